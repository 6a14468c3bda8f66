"""The `rope_fusion::rotary` and `rope_fusion::rotary_qk` operators, and the way every variant is defined.

Fused nodes are ordinary torch.library ops in any FX graph: a fake implementation (shape propagation under
torch.compile), an eager implementation (the reference, or a device kernel that a backend registers with
`register_device_kernel`, which is torch.library's `register_kernel`), an autograd formula and, for the two
main ops, an Inductor lowering (ops/lowering.py). A backend that needs an op Inductor must not lower (the
NPU bridge, the Triton kernel behind a symbolic-size site) defines its own variant with
`define_rotary_ops(suffix, impl)`: same schema, fake and autograd formula, its own eager implementation.
Every signature comes from `schema.RotaryParams`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .reference import partner_lanes, rotary_reference, table_grads
from .schema import RotaryParams, check_args, op_schema

LIBRARY = torch.library.Library("rope_fusion", "FRAGMENT")

# impl(xs, cos, sin, params, positions) -> list of outputs, or None to use the reference
Impl = Callable[[list, torch.Tensor, torch.Tensor, RotaryParams, "torch.Tensor | None"], "list | None"]


def _split(args: Sequence[Any], kw: dict, arity: int) -> tuple:
    """(xs, cos, sin, positions, params) from an op call's arguments."""
    kw = dict(kw)
    positions = args[arity + 2] if len(args) > arity + 2 else kw.pop("positions", None)
    return list(args[:arity]), args[arity], args[arity + 1], positions, RotaryParams(**kw)


def _result(outs: Sequence[torch.Tensor]) -> Any:
    return outs[0] if len(outs) == 1 else tuple(outs)


def _reference(xs: list, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams,
               positions: torch.Tensor | None) -> list:
    return [rotary_reference(x, cos, sin, positions=positions, **params.kwargs()).contiguous() for x in xs]


def _fake(arity: int) -> Callable[..., Any]:
    def fake(*args: Any, **kw: Any) -> Any:
        xs, cos, sin, positions, params = _split(args, kw, arity)
        check_args(xs, cos, sin, params, positions)
        return _result([x.new_empty(x.shape, dtype=params.out_dtype) for x in xs])
    return fake


def _eager(impl: Impl | None, arity: int) -> Callable[..., Any]:
    def run(*args: Any, **kw: Any) -> Any:
        xs, cos, sin, positions, params = _split(args, kw, arity)
        check_args(xs, cos, sin, params, positions)  # a direct call deserves the ValueError, not a kernel's
        outs = impl(xs, cos, sin, params, positions) if impl is not None else None
        return _result(outs if outs is not None else _reference(xs, cos, sin, params, positions))
    return run


def _setup_context(arity: int) -> Callable[..., None]:
    def setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
        xs, cos, sin, positions, params = _split(inputs, keyword_only_inputs, arity)
        ctx.params, ctx.has_positions = params, positions is not None
        ctx.x_dtypes = [x.dtype for x in xs]
        ctx.tables_need_grad = cos.requires_grad or sin.requires_grad
        # x is needed only for the tables' gradients; saving it otherwise would cost activation memory
        saved = (positions,) if positions is not None else ()
        ctx.save_for_backward(cos, sin, *saved, *(xs if ctx.tables_need_grad else ()))
    return setup


def _backward(ctx: Any, *grads: Any) -> tuple:
    """The gradient of a rotation is the conjugate rotation (with the sin entry of the partner lane when
    the tables hold one entry per lane); tables that require grad get the sums of reference.table_grads."""
    p: RotaryParams = ctx.params
    cos, sin, *rest = ctx.saved_tensors
    positions = rest.pop(0) if ctx.has_positions else None
    xs = rest
    back_sin = partner_lanes(sin, p.rotary_dim, p.interleaved) if p.full_tables else sin
    inverse = [p.replace(conjugate=not p.conjugate, out_dtype=dtype) for dtype in ctx.x_dtypes]
    if len(grads) == 2 and None not in grads and inverse[0] == inverse[1]:  # q and k: one launch
        gx = list(ROTARY_QK(*grads, cos, back_sin, positions, **inverse[0].kwargs()))
    else:
        gx = [None if g is None else ROTARY(g, cos, back_sin, positions, **q.kwargs())
              for g, q in zip(grads, inverse)]
    gcos = gsin = None
    if ctx.tables_need_grad:
        gcos, gsin = table_grads(grads, xs, cos, sin, interleaved=p.interleaved, rotary_dim=p.rotary_dim,
                                 full_tables=p.full_tables, conjugate=p.conjugate, positions=positions)
    return (*gx, gcos, gsin, None)


def define_rotary_ops(suffix: str = "", impl: Impl | None = None, impl_qk: Impl | None = None) -> tuple:
    """Define `rope_fusion::rotary{suffix}` and `rope_fusion::rotary_qk{suffix}` (one tensor, or q and k that
    share tables, in one call) and return their default overloads."""
    ops = []
    for arity, name, fn in ((1, f"rotary{suffix}", impl), (2, f"rotary_qk{suffix}", impl_qk or impl)):
        qualname = f"rope_fusion::{name}"
        torch.library.define(qualname, op_schema(arity), lib=LIBRARY)
        torch.library.impl(qualname, "default", lib=LIBRARY)(_eager(fn, arity))
        torch.library.register_fake(qualname, lib=LIBRARY)(_fake(arity))
        torch.library.register_autograd(qualname, _backward, setup_context=_setup_context(arity), lib=LIBRARY)
        ops.append(getattr(torch.ops.rope_fusion, name).default)
    return tuple(ops)


ROTARY, ROTARY_QK = define_rotary_ops()


def register_device_kernel(device_type: str, impl: Impl) -> None:
    """Serve eager calls of `rotary` / `rotary_qk` on one device type with `impl` (None from it: reference)."""
    for op, arity in ((ROTARY, 1), (ROTARY_QK, 2)):
        torch.library.register_kernel(op._schema.name, device_type, _eager(impl, arity), lib=LIBRARY)


def _call(xs: list, cos: torch.Tensor, sin: torch.Tensor, options: dict) -> Any:
    options = dict(options)
    positions = options.pop("positions", None)
    from .backends import load_backends

    unknown = set(options) - set(RotaryParams.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; expected "
                        f"{[*RotaryParams.__dataclass_fields__, 'positions']}")
    names = ("x",) if len(xs) == 1 else ("q", "k")
    for name, x in zip(names, xs):
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ValueError(f"{name} must be a tensor with at least one dimension (the head dim)")
    if options.get("out_dtype") is None and len({x.dtype for x in xs}) > 1:
        raise ValueError(f"q is {xs[0].dtype} and k is {xs[1].dtype}: pass out_dtype=, both are written in it")
    params = RotaryParams(
        interleaved=bool(options.get("interleaved", False)),
        rotary_dim=options.get("rotary_dim") or xs[0].shape[-1],
        full_tables=bool(options.get("full_tables", False)),
        conjugate=bool(options.get("conjugate", False)),
        out_dtype=options.get("out_dtype") or xs[0].dtype,
    )
    check_args(xs, cos, sin, params, positions)
    load_backends()  # device kernels (Triton on CUDA) register on import
    op = ROTARY if len(xs) == 1 else ROTARY_QK
    return op(*xs, cos, sin, positions, **params.kwargs())


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
                 rotary_dim: int | None = None, full_tables: bool = False, conjugate: bool = False,
                 out_dtype: torch.dtype | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the last dim of x by the tables; differentiable (the gradient is the inverse rotation).

    Pairs are (2j, 2j+1) when `interleaved`, else NeoX (j, j + R/2), R = `rotary_dim` (default: the whole
    head dim; lanes >= R pass through). Tables: one entry per pair, width R/2 (the flash-attn / vLLM
    convention), or with `full_tables` one entry per lane, width R (the Hugging Face convention); they
    broadcast against x's leading dims and may be strided views. `conjugate` rotates by minus the angle.
    The math is fp32 (fp64 for fp64 inputs), rounded once to `out_dtype` (default x's dtype). With
    `positions` (int), cos and sin are [max_positions, width] caches and the tables are their rows
    `cos[positions]`, which broadcast against x like plain tables (positions [T, 1] for x [T, H, D]). Raises
    ValueError naming the argument for bad shapes, dtypes or devices."""
    return _call([x], cos, sin, dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables,
                                     conjugate=conjugate, out_dtype=out_dtype, positions=positions))


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by shared tables in one call (head counts may differ); options as for `apply_rotary`.
    Both results are written in one dtype: when q and k differ in dtype, `out_dtype` must say which."""
    return _call([q, k], cos, sin, options)
