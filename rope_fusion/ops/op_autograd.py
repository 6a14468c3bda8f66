"""The autograd formula of every `rope_fusion::rotary*` operator, variants included.

One formula serves every op of the rotary schema, whatever kernel runs its forward: `define_rotary_ops`
(op_definition.py) registers it with each op it defines, so a backend's variant differentiates exactly like the
main op. The backward calls the main ops themselves (a conjugate rotation is a rotation), found in torch's op
registry by name when a backward runs: this module is imported while those ops are being defined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .packed import unpacked
from .reference import partner_lanes, reference_outputs, table_grads
from .schema import OP_NAMES, RotaryCall


def register_rotary_autograd(qualname: str, arity: int, lib: torch.library.Library) -> None:
    """Give the op `qualname` (the rotary schema of `arity` tensors) the rotary formula, kept alive by `lib`."""
    torch.library.register_autograd(qualname, _backward, setup_context=_setup_context(arity), lib=lib)


def _main_op(arity: int) -> Any:
    """`rope_fusion::rotary`, `rotary_qk` or `rotary_qkv` (default overload) by its arity."""
    return getattr(torch.ops.rope_fusion, OP_NAMES[arity]).default


def _setup_context(arity: int) -> Callable[..., None]:
    def setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
        call = RotaryCall.parse(inputs, keyword_only_inputs, arity)
        ctx.arity, ctx.params = arity, call.params
        ctx.x_dtypes = [x.dtype for x in call.xs]
        ctx.tables_need_grad = call.cos.requires_grad or call.sin.requires_grad
        # backward through the reference: a norm, a de-interleaved output, tables given as angles, anything new
        ctx.via_reference = not call.params.closed_form_backward
        # x is needed only for the tables' gradients or a norm's; saving it otherwise costs activation memory
        keep_x = ctx.tables_need_grad or ctx.via_reference
        ctx.save_for_backward(*(call.tensors() if keep_x else
                                dataclasses.replace(call, xs=[None] * arity, norm_weights=None).tensors()))
    return setup


def _backward(ctx: Any, *grads: Any) -> tuple:
    """The gradient of a rotation is the conjugate rotation (with the sin entry of the partner lane when the
    tables hold one entry per lane); tables that require grad get the sums of reference.table_grads. With a
    norm, a de-interleaved output or angle tables, the gradient comes from autograd through the reference,
    recomputed here."""
    saved = ctx.saved_tensors
    call = RotaryCall.parse(saved, ctx.params.kwargs(), ctx.arity)
    # xs, cos, sin, positions, one norm weight per x, cu_seqlens, seqlen_offsets
    n_inputs = len(call.xs) + 3 + len(call.xs) + 2
    if ctx.via_reference:
        return _recomputed_grads(call, grads, n_inputs)
    p = ctx.params
    back_sin = partner_lanes(call.sin, p.interleaved, p.rotary_blocks) if p.full_tables else call.sin
    inverse = [p.replace(conjugate=not p.conjugate, out_dtype=dtype) for dtype in ctx.x_dtypes]
    packed = dict(cu_seqlens=call.cu_seqlens, seqlen_offsets=call.seqlen_offsets) if call.cu_seqlens is not None \
        else {}
    if len(grads) > 1 and None not in grads and all(q == inverse[0] for q in inverse):  # q, k (v): one launch
        gx = list(_main_op(len(grads))(*grads, call.cos, back_sin, call.positions, **packed, **inverse[0].kwargs()))
    else:
        rotary = _main_op(1)
        gx = [None if g is None else rotary(g, call.cos, back_sin, call.positions, **packed,
                                            **q.of_tensor(i).kwargs())
              for i, (g, q) in enumerate(zip(grads, inverse))]
    gcos = gsin = None
    if ctx.tables_need_grad:
        positions = unpacked(call).positions
        gcos, gsin = table_grads(grads, call.xs, call.cos, call.sin, interleaved=p.interleaved,
                                 rotary_dim=p.rotary_dim, full_tables=p.full_tables, conjugate=p.conjugate,
                                 positions=positions, rotary_blocks=p.rotary_blocks,
                                 rotary_offset=p.rotary_offset, offset_q_only=p.offset_q_only)
    return (*gx, gcos, gsin, *[None] * (n_inputs - len(gx) - 2))


def _recomputed_grads(call: RotaryCall, grads: tuple, n_inputs: int) -> tuple:
    inputs = [*call.xs, call.cos, call.sin, call.positions, *call.norm_weights, call.cu_seqlens, call.seqlen_offsets]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in inputs]
    n = len(call.xs)
    with torch.enable_grad():
        redo = RotaryCall(leaves[:n], leaves[n], leaves[n + 1], call.params, leaves[n + 2], leaves[n + 3:2 * n + 3],
                          *leaves[2 * n + 3:])
        outs = reference_outputs(redo)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    by_id = {id(t): g for t, g in zip(wanted, got)}
    return tuple(by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves)[:n_inputs]
