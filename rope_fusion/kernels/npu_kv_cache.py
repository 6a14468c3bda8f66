"""The KV-cache op on Ascend: `rope_fusion::rotary_qk_kv_cache` as torch_npu's fused RoPE + cache ops, where their
documented constraints hold (ops/kv_cache.py has the op's meaning).

- `torch.ops.npu.npu_qkv_rms_norm_rope_cache(qkv, q_gamma, k_gamma, cos, sin, index, q_out, k_cache, v_cache,
  qkv_size, head_nums, *, ..., epsilon, cache_mode="PA_NZ")`: q, k and v packed as one `[T, (Nq + Nk + Nv) * D]`
  tensor; q and k RMS-normalised (their gammas) and rotated NeoX-style by full-width `[T, D]` tables, k and v
  scattered at `index` (-1 skips) into FRACTAL_NZ pages `[blocks, Nk * D // 16, block_size, 16]`, q written into
  q_out. It serves the op's calls with the per-head QK-norm (`norm="rms"`, weights per lane), whole NeoX rotation of
  D = 128 lanes, Nk = Nv, one fp16/bf16 dtype for q, k, v, tables, output and caches, and `kv_layout="NZ"`.
- `torch.ops.npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, ..., epsilon,
  cache_mode)`: MLA's latent and k_pe packed as `kv [B, 1, S, 512 + 64]`; the latent RMS-normalised by gamma, k_pe's
  interleaved pairs rotated and written in NeoX order (full-width tables indexed by output lane), each scattered at
  `index` (a negative one skips) into its own cache, `[blocks, block_size, 1, D]` (`PA_BNSD`) or FRACTAL_NZ
  (`PA_NZ`). It serves the op's MLA calls with separate caches: one k head of 64 lanes rotated whole as
  interleaved pairs with a de-interleaved result, one v head of 512 lanes normalised (`v_norm_weight`, eps
  `norm_eps`), no norm of k, one fp16/bf16 dtype, NHD or NZ caches. q is rotated by the op's own `rotary` (on an
  NPU, torch_npu's RoPE ops through kernels/npu.py).

q, k and v that are views of one projection's output in that order (vLLM's `qkv.split(...)`, MLA's
`kv_a_proj_with_mqa` output split into latent and k_pe) are passed as that tensor; others are concatenated first.
Tables are gathered per token first (positions, packed sequences) and must already be in the tensors' dtype, as the
ops take them: a cast would round them, beyond the op's numerics. Every other call runs the reference (torch ops on
the NPU), logged once per kind of case. torch_npu needs the CANN runtime, so nothing here imports it: the ops are
looked up in `OP_NAMESPACE` when called, and the tests put stand-ins with the real schemas and the documented
semantics there. This path is verified against those stand-ins, not on Ascend hardware.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Any

import torch

from ..ops.kv_cache import CacheCall, cache_geometry
from ..ops.kv_cache_op import CACHE_KERNELS
from ..ops.op_definition import ROTARY
from ..ops.packed import unpacked
from ..ops.reference import gather_rows

log = logging.getLogger("rope_fusion")

OP_NAMESPACE = "npu"
"""Where torch_npu's fused cache ops are looked up (torch.ops.<namespace>.<op>)."""

NPU_DTYPES = (torch.float16, torch.bfloat16)
QKV_HEAD_DIM = 128  # npu_qkv_rms_norm_rope_cache: D = 128 only
MLA_ROPE, MLA_LATENT = 64, 512  # npu_kv_rmsnorm_rope_cache: rope_size 64, rms_size 512
NZ_RUN = 16  # FRACTAL_NZ's run of a 16-bit cache

stats: collections.Counter = collections.Counter()
"""Calls per path: 'qkv_rms_norm_rope_cache', 'kv_rmsnorm_rope_cache', 'reference' (tests and debugging)."""


def _ops() -> Any:
    return getattr(torch.ops, OP_NAMESPACE)


def _same_dtype(cc: CacheCall, *more: torch.Tensor) -> str | None:
    dtype = cc.k.dtype
    tensors = (cc.k, cc.v, cc.k_cache, cc.v_cache, cc.call.cos, cc.call.sin, *more)
    if dtype not in NPU_DTYPES or any(t.dtype != dtype for t in tensors):
        return "one fp16/bf16 dtype for k, v, the tables and the caches"
    return None


def why_not_qkv(cc: CacheCall) -> str | None:
    """None where npu_qkv_rms_norm_rope_cache's documented constraints hold for the call, else the first that fails."""
    p = cc.call.params
    if cc.layout.name != "NZ":
        return "kv_layout='NZ' (its only cache mode is PA_NZ)"
    extra = p.unhandled(("interleaved", "rotary_dim", "full_tables", "conjugate", "out_dtype", "norm", "norm_eps"))
    if extra:
        return f"no {', '.join(extra)}"
    if p.norm != "rms":
        return "the per-head QK-norm (norm='rms')"
    if p.interleaved:
        return "NeoX pairs"
    if not (cc.q.shape[-1] == cc.k.shape[-1] == cc.v.shape[-1] == p.rotary_dim == QKV_HEAD_DIM):
        return f"head dims of {QKV_HEAD_DIM}, rotated whole"
    if cc.k.shape[1] != cc.v.shape[1] or cc.v_norm_weight is not None:
        return "as many v heads as k heads, v not normalised"
    if cc.q.dtype != cc.k.dtype or p.out_dtype != cc.q.dtype or cc.k_scale is not None or cc.v_scale is not None:
        return "q, k and the result of one dtype, caches unquantised"
    if any(w is not None and (w.dim() != 1 or w.dtype != cc.q.dtype) for w in (cc.call.norm_weights or ())):
        return "one norm weight per lane, in the tensors' dtype"
    if cache_geometry(cc, cc.k_cache, cc.k)[1] % NZ_RUN:
        return f"a block size that is a multiple of {NZ_RUN}"
    return _same_dtype(cc) or _per_token(cc)


def why_not_kv(cc: CacheCall) -> str | None:
    """None where npu_kv_rmsnorm_rope_cache's documented constraints hold for the call, else the first that fails."""
    p, pk = cc.call.params, cc.call.params.of_tensor(1)
    if cc.layout.name not in ("NHD", "NZ") or cc.k_cache.storage_offset() or cc.v_cache.storage_offset() or not (
            cc.k_cache.is_contiguous() and cc.v_cache.is_contiguous()):
        return "caches of their own, contiguous NHD (PA_BNSD) or NZ (PA_NZ)"
    if cc.k.shape[1:] != (1, MLA_ROPE) or cc.v.shape[1:] != (1, MLA_LATENT):
        return f"MLA's one k head of {MLA_ROPE} lanes and one latent head of {MLA_LATENT}"
    if cc.v_norm_weight is None or cc.v_norm_weight.numel() != MLA_LATENT or p.norm != "none":
        return "the latent normalised by one weight per lane (v_norm_weight), k not normalised"
    if not (pk.interleaved and pk.deinterleave and pk.rotary_dim == MLA_ROPE and not pk.rotary_offset
            and not pk.angle_tables) or cc.k_scale is not None:
        return "k's interleaved pairs rotated whole and written in NeoX order (deinterleave), caches unquantised"
    return _same_dtype(cc, cc.v_norm_weight) or _per_token(cc)


def _per_token(cc: CacheCall) -> str | None:
    """Tables of one row per token, the same for every head (the ops take `[T, D]` rows)."""
    call, heads = cc.call, cc.k.shape[1]
    if heads == 1:
        return None
    if call.positions is not None or call.cu_seqlens is not None:
        return None if call.positions is None or call.positions.shape[-1] == 1 else "one position per token"
    shape = (cc.q.shape[0], heads, call.cos.shape[-1])
    if any(torch.broadcast_to(t, shape).stride(1) != 0 for t in (call.cos, call.sin)):
        return "tables that are the same for every head"
    return None


def _token_tables(cc: CacheCall, full_width: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as one full-width row per token, `[T, rotary_dim]`: gathered by the positions (packed sequences:
    theirs), the same for every head (`_per_token`), a per-pair table's halves repeated ([c, c]: NeoX order), sin
    negated for the conjugate."""
    call = unpacked(cc.call)
    T = cc.q.shape[0]
    rows = []
    for t in (call.cos, call.sin):
        if call.positions is not None:
            t = gather_rows(t, call.positions)
        t = torch.broadcast_to(t, (T, cc.k.shape[1], t.shape[-1]))[:, 0]
        if full_width and not call.params.full_tables:
            t = torch.cat((t, t), dim=-1)
        rows.append(t)
    cos, sin = rows
    return cos.contiguous(), (-sin if call.params.conjugate else sin).contiguous()


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """`[T, sum of heads x lanes]`: the parts as the one tensor they are views of, in order, where they are (no copy);
    else concatenated."""
    T = parts[0].shape[0]
    widths = [p.shape[1] * p.shape[2] for p in parts]
    total = sum(widths)
    base = parts[0]
    offset = base.storage_offset()
    joined = True
    for p, before in zip(parts, [0, *itertools.accumulate(widths)]):
        joined = joined and (p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                             and p.storage_offset() == offset + before
                             and (T == 1 or p.stride(0) == total) and p.stride(2) == 1
                             and (p.shape[1] == 1 or p.stride(1) == p.shape[2]))
    if joined:
        return base.as_strided((T, total), (total, 1), offset)
    return torch.cat([p.reshape(T, -1) for p in parts], dim=1)


def _index(cc: CacheCall) -> torch.Tensor:
    """The slots as the ops take them: int64, one per token (-1 for the tokens past slot_mapping)."""
    slots = cc.slot_mapping.to(torch.int64)
    short = cc.q.shape[0] - slots.shape[0]
    return torch.cat((slots, slots.new_full((short,), -1))) if short else slots


def qkv_rms_norm_rope_cache(cc: CacheCall) -> torch.Tensor:
    """q rotated ([T, Nq, D]) by one npu_qkv_rms_norm_rope_cache, which writes k and v into their NZ caches."""
    q, k, v = cc.q, cc.k, cc.v
    T, D = q.shape[0], q.shape[-1]
    cos, sin = _token_tables(cc, full_width=True)
    weights = cc.call.norm_weights or [None, None]
    gammas = [w if w is not None else torch.ones(D, dtype=q.dtype, device=q.device) for w in weights]
    q_out = torch.empty(T, q.shape[1] * D, dtype=q.dtype, device=q.device)
    heads = [q.shape[1], k.shape[1], v.shape[1]]
    _ops().npu_qkv_rms_norm_rope_cache(_packed([q, k, v]), *gammas, cos, sin, _index(cc), q_out, cc.k_cache,
                                       cc.v_cache, [T, 1, sum(heads), D], heads, epsilon=cc.call.params.norm_eps,
                                       cache_mode="PA_NZ")
    stats["qkv_rms_norm_rope_cache"] += 1
    return q_out.view(q.shape)


def kv_rmsnorm_rope_cache(cc: CacheCall) -> torch.Tensor:
    """q rotated by the op's own `rotary`; k_pe rotated and the latent normalised into their caches by one
    npu_kv_rmsnorm_rope_cache."""
    call = cc.call
    T = cc.q.shape[0]
    cos, sin = _token_tables(cc, full_width=True)
    blocks, block_size, _, _ = cache_geometry(cc, cc.k_cache, cc.k)
    k_cache, v_cache = (c.view(blocks, block_size, 1, -1) for c in (cc.k_cache, cc.v_cache))  # NZ: the ops' shape
    kv = _packed([cc.v, cc.k]).view(T, 1, 1, MLA_LATENT + MLA_ROPE)
    _ops().npu_kv_rmsnorm_rope_cache(kv, cc.v_norm_weight.reshape(-1), cos.view(T, 1, 1, -1), sin.view(T, 1, 1, -1),
                                     _index(cc), k_cache, v_cache, epsilon=call.params.norm_eps,
                                     cache_mode="PA_BNSD" if cc.layout.name == "NHD" else "PA_NZ")
    stats["kv_rmsnorm_rope_cache"] += 1
    q_params = call.params.of_tensor(0)
    return ROTARY(cc.q, call.cos, call.sin, call.positions, call.weight(0), call.cu_seqlens, call.seqlen_offsets,
                  **q_params.kwargs())


_LOGGED: set = set()


def serve(cc: CacheCall) -> torch.Tensor | None:
    """The call through the torch_npu op whose constraints hold, or None (the reference runs; logged once a kind)."""
    reasons = {}
    for name, why_not, run in (("npu_qkv_rms_norm_rope_cache", why_not_qkv, qkv_rms_norm_rope_cache),
                               ("npu_kv_rmsnorm_rope_cache", why_not_kv, kv_rmsnorm_rope_cache)):
        reasons[name] = why_not(cc)
        if reasons[name] is None:
            return run(cc)
    stats["reference"] += 1
    what = "; ".join(f"{n} needs {r}" for n, r in reasons.items())
    if what not in _LOGGED:
        _LOGGED.add(what)
        log.warning("rope_fusion: no torch_npu cache op takes this KV-cache call (%s); the reference runs it (logged "
                    "once)", what)
    return None


if torch._C._get_privateuse1_backend_name() == "npu":  # torch_npu is loaded: serve the cache ops on its devices
    CACHE_KERNELS.register("npu", serve)
