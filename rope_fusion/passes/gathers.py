"""Tables gathered per token from a cache: `cache[positions]` seen through the ops between it and the table.

vLLM's rotary layers gather a `[max_pos, rotary_dim]` cos|sin cache by positions in every call
(`cos_sin_cache.index_select(0, positions).chunk(2, -1)`, then casts and unsqueezes). The op takes the cache
and the positions instead (docs/design.md section 2), so the gather and its copies are not materialised,
and two sites that gather the same cache by the same positions read provably the same table.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .fx_util import as_int
from .matcher import TableRef

aten = torch.ops.aten
prims = torch.ops.prims


# Ops between a gathered cache and the table the model multiplies by, that the op can see through: casts
# and copies (the op reads the cache in its own dtype: one rounding less), size-1 dims, lane windows.
_GATHER_CARRIERS = {prims.convert_element_type.default, aten.clone.default, aten.alias.default,
                    aten.unsqueeze.default}


def _lane_window(node: fx.Node, start: int, step: int) -> tuple | None:
    """(source, start, step): lanes [start::step] of `node` are these lanes of `source`, through one op."""
    t = node.target
    if t in _GATHER_CARRIERS:
        if t is aten.unsqueeze.default and node.args[1] in (-1, node.meta["val"].dim() - 1):
            return None
        return node.args[0], start, step
    if t is operator.getitem and isinstance(node.args[0], fx.Node) and \
            node.args[0].target in (aten.split.Tensor, aten.split_with_sizes.default):
        split = node.args[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim not in (-1, split.args[0].meta["val"].dim() - 1):
            return None
        sizes = split.args[1]
        sizes = [sizes] * (node.args[1] + 1) if not isinstance(sizes, (list, tuple)) else sizes
        sizes = [as_int(s.meta["val"] if isinstance(s, fx.Node) else s, specialize=True) for s in sizes]
        if None in sizes:
            return None
        return split.args[0], start + sum(sizes[: node.args[1]]), step
    if t is aten.slice.Tensor and node.args[1] in (-1, node.args[0].meta["val"].dim() - 1):
        s0 = as_int(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else 0
        st = as_int(node.args[4]) if len(node.args) > 4 else 1
        if s0 is None or st is None:
            return None
        return node.args[0], s0 + start * st, step * st
    return None


@dataclasses.dataclass(frozen=True)
class Gather:
    """A table that is the lanes [start::step] of rows of a 2-D cache picked by positions."""

    cache: fx.Node
    positions: fx.Node
    start: int
    step: int


def gather_of(node: fx.Node, t: TableRef) -> Gather | None:
    """The gather the table `t` (read from `node`) comes from, through the carriers above, or None: vLLM's
    `cos_sin_cache.index_select(0, positions).chunk(2, -1)`, `embedding`, `cache[positions]`."""
    shape = node.meta["val"].shape
    if t.as_real or t.partner or any(as_int(d) != 1 for d in shape[len(shape) - t.k:-1]):
        return None  # only the last of the table's grid dims may hold lanes
    start, step = t.start, t.step
    for _ in range(16):
        if node.target is aten.index.Tensor and len(node.args[1]) == 1 and node.args[1][0] is not None:
            cache, (pos,) = node.args[0], node.args[1]
        elif node.target is aten.index_select.default and node.args[1] in (0, -2):
            cache, pos = node.args[0], node.args[2]
        elif node.target is aten.embedding.default:
            cache, pos = node.args[0], node.args[1]
        else:
            hop = _lane_window(node, start, step)
            if hop is None:
                return None
            node, start, step = hop
            continue
        cval, pval = cache.meta.get("val"), pos.meta.get("val")
        if cval is None or pval is None or cval.dim() != 2 or pval.dtype not in (torch.int32, torch.int64):
            return None
        return Gather(cache, pos, start, step)
    return None
