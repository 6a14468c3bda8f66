"""Small polynomials over lane atoms: the entries of the lane algebra.

An atom names one lane of one source tensor: (node name, k, as_real, flat), where the source's last k dims
form its lane grid, `flat` indexes that grid in row-major order and `as_real` says the source is complex
and is read through view_as_real (its grid then ends in the re/im dim of size 2). A polynomial maps a
monomial (a sorted tuple of atoms) to its float coefficient. A rotation is degree 2 (a table entry times a lane
of x); a folded norm's statistics and tables computed in the graph reach higher, so the cap is `MAX_DEGREE`
(and `MAX_TERMS` terms): past it the interpreter treats the value as opaque, and these stay small enough for
plain dicts.
"""

from __future__ import annotations

from collections.abc import Callable

Atom = tuple  # (name: str, k: int, as_real: bool, flat: int)
Poly = dict  # {tuple[Atom, ...]: float}

MAX_DEGREE = 6
MAX_TERMS = 16


def const(value: float) -> Poly:
    """The constant polynomial `value` ({} for zero)."""
    return {(): float(value)} if value != 0 else {}


def atom(lane: Atom) -> Poly:
    """The polynomial that is one atom."""
    return {(lane,): 1.0}


def add(base: Poly, other: Poly, alpha: float = 1.0) -> Poly:
    """base + alpha*other; terms that cancel are dropped."""
    out = dict(base)
    for mono, coef in other.items():
        total = out.get(mono, 0.0) + alpha * coef
        if total == 0.0:
            out.pop(mono, None)
        else:
            out[mono] = total
    return out


def scale(poly: Poly, factor: float) -> Poly:
    """factor*poly."""
    if factor == 0.0:
        return {}
    return {mono: coef * factor for mono, coef in poly.items()}


def mul(left: Poly, right: Poly) -> Poly | None:
    """Product, or None when it grows past the degree/term caps (the value becomes opaque)."""
    if len(left) == 1 and len(right) == 1:  # the common case (a lane times a table entry): no accumulation
        ((mono_l, coef_l),), ((mono_r, coef_r),) = left.items(), right.items()
        if not mono_l or not mono_r:
            mono = mono_l or mono_r
        elif len(mono_l) == 1 and len(mono_r) == 1:
            mono = mono_l + mono_r if mono_l[0] <= mono_r[0] else mono_r + mono_l
        else:
            mono = tuple(sorted(mono_l + mono_r))
            if len(mono) > MAX_DEGREE:
                return None
        coef = coef_l * coef_r
        return {mono: coef} if coef != 0.0 else {}
    out: Poly = {}
    for mono_l, coef_l in left.items():
        for mono_r, coef_r in right.items():
            if not mono_l:
                mono = mono_r
            elif not mono_r:
                mono = mono_l
            elif len(mono_l) == 1 and len(mono_r) == 1:  # the common case: atom times atom
                mono = mono_l + mono_r if mono_l[0] <= mono_r[0] else mono_r + mono_l
            else:
                mono = tuple(sorted(mono_l + mono_r))
                if len(mono) > MAX_DEGREE:
                    return None
            total = out.get(mono, 0.0) + coef_l * coef_r
            if total == 0.0:
                out.pop(mono, None)
            else:
                out[mono] = total
    if len(out) > MAX_TERMS:
        return None
    return out


def remap(poly: Poly, rename: Callable[[Atom], Atom]) -> Poly:
    """Rename atoms (used when a value's lane grid absorbs a leading dim)."""
    out: Poly = {}
    for mono, coef in poly.items():
        renamed = tuple(sorted(rename(a) for a in mono))
        out[renamed] = out.get(renamed, 0.0) + coef
    return out


def cofactor(poly: Poly, lane: Atom) -> Poly:
    """The polynomial q with poly = lane*q + (terms without lane); lane appears at most once per monomial."""
    out: Poly = {}
    for mono, coef in poly.items():
        if lane in mono:
            i = mono.index(lane)
            rest = mono[:i] + mono[i + 1:]
            out[rest] = out.get(rest, 0.0) + coef
    return out


def atoms_of(poly: Poly) -> set:
    """Every atom that occurs in some monomial."""
    return {a for mono in poly for a in mono}


def ratio(num: Poly, den: Poly) -> float | None:
    """c with num == c*den (den nonzero; coefficients equal to a relative 1e-12), else None."""
    if not den or len(num) != len(den):
        return None
    factor = None
    for mono, coef in den.items():
        num_coef = num.get(mono)
        if num_coef is None:
            return None
        this = num_coef / coef
        if factor is None:
            factor = this
        elif abs(this - factor) > 1e-12 * max(1.0, abs(factor)):
            return None
    return factor


def signature(poly: Poly) -> frozenset:
    """poly with the atoms' grid ranks dropped: equal for a value and its promoted first block."""
    return frozenset((tuple((a[0], a[2], a[3]) for a in mono), coef) for mono, coef in poly.items())
