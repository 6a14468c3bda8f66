"""The op as users call it: `rope_fusion.apply_rotary` / `apply_rotary_qk`, bad inputs, autograd.

Bad inputs fail loudly with a ValueError that names the argument (eagerly and under torch.compile), and the
op is differentiable: the gradient of a rotation is the inverse rotation (with the partner lane's sin entry
when tables hold one entry per lane), and tables that require grad get theirs. Gradients are checked with
torch.autograd.gradcheck in fp64 against finite differences, and against autograd through the reference.
"""

from __future__ import annotations

import logging

import pytest
import torch

import rope_fusion
from rope_fusion.ops.reference import rotary_reference


def _tables(lead, width, dtype=torch.float64, requires_grad=False):
    a = torch.rand(*lead, width, dtype=torch.float64) * 6
    c, s = a.cos().to(dtype), a.sin().to(dtype)
    return c.requires_grad_(requires_grad), s.requires_grad_(requires_grad)


def test_tables_on_another_device_raise_naming_the_devices():
    x = torch.randn(2, 5, 3, 8)
    c = torch.randn(5, 1, 4).to("meta")
    with pytest.raises(ValueError, match="x on cpu, cos on meta, sin on meta"):
        rope_fusion.apply_rotary(x, c, c)
    with pytest.raises(ValueError, match="meta"):
        torch.compile(lambda x, c: rope_fusion.apply_rotary(x, c, c))(x, c)


def test_zero_dim_x_raises():
    with pytest.raises(ValueError, match="at least one dimension"):
        rope_fusion.apply_rotary(torch.tensor(1.0), torch.ones(1), torch.ones(1))


@pytest.mark.parametrize("bad,match", [
    (dict(rotary_dim=3), "rotary_dim"), (dict(rotary_dim=16), "exceeds the head dim"),
    (dict(full_tables=True), "last dim 8"),
])
def test_bad_options_raise(bad, match):
    x = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(ValueError, match=match):
        rope_fusion.apply_rotary(x, c, s, **bad)


def test_unknown_option_is_a_type_error():
    q = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(TypeError, match="interleave"):
        rope_fusion.apply_rotary_qk(q, q, c, s, interleave=True)


def test_qk_of_different_dtypes_needs_out_dtype():
    q, k = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16), torch.randn(2, 5, 1, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        rope_fusion.apply_rotary_qk(q, k, c, s)
    qo, ko = rope_fusion.apply_rotary_qk(q, k, c, s, out_dtype=torch.float32)
    assert qo.dtype == ko.dtype == torch.float32
    torch.testing.assert_close(ko, rotary_reference(k, c, s, interleaved=False, rotary_dim=8, full_tables=False))


CASES = [  # interleaved, rotary_dim, full_tables, conjugate
    (False, 8, False, False), (True, 8, False, False), (False, 8, True, False), (True, 8, True, True),
    (False, 4, True, False), (True, 6, False, True),
]


@pytest.mark.parametrize("interleaved,rotary_dim,full,conj", CASES)
def test_gradient_of_x_is_the_inverse_rotation(interleaved, rotary_dim, full, conj):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    c, s = _tables((5, 1), rotary_dim if full else rotary_dim // 2)
    if full:  # one entry per lane, every lane its own angle: the partner's sin entry matters
        c, s = _tables((5, 1), rotary_dim)
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full, conjugate=conj)
    assert torch.autograd.gradcheck(lambda x: rope_fusion.apply_rotary(x, c, s, **kw), (x,))


@pytest.mark.parametrize("interleaved,rotary_dim,full,conj", CASES)
def test_tables_that_require_grad_get_theirs(interleaved, rotary_dim, full, conj):
    torch.manual_seed(1)
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 8, dtype=torch.float64, requires_grad=True)
    c, s = _tables((5, 1), rotary_dim if full else rotary_dim // 2, requires_grad=True)
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full, conjugate=conj)
    assert torch.autograd.gradcheck(lambda q, k, c, s: rope_fusion.apply_rotary_qk(q, k, c, s, **kw), (q, k, c, s))


def test_low_precision_gradients_match_the_reference():
    torch.manual_seed(2)
    x = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    c, s = _tables((16, 1), 32, torch.float32, requires_grad=True)
    g = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16)
    kw = dict(interleaved=True, rotary_dim=64, full_tables=False)
    grads = torch.autograd.grad(rope_fusion.apply_rotary(x, c, s, **kw), (x, c, s), g)
    x64, c64, s64 = (t.detach().double().requires_grad_() for t in (x, c, s))
    ref = torch.autograd.grad(rotary_reference(x64, c64, s64, **kw), (x64, c64, s64), g.double())
    for got, want in zip(grads, ref):
        assert got.dtype == (torch.bfloat16 if got.shape == x.shape else torch.float32)
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-2, err


def test_x_is_not_saved_for_backward_when_tables_need_no_grad():
    """Activation memory: the backward of x needs only the tables."""
    x = torch.randn(2, 5, 3, 8, requires_grad=True)
    c, s = _tables((5, 1), 4, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rope_fusion.apply_rotary(x, c, s)
    assert all(t.shape != x.shape for t in saved) and len(saved) == 2


def test_requested_backend_that_cannot_run_falls_back_with_one_log_line(caplog):
    from conftest import compile_with_pass

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    x = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 8, torch.float32)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        out, p = compile_with_pass(lambda x, c, s: (rope(x, c, s), rope(2 * x, c, s)), x, c, s,
                                   backend="triton", fuse_qk=False)
    assert [k.backend for k in p.report.kernels] == ["inductor", "inductor"], p.report.table()
    assert all("triton" in k.fallback and "cpu" in k.fallback for k in p.report.kernels)
    lines = [r.getMessage() for r in caplog.records if "did not take a site" in r.getMessage()]
    assert len(lines) == 1, lines
    torch.testing.assert_close(out[0], rope(x, c, s), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["rms", "rms_across_heads"])
def test_norm_prologue_matches_the_reference_and_is_differentiable(norm):
    torch.manual_seed(5)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8 if norm == "rms" else (3, 8), dtype=torch.float64, requires_grad=True)
    c, s = _tables((5, 1), 4)
    out = rope_fusion.apply_rotary(x, c, s, norm=norm, norm_eps=1e-5, norm_weight=w)
    dims = (-1,) if norm == "rms" else (-2, -1)
    xn = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(out, rotary_reference(xn, c, s, interleaved=False, rotary_dim=8, full_tables=False))
    assert torch.autograd.gradcheck(
        lambda x, w: rope_fusion.apply_rotary(x, c, s, norm=norm, norm_eps=1e-5, norm_weight=w), (x, w))


def test_norm_weight_without_a_norm_is_refused():
    x = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(ValueError, match="without a norm"):
        rope_fusion.apply_rotary(x, c, s, norm_weight=torch.ones(8))
    with pytest.raises(ValueError, match="norm must be one of"):
        rope_fusion.apply_rotary(x, c, s, norm="layer")


@pytest.mark.parametrize("full", [False, True])
def test_deinterleave_is_neox_on_the_deinterleaved_x(full):
    """DeepSeek-V3's form: x's interleaved pairs rotated and written in NeoX order; full tables are indexed
    by output lane (as the model applies cat(freqs, freqs) to the de-interleaved x)."""
    torch.manual_seed(6)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    c, s = _tables((5,), 16 if full else 8)
    xd = x.unflatten(-1, (8, 2)).transpose(-1, -2).reshape(3, 5, 16)
    want = rotary_reference(xd, c, s, interleaved=False, rotary_dim=16, full_tables=full)
    kw = dict(interleaved=True, rotary_dim=16, full_tables=full, conjugate=False, out_dtype=torch.float64,
              deinterleave=True)
    torch.testing.assert_close(torch.ops.rope_fusion.rotary(x, c, s, **kw), want)
    compiled = torch.compile(lambda x: torch.ops.rope_fusion.rotary(x, c, s, **kw))  # the lowering
    torch.testing.assert_close(compiled(x.detach()), want.detach())
    assert torch.autograd.gradcheck(lambda x: torch.ops.rope_fusion.rotary(x, c, s, **kw), (x,))
    with pytest.raises(ValueError, match="interleaved=True"):
        torch.ops.rope_fusion.rotary(x, c, s, **{**kw, "interleaved": False})
