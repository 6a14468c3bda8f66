"""A joined x read from its pieces by the fused node (docs/design.md 4.4).

Flux and Flux.2 norm the text and image q (and k) apart, join them along the sequence dim and rotate the join:
`rope(cat([norm_t(q_txt), norm_i(q_img)], 1))`. The op's lowering fuses the cat, the norms and the rotation into
one Inductor kernel, so nothing is gained there; an opaque kernel cannot fuse: the cat is a read and a write of q
and k of its own beside the rotation, and each piece's norm stays in the graph too (the norm fold sees the cat, not
a norm). For a backend whose `folds` name it (the Triton kernel) a group whose every x is such a cat becomes
one call of `rope_fusion::rotary*_cat` (ops/cat_rotary.py), which reads the pieces and writes the joined rotation
(on CUDA as the kernel's own user-kernel node, `cat_rotary.emit_node`);
each piece's RMSNorm folds into it (its own weight) where every piece's would fold on its own
(passes/analysis/norms.py's proof, one norm kind and eps for all), and stays in the graph otherwise, the cat
still folded.

What is recognised: x as the op reads it is itself `cat([a, b], dim)`, two pieces of one dtype (the cat's), along a
dim before the lanes, each of static, non-zero length, the first pieces of q and k of one length, the join used
only by the rotation; the kernel must take the call (`triton_cat.why_not`). Anything else keeps the cat, and the
kernel's report line says why ("cat not folded: ..."). Only two pieces: every model that joins q so joins text and
image, and the kernel takes each piece's pointer and strides as arguments of their own.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ...fx_sizes import as_int
from ...ops import cat_rotary
from ...ops.cat_rotary import CAT_OPS, CatCall
from ...ops.schema import TENSOR_NAMES, RotaryCall
from ..analysis.norms import dies_with, norm_prologue
from ..fx_util import PASS_THROUGH

aten = torch.ops.aten


@dataclasses.dataclass
class Join:
    """One x that is `cat([first, second], dim)`: the cat node and its two pieces as the graph holds them."""

    cat: fx.Node
    first: fx.Node
    second: fx.Node
    dim: int

    @property
    def pieces(self) -> tuple:
        return self.first, self.second


def _used_by_rotation_only(cat: fx.Node, replaced: fx.Node, depends_on: Callable) -> bool:
    """Whether every value computed from the join on the way to the rotation serves the rotation alone: then the
    join dies with it."""
    todo, seen = [cat], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u is replaced or u in seen:
                continue
            if not depends_on(replaced, u):
                return False
            seen.add(u)
            todo.append(u)
    return True


def _through_views(x: fx.Node) -> fx.Node | None:
    """The cat that x is a layout view of (x itself not a cat), else None."""
    n = x
    for _ in range(8):
        if n.target not in PASS_THROUGH or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]
        if n.target is aten.cat.default:
            return n
    return None


def join_of(x: fx.Node, replaced: fx.Node, depends_on: Callable) -> Join | str | None:
    """The join that x (as the op reads it) is, why it is not one the op reads, or None where x is no join."""
    if x.target is not aten.cat.default:
        if _through_views(x) is not None:
            return "x reads the joined tensor through a view (the op reads a join only as it is)"
        return None
    pieces = x.args[0]
    dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    val = x.meta["val"]
    nd = val.dim()
    dim = dim % nd if nd else 0
    if nd < 2 or dim == nd - 1:
        return "the pieces join along the lanes"
    if len(pieces) != 2 or not all(isinstance(p, fx.Node) for p in pieces):
        return f"a cat of {len(pieces)} pieces: the op reads two"
    vals = [p.meta["val"] for p in pieces]
    if any(v.dtype != val.dtype for v in vals) or any(v.dim() != nd for v in vals):
        return (f"the pieces are {' and '.join(str(v.dtype) for v in vals)}, joined as {val.dtype} "
                "(the op reads pieces of the join's dtype)")
    sizes = [as_int(v.shape[dim]) for v in vals]
    if any(s is None or s == 0 for s in sizes):
        return "a piece is empty or of symbolic length along the join"
    if not _used_by_rotation_only(x, replaced, depends_on):
        return "the joined tensor is used elsewhere too (the cat stays)"
    return Join(x, pieces[0], pieces[1], dim)


def group_joins(group: tuple, xs: list, inputs: list, depends_on: Callable) -> list | str | None:
    """Every member's join, why the group's are not folded, or None where no member's x is a join."""
    found = [join_of(x, m.node, depends_on) for m, x in zip(group, inputs)]
    if all(f is None for f in found):
        return None
    names = TENSOR_NAMES[len(group)]
    if len(group) > 2:
        return "the op reads joins of x, or of q and k, not of three tensors"
    for name, f in zip(names, found):
        if f is None:
            return f"{name}'s x is not a join" if len(group) > 1 else "x is not a join"
        if isinstance(f, str):
            return f if len(group) == 1 else f"{name}: {f}"
    if any(x is not i for x, i in zip(xs, inputs)):
        return "the op would read the join cast to the dtype the rotation computes in"
    if len({f.dim for f in found}) > 1:
        return "q and k join along different dims"
    if len({as_int(f.first.meta["val"].shape[f.dim]) for f in found}) > 1:
        return "the first pieces of q and k differ in length"
    return found


@dataclasses.dataclass
class PieceNorms:
    """The norms of every piece that fold (per member: first's, second's), or why they stay in the graph."""

    norms: list | None
    why: str = ""


def piece_norms(group: tuple, joins: list, depends_on: Callable) -> PieceNorms:
    """Each piece's norm folds where every piece's would on its own (passes/analysis/norms.py), with one kind and
    eps."""
    found = [[norm_prologue(p, m.x.head_dim, m.x.blocks, m.x.k) for p in j.pieces] for m, j in zip(group, joins)]
    flat = [f for pair in found for f in pair]
    if all(f is None for f in flat):
        return PieceNorms(None)
    reasons = [f for f in flat if isinstance(f, str)]
    if reasons:
        return PieceNorms(None, reasons[0])
    if any(f is None for f in flat):
        return PieceNorms(None, "some pieces are normed, others not (the op has one norm)")
    if len({(f.kind, f.eps) for f in flat}) > 1:
        return PieceNorms(None, "the pieces are normed differently")
    if len({f.weight is None for f in flat}) > 1:
        return PieceNorms(None, "some pieces' norms have a weight, others not")
    if not all(dies_with(f, m.node, depends_on) for m, pair in zip(group, found) for f in pair):
        return PieceNorms(None, "a piece's norm is used elsewhere too (kept in the graph; folding would read x twice)")
    return PieceNorms(found)


def cat_call(call: RotaryCall, firsts: list, seconds: list, weights: list | None, second_weights: list,
             dims: list) -> CatCall:
    """The cat op's call on graph values (their fake values: what `triton_cat.why_not` plans on)."""
    def val(t: Any) -> Any:
        return t.meta["val"] if isinstance(t, fx.Node) else t
    fake = RotaryCall([val(x) for x in firsts], val(call.cos), val(call.sin), call.params, val(call.positions),
                      [val(w) for w in weights] if weights else None)
    return CatCall(fake, [val(y) for y in seconds], [val(w) for w in second_weights], dims)


def emit_cat(em: Any, call: RotaryCall, firsts: list, seconds: list, weights: list | None, second_weights: list,
             dims: list, like: fx.Node) -> list:
    """The joined results of the cat op's call on the pieces: the device kernel's own node where it has one
    (`cat_rotary.emit_node`: the Triton kernel's user-kernel node, launched from the compiled graph's code as the
    main op's is), else one call of the cat op of the call's arity."""
    n = len(firsts)
    rot = RotaryCall(firsts, call.cos, call.sin, call.params, call.positions, weights)
    nodes = cat_rotary.emit_node(em.graph, em.fake_mode, CatCall(rot, list(seconds), list(second_weights), list(dims)),
                                 like)
    if nodes is not None:
        return nodes
    kwargs = dict(call.params.kwargs(), second_pieces=list(seconds), second_norm_weights=list(second_weights),
                  cat_dims=list(dims))
    op = CAT_OPS[n - 1]
    args = rot.tensors()
    node = em.graph.call_function(op, args, kwargs)
    vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])  # lists of nodes in the keywords too
    if em.fake_mode is not None:
        with em.fake_mode:
            node.meta["val"] = op(*vals[0], **vals[1])
            cat_rotary.warm(op, *vals)  # its launch compiles while Inductor compiles the graph
    else:
        node.meta["val"] = op(*vals[0], **vals[1])
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):  # where the RoPE came from, as emission's
        if key in like.meta:
            node.meta[key] = like.meta[key]
    if n == 1:
        return [node]
    return [em.call(operator.getitem, (node, i), like=like) for i in range(n)]


def describe(joins: list) -> str:
    """The report's fold line of a folded group."""
    return "cat folded: " + ", ".join(f"{j.cat.name}({j.first.name}, {j.second.name}; dim {j.dim})" for j in joins)


@dataclasses.dataclass
class JoinedFold:
    """A group's joins folded into the cat op: its joined results, the parameters it was called with, the report's
    fold line and what happened to the pieces' norms."""

    outs: list
    params: Any
    fold: str
    norm: str


__all__ = ["Join", "JoinedFold", "PieceNorms", "cat_call", "describe", "emit_cat", "group_joins", "join_of",
           "piece_norms"]
