"""A rotation written back into a slice of a larger tensor, folded into the fused node (docs/design.md 4.2).

`q[:, :, a:b] = rope(q[:, :, a:b])` reaches the post-grad graph as `slice_scatter(q, rope(slice(q, 2, a, b)),
2, a, b)`, at times through `copy(slice(q, ..), rope(..))`. The op's lowering fuses with that scatter (Inductor
writes each row once), but an opaque kernel cannot: it writes the rotated slice and the scatter copies it into q
again. For those backends a group whose every member is such a write becomes one `auto_functionalized` call of
`rope_fusion::rotary*_slice_` (ops/slice_write.py), which rotates the slices of the bases in place; its results
(the written bases) replace the scatters. Inductor's reinplacing then writes into each base where nothing reads it
afterwards and clones it where something does, so a base read again still reads its old values.

What is recognised: the op's x is itself `slice(base, dim, start, end)` along a dim before the lanes, with unit
step; the replaced node's only use is the scatter into the same rows of the same base (through one `copy` into a
slice of those rows), in the base's dtype and the slice's shape. Anything else is left as it was, and says why
(`SliceWrite.why`).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..ops.schema import TENSOR_NAMES
from ..ops.slice_write import SLICE_OPS
from .fx_util import as_int
from .written_bases import base_reason, shared_reason

aten = torch.ops.aten


@dataclasses.dataclass
class SliceWrite:
    """Where one site's rotation is written: rows [start, end) of `base` along `dim`; `scatter` is the node whose
    value (the written base) the fold's result replaces."""

    base: fx.Node
    dim: int
    start: int
    end: int
    scatter: fx.Node


def _bounds(base: fx.Node, dim: int, start, end, step=1) -> tuple | None:
    """(dim, start, end) normalised against the base's static size, as the slice reads them; None if symbolic."""
    shape = base.meta["val"].shape
    nd = len(shape)
    size = as_int(shape[dim % nd]) if -nd <= dim < nd else None
    if size is None or step != 1 or not all(isinstance(v, int) for v in (start, end)):
        return None
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    return dim % nd, start, end


def _slice_of(node: fx.Node) -> tuple | None:
    """(base, dim, start, end) of a `slice.Tensor` node with static bounds."""
    if node.target is not aten.slice.Tensor or not isinstance(node.args[0], fx.Node):
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    base, dim, start, end, step = args[:5]
    b = _bounds(base, dim if dim is not None else 0, start if start is not None else 0,
                end if end is not None else (1 << 63) - 1, step if step is not None else 1)
    return None if b is None else (base, *b)


def slice_write(site_node: fx.Node, x: fx.Node) -> SliceWrite | str:
    """The slice write of one site (its replaced node, and x as the op reads it), or why it is not one."""
    target = _slice_of(x)
    if target is None:
        return "x is not a static unit-step slice of a tensor"
    base, dim, start, end = target
    if dim == len(base.meta["val"].shape) - 1:
        return "the slice runs along the lanes"
    src = site_node
    users = list(src.users)
    if len(users) == 1 and users[0].target is aten.copy.default and users[0].args[1] is src \
            and isinstance(users[0].args[0], fx.Node) and _slice_of(users[0].args[0]) == target:
        src = users[0]
        users = list(src.users)
    if len(users) != 1 or users[0].target is not aten.slice_scatter.default or users[0].args[1] is not src:
        return "the rotation is not written back with slice_scatter alone"
    scatter = users[0]
    args = list(scatter.args) + [None] * (6 - len(scatter.args))
    sbase, sdim, sstart, send, sstep = args[0], args[2], args[3], args[4], args[5]
    if sbase is not base:
        return "it is written into another tensor than the one its x is sliced from"
    got = _bounds(base, sdim if sdim is not None else 0, sstart if sstart is not None else 0,
                  send if send is not None else (1 << 63) - 1, sstep if sstep is not None else 1)
    if got != (dim, start, end):
        return "it is written into other rows than its x is read from"
    bv, sv = base.meta["val"], site_node.meta["val"]
    if sv.dtype != bv.dtype or src is site_node and tuple(sv.shape) != tuple(x.meta["val"].shape):
        return f"the rotation is {sv.dtype} of shape {tuple(sv.shape)}, its slice of the base {bv.dtype}"
    if end == start:
        return "the slice is empty"
    why = base_reason(base, {scatter, src} - {site_node}, site_node)
    if why is not None:
        return why
    return SliceWrite(base, dim, start, end, scatter)


def group_writes(group: tuple, xs: list) -> list | str:
    """Every member's slice write, or why the group is not folded (the first member's reason, named)."""
    found = [slice_write(m.node, x) for m, x in zip(group, xs)]
    names = TENSOR_NAMES[len(group)]
    for name, f in zip(names, found):
        if isinstance(f, str):
            return f if len(group) == 1 else f"{name}: {f}"
    if len({id(f.base) for f in found}) != len(found):
        return "two of the rotations are written into one tensor"
    return shared_reason([f.base for f in found]) or found


def emit_slice_write(em, call, writes: list, like: fx.Node) -> list:
    """The fold: one `auto_functionalized` call of the slice op of the call's arity; returns the written bases."""
    n = len(writes)
    return emit_written(em, SLICE_OPS[n - 1], [w.base for w in writes] + list(call.tensors()[n:]), call, writes,
                        like)


def emit_written(em, op, tensors: list, call, writes: list, like: fx.Node) -> list:
    """One `auto_functionalized` call of a slice-writing op (the slice op, or the into op of
    passes/joined_writes.py): its tensors in schema order, the call's parameters, and each write's (dim, start,
    end); returns the tensors it wrote, one per write."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    n = len(writes)
    names = [a.name for a in op._schema.arguments]
    kwargs = dict(zip(names, tensors + [None] * (len(names) - len(tensors))))  # every argument by name
    kwargs.update(call.params.kwargs())
    kwargs.update(slice_dims=[w.dim for w in writes], slice_starts=[w.start for w in writes],
                  slice_ends=[w.end for w in writes])
    node = em.graph.call_function(auto_functionalized, (op,), kwargs)
    vals = fx.node.map_arg(kwargs, lambda a: a.meta["val"])
    if em.fake_mode is not None:
        with em.fake_mode:
            node.meta["val"] = auto_functionalized(op, **vals)
    else:
        node.meta["val"] = auto_functionalized(op, **vals)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):  # where the RoPE came from, as emission's
        if key in like.meta:
            node.meta[key] = like.meta[key]
    first = len(node.meta["val"]) - n  # the op's own result (None) comes before the written tensors
    return [em.call(operator.getitem, (node, first + i), like=like) for i in range(n)]
