"""Issue 2: every "must" row of catalogue.md fuses, with the right report and the numerics contract.

Each row is a spelling in tests/spellings/catalogue.py. The self-check proves the spelling (the test data)
against rotary_reference in eager; the compiled tests run on the CPU, static and dynamic=True (with the head dim
static, as a model's config makes it: a symbolic one leaves the site, tests/passes/test_no_guards.py)."""

from __future__ import annotations

import pytest

from tests.helpers.spelling_runs import SHORT, compile_params, run_fused, self_check
from tests.spellings import CATALOGUE

MUST_ROWS = [f"I{i}" for i in range(1, 9)] + [f"N{i}" for i in range(1, 9)] + ["C1", "C2", "C3"] + \
    [f"M{i}" for i in range(1, 12)] + ["M12"]


def test_every_must_row_has_a_spelling():
    ids = {c.id.split("_")[0] for c in CATALOGUE}
    assert set(MUST_ROWS) <= ids, sorted(set(MUST_ROWS) - ids)


def test_all_four_dtypes_covered():
    assert {dt for c in CATALOGUE for dt in c.dtypes} == set(SHORT)


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.id)
def test_spelling_matches_reference(case):
    self_check(case)


@pytest.mark.parametrize("case,dtype,dynamic", compile_params(CATALOGUE))
def test_catalogue_fuses(case, dtype, dynamic):
    run_fused(case, dtype, dynamic)
