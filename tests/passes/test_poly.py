"""Unit tests of rope_fusion/passes/analysis/poly.py: the polynomials that are the entries of the lane algebra."""

from __future__ import annotations

from rope_fusion.passes.analysis import poly

X0, X1 = ("x", 1, False, 0), ("x", 1, False, 1)
C0, S0 = ("cos", 1, False, 0), ("sin", 1, False, 0)
Z3 = ("z", 2, True, 3)


def test_const():
    assert poly.const(2) == {(): 2.0}
    assert isinstance(poly.const(2)[()], float)
    assert poly.const(0) == {}
    assert poly.const(0.0) == {}


def test_atom():
    assert poly.atom(X0) == {(X0,): 1.0}


def test_add():
    x0, x1 = poly.atom(X0), poly.atom(X1)
    assert poly.add(x0, x1) == {(X0,): 1.0, (X1,): 1.0}
    assert poly.add(x0, poly.const(3)) == {(X0,): 1.0, (): 3.0}


def test_add_with_alpha():
    x0, x1 = poly.atom(X0), poly.atom(X1)
    assert poly.add(x0, x1, 2.0) == {(X0,): 1.0, (X1,): 2.0}
    assert poly.add(x0, x1, -1.0) == {(X0,): 1.0, (X1,): -1.0}
    assert poly.add(x0, x0, 0.5) == {(X0,): 1.5}


def test_add_drops_cancelled_terms_and_leaves_operands_alone():
    x0 = poly.atom(X0)
    both = poly.add(x0, poly.atom(X1))
    assert poly.add(both, x0, -1.0) == {(X1,): 1.0}
    assert poly.add(x0, x0, -1.0) == {}
    assert both == {(X0,): 1.0, (X1,): 1.0}
    assert x0 == {(X0,): 1.0}


def test_scale():
    p = poly.add(poly.atom(X0), poly.const(2))
    assert poly.scale(p, -1.0) == {(X0,): -1.0, (): -2.0}
    assert poly.scale(p, 0.5) == {(X0,): 0.5, (): 1.0}
    assert poly.scale(p, 0.0) == {}


def test_mul_of_atoms_sorts_the_monomial():
    x0, c0 = poly.atom(X0), poly.atom(C0)
    assert poly.mul(x0, c0) == {(C0, X0): 1.0}
    assert poly.mul(c0, x0) == {(C0, X0): 1.0}
    assert poly.mul(x0, x0) == {(X0, X0): 1.0}


def test_mul_by_constants_and_of_sums():
    x0, x1, c0, s0 = (poly.atom(a) for a in (X0, X1, C0, S0))
    assert poly.mul(x0, poly.const(3)) == {(X0,): 3.0}
    assert poly.mul(poly.const(3), x0) == {(X0,): 3.0}
    assert poly.mul(x0, {}) == {}
    # (x0 + x1) * (cos0 - sin0)
    got = poly.mul(poly.add(x0, x1), poly.add(c0, s0, -1.0))
    assert got == {(C0, X0): 1.0, (S0, X0): -1.0, (C0, X1): 1.0, (S0, X1): -1.0}
    # higher degree: (x0*cos0) * sin0, sorted
    assert poly.mul(poly.mul(x0, c0), s0) == {(C0, S0, X0): 1.0}


def test_mul_cancels_terms():
    x0, x1 = poly.atom(X0), poly.atom(X1)
    # (x0 + x1) * (x0 - x1) = x0^2 - x1^2
    got = poly.mul(poly.add(x0, x1), poly.add(x0, x1, -1.0))
    assert got == {(X0, X0): 1.0, (X1, X1): -1.0}


def test_mul_degree_cap():
    cube = {(X0, X0, X0): 1.0}
    assert poly.mul(cube, cube) == {(X0,) * 6: 1.0}  # degree 6 = MAX_DEGREE: still a polynomial
    assert poly.MAX_DEGREE == 6
    assert poly.mul(cube, {(X0, X0, X0, X0): 1.0}) is None  # degree 7


def test_mul_term_cap():
    four = [("a", 1, False, i) for i in range(4)]
    five = [("b", 1, False, i) for i in range(5)]
    sum4 = {(a,): 1.0 for a in four}
    sum5 = {(b,): 1.0 for b in five}
    assert poly.MAX_TERMS == 16
    assert len(poly.mul(sum4, sum4)) == 10  # 4 squares + 6 cross terms
    assert len(poly.mul(sum4, {(b,): 1.0 for b in five[:4]})) == 16  # exactly MAX_TERMS
    assert poly.mul(sum4, sum5) is None  # 20 terms


def test_remap():
    p = {(C0, X0): 2.0, (X1,): 1.0, (): 0.5}
    renamed = poly.remap(p, lambda a: (a[0], a[1] + 1, a[2], a[3] + 4))
    assert renamed == {(("cos", 2, False, 4), ("x", 2, False, 4)): 2.0, (("x", 2, False, 5),): 1.0, (): 0.5}


def test_remap_sorts_and_merges():
    # renaming x -> a reorders the monomial; two monomials that become equal merge
    p = {(C0, X0): 1.0, (C0, X1): 2.0}
    renamed = poly.remap(p, lambda a: ("a", 1, False, 0) if a[0] == "x" else a)
    assert renamed == {(("a", 1, False, 0), C0): 3.0}


def test_cofactor():
    # p = 2*cos0*x0 - sin0*x1 + 3*x0
    p = {(C0, X0): 2.0, (S0, X1): -1.0, (X0,): 3.0}
    assert poly.cofactor(p, X0) == {(C0,): 2.0, (): 3.0}
    assert poly.cofactor(p, C0) == {(X0,): 2.0}
    assert poly.cofactor(p, S0) == {(X1,): -1.0}
    assert poly.cofactor(p, Z3) == {}


def test_atoms_of():
    assert poly.atoms_of({(C0, X0): 2.0, (X1,): 1.0, (): 1.0}) == {C0, X0, X1}
    assert poly.atoms_of({}) == set()
    assert poly.atoms_of(poly.const(1)) == set()


def test_ratio():
    q = {(C0, X0): 1.0, (X1,): -2.0}
    assert poly.ratio({(C0, X0): 3.0, (X1,): -6.0}, q) == 3.0
    assert poly.ratio(q, q) == 1.0
    assert poly.ratio({(C0, X0): -0.5, (X1,): 1.0}, q) == -0.5


def test_ratio_none_cases():
    q = {(C0, X0): 1.0, (X1,): -2.0}
    assert poly.ratio({(C0, X0): 3.0, (X1,): 6.0}, q) is None  # not proportional
    assert poly.ratio({(C0, X0): 3.0}, q) is None  # a term missing
    assert poly.ratio({(C0, X0): 3.0, (X0,): -6.0}, q) is None  # a different monomial
    assert poly.ratio({(C0, X0): 1.0, (X1,): -2.0, (): 1.0}, q) is None  # an extra term
    assert poly.ratio(q, {}) is None  # zero denominator
    assert poly.ratio({}, {}) is None


def test_ratio_near_equal():
    q = {(C0, X0): 1.0, (X1,): 1.0}
    # ratios equal to a relative 1e-12: accepted, the first ratio is the answer
    assert poly.ratio({(C0, X0): 2.0, (X1,): 2.0 * (1 + 1e-13)}, q) == 2.0
    # a relative difference of 1e-9: rejected
    assert poly.ratio({(C0, X0): 2.0, (X1,): 2.0 * (1 + 1e-9)}, q) is None
    # small ratios compare absolutely (to 1e-12)
    assert poly.ratio({(C0, X0): 1e-6, (X1,): 1e-6 + 1e-13}, q) == 1e-6
    assert poly.ratio({(C0, X0): 1e-6, (X1,): 1e-6 + 1e-11}, q) is None


def test_signature_drops_grid_ranks():
    promoted = {(("x", 2, False, 1), ("cos", 2, False, 0)): 2.0}
    plain = {(("x", 1, False, 1), ("cos", 1, False, 0)): 2.0}
    assert poly.signature(promoted) == poly.signature(plain)
    assert poly.signature(plain) == frozenset({((("x", False, 1), ("cos", False, 0)), 2.0)})
    assert poly.signature(poly.const(1)) == frozenset({((), 1.0)})
    # the lane, the complex flag and the coefficient still count
    assert poly.signature({(X0,): 1.0}) != poly.signature({(X1,): 1.0})
    assert poly.signature({(("x", 1, True, 0),): 1.0}) != poly.signature({(X0,): 1.0})
    assert poly.signature({(X0,): 1.0}) != poly.signature({(X0,): 2.0})
    # hashable: used as a dict key by the matcher
    assert {poly.signature(plain): 1}[poly.signature(promoted)] == 1


def test_mul_of_single_terms_on_random_monomials():
    """A product of two one-term polynomials (the common case, which mul takes without its accumulation loop):
    the two monomials' atoms joined and sorted, the coefficients multiplied, None past MAX_DEGREE."""
    import random

    rng = random.Random(5)
    pool = [("x", 1, False, i) for i in range(4)] + [("t", 2, False, i) for i in range(3)]
    for _ in range(3000):
        ml = tuple(sorted(rng.choice(pool) for _ in range(rng.randint(0, 4))))
        mr = tuple(sorted(rng.choice(pool) for _ in range(rng.randint(0, 4))))
        cl, cr = rng.choice([1.0, -2.0, 0.5]), rng.choice([1.0, -1.0, 3.0])
        want = {tuple(sorted(ml + mr)): cl * cr} if len(ml) + len(mr) <= poly.MAX_DEGREE else None
        assert poly.mul({ml: cl}, {mr: cr}) == want, (ml, mr)
