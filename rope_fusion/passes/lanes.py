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


def rules_for(target):
    """The transfer rule of an op (lane_rules.py), or None: the node is then a source."""
    from .lane_rules import RULES

    return RULES.get(target)


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
            rule = rules_for(node.target)
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
        geometry: dict = {}  # (name, ks, cplx) -> (size of the dim being absorbed, grid size) or None

        def fn(a):
            name, ks, cplx, flat = a
            g = geometry.get((name, ks, cplx), False)
            if g is False:
                sval = _meta(self.nodes.get(name))
                sshape = tuple(sval.shape) + ((2,) if cplx else ())
                s_lead_len = len(sshape) - ks
                g = None if s_lead_len <= 0 else (as_int(sshape[s_lead_len - 1]),
                                                  math.prod(_ints(sshape[s_lead_len:])))
                geometry[(name, ks, cplx)] = g
            if g is None:
                return a
            m, grid = g
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


def _node_is_wide(node) -> bool:
    val = _meta(node)
    return isinstance(val, torch.Tensor) and val.dtype in WIDE


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
