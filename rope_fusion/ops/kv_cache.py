"""The rotation of q and k with k (and v) written into a paged KV cache: `rope_fusion::rotary_qk_kv_cache` and
`rope_fusion::rotary_qk_mla_cache`.

At decode, a serving stack's RoPE and its KV-cache write are two launches that cost more than the bytes they move
(vLLM's `reshape_and_cache_flash` after the rotation; docs/design.md 4.6). These ops are both in one call: they
rotate q and k as `rotary_qk` does (every option of its schema: positions into a cos|sin cache, packed sequences,
partial and interleaved rotations, the QK-norm, a pass-through head on q alone for MLA's shared k), return q
rotated, and write k rotated and v into the cache slot of each token, `slot_mapping[t]`: slot s is slot
`s % block_size` of block `s // block_size`, a negative slot is a padding token that writes nothing, and so is every
token from `len(slot_mapping)` on (vLLM's cache writes launch one program per slot_mapping entry). Slots are
distinct, as vLLM's are: two tokens written into one slot leave either.

- `rotary_qk_kv_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, ...)`: one cache per tensor in a
  `kv_layout` of ops/cache_layouts.py (vLLM's flash layout NHD, HND, Ascend's NZ); q `[T, Hq, Dq]`, k `[T, Hk, Dk]`,
  v `[T, Hv, Dv]` (a 2-D tensor is one head), each cache holding its tensor's heads.
- `rotary_qk_mla_cache(q, k, v, cos, sin, kv_cache, slot_mapping, ...)`: MLA's one cache `[num_blocks, block_size,
  Dv + Dk]` whose entry is v (the latent c_kv) then k (the shared k_pe, one head), as vLLM's concat_and_cache_mla
  writes it; one `scale` for both.

A cache in the model's dtypes holds the values rounded once to its dtype; an FP8 (e4m3fn) cache holds `x / scale`
rounded to nearest even and saturated at +-448, as vLLM's FP8 cache writes store it (`k_scale`, `v_scale`: float32
tensors of one element; None is 1). k's cached value is its rotation in the math dtype, rounded once: vLLM's unfused
pair rounds it to the model dtype first. `v_norm_weight` RMS-normalises v over its head dim (eps `norm_eps`) and
scales it before it is cached, as MLA's kv_a_layernorm does to the latent (the `norm` option is q's and k's).

This module holds a call's arguments by role (`CacheCall`), the schemas, and the checks every implementation relies
on; ops/kv_cache_op.py defines the ops and dispatches them to a device kernel or the reference
(ops/kv_cache_reference.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .cache_layouts import CacheLayout, layout
from .schema import FLOAT_DTYPES, RotaryCall, RotaryParams, check_call, op_schema, optional_tensor_names

FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
CACHE_DTYPES = (*FLOAT_DTYPES, *FP8_CACHE_DTYPES)
SLOT_DTYPES = (torch.int32, torch.int64)

# each op's tensor arguments in schema order: the rotary op's q, k, tables and optional tensors, with v, the caches
# and the slot mapping after the tables, and the cache op's own optional tensors last
SEPARATE_TENSORS = ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slot_mapping", *optional_tensor_names(2),
                    "k_scale", "v_scale", "v_norm_weight")
JOINT_TENSORS = ("q", "k", "v", "cos", "sin", "kv_cache", "slot_mapping", *optional_tensor_names(2), "scale",
                 "v_norm_weight")


@dataclasses.dataclass
class CacheCall:
    """One call of a cache op, its arguments by role: the rotary call of q and k (3-D, `[T, H, D]`), v, the two
    caches (for MLA's one cache, its k and v parts as NHD views of one head), the slots and the cache options."""

    call: RotaryCall
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    layout: CacheLayout
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_norm_weight: torch.Tensor | None = None
    q_shape: tuple = ()  # q as the caller gave it: the shape of the result

    @property
    def q(self) -> torch.Tensor:
        return self.call.xs[0]

    @property
    def k(self) -> torch.Tensor:
        return self.call.xs[1]

    def caches(self) -> tuple:
        """(name, cache, the tensor it holds, its scale) for k and v."""
        return (("k_cache", self.k_cache, self.k, self.k_scale), ("v_cache", self.v_cache, self.v, self.v_scale))


def _heads(t: torch.Tensor) -> torch.Tensor:
    """`[T, D]` as one head, `[T, 1, D]`; any other rank as it is (the checks name it)."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def _schema(caches: str, own: str, options: str = "") -> str:
    """The rotary_qk schema with v, the caches and the slot mapping after the tables, `own` optional tensors after
    its optional ones, `options` after its keyword options, and q rotated as the result."""
    head, _ = op_schema(2).rsplit(") ->", 1)
    tensors, keywords = head.split(", *, ", 1)
    prefix = "(Tensor q, Tensor k, Tensor cos, Tensor sin"
    assert tensors.startswith(prefix), tensors
    tensors = f"(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, {caches}, Tensor slot_mapping" + \
        tensors[len(prefix):]
    return f"{tensors}, {own}, *, {keywords}{options}) -> Tensor"


SEPARATE_SCHEMA = _schema("Tensor(a!) k_cache, Tensor(b!) v_cache",
                          "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? v_norm_weight=None",
                          ', str kv_layout="NHD"')
JOINT_SCHEMA = _schema("Tensor(a!) kv_cache", "Tensor? scale=None, Tensor? v_norm_weight=None")


def _by_name(names: Sequence[str], args: Sequence[Any], kw: dict) -> tuple[dict, dict]:
    """(tensor arguments by name, the keyword options left)."""
    kw = dict(kw)
    got = dict(zip(names, args))
    got.update({n: kw.pop(n) for n in names if n in kw})
    return got, kw


def _rotary_call(got: dict, params: RotaryParams) -> RotaryCall:
    q, k = _heads(got["q"]), _heads(got["k"])
    positions = got.get("positions")
    if positions is not None and positions.dim() == 1:  # one position per token of [T, H, D]: [T, 1]
        positions = positions[:, None]
    weights = [got.get("q_norm_weight"), got.get("k_norm_weight")]
    return RotaryCall([q, k], got["cos"], got["sin"], params, positions,
                      weights if any(w is not None for w in weights) else None, got.get("cu_seqlens"),
                      got.get("seqlen_offsets"))


def parse_separate(args: Sequence[Any], kw: dict) -> CacheCall:
    got, kw = _by_name(SEPARATE_TENSORS, args, kw)
    kv_layout = layout(kw.pop("kv_layout", "NHD"))
    return CacheCall(_rotary_call(got, RotaryParams(**kw)), _heads(got["v"]), got["k_cache"], got["v_cache"],
                     got["slot_mapping"], kv_layout, got.get("k_scale"), got.get("v_scale"), got.get("v_norm_weight"),
                     tuple(got["q"].shape))


def parse_joint(args: Sequence[Any], kw: dict) -> CacheCall:
    """MLA's one cache as two NHD views of one head: v's lanes first, then k's (concat_and_cache_mla's entry)."""
    got, kw = _by_name(JOINT_TENSORS, args, kw)
    kv, v, k = got["kv_cache"], _heads(got["v"]), _heads(got["k"])
    if kv.dim() != 3 or kv.shape[-1] != v.shape[-1] + k.shape[-1]:
        raise ValueError(f"kv_cache must be MLA's [num_blocks, block_size, {v.shape[-1]} + {k.shape[-1]}] (v's lanes, "
                         f"then k's), got shape {tuple(kv.shape)}")
    dv = v.shape[-1]
    scale = got.get("scale")
    return CacheCall(_rotary_call(got, RotaryParams(**kw)), v, kv[..., dv:].unsqueeze(2), kv[..., :dv].unsqueeze(2),
                     got["slot_mapping"], layout("NHD"), scale, scale, got.get("v_norm_weight"), tuple(got["q"].shape))


def _require(ok: Any, message: str) -> None:
    """A ValueError where a check fails; on symbolic sizes (a traced token count) one decided without a guard where
    it can be, else left to torch's check of the traced graph, as the rotary op's broadcasts are."""
    if isinstance(ok, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        if statically_known_true(ok):
            return
        if statically_known_true(torch.sym_not(ok)):
            raise ValueError(message)
        torch._check(ok, lambda: message)
    elif not ok:
        raise ValueError(message)


def check(cc: CacheCall) -> None:
    """Raise ValueError naming the offending argument: the tensors' ranks, the rotary op's checks on q and k, then
    v, the slots, the caches and their options."""
    q, k, v = cc.q, cc.k, cc.v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim] (or [tokens, head_dim], one head), got shape "
                             f"{tuple(t.shape)}")
    check_call(cc.call)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.shape[0] == q.shape[0], f"q, k and v hold one row per token: {name} {tuple(t.shape)}, q "
                                           f"{tuple(q.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} on {t.device}, q on {q.device}: all tensors must be on one device")
    if v.dtype != k.dtype:
        raise ValueError(f"v is {v.dtype} and k is {k.dtype}: they must share a dtype")
    s = cc.slot_mapping
    if s.dtype not in SLOT_DTYPES or s.dim() != 1 or s.device != q.device:
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor on {q.device}, one slot per token, got "
                         f"{tuple(s.shape)} {s.dtype} on {s.device}")
    _require(s.shape[0] <= q.shape[0], f"slot_mapping holds {s.shape[0]} slots for {q.shape[0]} tokens")
    _check_caches(cc)
    w = cc.v_norm_weight
    if w is not None and (w.device != q.device or w.dim() > 2 or w.shape[-1] != v.shape[-1]
                          or w.dim() == 2 and w.shape[0] not in (1, v.shape[1])):
        raise ValueError(f"v_norm_weight of shape {tuple(w.shape)} must be [{v.shape[-1]}] or [heads, {v.shape[-1]}] "
                         f"on {q.device} (v {tuple(v.shape)})")


def cache_geometry(cc: CacheCall, cache: torch.Tensor, held: torch.Tensor) -> tuple:
    """(num_blocks, block_size, heads, head_dim) of a cache holding `held`'s heads; ValueError where its layout does
    not hold them."""
    geometry = cc.layout.geometry(cache, held.shape[-1])
    if isinstance(geometry, str):
        raise ValueError(f"a {cc.layout.name} cache {cc.layout.dims}: {geometry}")
    return geometry


def _check_caches(cc: CacheCall) -> None:
    blocks = []
    for name, cache, held, scale in cc.caches():
        if cache.dtype not in CACHE_DTYPES:
            hint = " (an FP8 cache kept as bytes: pass cache.view(torch.float8_e4m3fn))" \
                if cache.dtype == torch.uint8 else ""
            raise ValueError(f"{name} is {cache.dtype}; expected one of {CACHE_DTYPES}{hint}")
        if cache.device != held.device:
            raise ValueError(f"{name} on {cache.device}, q on {held.device}: all tensors must be on one device")
        nb, bs, heads, dim = cache_geometry(cc, cache, held)
        tensor = name[0]
        message = (f"{name} of shape {tuple(cache.shape)} ({cc.layout.name}: {heads} heads of {dim}) does not hold "
                   f"{tensor}'s {held.shape[1]} heads of {held.shape[2]}")
        _require(heads == held.shape[1], message)
        _require(dim == held.shape[2], message)
        blocks.append((nb, bs))
        if cache.dtype in FP8_CACHE_DTYPES:
            if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32
                                      or scale.device != held.device):
                raise ValueError(f"{tensor}_scale must be a float32 tensor of one element on {held.device} (the FP8 "
                                 f"cache holds x / scale), got {tuple(scale.shape)} {scale.dtype} on {scale.device}")
        elif scale is not None:
            raise ValueError(f"{tensor}_scale given for a {cache.dtype} {name}: a scale applies to an FP8 cache only")
    message = f"k_cache and v_cache must share (num_blocks, block_size), one slot addressing both: got {blocks}"
    for k_size, v_size in zip(*blocks):
        _require(k_size == v_size, message)
