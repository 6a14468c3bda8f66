"""A rotation joined after it is computed, written into the join by the fused node (docs/design.md 4.5).

HunyuanVideo's dual-stream blocks rotate the image q and k and then join the text stream after them,
`cat([rope(q_img), q_txt], 2)`; Qwen-Image rotates both streams, each with its own tables, and joins them,
`cat([rope(q_txt), rope(q_img)], 1)`. The op's lowering is pointwise, and Inductor's cat writes each piece's kernel
straight into the joined buffer. An opaque kernel cannot be fused so: it writes the rotation, and the cat reads it
and writes it once more. For a backend whose `folds` name it (the Triton kernel) a group whose every
member's rotation is read by a cat alone becomes one `auto_functionalized` call of `rope_fusion::rotary*_into_`
(ops/slice_write.py), which writes each rotation into its rows of the joined tensor. The joined tensor starts as
`empty` in the cat's shape and strides; the groups that write into one cat are chained (each writes into the
tensor the one before it wrote), and once every group is planned the pieces no group wrote are scattered into
their rows (`slice_scatter`, which Inductor's reinplacing turns into a copy into a view of the joined tensor: the
copy the cat made of them) and the result replaces the cat (`finish_joins`).

What is recognised: the member's rotation has one use, a `cat` along a dim before the lanes that holds it once; the
cat's shape is static, every piece has the cat's dtype and rank; the op reads x in the rotation's shape (no view
between that the slice would have to take). In a q/k group, a member whose rotation is not joined (PRX joins k
alone) is written whole into a fresh tensor of its own, as the op would return it. Anything else keeps the cat,
and the kernel's report line says why ("joined write not folded: ...").
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ...fx_sizes import as_int
from ...ops.schema import TENSOR_NAMES
from ...ops.slice_write import INTO_OPS
from .slice_writes import emit_written

aten = torch.ops.aten


@dataclasses.dataclass
class JoinedWrite:
    """Where one member's rotation lands: rows [start, end) along `dim` of the tensor `cat` joins; with `cat`
    None, a member of a group whose other members are joined, written whole into a fresh tensor of its own
    (`shape`, contiguous, as the op would return it)."""

    cat: fx.Node | None
    dim: int
    start: int
    end: int
    shape: tuple = ()

    def describe(self) -> str:
        if self.cat is None:
            return "its own tensor"
        return f"{self.cat.name}[dim {self.dim}, {self.start}:{self.end}]"


def _own(x: fx.Node) -> JoinedWrite | str:
    """A member not joined after its rotation, in a group whose others are: written whole into a fresh tensor."""
    shape = [as_int(s) for s in x.meta["val"].shape]
    if len(shape) < 2 or any(s is None for s in shape):
        return "the rotation is not joined after it, and its shape is symbolic"
    return JoinedWrite(None, 0, 0, shape[0], tuple(shape))


@dataclasses.dataclass
class PendingJoin:
    """A cat some groups write into: the joined tensor as the last of them left it, and the rows written."""

    buffer: fx.Node
    written: set


def _cat_args(cat: fx.Node) -> tuple[list, int]:
    pieces = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return list(pieces), dim


def joined_write(site_node: fx.Node, x: fx.Node) -> JoinedWrite | str | None:
    """The rows of a join that a site's rotation is copied into, why they cannot be written directly, or None
    where the rotation is not joined after it."""
    users = list(site_node.users)
    cats = [u for u in users if u.target is aten.cat.default]
    if not cats:
        return None
    if len(users) != 1:
        return "the rotation is read by more than the cat that joins it"
    cat = cats[0]
    pieces, dim = _cat_args(cat)
    if pieces.count(site_node) != 1:
        return "the rotation is joined more than once"
    val = cat.meta["val"]
    nd = val.dim()
    if not isinstance(dim, int) or not -nd <= dim < nd:
        return "the join's dim is not a static dim of the joined tensor"
    dim %= nd
    if dim == nd - 1:
        return "the join runs along the lanes"
    if any(as_int(s) is None for s in val.shape) or any(as_int(s) is None for s in val.stride()):
        return "the joined tensor's shape is symbolic"
    sizes = []
    for p in pieces:
        pv = p.meta.get("val") if isinstance(p, fx.Node) else None
        if not isinstance(pv, torch.Tensor) or pv.dim() != nd or pv.dtype != val.dtype:
            return "a piece of the join has another rank or dtype than the joined tensor"
        sizes.append(as_int(pv.shape[dim]))
    i = pieces.index(site_node)
    if tuple(x.meta["val"].shape) != tuple(site_node.meta["val"].shape):
        return "the op reads x in another shape than the rotation's result (a view between them)"
    start = sum(sizes[:i])
    return JoinedWrite(cat, dim, start, start + sizes[i])


def group_joined_writes(group: tuple, xs: list) -> list | str | None:
    """Every member's joined write, why the group's are not folded (the first member's reason, named), or None
    where no member's rotation is joined after it. A member not joined, in a group whose others are, is written
    whole into a tensor of its own (PRX joins k after its rotation, not q): the pair stays one launch."""
    found = [joined_write(m.node, x) for m, x in zip(group, xs)]
    if all(f is None for f in found):
        return None
    names = TENSOR_NAMES[len(group)]
    found = [_own(x) if f is None else f for f, x in zip(found, xs)]  # PRX joins k after its rotation, not q
    for name, f in zip(names, found):
        if isinstance(f, str):
            return f if len(group) == 1 else f"{name}: {f}"
    cats = [id(f.cat) for f in found if f.cat is not None]
    if len(set(cats)) != len(cats):
        return "two of the rotations are joined into one tensor"
    return found


def _buffer(em, pending: dict, cat: fx.Node, like: fx.Node) -> fx.Node:
    """The joined tensor a group writes into: as the last group left it, else a new `empty` in the cat's shape,
    strides, dtype and device."""
    if cat in pending:
        return pending[cat].buffer
    val = cat.meta["val"]
    return em.call(aten.empty_strided.default, ([as_int(s) for s in val.shape], [as_int(s) for s in val.stride()]),
                   dict(dtype=val.dtype, device=val.device), like=like)


def _own_tensor(em, w: JoinedWrite, x: fx.Node, dtype: torch.dtype, like: fx.Node) -> fx.Node:
    """A fresh contiguous tensor of x's shape in the op's out dtype: what the op would have returned."""
    return em.call(aten.empty.memory_format, (list(w.shape),),
                   dict(dtype=dtype, device=x.meta["val"].device), like=like)


def emit_joined_write(em, pending: dict, call, writes: list, like: fx.Node) -> tuple[list, dict]:
    """The fold: one `auto_functionalized` call of the into op of the call's arity, writing into each member's
    joined tensor. Returns, per member, the view of its rows (what the cat read from the rotation), and the pending
    joins to record once the group is planned."""
    n = len(writes)
    bases = [_own_tensor(em, w, x, call.params.out_dtype, like) if w.cat is None else _buffer(em, pending, w.cat, like)
             for w, x in zip(writes, call.xs)]
    written = emit_written(em, INTO_OPS[n - 1], bases + list(call.tensors()), call, writes, like)
    rows = [b if w.cat is None else em.call(aten.slice.Tensor, (b, w.dim, w.start, w.end), like=like)
            for b, w in zip(written, writes)]
    updates = {}
    for b, w in zip(written, writes):
        if w.cat is None:
            continue
        before = pending.get(w.cat)
        updates[w.cat] = PendingJoin(b, (before.written if before else set()) | {(w.start, w.end)})
    return rows, updates


def finish_joins(em, pending: dict) -> None:
    """Every cat written into: the pieces no group wrote scattered into their rows of the joined tensor, and the
    result in the cat's place (before the cat, which then dies)."""
    for cat, join in pending.items():
        pieces, dim = _cat_args(cat)
        dim %= cat.meta["val"].dim()
        out, start = join.buffer, 0
        with em.graph.inserting_before(cat):
            for p in pieces:
                size = as_int(p.meta["val"].shape[dim])
                if (start, start + size) not in join.written and size:
                    out = em.call(aten.slice_scatter.default, (out, p, dim, start, start + size), like=cat)
                start += size
        cat.replace_all_uses_with(out)
