"""Acceptance: does a lane value compute a rotary embedding of one source tensor?

A value is accepted when, over its lanes d, every entry is exactly `x[d]*C(d) + s(d)*x[p(d)]*S(d)` for
d < R, with p the NeoX or the interleaved pairing and s the sign pattern of a rotation (or of its inverse),
every lane d >= R is `x[d]`, C and S are single table atoms that differ from each other, and the tables do
not depend on x. The answer is a `Match` that says which views of which nodes the fused op reads, or the
reason for the rejection (reported as a near miss when the value otherwise looks like a rotation).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from . import lanes as L


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
    x_name: str
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


def _affine(flats: list) -> tuple | None:
    start = flats[0]
    step = flats[1] - flats[0] if len(flats) > 1 else 1
    if step < 1:
        return None
    if any(f != start + step * i for i, f in enumerate(flats)):
        return None
    return start, step


def looks_like_rotation(v: L.LaneValue) -> bool:
    """Some lane is a sum of two products that share a source: worth a near-miss record."""
    for e in v.entries:
        if e is None or len(e) != 2:
            continue
        (m1, _), (m2, _) = e.items()
        if len(m1) == 2 and len(m2) == 2 and {a[:3] for a in m1} & {a[:3] for a in m2}:
            return True
    return False


class Acceptor:
    """Checks lane values for rotary form; remembers ancestry queries across a graph."""

    def __init__(self, interp: L.LaneInterpreter):
        self.I = interp
        self.order = {n: i for i, n in enumerate(interp.graph.nodes)}
        self._anc: dict = {}

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
            r = self._accept_flat(node, v)
            if isinstance(r, Match):
                return r
            reason = r
            v = L.demote(self.I, v)
        return reason

    def _accept_flat(self, node: fx.Node, v: L.LaneValue) -> Match | str:
        E = v.entries
        n = len(E)
        if v.is_complex:
            return "complex result"
        if n < 2:
            return "fewer than two lanes"
        for d, e in enumerate(E):
            if e is None:
                return f"lane {d} is never written"
        e0 = E[0]
        if len(e0) != 2 or any(len(m) != 2 for m in e0):
            return "lane 0 is not a sum of two products"
        (m1, _), (m2, _) = e0.items()
        candidates = sorted({a[:3] for a in m1} & {a[:3] for a in m2})
        if not candidates:
            return "the two products of lane 0 share no tensor"
        reason = "not a rotation"
        for X in candidates:
            r = self._accept_x(node, v, X)
            if isinstance(r, Match):
                return r
            reason = r
        return reason

    def _accept_x(self, node, v, X) -> Match | str:
        E = v.entries
        n = len(E)

        def copy_lane(e, d):
            return len(e) == 1 and e.get(((*X, d),)) == 1.0

        R = n
        for d in range(n):
            if copy_lane(E[d], d):
                R = d
                break
        if R < 2 or R % 2:
            return f"rotated lanes end at {R}, not an even count"
        for d in range(R, n):
            if not copy_lane(E[d], d):
                return f"lane {d} past the rotated part is not a copy of x"

        def split(e):
            """[(x_flat, table_atom, coef)] or None."""
            out = []
            if len(e) != 2:
                return None
            for m, c in e.items():
                if len(m) != 2:
                    return None
                xs = [a for a in m if a[:3] == X]
                if len(xs) != 1:
                    return None
                t = m[0] if m[1] is xs[0] else m[1]
                out.append((xs[0][3], t, c))
            return out

        t0 = split(E[0])
        if t0 is None:
            return "lane 0 is not x times a table plus x times a table"
        partners = {f for f, _, _ in t0 if f != 0}
        if len(partners) != 1:
            return "lane 0 does not pair with exactly one other lane"
        p0 = partners.pop()
        half = R // 2
        if p0 == half:
            interleaved = False
        elif p0 == 1:
            interleaved = True
        else:
            return f"lane 0 pairs with lane {p0}: neither NeoX ({half}) nor interleaved (1)"

        def partner(d):
            return d ^ 1 if interleaved else (d + half) % R

        def first_of_pair(d):
            return d % 2 == 0 if interleaved else d < half

        C, S = [], []
        conj = None
        for d in range(R):
            t = split(E[d])
            if t is None:
                return f"lane {d} is not x times a table plus x times a table"
            own = [x for x in t if x[0] == d]
            other = [x for x in t if x[0] == partner(d)]
            if len(own) != 1 or len(other) != 1:
                return f"lane {d} does not combine x[{d}] with x[{partner(d)}]"
            _, c_atom, c_coef = own[0]
            _, s_atom, s_coef = other[0]
            if c_coef != 1.0 or abs(s_coef) != 1.0:
                return f"lane {d} has coefficients {c_coef}, {s_coef} instead of 1 and +-1"
            if c_atom == s_atom:
                return f"lane {d} multiplies both x lanes by the same table entry"
            rotation_sign = -1.0 if first_of_pair(d) else 1.0
            this_conj = s_coef != rotation_sign
            if conj is None:
                conj = this_conj
            elif conj != this_conj:
                return f"lane {d} has the sign pattern of neither a rotation nor its inverse"
            C.append(c_atom)
            S.append(s_atom)
        c_keys, s_keys = {a[:3] for a in C}, {a[:3] for a in S}
        if len(c_keys) != 1 or len(s_keys) != 1:
            return "table entries come from more than one tensor"
        x_node = self.I.nodes[X[0]]
        for key in (c_keys | s_keys):
            tnode = self.I.nodes[key[0]]
            if tnode is x_node:
                return "the table is x itself"
            if self.depends_on(tnode, x_node):
                return f"the table {tnode.name} depends on x"
        refs = self._tables(C, S, R, interleaved, first_of_pair, partner)
        if isinstance(refs, str):
            return refs
        cos, sin, full = refs
        xval = L._meta(x_node)
        xshape = tuple(xval.shape) + ((2,) if X[2] else ())
        xk = X[1]
        x_lead = xshape[: len(xshape) - xk]
        if len(x_lead) != len(v.lead) or not all(L.same_dim(a, b) for a, b in zip(x_lead, v.lead)):
            return "x is broadcast to the output shape"
        return Match(node, v.k, X[0], xk, X[2], n, R, interleaved, full, bool(conj), cos, sin, v.wide)

    def _tables(self, C, S, R, interleaved, first_of_pair, partner):
        firsts = [d for d in range(R) if first_of_pair(d)]
        halfable = all(C[d] == C[partner(d)] and S[d] == S[partner(d)] for d in firsts)
        if halfable:
            cf = _affine([C[d][3] for d in firsts])
            sf = _affine([S[d][3] for d in firsts])
            if cf and sf:
                w = R // 2
                return (TableRef(*C[0][:3], cf[0], cf[1], w), TableRef(*S[0][:3], sf[0], sf[1], w), False)
        cf = _affine([a[3] for a in C])
        sf = _affine([a[3] for a in S])
        if cf and sf:
            return (TableRef(*C[0][:3], cf[0], cf[1], R), TableRef(*S[0][:3], sf[0], sf[1], R), True)
        return "table lanes are not a strided view of one tensor"


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


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")
