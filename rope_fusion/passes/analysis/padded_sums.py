"""A sum of values padded with zero rows, as one padded sum: the backward of a rotation of a row slice.

The gradient of `rope(y[:, 2:])` with respect to y is the rotation's backward padded with zero rows. Where the
forward reads the slice twice (`y[:, 2:] * cos + rotate_half(y[:, 2:]) * sin`: two slice nodes), autograd pads
each product's gradient on its own and adds them:

    add(slice_scatter(zeros, g * cos, 1, 2), slice_scatter(zeros, rotate_half_T(g * sin), 1, 2))

Neither operand is a rotation, and the sum pads along a sequence dim, which the lane algebra does not enumerate:
the backward's rotation was neither fused nor reported (CogVideoX-style row slices, under Inductor and
`rope_fusion.backend`). Both operands pad the same rows of the same zeros, so the sum is the padded sum of their
sources, exactly (rows outside the slice are 0 + 0 = 0 either way, and rows inside add the same two numbers):

    slice_scatter(zeros, g * cos + rotate_half_T(g * sin), 1, 2)

`merge_padded_sums` rewrites the graph so: the rotation is then a node, the site, and its padding a scatter of its
result into zeros that Inductor fuses into the rotation's consumer as it fused the two before. It runs before the
analysis on every graph; where no rotation results, the graph computes the same numbers with one scatter less.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...fx_nodes import meta
from ...fx_sizes import norm_dim, same_dim

aten = torch.ops.aten

SUMS = (aten.add.Tensor, aten.sub.Tensor)
# scatters into a base, by the position of their first placement argument (dim, then start/end/step or index)
PADS = (aten.slice_scatter.default, aten.select_scatter.default)
# ops whose result is zeros everywhere (with the fill value their position, where they take one)
_ZEROS = {aten.zeros.default: None, aten.zeros_like.default: None, aten.new_zeros.default: None,
          aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}


def merge_padded_sums(graph: fx.Graph) -> int:
    """Rewrite every sum of two values padded alike with zeros as the padded sum (module docstring), sums of sums
    included; returns how many were rewritten. The nodes replaced are left dead for the pass's dead-code sweep."""
    merged = 0
    pending = [n for n in graph.nodes if n.op == "call_function" and n.target in SUMS][::-1]  # graph order
    while pending:
        node = pending.pop()
        summed = _merge(graph, node)
        if summed is not None:
            merged += 1
            pending.append(summed)  # the sources may themselves be padded alike (a slice of two dims)
    return merged


def _merge(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """The sum of the two padded values' sources, with `node`'s uses moved to its padding; None where `node` is
    not such a sum."""
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args) or set(node.kwargs) - {"alpha"}:
        return None
    first, second = node.args
    if not _padded_alike(first, second, meta(node)):
        return None
    a, b = first.args[1], second.args[1]
    with graph.inserting_before(node):
        summed = graph.call_function(node.target, (a, b), dict(node.kwargs))
        summed.meta = {k: v for k, v in node.meta.items() if k != "val"}
        summed.meta["val"] = meta(a).new_empty(meta(a).shape)
        padded = graph.call_function(first.target, (first.args[0], summed, *first.args[2:]), dict(first.kwargs))
        padded.meta = dict(node.meta)
    node.replace_all_uses_with(padded)
    return summed


def _padded_alike(first: fx.Node, second: fx.Node, out) -> bool:
    """Both are the same scatter (rows, dim, step or index) of a value into zeros of one shape and dtype, and the
    sum keeps that dtype."""
    if first.target not in PADS or second.target is not first.target or first.kwargs != second.kwargs:
        return False
    vals = [meta(n) for n in (first, second, first.args[0], second.args[0], first.args[1], second.args[1])]
    if not all(isinstance(v, torch.Tensor) for v in vals) or not isinstance(out, torch.Tensor):
        return False
    if len({v.dtype for v in vals} | {out.dtype}) != 1 or not all(_zeros(n) for n in (first.args[0], second.args[0])):
        return False
    ndim = vals[0].dim()
    if _placement(first, ndim) != _placement(second, ndim):
        return False
    return all(_same_shape(x, y) for x, y in ((vals[2], vals[3]), (vals[4], vals[5]), (vals[0], out)))


def _placement(node: fx.Node, ndim: int) -> tuple:
    """The scatter's dim (normalised) and its rows (start, end, step; or the index), as given."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return (norm_dim(dim, ndim), *node.args[3:])


def _same_shape(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dim() == y.dim() and all(same_dim(a, b) for a, b in zip(x.shape, y.shape))


def _zeros(node: fx.Node) -> bool:
    """Whether the node holds zeros everywhere: a zeros op, or a full of 0."""
    if node.op != "call_function" or node.target not in _ZEROS:
        return False
    at = _ZEROS[node.target]
    if at is None:
        return True
    value = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


__all__ = ["merge_padded_sums"]
