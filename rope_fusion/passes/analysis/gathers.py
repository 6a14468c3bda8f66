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

from ...fx_sizes import as_int
from ..fx_util import PASS_THROUGH
from .site import TableRef

aten = torch.ops.aten
prims = torch.ops.prims


# Ops between a gathered cache and the table the model multiplies by, that the op can see through: of the
# pass-through ops, the cast and the copies (the op reads the cache in its own dtype: one rounding less) and size-1
# dims, each of which `_lane_window` maps lane by lane (lane windows are read from slices apart).
_GATHER_CARRIERS = PASS_THROUGH & {prims.convert_element_type.default, aten.clone.default, aten.alias.default,
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
        sizes = [as_int(s.meta["val"] if isinstance(s, fx.Node) else s) for s in sizes]
        if None in sizes:
            return None
        return split.args[0], start + sum(sizes[: node.args[1]]), step
    if t is aten.slice.Tensor and node.args[1] in (-1, node.args[0].meta["val"].dim() - 1):
        s0 = _slice_start(node)
        st = as_int(node.args[4]) if len(node.args) > 4 else 1
        if s0 is None or st is None:
            return None
        return node.args[0], s0 + start * st, step * st
    return None


# Ops that Inductor decomposes into `cache[positions]` but that raise on a negative position in eager (by name:
# the node's `original_aten` may be a copy of the overload, which compares by identity)
_RAISE_ON_NEGATIVES = {"aten::index_select", "aten::embedding"}


def _wraps_negatives(index: fx.Node) -> bool:
    """Whether the model's gather wraps a negative position, as `cache[positions]` does in eager. Inductor
    decomposes `index_select` into an index (which would wrap); its node remembers the op it came from, and
    then the positions are taken as eager's index_select takes them (a negative one raises)."""
    original = index.meta.get("original_aten")
    return not (isinstance(original, torch._ops.OpOverload) and original.name() in _RAISE_ON_NEGATIVES)


def _slice_start(node: fx.Node) -> int | None:
    """The first lane of `slice(x, -1, start, ...)` as an index into x's lanes: a negative start counts from
    the end (`cs[..., -(D // 2):]` is lane D // 2 of D), clamped to [0, lanes] as slicing clamps it; None where
    that needs a size that is not concrete."""
    arg = node.args[2] if len(node.args) > 2 else None
    if arg is None:
        return 0
    s0 = as_int(arg.meta["val"] if isinstance(arg, fx.Node) else arg)
    if s0 is None:
        return None
    if s0 >= 0:
        return s0
    lanes = as_int(node.args[0].meta["val"].shape[-1])
    return None if lanes is None else max(s0 + lanes, 0)


@dataclasses.dataclass(frozen=True)
class Gather:
    """A table that is the lanes [start::step] of rows of a 2-D cache picked by positions.

    `wraps`: the model indexed the cache as `cache[positions]`, which reads row `rows + p` for a negative
    position p (>= -rows); `index_select` and `embedding` raise on it instead. The op's own rule is
    0 <= p < rows for every backend (a position outside raises, as plain compile does), so the positions the
    op takes are wrapped first where the model's gather wraps (`op_positions`)."""

    cache: fx.Node
    positions: fx.Node
    start: int
    step: int
    wraps: bool = False

    def same_rows(self, other: Gather) -> bool:
        """Both read the same rows for every position: one cache, one positions tensor, one indexing form."""
        return (self.cache, self.positions, self.wraps) == (other.cache, other.positions, other.wraps)


def op_positions(em, g: Gather, like: fx.Node) -> fx.Node:
    """The positions as the op takes them: a negative position p of a wrapping gather becomes rows + p, as
    eager reads it (one below -rows stays negative, and the op raises where eager raises); others as they are."""
    if not g.wraps:
        return g.positions
    (rows,) = em.size_args(g.cache, range(1), like)
    negative = em.call(aten.lt.Scalar, (g.positions, 0), like=like)
    wrapped = em.call(aten.add.Tensor, (g.positions, rows), like=like)
    return em.call(aten.where.self, (negative, wrapped, g.positions), like=like)


def gather_of(node: fx.Node, t: TableRef) -> Gather | None:
    """The gather the table `t` (read from `node`) comes from, through the carriers above, or None: vLLM's
    `cos_sin_cache.index_select(0, positions).chunk(2, -1)`, `embedding`, `cache[positions]`."""
    shape = node.meta["val"].shape
    if t.as_real or t.partner or any(as_int(d) != 1 for d in shape[len(shape) - t.k:-1]):
        return None  # only the last of the table's grid dims may hold lanes
    start, step = t.start, t.step
    for _ in range(16):
        wraps = False
        if node.target is aten.index.Tensor and len(node.args[1]) == 1 and node.args[1][0] is not None:
            cache, (pos,), wraps = node.args[0], node.args[1], _wraps_negatives(node)
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
        return Gather(cache, pos, start, step, wraps)
    return None
