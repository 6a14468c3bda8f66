"""Transfer rules of the lane algebra: how each post-grad op maps the lanes of its inputs to its own.

Each rule takes the interpreter and an FX node and returns a LaneValue (or a list, for unbind/split), or
raises Unsupported, which makes the node a source. Rules keep the right-aligned meaning of atoms: they
either leave the leading dims alone or pull a leading dim into the lane grid first (`promote`).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from . import poly as P
from .lanes import (
    LaneInterpreter,
    LaneValue,
    Unsupported,
    _indices,
    _ints,
    _meta,
    _norm_dim,
    _strides,
    as_int,
    same_dim,
)

aten = torch.ops.aten
prims = torch.ops.prims


def _lane_int(a):
    """A slice bound or size along a lane dim: an int, or a symbolic value specialized to its hint."""
    if a is None or isinstance(a, int):
        return a
    val = _meta(a) if isinstance(a, fx.Node) else a
    out = as_int(val, specialize=True)
    return out if out is not None else a


def _out_shape(node) -> tuple:
    val = _meta(node)
    if not isinstance(val, torch.Tensor):
        raise Unsupported("no tensor meta")
    return tuple(val.shape) + ((2,) if val.dtype.is_complex else ())


def _check_float(node) -> None:
    val = _meta(node)
    if not isinstance(val, torch.Tensor) or not (val.dtype.is_floating_point or val.dtype.is_complex):
        raise Unsupported("not a float tensor")


# -- elementwise ---------------------------------------------------------------------------------

def _is_gather(v: LaneValue) -> bool:
    """Every lane is one source lane: a table or a view of x, not arithmetic."""
    return all(e is not None and len(e) == 1 and len(next(iter(e))) == 1 for e in v.entries)


def _broadcast_entries(v: LaneValue, grid: tuple) -> list:
    """v's entries over `grid` (same rank), replicating size-1 grid dims."""
    if tuple(v.grid) == tuple(grid):
        return v.entries
    vs = _strides(v.grid)
    out = []
    for idx in _indices(grid):
        f = sum((0 if v.grid[a] == 1 else idx[a]) * vs[a] for a in range(len(grid)))
        out.append(v.entries[f])
    return out


def _align(I: LaneInterpreter, node, vals: list) -> tuple:
    """Promote operands to one grid rank and broadcast them to the node's grid."""
    shape = _out_shape(node)
    k = max(v.k for v in vals)
    k = min(k, len(shape))
    vals = [I.promote(v, k) if v.k < k and len(v.shape) > v.k else v for v in vals]
    grid = tuple(_ints(shape[len(shape) - k:]))
    if math.prod(grid) > I.max_lanes:
        raise Unsupported("too many lanes")
    out = []
    for v in vals:
        g = tuple(v.grid)
        if len(g) < k:  # a 0-dim (or lower-rank) operand
            g = (1,) * (k - len(g)) + g
            v = LaneValue((1,) * (k - v.k) + v.shape, k, v.entries, v.is_complex, v.wide)
        if any(a != b and a != 1 for a, b in zip(g, grid)):
            raise Unsupported("grids do not broadcast")
        out.append(_broadcast_entries(v, grid))
    return shape, k, out


def _pointwise(I, node, args, fn, complex_ok=False) -> LaneValue:
    vals = [I.value(a) for a in args]
    if any(v.is_complex for v in vals) and not complex_ok:
        raise Unsupported("complex operand")
    return _pointwise_vals(I, node, vals, fn, is_complex=any(v.is_complex for v in vals))


def _scalar_of(arg) -> float | None:
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    return None


def rule_add(I, node):
    alpha = node.kwargs.get("alpha", 1)
    return _pointwise(I, node, node.args[:2], lambda a, b: P.add(a, b, alpha), complex_ok=True)


def rule_sub(I, node):
    alpha = node.kwargs.get("alpha", 1)
    return _pointwise(I, node, node.args[:2], lambda a, b: P.add(a, b, -alpha), complex_ok=True)


def rule_rsub(I, node):
    alpha = node.kwargs.get("alpha", 1)
    return _pointwise(I, node, node.args[:2], lambda a, b: P.add(b, a, -alpha))


def rule_neg(I, node):
    return _pointwise(I, node, node.args[:1], lambda a: P.scale(a, -1.0), complex_ok=True)


def rule_mul(I, node):
    a, b = node.args[:2]
    va = I.value(a)
    vb = I.value(b)
    if va.is_complex and vb.is_complex:
        return _complex_mul(I, node, va, vb)
    if va.is_complex or vb.is_complex:
        # complex times real: the real operand scales both parts
        c, r = (va, vb) if va.is_complex else (vb, va)
        r = LaneValue(r.shape + (1,), r.k + 1, r.entries, False, r.wide)
        return _pointwise_vals(I, node, [c, r], P.mul, is_complex=True)
    return _pointwise_vals(I, node, [va, vb], P.mul)


def _pointwise_vals(I, node, vals, fn, is_complex=False):
    _check_float(node)
    shape, k, ents = _align(I, node, vals)
    out = []
    for es in zip(*ents):
        if any(e is None for e in es):
            out.append(None)
            continue
        r = fn(*es)
        if r is None:
            raise Unsupported("polynomial too large")
        out.append(r)
    return LaneValue(shape, k, out, is_complex, any(v.wide for v in vals))


def _complex_mul(I, node, va, vb):
    shape = _out_shape(node)
    k = max(va.k, vb.k)
    va, vb = I.promote(va, k), I.promote(vb, k)
    grid = tuple(_ints(shape[len(shape) - k:]))
    ea, eb = _broadcast_entries(va, grid), _broadcast_entries(vb, grid)
    out = []
    for i in range(0, len(ea), 2):
        ar, ai, br, bi = ea[i], ea[i + 1], eb[i], eb[i + 1]
        if None in (ar, ai, br, bi):
            out += [None, None]
            continue
        p1, p2, p3, p4 = P.mul(ar, br), P.mul(ai, bi), P.mul(ar, bi), P.mul(ai, br)
        if None in (p1, p2, p3, p4):
            raise Unsupported("polynomial too large")
        out += [P.add(p1, p2, -1.0), P.add(p3, p4)]
    return LaneValue(shape, k, out, True, va.wide or vb.wide)


def rule_div(I, node):
    c = _scalar_of(node.args[1])
    if c is None or c == 0:
        raise Unsupported("division by a tensor")
    return _pointwise(I, node, node.args[:1], lambda a: P.scale(a, 1.0 / c), complex_ok=True)


def rule_addcmul(I, node):
    value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else 1)

    def fn(s, t1, t2):
        m = P.mul(t1, t2)
        return None if m is None else P.add(s, m, value)

    return _pointwise(I, node, node.args[:3], fn)


def rule_identity(I, node):
    _check_float(node)
    v = I.value(node.args[0])
    return LaneValue(_out_shape(node), v.k, v.entries, v.is_complex, v.wide)


def rule_convert(I, node):
    val = _meta(node)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        raise Unsupported("cast to a non-float dtype")
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex cast")
    return LaneValue(_out_shape(node), v.k, v.entries, False, v.wide)


def rule_copy(I, node):
    """copy(dst, src): src broadcast to dst's shape, converted to dst's dtype."""
    _check_float(node)
    v = I.value(node.args[1])
    return _expand_to(I, v, _out_shape(node))


# -- creation ------------------------------------------------------------------------------------

def _filled(I, node, entry):
    _check_float(node)
    shape = _out_shape(node)
    if not shape:
        return LaneValue((), 0, [entry])
    (n,) = _ints(shape[-1:], specialize=True)
    if n > I.max_lanes:
        raise Unsupported("too many lanes")
    return LaneValue(shape[:-1] + (n,), 1, [entry] * n)


def rule_empty(I, node):
    return _filled(I, node, None)


def rule_full(I, node):
    c = _scalar_of(node.args[1])
    if c is None:
        raise Unsupported("non-scalar fill")
    return _filled(I, node, P.const(c))


def rule_zeros(I, node):
    return _filled(I, node, P.const(0.0))


# -- views and shape changes ---------------------------------------------------------------------

def rule_reshape(I, node):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex reshape")
    new = _out_shape(node)
    old = v.shape
    if len(new) >= v.k and tuple(as_int(d) for d in new[len(new) - v.k:]) == tuple(v.grid):
        if len(new) == len(old) and all(same_dim(a, b) for a, b in zip(old, new)):
            return LaneValue(new, v.k, v.entries, False, v.wide)
        raise Unsupported("reshape of leading dims only: the result is a new source")
    p = 0
    while p < min(len(old), len(new)) and same_dim(old[p], new[p]):
        p += 1
    p = min(p, len(old) - v.k)
    while p >= 0:
        old_tail = [as_int(d) for d in old[p:]]
        if None in old_tail:
            break
        new_tail = [as_int(d, specialize=True) for d in new[p:]]
        if None not in new_tail and math.prod(old_tail) == math.prod(new_tail):
            if math.prod(new_tail) > I.max_lanes:
                raise Unsupported("too many lanes")
            pv = I.promote(v, len(old) - p)
            return LaneValue(new[:p] + tuple(new_tail), len(new) - p, pv.entries, False, v.wide)
        p -= 1
    raise Unsupported("reshape across symbolic dims")


def rule_unsqueeze(I, node):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex unsqueeze")
    nd_new = len(v.shape) + 1
    pos = _norm_dim(node.args[1], nd_new)
    if pos == 0:
        return LaneValue((1,) + v.shape, v.k, v.entries, False, v.wide)
    first_grid = nd_new - v.k - 1  # insertion points at or after this go into the grid
    if pos == first_grid and _is_gather(v) and v.k < len(v.shape):
        # a table or x gaining a broadcast dim (`cos.unsqueeze(-2)`): a new source, so that every use of
        # the table sees the same lanes whatever rank the other operand has
        raise Unsupported("unsqueeze in front of the lanes of a plain tensor")
    if pos < first_grid:
        raise Unsupported("unsqueeze between leading dims: the result is a new source")
    shape = v.shape[:pos] + (1,) + v.shape[pos:]
    return LaneValue(shape, v.k + 1, v.entries, False, v.wide)


def rule_squeeze(I, node):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex squeeze")
    nd = len(v.shape)
    dims = node.args[1] if len(node.args) > 1 else [i for i in range(nd) if as_int(v.shape[i]) == 1]
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = sorted({_norm_dim(d, nd) for d in dims if as_int(v.shape[_norm_dim(d, nd)]) == 1})
    if not dims:
        return rule_identity(I, node)
    if dims[0] < nd - v.k:
        raise Unsupported("squeeze of a leading dim: the result is a new source")
    shape = tuple(s for i, s in enumerate(v.shape) if i not in dims)
    return LaneValue(shape, v.k - len(dims), v.entries, False, v.wide)


def _expand_to(I, v: LaneValue, shape: tuple) -> LaneValue:
    if len(shape) < len(v.shape):
        raise Unsupported("expand to fewer dims")
    k = v.k
    grid = tuple(_ints(shape[len(shape) - k:]))
    if math.prod(grid) > I.max_lanes:
        raise Unsupported("too many lanes")
    if any(a != b and a != 1 for a, b in zip(v.grid, grid)):
        raise Unsupported("bad expand")
    return LaneValue(shape, k, _broadcast_entries(v, grid), v.is_complex, v.wide)


def rule_expand(I, node):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex expand")
    return _expand_to(I, v, _out_shape(node))


def _permute(I, node, perm):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex permute")
    nd = len(v.shape)
    perm = [_norm_dim(p, nd) for p in perm]
    moved = [i for i in range(nd) if perm[i] != i]
    if not moved:
        return rule_identity(I, node)
    if min(moved) < nd - v.k:
        raise Unsupported("permute of leading dims: the result is a new source")
    start = nd - v.k
    gperm = [p - start for p in perm[start:]]
    grid = v.grid
    new_grid = [grid[p] for p in gperm]
    st = _strides(grid)
    entries = []
    for idx in _indices(new_grid):
        f = sum(idx[a] * st[gperm[a]] for a in range(len(gperm)))
        entries.append(v.entries[f])
    return LaneValue(_out_shape(node), v.k, entries, False, v.wide)


def rule_permute(I, node):
    return _permute(I, node, list(node.args[1]))


def rule_transpose(I, node):
    nd = len(_out_shape(node))
    a, b = _norm_dim(node.args[1], nd), _norm_dim(node.args[2], nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _permute(I, node, perm)


def _take(v: LaneValue, axis: int, picks: list, keep_axis: bool) -> list:
    """Entries of v with grid axis `axis` restricted to `picks`, in row-major order of the new grid."""
    grid = v.grid
    st = _strides(grid)
    new_grid = list(grid)
    new_grid[axis] = len(picks)
    out = []
    for idx in _indices(new_grid):
        f = sum(i * s for a, (i, s) in enumerate(zip(idx, st)) if a != axis) + picks[idx[axis]] * st[axis]
        out.append(v.entries[f])
    return out


def _slice_picks(size: int, start, end, step) -> list:
    start = 0 if start is None else start
    end = size if end is None else end
    return list(range(size))[slice(start, end, step)]


def rule_slice(I, node):
    src = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    v = I.value(src)
    if v.is_complex:
        raise Unsupported("complex slice")
    nd = len(v.shape)
    d = _norm_dim(dim, nd)
    if d >= nd - v.k:  # bounds along a lane dim are lane indices: fix them at their value
        start, end, step = (_lane_int(a) for a in (start, end, step))
    if not all(isinstance(s, int) or s is None for s in (start, end, step)):
        raise Unsupported("symbolic slice")
    if d < nd - v.k:
        size = v.shape[d]
        if (start in (0, None)) and step == 1 and (end is None or (isinstance(size, int) and end >= size)
                                                    or end >= 2**62):
            return rule_identity(I, node)
        v = I.ensure_dim_in_grid(v, d)
    axis = d - (nd - v.k)
    picks = _slice_picks(v.grid[axis], start, end, step)
    entries = _take(v, axis, picks, True)
    shape = v.shape[:d] + (len(picks),) + v.shape[d + 1:]
    return LaneValue(shape, v.k, entries, False, v.wide)


def rule_select(I, node):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex select")
    nd = len(v.shape)
    d = _norm_dim(node.args[1], nd)
    idx = _lane_int(node.args[2])
    if not isinstance(idx, int):
        raise Unsupported("symbolic index")
    v = I.ensure_dim_in_grid(v, d)
    axis = d - (nd - v.k)
    idx = idx + v.grid[axis] if idx < 0 else idx
    entries = _take(v, axis, [idx], False)
    shape = v.shape[:d] + v.shape[d + 1:]
    return LaneValue(shape, v.k - 1, entries, False, v.wide)


def _split_points(size: int, sizes: list) -> list:
    out, s = [], 0
    for n in sizes:
        out.append((s, min(s + n, size)))
        s += n
    return out


def _split(I, node, sizes_of):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex split")
    nd = len(v.shape)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    d = _norm_dim(dim, nd)
    v = I.ensure_dim_in_grid(v, d)
    axis = d - (nd - v.k)
    size = v.grid[axis]
    parts = []
    for a, b in _split_points(size, sizes_of(size)):
        picks = list(range(a, b))
        shape = v.shape[:d] + (len(picks),) + v.shape[d + 1:]
        parts.append(LaneValue(shape, v.k, _take(v, axis, picks, True), False, v.wide))
    return parts


def rule_split(I, node):
    n = _lane_int(node.args[1])
    if not isinstance(n, int):
        raise Unsupported("symbolic split")
    return _split(I, node, lambda size: [n] * ((size + n - 1) // n))


def rule_split_with_sizes(I, node):
    sizes = [_lane_int(a) for a in node.args[1]]
    if not all(isinstance(s, int) for s in sizes):
        raise Unsupported("symbolic split")
    return _split(I, node, lambda size: sizes)


def rule_unbind(I, node):
    v = I.value(node.args[0])
    if v.is_complex:
        raise Unsupported("complex unbind")
    nd = len(v.shape)
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    v = I.ensure_dim_in_grid(v, d)
    axis = d - (nd - v.k)
    shape = v.shape[:d] + v.shape[d + 1:]
    return [LaneValue(shape, v.k - 1, _take(v, axis, [i], False), False, v.wide)
            for i in range(v.grid[axis])]


def rule_getitem(I, node):
    src, i = node.args
    vals = I.values.get(src)
    if not isinstance(vals, list) or not isinstance(i, int):
        raise Unsupported("getitem of an opaque node")
    v = vals[i]
    return v


def rule_cat(I, node):
    tensors = list(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    shape = _out_shape(node)
    nd = len(shape)
    d = _norm_dim(dim, nd)
    vals = []
    for t in tensors:
        tv = _meta(t)
        if isinstance(tv, torch.Tensor) and tv.dim() == 1 and tv.shape[0] == 0 and nd > 1:
            continue  # legacy empty tensors are skipped by cat
        v = I.value(t)
        if v.is_complex:
            raise Unsupported("complex cat")
        vals.append(I.ensure_dim_in_grid(v, d))
    k = max(v.k for v in vals)
    vals = [I.promote(v, k) for v in vals]
    axis = d - (nd - k)
    # concatenate along the axis: interleave blocks of each operand per outer index
    n_outer = math.prod(vals[0].grid[:axis])
    entries = []
    for o in range(n_outer):
        for v in vals:
            block = math.prod(v.grid[axis:])
            entries.extend(v.entries[o * block:(o + 1) * block])
    new_grid = _ints(shape[nd - k:])
    if math.prod(new_grid) != len(entries):
        raise Unsupported("cat operands disagree")
    return LaneValue(shape[: nd - k] + tuple(new_grid), k, entries, False, any(v.wide for v in vals))


def _scatter(I, node, base_v, src_v, d, picks):
    nd = len(base_v.shape)
    base_v = I.ensure_dim_in_grid(base_v, d)
    if src_v.k > base_v.k:
        base_v = I.promote(base_v, src_v.k)
    k = base_v.k
    axis = d - (nd - k)
    src_v = I.promote(src_v, k) if src_v.k < k else src_v
    if src_v.k != k:
        raise Unsupported("scatter source grid")
    grid = list(base_v.grid)
    sgrid = grid.copy()
    sgrid[axis] = len(picks)
    if list(src_v.grid) != sgrid:
        src_entries = _broadcast_entries(src_v, tuple(sgrid))
    else:
        src_entries = src_v.entries
    entries = list(base_v.entries)
    st = _strides(grid)
    sst = _strides(sgrid)
    for sidx in _indices(sgrid):
        bidx = list(sidx)
        bidx[axis] = picks[sidx[axis]]
        entries[sum(i * s for i, s in zip(bidx, st))] = src_entries[sum(i * s for i, s in zip(sidx, sst))]
    return LaneValue(_out_shape(node), k, entries, False, base_v.wide or src_v.wide)


def _scatter_operands(I, node, base, src, dim):
    """Base and source values of a scatter, with the scattered dim pulled into the base's grid."""
    _check_float(node)
    bv, sv = I.value(base), I.value(src)
    if bv.is_complex or sv.is_complex:
        raise Unsupported("complex scatter")
    nd = len(bv.shape)
    d = _norm_dim(dim, nd)
    bv = I.ensure_dim_in_grid(bv, d)
    return bv, sv, d, d - (nd - bv.k)


def rule_slice_scatter(I, node):
    base, src = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    start = _lane_int(node.args[3] if len(node.args) > 3 else node.kwargs.get("start"))
    end = _lane_int(node.args[4] if len(node.args) > 4 else node.kwargs.get("end"))
    step = _lane_int(node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1))
    if not all(isinstance(a, int) or a is None for a in (start, end, step)):
        raise Unsupported("symbolic scatter")
    bv, sv, d, axis = _scatter_operands(I, node, base, src, dim)
    picks = _slice_picks(bv.grid[axis], start, end, step)
    return _scatter(I, node, bv, sv, d, picks)


def rule_select_scatter(I, node):
    base, src, dim, index = node.args[:4]
    bv, sv, d, axis = _scatter_operands(I, node, base, src, dim)
    index = index + bv.grid[axis] if index < 0 else index
    # the source lacks the scattered dim: give it a size-1 grid dim there
    s_axis_from_end = bv.k - axis - 1
    if sv.k < s_axis_from_end:
        sv = I.promote(sv, s_axis_from_end)
    pos = len(sv.shape) - s_axis_from_end
    sv = LaneValue(sv.shape[:pos] + (1,) + sv.shape[pos:], sv.k + 1, sv.entries, False, sv.wide)
    return _scatter(I, node, bv, sv, d, [index])


# -- complex ---------------------------------------------------------------------------------------

def rule_view_as_complex(I, node):
    v = I.value(node.args[0])
    if v.is_complex or as_int(v.shape[-1]) != 2:
        raise Unsupported("view_as_complex of a non-pair")
    v = I.promote(v, 2) if v.k < 2 and len(v.shape) > 1 else v
    return LaneValue(v.shape, v.k, v.entries, True, v.wide)


def rule_view_as_real(I, node):
    src = node.args[0]
    v = I.value(src)
    if not v.is_complex:
        raise Unsupported("view_as_real of a real tensor")
    return LaneValue(v.shape, v.k, v.entries, False, v.wide)


def rule_conj(I, node):
    v = I.value(node.args[0])
    if not v.is_complex:
        raise Unsupported("conj of a real tensor")
    entries = [None if e is None else (P.scale(e, -1.0) if i % 2 else e) for i, e in enumerate(v.entries)]
    return LaneValue(v.shape, v.k, entries, True, v.wide)


RULES: dict = {
    aten._conj.default: rule_conj,
    aten.conj.default: rule_conj,
    aten.conj_physical.default: rule_conj,
    aten.resolve_conj.default: rule_identity,
    aten.add.Tensor: rule_add,
    aten.sub.Tensor: rule_sub,
    aten.rsub.Scalar: rule_rsub,
    aten.neg.default: rule_neg,
    aten.mul.Tensor: rule_mul,
    aten.mul.Scalar: rule_mul,
    aten.div.Tensor: rule_div,
    aten.div.Scalar: rule_div,
    aten.addcmul.default: rule_addcmul,
    aten.clone.default: rule_identity,
    aten.alias.default: rule_identity,
    aten.contiguous.default: rule_identity,
    prims.convert_element_type.default: rule_convert,
    aten._to_copy.default: rule_convert,
    aten.copy.default: rule_copy,
    aten.empty.memory_format: rule_empty,
    aten.empty_like.default: rule_empty,
    aten.empty_strided.default: rule_empty,
    aten.full.default: rule_full,
    aten.full_like.default: rule_full,
    aten.zeros.default: rule_zeros,
    aten.zeros_like.default: rule_zeros,
    aten.reshape.default: rule_reshape,
    aten.view.default: rule_reshape,
    aten._unsafe_view.default: rule_reshape,
    aten.unsqueeze.default: rule_unsqueeze,
    aten.squeeze.dim: rule_squeeze,
    aten.squeeze.dims: rule_squeeze,
    aten.squeeze.default: rule_squeeze,
    aten.expand.default: rule_expand,
    aten.permute.default: rule_permute,
    aten.transpose.int: rule_transpose,
    aten.slice.Tensor: rule_slice,
    aten.select.int: rule_select,
    aten.split.Tensor: rule_split,
    aten.split_with_sizes.default: rule_split_with_sizes,
    aten.unbind.int: rule_unbind,
    operator.getitem: rule_getitem,
    aten.cat.default: rule_cat,
    aten.slice_scatter.default: rule_slice_scatter,
    aten.select_scatter.default: rule_select_scatter,
    aten.view_as_complex.default: rule_view_as_complex,
    aten.view_as_real.default: rule_view_as_real,
}
