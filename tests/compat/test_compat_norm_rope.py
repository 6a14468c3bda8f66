"""rope_fusion.rms_norm_rope_qk against the QK-norm + RoPE that attention code writes by hand: RMSNorm in fp32
(per head as Qwen3 does, or over the whole inner dim as Wan and Flux.2 do), cast back, then RoPE. Checked within
the numerics contract (docs/design.md section 2) in NeoX and interleaved pairs, with and without weights, and the
pass, compiling the hand-written form, folds the norm and emits the rotation the function asks for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rope_fusion
from tests.helpers.compat import assert_pass_matches_dropin, dropin_calls
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

T, H, HK, D, EPS = 5, 4, 2, 64, 1e-6


def _rope(x, cos, sin, interleaved):
    c, s = cos[:, None], sin[:, None]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def _norm(x, w, per_head):
    """Per head over D; across heads over the inner dim H * D before the heads are split, as Wan does."""
    if per_head:
        return F.rms_norm(x.float(), x.shape[-1:], None if w is None else w.float(), EPS).to(x.dtype)
    inner = x.flatten(-2)
    out = F.rms_norm(inner.float(), inner.shape[-1:], None if w is None else w.float(), EPS).to(x.dtype)
    return out.view_as(x)


def hand_written(per_head, interleaved):
    def fn(q, k, qw, kw, cos, sin):
        return (_rope(_norm(q, qw, per_head), cos, sin, interleaved),
                _rope(_norm(k, kw, per_head), cos, sin, interleaved))
    return fn


def _inputs(per_head, weights, dtype):
    q, k = torch.randn(T, H, D).to(dtype), torch.randn(T, HK, D).to(dtype)
    qw = (torch.rand(D if per_head else H * D) + 0.5).to(dtype) if weights else None
    kw = (torch.rand(D if per_head else HK * D) + 0.5).to(dtype) if weights else None
    angles = torch.rand(T, D // 2) * 6
    return q, k, qw, kw, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("per_head", [True, False])
def test_against_hand_written(per_head, interleaved, weights, dtype):
    q, k, qw, kw, cos, sin = _inputs(per_head, weights, dtype)
    out = rope_fusion.rms_norm_rope_qk(q, k, qw, kw, EPS, cos[:, None], sin[:, None], per_head=per_head,
                                       interleaved=interleaved)
    ref = hand_written(per_head, interleaved)
    if weights:
        check_numerics(ref, (q, k, qw, kw, cos, sin), out)
    else:
        check_numerics(lambda q, k, c, s: ref(q, k, None, None, c, s), (q, k, cos, sin), out)


def test_options_pass_through_and_norm_keywords_refused():
    q, k, qw, kw, cos, sin = _inputs(True, True, torch.float32)
    out = rope_fusion.rms_norm_rope_qk(q, k, qw, kw, EPS, cos[:, None, :16], sin[:, None, :16], rotary_dim=32)
    ref = hand_written(True, False)(q, k, qw, kw, cos, sin)  # full rotation: only the passed-through lanes match
    normed = _norm(q, qw, True)
    torch.testing.assert_close(out[0][..., 32:], normed[..., 32:])
    assert not torch.allclose(out[0][..., :32], ref[0][..., :32])
    with pytest.raises(TypeError, match="norm_eps"):
        rope_fusion.rms_norm_rope_qk(q, k, qw, kw, EPS, cos[:, None], sin[:, None], norm_eps=1e-5)
    with pytest.raises(ValueError, match="H \\* D"):
        rope_fusion.rms_norm_rope_qk(q, k, torch.ones(3 * D), None, EPS, cos[:, None], sin[:, None], per_head=False)


@pytest.mark.parametrize("per_head", [True, False])
def test_pass_emits_dropin_params(per_head):
    q, k, qw, kw, cos, sin = _inputs(per_head, True, torch.float32)
    fn = hand_written(per_head, False)
    out, p = compile_with_pass(fn, q, k, qw, kw, cos, sin)
    check_numerics(fn, (q, k, qw, kw, cos, sin), out)
    calls = dropin_calls(lambda q, k, qw, kw, c, s: rope_fusion.rms_norm_rope_qk(
        q, k, qw, kw, EPS, c[:, None], s[:, None], per_head=per_head), q, k, qw, kw, cos, sin)
    assert {c["norm"] for c in calls} == {"rms" if per_head else "rms_across_heads"}
    assert_pass_matches_dropin(p.report, calls, 2, p.report.table())
    folded = "rms folded" if per_head else "rms_across_heads folded"
    assert all(s.norm == folded for s in p.report.sites), p.report.table()
