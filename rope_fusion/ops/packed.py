"""Packed sequences in the fused op: the table row of every token from `cu_seqlens` (flash-attn's varlen form).

x holds the tokens of several sequences back to back, `[total_tokens, ..., D]`; `cu_seqlens` (`[batch + 1]`,
int32/int64, nondecreasing, 0 first and total_tokens last) says where each sequence starts, and `seqlen_offsets`
(`[batch]`, optional) which table row each sequence's first token reads. Token t of sequence b, the b with
`cu_seqlens[b] <= t < cu_seqlens[b + 1]`, rotates by row `(t - cu_seqlens[b]) + seqlen_offsets[b]` of the
`[rows, width]` caches cos and sin, as flash-attn's varlen `apply_rotary_emb` rotates it.

The op turns these into positions (`[T, 1, ..., 1]`, one row per token, broadcast over the heads) and then runs
its positions path, so every backend checks one rule: a row outside [0, rows) raises. A token that no sequence
holds (before `cu_seqlens[0]` or from `cu_seqlens[-1]` on) raises too: its sequence index is -1 or batch, and the
gather of its sequence's start (`embedding`, which never wraps a negative index, eagerly nor in Inductor's
lowering) is checked like the rows. Values that break the rest of the contract (cu_seqlens decreasing) are not
detected: that would need a read of their values on the host.

The arithmetic is spelled once, as ATen ops through a caller's `op(target, *args, **kwargs)`: applied to tensors
(the reference and the eager kernels, `unpacked`; traced as it is into the Triton kernel's user-kernel node), to
Inductor's IR through its lowerings (ops/lowering.py), and to graph nodes through the pass's emitter (the NPU
graph path, flash-attn varlen sites with per-sequence offsets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten
prims = torch.ops.prims

INDEX_DTYPES = (torch.int32, torch.int64)

Op = Callable[..., Any]  # op(target, *args, **kwargs): one ATen op applied to the caller's kind of value


def eager_op(target: Any, *args: Any, **kwargs: Any) -> Any:
    return target(*args, **kwargs)


def packed_positions(op: Op, cu_seqlens: Any, seqlen_offsets: Any, tokens: Any, ndim: int, device: Any) -> Any:
    """int64 positions `[tokens, 1, ..., 1]` (ndim - 1 dims, x's lead dims) of packed sequences: token t of
    sequence b reads row t - cu_seqlens[b] (+ seqlen_offsets[b]). `op` applies one ATen op (`eager_op` for
    tensors)."""
    cu = op(prims.convert_element_type.default, cu_seqlens, torch.int64)
    t = op(prims.iota.default, tokens, start=0, step=1, dtype=torch.int64, device=device, requires_grad=False)
    # the sequence of each token: -1 before cu_seqlens[0], batch from cu_seqlens[-1] on; both fail the checked
    # gathers below (`embedding` reads a [batch, 1] table, never wrapping a negative index)
    seq = op(aten.sub.Tensor, op(aten.searchsorted.Tensor, cu, t, right=True), 1)
    starts = op(aten.unsqueeze.default, op(aten.slice.Tensor, cu, 0, 0, -1), -1)  # [batch, 1]
    rows = op(aten.sub.Tensor, t, op(aten.view.default, op(aten.embedding.default, starts, seq), [tokens]))
    if seqlen_offsets is not None:
        off = op(aten.unsqueeze.default, op(prims.convert_element_type.default, seqlen_offsets, torch.int64), -1)
        rows = op(aten.add.Tensor, rows, op(aten.view.default, op(aten.embedding.default, off, seq), [tokens]))
    return op(aten.view.default, rows, [tokens, *[1] * (ndim - 2)])


def positions_shape(x: torch.Tensor) -> tuple:
    """The shape of the positions a packed call derives for x: its token dim, then 1 per other lead dim."""
    return (x.shape[0], *[1] * (x.dim() - 2))


def unpacked(call: Any) -> Any:
    """A `schema.RotaryCall` of packed sequences as the same call with its derived positions (the form every
    backend implements); any other call as it is."""
    if call.cu_seqlens is None:
        return call
    x = call.xs[0]
    positions = packed_positions(eager_op, call.cu_seqlens, call.seqlen_offsets, x.shape[0], x.dim(), x.device)
    return dataclasses.replace(call, positions=positions, cu_seqlens=None, seqlen_offsets=None)


def check_packed(xs: Sequence[torch.Tensor], names: Sequence[str], positions: Any, cu_seqlens: Any,
                 seqlen_offsets: Any) -> None:
    """Raise ValueError naming the argument; shapes may be symbolic (fake tensors)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    if cu_seqlens is None:
        if seqlen_offsets is not None:
            raise ValueError("seqlen_offsets are the offsets of packed sequences: they need cu_seqlens")
        return
    if positions is not None:
        raise ValueError("pass positions or cu_seqlens, not both: cu_seqlens derives each token's position")
    for name, t in (("cu_seqlens", cu_seqlens), ("seqlen_offsets", seqlen_offsets)):
        if t is None:
            continue
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
        if t.device != xs[0].device:
            raise ValueError(f"{name} on {t.device}, {names[0]} on {xs[0].device}: all tensors must be on one device")
    if guard_or_false(cu_seqlens.shape[0] == 0):
        raise ValueError("cu_seqlens must hold batch + 1 entries (0 first, the token count last), got none")
    if seqlen_offsets is not None:
        a, b = seqlen_offsets.shape[0], cu_seqlens.shape[0] - 1
        if not _exactly(a, b):
            raise ValueError(f"seqlen_offsets of shape {tuple(seqlen_offsets.shape)} must hold one offset per "
                             f"sequence, [batch] = [{b}] for cu_seqlens of shape {tuple(cu_seqlens.shape)}")
    for name, x in zip(names, xs):
        if x.dim() < 2:
            raise ValueError(f"with cu_seqlens, {name} is packed tokens [total_tokens, ..., head_dim], got shape "
                             f"{tuple(x.shape)}")
        if x.dim() != xs[0].dim() or not _exactly(x.shape[0], xs[0].shape[0]):
            raise ValueError(f"with cu_seqlens, every rotated tensor packs the same tokens in the same number of "
                             f"dims: {names[0]} {tuple(xs[0].shape)}, {name} {tuple(x.shape)}")


def _exactly(a: Any, b: Any) -> bool:
    """False where two sizes provably differ; sizes known only at run time are checked there."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

    if statically_known_true(a == b):
        return True
    if guard_or_false(a != b):
        return False
    torch._check(a == b)  # no message: Dynamo traces this check and cannot convert a closure
    return True


def graph_positions(em: Any, x: Any, cu_seqlens: Any, seqlen_offsets: Any, like: Any) -> Any:
    """The positions of packed sequences whose tensors are graph nodes (x, the first rotated tensor), as nodes
    that the pass's emitter (passes/emission.Emitter) inserts at its point: the same ATen ops, so Inductor (or the
    graph's own compiler) runs and checks them as it runs its own."""
    val = x.meta["val"]
    tokens = em.size_args(x, range(1), like)[0]
    return packed_positions(lambda target, *a, **kw: em.call(target, a, kw, like=like), cu_seqlens, seqlen_offsets,
                            tokens, val.dim(), val.device)
