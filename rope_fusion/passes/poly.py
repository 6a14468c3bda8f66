"""Small polynomials over lane atoms: the entries of the lane algebra.

An atom names one lane of one source tensor: (node name, k, as_real, flat), where the source's last k dims
form its lane grid, `flat` indexes that grid in row-major order and `as_real` says the source is complex
and is read through view_as_real (its grid then ends in the re/im dim of size 2). A polynomial maps a
monomial (a sorted tuple of atoms) to its coefficient. RoPE needs degree 2 at most; anything larger is cut
off by the interpreter, so these stay tiny and plain dicts are fast enough.
"""

from __future__ import annotations

Atom = tuple  # (name: str, k: int, as_real: bool, flat: int)
Poly = dict  # {tuple[Atom, ...]: float}

MAX_DEGREE = 6
MAX_TERMS = 16


def const(c: float) -> Poly:
    return {(): float(c)} if c != 0 else {}


def atom(a: Atom) -> Poly:
    return {(a,): 1.0}


def add(p: Poly, q: Poly, alpha: float = 1.0) -> Poly:
    out = dict(p)
    for m, c in q.items():
        v = out.get(m, 0.0) + alpha * c
        if v == 0.0:
            out.pop(m, None)
        else:
            out[m] = v
    return out


def scale(p: Poly, c: float) -> Poly:
    if c == 0.0:
        return {}
    return {m: v * c for m, v in p.items()}


def mul(p: Poly, q: Poly) -> Poly | None:
    """Product, or None when it grows past the degree/term caps (the value becomes opaque)."""
    out: Poly = {}
    for m1, c1 in p.items():
        for m2, c2 in q.items():
            if not m1:
                m = m2
            elif not m2:
                m = m1
            elif len(m1) == 1 and len(m2) == 1:  # the common case: atom times atom
                m = m1 + m2 if m1[0] <= m2[0] else m2 + m1
            else:
                m = tuple(sorted(m1 + m2))
                if len(m) > MAX_DEGREE:
                    return None
            v = out.get(m, 0.0) + c1 * c2
            if v == 0.0:
                out.pop(m, None)
            else:
                out[m] = v
    if len(out) > MAX_TERMS:
        return None
    return out


def remap(p: Poly, fn) -> Poly:
    """Rename atoms (used when a value's lane grid absorbs a leading dim)."""
    out: Poly = {}
    for m, c in p.items():
        nm = tuple(sorted(fn(a) for a in m))
        out[nm] = out.get(nm, 0.0) + c
    return out


def cofactor(p: Poly, a: Atom) -> Poly:
    """The polynomial q with p = a*q + (terms without a); a appears at most once per monomial here."""
    out: Poly = {}
    for m, c in p.items():
        if a in m:
            i = m.index(a)
            rest = m[:i] + m[i + 1:]
            out[rest] = out.get(rest, 0.0) + c
    return out


def atoms_of(p: Poly) -> set:
    return {a for m in p for a in m}


def ratio(p: Poly, q: Poly) -> float | None:
    """c with p == c*q (q nonzero), else None."""
    if not q or len(p) != len(q):
        return None
    c = None
    for m, v in q.items():
        pv = p.get(m)
        if pv is None:
            return None
        r = pv / v
        if c is None:
            c = r
        elif abs(r - c) > 1e-12 * max(1.0, abs(c)):
            return None
    return c


def signature(p: Poly) -> frozenset:
    """p with the atoms' grid ranks dropped: equal for a value and its promoted first block."""
    return frozenset((tuple((a[0], a[2], a[3]) for a in m), c) for m, c in p.items())
