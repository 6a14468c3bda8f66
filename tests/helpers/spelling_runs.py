"""How a spelling of tests/spellings is run: its eager self-check against rotary_reference, its compile
parameters (dtypes, static and dynamic), and its compiled run with the pass, checked against its Expect, the
numerics contract and an independent reading of the graph. The catalogue and its variations share them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.compile_pass import compile_with_pass, static_lanes
from tests.helpers.numerics import as_tuple, check_numerics, rel_err, to_fp64
from tests.spellings.case import distinct_tables
from tests.spellings.checks import check_graph, check_report

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
