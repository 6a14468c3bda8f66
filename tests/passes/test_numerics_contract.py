"""The numerics contract (docs/design.md section 2) and the helper that checks it
(tests/helpers/numerics.check_numerics): fused error vs an fp64 evaluation of the original function <= the original's
own error + eps(out dtype)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import as_tuple, check_numerics, contract_errors, fp64_eval, to_fp64
from tests.spellings import ALL, CATALOGUE
from tests.spellings.case import distinct_tables
from tests.spellings.checks import check_report


def test_fp64_eval_computes_in_fp64():
    case = ALL["I1_wan"]
    args = case.make(torch.bfloat16)
    outs = fp64_eval(case.fn, *args)
    assert all(o.dtype == torch.float64 for o in outs)
    for o, r in zip(outs, as_tuple(case.ref(*to_fp64(args)))):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)


def test_inputs_are_fresh_random():
    case = ALL["N1_llama"]
    a, b = case.make(torch.float32), case.make(torch.float32)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[2], b[2])
    assert all(t.abs().sum() > 0 for t in a)


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.id)
def test_once_rounded_reference_meets_the_contract(case):
    """The contract is achievable: rotary_reference (fp32 math, one rounding) meets it for every row and
    dtype, on a few random draws. So a failing fused result is the pass's fault, not the slack's."""
    for dt in case.dtypes:
        for _ in range(3):
            args = case.make(dt)
            check_numerics(case.fn, args, case.ref(*args))


def test_contract_rejects_a_wrong_rotation():
    case = ALL["N1_llama"]
    args = case.make(torch.bfloat16)
    q, k = case.fn(*args)
    wrong = (q.clone(), k)
    wrong[0][..., 0] = -wrong[0][..., 0]
    with pytest.raises(AssertionError):
        check_numerics(case.fn, args, wrong)
    with pytest.raises(AssertionError):  # a sine of the wrong sign (the conjugate) is caught as well
        c = ALL["N1_llama"]
        x, kk, cos, sin = args
        check_numerics(c.fn, args, c.fn(x, kk, cos, -sin))


def test_contract_is_tight_for_low_precision_spellings():
    """bf16-math spellings round several times: their own error is far above one rounding of fp32 math."""
    case = ALL["N1_llama"]
    args = case.make(torch.bfloat16)
    for ef, eo, eps in contract_errors(case.fn, args, case.ref(*args)):
        assert ef <= eo + eps and eo > 0


DISTINCT = ["I4_flux_bshd", "I7_mammoth_per_lane", "N1_llama", "M3_nanochat_conjugate"]


@pytest.mark.parametrize("name", DISTINCT)
def test_fused_with_lane_distinct_tables(name):
    """Full tables whose paired lanes differ: a fusion that reads the wrong lane of a table (or assumes that
    a full table is duplicated) breaks the numbers here, though not with real duplicated tables."""
    case = ALL[name]
    dt = case.dtypes[0]
    with distinct_tables():
        args = case.make(dt)
    out, p = compile_with_pass(case.fn, *args)
    assert not p.report.errors, p.report.table()
    check_numerics(case.fn, args, out, context=p.report.table())
    check_report(p, case.expect, tuple({o.dtype for o in as_tuple(case.fn(*args))}))
