"""Lane algebra: an abstract interpretation of the post-grad graph along the trailing (head) dims.

Every tensor value the interpreter understands is a `LaneValue`: its last k dims form a lane grid, and
each grid entry is a small polynomial over atoms (one lane of one source tensor, see poly.py) or None
when the lane was never written (an `empty` base). A node the interpreter does not understand becomes a
source: its lanes are atoms of itself. Leading dims are never enumerated; an atom stands for the source's
entry at the leading index that broadcasting (right-aligned) pairs with the value's own, so every rule
keeps that alignment or absorbs leading dims into the grid first (`promote`). This is what lets one
matcher accept `cat` rotate-half, `stack`+`flatten`, strided slice assignment, complex products and the
rest without a pattern per spelling.

The transfer rule of each op lives in lane_rules.py and is registered here with `@lane_rule(op, ...)`;
this module never imports lane_rules, so the registry is filled once something imports it (the pass
does); `LaneInterpreter.run()` refuses to run on an empty registry.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from ...fx_nodes import meta, nearest_upstream
from ...fx_sizes import SymbolicSizeError, as_int, concrete_ints, norm_dim, reading_for
from . import poly

MAX_LANES = 4096
WIDE = (torch.float64, torch.complex128)
# A value whose last dim is wider than any head (MLA's 576 lanes included) and that only flows, through other
# such values, into projections, statistics or elementwise math can be neither a rotation, nor its x, nor its
# tables: the interpreter skips it. These are a DiT block's modulation, gates and residual stream over
# the hidden size, 80% of the pass's time on Flux before they were skipped.
DEAD_END_LAST_DIM = 1024
# What such a value may flow into: projections, statistics and elementwise math without a lane rule. A
# rotation ends in attention, a cache write or the graph's output, never here, so a wide rotation that flows
# straight into one of those (an attention op taking a flat [.., H*D] q) is still evaluated.
DEAD_END_USERS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "native_layer_norm", "var_mean", "mean", "sum", "amax",
    "amin", "exp", "log", "tanh", "sigmoid", "erf", "gelu", "silu", "relu", "abs", "sqrt", "rsqrt", "pow",
    "where", "ge", "gt", "le", "lt", "eq", "ne", "_softmax"})


SMALL_SUM_LANES = 4  # a sum over this many lanes at most is arithmetic on lanes (a 2x2 matrix's row), not a statistic


def small_sum_dims(node: fx.Node) -> list | None:
    """The dims (normalised, sorted) that a `sum.dim_IntList` node reduces, when they hold at most
    `SMALL_SUM_LANES` lanes together (the sum then has a lane rule), else None (a statistic: a dead end)."""
    dims = node.args[1] if len(node.args) > 1 else None
    val = meta(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if not dims or not isinstance(val, torch.Tensor) or not val.dim() or val.dtype.is_complex:
        return None
    dims = sorted({norm_dim(d, val.dim()) for d in ([dims] if isinstance(dims, int) else dims)})
    sizes = [as_int(val.shape[d]) for d in dims]
    if None in sizes or math.prod(sizes) > SMALL_SUM_LANES:
        return None
    return dims


# A sum of two products (x*cos + rot(x)*sin) wider than this many lanes is not analysed (`MAX_LANES`), yet it
# may be a rotation: such a value is reported as a near miss when it is `rotation_shaped`.
_SUMS = frozenset({"add", "sub", "addcmul"})
# Ops that move or copy lanes without computing (rotate_half's slices and cat, a roll, a sign): what lies
# between x and its rotated copy in `rotation_shaped`.
_LANE_MOVES = frozenset({
    "slice", "select", "cat", "split", "split_with_sizes", "unbind", "getitem", "neg", "index", "roll", "flip",
    "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand", "clone", "convert_element_type",
    "_to_copy", "permute", "transpose", "stack", "mul", "alias", "view_as_real", "view_as_complex"})
_ROTATE_HOPS = 8  # rotate_half through casts and views is 4-6 ops


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(node.target, "__name__", "")


def _rotation_or_its_halves(node: fx.Node) -> bool:
    """`rotation_shaped`, or a cat of such sums: the NeoX halves written out, `cat((x1*c - x2*s, x2*c + x1*s))`,
    whose rotation is the cat (a 2048-lane one feeding a projection was a dead end at the cat)."""
    if rotation_shaped(node):
        return True
    if node.op != "call_function" or _op_name(node) != "cat" or not node.args:
        return False
    parts = node.args[0] if isinstance(node.args[0], (list, tuple)) else ()
    return any(isinstance(a, fx.Node) and rotation_shaped(a) for a in parts)


def _lane_moved_from(nodes: list) -> set:
    """The nodes and what they are lane-moved copies of (`_LANE_MOVES`, within `_ROTATE_HOPS`): the halves of one
    split (`x1, x2 = x.chunk(2, -1)`, a 2048-lane q that feeds a projection) are each other's rotated copy only
    through their common input, which a walk back from one half alone never meets (such a rotation was skipped
    as a dead end: no site, no near miss)."""
    seen, frontier = set(nodes), list(nodes)
    for _ in range(_ROTATE_HOPS):
        frontier = [a for n in frontier if _op_name(n) in _LANE_MOVES for a in n.all_input_nodes if a not in seen]
        if not frontier:
            break
        seen.update(frontier)
    return seen


def rotation_shaped(node: fx.Node) -> bool:
    """A sum of two products where an operand of one is a lane-moved copy of an operand of the other: the shape
    of x*cos + rot(x)*sin, read from the ops alone. A DiT's wide elementwise work (modulation, gates, the
    residual stream) adds one product to something else, so the rule that skips it keeps skipping that, and
    a wide rotation that flows into a projection is still analysed."""
    if node.op != "call_function" or _op_name(node) not in _SUMS:
        return False
    if _op_name(node) == "addcmul":
        products = [node.args[0], node.args[1:3]]
    else:
        products = list(node.args[:2])
    operands = []
    for product in products:
        if isinstance(product, tuple):
            operands.append([a for a in product if isinstance(a, fx.Node)])
            continue
        while isinstance(product, fx.Node) and _op_name(product) in ("convert_element_type", "_to_copy"):
            product = product.args[0]
        if not isinstance(product, fx.Node) or _op_name(product) != "mul":
            return False
        operands.append([a for a in product.args[:2] if isinstance(a, fx.Node)])
    first = _lane_moved_from(operands[0])
    for start in operands[1]:
        seen, frontier = {start}, [start]
        for _ in range(_ROTATE_HOPS):
            frontier = [a for n in frontier if _op_name(n) in _LANE_MOVES for a in n.all_input_nodes if a not in seen]
            if not frontier:
                break
            seen.update(frontier)
            if first & set(frontier):
                return True
    return False


# Why a value that looks like a rotation was not analysed: recorded per node in `LaneInterpreter.unfollowed`
# and reported as a near miss.
OVER_CAP = ("a sum of products of a tensor and its rotated copy over {lanes} lanes, over the analysis cap of "
            "{cap} lanes per lane grid: not analysed (a rotation over fewer lanes per head, [.., H, D], is)")
MATRIX_2X2 = ("a 2x2 matrix {built} is applied to pairs of lanes with a matmul (einsum or @): the graph moves the "
              "pair index into the matmul's batch dims, which the lane analysis does not follow; written out, "
              "x0 * cos - x1 * sin and x0 * sin + x1 * cos (or R[..., 0, 0] * x0 + R[..., 0, 1] * x1, ...), "
              "a rotation fuses")


# -- the rule registry -----------------------------------------------------------------------------

RULES: dict = {}  # op overload (or operator.getitem) -> rule(interp, node) -> LaneValue | list


def lane_rule(*targets) -> Callable:
    """Register the decorated function as the transfer rule of each op in `targets`.

    A rule takes the interpreter and an FX node and returns the node's LaneValue (a list of them for ops
    with several outputs), or raises Unsupported: the node is then a source."""

    def register(rule: Callable) -> Callable:
        for target in targets:
            known = RULES.get(target)
            if known is not None and known.__qualname__ != rule.__qualname__:
                raise ValueError(f"{target} already has the lane rule {known.__qualname__}")
            RULES[target] = rule
        return rule

    return register


# -- values ----------------------------------------------------------------------------------------

class LaneValue:
    """Entries of a tensor over its last k dims. Complex tensors are held as their view_as_real."""

    __slots__ = ("shape", "k", "entries", "is_complex", "wide")

    def __init__(self, shape: tuple, k: int, entries: list, is_complex: bool = False, wide: bool = False):
        shape = tuple(shape)
        if k:
            grid = tuple(as_int(size, specialize=True) for size in shape[len(shape) - k:])
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


# -- lane-grid helpers -----------------------------------------------------------------------------

def lane_dims(dims, specialize: bool = False) -> list[int]:
    """`fx_sizes.concrete_ints`, raising Unsupported for a symbolic size (inside a rule: a source)."""
    try:
        return concrete_ints(dims, specialize)
    except SymbolicSizeError as err:
        raise Unsupported(str(err)) from None


def row_major_strides(grid) -> list[int]:
    """Strides of a row-major grid: (2, 3, 4) -> [12, 4, 1]."""
    strides, step = [], 1
    for size in reversed(grid):
        strides.append(step)
        step *= size
    return strides[::-1]


def unravel(flat: int, grid) -> list[int]:
    """The multi-index of a row-major flat index: unravel(7, (2, 4)) -> [1, 3]."""
    index = []
    for size in reversed(grid):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def grid_indices(grid) -> Iterator[tuple]:
    """All multi-indices of a grid in row-major order: (2, 2) -> (0, 0), (0, 1), (1, 0), (1, 1)."""
    return itertools.product(*[range(size) for size in grid])


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
            top = stack[-1]
            if top in self._id:
                stack.pop()
                continue
            pending = [arg for arg in top.all_input_nodes if arg not in self._id]
            if pending and self._pure(top):
                stack.extend(pending)
                continue
            stack.pop()
            if self._pure(top):
                key = (top.target, self._freeze(top.args), self._freeze(top.kwargs))
            else:
                key = ("node", top)
            try:
                ident = self._intern.setdefault(key, len(self._intern))
            except TypeError:  # an unhashable constant: the node is only itself
                ident = self._intern.setdefault(("node", top), len(self._intern))
            self._id[top] = ident
            self.first.setdefault(ident, top)
        return self._id[node]

    @staticmethod
    def _pure(node: fx.Node) -> bool:
        if node.op != "call_function" or node.is_impure():
            return False
        tags = getattr(node.target, "tags", ())
        return torch.Tag.nondeterministic_seeded not in tags

    def _freeze(self, arg):
        if isinstance(arg, fx.Node):
            return ("#", self._id[arg])
        if isinstance(arg, (list, tuple)):
            return tuple(self._freeze(item) for item in arg)
        if isinstance(arg, dict):
            return tuple(sorted((key, self._freeze(item)) for key, item in arg.items()))
        if isinstance(arg, torch.SymInt):
            return ("sym", str(arg))
        return arg

    def canonical(self, node: fx.Node) -> fx.Node:
        return self.first[self.id(node)]


class LaneInterpreter:
    """Computes a LaneValue for every node it can; `values` maps node -> LaneValue (or list)."""

    def __init__(self, graph: fx.Graph, max_lanes: int = MAX_LANES):
        self.graph = graph
        self.max_lanes = max_lanes
        self.values: dict = {}
        self._raw: dict = {}
        self.nodes: dict = {}  # name -> node
        self.order: dict = {}  # node -> position in the graph
        self.structure = Structure()
        self.unfollowed: dict = {}  # node -> why a rotation-like value was not analysed (OVER_CAP, MATRIX_2X2)
        # source name -> the lanes it holds under another leading alignment (identified_source, note_lanes)
        self.identified: dict = {}

    def run(self) -> None:
        if not RULES:
            raise RuntimeError("no lane transfer rules are registered: "
                               "import rope_fusion.passes.analysis.lane_rules to register the transfer rules")
        skip = self._dead_ends()
        for node in self.graph.nodes:
            self.nodes[node.name] = node
            self.order[node] = len(self.order)
            if node.op != "call_function":
                continue
            rule = RULES.get(node.target)
            if rule is None or node in skip:
                if rule is None and _op_name(node) == "bmm":
                    self._note_matrix_2x2(node)
                continue
            try:
                with reading_for(node):  # a size read at its hint here is read for this node's lanes
                    value = rule(self, node)
            except Unsupported:
                value = None
                self._note_over_cap(node)
            if isinstance(value, LaneValue) and len(value.entries) > self.max_lanes and self._note_over_cap(node):
                value = None  # the halves of an x over the cap are unrelated sources: these lanes show no rotation
            if value is not None:
                if isinstance(value, LaneValue):
                    value.wide = value.wide or _node_is_wide(node)
                self.values[node] = value

    def _dead_ends(self) -> set:
        """Nodes past DEAD_END_LAST_DIM lanes whose every use is one of DEAD_END_USERS (without a lane rule) or
        another such node."""

        def ends_here(u: fx.Node) -> bool:
            packet = getattr(u.target, "overloadpacket", None)
            if packet is None or packet.__name__ not in DEAD_END_USERS:
                return False
            return u.target not in RULES or (packet.__name__ == "sum" and small_sum_dims(u) is None)

        dead: set = set()
        for node in reversed(self.graph.nodes):
            if node.op != "call_function" or node.target not in RULES or not node.users:
                continue
            val = meta(node)
            if not (isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[-1], int)
                    and val.shape[-1] > DEAD_END_LAST_DIM):
                continue
            if all(u.op == "call_function" and (u in dead or ends_here(u)) for u in node.users) \
                    and not _rotation_or_its_halves(node):
                dead.add(node)
        return dead

    def _note_over_cap(self, node: fx.Node) -> bool:
        """Record a rotation-shaped sum that no rule could take because its lanes are over the cap, or the cat of
        such halves (`cat((x1*c - x2*s, x2*c + x1*s))` of a 5120-lane x, whose cast and split are over the cap:
        the cat's lanes exist, but read two unrelated sources). Whether it was recorded."""
        val = meta(node)
        if not (isinstance(val, torch.Tensor) and val.dim() and val.dtype.is_floating_point):
            return False
        lanes_ = as_int(val.shape[-1])
        if lanes_ is not None and lanes_ > self.max_lanes and _rotation_or_its_halves(node):
            self.unfollowed[node] = OVER_CAP.format(lanes=lanes_, cap=self.max_lanes)
            return True
        return False

    def _note_matrix_2x2(self, node: fx.Node) -> None:
        """Record a batched matmul that applies a 2x2 matrix to pairs ([B, M, 2] @ [B, 2, 2] or [B, 2, 2] @
        [B, 2, P]), the post-grad form of `einsum("...ij,...j->...i", R, x.reshape(..., -1, 2))`: the pairs are in
        its batch dim. A plain `mm` of that shape is a linear layer of 2 features (a tiny model's time embedding
        and its gradient), which this recorded as a rotation applied with einsum."""
        vals = [meta(a) for a in node.args[:2]]
        if not all(isinstance(v, torch.Tensor) and v.dim() >= 2 and v.dtype.is_floating_point for v in vals):
            return
        sizes = [tuple(as_int(d) for d in v.shape[-2:]) for v in vals]
        if sizes[0][1] != 2:  # the contraction: a pair
            return
        matrix = node.args[1] if sizes[1] == (2, 2) else node.args[0] if sizes[0] == (2, 2) else None
        if matrix is None:
            return
        trig = _reaches(matrix, ("cos", "sin"), 16)
        self.unfollowed[node] = MATRIX_2X2.format(
            built="built from cos and sin" if trig else "read from a tensor (a general per-pair transform unless "
                                                         "it holds [[cos, -sin], [sin, cos]])")

    # -- values ---------------------------------------------------------------------------------
    def value(self, arg: Any, min_k: int = 1) -> LaneValue:
        """The lanes of a node argument (at least `min_k` grid dims) or of a scalar constant (k = 0)."""
        if isinstance(arg, fx.Node):
            known = self.values.get(arg)
            if isinstance(known, LaneValue):
                return self.promote(known, min_k) if known.k < min_k else known
            return self.raw(arg, min_k)
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return LaneValue((), 0, [poly.const(arg)])
        raise Unsupported(f"argument {arg!r}")

    def is_source(self, arg: Any) -> bool:
        """Whether `value(arg)` would take the node as a source (`raw`): no rule computed its lanes."""
        return isinstance(arg, fx.Node) and not isinstance(self.values.get(arg), LaneValue)

    def raw_geometry(self, node: fx.Node, k: int = 1) -> tuple:
        """(shape, grid rank, is_complex) of `raw(node, k)`, without building its lanes (a rule that may reject
        a source asks this first: a wide projection's lanes cost more than the rule's decision)."""
        val = meta(node)
        if not isinstance(val, torch.Tensor):
            raise Unsupported("no tensor meta")
        is_complex = val.dtype.is_complex
        if is_complex and val.is_conj():
            raise Unsupported("a lazily conjugated view")
        if not (val.dtype.is_floating_point or is_complex):
            raise Unsupported("not a float tensor")
        shape = tuple(val.shape) + ((2,) if is_complex else ())
        grid_rank = min(k + (1 if is_complex else 0), len(shape))
        with reading_for(node):  # the source's own lanes
            grid = lane_dims(shape[len(shape) - grid_rank:], specialize=(grid_rank <= (2 if is_complex else 1)))
        if math.prod(grid) > self.max_lanes:
            raise Unsupported("too many lanes")
        return shape[: len(shape) - grid_rank] + tuple(grid), grid_rank, is_complex

    def raw(self, node: fx.Node, k: int = 1) -> LaneValue:
        """The node as a source: each lane is an atom of (the first node structurally equal to) itself."""
        node = self.structure.canonical(node)
        key = (node, k)
        if key in self._raw:
            return self._raw[key]
        shape, grid_rank, is_complex = self.raw_geometry(node, k)
        count = math.prod(shape[len(shape) - grid_rank:])
        name = node.name  # poly.atom, inlined: a wide graph creates hundreds of thousands of source lanes
        entries = [{((name, grid_rank, is_complex, flat),): 1.0} for flat in range(count)]
        result = LaneValue(shape, grid_rank, entries, is_complex)
        self._raw[key] = result
        return result

    def note_lanes(self, node: fx.Node, value: LaneValue) -> None:
        """Remember the lanes `value` shows for a node that becomes a plain source (an unsqueeze that changes its
        leading alignment), so that a reason can name what its lanes hold (`pair_matrix`)."""
        if not value.is_complex:
            self.identified.setdefault(self.structure.canonical(node).name, value)

    def identified_source(self, node: fx.Node, value: LaneValue) -> LaneValue | None:
        """The node as a source over `value`'s grid, where `value` holds the node's lanes under another leading
        alignment (an unsqueeze between leading dims): lanes that `value` proves equal, or negated, share one
        atom, since such a relation between lanes of one tensor holds at every leading index. A 2x2 rotation
        matrix [[c, -s], [s, c]] stacked from [B, S] tables and given a heads dim, [B, 1, S, D/2, 2, 2] for a
        [B, H, S, D] x, reads (m00, -m10, m10, m00): its cos and sin are views of the matrix. None when no
        two lanes are related (the plain source says as much)."""
        shape, grid_rank, is_complex = self.raw_geometry(node, value.k)
        if is_complex or value.is_complex or grid_rank != value.k or tuple(shape[len(shape) - grid_rank:]) != \
                tuple(value.grid):
            return None
        relations = lane_relations(value)
        if relations is None:
            return None
        name = self.structure.canonical(node).name
        out = [rel[1] if rel[0] == "const" else {((name, grid_rank, False, rel[0]),): rel[1]} for rel in relations]
        self.identified[name] = value
        return LaneValue(shape, grid_rank, out, False, value.wide)

    def promote(self, value: LaneValue, k: int) -> LaneValue:
        """Absorb leading dims into the grid until it has k dims (each absorbed dim must be concrete)."""
        while value.k < k:
            if value.k >= len(value.shape):
                raise Unsupported("cannot promote past the first dim")
            pos = len(value.shape) - value.k - 1
            size = as_int(value.shape[pos])
            if size is None:
                raise Unsupported("symbolic leading dim")
            block = len(value.entries)
            if size * block > self.max_lanes:
                raise Unsupported("too many lanes")
            lead_len = pos + 1
            entries = []
            for index in range(size):
                rename = self._absorb(index, size, lead_len)
                entries.extend(None if entry is None else poly.remap(entry, rename) for entry in value.entries)
            value = LaneValue(value.shape, value.k + 1, entries, value.is_complex, value.wide)
        return value

    def _absorb(self, index: int, size: int, lead_len: int) -> Callable:
        """The atom renaming for block `index` of a leading dim of `size` that joins the grid."""
        geometry: dict = {}  # (name, ks, cplx) -> (size of the dim being absorbed, grid size) or None

        def rename(atom):
            name, ks, cplx, flat = atom
            geo = geometry.get((name, ks, cplx), False)
            if geo is False:
                source_val = meta(self.nodes.get(name))
                source_shape = tuple(source_val.shape) + ((2,) if cplx else ())
                source_lead_len = len(source_shape) - ks
                if source_lead_len <= 0:
                    geo = None
                else:
                    geo = (as_int(source_shape[source_lead_len - 1]),
                           math.prod(lane_dims(source_shape[source_lead_len:])))
                geometry[(name, ks, cplx)] = geo
            if geo is None:
                return atom
            source_size, source_lanes = geo
            if source_size == size:
                return (name, ks + 1, cplx, index * source_lanes + flat)
            if source_size == 1:
                return (name, ks + 1, cplx, flat)
            raise Unsupported("source does not broadcast against the absorbed dim")

        return rename

    def ensure_dim_in_grid(self, value: LaneValue, dim: int) -> LaneValue:
        """Lane ops along a leading dim pull that dim into the grid only when it borders the grid and has
        size 2: a pair dim kept outside the head dim (`x.reshape(..., 2, D/2)` sliced along -2) is lanes in
        disguise; a sequence or head dim is not, and its slices become new sources instead."""
        ndim = len(value.shape) - (1 if value.is_complex else 0)
        pos = norm_dim(dim, ndim)
        need = len(value.shape) - pos
        if need <= value.k:
            return value
        if need > value.k + 1 or as_int(value.shape[pos]) != 2:
            raise Unsupported("lane op on a leading dim")
        return self.promote(value, need)


def lane_relations(value: LaneValue) -> list | None:
    """Which lanes of `value` are equal or negated: per lane, (the first lane of its class, its sign), or ("const",
    the entry) for a constant; None when no two lanes are related. Lanes with a positive leading coefficient are
    taken first: `s` is the representative and `-s` its negation. Such relations between the lanes of one tensor
    hold at every leading index (`LaneInterpreter.identified_source`)."""
    entries = value.entries
    order = sorted(range(len(entries)), key=lambda i: not (entries[i] and entries[i][min(entries[i])] > 0))
    reps: dict = {}
    out: list = [None] * len(entries)
    related = False
    for i in order:
        e = entries[i]
        if e is not None and all(not mono for mono in e):
            out[i] = ("const", e)  # a constant reads the same at every leading index
            continue
        if e is not None:
            for sign, probe in ((1.0, e), (-1.0, poly.scale(e, -1.0))):
                hit = reps.get(frozenset(probe.items()))
                if hit is not None:
                    out[i] = (hit, sign)
                    related = True
                    break
            else:
                reps[frozenset(e.items())] = i
        if out[i] is None:
            out[i] = (i, 1.0)
    return out if related else None


def _reaches(node: fx.Node, names: tuple, limit: int) -> bool:
    """Whether `node` is computed from an op named in `names`, within `limit` nodes searched back."""
    return nearest_upstream(node, lambda n: _op_name(n) in names, limit) is not None


def _node_is_wide(node) -> bool:
    val = meta(node)
    return isinstance(val, torch.Tensor) and val.dtype in WIDE


def demote(interp: LaneInterpreter, value: LaneValue) -> LaneValue | None:
    """Inverse of `promote` for the outermost grid dim, when every block is the same function of the
    sources shifted along that dim; None otherwise. Lets the matcher look at the lanes of one head (or
    token) even after a rule absorbed heads or tokens into the grid."""
    if value.k < 2:
        return None
    count = value.grid[0]
    block = len(value.entries) // count

    def lower(atom):
        name, ks, cplx, flat = atom
        source_val = meta(interp.nodes.get(name))
        source_shape = tuple(source_val.shape) + ((2,) if cplx else ())
        if ks < 1 or ks >= len(source_shape):
            return atom  # a source without leading dims was never shifted
        inner = math.prod(lane_dims(source_shape[len(source_shape) - ks + 1:]))
        return (name, ks - 1, cplx, flat % inner)

    try:
        base = [None if entry is None else poly.remap(entry, lower) for entry in value.entries[:block]]
        lead_len = len(value.shape) - value.k + 1
        for index in range(count):
            rename = interp._absorb(index, count, lead_len)
            for first, entry in zip(base, value.entries[index * block:(index + 1) * block]):
                if (first is None) != (entry is None):
                    return None
                if first is not None and poly.remap(first, rename) != entry:
                    return None
    except Unsupported:
        return None
    return LaneValue(value.shape, value.k - 1, base, value.is_complex, value.wide)
