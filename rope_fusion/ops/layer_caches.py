"""How a vLLM attention layer's cache becomes the k and v caches `rope_fusion::rotary_qk_kv_cache` writes: one
record per attention implementation, looked up by the layer's `impl` class (or a class it derives from).

vLLM hands each attention layer one tensor, `layer.kv_cache`, whose layout its backend chose (`get_kv_cache_shape`),
and writes it in the backend's `do_kv_cache_update`. The fused layer-cache op (ops/layer_cache_op.py) may write it
itself only where it writes exactly what that method writes: the record's `split` makes the same k and v views of the
layer's cache that the method makes, in a layout of ops/cache_layouts.py, with the same dtype and scales, or says
why it cannot (an encoder layer that writes nothing, a cache shared with another layer, a cache dtype the op does
not hold). A backend without a record, or a record's refusal, runs vLLM's own path: the rotation, then the
backend's `do_kv_cache_update`. A new backend is a new record here (`register_attention_cache`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """The k and v caches of one layer as the cache op takes them."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_layout: str
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


# split(layer, impl, kv_cache) -> the caches, or why the op cannot write this layer's cache
Split = Callable[[Any, Any, torch.Tensor], "LayerCache | str"]


@dataclasses.dataclass(frozen=True)
class AttentionCache:
    """One attention implementation: its class as "module.QualName" (vLLM is not imported to match it) and how its
    layers' caches split into the op's k and v caches."""

    impl: str
    split: Split


_RECORDS: dict[str, AttentionCache] = {}

# vLLM's FP8 cache dtypes that are float8 e4m3 stored as bytes (reshape_and_cache_flash's "fp8", "fp8_e4m3")
_E4M3_NAMES = ("fp8", "fp8_e4m3")
_ENCODER_TYPES = ("encoder", "encoder_only")


def register_attention_cache(record: AttentionCache) -> None:
    _RECORDS[record.impl] = record


def record_of(impl: Any) -> AttentionCache | None:
    """The record of `impl`'s class or of the nearest class it derives from."""
    for cls in type(impl).__mro__:
        found = _RECORDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            return found
    return None


def layer_cache(layer: Any, kv_cache: torch.Tensor) -> LayerCache | str:
    """The caches the op writes for this layer, or why vLLM's own path must write them."""
    impl = getattr(layer, "impl", None)
    record = record_of(impl)
    if record is None:
        return f"attention backend {type(impl).__name__}: no cache record (ops/layer_caches.py)"
    return record.split(layer, impl, kv_cache)


def _cache_dtype(layer: Any, impl: Any, k: torch.Tensor, v: torch.Tensor) -> LayerCache | str:
    """The views in the dtype the backend writes: the model's ("auto"), or e4m3 bytes divided by the layer's scales."""
    name = getattr(impl, "kv_cache_dtype", "auto")
    if name == "auto":
        return LayerCache(k, v, "NHD")
    if name in _E4M3_NAMES:
        k8, v8 = (t if t.dtype == torch.float8_e4m3fn else t.view(torch.float8_e4m3fn) for t in (k, v))
        return LayerCache(k8, v8, "NHD", getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None))
    return f"kv_cache_dtype {name!r}: the op holds the model's dtype or float8 e4m3 with one scale a cache"


def _head_split(layer: Any, impl: Any, kv_cache: torch.Tensor) -> LayerCache | str:
    """FlashAttention's and FlashInfer's `do_kv_cache_update` in vLLM 0.33: the cache is [num_blocks, kv_heads,
    block_size, 2 * head_size], k's lanes then v's in each row, and `kv_cache.transpose(1, 2).split(head_size, -1)`
    gives two [num_blocks, block_size, kv_heads, head_size] views, NHD with strides, that reshape_and_cache_flash
    writes."""
    kind = getattr(getattr(impl, "attn_type", None), "value", getattr(impl, "attn_type", None))
    if kind in _ENCODER_TYPES:
        return f"{kind} attention writes no cache"
    if getattr(impl, "kv_sharing_target_layer_name", None) is not None:
        return f"the layer shares the cache of {impl.kv_sharing_target_layer_name}"
    if getattr(impl, "nvfp4_fa2", False) or getattr(impl, "is_kvcache_nvfp4", False):
        return "an NVFP4 cache (data and block scales): the op holds float8 e4m3 with one scale a cache"
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * impl.head_size:
        return f"a cache of shape {tuple(kv_cache.shape)}, not [num_blocks, kv_heads, block_size, 2 * {impl.head_size}]"
    k, v = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    return _cache_dtype(layer, impl, k, v)


FLASH_ATTENTION = AttentionCache("vllm.v1.attention.backends.flash_attn.FlashAttentionImpl", _head_split)
FLASHINFER = AttentionCache("vllm.v1.attention.backends.flashinfer.FlashInferImpl", _head_split)
register_attention_cache(FLASH_ATTENTION)
register_attention_cache(FLASHINFER)
