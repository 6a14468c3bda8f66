"""Acceptance: does a lane value compute a rotary embedding of one source tensor?

A value is accepted when, over its lanes d, every entry is exactly `x[d]*C(d) + s(d)*x[p(d)]*S(d)` for
d < R, with p the NeoX or the interleaved pairing and s the sign pattern of a rotation (or of its inverse),
every lane d >= R is `x[d]`, C and S are single table atoms that differ from each other, and the tables do
not depend on x. The answer is a `site.Site` that says which views of which nodes the fused op reads, or the
reason for the rejection (reported as a near miss when the value otherwise looks like a rotation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ...fx_nodes import chain_back, meta, nearest_upstream
from ...fx_sizes import as_int, concrete_ints, same_dim
from ...ops.schema import RotaryParams
from ..fx_util import PASS_THROUGH
from . import lanes, pair_matrix, poly
from .site import GraphTables, Site, TableRef, XView

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that read only a tensor's sizes: a table built from `arange(x.shape[1])` does not depend on x's values.
_PROJECTIONS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                aten.convolution.default, aten._scaled_mm.default}
_SIZE_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}


class Rejection(str):
    """The reason a value is not a rotation, with how far the check got (a later stage says more)."""

    stage: int

    def __new__(cls, stage: int, text: str) -> Rejection:
        r = super().__new__(cls, text)
        r.stage = stage
        return r


# Stages: lane form, pairing, each lane's products, tables and shapes.
FORM, PAIRING, LANES, TABLES = range(4)


# At most this many pieces make one table (a head dim rotated per axis has 2-3; more is no structure).
MAX_TABLE_PIECES = 4


def _affine(flats: list) -> tuple | None:
    start = flats[0]
    step = flats[1] - flats[0] if len(flats) > 1 else 1
    if step < 1:
        return None
    if any(f != start + step * i for i, f in enumerate(flats)):
        return None
    return start, step


# Lanes that `looks_like_rotation` reads: a rotation shows in the first head of a value (a pass-through part
# and the rotated lanes of one head fit: 576 lanes in MLA's latent cache), and the wide values of a DiT (3072
# lanes in Flux) are not rotations.
SCAN_LANES = 1024


def looks_like_rotation(v: lanes.LaneValue) -> bool:
    """Some lane adds two products that read different lanes of one tensor: worth a near-miss record.

    Linear in the atoms of a lane: the atoms of one source seen so far, none two of them in different lanes
    and different products, either all read one lane or all sit in one product, so two distinct lanes and two
    distinct products per source decide whether a new atom makes such a pair (a lane summing thousands of
    products of one lane, as a norm's statistics do, made a pairwise check take seconds)."""
    for e in v.entries[:SCAN_LANES]:
        if e is None or len(e) < 2:
            continue
        products = [m for m in e if len(m) > 1]
        if len(products) < 2:  # most lanes of a wide graph (a projection, a modulation): one product at most
            continue
        seen: dict = {}  # source (name, k, as_real) -> (up to 2 distinct lanes, up to 2 distinct products)
        for i, m in enumerate(products):
            for a in m:
                got = seen.get(a[:3])
                if got is None:
                    seen[a[:3]] = ([a[3]], [i])
                    continue
                lanes_, prods = got
                if len(lanes_) == 1 and a[3] != lanes_[0] and (len(prods) > 1 or prods[0] != i):
                    return True
                if len(prods) == 1 and i != prods[0] and (len(lanes_) > 1 or lanes_[0] != a[3]):
                    return True
                if len(lanes_) == 1 and a[3] != lanes_[0]:
                    lanes_.append(a[3])
                if len(prods) == 1 and i != prods[0]:
                    prods.append(i)
    return False


class _XLanes:
    """x as the matcher sees it: lane i of the flattened grid is `entry(i)`."""

    def __init__(self, name, k, as_real, entries=None):
        self.name, self.k, self.as_real, self.entries = name, k, as_real, entries

    def entry(self, i: int):
        if self.entries is None:
            return {((self.name, self.k, self.as_real, i),): 1.0}
        return self.entries[i]


class Acceptor:
    """Checks lane values for rotary form; caches graph queries across one graph."""

    def __init__(self, interp: lanes.LaneInterpreter):
        self.interp = interp
        self.order = interp.order
        self._anc: dict = {}
        self._gather: dict | None = None
        self._canon: dict = {}  # (name, k, as_real) -> the grid rank of `_canonical_atom`
        self._by_entry0: dict | None = None
        self._projected_nodes: dict = {}  # node name -> whether a projection computes it (`_projected`)
        self._by_unit_entry0: dict = {}  # the same, keyed up to a constant factor (`_unit_signature`)
        self._scope = None  # the node `accept` is checking: computed tables are looked up among its inputs
        self._scope_tables: dict = {}  # node -> the computed values it is computed from (`_computed_tables`)
        self._lane_index: dict = {}  # computed value -> its lanes by normalised entry (`_lane_index`)
        self.split_note = ""  # why the last computed-table split failed, when it found computed factors
        # Views and casts of one x carry the same lane entries, so each is a candidate whose lane check (and
        # table check) comes out the same: computed once per distinct value (a 3072-lane Flux grid made the
        # pass take 20 s without this).
        self._lanes_memo: dict = {}
        self._tables_memo: dict = {}
        # `_lanes_memo` keys hold `id`s of lane lists: `_pinned` keeps those lists alive (a demoted value's lanes
        # are temporary), so an id cannot be reused by another list while it is a key.
        self._pinned: list = []

    def depends_on(self, node: fx.Node, src: fx.Node) -> bool:
        """True when `src` is an ancestor of `node` (or the node itself)."""
        if node is src:
            return True
        key = (node, src)
        if key in self._anc:
            return self._anc[key]
        lo = self.order[src]
        seen, stack, found = set(), [node], False
        while stack and not found:
            n = stack.pop()
            if n.target in _SIZE_QUERIES:
                continue
            for a in n.all_input_nodes:
                if a is src:
                    found = True
                    break
                if a not in seen and self.order.get(a, -1) > lo:
                    seen.add(a)
                    stack.append(a)
        self._anc[key] = found
        return found

    def accept(self, node: fx.Node, v: lanes.LaneValue) -> Site | Rejection:
        """The rotation `v` computes, or the most specific reason it is none: the grid is tried as one head,
        as blocks of heads, and after demotion (a leading dim that a rule absorbed into the grid)."""
        best = Rejection(FORM, "not a rotation")
        self._scope = node
        while v is not None:
            if any(e is None for e in v.entries):
                d = next(i for i, e in enumerate(v.entries) if e is None)
                return Rejection(FORM, f"lane {d} is never written")
            if v.is_complex:
                return Rejection(FORM, "complex result")
            # The widest grouping first, except one whose rows look like heads of the same tables: it is tried
            # after the narrower ones, which then match with one head's tables (it could only match by reading
            # them again per head, and ruling it out cost as much as the match on Wan's 12 x 128 lanes).
            widths = list(range(v.k, 0, -1))
            later = [m for m in widths if self._rows_share_tables(v, m)]
            misses = {}
            for m in [m for m in widths if m not in later] + later:
                r = self._accept_blocks(node, v, m)
                if isinstance(r, Site):
                    return r
                misses[m] = r
            for m in widths:  # the widest grouping's reason first, as if tried in that order
                if misses[m].stage > best.stage:
                    best = misses[m]
            v = lanes.demote(self.interp, v)
        return best

    @staticmethod
    def _rows_share_tables(v: lanes.LaneValue, m: int) -> bool:
        """Whether lane 0 and the first lane of the next row of an m-dim grouping share two or more atoms
        (a cos and a sin entry: the rows are heads of one table). Only an order of trial: any answer is safe."""
        if m < 2:
            return False
        n = math.prod(v.grid[v.k - m:])
        rows = v.grid[v.k - m]
        if rows < 2:
            return False
        first, second = v.entries[0], v.entries[n // rows]
        return bool(first) and bool(second) and len(poly.atoms_of(first) & poly.atoms_of(second)) >= 2

    # -- x candidates ------------------------------------------------------------------------------
    def _x_candidates(self, p1: dict, v: lanes.LaneValue, total: int) -> list:
        out = []
        if len(p1) == 1:
            (m, c), = p1.items()
            if len(m) == 1 and c == 1.0 and m[0][3] == 0:
                a = m[0]
                out.append(_XLanes(a[0], a[1], a[2]))
        if self._by_entry0 is None:
            self._by_entry0, self._by_unit_entry0 = {}, {}
            for n, xv in self.interp.values.items():
                if isinstance(xv, lanes.LaneValue) and not xv.is_complex and xv.entries and xv.entries[0]:
                    self._by_entry0.setdefault(poly.signature(xv.entries[0]), []).append(n)
                    if not _one_atom(xv.entries[0]):
                        self._by_unit_entry0.setdefault(_unit_signature(xv.entries[0]), []).append(n)
        for n in self._by_entry0.get(poly.signature(p1)) or self._by_unit_entry0.get(_unit_signature(p1), []):
            xv = self.interp.values[n]
            if len(xv.entries) == total and len(xv.lead) == len(v.lead) and None not in xv.entries:
                out.append(_XLanes(n.name, xv.k, False, xv.entries))
        return out

    def _accept_blocks(self, node, v, m) -> Site | Rejection:
        entries = v.entries
        n = math.prod(v.grid[v.k - m:])
        nblocks = len(entries) // n
        if n < 2:
            return Rejection(FORM, "fewer than two lanes")
        e0 = entries[0]
        atoms0 = sorted(poly.atoms_of(e0))
        best = Rejection(FORM, "lane 0 is not x times a table plus x times a table")
        cands = list(self._x_candidates(e0, v, len(entries)))  # lane 0 may be a plain copy of x
        for ac in atoms0:
            p1 = poly.cofactor(e0, ac)
            if p1:
                cands.extend(self._x_candidates(p1, v, len(entries)))
            if ac[3] == 0:  # lane 0 of a source that lane 0 reads: x, when the products do not split
                cands.append(_XLanes(ac[0], ac[1], ac[2]))
        unique = {}
        for xl in cands:
            unique.setdefault((xl.name, xl.k, xl.as_real, xl.entries is None), xl)
        cands = list(unique.values())
        # a projection's output before a tensor no matmul computed: in a product of two complex tensors of one
        # shape (a key of one head times freqs_cis) either factor rotates the other, and x is the activation;
        # then a source tensor before a computed one: x, not its rotate_half, is what the op should read
        cands.sort(key=lambda xl: (not self._projected(xl.name), xl.entries is not None))
        for xl in cands:
            r = self._accept_x(node, v, m, n, nblocks, xl)
            if isinstance(r, Site):
                return r
            if r.stage >= best.stage:
                best = r
        return best

    def _projected(self, name: str) -> bool:
        """Whether a matmul or convolution computes the node (within a few ops upstream): an activation. Asked
        for every x candidate of every value the acceptor sees, so each node is looked up once."""
        known = self._projected_nodes.get(name)
        if known is None:
            node = self.interp.nodes.get(name)
            known = node is not None and nearest_upstream(node, lambda n: n.target in _PROJECTIONS, 32) is not None
            self._projected_nodes[name] = known
        return known

    def _split(self, e, xd, xp):
        """e == c1*a*xd + c2*b*xp for atoms a, b: return ((a, c1), (b, c2)) or None."""
        if not xd or not xp:
            return None
        quick = _split_products(e, xd, xp)
        if quick is not None:
            return quick
        ca = cb = None
        for a in poly.atoms_of(e):
            q = poly.cofactor(e, a)
            r1 = poly.ratio(q, xd)
            if r1 is not None and ca is None:
                ca = (a, r1)
                continue
            r2 = poly.ratio(q, xp)
            if r2 is not None and cb is None:
                cb = (a, r2)
        if ca is None or cb is None or ca[0] == cb[0]:
            return None
        rebuilt = poly.add(poly.scale(poly.mul(poly.atom(ca[0]), xd) or {}, ca[1]),
                        poly.scale(poly.mul(poly.atom(cb[0]), xp) or {}, cb[1]))
        if rebuilt != e and not _close(rebuilt, e):
            return None
        return ca, cb

    def _split_lane(self, e, xd, xp):
        """`_split`, else `_split_computed`: one table atom per x lane, or a computed table's lane."""
        return self._split(e, xd, xp) or self._split_computed(e, xd, xp)

    def _split_computed(self, e, xd, xp):
        """`_split` where the factors of x are tables computed in the graph (`c + c2`, the angle-sum identity
        `c1*c2 - s1*s2`, a gate `c * g`): e == xd*P + xp*Q, and P and Q are (multiples of) the lanes of nodes
        that hold them. Each such lane stands for its table entry as an atom of that node, so the table is a view
        of the node like any other. Where a factor is computed but no node holds it (`x * c * g`: x times c,
        then times g), `self.split_note` says so, the reason a user can act on."""
        if len(xd) != 1 or len(xp) != 1:
            return None
        ((md, cd),), ((mp, cp),) = xd.items(), xp.items()
        if md == mp:
            return None
        factors: tuple = ({}, {})
        for mono, coef in e.items():
            rest_d, rest_p = _without(mono, md), _without(mono, mp)
            if (rest_d is None) == (rest_p is None):
                return None  # a term of neither x lane, or of both
            if rest_d is not None:
                factors[0][rest_d] = factors[0].get(rest_d, 0.0) + coef / cd
            else:
                factors[1][rest_p] = factors[1].get(rest_p, 0.0) + coef / cp
        x_names = {a[0] for a in md + mp}
        if not all(factors) or any(a[0] in x_names for f in factors for a in poly.atoms_of(f)):
            return None
        if all(len(f) == 1 and len(next(iter(f))) == 1 for f in factors):
            return None  # one atom each: the atom split's answer stands (one table for both, say)
        found = []
        for f in factors:
            hit = self._computed_table_lane(f, x_names)
            if hit is None:
                if not self._reads_x(f, x_names):
                    self.split_note = (f"its factor {_describe(f)} is a table computed in the graph, but no node "
                                       "holds it (x is multiplied by its parts one at a time): compute the table "
                                       "first, then multiply x by it")
                # else a norm's scale (`rsqrt(mean(x^2))`) is part of it: no table, and no note; the candidate x
                # after the norm says why the value is no rotation (the note outranked it, and was untrue)
                return None
            found.append(hit)
        if found[0][0] == found[1][0]:
            return None
        return found[0], found[1]

    def _reads_x(self, factor: dict, x_names: set) -> bool:
        """Whether an atom of a factor is computed from x (a statistic of x, as a norm's scale is)."""
        nodes = self.interp.nodes
        xs = [nodes[n] for n in x_names if n in nodes]
        return any(self.depends_on(nodes[a[0]], x) for a in poly.atoms_of(factor) if a[0] in nodes for x in xs)

    def _computed_table_lane(self, f: dict, x_names: set):
        """(atom of a node whose lane is r * ... == f, r) for the computed factor f, or None. The nodes tried are
        the computed values that the value being accepted is computed from (a table it reads), in graph order,
        each lane compared exactly (atoms with their grid ranks: the same entries at every leading index)."""
        first = min(f)
        for tnode in self._computed_tables():
            if any(a[0] in x_names for a in poly.atoms_of(self.interp.values[tnode].entries[0])):
                continue  # a value of x (a product with x, a rotate_half), not a table
            index = self._lane_index.get(tnode)
            if index is None:
                index = self._lane_index[tnode] = _lane_index(self.interp.values[tnode])
            hit = index.get(_normal_key(f, first))
            if hit is not None:
                k, flat, lead_coef = hit
                return (tnode.name, k, False, flat), f[first] / lead_coef
        return None

    def _computed_tables(self) -> list:
        """Computed values (not plain copies of sources) that the node being accepted is computed from through
        lane rules, in graph order: where a computed table of it must be. Bounded: a table is a few ops."""
        scope = self._scope
        got = self._scope_tables.get(scope)
        if got is not None:
            return got
        values = self.interp.values
        seen, stack, found = {scope}, [scope], []
        while stack and len(seen) < _TABLE_SCOPE_NODES:
            for a in stack.pop().all_input_nodes:
                if a in seen or not isinstance(values.get(a), lanes.LaneValue):
                    continue
                seen.add(a)
                stack.append(a)
                v = values[a]
                if v.k and not v.is_complex and None not in v.entries and not _plain(v.entries):
                    found.append(a)
        found.sort(key=self.order.get)
        self._scope_tables[scope] = found
        return found

    def _lanes(self, style, entries, xl, head, rot, n, nblocks, is_copy):
        """(style, cos lanes, sin lanes, conjugate) when every rotated lane of every head block has the form
        of `style`'s pairing and every other lane copies x, else the Rejection."""
        cos_lanes, sin_lanes = [], []
        template = []  # block 0's split of each lane: the other head blocks must equal it on their own x lanes
        conj = None
        for b in range(nblocks):
            base = b * n + head
            for d in range(rot):
                xa, xb = style.x_lane(d), style.x_partner(d)
                xd, xp = xl.entry(base + xa), xl.entry(base + xb)
                if b > 0 and xd and xp:  # one product per term instead of a search over the lane's atoms
                    (ca, cc), (sa, sc) = template[d]
                    want = poly.add(poly.scale(poly.mul(poly.atom(ca), xd) or {}, cc),
                                    poly.scale(poly.mul(poly.atom(sa), xp) or {}, sc))
                    if want == entries[base + d] or _close(want, entries[base + d]):
                        continue
                self.split_note = ""
                sp = self._split_lane(entries[base + d], xd, xp)
                if sp is None:
                    if self.split_note:
                        return Rejection(TABLES, f"lane {d}: {self.split_note}")
                    return Rejection(LANES, f"lane {d} does not combine x[{xa}] and x[{xb}] with one table "
                                            f"entry each ({style.name} pairs)")
                (ca, cc), (sa, sc) = sp
                if ca == sa:
                    return Rejection(LANES, f"lane {d} multiplies both x lanes by the same table entry")
                # A negative cos factor is a table too: x*(-cos) + rot(x)*(-sin) is the rotation by the angle plus
                # pi, read from the negated tables where the graph holds them (`_tables` says where it does not).
                rotation_sign = -1.0 if style.first(d) else 1.0
                this_conj = (sc > 0) != (rotation_sign > 0)
                if conj is None:
                    conj = this_conj
                    first_sign, first_cos = sc, cc
                elif conj != this_conj:
                    if (cc > 0) != (first_cos > 0):  # conj(x) * freqs: [[c, s], [s, -c]] on each pair
                        return Rejection(LANES, f"lanes {d - 1} and {d} reflect each pair of x instead of rotating "
                                                "it (the cos factor changes sign within the pair, as in "
                                                "conj(x) * freqs, which is conj(x * conj(freqs))): a reflection is "
                                                "not a rotation; x * freqs.conj() is the inverse rotation")
                    shown = self._pair_matrix(style, d, sp, template) if b == 0 else None
                    if shown is not None:  # the tables are known, and wrong: past the lanes for x itself
                        stage = TABLES if xl.entries is None else LANES
                        return Rejection(stage, f"lanes {shown[0]} and {d} multiply each pair of x by the matrix "
                                         f"{shown[1]} of two tables c and s that the graph builds: neither "
                                         "a rotation ([[c, -s], [s, c]]) nor its inverse ([[c, s], [-s, c]])")
                    if sc > 0 and first_sign > 0:  # HiDream's F[..., 0] * x0 + F[..., 1] * x1: no minus anywhere
                        return Rejection(LANES, f"lanes {d - 1} and {d} apply a general 2x2 matrix of table "
                                                "entries to each pair (no minus sign in the graph): a table "
                                                "that arrives as a tensor cannot be proven to hold [[cos, -sin], "
                                                "[sin, cos]]; only tables built from cos and sin in the graph "
                                                "fuse")
                    return Rejection(LANES, f"lane {d} has the sign pattern of neither a rotation nor its inverse")
                c_entry, s_entry = (ca, cc), (sa, abs(sc))
                if b == 0:
                    cos_lanes.append(c_entry)
                    sin_lanes.append(s_entry)
                    template.append(sp)
                elif cos_lanes[d] != c_entry or sin_lanes[d] != s_entry:
                    return Rejection(TABLES, "the tables differ between the heads of a flattened [.., H*D] x "
                                             "(per-head tables on a flattened head dim are not supported)")
            for d in [*range(-head, 0), *range(rot, n - head)]:
                if not is_copy(base + d):
                    return Rejection(LANES, f"lane {head + d} outside the rotated part is not a copy of x")
        return style, cos_lanes, sin_lanes, conj

    def _pair_matrix(self, style, d, split, template) -> tuple | None:
        """(the partner lane, the pair's matrix in c and s) where lane d and its partner before it, both split,
        apply a matrix of two tables that the graph builds (`pair_matrix.built_matrix`), else None."""
        xa, xb = style.x_lane(d), style.x_partner(d)
        for d0 in range(d):
            if style.x_lane(d0) == xb and style.x_partner(d0) == xa:
                shown = pair_matrix.built_matrix(self.interp, template[d0], split)
                return None if shown is None else (d0, shown)
        return None

    @staticmethod
    def _shared_factor(e, xd, xp) -> str | None:
        """The table a lane multiplies both x lanes by (e == t*(xd +- xp)), or None."""
        if not xd or not xp:
            return None
        for a in poly.atoms_of(e):
            rest = poly.add(poly.cofactor(e, a), xd, -1.0)
            if rest and (rest == xp or rest == poly.scale(xp, -1.0)):
                return a[0]
        return None

    def _x_shape(self, xl: _XLanes, v: lanes.LaneValue) -> str:
        """Why x cannot be the rotated tensor by its shape alone ("" when it can): the op's output has x's shape.
        Checked before x's lanes, so that a broadcast operand that happens to pair its lanes (freqs in
        conj(x) * freqs, rotated by x's lanes as if they were tables) never outranks the reason for x itself."""
        x_node = self.interp.nodes[xl.name]
        if xl.entries is None:
            xval = meta(x_node)
            xshape = tuple(xval.shape) + ((2,) if xl.as_real else ())
            x_lead = xshape[: len(xshape) - xl.k]
            if len(x_lead) != len(v.lead) or not all(same_dim(a, b) for a, b in zip(x_lead, v.lead)):
                return f"{xl.name} is broadcast to the output shape: it cannot be the rotated x"
            if math.prod(concrete_ints(xshape[len(xshape) - xl.k:])) != len(v.entries):
                return f"{xl.name} has a different lane count than the output"
        else:
            x_lead = self.interp.values[x_node].lead
            if len(x_lead) == len(v.lead) and not all(same_dim(a, b) for a, b in zip(x_lead, v.lead)):
                return f"{xl.name} is broadcast to the output shape: it cannot be the rotated x"
        return ""

    def _copy_test(self, entries: list, xl: _XLanes) -> Callable[[int], bool] | Rejection:
        """Whether output lane i is a plain copy of x's lane i. A source x: the entry is the one atom of lane i;
        computed lanes: the same polynomial. A source x whose lane 0 is rotated but never reads x[0] is rejected
        here: no pairing nor shared table can fit, whatever the rotated range (not scanning it saves most of the
        time spent on the wrong candidates)."""
        if xl.entries is not None:
            return lambda i: _close(entries[i], xl.entries[i])
        src = (xl.name, xl.k, xl.as_real)

        def is_copy(i: int) -> bool:
            e = entries[i]
            if e is None or len(e) != 1:
                return False
            (mono, coef), = e.items()
            return len(mono) == 1 and mono[0][3] == i and mono[0][:3] == src and abs(coef - 1.0) <= 1e-12
        if not is_copy(0) and not _reads_lane(entries[0], xl.entry(0)):
            return Rejection(PAIRING, "lane 0 pairs with neither lane 0+R/2 (NeoX) nor lane 1 (interleaved) of x")
        return is_copy

    @staticmethod
    def _rotated_range(n: int, is_copy: Callable[[int], bool]) -> tuple[int, int] | Rejection:
        """(head, rot): lanes [0, head) copied, [head, head + rot) rotated, the rest copied (head > 0: the rotated
        part comes after a pass-through head, as in LTX's padded tables or DeepSeek-V4's rope at the end)."""
        head = 0
        while head < n and is_copy(head):
            head += 1
        rot = n - head
        for d in range(head, n):
            if is_copy(d):
                rot = d - head
                break
        if rot < 2 or rot % 2:
            if rot == 0 and head == n:
                return Rejection(FORM, "every lane is a plain copy of x")
            return Rejection(PAIRING, f"lanes [{head}, {head + rot}) differ from x but are not an even count of "
                                      "rotated lanes: a permutation of x's lanes or another mix")
        return head, rot

    def _candidate_styles(self, entries: list, xl: _XLanes, head: int, half: int) -> list | Rejection:
        """The pairings whose partner of the first rotated lane fits it (each is then checked lane by lane); where
        none does, the reason: a table that cannot be split, cos and sin as one table, or no pairing at all."""
        e0, x0 = entries[head], xl.entry(head)
        self.split_note = ""
        styles = [s for s in _pairings(half)
                  if self._split_lane(e0, x0, xl.entry(head + s.x_partner(0))) is not None]
        if styles:
            return styles
        if self.split_note:
            return Rejection(TABLES, f"lane {head}: {self.split_note}")
        for p0 in (half, 1):
            shared = self._shared_factor(e0, x0, xl.entry(head + p0))
            if shared is not None:
                return Rejection(LANES, f"lane {head} multiplies x[{head}] and x[{head + p0}] by the same "
                                        f"entry of {shared}: cos and sin are one table here")
        return Rejection(PAIRING, f"lane {head} pairs with neither lane {head}+R/2 (NeoX) nor lane {head + 1} "
                                  "(interleaved) of x")

    def _fitting_lanes(self, styles: list, entries: list, xl: _XLanes, head: int, rot: int, n: int, nblocks: int,
                       is_copy: Callable[[int], bool]) -> tuple | Rejection:
        """(style, cos lanes, sin lanes, conj) of the first pairing every lane fits (memoised: q and k, and the
        candidates of one value, ask alike); else the most plausible pairing's reason: the first to fit lane 0,
        unless a later one got further."""
        got = first = None
        xkey = (xl.name, xl.k, xl.as_real) if xl.entries is None else tuple(map(id, xl.entries))
        for style in styles:
            key = (id(entries), xkey, style.key, head, rot, n, nblocks)
            got = self._lanes_memo.get(key)
            if got is None:
                got = self._lanes_memo[key] = self._lanes(style, entries, xl, head, rot, n, nblocks, is_copy)
                self._pinned.append((entries, xl.entries))  # the ids in the key stay unique
            if not isinstance(got, Rejection):
                return got
            first = got if first is None or got.stage > first.stage else first
        return first

    def _table_from_x(self, xl: _XLanes, cos_lanes: list, sin_lanes: list) -> Rejection | None:
        """A table that is x, or is computed from x, makes a rotation by angles taken from x itself: not a
        position embedding."""
        origins = self._x_origins(self.interp.nodes[xl.name], xl)
        for key in {a[:3] for a, _ in cos_lanes} | {a[:3] for a, _ in sin_lanes}:
            tnode = self.interp.nodes[key[0]]
            if tnode in origins:
                return Rejection(TABLES, "the table is x itself")
            for o in origins:
                if self.depends_on(tnode, o):
                    return Rejection(TABLES, f"the table {tnode.name} is computed from x ({o.name}): a rotation "
                                             "by angles taken from x itself is not a position embedding")
        return None

    def _graph_tables(self, v, style: Any, cos_lanes: list, sin_lanes: list, rot: int) -> tuple | Rejection:
        """(cos, sin, full) as graph tables read by the fitted lanes (memoised), each broadcasting against x."""
        tkey = (tuple(cos_lanes), tuple(sin_lanes), rot, style.key)
        refs = self._tables_memo.get(tkey)
        if refs is None:
            refs = self._tables_memo[tkey] = self._tables(cos_lanes, sin_lanes, rot, style.first, style.out_partner)
        if isinstance(refs, str):
            return Rejection(TABLES, _scaled_tables(cos_lanes, sin_lanes) or refs)
        cos, sin, _ = refs
        for t in (p for table in (cos, sin) for p in table.parts):
            if not self._broadcasts(t, v.lead):
                return Rejection(TABLES, f"the table {t.name} does not broadcast against x")
        return refs

    def _accept_x(self, node, v, m, n, nblocks, xl: _XLanes) -> Site | Rejection:
        """The site where the value's lanes are x's rotated by tables, else the reason they are not; each step
        narrows the next: x's shape, the copied and rotated lanes, the pairings, the tables."""
        entries = v.entries
        shape_note = self._x_shape(xl, v)
        if shape_note:
            return Rejection(PAIRING, shape_note)
        is_copy = self._copy_test(entries, xl)
        if isinstance(is_copy, Rejection):
            return is_copy
        span = self._rotated_range(n, is_copy)
        if isinstance(span, Rejection):
            return span
        head, rot = span
        styles = self._candidate_styles(entries, xl, head, rot // 2)
        if isinstance(styles, Rejection):
            return styles
        got = self._fitting_lanes(styles, entries, xl, head, rot, n, nblocks, is_copy)
        if isinstance(got, Rejection):
            return got
        style, cos_lanes, sin_lanes, conj = got
        rejected = self._table_from_x(xl, cos_lanes, sin_lanes)
        if rejected is not None:
            return rejected
        refs = self._graph_tables(v, style, cos_lanes, sin_lanes, rot)
        if isinstance(refs, Rejection):
            return refs
        cos, sin, full = refs
        params = RotaryParams(interleaved=style.interleaved, rotary_dim=rot, full_tables=full, conjugate=bool(conj),
                              out_dtype=node.meta["val"].dtype, deinterleave=style.name == "deinterleave",
                              rotary_blocks=style.blocks, rotary_offset=head)
        return Site(node=node, value_k=v.k, x=XView(xl.name, n, xl.k, xl.as_real, tuple(v.grid[: v.k - m])),
                    params=params, tables=GraphTables(cos, sin), wide=v.wide)

    def _x_origins(self, x_node: fx.Node, xl: _XLanes) -> list:
        """Where x's numbers come from: x (a source), or the sources its computed lanes read, with what they
        carry unchanged from. A table computed from any of these is computed from x."""
        if xl.entries is None:
            return _carried_from(x_node)
        names = {a[0] for e in xl.entries for a in poly.atoms_of(e)}
        return [o for name in sorted(names) for o in _carried_from(self.interp.nodes[name])]

    # -- tables ------------------------------------------------------------------------------------
    def _broadcasts(self, t: TableRef, lead: tuple) -> bool:
        val = meta(self.interp.nodes[t.name])
        shape = tuple(val.shape) + ((2,) if t.as_real else ())
        t_lead = shape[: len(shape) - t.k]
        if len(t_lead) > len(lead):
            return False
        return all(as_int(a) == 1 or same_dim(a, b) for a, b in zip(reversed(t_lead), reversed(lead)))

    def _tables(self, cos_lanes, sin_lanes, rot, first_of_pair, partner):
        firsts = [d for d in range(rot) if first_of_pair(d)]
        per_pair = all(cos_lanes[d] == cos_lanes[partner(d)] and sin_lanes[d] == sin_lanes[partner(d)]
                       for d in firsts)
        if per_pair:
            c = self._table([cos_lanes[d] for d in firsts])
            s = self._table([sin_lanes[d] for d in firsts])
            if c and s:
                return c, s, False
        c, s = self._table(cos_lanes), self._table(sin_lanes)
        if c and not s:  # the backward of a rotation: sin read at the partner lane
            s = self._table([sin_lanes[partner(d)] for d in range(rot)])
            s = dataclasses.replace(s, partner=True) if s else None
        if c and s:
            return c, s, True
        return "table lanes are not a strided view of one tensor"

    def _table(self, entries: list) -> TableRef | None:
        """The table `entries` ((atom, coef) per lane) as one view, or as a few concatenated ones."""
        whole = self._one_table(entries)
        if whole is not None:
            return whole
        runs = [[entries[0]]]  # runs of lanes that read one source at evenly spaced entries
        for e in entries[1:]:
            run = runs[-1]
            a, b = run[-1][0], e[0]
            if a[:3] == b[:3] and b[3] > a[3] and (len(run) < 2 or b[3] - a[3] == a[3] - run[-2][0][3]):
                run.append(e)
            elif len(runs) == MAX_TABLE_PIECES:
                return None
            else:
                runs.append([e])
        pieces = [self._one_table(run) for run in runs]
        # one table read again for every head is x's heads, not pieces: the caller tries the head as the grid
        if len(pieces) < 2 or None in pieces or len({p.key for p in pieces}) < len(pieces):
            return None
        return dataclasses.replace(pieces[0], width=len(entries), pieces=tuple(pieces))

    def _one_table(self, entries: list) -> TableRef | None:
        """A view that reads the table `entries`: a strided slice of one source, or a node that computes
        exactly those entries."""
        atoms = [a for a, _ in entries]
        keys = {a[:3] for a in atoms}
        if len(keys) == 1 and all(c == 1.0 for _, c in entries):
            aff = _affine([a[3] for a in atoms])
            if aff:
                name, k, as_real = atoms[0][:3]
                return TableRef(name=name, k=k, as_real=as_real, start=aff[0], step=aff[1], width=len(atoms))
        key = tuple((self._canonical_atom(a), c) for a, c in entries)
        hit = self._gathered().get(key)
        if hit is not None:
            node, k = hit
            return TableRef(name=node.name, k=k, as_real=False, start=0, step=1, width=len(atoms))
        return None

    def _gathered(self) -> dict:
        """Nodes whose lanes are single table entries (a table assembled in the graph from several
        tensors, e.g. the per-axis frequencies of a video model, or scaled), keyed by their exact lanes: each
        atom with its grid rank, which says the leading index it stands for. A key without the rank once let
        `c * 2` ([2, 8], one row per head) stand for its own row `(c * 2)[0]`, whose atoms are c's lanes at
        grid rank 2: the lanes of row 0 (and a packed `[S, 2, D]` table stand for its cos half)."""
        if self._gather is None:
            self._gather = {}
            for node, v in self.interp.values.items():
                if not isinstance(v, lanes.LaneValue) or v.is_complex:
                    continue
                while v is not None:
                    if all(e is not None and len(e) == 1 and len(next(iter(e))) == 1 for e in v.entries):
                        key = tuple((self._canonical_atom(m[0]), c) for e in v.entries for m, c in e.items())
                        self._gather.setdefault(key, (node, v.k))
                        v = lanes.demote(self.interp, v)
                    else:
                        v = None
        return self._gather

    def _canonical_atom(self, atom: tuple) -> tuple:
        """The atom with the size-1 outer dims of its source's lane grid moved to the leading dims: the same
        entry at every leading index (a size-1 leading dim broadcasts), so two ranks that differ only there
        compare equal, and no others do."""
        name, k, as_real, flat = atom
        got = self._canon.get(atom[:3])
        if got is None:
            val = meta(self.interp.nodes[name])
            shape = tuple(val.shape) + ((2,) if as_real else ())
            got = k
            while got > 1 and as_int(shape[len(shape) - got]) == 1:
                got -= 1
            self._canon[atom[:3]] = got
        return (name, got, as_real, flat)


@dataclasses.dataclass(frozen=True)
class Pairing:
    """Which lanes of x an output lane d combines (x_lane, x_partner), whether d holds a pair's first
    element, and which output lane holds the other element of its pair (out_partner). NeoX pairs may lie
    within `blocks` equal blocks of the rotated lanes (a head dim split per axis, each block rotate_half)."""

    name: str
    half: int
    blocks: int = 1

    @property
    def interleaved(self) -> bool:
        return self.name != "neox"

    @property
    def key(self) -> tuple:
        return (self.name, self.blocks)

    @property
    def _block_half(self) -> int:
        return self.half // self.blocks

    def x_lane(self, d: int) -> int:
        if self.name == "deinterleave":  # out[j] and out[j + R/2] come from the pair (2j, 2j + 1) of x
            return 2 * (d % self.half) + d // self.half
        return d

    def x_partner(self, d: int) -> int:
        if self.name == "neox":
            return self._neox_partner(d)
        return self.x_lane(d) ^ 1

    def first(self, d: int) -> bool:
        return d % 2 == 0 if self.name == "interleaved" else d % (2 * self._block_half) < self._block_half

    def out_partner(self, d: int) -> int:
        """The output lane of d's pair partner: NeoX-ordered for the de-interleaved output too."""
        return d ^ 1 if self.name == "interleaved" else self._neox_partner(d)

    def _neox_partner(self, d: int) -> int:
        bh = self._block_half
        return d - d % (2 * bh) + (d % (2 * bh) + bh) % (2 * bh)


def _pairings(half: int) -> list:
    """The pairings to try: NeoX, interleaved, de-interleaved, then NeoX within 2, 3, ... equal blocks of at
    least 4 lanes (blocks of 2 are interleaved pairs)."""
    names = ["neox", "interleaved", "deinterleave"]
    blocks = [Pairing("neox", half, nb) for nb in range(2, half // 2 + 1) if half % nb == 0]
    return [Pairing(name, half) for name in names] + blocks


def _unit_signature(p: dict) -> frozenset:
    """`poly.signature` up to a constant factor: the key under which lane 0 of a computed x candidate is looked up
    where the exact one finds none. The cofactor of a table atom in lane 0 is x[0] times whatever constant the
    tables carry (attention scaling, a negated pair: `-1.3 * norm(q)[0]`), and the exact signature missed every
    computed x there (a normalised, transposed q read as a rotation of the raw q, then rejected). Only computed
    values whose lane 0 is more than one source lane are keyed so: one that is a signed copy of a source lane
    (the rotate_half of x, `-x[8]`) would be found for every negated table, and the op reads x, not its
    rotate_half. Coefficients are rounded after the division, since the key only proposes a candidate:
    `_accept_x` checks its lanes exactly."""
    sig = poly.signature(p)
    if not sig:
        return sig
    lead = min(sig, key=lambda t: t[0])[1]
    return frozenset((mono, round(coef / lead, 9)) for mono, coef in sig)


def _one_atom(p: dict) -> bool:
    """Whether p is a multiple of one atom (a lane of a source, moved or negated)."""
    return len(p) == 1 and len(next(iter(p))) == 1


def _split_products(e: dict, xd: dict, xp: dict):
    """`Acceptor._split` for its common case, read off the monomials: each x lane one monomial (a source lane,
    or a normed lane x * rsqrt * weight) and e two monomials, each one of them times one more atom (the table
    entry). None for any other form, which the general search then takes; where this answers, the two agree.
    Every rotated lane of every site goes through here, so it is the acceptor's inner loop."""
    if len(e) != 2 or len(xd) != 1 or len(xp) != 1:
        return None
    ((md, cd),), ((mp, cp),) = xd.items(), xp.items()
    if md == mp:
        return None
    ca = cb = None
    for mono, coef in e.items():
        if ca is None and (a := _one_more(mono, md)) is not None:
            ca = (a, coef / cd)
        elif cb is None and (a := _one_more(mono, mp)) is not None:
            cb = (a, coef / cp)
        else:
            return None
    if ca[0] == cb[0] or ca[0] in md or ca[0] in mp or cb[0] in md or cb[0] in mp:
        return None
    return ca, cb


def _scaled_tables(cos_lanes: list, sin_lanes: list) -> str:
    """Why tables read with a factor other than 1 are no view: the graph holds no node with the scaled (or
    negated) entries. "" when every factor is 1."""
    for what, lanes_ in (("cos", cos_lanes), ("sin", sin_lanes)):
        d, (atom_, coef) = next(((d, e) for d, e in enumerate(lanes_) if e[1] != 1.0), (None, (None, None)))
        if d is None:
            continue
        table = f"-{atom_[0]}" if coef == -1.0 else f"{coef:g} * {atom_[0]}"
        return (f"lane {d} reads its {what} factor as {table}, and no node of the graph holds {table} (x is "
                "multiplied by the factor separately): multiply x by one table tensor, which fuses even when "
                "computed (x * (-cos) + rot(x) * (-sin) is the rotation by the angle plus pi)")
    return ""


# At most this many nodes are searched for a computed table, from the value being accepted back (a table is a
# few ops: `c + c2`, an angle-sum identity, a gate; the bound keeps a rejected value of a wide graph cheap).
_TABLE_SCOPE_NODES = 64


def _without(mono: tuple, sub: tuple) -> tuple | None:
    """`mono` with the atoms of `sub` taken out once each, when it has them all and more; else None."""
    if len(mono) <= len(sub):
        return None
    rest = list(mono)
    for a in sub:
        if a not in rest:
            return None
        rest.remove(a)
    return tuple(rest)


def _normal_key(f: dict, first: tuple) -> frozenset:
    """f up to a constant factor: its coefficients divided by that of the monomial `first`."""
    c0 = f[first]
    return frozenset((m, c / c0) for m, c in f.items())


def _lane_index(v: lanes.LaneValue) -> dict:
    """A computed value's lanes by `_normal_key`: key -> (grid rank, flat lane, coefficient divided out)."""
    index: dict = {}
    for flat, e in enumerate(v.entries):
        if e:
            first = min(e)
            index.setdefault(_normal_key(e, first), (v.k, flat, e[first]))
    return index


def _plain(entries: list) -> bool:
    """Every lane one atom (a source's lanes, a view, a negated or scaled copy): not a computed table."""
    return all(len(e) == 1 and len(next(iter(e))) == 1 for e in entries)


def _describe(f: dict) -> str:
    """A computed factor in a user's terms: the nodes whose entries it combines (`arg1_1*arg3_1 - arg2_1`)."""
    terms = []
    for mono, coef in sorted(f.items())[:4]:
        names = "*".join(a[0] for a in mono) or "1"
        scale = "" if abs(coef) == 1.0 else f"{abs(coef):g}*"
        terms.append(("- " if coef < 0 else "+ ") + scale + names)
    text = " ".join(terms) + (" + ..." if len(f) > 4 else "")
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


def _reads_lane(e: dict | None, xd: dict) -> bool:
    """Whether some monomial of e is a monomial of the x lane xd times more atoms (a table entry, or the product
    of a computed table's): `_split` and `_shared_factor` both need it of a lane that combines x lanes."""
    if not e:
        return False
    return any(_without(mono, md) is not None for mono in e for md in xd)


def _one_more(mono: tuple, sub: tuple):
    """The atom that `mono` has beyond the monomial `sub`, or None."""
    rest = _without(mono, sub) if len(mono) == len(sub) + 1 else None
    return rest[0] if rest else None


def _carried_from(x: fx.Node) -> list:
    """x and the nodes it carries unchanged from (casts, views, copies), back to where its numbers arise: a table
    computed from any of them is computed from x."""
    return chain_back(x, PASS_THROUGH)


def _close(p: dict, q: dict) -> bool:
    if p is q and p is not None:
        return True
    if p is None or q is None or p.keys() != q.keys():
        return False
    return all(abs(p[m] - q[m]) <= 1e-12 * max(1.0, abs(q[m])) for m in p)
