"""Reference semantics of the cache ops (ops/kv_cache.py): plain PyTorch, the meaning every backend is tested against,
and the ops' implementation wherever no device kernel takes a call.

q and k are rotated by the rotary op's own reference; k's cached value is its rotation in the math dtype and v's is
v itself (normalised with `v_norm_weight` in the math dtype), each rounded once into its cache: to the cache's dtype,
or for an FP8 cache divided by its scale in fp32, saturated at +-448 and rounded to nearest even (`to_cache`).
"""

from __future__ import annotations

import dataclasses

import torch

from .kv_cache import FP8_CACHE_DTYPES, CacheCall, cache_geometry
from .packed import unpacked
from .reference import rms_norm, rotary_reference
from .schema import math_dtype

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value


def to_cache(values: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Values as a cache of `dtype` holds them: rounded once to it; for FP8, `values / scale` in fp32, saturated at
    the largest finite value (NaN stays NaN) and rounded to nearest even, as vLLM's FP8 cache writes store it. The
    saturation is explicit: torch's conversion has turned a value past 448 into NaN in some releases."""
    if dtype in FP8_CACHE_DTYPES:
        q = values.float() / (scale.float() if scale is not None else 1.0)
        return q.clamp(-E4M3_MAX, E4M3_MAX).to(dtype)
    return values.to(dtype)


def write_rows(cache: torch.Tensor, cc: CacheCall, values: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Write each token's rows (`values[t]`, `[heads, head_dim]`) into its slot of the cache: the tokens with a slot
    >= 0 among the first len(slot_mapping); a slot past the cache's blocks raises IndexError."""
    blocks, block_size, _, _ = cache_geometry(cc, cache, values)
    slots = cc.slot_mapping.to(torch.int64)
    tokens = (slots >= 0).nonzero().squeeze(1)
    slots = slots[tokens]
    if slots.numel() and int(slots.max()) >= blocks * block_size:
        raise IndexError(f"slot {int(slots.max())} is outside the cache's {blocks} blocks of {block_size} slots")
    cc.layout.write(cache, slots // block_size, slots % block_size, to_cache(values[tokens], cache.dtype, scale))


def reference(cc: CacheCall) -> torch.Tensor:
    """q rotated (`[T, Hq, Dq]`, out_dtype), after k rotated and v are written into their caches."""
    call = unpacked(cc.call)  # packed sequences: their positions
    params = call.params
    q_out = rotary_reference(call.xs[0], call.cos, call.sin, positions=call.positions, norm_weight=call.weight(0),
                             **params.of_tensor(0).kwargs())
    # k in the math dtype: fp64 holds the fp32 or fp64 result exactly, rounded once into the cache
    k_val = rotary_reference(call.xs[1], call.cos, call.sin, positions=call.positions, norm_weight=call.weight(1),
                             **dataclasses.replace(params.of_tensor(1), out_dtype=torch.float64).kwargs())
    v = cc.v
    if cc.v_norm_weight is not None:
        cd = math_dtype(call.xs, call.cos, call.sin, params.out_dtype)
        v = rms_norm(v.to(cd), "rms", params.norm_eps, cc.v_norm_weight)
    write_rows(cc.k_cache, cc, k_val, cc.k_scale)
    write_rows(cc.v_cache, cc, v, cc.v_scale)
    return q_out.contiguous()
