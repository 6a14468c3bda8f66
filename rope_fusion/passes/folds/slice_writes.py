"""A rotation written back into a slice of a larger tensor, folded into the fused node (docs/design.md 4.2).

`q[:, :, a:b] = rope(q[:, :, a:b])` reaches the post-grad graph as `slice_scatter(q, rope(slice(q, 2, a, b)),
2, a, b)`, at times through `copy(slice(q, ..), rope(..))`. The op's lowering fuses with that scatter (Inductor
writes each row once), but an opaque kernel cannot: it writes the rotated slice and the scatter copies it into q
again. For those backends a group whose every member is such a write becomes one `auto_functionalized` call of
`rope_fusion::rotary*_slice_` (ops/slice_write.py), which rotates the slices of the bases in place; its results
(the written bases) replace the scatters. Inductor's reinplacing then writes into each base where nothing reads it
afterwards and clones it where something does, so a base read again still reads its old values.

What is recognised: the op's x is itself `slice(base, dim, start, end)` along a dim before the lanes, with unit
step and bounds known to lie in the base (static, or symbolic and proven so without a guard: `q[:, :, t:]` with a
symbolic text length t, the end of a dynamic sequence); the replaced node's only use is the scatter into the same
rows of the same base (through one `copy` into a slice of those rows), in the base's dtype and the slice's shape,
into a base the op may write in place (passes/folds/written_bases.py). Anything else is left as it was, and says why.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...fx_sizes import as_int
from ...ops.schema import TENSOR_NAMES
from ...ops.slice_write import INTO_OPS, SLICE_OPS, WrittenCall, emit_node, warm_written
from .written_bases import base_reason, shared_reason

aten = torch.ops.aten


@dataclasses.dataclass
class SliceWrite:
    """Where one site's rotation is written: rows [start, end) of `base` along `dim`; `scatter` is the node whose
    value (the written base) the fold's result replaces. Under dynamic shapes a bound may be a SymInt (a text
    length `t` of `q[:, :, t:]`, the end of a sequence): `start_arg` and `end_arg` are what the graph holds for it
    (an int, or the node that computes it; None for the base's own size along `dim`)."""

    base: fx.Node
    dim: int
    start: Any
    end: Any
    scatter: fx.Node
    start_arg: Any = None
    end_arg: Any = None

    def describe(self) -> str:
        return f"{self.base.name}[dim {self.dim}, {self.start}:{self.end}]"


_END = (1 << 63) - 1  # a slice to the end, as the graph spells it


def _known(cond) -> bool:
    return bool(cond) if isinstance(cond, bool) else statically_known_true(cond)


def _value(arg) -> Any:
    """A bound as an int or a SymInt (a node's value), None for anything else."""
    if isinstance(arg, int):
        return arg
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return val if isinstance(val, (int, torch.SymInt)) else None


def _bounds(base: fx.Node, dim, start, end, step) -> tuple | None:
    """(dim, start, end, start_arg, end_arg) of a unit-step slice, as the slice reads them: static bounds clamped to
    the base's size as `slice` clamps them, symbolic ones only where they provably lie in [0, size] without a
    guard. None where that cannot be shown."""
    shape = base.meta["val"].shape
    nd = len(shape)
    if not isinstance(dim, int) or not -nd <= dim < nd or step not in (None, 1):
        return None
    dim %= nd
    size, lo, hi = shape[dim], _value(0 if start is None else start), _value(_END if end is None else end)
    if lo is None or hi is None:
        return None
    static = as_int(size)
    if static is not None and isinstance(lo, int) and isinstance(hi, int):
        lo = min(max(lo + static if lo < 0 else lo, 0), static)
        hi = min(max(hi + static if hi < 0 else hi, lo), static)
        return dim, lo, hi, lo, hi
    start_arg = 0 if start is None else start
    if isinstance(hi, int) and hi >= _END:  # to the end: the base's size
        hi, end_arg = size, None
    else:
        end_arg = end
    if not (_known(lo >= 0) and _known(lo <= hi) and _known(hi <= size)):
        return None
    return dim, lo, hi, start_arg, end_arg


def _same(a, b) -> bool:
    """Two bounds known equal without a guard."""
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b) or _known(a == b)


def _slice_of(node: fx.Node) -> tuple | None:
    """(base, (dim, start, end, start_arg, end_arg)) of a unit-step `slice.Tensor` node whose bounds are known."""
    if node.target is not aten.slice.Tensor or not isinstance(node.args[0], fx.Node):
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    base, dim, start, end, step = args[:5]
    b = _bounds(base, 0 if dim is None else dim, start, end, step)
    return None if b is None else (base, b)


def _same_rows(a: tuple | None, b: tuple | None) -> bool:
    """Two slices of one base over the same rows, known without a guard."""
    return a is not None and b is not None and a[0] is b[0] and a[1][0] == b[1][0] and _same(a[1][1], b[1][1]) \
        and _same(a[1][2], b[1][2])


def slice_write(site_node: fx.Node, x: fx.Node) -> SliceWrite | str:
    """The slice write of one site (its replaced node, and x as the op reads it), or why it is not one."""
    target = _slice_of(x)
    if target is None:
        return "x is not a unit-step slice of a tensor with bounds known in range"
    base, (dim, start, end, start_arg, end_arg) = target
    if dim == len(base.meta["val"].shape) - 1:
        return "the slice runs along the lanes"
    src = site_node
    users = list(src.users)
    if len(users) == 1 and users[0].target is aten.copy.default and users[0].args[1] is src \
            and isinstance(users[0].args[0], fx.Node) and _same_rows(_slice_of(users[0].args[0]), target):
        src = users[0]
        users = list(src.users)
    if len(users) != 1 or users[0].target is not aten.slice_scatter.default or users[0].args[1] is not src:
        return "the rotation is not written back with slice_scatter alone"
    scatter = users[0]
    args = list(scatter.args) + [None] * (6 - len(scatter.args))
    sbase, sdim, sstart, send, sstep = args[0], args[2], args[3], args[4], args[5]
    if sbase is not base:
        return "it is written into another tensor than the one its x is sliced from"
    got = _bounds(base, 0 if sdim is None else sdim, sstart, send, sstep)
    if not _same_rows((base, got) if got is not None else None, target):
        return "it is written into other rows than its x is read from"
    bv, sv = base.meta["val"], site_node.meta["val"]
    if sv.dtype != bv.dtype or src is site_node and not all(
            _same(a, b) for a, b in zip(sv.shape, x.meta["val"].shape)) or sv.dim() != x.meta["val"].dim():
        return f"the rotation is {sv.dtype} of shape {tuple(sv.shape)}, its slice of the base {bv.dtype}"
    if _known(end == start):
        return "the slice is empty"
    why = base_reason(base, {scatter, src} - {site_node}, site_node)
    if why is not None:
        return why
    return SliceWrite(base, dim, start, end, scatter, start_arg, end_arg)


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
    """The fold: one `auto_functionalized` call of the slice op of the call's arity; returns the written bases. A
    symbolic bound is passed as the node that computes it (the base's size as a `sym_size` of it)."""
    n = len(writes)
    bounds = [(w.dim, w.start_arg, em.size_args(w.base, range(w.dim, w.dim + 1), like)[0] if w.end_arg is None
               else w.end_arg) for w in writes]
    return emit_written(em, SLICE_OPS[n - 1], [w.base for w in writes] + list(call.tensors()[n:]), call, writes,
                        like, bounds)


def emit_written(em, op, tensors: list, call, writes: list, like: fx.Node, bounds: list | None = None) -> list:
    """The call of a slice-writing op (the slice op, or the into op of passes/folds/joined_writes.py): the device
    kernel's own node where it has one (`slice_write.emit_node`: on CUDA the Triton kernel's user-kernel node, each
    tensor written passed whole with its slice's offset), else one `auto_functionalized` call of the op: its tensors
    in schema order, the call's parameters, and each write's (dim, start, end) as graph arguments (`bounds`; by
    default the writes' own, ints). Returns the tensors it wrote, one per write."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    n = len(writes)
    bounds = bounds or [(w.dim, w.start, w.end) for w in writes]
    nodes = emit_node(em.graph, em.fake_mode, WrittenCall(list(tensors[:n]), call, list(bounds), op in INTO_OPS), like)
    if nodes is not None:  # the device kernel's own node, the bases whole: nothing of the op is left to warm
        return nodes
    names = [a.name for a in op._schema.arguments]
    kwargs = dict(zip(names, tensors + [None] * (len(names) - len(tensors))))  # every argument by name
    kwargs.update(call.params.kwargs())
    kwargs.update(slice_dims=[b[0] for b in bounds], slice_starts=[b[1] for b in bounds],
                  slice_ends=[b[2] for b in bounds])
    node = em.graph.call_function(auto_functionalized, (op,), kwargs)
    vals = fx.node.map_arg(kwargs, lambda a: a.meta["val"])
    if em.fake_mode is not None:
        with em.fake_mode:
            node.meta["val"] = auto_functionalized(op, **vals)
            warm_written(op, vals)  # its launches compile while Inductor compiles the graph
    else:
        node.meta["val"] = auto_functionalized(op, **vals)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):  # where the RoPE came from, as emission's
        if key in like.meta:
            node.meta[key] = like.meta[key]
    first = len(node.meta["val"]) - n  # the op's own result (None) comes before the written tensors
    return [em.call(operator.getitem, (node, first + i), like=like) for i in range(n)]
