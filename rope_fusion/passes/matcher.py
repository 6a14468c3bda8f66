"""Acceptance: does a lane value compute a rotary embedding of one source tensor?

A value is accepted when, over its lanes d, every entry is exactly `x[d]*C(d) + s(d)*x[p(d)]*S(d)` for
d < R, with p the NeoX or the interleaved pairing and s the sign pattern of a rotation (or of its inverse),
every lane d >= R is `x[d]`, C and S are single table atoms that differ from each other, and the tables do
not depend on x. The answer is a `Match` that says which views of which nodes the fused op reads, or the
reason for the rejection (reported as a near miss when the value otherwise looks like a rotation).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from . import lanes as L
from . import poly as P


@dataclasses.dataclass(frozen=True)
class TableRef:
    """A table as the op reads it: node (as_real when complex), last k dims flattened, then a strided slice."""

    name: str
    k: int
    as_real: bool
    start: int
    step: int
    width: int

    @property
    def key(self) -> tuple:
        return (self.name, self.k, self.as_real, self.start, self.step, self.width)


@dataclasses.dataclass
class Match:
    node: fx.Node  # the node whose value is the rotation (to be replaced)
    value_k: int  # grid dims of the accepted value: the op's output is unflattened to them
    blocks: tuple  # grid dims outside the rotated lanes (e.g. heads of a [B,S,H*D] x), broadcast over
    x_name: str  # a source node, or a node whose computed value is x
    x_k: int
    x_as_real: bool
    head_dim: int
    rotary_dim: int
    interleaved: bool
    full_tables: bool
    conjugate: bool
    cos: TableRef
    sin: TableRef
    wide: bool  # the replaced subgraph computed in fp64
    offset: int = 0  # lanes before the rotated part, copied unchanged


def _affine(flats: list) -> tuple | None:
    start = flats[0]
    step = flats[1] - flats[0] if len(flats) > 1 else 1
    if step < 1:
        return None
    if any(f != start + step * i for i, f in enumerate(flats)):
        return None
    return start, step


def looks_like_rotation(v: L.LaneValue) -> bool:
    """Some lane adds two products that read different lanes of one tensor: worth a near-miss record."""
    for e in v.entries:
        if e is None or len(e) < 2:
            continue
        seen: dict = {}  # source (name, k, as_real) -> [(lane, monomial)] of its atoms in products
        for i, m in enumerate(e):
            if len(m) < 2:
                continue
            for a in m:
                got = seen.setdefault(a[:3], [])
                if any(f != a[3] and j != i for f, j in got):
                    return True
                got.append((a[3], i))
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

    def __init__(self, interp: L.LaneInterpreter):
        self.I = interp
        self.order = {n: i for i, n in enumerate(interp.graph.nodes)}
        self._anc: dict = {}
        self._gather: dict | None = None
        self._by_entry0: dict | None = None

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
            for a in n.all_input_nodes:
                if a is src:
                    found = True
                    break
                if a not in seen and self.order.get(a, -1) > lo:
                    seen.add(a)
                    stack.append(a)
        self._anc[key] = found
        return found

    def accept(self, node: fx.Node, v: L.LaneValue) -> Match | str:
        reason = "not a rotation"
        while v is not None:
            if any(e is None for e in v.entries):
                d = next(i for i, e in enumerate(v.entries) if e is None)
                return f"lane {d} is never written"
            if v.is_complex:
                return "complex result"
            for m in range(v.k, 0, -1):
                r = self._accept_blocks(node, v, m)
                if isinstance(r, Match):
                    return r
                reason = r
            v = L.demote(self.I, v)
        return reason

    # -- x candidates ------------------------------------------------------------------------------
    def _x_candidates(self, p1: dict, v: L.LaneValue, total: int) -> list:
        out = []
        if len(p1) == 1:
            (m, c), = p1.items()
            if len(m) == 1 and c == 1.0 and m[0][3] == 0:
                a = m[0]
                out.append(_XLanes(a[0], a[1], a[2]))
        if self._by_entry0 is None:
            self._by_entry0 = {}
            for n, xv in self.I.values.items():
                if isinstance(xv, L.LaneValue) and not xv.is_complex and xv.entries and xv.entries[0]:
                    self._by_entry0.setdefault(P.signature(xv.entries[0]), []).append(n)
        for n in self._by_entry0.get(P.signature(p1), []):
            xv = self.I.values[n]
            if len(xv.entries) == total and len(xv.lead) == len(v.lead) and None not in xv.entries:
                out.append(_XLanes(n.name, xv.k, False, xv.entries))
        return out

    def _accept_blocks(self, node, v, m) -> Match | str:
        E = v.entries
        n = math.prod(v.grid[v.k - m:])
        nblocks = len(E) // n
        if n < 2:
            return "fewer than two lanes"
        e0 = E[0]
        atoms0 = sorted(P.atoms_of(e0))
        reason = "lane 0 is not x times a table plus x times a table"
        cands = list(self._x_candidates(e0, v, len(E)))  # lane 0 may be a plain copy of x
        for ac in atoms0:
            p1 = P.cofactor(e0, ac)
            if p1:
                cands.extend(self._x_candidates(p1, v, len(E)))
        # a source tensor before a computed one: x, not its rotate_half, is what the op should read
        cands.sort(key=lambda xl: xl.entries is not None)
        for xl in cands:
            r = self._accept_x(node, v, m, n, nblocks, xl)
            if isinstance(r, Match):
                return r
            reason = r
        return reason

    def _split(self, e, xd, xp):
        """e == c1*a*xd + c2*b*xp for atoms a, b: return ((a, c1), (b, c2)) or None."""
        if not xd or not xp:
            return None
        ca = cb = None
        for a in P.atoms_of(e):
            q = P.cofactor(e, a)
            r1 = P.ratio(q, xd)
            if r1 is not None and ca is None:
                ca = (a, r1)
                continue
            r2 = P.ratio(q, xp)
            if r2 is not None and cb is None:
                cb = (a, r2)
        if ca is None or cb is None or ca[0] == cb[0]:
            return None
        rebuilt = P.add(P.scale(P.mul(P.atom(ca[0]), xd) or {}, ca[1]),
                        P.scale(P.mul(P.atom(cb[0]), xp) or {}, cb[1]))
        if rebuilt != e and not _close(rebuilt, e):
            return None
        return ca, cb

    def _accept_x(self, node, v, m, n, nblocks, xl: _XLanes) -> Match | str:
        E = v.entries

        def is_copy(i):
            return _close(E[i], xl.entry(i))

        # lanes [0, P) copied, [P, P+R) rotated, the rest copied (P > 0: the rotated part comes after a
        # pass-through head, as in LTX's padded tables or DeepSeek-V4's rope at the end)
        P = 0
        while P < n and is_copy(P):
            P += 1
        R = n - P
        for d in range(P, n):
            if is_copy(d):
                R = d - P
                break
        if R < 2 or R % 2:
            return f"rotated lanes [{P}, {P + R}) are not an even count of at least 2"
        half = R // 2
        # the partner of the first rotated lane decides the style
        e0 = E[P]
        x0 = xl.entry(P)
        style = None
        for interleaved, p0 in ((False, half), (True, 1)):
            if self._split(e0, x0, xl.entry(P + p0)) is not None:
                style = interleaved
                break
        if style is None:
            return f"lane {P} pairs with neither lane {P}+R/2 (NeoX) nor lane {P + 1} (interleaved)"
        interleaved = style

        def partner(d):
            return d ^ 1 if interleaved else (d + half) % R

        def first_of_pair(d):
            return d % 2 == 0 if interleaved else d < half

        C, S = [], []
        conj = None
        for b in range(nblocks):
            base = b * n + P
            for d in range(R):
                sp = self._split(E[base + d], xl.entry(base + d), xl.entry(base + partner(d)))
                if sp is None:
                    return f"lane {d} does not combine x[{d}] and x[{partner(d)}] with one table entry each"
                (ca, cc), (sa, sc) = sp
                if cc <= 0:
                    return f"lane {d}: x[{d}] enters with a negative factor"
                if ca == sa:
                    return f"lane {d} multiplies both x lanes by the same table entry"
                rotation_sign = -1.0 if first_of_pair(d) else 1.0
                this_conj = (sc > 0) != (rotation_sign > 0)
                if conj is None:
                    conj = this_conj
                elif conj != this_conj:
                    return f"lane {d} has the sign pattern of neither a rotation nor its inverse"
                c_entry, s_entry = (ca, cc), (sa, abs(sc))
                if b == 0:
                    C.append(c_entry)
                    S.append(s_entry)
                elif C[d] != c_entry or S[d] != s_entry:
                    return "the tables differ between heads of x"
            for d in [*range(-P, 0), *range(R, n - P)]:
                if not is_copy(base + d):
                    return f"lane {P + d} outside the rotated part is not a copy of x"
        x_node = self.I.nodes[xl.name]
        for key in {a[:3] for a, _ in C} | {a[:3] for a, _ in S}:
            tnode = self.I.nodes[key[0]]
            if tnode is x_node:
                return "the table is x itself"
            if self.depends_on(tnode, x_node):
                return f"the table {tnode.name} depends on x"
        refs = self._tables(C, S, R, first_of_pair, partner)
        if isinstance(refs, str):
            return refs
        cos, sin, full = refs
        for t in (cos, sin):
            if not self._broadcasts(t, v.lead):
                return f"the table {t.name} does not broadcast against x"
        if xl.entries is None:
            xval = L._meta(x_node)
            xshape = tuple(xval.shape) + ((2,) if xl.as_real else ())
            x_lead = xshape[: len(xshape) - xl.k]
            if len(x_lead) != len(v.lead) or not all(L.same_dim(a, b) for a, b in zip(x_lead, v.lead)):
                return "x is broadcast to the output shape"
            if math.prod(L._ints(xshape[len(xshape) - xl.k:])) != len(E):
                return "x has a different lane count"
        else:
            xv = self.I.values[x_node]
            x_lead = xv.lead
            if len(x_lead) == len(v.lead) and not all(L.same_dim(a, b) for a, b in zip(x_lead, v.lead)):
                return "x is broadcast to the output shape"
        blocks = tuple(v.grid[: v.k - m])
        return Match(node, v.k, blocks, xl.name, xl.k, xl.as_real, n, R, interleaved, full, bool(conj),
                     cos, sin, v.wide, P)

    # -- tables ------------------------------------------------------------------------------------
    def _broadcasts(self, t: TableRef, lead: tuple) -> bool:
        val = L._meta(self.I.nodes[t.name])
        shape = tuple(val.shape) + ((2,) if t.as_real else ())
        t_lead = shape[: len(shape) - t.k]
        if len(t_lead) > len(lead):
            return False
        return all(L.as_int(a) == 1 or L.same_dim(a, b) for a, b in zip(reversed(t_lead), reversed(lead)))

    def _tables(self, C, S, R, first_of_pair, partner):
        firsts = [d for d in range(R) if first_of_pair(d)]
        halfable = all(C[d] == C[partner(d)] and S[d] == S[partner(d)] for d in firsts)
        if halfable:
            c = self._table([C[d] for d in firsts])
            s = self._table([S[d] for d in firsts])
            if c and s:
                return c, s, False
        c, s = self._table(C), self._table(S)
        if c and s:
            return c, s, True
        return "table lanes are not a strided view of one tensor"

    def _table(self, entries: list) -> TableRef | None:
        """A view that reads the table `entries` ((atom, coef) per lane): a strided slice of one source,
        or a node that computes exactly those entries."""
        atoms = [a for a, _ in entries]
        keys = {a[:3] for a in atoms}
        if len(keys) == 1 and all(c == 1.0 for _, c in entries):
            aff = _affine([a[3] for a in atoms])
            if aff:
                return TableRef(*atoms[0][:3], aff[0], aff[1], len(atoms))
        key = tuple(P.signature({(a,): c}) for a, c in entries)
        hit = self._gathered().get(key)
        if hit is not None:
            node, k = hit
            return TableRef(node.name, k, False, 0, 1, len(atoms))
        return None

    def _gathered(self) -> dict:
        """Nodes whose lanes are single table entries (a table assembled in the graph from several
        tensors, e.g. the per-axis frequencies of a video model, or scaled), keyed by lane signature."""
        if self._gather is None:
            self._gather = {}
            for node, v in self.I.values.items():
                if not isinstance(v, L.LaneValue) or v.is_complex:
                    continue
                while v is not None:
                    if all(e is not None and len(e) == 1 and len(next(iter(e))) == 1 for e in v.entries):
                        key = tuple(P.signature(e) for e in v.entries)
                        self._gather.setdefault(key, (node, v.k))
                        v = L.demote(self.I, v)
                    else:
                        v = None
        return self._gather


def _close(p: dict, q: dict) -> bool:
    if p is q and p is not None:
        return True
    if p is None or q is None or p.keys() != q.keys():
        return False
    return all(abs(p[m] - q[m]) <= 1e-12 * max(1.0, abs(q[m])) for m in p)


def source_line(node: fx.Node) -> str:
    """The innermost model-code frame of the node's stack trace ("path:line")."""
    tb = node.meta.get("stack_trace") or ""
    best = ""
    for line in tb.splitlines():
        line = line.strip()
        if line.startswith("File "):
            try:
                path = line.split('"')[1]
                lineno = line.split("line ")[1].split(",")[0]
            except IndexError:
                continue
            best = f"{path}:{lineno}"
    return best or "<unknown>"


_ARITHMETIC = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor,
               torch.ops.aten.addcmul.default)


def rotation_source(node: fx.Node) -> str:
    """Where the rotation's arithmetic was written: the replaced node may be a view or transpose that the
    model applies afterwards (attention dispatch code), so look back for the nearest add/mul."""
    seen, queue, i = {node}, [node], 0
    while i < len(queue) and i < 64:
        n = queue[i]
        i += 1
        if n.target in _ARITHMETIC and n.meta.get("stack_trace"):
            return source_line(n)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                queue.append(a)
    return source_line(node)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")
