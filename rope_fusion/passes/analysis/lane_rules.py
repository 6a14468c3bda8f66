"""Transfer rules of the lane algebra: how each post-grad op maps the lanes of its inputs to its own.

Each rule takes the interpreter and an FX node and returns a LaneValue (or a list, for unbind/split), or
raises Unsupported, which makes the node a source. Rules keep the right-aligned meaning of atoms: they
either leave the leading dims alone or pull a leading dim into the lane grid first (`promote`).
Importing this module registers the rules (`@lane_rule`) in `lanes.RULES`.

In the examples, x is a source with 4 lanes (x0, x1, x2, x3) in its last dim, unless stated otherwise.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ...fx_nodes import meta
from ...fx_sizes import as_int, norm_dim, same_dim
from . import poly
from .lanes import (
    LaneInterpreter,
    LaneValue,
    Unsupported,
    grid_indices,
    lane_dims,
    lane_relations,
    lane_rule,
    row_major_strides,
    small_sum_dims,
)

aten = torch.ops.aten
prims = torch.ops.prims


def _lane_int(arg):
    """A slice bound or size along a lane dim: an int, or a symbolic value specialized to its hint."""
    if arg is None or isinstance(arg, int):
        return arg
    val = meta(arg) if isinstance(arg, fx.Node) else arg
    out = as_int(val, specialize=True)
    return out if out is not None else arg


def _out_shape(node) -> tuple:
    val = meta(node)
    if not isinstance(val, torch.Tensor):
        raise Unsupported("no tensor meta")
    return tuple(val.shape) + ((2,) if val.dtype.is_complex else ())


def _check_float(node) -> None:
    val = meta(node)
    if not isinstance(val, torch.Tensor) or not (val.dtype.is_floating_point or val.dtype.is_complex):
        raise Unsupported("not a float tensor")


# -- elementwise ---------------------------------------------------------------------------------

def _is_gather(value: LaneValue) -> bool:
    """Every lane is one source lane as it is: a table or a view of x, not arithmetic (a lane holding -sin,
    as a 2x2 rotation-matrix table does, is arithmetic: its sign must stay visible)."""
    return all(e is not None and len(e) == 1 and next(iter(e.items()))[1] == 1.0 and len(next(iter(e))) == 1
               for e in value.entries)


def _broadcast_entries(value: LaneValue, grid: tuple) -> list:
    """The value's entries over `grid` (same rank), replicating size-1 grid dims."""
    if tuple(value.grid) == tuple(grid):
        return value.entries
    strides = row_major_strides(value.grid)
    out = []
    for index in grid_indices(grid):
        flat = sum((0 if value.grid[axis] == 1 else index[axis]) * strides[axis] for axis in range(len(grid)))
        out.append(value.entries[flat])
    return out


def _align(interp: LaneInterpreter, node, values: list, args: list | None = None) -> tuple:
    """Promote operands to one grid rank and broadcast them to the node's grid. Where an operand cannot be
    promoted (a symbolic leading dim), the operands of more grid dims whose extra dims all have size 1 are
    taken as sources of the lower rank instead (`_unbroadcast_grid`)."""
    shape = _out_shape(node)
    k = max(value.k for value in values)
    k = min(k, len(shape))
    try:
        values = [interp.promote(value, k) if value.k < k and len(value.shape) > value.k else value
                  for value in values]
    except Unsupported:
        if args is None:
            raise
        values, k = _unbroadcast_grid(interp, values, args)
    grid = tuple(lane_dims(shape[len(shape) - k:]))
    if math.prod(grid) > interp.max_lanes:
        raise Unsupported("too many lanes")
    out = []
    for value in values:
        value_grid = tuple(value.grid)
        if len(value_grid) < k:  # a 0-dim (or lower-rank) operand
            value_grid = (1,) * (k - len(value_grid)) + value_grid
            value = LaneValue((1,) * (k - value.k) + value.shape, k, value.entries, value.is_complex, value.wide)
        if any(a != b and a != 1 for a, b in zip(value_grid, grid)):
            raise Unsupported("grids do not broadcast")
        out.append(_broadcast_entries(value, grid))
    return shape, k, out


def _unbroadcast_grid(interp: LaneInterpreter, values: list, args: list) -> tuple:
    """(values, grid rank) of operands aligned at the lowest grid rank among them, where promoting that one failed.

    Under dynamic=True every dim of x is symbolic, its heads dim too: `q [B, S, H, D] * cos.unsqueeze(1)` with a
    computed table ([S, 1, D], grid (1, D): its lanes keep their size-1 heads dim so that their atoms stay
    aligned) cannot absorb H into q's grid, and the product was a source: no rotation was seen, nor a near miss.
    An operand whose extra grid dims all have size 1 broadcasts over those dims; as a source of the lower rank
    (its own node's lanes, right-aligned like any source: [S, 1] pairs with [S, H]) it reads the same entries
    at every index of the result. Operands that are not nodes, or whose extra dims are not all size 1, leave
    the node a source as before."""
    low = min(value.k for value in values if len(value.shape) > value.k)
    if low < 1:
        raise Unsupported("symbolic leading dim")
    out = []
    for value, arg in zip(values, args):
        if value.k > low:
            if not isinstance(arg, fx.Node) or value.is_complex or any(size != 1 for size in value.grid[:-low]):
                raise Unsupported("symbolic leading dim")
            value = interp.raw(arg, low)
        out.append(value)
    return out, low


def _pointwise(interp, node, args, fn, complex_ok=False) -> LaneValue:
    values = [interp.value(arg) for arg in args]
    if any(value.is_complex for value in values) and not complex_ok:
        raise Unsupported("complex operand")
    return _pointwise_values(interp, node, values, fn, is_complex=any(value.is_complex for value in values),
                             args=list(args))


def _pointwise_values(interp, node, values, fn, is_complex=False, args=None):
    _check_float(node)
    shape, k, operand_entries = _align(interp, node, values, args)
    out = []
    for lane in zip(*operand_entries):
        if None in lane:  # (entries are dicts: `in` compares them to None by identity first, then ==)
            out.append(None)
            continue
        result = fn(*lane)
        if result is None:
            raise Unsupported("polynomial too large")
        out.append(result)
    return LaneValue(shape, k, out, is_complex, any(value.wide for value in values))


def _scalar_of(arg) -> float | None:
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    return None


@lane_rule(aten.add.Tensor)
def rule_add(interp, node):
    """Lanewise a + alpha*b, operands broadcast against each other.
    add(x, y, alpha=2) with y of 4 lanes: lanes (x0 + 2*y0, ..., x3 + 2*y3)."""
    alpha = node.kwargs.get("alpha", 1)
    return _pointwise(interp, node, node.args[:2], lambda a, b: poly.add(a, b, alpha), complex_ok=True)


@lane_rule(aten.sub.Tensor)
def rule_sub(interp, node):
    """Lanewise a - alpha*b.
    sub(x, y): lanes (x0 - y0, ..., x3 - y3)."""
    alpha = node.kwargs.get("alpha", 1)
    return _pointwise(interp, node, node.args[:2], lambda a, b: poly.add(a, b, -alpha), complex_ok=True)


@lane_rule(aten.rsub.Scalar)
def rule_rsub(interp, node):
    """Lanewise other - alpha*self (real operands only).
    rsub(x, 2.0): lanes (2 - x0, ..., 2 - x3)."""
    alpha = node.kwargs.get("alpha", 1)
    return _pointwise(interp, node, node.args[:2], lambda a, b: poly.add(b, a, -alpha))


@lane_rule(aten.neg.default)
def rule_neg(interp, node):
    """Every lane negated.
    neg(x): lanes (-x0, -x1, -x2, -x3)."""
    return _pointwise(interp, node, node.args[:1], lambda a: poly.scale(a, -1.0), complex_ok=True)


@lane_rule(aten.mul.Tensor, aten.mul.Scalar)
def rule_mul(interp, node):
    """Lanewise product (complex times complex as (re, im) pairs; a real factor scales both parts).
    mul(x, cos) with cos of 4 lanes: lanes (x0*cos0, ..., x3*cos3); mul(x, 3): (3*x0, ..., 3*x3)."""
    lhs, rhs = node.args[:2]
    value_a = interp.value(lhs)
    value_b = interp.value(rhs)
    if value_a.is_complex and value_b.is_complex:
        return _complex_mul(interp, node, value_a, value_b)
    if value_a.is_complex or value_b.is_complex:
        # complex times real: the real operand scales both parts
        cplx, real = (value_a, value_b) if value_a.is_complex else (value_b, value_a)
        real = LaneValue(real.shape + (1,), real.k + 1, real.entries, False, real.wide)
        return _pointwise_values(interp, node, [cplx, real], poly.mul, is_complex=True)
    return _pointwise_values(interp, node, [value_a, value_b], poly.mul, args=[lhs, rhs])


def _complex_mul(interp, node, value_a, value_b):
    shape = _out_shape(node)
    k = max(value_a.k, value_b.k)
    value_a, value_b = (_lower_rank_padded(value, k) if len(value.shape) <= value.k else interp.promote(value, k)
                        for value in (value_a, value_b))
    grid = tuple(lane_dims(shape[len(shape) - k:]))
    if any(a != b and a != 1 for value in (value_a, value_b) for a, b in zip(value.grid, grid)):
        raise Unsupported("grids do not broadcast")
    entries_a, entries_b = _broadcast_entries(value_a, grid), _broadcast_entries(value_b, grid)
    out = []
    for i in range(0, len(entries_a), 2):
        ar, ai, br, bi = entries_a[i], entries_a[i + 1], entries_b[i], entries_b[i + 1]
        if None in (ar, ai, br, bi):
            out += [None, None]
            continue
        rr, ii, ri, ir = poly.mul(ar, br), poly.mul(ai, bi), poly.mul(ar, bi), poly.mul(ai, br)
        if None in (rr, ii, ri, ir):
            raise Unsupported("polynomial too large")
        out += [poly.add(rr, ii, -1.0), poly.add(ri, ir)]
    return LaneValue(shape, k, out, True, value_a.wide or value_b.wide)


def _lower_rank_padded(value: LaneValue, k: int) -> LaneValue:
    """A value without leading dims given k grid dims by size-1 dims in front (broadcasting, as `_align` does
    for a lower-rank operand): complex freqs of one head's pairs, [D/2], times x viewed as [B, S, H, D/2]
    heads could not be promoted past their first dim, and the product was a source."""
    if value.k >= k:
        return value
    return LaneValue((1,) * (k - value.k) + value.shape, k, value.entries, value.is_complex, value.wide)


@lane_rule(aten.div.Tensor, aten.div.Scalar)
def rule_div(interp, node):
    """Division by a nonzero scalar constant scales every lane (a tensor divisor is unsupported).
    div(x, 2): lanes (x0/2, ..., x3/2)."""
    divisor = _scalar_of(node.args[1])
    if divisor is None or divisor == 0:
        raise Unsupported("division by a tensor")
    return _pointwise(interp, node, node.args[:1], lambda a: poly.scale(a, 1.0 / divisor), complex_ok=True)


@lane_rule(aten.addcmul.default)
def rule_addcmul(interp, node):
    """Lanewise self + value*t1*t2.
    addcmul(s, x, cos, value=0.5): lanes (s0 + 0.5*x0*cos0, ..., s3 + 0.5*x3*cos3)."""
    value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else 1)

    def fn(base, t1, t2):
        product = poly.mul(t1, t2)
        return None if product is None else poly.add(base, product, value)

    return _pointwise(interp, node, node.args[:3], fn)


@lane_rule(aten.sum.dim_IntList)
def rule_sum(interp, node):
    """A sum over grid dims of at most `lanes.SMALL_SUM_LANES` lanes adds their entries (a 2x2 matrix applied to
    pairs as a product and a sum, Kandinsky's `(F * x.reshape(..., D/2, 1, 2)).sum(-1)`); a sum over a leading
    dim or over many lanes (a norm's statistic, attention's softmax) is a new source.
    sum(v [2, 2] lanes (a, b, c, d), [-1]): grid (2,), lanes (a + b, c + d)."""
    _check_float(node)
    value = interp.value(node.args[0])
    dims = small_sum_dims(node)
    if dims is None or value.is_complex:
        raise Unsupported("a sum over many lanes")
    for d in dims:
        value = interp.ensure_dim_in_grid(value, d - len(value.shape))
    if value.k <= len(dims):  # a lane must be left: the dim in front joins the grid (a pair's row index)
        value = interp.promote(value, len(dims) + 1)
    first = len(value.shape) - value.k
    axes = [d - first for d in dims]
    grid = value.grid
    strides = row_major_strides(grid)
    kept = [a for a in range(len(grid)) if a not in axes]
    out = []
    for index in grid_indices(tuple(grid[a] for a in kept)):
        base = sum(i * strides[a] for i, a in zip(index, kept))
        total: dict = {}
        for picks in grid_indices(tuple(grid[a] for a in axes)):
            entry = value.entries[base + sum(i * strides[a] for i, a in zip(picks, axes))]
            if entry is None:
                raise Unsupported("a sum over a lane never written")
            total = poly.add(total, entry)
        if len(total) > poly.MAX_TERMS:
            raise Unsupported("polynomial too large")
        out.append(total)
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    k = value.k if keepdim else value.k - len(axes)
    return LaneValue(_out_shape(node), k, out, False, value.wide)


@lane_rule(aten.clone.default, aten.alias.default, aten.contiguous.default, aten.resolve_conj.default)
def rule_identity(interp, node):
    """The lanes of the first argument, unchanged (copies, aliases, layout changes).
    clone(x): lanes (x0, x1, x2, x3)."""
    _check_float(node)
    value = interp.value(node.args[0])
    return LaneValue(_out_shape(node), value.k, value.entries, value.is_complex, value.wide)


@lane_rule(prims.convert_element_type.default, aten._to_copy.default)
def rule_convert(interp, node):
    """A cast between real float dtypes keeps the lanes (a cast to fp64 marks the value wide).
    convert_element_type(x, float64): lanes (x0, x1, x2, x3); a cast to int is unsupported."""
    val = meta(node)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        raise Unsupported("cast to a non-float dtype")
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex cast")
    return LaneValue(_out_shape(node), value.k, value.entries, False, value.wide)


@lane_rule(aten.copy.default)
def rule_copy(interp, node):
    """copy(dst, src): src broadcast to dst's shape, converted to dst's dtype.
    copy(empty [2, 4], x): lanes (x0, x1, x2, x3) in each of the 2 rows."""
    _check_float(node)
    value = interp.value(node.args[1])
    return _expand_to(interp, value, _out_shape(node))


# -- creation ------------------------------------------------------------------------------------

def _filled(interp, node, entry):
    _check_float(node)
    shape = _out_shape(node)
    if not shape:
        return LaneValue((), 0, [entry])
    (count,) = lane_dims(shape[-1:], specialize=True)
    if count > interp.max_lanes:
        raise Unsupported("too many lanes")
    return LaneValue(shape[:-1] + (count,), 1, [entry] * count)


@lane_rule(aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default)
def rule_empty(interp, node):
    """A new tensor whose lanes are never written (None) until a scatter fills them.
    empty([2, 4]): lanes (None, None, None, None)."""
    return _filled(interp, node, None)


@lane_rule(aten.full.default, aten.full_like.default)
def rule_full(interp, node):
    """A tensor filled with a scalar constant (a non-scalar fill is unsupported).
    full([2, 4], 1.5): lanes (1.5, 1.5, 1.5, 1.5)."""
    fill = _scalar_of(node.args[1])
    if fill is None:
        raise Unsupported("non-scalar fill")
    return _filled(interp, node, poly.const(fill))


@lane_rule(aten.zeros.default, aten.zeros_like.default)
def rule_zeros(interp, node):
    """A tensor of zeros (the zero polynomial {} in every lane).
    zeros([2, 4]): lanes (0, 0, 0, 0)."""
    return _filled(interp, node, poly.const(0.0))


# -- views and shape changes ---------------------------------------------------------------------

@lane_rule(aten.reshape.default, aten.view.default, aten._unsafe_view.default)
def rule_reshape(interp, node):
    """A reshape that splits or merges lane dims regroups the same lanes in row-major order; leading dims
    join the grid when merged into it. view(x [2, 8], [2, 2, 4]): grid (2, 4), lanes x0..x7 in order.
    A reshape of leading dims only makes a new source."""
    arg, new = node.args[0], _out_shape(node)
    value = None
    if interp.is_source(arg):  # decided on the source's geometry: its lanes are built only when they are kept
        old, k, is_complex = interp.raw_geometry(arg)
        grid = old[len(old) - k:]
    else:
        value = interp.value(arg)
        old, k, is_complex, grid = value.shape, value.k, value.is_complex, value.grid
    if is_complex:
        raise Unsupported("complex reshape")
    try:
        tail = _reshape_tail(interp, old, k, grid, value, new)
    except LeadingOnly:
        return _regrouped_rows(interp, node, interp.value(arg) if value is None else value)
    if value is None:
        value = interp.value(arg)
    if tail is None:
        return LaneValue(new, value.k, value.entries, False, value.wide)
    pos, new_tail = tail
    promoted = interp.promote(value, len(old) - pos)
    return LaneValue(new[:pos] + tuple(new_tail), len(new) - pos, promoted.entries, False, value.wide)


class LeadingOnly(Unsupported):
    """A reshape that regroups leading dims only and keeps the lanes."""


def _regrouped_rows(interp, node, value: LaneValue) -> LaneValue:
    """A value whose rows are regrouped or picked (a reshape, permute, slice or select of leading dims only) with
    their lanes kept: each row of the result is a row of the value, so lanes that the value proves equal or negated
    are still so in every row. A new source whose such lanes share one atom (`LaneInterpreter.identified_source`):
    Kandinsky's [T, H, W, 1, D/2, 2, 2] rotation matrices flattened to [T*H*W, 1, D/2, 2, 2], or first regrouped
    into tiles of tokens (`reshape -> permute -> flatten`, Kandinsky 6 SR's `_local_patch` for its sparse
    attention), read as views of their cos and sin, as after an unsqueeze between leading dims. Without a related
    pair of lanes, a plain source (raises Unsupported) whose lanes a reason can still name (`note_lanes`)."""
    known = None if _is_gather(value) else interp.identified_source(node, value)
    if known is None:
        interp.note_lanes(node, value)
        raise LeadingOnly("leading dims regrouped: the result is a new source")
    return known


def _reshape_tail(interp, old: tuple, k: int, grid: tuple, value: LaneValue | None, new: tuple) -> tuple | None:
    """(pos, new tail): the reshape regroups the dims from `pos` on, which become the new grid; None for the
    same shape; raises Unsupported where the result is a new source (a value of shape `old`, grid of k dims;
    None for a source, whose lanes are not built yet)."""
    pos = 0
    while pos < min(len(old), len(new)) and same_dim(old[pos], new[pos]):
        pos += 1
    if len(new) >= k and tuple(as_int(d) for d in new[len(new) - k:]) == tuple(grid):
        if len(new) == len(old) and pos == len(old):
            return None
        # the same tail, unless every leading dim stays where it is and a size-1 grid dim merges into the lanes
        # ([T, 1, 1, 2] -> [T, 1, 2] for a grid (1, 2): the trailing 1 and 2 only look like the old grid)
        if pos < len(old) - k or len(new) >= len(old):
            raise LeadingOnly("reshape of leading dims only: the result is a new source")
    pos = min(pos, len(old) - k)
    while pos >= 0:
        old_tail = [as_int(d) for d in old[pos:]]
        if None in old_tail:
            break
        new_tail = [as_int(d, specialize=True) for d in new[pos:]]
        if None not in new_tail and math.prod(old_tail) == math.prod(new_tail):
            if math.prod(new_tail) > interp.max_lanes:
                raise Unsupported("too many lanes")
            if _splits_into_heads(k, grid, value, new_tail):
                raise Unsupported("a projection split into heads: each head's lanes are a new source")
            return pos, new_tail
        pos -= 1
    raise Unsupported("reshape across symbolic dims")


HEAD_SPLIT_MIN_LANES = 1024  # a plain tensor's grid at least this wide, split into heads, restarts per head
HEAD_SPLIT_MIN_HEAD = 32  # ... when the split's last dim (the head dim) is at least this wide


def _splits_into_heads(k: int, grid: tuple, value: LaneValue | None, new_tail: list) -> bool:
    """A plain tensor (a projection's output: every lane one source lane) whose wide grid is viewed as heads of
    a head dim, [.., H*D] -> [.., H, D]. Its lanes are then taken afresh per head (a new source, D lanes): the
    rotation acts within a head, and carrying all H*D lanes through every later op made the analysis of a
    3072-lane Flux projection take most of the pass's time. Splits of computed values keep their lanes (a norm
    across all heads before the split, as in Wan, is seen through them), and so do small or pair splits
    (`reshape(..., -1, 2)`, NeoX's (2, D/2)), which are rotations' own spellings."""
    return (len(new_tail) > k and math.prod(grid) >= HEAD_SPLIT_MIN_LANES
            and new_tail[-1] >= HEAD_SPLIT_MIN_HEAD and (value is None or _is_gather(value)))


@lane_rule(aten.unsqueeze.default)
def rule_unsqueeze(interp, node):
    """A size-1 dim in front (a leading dim) or inside the lanes (a grid dim); the lanes stay.
    unsqueeze(x*cos [2, 4], -2): shape (2, 1, 4), grid (1, 4), lanes (x0*cos0, ..., x3*cos3). In front of lanes
    that are each one source lane (`cos.unsqueeze(-2)`): a new source. Between leading dims: the lanes stay for
    a computed value whose atoms keep their right-aligned meaning (`m [S, 4] = stack([c, -s, s, c])` unsqueezed
    to [1, S, 4]), else a new source, whose lanes that the value proves equal or negated share one atom
    (`LaneInterpreter.identified_source`: m [B, S, 4] unsqueezed to [B, 1, S, 4] reads (m0, -m2, m2, m0))."""
    src = meta(node.args[0])
    if isinstance(src, torch.Tensor) and src.dim() and norm_dim(node.args[1], src.dim() + 1) == src.dim() \
            and interp.is_source(node.args[0]) and as_int(src.shape[-1]) is None:
        # a unit dim after a symbolic one on a source (`pos[..., None]`, positions over a dynamic sequence, before
        # they scale the frequencies): its lanes would be that dim, read at its example value, and every site
        # computed from it would hold for that value only. A source of one lane instead: the sequence stays leading
        raise Unsupported("a unit dim after a symbolic dim of a source: the result is a new source")
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex unsqueeze")
    new_ndim = len(value.shape) + 1
    pos = norm_dim(node.args[1], new_ndim)
    if pos == 0:
        return LaneValue((1,) + value.shape, value.k, value.entries, False, value.wide)
    first_grid = new_ndim - value.k - 1  # insertion points at or after this go into the grid
    if pos == first_grid and _is_gather(value) and value.k < len(value.shape):
        # a table or x gaining a broadcast dim (`cos.unsqueeze(-2)`): a new source, so that every use of
        # the table sees the same lanes whatever rank the other operand has
        interp.note_lanes(node, value)
        raise Unsupported("unsqueeze in front of the lanes of a plain tensor")
    if pos < first_grid:
        if not _is_gather(value) and _atoms_keep_alignment(interp, value, pos):
            # a computed value (a 2x2 rotation matrix built from cos and -sin, given a heads dim in front of its
            # sequence dim for a [1, H, S, D] x): its lanes stay, so that the minus sign stays visible
            return LaneValue(value.shape[:pos] + (1,) + value.shape[pos:], value.k, value.entries, False,
                             value.wide)
        known = None if _is_gather(value) else interp.identified_source(node, value)
        if known is None:
            interp.note_lanes(node, value)
            raise Unsupported("unsqueeze between leading dims: the result is a new source")
        return known
    if pos == first_grid and not _is_gather(value) and any(as_int(d) is None for d in value.shape[:pos]):
        # a computed table of symbolic leading dims given a heads dim in front of its lanes (HiDream's
        # `freqs_cis[:, :, None]` for a [B, S, H, D] x, dynamic=True): a new source over the value's grid whose
        # related lanes share atoms, so that x's heads stay leading (a symbolic head count cannot join the
        # grid). With static sizes the dim joins the grid (below): the lanes then still show the angles that
        # cos and sin were taken of, which the op reads instead of the tables (`angle_tables`)
        known = interp.identified_source(node, value)
        if known is not None:
            return known
    shape = value.shape[:pos] + (1,) + value.shape[pos:]
    return LaneValue(shape, value.k + 1, value.entries, False, value.wide)


def _atoms_keep_alignment(interp, value: LaneValue, pos: int) -> bool:
    """Whether every atom of `value` still stands for the same entry of its source once a size-1 dim is inserted
    at leading position `pos`. Atoms are right-aligned with the value's leading dims: a source dim aligned at or
    after `pos` keeps its partner dim, one aligned before it moves to the next dim, which is harmless only when
    that source dim has size 1 (it broadcasts wherever it lands)."""
    lead_len = len(value.lead)
    checked: set = set()
    for entry in value.entries:
        for atom in poly.atoms_of(entry or {}):
            key = atom[:3]
            if key in checked:
                continue
            checked.add(key)
            name, ks, cplx = key
            source = meta(interp.nodes.get(name))
            if not isinstance(source, torch.Tensor):
                return False
            source_shape = tuple(source.shape) + ((2,) if cplx else ())
            source_lead = source_shape[: len(source_shape) - ks]
            moved = source_lead[: max(0, len(source_lead) - (lead_len - pos))]
            if any(as_int(size) != 1 for size in moved):
                return False
    return True


@lane_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def rule_squeeze(interp, node):
    """Size-1 grid dims dropped; the lanes stay (squeezing a leading dim makes a new source).
    squeeze(unsqueeze(x*cos, -2), -2): grid (4,), lanes (x0*cos0, ..., x3*cos3)."""
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex squeeze")
    ndim = len(value.shape)
    if len(node.args) > 1:
        dims = node.args[1]
    else:
        dims = [d for d in range(ndim) if as_int(value.shape[d]) == 1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = sorted({norm_dim(d, ndim) for d in dims if as_int(value.shape[norm_dim(d, ndim)]) == 1})
    if not dims:
        return rule_identity(interp, node)
    if dims[0] < ndim - value.k:
        raise Unsupported("squeeze of a leading dim: the result is a new source")
    shape = tuple(size for d, size in enumerate(value.shape) if d not in dims)
    return LaneValue(shape, value.k - len(dims), value.entries, False, value.wide)


def _expand_to(interp, value: LaneValue, shape: tuple) -> LaneValue:
    if len(shape) < len(value.shape):
        raise Unsupported("expand to fewer dims")
    k = value.k
    grid = tuple(lane_dims(shape[len(shape) - k:]))
    if math.prod(grid) > interp.max_lanes:
        raise Unsupported("too many lanes")
    if any(a != b and a != 1 for a, b in zip(value.grid, grid)):
        raise Unsupported("bad expand")
    return LaneValue(shape, k, _broadcast_entries(value, grid), value.is_complex, value.wide)


@lane_rule(aten.expand.default)
def rule_expand(interp, node):
    """New leading dims are free; a size-1 grid dim repeats its lanes.
    expand(y [2, 1], [2, 4]): lanes (y0, y0, y0, y0)."""
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex expand")
    return _expand_to(interp, value, _out_shape(node))


def _permute(interp, node, perm):
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex permute")
    ndim = len(value.shape)
    perm = [norm_dim(p, ndim) for p in perm]
    moved = [d for d in range(ndim) if perm[d] != d]
    if not moved:
        return rule_identity(interp, node)
    if min(moved) < ndim - value.k:
        if max(moved) < ndim - value.k:
            return _regrouped_rows(interp, node, value)
        raise Unsupported("permute of leading and lane dims: the result is a new source")
    start = ndim - value.k
    grid_perm = [p - start for p in perm[start:]]
    grid = value.grid
    new_grid = [grid[p] for p in grid_perm]
    strides = row_major_strides(grid)
    entries = []
    for index in grid_indices(new_grid):
        flat = sum(index[axis] * strides[grid_perm[axis]] for axis in range(len(grid_perm)))
        entries.append(value.entries[flat])
    return LaneValue(_out_shape(node), value.k, entries, False, value.wide)


@lane_rule(aten.permute.default)
def rule_permute(interp, node):
    """A permutation of grid dims reorders the lanes; one of leading dims only regroups the rows (a new source,
    related lanes sharing atoms: `_regrouped_rows`); one that moves both makes a plain new source.
    permute(v, [0, 2, 1]) with grid (2, 2) lanes (a, b, c, d): lanes (a, c, b, d)."""
    return _permute(interp, node, list(node.args[1]))


@lane_rule(aten.transpose.int)
def rule_transpose(interp, node):
    """A permute that swaps two dims.
    transpose(v, -1, -2) with grid (2, 2) lanes (a, b, c, d): lanes (a, c, b, d)."""
    ndim = len(_out_shape(node))
    a, b = norm_dim(node.args[1], ndim), norm_dim(node.args[2], ndim)
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return _permute(interp, node, perm)


def _take(value: LaneValue, axis: int, picks: list, keep_axis: bool) -> list:
    """The value's entries with grid axis `axis` restricted to `picks`, in row-major order of the new grid."""
    grid = value.grid
    strides = row_major_strides(grid)
    new_grid = list(grid)
    new_grid[axis] = len(picks)
    out = []
    for index in grid_indices(new_grid):
        flat = sum(i * s for a, (i, s) in enumerate(zip(index, strides)) if a != axis)
        out.append(value.entries[flat + picks[index[axis]] * strides[axis]])
    return out


def _slice_picks(size: int, start, end, step) -> list:
    start = 0 if start is None else start
    end = size if end is None else end
    return list(range(size))[slice(start, end, step)]


@lane_rule(aten.slice.Tensor)
def rule_slice(interp, node):
    """The picked lanes of a lane dim (a leading dim only when sliced whole, or a size-2 pair dim).
    slice(x, -1, 1, 4, 2): lanes (x1, x3). Symbolic bounds on a leading dim are unsupported. Rows picked along a
    leading dim keep their lanes: a new source, related lanes sharing atoms (`_regrouped_rows`)."""
    src = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    value = interp.value(src)
    if value.is_complex:
        raise Unsupported("complex slice")
    ndim = len(value.shape)
    pos = norm_dim(dim, ndim)
    if pos >= ndim - value.k:  # bounds along a lane dim are lane indices: fix them at their value
        start, end, step = (_lane_int(bound) for bound in (start, end, step))
    if not all(isinstance(bound, int) or bound is None for bound in (start, end, step)):
        raise Unsupported("symbolic slice")
    if pos < ndim - value.k:
        size = value.shape[pos]
        if (start in (0, None)) and step == 1 and (end is None or (isinstance(size, int) and end >= size)
                                                    or end >= 2**62):
            return rule_identity(interp, node)
        try:
            value = interp.ensure_dim_in_grid(value, pos)
        except Unsupported:  # rows picked along a sequence or batch dim: each row's lanes kept
            return _regrouped_rows(interp, node, value)
    axis = pos - (ndim - value.k)
    picks = _slice_picks(value.grid[axis], start, end, step)
    entries = _take(value, axis, picks, True)
    shape = value.shape[:pos] + (len(picks),) + value.shape[pos + 1:]
    return LaneValue(shape, value.k, entries, False, value.wide)


@lane_rule(aten.select.int)
def rule_select(interp, node):
    """One index of a lane dim (or of a size-2 pair dim next to the lanes); that grid dim goes.
    select(x, -1, 3): k = 0, the one lane x3; select(v [3, 2, 4], -2, 1): the 4 lanes of pair half 1. One row of
    another leading dim keeps its lanes: a new source, related lanes sharing atoms (`_regrouped_rows`)."""
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex select")
    ndim = len(value.shape)
    pos = norm_dim(node.args[1], ndim)
    if pos < ndim - value.k:  # first: an index along a leading dim is never read
        try:
            value = interp.ensure_dim_in_grid(value, pos)
        except Unsupported:  # one row of a sequence or batch dim: its lanes kept
            return _regrouped_rows(interp, node, value)
    index = _lane_int(node.args[2])
    if not isinstance(index, int):
        raise Unsupported("symbolic index")
    axis = pos - (ndim - value.k)
    index = index + value.grid[axis] if index < 0 else index
    entries = _take(value, axis, [index], False)
    shape = value.shape[:pos] + value.shape[pos + 1:]
    return LaneValue(shape, value.k - 1, entries, False, value.wide)


def _split_points(size: int, sizes: list) -> list:
    out, start = [], 0
    for count in sizes:
        out.append((start, min(start + count, size)))
        start += count
    return out


def _split(interp, node, sizes_of):
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex split")
    ndim = len(value.shape)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    pos = norm_dim(dim, ndim)
    value = interp.ensure_dim_in_grid(value, pos)
    axis = pos - (ndim - value.k)
    size = value.grid[axis]
    parts = []
    for lo, hi in _split_points(size, sizes_of(size)):
        picks = list(range(lo, hi))
        shape = value.shape[:pos] + (len(picks),) + value.shape[pos + 1:]
        parts.append(LaneValue(shape, value.k, _take(value, axis, picks, True), False, value.wide))
    return parts


@lane_rule(aten.split.Tensor)
def rule_split(interp, node):
    """A list of values, one per chunk of a lane dim.
    split(x, 3, -1) on 8 lanes: [(x0, x1, x2), (x3, x4, x5), (x6, x7)]."""
    chunk = _lane_int(node.args[1])
    if not isinstance(chunk, int):
        raise Unsupported("symbolic split")
    return _split(interp, node, lambda size: [chunk] * ((size + chunk - 1) // chunk))


@lane_rule(aten.split_with_sizes.default)
def rule_split_with_sizes(interp, node):
    """A list of values, one per given size along a lane dim.
    split_with_sizes(x, [1, 3], -1): [(x0,), (x1, x2, x3)]."""
    sizes = [_lane_int(size) for size in node.args[1]]
    if not all(isinstance(size, int) for size in sizes):
        raise Unsupported("symbolic split")
    return _split(interp, node, lambda size: sizes)


@lane_rule(aten.unbind.int)
def rule_unbind(interp, node):
    """A list of values, one per index of a lane dim (or of a size-2 pair dim), that dim gone.
    unbind(v [3, 2, 4], -2): [lanes of pair half 0, lanes of pair half 1], 4 lanes each."""
    value = interp.value(node.args[0])
    if value.is_complex:
        raise Unsupported("complex unbind")
    ndim = len(value.shape)
    pos = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    value = interp.ensure_dim_in_grid(value, pos)
    axis = pos - (ndim - value.k)
    shape = value.shape[:pos] + value.shape[pos + 1:]
    return [LaneValue(shape, value.k - 1, _take(value, axis, [i], False), False, value.wide)
            for i in range(value.grid[axis])]


@lane_rule(operator.getitem)
def rule_getitem(interp, node):
    """One value of a split or unbind.
    getitem(split(x, 2, -1), 1): lanes (x2, x3)."""
    src, index = node.args
    values = interp.values.get(src)
    if not isinstance(values, list) or not isinstance(index, int):
        if isinstance(index, int) and _splits_rows(interp, src):  # a piece of a split along a leading dim
            return _regrouped_rows(interp, node, interp.value(src.args[0]))
        raise Unsupported("getitem of an opaque node")
    return values[index]


def _splits_rows(interp, node) -> bool:
    """Whether `node` splits (or unbinds) its input along a leading dim: each piece holds rows of the input."""
    if not isinstance(node, fx.Node) or node.target not in (aten.split.Tensor, aten.split_with_sizes.default,
                                                            aten.unbind.int):
        return False
    at = 1 if node.target is aten.unbind.int else 2
    dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
    value = interp.values.get(node.args[0])
    if not isinstance(value, LaneValue) or value.is_complex:
        return False
    return norm_dim(dim, len(value.shape)) < len(value.shape) - value.k


# Integer ops that a constant lane index is computed with (`torch.roll` decomposes to
# `index(x, [.., fmod(iota(n) + n - shift, n)])`): evaluated on the CPU when every input is constant.
_INDEX_MATH = {
    prims.iota.default, aten.arange.default, aten.arange.start, aten.arange.start_step, aten.add.Tensor,
    aten.sub.Tensor, aten.mul.Tensor, aten.neg.default, aten.fmod.Scalar, aten.fmod.Tensor, aten.remainder.Scalar,
    aten.remainder.Tensor, aten.floor_divide.default, aten.where.self, aten.lt.Scalar, aten.ge.Scalar,
    aten.flip.default, prims.convert_element_type.default, aten.lift_fresh_copy.default}
_INDEX_DEPTH = 12


def _constant_index(arg, depth: int = 0) -> torch.Tensor | None:
    """An int tensor computed from constants alone (iota, arithmetic): its values, or None."""
    if isinstance(arg, (int, float, bool)) or arg is None:
        return arg
    if not isinstance(arg, fx.Node) or depth > _INDEX_DEPTH:
        return None
    val = meta(arg)
    if isinstance(val, torch.SymInt):  # a size (dynamic=True: roll's `iota(s)` of a lane dim): at its hint,
        return as_int(val, specialize=True)  # remembered: a site that depends on it is left unfused
    if arg.op != "call_function":
        return None
    if arg.target not in _INDEX_MATH:
        return None
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype.is_complex:
        return None
    shape = [as_int(d, specialize=True) for d in val.shape]
    if None in shape or math.prod(shape) > 1 << 16:
        return None
    args = []
    for a in arg.args:
        c = _constant_index(a, depth + 1) if isinstance(a, fx.Node) else a
        if isinstance(a, fx.Node) and c is None:
            return None
        if isinstance(a, (list, tuple)) and any(isinstance(i, fx.Node) for i in a):
            return None
        args.append(c)
    kwargs = {key: torch.device("cpu") if key == "device" else value for key, value in arg.kwargs.items()}
    if any(isinstance(value, fx.Node) for value in kwargs.values()):
        return None
    try:
        with unset_fake_temporarily():  # real numbers, also where the pass runs under a fake mode
            out = arg.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - anything it cannot evaluate is simply not a constant
        return None
    return out if isinstance(out, torch.Tensor) and list(out.shape) == shape else None


def _permute_lanes(interp, node, value: LaneValue, pos: int, picks: list) -> LaneValue:
    """The value's lanes along dim `pos` (a lane dim) picked by `picks` (any order, repeats allowed)."""
    ndim = len(value.shape)
    value = interp.ensure_dim_in_grid(value, pos)
    axis = pos - (ndim - value.k)
    size = value.grid[axis]
    picks = [p + size if p < 0 else p for p in picks]
    if any(not 0 <= p < size for p in picks):
        raise Unsupported("lane index out of range")
    entries = _take(value, axis, picks, True)
    shape = value.shape[:pos] + (len(picks),) + value.shape[pos + 1:]
    return LaneValue(shape, value.k, entries, False, value.wide)


@lane_rule(aten.index.Tensor)
def rule_index(interp, node):
    """Lanes picked by a constant index along one lane dim (every other index None): `torch.roll` on the lanes
    decomposes to this. index(x, [None, fmod(iota(4) + 2, 4)]) on a [2, 4] x: lanes (x2, x3, x0, x1). An index
    that reads values (positions) or spans several dims is unsupported (a gather of a table: a source)."""
    src, indices = node.args[:2]
    _check_float(node)
    value = interp.value(src)
    if value.is_complex:
        raise Unsupported("complex index")
    ndim = len(value.shape)
    used = [i for i, index in enumerate(indices) if index is not None]
    if len(used) != 1 or len(indices) != ndim or used[0] < ndim - 1 - (1 if value.k > 1 else 0):
        raise Unsupported("not a lane index")
    picks = _constant_index(indices[used[0]])
    if picks is None or picks.dim() != 1:
        raise Unsupported("index not constant")
    return _permute_lanes(interp, node, value, used[0], [int(p) for p in picks.tolist()])


@lane_rule(aten.roll.default)
def rule_roll(interp, node):
    """Lanes rotated along lane dims by constant shifts (a roll that the graph keeps as one op).
    roll(x, 2, -1) on a [2, 4] x: lanes (x2, x3, x0, x1)."""
    src = node.args[0]
    shifts = node.args[1] if len(node.args) > 1 else node.kwargs.get("shifts")
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims or len(dims) != len(shifts) or not all(isinstance(x, int) for x in shifts + dims):
        raise Unsupported("roll of the flattened tensor or with symbolic shifts")
    _check_float(node)
    value = interp.value(src)
    if value.is_complex:
        raise Unsupported("complex roll")
    for shift, dim in zip(shifts, dims):
        pos = norm_dim(dim, len(value.shape))
        size = as_int(value.shape[pos])
        if size is None:
            raise Unsupported("symbolic roll")
        value = _permute_lanes(interp, node, value, pos, [(i - shift) % size for i in range(size)])
    return LaneValue(_out_shape(node), value.k, value.entries, False, value.wide)


@lane_rule(aten.cat.default)
def rule_cat(interp, node):
    """The operands' lanes one after another along a lane dim (or a size-2 pair dim).
    cat([x[0:2], -x[2:4]], -1): lanes (x0, x1, -x2, -x3)."""
    tensors = list(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    shape = _out_shape(node)
    ndim = len(shape)
    pos = norm_dim(dim, ndim)
    values = []
    for tensor in tensors:
        val = meta(tensor)
        if isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == 0 and ndim > 1:
            continue  # legacy empty tensors are skipped by cat
        value = interp.value(tensor)
        if value.is_complex:
            raise Unsupported("complex cat")
        values.append(value)
    try:
        values = [interp.ensure_dim_in_grid(value, pos) for value in values]
    except Unsupported:  # rows joined along a sequence or batch dim: each row a row of one operand
        return _joined_rows(interp, node, values)
    k = max(value.k for value in values)
    values = [interp.promote(value, k) for value in values]
    axis = pos - (ndim - k)
    # concatenate along the axis: interleave blocks of each operand per outer index
    n_outer = math.prod(values[0].grid[:axis])
    entries = []
    for outer in range(n_outer):
        for value in values:
            block = math.prod(value.grid[axis:])
            entries.extend(value.entries[outer * block:(outer + 1) * block])
    new_grid = lane_dims(shape[ndim - k:])
    if math.prod(new_grid) != len(entries):
        raise Unsupported("cat operands disagree")
    return LaneValue(shape[: ndim - k] + tuple(new_grid), k, entries, False, any(value.wide for value in values))


def _joined_rows(interp, node, values: list) -> LaneValue:
    """A cat of rows (along a leading dim) whose operands relate their lanes alike (`lanes.lane_relations`: the
    same lanes equal or negated, the same constants): every row of the result obeys it, as after a regrouping of
    one value's rows (`_regrouped_rows`). Rotation matrices of two token ranges joined, say; else a new source."""
    if not values or any(tuple(v.grid) != tuple(values[0].grid) or v.k != values[0].k for v in values):
        raise Unsupported("a cat of rows of other lane grids: the result is a new source")
    relations = [lane_relations(v) for v in values]
    if relations[0] is None or any(r != relations[0] for r in relations):
        raise Unsupported("a cat of rows whose lanes relate differently: the result is a new source")
    return _regrouped_rows(interp, node, values[0])


def _scatter(interp, node, base_value, src_value, pos, picks):
    ndim = len(base_value.shape)
    base_value = interp.ensure_dim_in_grid(base_value, pos)
    if src_value.k > base_value.k:
        base_value = interp.promote(base_value, src_value.k)
    k = base_value.k
    axis = pos - (ndim - k)
    src_value = interp.promote(src_value, k) if src_value.k < k else src_value
    if src_value.k != k:
        raise Unsupported("scatter source grid")
    grid = list(base_value.grid)
    src_grid = grid.copy()
    src_grid[axis] = len(picks)
    if list(src_value.grid) != src_grid:
        src_entries = _broadcast_entries(src_value, tuple(src_grid))
    else:
        src_entries = src_value.entries
    entries = list(base_value.entries)
    strides = row_major_strides(grid)
    src_strides = row_major_strides(src_grid)
    for src_index in grid_indices(src_grid):
        base_index = list(src_index)
        base_index[axis] = picks[src_index[axis]]
        base_flat = sum(i * s for i, s in zip(base_index, strides))
        src_flat = sum(i * s for i, s in zip(src_index, src_strides))
        entries[base_flat] = src_entries[src_flat]
    return LaneValue(_out_shape(node), k, entries, False, base_value.wide or src_value.wide)


def _scatter_operands(interp, node, base, src, dim):
    """Base and source values of a scatter, with the scattered dim pulled into the base's grid."""
    _check_float(node)
    base_value, src_value = interp.value(base), interp.value(src)
    if base_value.is_complex or src_value.is_complex:
        raise Unsupported("complex scatter")
    ndim = len(base_value.shape)
    pos = norm_dim(dim, ndim)
    base_value = interp.ensure_dim_in_grid(base_value, pos)
    return base_value, src_value, pos, pos - (ndim - base_value.k)


@lane_rule(aten.slice_scatter.default)
def rule_slice_scatter(interp, node):
    """The base's lanes with the sliced ones replaced by the source's (strided slice assignment).
    slice_scatter(empty [4], y [2], -1, 0, 4, 2): lanes (y0, None, y1, None)."""
    base, src = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    # the operands first: a scatter along a sequence or head dim is no lane op, and its bounds are never read
    # (read at their hints, a symbolic start `q[:, :, t:] = ...` was guarded to one value per compile)
    base_value, src_value, pos, axis = _scatter_operands(interp, node, base, src, dim)
    start = _lane_int(node.args[3] if len(node.args) > 3 else node.kwargs.get("start"))
    end = _lane_int(node.args[4] if len(node.args) > 4 else node.kwargs.get("end"))
    step = _lane_int(node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1))
    if not all(isinstance(bound, int) or bound is None for bound in (start, end, step)):
        raise Unsupported("symbolic scatter")
    picks = _slice_picks(base_value.grid[axis], start, end, step)
    return _scatter(interp, node, base_value, src_value, pos, picks)


@lane_rule(aten.select_scatter.default)
def rule_select_scatter(interp, node):
    """The base's lanes with one index of a lane dim replaced by the source's.
    select_scatter(zeros [3, 2, 4], y [3, 4], -2, 1): grid (2, 4), lanes (0, 0, 0, 0, y0, y1, y2, y3)."""
    base, src, dim, index = node.args[:4]
    base_value, src_value, pos, axis = _scatter_operands(interp, node, base, src, dim)
    index = index + base_value.grid[axis] if index < 0 else index
    # the source lacks the scattered dim: give it a size-1 grid dim there
    src_axis_from_end = base_value.k - axis - 1
    if src_value.k < src_axis_from_end:
        src_value = interp.promote(src_value, src_axis_from_end)
    at = len(src_value.shape) - src_axis_from_end
    src_value = LaneValue(src_value.shape[:at] + (1,) + src_value.shape[at:], src_value.k + 1,
                          src_value.entries, False, src_value.wide)
    return _scatter(interp, node, base_value, src_value, pos, [index])


# -- complex ---------------------------------------------------------------------------------------

@lane_rule(aten.view_as_complex.default)
def rule_view_as_complex(interp, node):
    """Pairs of the last dim read as (re, im); the same lanes, held as a complex value.
    view_as_complex(y [2, 2]): complex, grid (2, 2), lanes (y0, y1, y2, y3) = (re0, im0, re1, im1)."""
    value = interp.value(node.args[0])
    if value.is_complex or as_int(value.shape[-1]) != 2:
        raise Unsupported("view_as_complex of a non-pair")
    value = interp.promote(value, 2) if value.k < 2 and len(value.shape) > 1 else value
    return LaneValue(value.shape, value.k, value.entries, True, value.wide)


@lane_rule(aten.view_as_real.default)
def rule_view_as_real(interp, node):
    """A complex value's (re, im) lanes as a real value.
    view_as_real(z) for a complex source z [2]: grid (2, 2), lanes (z0, z1, z2, z3) = (re0, im0, re1, im1)."""
    src = node.args[0]
    value = interp.value(src)
    if not value.is_complex:
        raise Unsupported("view_as_real of a real tensor")
    return LaneValue(value.shape, value.k, value.entries, False, value.wide)


@lane_rule(aten._conj.default, aten.conj.default, aten.conj_physical.default)
def rule_conj(interp, node):
    """Complex conjugate: every imaginary lane negated.
    conj(z) for a complex source z [2]: lanes (z0, -z1, z2, -z3)."""
    value = interp.value(node.args[0])
    if not value.is_complex:
        raise Unsupported("conj of a real tensor")
    entries = [None if e is None else (poly.scale(e, -1.0) if i % 2 else e) for i, e in enumerate(value.entries)]
    return LaneValue(value.shape, value.k, entries, True, value.wide)
