"""Lane algebra: an abstract interpretation of the post-grad graph along the trailing (head) dims.

Every tensor value the interpreter understands is a `LaneValue`: its last k dims form a lane grid, and
each grid entry is a small polynomial over atoms (one lane of one source tensor, see poly.py) or None
when the lane was never written (an `empty` base). A node the interpreter does not understand becomes a
source: its lanes are atoms of itself. Leading dims are never enumerated; an atom stands for the source's
entry at the leading index that broadcasting (right-aligned) pairs with the value's own, so every rule
keeps that alignment or absorbs leading dims into the grid first (`promote`). This is what lets one
matcher accept `cat` rotate-half, `stack`+`flatten`, strided slice assignment, complex products and the
rest without a pattern per spelling.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from . import poly as P

aten = torch.ops.aten
prims = torch.ops.prims

MAX_LANES = 4096
WIDE = (torch.float64, torch.complex128)


class LaneValue:
    """Entries of a tensor over its last k dims. Complex tensors are held as their view_as_real."""

    __slots__ = ("shape", "k", "entries", "is_complex", "wide")

    def __init__(self, shape: tuple, k: int, entries: list, is_complex: bool = False, wide: bool = False):
        shape = tuple(shape)
        if k:
            grid = tuple(as_int(g, specialize=True) for g in shape[len(shape) - k:])
            if None in grid:
                raise Unsupported("symbolic lane dims")
            shape = shape[: len(shape) - k] + grid
        self.shape = shape
        self.k = k
        self.entries = entries
        self.is_complex = is_complex
        self.wide = wide

    @property
    def grid(self) -> tuple:
        return self.shape[len(self.shape) - self.k:]

    @property
    def lead(self) -> tuple:
        return self.shape[: len(self.shape) - self.k]


class Unsupported(Exception):
    """Raised inside a rule: the node becomes an opaque source."""


# -- shape helpers ---------------------------------------------------------------------------------

def as_int(s: Any, specialize: bool = False) -> int | None:
    """A concrete size; with `specialize`, a symbolic lane size is fixed (and guarded) at its hint."""
    if isinstance(s, int):
        return s
    try:
        from torch.fx.experimental.symbolic_shapes import guard_int, is_concrete_int

        if is_concrete_int(s):
            return int(s)
        if specialize:
            return int(guard_int(s))
    except Exception:
        return None
    return None


def same_dim(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _ints(dims, specialize=False) -> list:
    out = [as_int(d, specialize) for d in dims]
    if any(d is None for d in out):
        raise Unsupported("symbolic lane dims")
    return out


def _strides(grid) -> list:
    st, acc = [], 1
    for g in reversed(grid):
        st.append(acc)
        acc *= g
    return st[::-1]


def _unravel(flat: int, grid) -> list:
    idx = []
    for g in reversed(grid):
        idx.append(flat % g)
        flat //= g
    return idx[::-1]


def _indices(grid):
    """All multi-indices of a grid in row-major order."""
    import itertools

    return itertools.product(*[range(g) for g in grid])


def _meta(node) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _norm_dim(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


# -- the interpreter -------------------------------------------------------------------------------

class Structure:
    """Structural identity: the same pure op on structurally identical inputs computes the same tensor.

    Models rebuild the same table view in every call of their apply function (`cos[..., 0::2]` twice,
    `freqs.unsqueeze(1)` once for q and once for k); as sources these must be one tensor, or a rotation
    would seem to read two tables. Keys are interned to small ints so that they stay cheap to hash.
    """

    def __init__(self):
        self._id: dict = {}
        self._intern: dict = {}
        self.first: dict = {}  # id -> first node with that structure

    def id(self, node: fx.Node) -> int:
        stack = [node]
        while stack:
            n = stack[-1]
            if n in self._id:
                stack.pop()
                continue
            pending = [a for a in n.all_input_nodes if a not in self._id]
            if pending and self._pure(n):
                stack.extend(pending)
                continue
            stack.pop()
            key = (n.target, self._freeze(n.args), self._freeze(n.kwargs)) if self._pure(n) else ("node", n)
            try:
                i = self._intern.setdefault(key, len(self._intern))
            except TypeError:  # an unhashable constant: the node is only itself
                i = self._intern.setdefault(("node", n), len(self._intern))
            self._id[n] = i
            self.first.setdefault(i, n)
        return self._id[node]

    @staticmethod
    def _pure(n: fx.Node) -> bool:
        if n.op != "call_function" or n.is_impure():
            return False
        tags = getattr(n.target, "tags", ())
        return torch.Tag.nondeterministic_seeded not in tags

    def _freeze(self, a):
        if isinstance(a, fx.Node):
            return ("#", self._id[a])
        if isinstance(a, (list, tuple)):
            return tuple(self._freeze(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, self._freeze(v)) for k, v in a.items()))
        if isinstance(a, torch.SymInt):
            return ("sym", str(a))
        return a

    def canonical(self, node: fx.Node) -> fx.Node:
        return self.first[self.id(node)]


class LaneInterpreter:
    """Computes a LaneValue for every node it can; `values` maps node -> LaneValue (or list)."""

    def __init__(self, graph: fx.Graph, max_lanes: int = MAX_LANES):
        self.graph = graph
        self.max_lanes = max_lanes
        self.values: dict = {}
        self._raw: dict = {}
        self.nodes: dict = {}
        self.structure = Structure()

    def run(self) -> None:
        for node in self.graph.nodes:
            self.nodes[node.name] = node
            if node.op != "call_function":
                continue
            rule = RULES.get(node.target)
            if rule is None:
                continue
            try:
                v = rule(self, node)
            except Unsupported:
                v = None
            if v is not None:
                if isinstance(v, LaneValue):
                    v.wide = v.wide or _node_is_wide(node)
                self.values[node] = v

    # -- values ---------------------------------------------------------------------------------
    def value(self, arg: Any, min_k: int = 1) -> LaneValue:
        if isinstance(arg, fx.Node):
            v = self.values.get(arg)
            if isinstance(v, LaneValue):
                return self.promote(v, min_k) if v.k < min_k else v
            return self.raw(arg, min_k)
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return LaneValue((), 0, [P.const(arg)])
        raise Unsupported(f"argument {arg!r}")

    def raw(self, node: fx.Node, k: int = 1) -> LaneValue:
        """The node as a source: each lane is an atom of (the first node structurally equal to) itself."""
        node = self.structure.canonical(node)
        key = (node, k)
        if key in self._raw:
            return self._raw[key]
        val = _meta(node)
        if not isinstance(val, torch.Tensor):
            raise Unsupported("no tensor meta")
        is_complex = val.dtype.is_complex
        if is_complex and val.is_conj():
            raise Unsupported("a lazily conjugated view")
        if not (val.dtype.is_floating_point or is_complex):
            raise Unsupported("not a float tensor")
        shape = tuple(val.shape) + ((2,) if is_complex else ())
        kk = min(k + (1 if is_complex else 0), len(shape))
        grid = _ints(shape[len(shape) - kk:], specialize=(kk <= (2 if is_complex else 1)))
        n = math.prod(grid)
        if n > self.max_lanes:
            raise Unsupported("too many lanes")
        shape = shape[: len(shape) - kk] + tuple(grid)
        name = node.name
        v = LaneValue(shape, kk, [P.atom((name, kk, is_complex, f)) for f in range(n)], is_complex)
        self._raw[key] = v
        return v

    def promote(self, v: LaneValue, k: int) -> LaneValue:
        """Absorb leading dims into the grid until it has k dims (each absorbed dim must be concrete)."""
        while v.k < k:
            if v.k >= len(v.shape):
                raise Unsupported("cannot promote past the first dim")
            pos = len(v.shape) - v.k - 1
            n = as_int(v.shape[pos])
            if n is None:
                raise Unsupported("symbolic leading dim")
            size = len(v.entries)
            if n * size > self.max_lanes:
                raise Unsupported("too many lanes")
            lead_len = pos + 1
            entries = []
            for i in range(n):
                fn = self._absorb(i, n, lead_len)
                entries.extend(None if e is None else P.remap(e, fn) for e in v.entries)
            v = LaneValue(v.shape, v.k + 1, entries, v.is_complex, v.wide)
        return v

    def _absorb(self, i: int, n: int, lead_len: int) -> Callable:
        def fn(a):
            name, ks, cplx, flat = a
            src = self.nodes.get(name)
            sval = _meta(src)
            sshape = tuple(sval.shape) + ((2,) if cplx else ())
            s_lead_len = len(sshape) - ks
            if s_lead_len <= 0:
                return a
            m = as_int(sshape[s_lead_len - 1])
            grid = math.prod(_ints(sshape[s_lead_len:]))
            if m == n:
                return (name, ks + 1, cplx, i * grid + flat)
            if m == 1:
                return (name, ks + 1, cplx, flat)
            raise Unsupported("source does not broadcast against the absorbed dim")

        return fn

    def ensure_dim_in_grid(self, v: LaneValue, dim: int) -> LaneValue:
        """Lane ops along a leading dim pull that dim into the grid only when it borders the grid and has
        size 2: a pair dim kept outside the head dim (`x.reshape(..., 2, D/2)` sliced along -2) is lanes in
        disguise; a sequence or head dim is not, and its slices become new sources instead."""
        nd = len(v.shape) - (1 if v.is_complex else 0)
        d = _norm_dim(dim, nd)
        need = len(v.shape) - d
        if need <= v.k:
            return v
        if need > v.k + 1 or as_int(v.shape[d]) != 2:
            raise Unsupported("lane op on a leading dim")
        return self.promote(v, need)


def _lane_int(a):
    """A slice bound or size along a lane dim: an int, or a symbolic value specialized to its hint."""
    if a is None or isinstance(a, int):
        return a
    val = _meta(a) if isinstance(a, fx.Node) else a
    out = as_int(val, specialize=True)
    return out if out is not None else a


def _node_is_wide(node) -> bool:
    val = _meta(node)
    return isinstance(val, torch.Tensor) and val.dtype in WIDE


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


def rule_slice_scatter(I, node):
    base, src = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    start = _lane_int(node.args[3] if len(node.args) > 3 else node.kwargs.get("start"))
    end = _lane_int(node.args[4] if len(node.args) > 4 else node.kwargs.get("end"))
    step = _lane_int(node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1))
    if not all(isinstance(a, int) or a is None for a in (start, end, step)):
        raise Unsupported("symbolic scatter")
    _check_float(node)
    bv, sv = I.value(base), I.value(src)
    if bv.is_complex or sv.is_complex:
        raise Unsupported("complex scatter")
    nd = len(bv.shape)
    d = _norm_dim(dim, nd)
    bv = I.ensure_dim_in_grid(bv, d)
    axis = d - (nd - bv.k)
    picks = _slice_picks(bv.grid[axis], start, end, step)
    return _scatter(I, node, bv, sv, d, picks)


def rule_select_scatter(I, node):
    base, src, dim, index = node.args[:4]
    _check_float(node)
    bv, sv = I.value(base), I.value(src)
    if bv.is_complex or sv.is_complex:
        raise Unsupported("complex scatter")
    nd = len(bv.shape)
    d = _norm_dim(dim, nd)
    bv = I.ensure_dim_in_grid(bv, d)
    axis = d - (nd - bv.k)
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


def demote(I: LaneInterpreter, v: LaneValue) -> LaneValue | None:
    """Inverse of `promote` for the outermost grid dim, when every block is the same function of the
    sources shifted along that dim; None otherwise. Lets the matcher look at the lanes of one head (or
    token) even after a rule absorbed heads or tokens into the grid."""
    if v.k < 2:
        return None
    n = v.grid[0]
    block = len(v.entries) // n

    def lower(a):
        name, ks, cplx, flat = a
        sval = _meta(I.nodes.get(name))
        sshape = tuple(sval.shape) + ((2,) if cplx else ())
        if ks < 1 or ks >= len(sshape):
            return a  # a source without leading dims was never shifted
        inner = math.prod(_ints(sshape[len(sshape) - ks + 1:]))
        return (name, ks - 1, cplx, flat % inner)

    try:
        base = [None if e is None else P.remap(e, lower) for e in v.entries[:block]]
        lead_len = len(v.shape) - v.k + 1
        for i in range(n):
            fn = I._absorb(i, n, lead_len)
            for e0, e in zip(base, v.entries[i * block:(i + 1) * block]):
                if (e0 is None) != (e is None):
                    return None
                if e0 is not None and P.remap(e0, fn) != e:
                    return None
    except Unsupported:
        return None
    return LaneValue(v.shape, v.k - 1, base, v.is_complex, v.wide)
