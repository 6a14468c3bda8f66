"""The 2x2 matrix that a rejected value applies to each pair of x lanes, in a user's terms.

Models that build their tables as 2x2 matrices (`stack([cos, -sin, sin, cos]).view(..., 2, 2)`, HiDream, PRX,
Kandinsky) write the rotation's sign pattern into the table. When that pattern is wrong ([[c, s], [s, c]],
[[c, -s], [-s, c]]), the matcher rejects the value, and the reason should name the matrix the graph builds
rather than guess that the table arrived as a tensor. A matrix reads as built when the graph itself shows two
of its entries equal and the other two equal (up to sign): its four entries are then two tables, c and s. A
matrix of four unrelated entries (one that arrives as a tensor) has no description here.

The entries are read through the lanes of a matrix that the interpreter re-sourced under another leading
alignment (`LaneInterpreter.identified`), so a matrix given a heads dim reads as the cos and sin it holds.
"""

from __future__ import annotations

from . import lanes, poly


def _expand(interp: lanes.LaneInterpreter, atom: tuple, coef: float) -> dict:
    """coef * the atom's entry in the tables the graph computes it from: through an identified source
    (`LaneInterpreter.identified`) or a computed table (a `neg` node holding -sin), a few steps deep."""
    entry: dict = {(atom,): coef}
    for _ in range(_DEPTH):
        (mono, scale), = entry.items()
        if len(mono) != 1:
            break
        name, k, _, flat = mono[0]
        known = interp.identified.get(name)
        if known is None:
            known = interp.values.get(interp.nodes.get(name))
        if not isinstance(known, lanes.LaneValue) or known.k != k or flat >= len(known.entries) \
                or not known.entries[flat] or known.entries[flat] == {(mono[0],): 1.0}:
            break
        entry = poly.scale(known.entries[flat], scale)
        if len(entry) != 1:
            break
    return entry


_DEPTH = 4  # identified source -> cat -> neg -> sin is three steps


def _normal(p: dict) -> tuple[dict, float]:
    """(p with a positive leading coefficient, the sign taken out)."""
    sign = 1.0 if p[min(p)] > 0 else -1.0
    return poly.scale(p, sign), sign


def _sign_of(p: dict, unit: dict) -> float | None:
    if p == unit:
        return 1.0
    if p == poly.scale(unit, -1.0):
        return -1.0
    return None


def built_matrix(interp: lanes.LaneInterpreter, first: tuple, second: tuple) -> str | None:
    """The matrix `[[c, -s], [-s, c]]` (say) that a pair's two output lanes apply to (x_a, x_b), when its entries
    are two tables c and s up to sign, else None. `first` is the split of the lane that reads x_a times its
    "cos" factor and x_b times its "sin" factor, `second` that of its partner, which reads x_b times its cos
    factor: each ((cos atom, coef), (sin atom, coef)), as the matcher's `_split_lane` returns them."""
    (ca0, cc0), (sa0, sc0) = first
    (ca1, cc1), (sa1, sc1) = second
    m00, m01 = _expand(interp, ca0, cc0), _expand(interp, sa0, sc0)
    m10, m11 = _expand(interp, sa1, sc1), _expand(interp, ca1, cc1)
    if not (m00 and m10):
        return None
    c, c_sign = _normal(m00)
    s, s_sign = _normal(m10)
    if c == s:
        return None
    signs = (c_sign, _sign_of(m01, s), s_sign, _sign_of(m11, c))
    if None in signs:
        return None

    def show(sign, name):
        return name if sign > 0 else "-" + name
    return f"[[{show(signs[0], 'c')}, {show(signs[1], 's')}], [{show(signs[2], 's')}, {show(signs[3], 'c')}]]"
