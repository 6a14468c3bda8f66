"""The `rope_fusion::rotary` and `rope_fusion::rotary_qk` operators.

Defined with torch.library so that fused nodes are ordinary ops in any FX graph: they have fake
implementations (shape propagation under torch.compile), an eager implementation (the reference, or a
device kernel registered by a backend module), and an Inductor lowering (ops/lowering.py). The pass
emits these ops; nothing else in the project invents its own.
"""

from __future__ import annotations

from typing import Callable

import torch

from .reference import check_args, rotary_reference

# Device-specific eager kernels (e.g. Triton on CUDA) register here; the reference is the fallback.
_EAGER_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
_EAGER_QK_KERNELS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def register_eager_kernel(device_type: str, rotary=None, rotary_qk=None) -> None:
    """Let a backend (kernels/) serve direct calls of the op on one device type."""
    if rotary is not None:
        _EAGER_KERNELS[device_type] = rotary
    if rotary_qk is not None:
        _EAGER_QK_KERNELS[device_type] = rotary_qk


@torch.library.custom_op("rope_fusion::rotary", mutates_args=())
def rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: int,
    full_tables: bool,
    conjugate: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables,
              conjugate=conjugate, out_dtype=out_dtype)
    kernel = _EAGER_KERNELS.get(x.device.type)
    if kernel is not None:
        out = kernel(x, cos, sin, **kw)
        if out is not None:
            return out
    return rotary_reference(x, cos, sin, **kw).contiguous()


@rotary.register_fake
def _rotary_fake(x, cos, sin, *, interleaved, rotary_dim, full_tables, conjugate, out_dtype):
    check_args(x, cos, sin, rotary_dim, full_tables, out_dtype)
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("rope_fusion::rotary_qk", mutates_args=())
def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: int,
    full_tables: bool,
    conjugate: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables,
              conjugate=conjugate, out_dtype=out_dtype)
    kernel = _EAGER_QK_KERNELS.get(q.device.type)
    if kernel is not None:
        out = kernel(q, k, cos, sin, **kw)
        if out is not None:
            return out
    return (rotary_reference(q, cos, sin, **kw).contiguous(),
            rotary_reference(k, cos, sin, **kw).contiguous())


@rotary_qk.register_fake
def _rotary_qk_fake(q, k, cos, sin, *, interleaved, rotary_dim, full_tables, conjugate, out_dtype):
    check_args(q, cos, sin, rotary_dim, full_tables, out_dtype, name="q")
    check_args(k, cos, sin, rotary_dim, full_tables, out_dtype, name="k")
    return q.new_empty(q.shape, dtype=out_dtype), k.new_empty(k.shape, dtype=out_dtype)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    full_tables: bool = False,
    conjugate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rotate x by the tables (DESIGN.md section 2); rotary_dim defaults to the whole head dim."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check_args(x, cos, sin, rotary_dim, full_tables, out_dtype)
    return torch.ops.rope_fusion.rotary(
        x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables,
        conjugate=conjugate, out_dtype=out_dtype,
    )


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    full_tables: bool = False,
    conjugate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (head counts may differ) by shared tables in one call."""
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    out_dtype = q.dtype if out_dtype is None else out_dtype
    check_args(q, cos, sin, rotary_dim, full_tables, out_dtype, name="q")
    check_args(k, cos, sin, rotary_dim, full_tables, out_dtype, name="k")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    return torch.ops.rope_fusion.rotary_qk(
        q, k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables,
        conjugate=conjugate, out_dtype=out_dtype,
    )
