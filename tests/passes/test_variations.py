"""Issue 2: variations of the catalogue spellings that must fuse too (tests/spellings/variations.py)."""

from __future__ import annotations

import pytest

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import as_tuple, check_numerics
from tests.helpers.spelling_runs import compile_params, run_fused, self_check
from tests.spellings import VARIATIONS
from tests.spellings.checks import check_report
from tests.spellings.variations import OPTIONAL

DYNAMIC_TOO = {"V_gqa_different_head_counts", "V_vllm_native_gathered_cache", "V_odd_lanes_written_first"}


@pytest.mark.parametrize("case", VARIATIONS + OPTIONAL, ids=lambda c: c.id)
def test_variation_matches_reference(case):
    self_check(case)


@pytest.mark.parametrize("case,dtype,dynamic", compile_params(VARIATIONS, lambda c: c.id in DYNAMIC_TOO))
def test_variation_fuses(case, dtype, dynamic):
    run_fused(case, dtype, dynamic)


@pytest.mark.parametrize("case", OPTIONAL, ids=lambda c: c.id)
def test_optional_rotation_fuses_correctly_or_not_at_all(case):
    """A rotation the lane algebra may not see through (torch.roll): left alone or fused right, never wrong."""
    args = case.make(case.dtypes[0])
    out, p = compile_with_pass(case.fn, *args)
    assert not p.report.errors, p.report.table()
    check_numerics(case.fn, args, out, context=p.report.table())
    if p.report.sites:
        check_report(p, case.expect, tuple({o.dtype for o in as_tuple(case.fn(*args))}))
