"""vLLM's rotary embedding on the fused op: `_C.rotary_embedding` (in place) and MRoPE.

vLLM keeps one `cos_sin_cache` [max_position, rot_dim]: the cos half, then the sin half, each one entry per pair.
Its two halves are views that the op gathers by `positions` (the op's cache form), so nothing is copied. q and k
are flat [T, H * D] or [T, H, D]; a cache narrower than the head (rot_dim < head_size) rotates the first rot_dim
lanes of each head (partial rotary). The serving signature `(positions, query, key, head_size, cos_sin_cache,
is_neox)`, which SGLang and FlashInfer share, rotates in place: eagerly, the in-place form of the op's kernel
(ops/slice_write.py's device planners) writes into query and key themselves, one launch and no copy, and reads and
writes only the rotated lanes of each head (a partial rotation's tail and the lanes before `rope_dim_offset` are
query's and key's own already).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..ops import slice_write
from ..ops.kv_cache_api import apply_rotary_qk_kv_cache
from ..ops.optional_backends import load_backends
from ..ops.public_functions import apply_rotary, apply_rotary_qk
from ..ops.schema import RotaryCall, RotaryParams, check_call
from .arguments import caller_names
from .direct import Plans, call_key


def _heads(t: torch.Tensor, num_tokens: int, head_size: int) -> torch.Tensor:
    """[T, H * D] or [T, H, D] as [T, H, D] (a view where the strides allow, as vLLM's `view`)."""
    if t.numel() % (num_tokens * head_size):
        raise ValueError(f"a tensor of shape {tuple(t.shape)} does not split into {num_tokens} tokens of heads of "
                         f"{head_size}")
    return t.reshape(num_tokens, -1, head_size)


def _rotate(query: torch.Tensor, key: torch.Tensor | None, head_size: int, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor | None, is_neox: bool, rotary_offset: int = 0, conjugate: bool = False) -> tuple:
    num_tokens = cos.shape[0] if positions is None else positions.shape[0]
    rot = dict(interleaved=not is_neox, rotary_dim=2 * cos.shape[-1], rotary_offset=rotary_offset,
               conjugate=conjugate)
    table = (cos[:, None], sin[:, None]) if positions is None else (cos, sin)
    pos = None if positions is None else positions[:, None]
    q = _heads(query, num_tokens, head_size)
    if key is None:
        return apply_rotary(q, *table, positions=pos, **rot), None
    return apply_rotary_qk(q, _heads(key, num_tokens, head_size), *table, positions=pos, **rot)


def _check_cache(cos_sin_cache: torch.Tensor, head_size: int, rope_dim_offset: int = 0) -> None:
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] % 2 or \
            not 0 <= rope_dim_offset <= head_size - cos_sin_cache.shape[-1]:
        raise ValueError(f"cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= head_size="
                         f"{head_size} - rope_dim_offset={rope_dim_offset}, got {tuple(cos_sin_cache.shape)}")


_IN_PLACE = Plans("vllm_rotary_embedding")  # rotary_embedding's call geometries -> their in-place runners


def _plan_in_place(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                   cos_sin_cache: torch.Tensor, params: RotaryParams) -> Callable[..., None]:
    """The in-place runner of a checked call geometry: the device's in-place kernel writing the rotation into
    query's and key's own memory (one launch for both), where their [T, H, D] views exist and the kernel takes
    them; else the rotation computed apart and copied in."""
    tokens = positions.numel()
    if key is not None and key.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} and key {key.dtype}: both are rotated in place, in one dtype")
    heads = (tokens, -1, head_size)
    try:
        xs = [t.view(heads) for t in (query, key) if t is not None]
        rows = positions.view(tokens, 1)
    except RuntimeError:  # strides that no [T, H, D] view has: computed apart, then copied in
        return _copied_in(head_size, params)
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    call = RotaryCall(xs, cos, sin, params, rows)
    check_call(call)
    load_backends()  # the device kernels register on import
    kernel = slice_write.IN_PLACE_KERNELS.get(query.device.type)
    runner = kernel.plan(call) if kernel is not None and kernel.plan is not None else None
    if runner is None:
        return _copied_in(head_size, params)

    def run(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, cache: torch.Tensor) -> None:
        xs = [query.view(heads)] if key is None else [query.view(heads), key.view(heads)]
        cos, sin = cache.chunk(2, dim=-1)
        runner(xs, cos, sin, positions.view(tokens, 1), None)
    return run


def _copied_in(head_size: int, params: RotaryParams) -> Callable[..., None]:
    """A runner that rotates into new tensors and copies them into query and key (one more write of each): where
    the kernel cannot write them in place, and on devices without an in-place kernel (the CPU)."""
    def run(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, cache: torch.Tensor) -> None:
        cos, sin = cache.chunk(2, dim=-1)
        q_out, k_out = _rotate(query, key, head_size, cos, sin, positions.reshape(-1), not params.interleaved,
                               params.rotary_offset, params.conjugate)
        query.copy_(q_out.view(query.shape))
        if key is not None:
            key.copy_(k_out.view(key.shape))
    return run


@caller_names(x="query", q="query", k="key", cos="cos_sin_cache", sin="cos_sin_cache")
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool, rope_dim_offset: int = 0,
                     inverse: bool = False, *, value: torch.Tensor | None = None,
                     k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None, kv_cache_dtype: str = "auto",
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     kv_layout: str = "NHD") -> None:
    """vLLM's `ops.rotary_embedding` (its `_C.rotary_embedding`): rotates query and key in place; key may be None
    (cross-layer KV sharing).

    positions: [T] (or [B, S], flattened as vLLM does); query [T, H * D] or [T, H, D], key the same with its own
    head count (GQA); cos_sin_cache [max_position, rot_dim] (cos half, then sin half, fp32 or the activations'
    dtype) with rot_dim <= head_size; rot_dim < head_size rotates the first rot_dim lanes of each head (partial
    rotary), or those from `rope_dim_offset` on (DeepSeek's rope lanes after its nope lanes); `inverse` rotates by
    minus the angle. Eagerly on CUDA, the kernel reads each token's cache row by its position and writes the
    rotation into query's and key's own memory: one launch, nothing copied; a call geometry is checked and planned
    once. Traced (torch.compile, make_fx), the rotation is the op's result copied in, which functionalization
    turns back into an in-place write.

    With value, k_cache, v_cache and slot_mapping, the rotation and vLLM's cache write are one call
    (`rope_fusion.apply_rotary_qk_kv_cache`, one launch on CUDA): query is rotated in place, key's rotation and value
    go into the caches at slot_mapping (reshape_and_cache_flash's semantics: a negative slot writes nothing), and key
    itself is left as it was (its rotation lives in k_cache, where attention reads it). The caches are vLLM's
    `[num_blocks, block_size, kv_heads, head_size]` (`kv_layout="NHD"`, any strides, as an HND-ordered cache viewed
    so) or `"HND"`; kv_cache_dtype "auto" writes them in their dtype, "fp8" / "fp8_e4m3" as float8 e4m3 (a uint8
    cache is viewed so) holding x / k_scale and v / v_scale."""
    if any(a is not None for a in (value, k_cache, v_cache, slot_mapping)):
        _rotate_into_cache(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset, inverse,
                           value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                           kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout)
        return
    scalars = (head_size, bool(is_neox), rope_dim_offset, bool(inverse))
    call_id = call_key((positions, query, key, cos_sin_cache), scalars)
    run = _IN_PLACE.get(call_id)
    if run is None:
        _check_cache(cos_sin_cache, head_size, rope_dim_offset)
        params = RotaryParams(interleaved=not is_neox, rotary_dim=cos_sin_cache.shape[-1], full_tables=False,
                              conjugate=bool(inverse), out_dtype=query.dtype, rotary_offset=rope_dim_offset)
        if call_id is None:  # traced, or autograd to record: the op's result, copied in
            _copied_in(head_size, params)(positions.flatten(), query, key, cos_sin_cache)
            return
        run = _IN_PLACE.put(call_id, _plan_in_place(positions, query, key, head_size, cos_sin_cache, params))
    run(positions, query, key, cos_sin_cache)


def _rotate_into_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                       cos_sin_cache: torch.Tensor, is_neox: bool, rope_dim_offset: int, inverse: bool, *,
                       value: torch.Tensor | None, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                       slot_mapping: torch.Tensor | None, kv_cache_dtype: str, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, kv_layout: str) -> None:
    """rotary_embedding with its cache write: query rotated in place, key's rotation and value into the caches."""
    if any(a is None for a in (value, k_cache, v_cache, slot_mapping)) or key is None:
        raise ValueError("a cache write takes key, value, k_cache, v_cache and slot_mapping together")
    _check_cache(cos_sin_cache, head_size, rope_dim_offset)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        k_cache, v_cache = (c.view(torch.float8_e4m3fn) if c.dtype == torch.uint8 else c for c in (k_cache, v_cache))
    elif kv_cache_dtype == "auto":
        k_scale = v_scale = None  # vLLM passes its layers' scales either way; only an FP8 cache reads them
    else:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: the fused cache write takes 'auto', 'fp8' and "
                         "'fp8_e4m3'")
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    q = apply_rotary_qk_kv_cache(
        _heads(query, num_tokens, head_size), _heads(key, num_tokens, head_size),
        _heads(value, num_tokens, head_size), cos, sin, k_cache, v_cache, slot_mapping, positions=positions,
        interleaved=not is_neox, rotary_dim=2 * cos.shape[-1], rotary_offset=rope_dim_offset, conjugate=bool(inverse),
        k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout)
    query.copy_(q.view(query.shape))


def _mrope_tables(cache: torch.Tensor, positions: torch.Tensor, mrope_section: Sequence[int],
                  interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token tables of MRoPE: pair j reads the row of the position stream (T, H or W) that owns it.

    Chunked layout (Qwen2-VL): the first mrope_section[0] pairs read stream 0, the next mrope_section[1] stream
    1, the rest stream 2. Interleaved layout (Qwen3-VL): pair j reads stream j % 3 while that stream has pairs
    left (j < 3 * mrope_section[1] for H, 3 * mrope_section[2] for W), stream 0 otherwise."""
    half = cache.shape[-1] // 2
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to rot_dim / 2 = {half}")
    lanes = torch.arange(half, device=cache.device)
    if interleaved:
        stream = torch.zeros(half, dtype=torch.long, device=cache.device)
        stream = torch.where((lanes % 3 == 1) & (lanes < 3 * mrope_section[1]), 1, stream)
        stream = torch.where((lanes % 3 == 2) & (lanes < 3 * mrope_section[2]), 2, stream)
    else:
        stream = torch.repeat_interleave(torch.arange(len(mrope_section), device=cache.device),
                                         torch.tensor(list(mrope_section), device=cache.device))
    rows = positions[stream]  # [half, T]: the position each pair reads
    cos = cache[:, :half][rows.T, lanes]  # [T, half]
    sin = cache[:, half:][rows.T, lanes]
    return cos, sin


@caller_names(x="query", q="query", k="key", cos="cos_sin_cache", sin="cos_sin_cache")
def mrope_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                           cos_sin_cache: torch.Tensor, is_neox: bool, mrope_section: Sequence[int] | None = None,
                           mrope_interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `MRotaryEmbedding.forward_native`: returns the rotated (query, key) in their input shapes.

    positions [T]: plain RoPE; [3, T]: the T/H/W position streams, pairs assigned to streams by mrope_section."""
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] % 2 or cos_sin_cache.shape[-1] > head_size:
        raise ValueError(f"cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= head_size="
                         f"{head_size}, got {tuple(cos_sin_cache.shape)}")
    if positions.dim() == 1:
        cos, sin = cos_sin_cache.chunk(2, dim=-1)
        q, k = _rotate(query, key, head_size, cos, sin, positions, is_neox)
    elif positions.dim() == 2 and positions.shape[0] == 3:
        if not mrope_section:
            raise ValueError("positions of shape [3, T] need mrope_section")
        cos, sin = _mrope_tables(cos_sin_cache, positions, mrope_section, mrope_interleaved)
        q, k = _rotate(query, key, head_size, cos, sin, None, is_neox)
    else:
        raise ValueError(f"positions must be [T] or [3, T], got {tuple(positions.shape)}")
    return q.reshape(query.shape), k.reshape(key.shape)
