"""The Ascend NPU bridge (rope_fusion/kernels/npu.py), on the CPU, with stand-in torch_npu ops.

torch_npu needs the CANN runtime, so the bridge calls the stand-ins of tests/helpers/npu_standins.py (the
schemas of torch_npu's ops and their documented semantics and constraints); each logs its arguments, so the tests
check what the bridge passes (layouts, table widths, modes, copies) as well as its results against
rotary_reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rope_fusion  # noqa: F401
from rope_fusion.kernels import npu as bridge
from rope_fusion.ops import backends as B
from rope_fusion.ops.reference import rotary_reference
from rope_fusion.ops.schema import RotaryParams
from tests.helpers.npu_standins import CALLS, NS


@pytest.fixture(autouse=True)
def stand_in_namespace(monkeypatch):
    monkeypatch.setattr(bridge, "OP_NAMESPACE", NS)
    CALLS.clear()
    bridge.stats.clear()
    yield


def _kw(interleaved=False, rotary_dim=None, full_tables=False, conjugate=False, out_dtype=None, x=None):
    return dict(interleaved=interleaved, rotary_dim=rotary_dim if rotary_dim is not None else x.shape[-1],
                full_tables=full_tables, conjugate=conjugate, out_dtype=out_dtype or x.dtype)


def _tables(shape, dtype=torch.float32):
    ang = torch.rand(shape, dtype=torch.float64) * 6.0
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _check(out, x, cos, sin, kw, tol=None):
    ref = rotary_reference(x, cos, sin, **kw)
    assert out.shape == x.shape and out.dtype == kw["out_dtype"]
    tol = tol or (1e-5 if kw["out_dtype"] == torch.float32 else 2e-2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


# -- npu_rotary_mul path -----------------------------------------------------------------------------------

CASES = [
    # (x shape, table shape without the width, interleaved, rotary_dim, full_tables, conjugate, x dtype, tables)
    ((2, 8, 4, 64), (1, 8, 1), False, 64, False, False, torch.float32, torch.float32),  # BSND, half tables
    ((2, 8, 4, 64), (1, 8, 1), True, 64, False, False, torch.float32, torch.float32),  # interleaved
    ((2, 4, 8, 64), (1, 1, 8), False, 64, True, False, torch.float32, torch.float32),  # BNSD, full tables
    ((6, 4, 80), (6, 1), False, 40, False, False, torch.float32, torch.float32),  # vLLM [T,H,D], partial
    ((6, 4, 80), (6, 1), True, 32, False, True, torch.float32, torch.float32),  # GPT-J partial, conjugate
    ((2, 8, 4, 64), (1, 8, 1), False, 64, False, False, torch.bfloat16, torch.float32),  # bf16 x, fp32 tables
    ((2, 8, 4, 128), (2, 8, 1), False, 128, True, True, torch.bfloat16, torch.bfloat16),  # per-batch tables
]


@pytest.mark.parametrize("x_shape,t_shape,interleaved,rdim,full,conj,xdt,tdt", CASES)
def test_rotary_mul_matches_reference(x_shape, t_shape, interleaved, rdim, full, conj, xdt, tdt):
    torch.manual_seed(0)
    x = torch.randn(x_shape).to(xdt)
    width = rdim if full else rdim // 2
    cos, sin = _tables((*t_shape, width), tdt)
    kw = _kw(interleaved, rdim, full, conj, x=x)
    out = torch.ops.rope_fusion.rotary_npu(x, cos, sin, **kw)
    _check(out, x, cos, sin, kw)
    assert bridge.stats == {"rotary_mul": 1}
    (name, xs, ts, mode, dt), = CALLS
    assert name == "rotary_mul" and mode == ("interleave" if interleaved else "half")
    assert len(xs) == 4 and xs[-1] == rdim and ts[-1] == rdim  # the head slice, full-width tables
    assert xs[:-1] == ((1,) * (4 - len(x_shape)) + tuple(x_shape))[:-1]
    assert ts[:-1] == ((1,) * (4 - len(t_shape) - 1) + tuple(t_shape))  # padded with views, not expanded
    assert dt == torch.promote_types(xdt, tdt)


def test_full_width_tables():
    c = torch.arange(1.0, 4.0).expand(2, 3)
    assert bridge.full_width(c, 6, False, False).tolist() == [[1, 2, 3, 1, 2, 3]] * 2
    assert bridge.full_width(c, 6, True, False).tolist() == [[1, 1, 2, 2, 3, 3]] * 2
    full = torch.randn(2, 6)
    assert bridge.full_width(full, 6, True, True) is full


def test_undocumented_cases_run_the_reference():
    torch.manual_seed(0)
    # 5-D x: npu_rotary_mul takes 4-D only
    x = torch.randn(2, 3, 4, 2, 16)
    cos, sin = _tables((1, 3, 1, 1, 8))
    kw = _kw(x=x)
    _check(torch.ops.rope_fusion.rotary_npu(x, cos, sin, **kw), x, cos, sin, kw)
    # interleave with per-batch tables (BS1D): documented for 'half' only
    x = torch.randn(2, 8, 4, 16)
    cos, sin = _tables((2, 8, 1, 8))
    kw = _kw(interleaved=True, x=x)
    _check(torch.ops.rope_fusion.rotary_npu(x, cos, sin, **kw), x, cos, sin, kw)
    # fp64
    x = torch.randn(2, 8, 4, 16, dtype=torch.float64)
    cos, sin = _tables((8, 1, 8), torch.float64)
    kw = _kw(x=x)
    _check(torch.ops.rope_fusion.rotary_npu(x, cos, sin, **kw), x, cos, sin, kw)
    assert bridge.stats == {"reference": 3} and not CALLS


def test_layout_rules():
    L = bridge.rotary_mul_layout
    assert L((2, 8, 4, 64), (1, 8, 1, 64), False) == "BSND"
    assert L((2, 4, 8, 64), (1, 1, 8, 64), False) == "BNSD"
    assert L((8, 2, 4, 64), (8, 1, 1, 64), False) == "SBND"  # S11D
    assert L((2, 8, 4, 64), (2, 8, 1, 64), False) == "BSND"  # BS1D
    assert L((2, 8, 4, 64), (2, 1, 1, 64), False) == "SBND"  # read as S11D
    assert L((2, 8, 4, 64), (1, 8, 4, 64), False) is None  # 1SND / 1NSD are not listed
    assert L((2, 8, 4, 64), (2, 8, 1, 64), True) is None  # interleave: tables carry S only
    assert L((2, 8, 4, 900), (1, 8, 1, 900), False) is None  # D < 896
    assert L((1, 8, 1000, 64), (1, 8, 1, 64), False) is None  # N < 1000
    assert L((1, 8, 40, 64), (1, 8, 1, 64), True) == "BSND"
    assert L((30, 8, 40, 64), (1, 8, 1, 64), True) is None  # B * N < 1000 for 'interleave'


# -- npu_apply_rotary_pos_emb path --------------------------------------------------------------------------

@pytest.mark.parametrize("layout,q_shape,k_shape,t_shape,d,dtype,full", [
    ("BSND", (2, 8, 4, 64), (2, 8, 2, 64), (1, 8, 1), 64, torch.bfloat16, True),
    ("BSND", (1, 5, 4, 128), (1, 5, 4, 128), (5, 1), 128, torch.float32, False),
    ("TND", (6, 4, 128), (6, 1, 128), (6, 1), 128, torch.float16, False),
])
def test_apply_rotary_pos_emb_where_documented(layout, q_shape, k_shape, t_shape, d, dtype, full):
    torch.manual_seed(0)
    q, k = torch.randn(q_shape).to(dtype), torch.randn(k_shape).to(dtype)
    q0, k0 = q.clone(), k.clone()
    cos, sin = _tables((*t_shape, d if full else d // 2), dtype)
    for conj in (False, True):
        CALLS.clear()
        kw = _kw(full_tables=full, conjugate=conj, x=q)
        qo, ko = torch.ops.rope_fusion.rotary_qk_npu(q, k, cos, sin, **kw)
        assert torch.equal(q, q0) and torch.equal(k, k0), "the in-place NPU op must get copies"
        _check(qo, q, cos, sin, kw)
        _check(ko, k, cos, sin, kw)
        (name, qs, ks, cs, lay, dt), = CALLS
        assert name == "apply" and lay == layout and qs == q_shape and ks == k_shape and dt == dtype
        assert cs[-1] == d and cs[-2] == 1
    assert bridge.stats == {"apply_rotary_pos_emb": 2}


@pytest.mark.parametrize("why,q_shape,t_shape,d,rdim,interleaved,qdt,tdt,grad", [
    ("interleaved", (2, 8, 4, 64), (8, 1), 64, 64, True, torch.float32, torch.float32, False),
    ("partial", (2, 8, 4, 128), (8, 1), 128, 64, False, torch.float32, torch.float32, False),
    ("head dim 80", (2, 8, 4, 80), (8, 1), 80, 80, False, torch.float32, torch.float32, False),
    ("dtypes differ", (2, 8, 4, 64), (8, 1), 64, 64, False, torch.bfloat16, torch.float32, False),
    ("BNSD", (2, 4, 8, 64), (1, 8), 64, 64, False, torch.float32, torch.float32, False),
])
def test_two_rotary_mul_calls_otherwise(why, q_shape, t_shape, d, rdim, interleaved, qdt, tdt, grad):
    torch.manual_seed(0)
    q = torch.randn(q_shape).to(qdt).requires_grad_(grad)
    k = torch.randn(q_shape).to(qdt)
    cos, sin = _tables((*t_shape, rdim // 2), tdt)
    kw = _kw(interleaved, rdim, x=q)
    qo, ko = torch.ops.rope_fusion.rotary_qk_npu(q, k, cos, sin, **kw)
    _check(qo, q.detach(), cos, sin, kw)
    _check(ko, k, cos, sin, kw)
    assert [c[0] for c in CALLS] == ["rotary_mul", "rotary_mul"], why
    assert bridge.stats == {"rotary_mul": 2}


# -- the backend and the pass ------------------------------------------------------------------------------

def _spec(device="npu", dtype=torch.bfloat16, shape=(2, 8, 4, 64)):
    params = RotaryParams(interleaved=False, rotary_dim=64, full_tables=False, conjugate=False, out_dtype=dtype)
    return B.SiteSpec(device_type=device, x_shapes=(shape, shape), x_dtype=dtype, table_dtype=dtype,
                      params=params)


def test_backend_registration_and_schemas():
    be = B.get_backend("npu")
    assert be is not None
    for mine, ref in ((bridge.ROTARY_NPU, torch.ops.rope_fusion.rotary.default),
                      (bridge.ROTARY_QK_NPU, torch.ops.rope_fusion.rotary_qk.default)):
        a, b = mine._schema, ref._schema
        assert [(x.name, str(x.type), x.kwarg_only) for x in a.arguments] == \
            [(x.name, str(x.type), x.kwarg_only) for x in b.arguments]
        assert [str(r.type) for r in a.returns] == [str(r.type) for r in b.returns]
    assert be.supports(_spec()) is None
    assert be.supports(_spec(device="cpu")) and be.supports(_spec(device="cuda"))
    assert "dtypes" in be.supports(_spec(dtype=torch.float64))
    assert "4 dims" in be.supports(_spec(shape=(2, 3, 8, 4, 64)))
    assert B.choose_backend("auto", _spec())[0].name == "npu"
    assert B.choose_backend("auto", _spec(dtype=torch.float64))[0].name == "inductor"


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def _neox_qk(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def test_pass_emits_the_npu_ops_in_a_compiled_graph(monkeypatch):
    """With the NPU backend made to accept CPU sites, the compiled graph calls the bridge."""
    from tests.helpers.compile_pass import compile_with_pass

    be = B.get_backend("npu")
    monkeypatch.setitem(B._BACKENDS, "npu", dataclasses.replace(be, supports=lambda spec: None))
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 4, 64), torch.randn(2, 8, 2, 64)  # BSND, GQA
    cos, sin = _tables((8, 1, 64))
    (qo, ko), p = compile_with_pass(_neox_qk, q, k, cos, sin, backend="npu")
    assert [(kk.op, kk.backend) for kk in p.report.kernels] == [("rope_fusion.rotary_qk", "npu")], p.report.table()
    assert [c[0] for c in CALLS] == ["apply"], CALLS
    eq, ek = _neox_qk(q, k, cos, sin)
    torch.testing.assert_close(qo, eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, ek, rtol=1e-5, atol=1e-5)
