"""`rope_fusion::rotary_qk_into_layer_cache`: the rotation of q and k and vLLM's KV-cache write of one attention layer
in one op, which the KV-cache fold (passes/folds/kv_cache_fold.py) puts where vLLM's graph has the rotation and
`vllm::unified_kv_cache_update(k, v, layer_name)`.

Like vLLM's op, it finds the layer's cache and slots at run time in vLLM's forward context (the layer is
`no_compile_layers[layer_name]`, its cache `layer.kv_cache`, its slots `slot_mapping[layer_name]`), since the graph
is compiled once and run for every step's cache. Where the layer's attention backend has a record in
ops/layer_caches.py, one call of `rope_fusion::rotary_qk_kv_cache` rotates q and k and writes k rotated and v into
that record's views of the cache (one launch on CUDA); anywhere else it runs vLLM's own path, the rotation then the
backend's `do_kv_cache_update`, and logs why once per layer (`FALLBACKS`). It returns q rotated, k rotated where the
graph still reads k (`need_k`; else an empty tensor), and the empty tensor vLLM's op returns, which orders the
attention op after the write.

The op declares no mutation, as vLLM's `unified_kv_cache_update` does not: the cache is not an argument (it is
looked up), and the dependency tensor keeps the order. The layer name's schema type is the one vLLM's op takes
(`str`, or vLLM's `LayerName` opaque type on torch >= 2.11), so one overload is defined per type on first use.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from .kv_cache_api import apply_rotary_qk_kv_cache
from .layer_caches import LayerCache, layer_cache
from .op_definition import OPS
from .op_families import define_family
from .schema import RotaryParams, op_schema, optional_tensor_names

log = logging.getLogger("rope_fusion")

NAME = "rotary_qk_into_layer_cache"
FALLBACKS: dict[str, str] = {}  # layer name -> why vLLM's own path wrote its cache (logged once per layer)
_OPTIONALS = optional_tensor_names(2)  # positions, q_norm_weight, k_norm_weight, cu_seqlens, seqlen_offsets
_OVERLOADS: dict[str, Any] = {}


def _schema(layer_type: str) -> str:
    """rotary_qk's schema with v after k, the layer's name and `need_k` as keywords, and three results."""
    head, _ = op_schema(2).rsplit(") ->", 1)
    tensors, options = head.split(", *, ", 1)
    tensors = tensors.replace("Tensor k, ", "Tensor k, Tensor v, ", 1)
    return f"{tensors}, *, {layer_type} layer_name, bool need_k, {options}) -> (Tensor, Tensor, Tensor)"


def layer_cache_op(layer_type: str) -> Any:
    """The op's overload whose layer name has schema type `layer_type` (defined on first use)."""
    if layer_type not in _OVERLOADS:
        overload = "str" if layer_type == "str" else "opaque"
        (_OVERLOADS[layer_type],) = define_family({layer_type: f"{NAME}.{overload}"}, _schema, lambda _: _run,
                                                  lambda _: _fake)
    return _OVERLOADS[layer_type]


def _split_args(args: tuple) -> tuple:
    """(q, k, v, cos, sin, the optional tensors by name)."""
    q, k, v, cos, sin, *rest = args
    rest += [None] * (len(_OPTIONALS) - len(rest))
    return q, k, v, cos, sin, dict(zip(_OPTIONALS, rest))


def _fake(*args: Any, layer_name: Any, need_k: bool, **params: Any) -> tuple:
    q, k, _, _, _, _ = _split_args(args)
    out_dtype = RotaryParams(**params).out_dtype or q.dtype
    k_out = k.new_empty(k.shape, dtype=out_dtype) if need_k else k.new_empty(0, dtype=out_dtype)
    return q.new_empty(q.shape, dtype=out_dtype), k_out, k.new_empty(0)


def forward_context_entry(name: str) -> tuple:
    """(the layer, its cache, its slots or None) from vLLM's forward context, as vLLM's `get_attention_context`
    reads them."""
    context = sys.modules["vllm.forward_context"].get_forward_context()
    layer = context.no_compile_layers[name]
    slots = context.slot_mapping
    if not isinstance(slots, dict):
        raise TypeError(f"vLLM's forward context holds slot_mapping as {type(slots).__name__}, expected a dict "
                        "of layer name -> slots")
    return layer, layer.kv_cache, slots.get(name)


def _run(*args: Any, layer_name: Any, need_k: bool, **params: Any) -> tuple:
    q, k, v, cos, sin, optional = _split_args(args)
    name = getattr(layer_name, "value", layer_name)  # vLLM's LayerName wraps the str
    layer, kv_cache, slots = forward_context_entry(name)
    dummy = k.new_empty(0)
    if slots is None:  # vLLM writes nothing without slots (a profiling run): the rotation alone
        q_rot, k_rot = OPS[1](q, k, cos, sin, *optional.values(), **params)
        return q_rot, k_rot if need_k else k_rot.new_empty(0), dummy
    target = layer_cache(layer, kv_cache)
    if isinstance(target, str):
        if FALLBACKS.get(name) != target:
            FALLBACKS[name] = target
            log.warning("rope_fusion: %s: vLLM's rotation and cache write, not the fused op: %s", name, target)
        q_rot, k_rot = OPS[1](q, k, cos, sin, *optional.values(), **params)
        layer.impl.do_kv_cache_update(layer, k_rot, v, kv_cache, slots)
        return q_rot, k_rot if need_k else k_rot.new_empty(0), dummy
    q_rot, k_rot = _write(q, k, v, cos, sin, optional, params, target, slots, need_k)
    return q_rot, k_rot, dummy


def _joinable(q: torch.Tensor, k: torch.Tensor, optional: dict, params: RotaryParams) -> bool:
    """Whether q and k can be rotated as one tensor's heads: the same lanes and dtype, and nothing per tensor."""
    return (q.shape[-1] == k.shape[-1] and q.dtype == k.dtype and params.norm == "none" and not params.offset_q_only
            and optional["q_norm_weight"] is None and optional["k_norm_weight"] is None)


def _write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, optional: dict,
           params: dict, target: LayerCache, slots: torch.Tensor, need_k: bool) -> tuple:
    """The cache op's call; where the graph reads k rotated, q's and k's heads as one tensor, which the op rotates
    and returns whole (its k is only cached), so that k's rotation costs no second launch."""
    cache = {"kv_layout": target.kv_layout, "k_scale": target.k_scale, "v_scale": target.v_scale}
    options = {**params, **{n: t for n, t in optional.items() if t is not None}, **cache}
    caches = (target.k_cache, target.v_cache, slots)
    if not need_k:
        q_rot = apply_rotary_qk_kv_cache(q, k, v, cos, sin, *caches, **options)
        return q_rot, q_rot.new_empty(0)
    if _joinable(q, k, optional, RotaryParams(**params)):
        both = apply_rotary_qk_kv_cache(torch.cat((q, k), dim=1), k, v, cos, sin, *caches, **options)
        q_rot, k_rot = both.split((q.shape[1], k.shape[1]), dim=1)
        return q_rot.contiguous(), k_rot.contiguous()  # an op's results may not alias each other
    q_rot = apply_rotary_qk_kv_cache(q, k, v, cos, sin, *caches, **options)
    return q_rot, OPS[1](q, k, cos, sin, *optional.values(), **params)[1]
