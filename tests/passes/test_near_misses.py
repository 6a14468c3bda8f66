"""Issue 2: RoPE-looking arithmetic that must NOT fuse (tests/spellings/near_misses.py): no site, numbers
unchanged, and the near miss recorded in the report."""

from __future__ import annotations

import pytest

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import as_tuple, check_numerics, check_unchanged, rel_err, to_fp64
from tests.spellings import NEAR_MISSES
from tests.spellings.near_misses import MAY_FUSE_PARTS


@pytest.mark.parametrize("case", NEAR_MISSES + MAY_FUSE_PARTS, ids=lambda c: c.id)
def test_near_miss_is_not_a_rope(case):
    """The test data: each near miss computes something else than the nearest true RoPE."""
    if case.ref is None:
        pytest.skip("not a RoPE for a reason the numbers cannot show (tables depend on x, a lane undefined)")
    cmp = case.compare or (lambda t: t)
    args = to_fp64(case.make(case.dtypes[0]))
    for got, want in zip(as_tuple(case.fn(*args)), as_tuple(case.ref(*args))):
        assert rel_err(cmp(got), cmp(want)) > 1e-3


@pytest.mark.parametrize("case", NEAR_MISSES, ids=lambda c: c.id)
def test_near_miss_not_fused(case):
    args = case.make(case.dtypes[0])
    out, p = compile_with_pass(case.fn, *args)
    t = p.report.table()
    assert not p.report.errors, t
    assert len(p.report.sites) == 0 and len(p.report.kernels) == 0, f"fused a near miss:\n{t}"
    check_unchanged(case.fn, args, out, compare=case.compare, context=t)
    if case.expect_miss:
        assert p.report.misses, f"near miss not recorded:\n{t}"
        assert all(m.reason for m in p.report.misses), t


@pytest.mark.parametrize("case", MAY_FUSE_PARTS, ids=lambda c: c.id)
def test_rotations_inside_a_near_miss(case):
    """Only the true rotations inside may fuse (an intermediate, or pieces on slices of the lanes): the
    numerics contract catches a site that covers the whole output."""
    args = case.make(case.dtypes[0])
    out, p = compile_with_pass(case.fn, *args)
    t = p.report.table()
    assert not p.report.errors, t
    check_numerics(case.fn, args, out, context=t)
