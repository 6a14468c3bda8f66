"""The public function of the cache ops: `rope_fusion.apply_rotary_qk_kv_cache`.

It takes every keyword `apply_rotary_qk` takes (the same schema fields, ops/public_functions.py
`option_parameters`) and the cache's own (`CACHE_KEYWORDS`). Eagerly, a call whose geometry was checked before goes
straight to its device's kernel (ops/kv_cache_op.py `run`); with autograd to record, under tracing or a dispatch
mode it calls the op, so torch.compile sees `rope_fusion::rotary_qk_kv_cache` (or `rotary_qk_mla_cache`) and
writes the caches in place.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .kv_cache import check, parse_joint, parse_separate
from .kv_cache_op import CACHE_KERNELS, KV_CACHE_OP, MLA_CACHE_OP, planned_runner, run
from .public_functions import direct_key, option_parameters, rotary_call

# the cache's keywords and their defaults, after the rotary ones
CACHE_KEYWORDS: dict[str, Any] = {"k_scale": None, "v_scale": None, "v_norm_weight": None, "kv_layout": "NHD"}
_CACHE_DOCS = {
    "k_scale": "float32 tensor of one element: an FP8 k cache holds k / k_scale (None: 1). With MLA's one cache "
               "(v_cache=None), the scale of both.",
    "v_scale": "float32 tensor of one element: an FP8 v cache holds v / v_scale (None: 1).",
    "v_norm_weight": "RMS-normalise v over its head dim (eps norm_eps) and scale it by this weight before caching "
                     "(MLA's kv_a_layernorm on the latent); the `norm` option is q's and k's.",
    "kv_layout": "'NHD' [num_blocks, block_size, kv_heads, head_dim] (vLLM's flash layout), 'HND' [num_blocks, "
                 "kv_heads, block_size, head_dim], or 'NZ' (Ascend's FRACTAL_NZ pages, ops/cache_layouts.py).",
}
_TENSORS = ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slot_mapping")
_KEYWORDS = frozenset(p.name for p in option_parameters(2)) | frozenset(CACHE_KEYWORDS)
_RUNNERS = CACHE_KERNELS.plan_cache("kv_cache.direct")  # the direct keys of checked calls -> planned runner, or False


def _op_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor | None, slot_mapping: torch.Tensor,
             options: dict) -> tuple:
    """(op, parser, positional arguments, keyword arguments) of a public call: the separate caches' op, or MLA's one
    cache's where v_cache is None."""
    options = dict(options)
    cache = {n: options.pop(n, d) for n, d in CACHE_KEYWORDS.items()}
    call = rotary_call((q, k), cos, sin, options)
    weights = call.norm_weights or [None, None]
    rest = (call.positions, *weights, call.cu_seqlens, call.seqlen_offsets)
    head = (q, k, v, call.cos, call.sin)
    if v_cache is not None:
        return (KV_CACHE_OP, parse_separate,
                (*head, k_cache, v_cache, slot_mapping, *rest, cache["k_scale"], cache["v_scale"],
                 cache["v_norm_weight"]), {**call.params.kwargs(), "kv_layout": cache["kv_layout"]})
    if cache["v_scale"] is not None and cache["v_scale"] is not cache["k_scale"]:
        raise ValueError("MLA's one cache (v_cache=None) has one scale: pass it as k_scale")
    if cache["kv_layout"] != "NHD":
        raise ValueError(f"kv_layout={cache['kv_layout']!r}: MLA's one cache (v_cache=None) is [num_blocks, "
                         "block_size, v_dim + k_dim], a layout of its own")
    return (MLA_CACHE_OP, parse_joint, (*head, k_cache, slot_mapping, *rest, cache["k_scale"], cache["v_norm_weight"]),
            call.params.kwargs())


def apply_rotary_qk_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                             slot_mapping: torch.Tensor, **options: Any) -> torch.Tensor:
    # the docstring and signature are set below, from the schema
    key = direct_key((q, k, v, k_cache, slot_mapping), cos, sin, {**options, "v_cache": v_cache})
    if key is None or key not in _RUNNERS:
        if not _KEYWORDS.issuperset(options):
            raise TypeError(f"unknown option(s) {sorted(set(options) - _KEYWORDS)}; expected {sorted(_KEYWORDS)}")
    op, parse, args, kw = _op_call(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, options)
    if key is None:  # traced, fake, a subclass, autograd: the op runs (and checks) this call
        return op(*args, **kw)
    cc = parse(args, kw)
    runner = _RUNNERS.get(key)  # False: checked, and its calls go to the kernel as they come
    if runner is None:
        check(cc)
        runner = _RUNNERS.put(key, planned_runner(cc) or False)
    return runner(cc).view(cc.q_shape) if runner else run(cc)


def _signature() -> inspect.Signature:
    tensors = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 annotation=torch.Tensor | None if n == "v_cache" else torch.Tensor) for n in _TENSORS]
    cache = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d,
                               annotation=str if n == "kv_layout" else torch.Tensor | None)
             for n, d in CACHE_KEYWORDS.items()]
    return inspect.Signature([*tensors, *option_parameters(2), *cache], return_annotation=torch.Tensor)


apply_rotary_qk_kv_cache.__signature__ = _signature()
apply_rotary_qk_kv_cache.__doc__ = """Rotate q and k by shared tables, write k rotated and v into a paged KV cache, and
return q rotated: RoPE and the cache write in one call (one launch on CUDA).

q [T, Hq, Dq], k [T, Hk, Dk], v [T, Hv, Dv] (a 2-D tensor is one head). Token t's k and v go to slot
s = slot_mapping[t] of the caches: slot s % block_size of block s // block_size; a negative slot (vLLM's padding
token) writes nothing, and neither does a token from len(slot_mapping) on. Caches in a float dtype hold the values
rounded once; a float8_e4m3fn cache holds x / scale, saturated at +-448 and rounded to nearest even (vLLM's FP8
cache). v_cache=None: k_cache is MLA's one cache [num_blocks, block_size, Dv + Dk], each entry v (the latent c_kv)
then k (the shared k_pe), as vLLM's concat_and_cache_mla writes it.

Rotary options: every keyword of `apply_rotary_qk` (positions, a [T] tensor meaning [T, 1]; cu_seqlens; norm and its
weights; interleaved; rotary_dim; rotary_offset with offset_q_only for MLA's q; ...). Cache options:
""" + "\n".join(f"    {n}={d!r}: {_CACHE_DOCS[n]}" for n, d in CACHE_KEYWORDS.items()) + """

Raises ValueError naming the argument for bad shapes, dtypes, devices or layouts, TypeError for an unknown option,
IndexError (eagerly) or a device-side assert (on CUDA) for a slot past the cache. Not differentiable."""
