"""The `rope_fusion::rotary`, `rotary_qk` and `rotary_qkv` operators, and the way every variant is defined.

Fused nodes are ordinary torch.library ops in any FX graph: a fake implementation (shape propagation under
torch.compile), an eager implementation (the reference, or a device kernel that a backend registers with
`register_device_kernel`, which is torch.library's `register_kernel`), an autograd formula and, for the two
main ops, an Inductor lowering (ops/lowering.py). A backend that needs an op Inductor must not lower (the
NPU bridge, the Triton kernel behind a symbolic-size site) defines its own variant with
`define_rotary_ops(suffix, impl)`: same schema, fake and autograd formula, its own eager implementation.
Every signature comes from `schema.RotaryParams` and `schema.optional_tensor_names`; implementations take a
`schema.RotaryCall`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .reference import partner_lanes, rotary_reference, table_grads
from .schema import OP_NAMES, TENSOR_NAMES, RotaryCall, RotaryParams, check_call, op_schema

LIBRARY = torch.library.Library("rope_fusion", "FRAGMENT")

# impl(call) -> list of outputs, or None to use the reference
Impl = Callable[[RotaryCall], "list | None"]


def _result(outs: Sequence[torch.Tensor]) -> Any:
    return outs[0] if len(outs) == 1 else tuple(outs)


def reference_outputs(call: RotaryCall) -> list:
    """The reference applied to every x of a call."""
    kw = call.params.kwargs()
    return [rotary_reference(x, call.cos, call.sin, positions=call.positions, norm_weight=call.weight(i),
                             **kw).contiguous() for i, x in enumerate(call.xs)]


def _fake(arity: int) -> Callable[..., Any]:
    def fake(*args: Any, **kw: Any) -> Any:
        call = RotaryCall.parse(args, kw, arity)
        check_call(call)
        return _result([x.new_empty(x.shape, dtype=call.params.out_dtype) for x in call.xs])
    return fake


def _eager(impl: Impl | None, arity: int) -> Callable[..., Any]:
    def run(*args: Any, **kw: Any) -> Any:
        call = RotaryCall.parse(args, kw, arity)
        check_call(call)  # a direct call deserves the ValueError, not a kernel's failure
        outs = impl(call) if impl is not None else None
        return _result(outs if outs is not None else reference_outputs(call))
    return run


def _setup_context(arity: int) -> Callable[..., None]:
    def setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
        call = RotaryCall.parse(inputs, keyword_only_inputs, arity)
        ctx.arity, ctx.params = arity, call.params
        ctx.x_dtypes = [x.dtype for x in call.xs]
        ctx.tables_need_grad = call.cos.requires_grad or call.sin.requires_grad
        # backward through the reference: a norm, a de-interleaved output, tables given as angles
        ctx.via_reference = call.params.norm != "none" or call.params.deinterleave or call.params.angle_tables
        # x is needed only for the tables' gradients or a norm's; saving it otherwise costs activation memory
        keep_x = ctx.tables_need_grad or ctx.via_reference
        ctx.save_for_backward(*(call.tensors() if keep_x else
                                (None,) * arity + (call.cos, call.sin, call.positions)))
    return setup


def _backward(ctx: Any, *grads: Any) -> tuple:
    """The gradient of a rotation is the conjugate rotation (with the sin entry of the partner lane when the
    tables hold one entry per lane); tables that require grad get the sums of reference.table_grads. With a
    norm, a de-interleaved output or angle tables, the gradient comes from autograd through the reference,
    recomputed here."""
    saved = ctx.saved_tensors
    call = RotaryCall.parse(saved, ctx.params.kwargs(), ctx.arity)
    n_inputs = len(call.xs) + 3 + len(call.xs)  # xs, cos, sin, positions, one norm weight per x
    if ctx.via_reference:
        return _recomputed_grads(call, grads, n_inputs)
    p = ctx.params
    back_sin = partner_lanes(call.sin, p.interleaved, p.rotary_blocks) if p.full_tables else call.sin
    inverse = [p.replace(conjugate=not p.conjugate, out_dtype=dtype) for dtype in ctx.x_dtypes]
    if len(grads) > 1 and None not in grads and all(q == inverse[0] for q in inverse):  # q, k (v): one launch
        gx = list(OPS[len(grads) - 1](*grads, call.cos, back_sin, call.positions, **inverse[0].kwargs()))
    else:
        gx = [None if g is None else ROTARY(g, call.cos, back_sin, call.positions, **q.kwargs())
              for g, q in zip(grads, inverse)]
    gcos = gsin = None
    if ctx.tables_need_grad:
        gcos, gsin = table_grads(grads, call.xs, call.cos, call.sin, interleaved=p.interleaved,
                                 rotary_dim=p.rotary_dim, full_tables=p.full_tables, conjugate=p.conjugate,
                                 positions=call.positions, rotary_blocks=p.rotary_blocks,
                                 rotary_offset=p.rotary_offset)
    return (*gx, gcos, gsin, *[None] * (n_inputs - len(gx) - 2))


def _recomputed_grads(call: RotaryCall, grads: tuple, n_inputs: int) -> tuple:
    inputs = [*call.xs, call.cos, call.sin, call.positions, *call.norm_weights]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in inputs]
    n = len(call.xs)
    with torch.enable_grad():
        redo = RotaryCall(leaves[:n], leaves[n], leaves[n + 1], call.params, leaves[n + 2], leaves[n + 3:])
        outs = reference_outputs(redo)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    by_id = {id(t): g for t, g in zip(wanted, got)}
    return tuple(by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves)[:n_inputs]


def define_rotary_ops(suffix: str = "", impl: Impl | None = None) -> tuple:
    """Define `rope_fusion::rotary{suffix}`, `rotary_qk{suffix}` and `rotary_qkv{suffix}` (one tensor; q and k;
    q, k and v that share tables, in one call) and return their default overloads, indexed by arity - 1."""
    ops = []
    for arity, base in OP_NAMES.items():
        name, fn = base + suffix, impl
        qualname = f"rope_fusion::{name}"
        torch.library.define(qualname, op_schema(arity), lib=LIBRARY)
        torch.library.impl(qualname, "default", lib=LIBRARY)(_eager(fn, arity))
        torch.library.register_fake(qualname, lib=LIBRARY)(_fake(arity))
        torch.library.register_autograd(qualname, _backward, setup_context=_setup_context(arity), lib=LIBRARY)
        ops.append(getattr(torch.ops.rope_fusion, name).default)
    return tuple(ops)


OPS = define_rotary_ops()  # by arity - 1
ROTARY, ROTARY_QK, ROTARY_QKV = OPS


def register_device_kernel(device_type: str, impl: Impl) -> None:
    """Serve eager calls of every arity's op on one device type with `impl` (None from it: reference)."""
    for arity, op in enumerate(OPS, start=1):
        torch.library.register_kernel(op._schema.name, device_type, _eager(impl, arity), lib=LIBRARY)


_TENSOR_OPTIONS = ("positions", "norm_weight")


def _call(xs: list, cos: torch.Tensor, sin: torch.Tensor, options: dict) -> Any:
    from .backends import load_backends

    options = {k: v for k, v in options.items()}
    positions = options.pop("positions", None)
    weights = options.pop("norm_weight", None)
    fields = RotaryParams.__dataclass_fields__
    unknown = set(options) - set(fields)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; expected {[*fields, *_TENSOR_OPTIONS]}")
    names = TENSOR_NAMES[len(xs)]
    for name, x in zip(names, xs):
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ValueError(f"{name} must be a tensor with at least one dimension (the head dim)")
    if options.get("out_dtype") is None and len({x.dtype for x in xs}) > 1:
        raise ValueError(f"q is {xs[0].dtype} and k is {xs[1].dtype}: pass out_dtype=, both are written in it")
    defaults = dict(interleaved=False, full_tables=False, conjugate=False)
    chosen = {k: v for k, v in options.items() if v is not None}
    rotary_dim = options.get("rotary_dim") or xs[0].shape[-1] - (options.get("rotary_offset") or 0)
    params = RotaryParams(**{**defaults, **chosen, "rotary_dim": rotary_dim,
                             "out_dtype": options.get("out_dtype") or xs[0].dtype})
    if weights is not None and not isinstance(weights, (list, tuple)):
        weights = [weights] * len(xs)
    call = RotaryCall(list(xs), cos, sin, params, positions, list(weights) if weights is not None else None)
    check_call(call)
    load_backends()  # device kernels (Triton on CUDA) register on import
    return OPS[len(xs) - 1](*call.tensors(), **params.kwargs())


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
                 rotary_dim: int | None = None, full_tables: bool = False, conjugate: bool = False,
                 out_dtype: torch.dtype | None = None, positions: torch.Tensor | None = None,
                 norm: str = "none", norm_eps: float = 1e-6,
                 norm_weight: torch.Tensor | None = None, rotary_blocks: int = 1,
                 rotary_offset: int = 0) -> torch.Tensor:
    """Rotate the last dim of x by the tables; differentiable (the gradient is the inverse rotation).

    Pairs are (2j, 2j+1) when `interleaved`, else NeoX (j, j + R/2), R = `rotary_dim` (default: the whole
    head dim; lanes >= R pass through). Tables: one entry per pair, width R/2 (the flash-attn / vLLM
    convention), or with `full_tables` one entry per lane, width R (the Hugging Face convention); they
    broadcast against x's leading dims and may be strided views. `conjugate` rotates by minus the angle.
    The math is fp32 (fp64 for fp64 inputs), rounded once to `out_dtype` (default x's dtype). With
    `positions` (int), cos and sin are [max_positions, width] caches and the tables are their rows
    `cos[positions]`, which broadcast against x like plain tables (positions [T, 1] for x [T, H, D]). With
    `norm="rms"` (each head) or `"rms_across_heads"` (all heads of a token), x is first RMS-normalised with
    `norm_eps` and scaled by `norm_weight` (broadcast against x's lanes), in fp32. Raises ValueError naming the
    argument for bad shapes, dtypes or devices. `rotary_blocks` > 1 (NeoX only): the rotated lanes are that many
    equal blocks, each with its own NeoX pairs (a head dim rotated per axis, as in Allegro). `rotary_offset`:
    the rotated lanes start there, the lanes before them pass through (DeepSeek-V3's rope lanes after the
    nope lanes of one head)."""
    return _call([x], cos, sin, dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables,
                                     conjugate=conjugate, out_dtype=out_dtype, positions=positions, norm=norm,
                                     norm_eps=norm_eps, norm_weight=norm_weight, rotary_blocks=rotary_blocks,
                                     rotary_offset=rotary_offset))


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by shared tables in one call (head counts may differ); options as for `apply_rotary`
    (`norm_weight` may be a pair: q's and k's). Both results are written in one dtype: when q and k differ in
    dtype, `out_dtype` must say which."""
    return _call([q, k], cos, sin, options)
