"""The op computes in the dtype the graph computes in (docs/design.md section 2).

The op's own rule is fp32 math, fp64 when an input is fp64 and the output holds it. The pass feeds it so that
this rule gives the graph's dtype (passes/analysis/grouping.py `arithmetic_dtype`, passes/emission.py `plan_group`):
fp64 data that the graph computes on in fp32 reaches the op as the fp32 cast the graph makes, so the result is
eager's to the bit; fp64 angles whose cos and sin the graph casts to fp16 or bf16 reach an fp32 op as the
tables, never as angles that the op would round to fp32 first (at positions near 1e7 that was 35x eager's
error); a graph that computes in fp64 still gets fp64 math.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import as_tuple, check_numerics, fp64_eval, rel_err


def rot_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def fp32_math_on_fp64_data(x, c, s):
    """issue 27: fp64 inputs, the rotation in fp32, the result cast back."""
    xf = x.float()
    return (xf * c.float() + rot_half(xf) * s.float()).double()


def fp32_math_on_fp64_tables(x, c, s):
    """fp32 x, fp64 tables cast to fp32 by the graph."""
    return x * c.float() + rot_half(x) * s.float()


def fp64_math_on_fp32_data(x, c, s):
    """The converse: fp32 inputs, the rotation in fp64, the result cast back: the op computes in fp64."""
    xd = x.double()
    return (xd * c.double() + rot_half(xd) * s.double()).float()


def _bit_exact(fn, args, out):
    for a, b in zip(as_tuple(out), as_tuple(fn(*args))):
        assert a.dtype == b.dtype and torch.equal(a, b), f"max difference {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("fn,dtype", [(fp32_math_on_fp64_data, torch.float64),
                                      (fp32_math_on_fp64_tables, torch.float32),
                                      (fp64_math_on_fp32_data, torch.float32)],
                         ids=["fp64-data-fp32-math", "fp64-tables-fp32-math", "fp32-data-fp64-math"])
def test_the_op_computes_in_the_graphs_dtype(fn, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 4, 32, dtype=dtype).transpose(1, 2)
    c, s = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    if fn is fp64_math_on_fp32_data:
        c, s = c.float(), s.float()
    out, p = compile_with_pass(fn, x, c, s)
    rep = p.report
    assert len(rep.sites) == 1 and not rep.errors, rep.table()
    _bit_exact(fn, (x, c, s), out)  # plain compile matches eager exactly here, and so must the pass
    check_numerics(fn, (x, c, s), out)


def tables_from_fp64_angles(dtype):
    def fn(x, pos, inv_freq):
        ang = pos.double()[:, None] * inv_freq.double()[None, :]
        emb = torch.cat((ang, ang), -1)
        return x * emb.cos().to(dtype) + rot_half(x) * emb.sin().to(dtype)
    return fn


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_fp64_angles_are_not_rounded_to_fp32(dtype):
    """issue 27: fp64 angles at positions near 1e7, tables cast to x's dtype. The op computes in fp32 (the
    output is not fp64), so it reads the tables, and the error is eager's plus one rounding."""
    torch.manual_seed(0)
    fn = tables_from_fp64_angles(dtype)
    x = torch.randn(1, 2, 16, 16).to(dtype)
    pos = torch.arange(16) + 10_000_000
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    out, p = compile_with_pass(fn, x, pos, inv_freq)
    rep = p.report
    assert len(rep.sites) == 1 and not rep.errors, rep.table()
    assert not rep.sites[0].angle_tables, rep.table()
    check_numerics(fn, (x, pos, inv_freq), out)
    if dtype is torch.float32:  # the graph's fp32 math on its fp32 casts of the tables
        _bit_exact(fn, (x, pos, inv_freq), out)


def test_fp64_angles_in_an_fp64_graph_stay_angles():
    """The near miss of the case above: everything fp64, so the op computes cos and sin in fp64 itself."""
    torch.manual_seed(0)
    fn = tables_from_fp64_angles(torch.float64)
    x = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    pos = torch.arange(16) + 10_000_000
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).double() / 16))
    out, p = compile_with_pass(fn, x, pos, inv_freq)
    rep = p.report
    assert len(rep.sites) == 1 and rep.sites[0].angle_tables and not rep.errors, rep.table()
    (ref,) = fp64_eval(fn, x, pos, inv_freq)
    assert rel_err(out, ref) <= 4 * torch.finfo(torch.float64).eps


def test_q_and_k_that_compute_in_different_dtypes_are_separate_launches():
    """fp64 q rotated in fp32 and fp64 k rotated in fp64 over the same tables, both results fp64: one launch
    would compute both in one dtype."""
    def fn(q, k, c, s):
        qf = q.float()
        return (qf * c.float() + rot_half(qf) * s.float()).double(), k * c + rot_half(k) * s

    torch.manual_seed(0)
    args = tuple(torch.randn(*shape, dtype=torch.float64) for shape in ((1, 8, 2, 16), (1, 8, 2, 16), (8, 1, 16),
                                                                        (8, 1, 16)))
    out, p = compile_with_pass(fn, *args)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 2 and not rep.errors, rep.table()
    _bit_exact(fn, args, out)
    check_numerics(fn, args, out)


def norm_in_fp64_rotation_in_fp32(x, w, c, s):
    xn = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w).float()
    return xn * c + rot_half(xn) * s


def norm_and_rotation_in_fp32_on_fp64_data(x, w, c, s):
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    return (xn * c + rot_half(xn) * s).double()


def norm_and_rotation_in_fp64(x, w, c, s):
    """Both functions above without their casts, on fp64 inputs: the reference (tests/helpers/numerics.fp64_eval would
    keep their `.float()`, and with it an fp32 norm)."""
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return xn * c + rot_half(xn) * s


@pytest.mark.parametrize("fn", [norm_in_fp64_rotation_in_fp32, norm_and_rotation_in_fp32_on_fp64_data])
def test_a_folded_norm_on_fp64_data_keeps_fp64_math(fn):
    """Under a folded norm the op cannot round as the graph's fp32 norm does (plain compile does not either), so
    fp64 data keeps the op's fp64 math: never less accurate than eager, which an fp64 result requires."""
    torch.manual_seed(0)
    args = (torch.randn(2, 16, 4, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64),
            torch.randn(16, 1, 64), torch.randn(16, 1, 64))
    out, p = compile_with_pass(fn, *args)
    rep = p.report
    assert len(rep.sites) == 1 and rep.sites[0].norm == "rms folded" and not rep.errors, rep.table()
    ref = norm_and_rotation_in_fp64(*(a.double() for a in args))
    eager = fn(*args)
    assert out.dtype == eager.dtype
    assert rel_err(out, ref) <= rel_err(eager, ref) + torch.finfo(out.dtype).eps
