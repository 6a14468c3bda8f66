"""A rotation after a pass-through head (the op's `rotary_offset`): DeepSeek-V3's MLA rotates the last 64 of
192 lanes and puts the head back with `cat((q_nope, rope(q_pe)), -1)`. The site is the cat, and one op writes
the whole head, so the cat's copy dies with the rotation (docs/design.md section 2)."""

from __future__ import annotations

import pytest
import torch

import rope_fusion
from rope_fusion.ops.reference import rotary_reference
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

B, H, S, NOPE, ROPE = 1, 4, 16, 32, 16


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def deepseek_v3_mla(q, k_pe, cos, sin):
    """transformers' DeepSeek-V3 attention with `rope_interleave`: q [B, H, S, nope + rope] split, q_pe and the
    single-head k_pe de-interleaved and rotated NeoX, q put back together by cat (k's cat reads another
    tensor, k_pass, so k_pe stays a site of its own, rotated whole: one call with q's, `offset_q_only`)."""
    q_pass, q_rot = torch.split(q, [NOPE, ROPE], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def deinterleave(x):
        b, h, s, d = x.shape
        return x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    q_rot, k_pe = deinterleave(q_rot), deinterleave(k_pe)
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_pe = k_pe * cos + rotate_half(k_pe) * sin
    return torch.cat((q_pass, q_rot), dim=-1), k_pe


def head_and_tail(q, k, cos, sin):
    """Lanes [8, 24) of 40 rotate (interleaved pairs); a head of 8 and a tail of 16 lanes pass through."""
    def one(x):
        a, r, t = x[..., :8], x[..., 8:24], x[..., 24:]
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
        return torch.cat((a, rot, t), -1)
    return one(q), one(k)


def normed_rope_at_end(q, k, wq, wk, cos, sin):
    """A per-head RMSNorm over the whole head, then NeoX on its last ROPE lanes (the rope part at the end)."""
    def one(x, w):
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
        nope, pe = x[..., :NOPE], x[..., NOPE:]
        return torch.cat((nope, pe * cos + rotate_half(pe) * sin), -1)
    return one(q, wq), one(k, wk)


def _tables(width: int, full: bool, dtype=torch.float32):
    ang = torch.rand(B, S, width // 2 if full else width, dtype=torch.float64) * 6
    if full:
        ang = torch.cat((ang, ang), -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deepseek_v3_q_cat_is_the_site(dtype):
    q = torch.randn(B, H, S, NOPE + ROPE).to(dtype)
    k_pe = torch.randn(B, 1, S, ROPE).to(dtype)
    cos, sin = _tables(ROPE, full=True)
    out, p = compile_with_pass(deepseek_v3_mla, q, k_pe, cos, sin)
    rep = p.report
    assert not rep.errors and not rep.misses, rep.table()
    by_role = {s.role: s for s in rep.sites}
    assert len(rep.sites) == 2 and set(by_role) == {"q", "k"}, rep.table()
    assert [k.op for k in rep.kernels] == ["rope_fusion.rotary_qk"], rep.table()  # q and k_pe in one call
    qs, ks = by_role["q"], by_role["k"]
    assert (qs.style, qs.rotary_offset, qs.rotary_dim, qs.head_dim) == ("deinterleave", NOPE, ROPE, NOPE + ROPE)
    assert qs.node.startswith("cat"), rep.table()  # the whole head, written by the op
    assert (ks.rotary_offset, ks.head_dim) == (0, ROPE)
    assert "R=32:48" in rep.table()
    cats = {t: c for t, c in p.capture.counts_after().items() if "cat" in t}
    assert not cats, f"a cat is left after the pass: {cats}"  # q's cat and the rotate_half cats all died
    check_numerics(deepseek_v3_mla, (q, k_pe, cos, sin), out, context=rep.table())


def test_head_and_tail_around_the_rotation():
    q, k = torch.randn(B, S, H, 40), torch.randn(B, S, 2, 40)
    cos, sin = (t.unsqueeze(2) for t in _tables(8, full=False))
    out, p = compile_with_pass(head_and_tail, q, k, cos, sin)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 1 and not rep.errors, rep.table()
    assert [(s.rotary_offset, s.rotary_dim, s.style) for s in rep.sites] == [(8, 16, "interleaved")] * 2
    check_numerics(head_and_tail, (q, k, cos, sin), out, context=rep.table())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_before_a_rotation_at_the_end_folds(dtype):
    """The op normalises the whole head and rotates from its offset: the norm folds (it used to stay in the
    graph, when the op rotated only the lanes after the head)."""
    q, k = torch.randn(B, S, H, NOPE + ROPE).to(dtype), torch.randn(B, S, 2, NOPE + ROPE).to(dtype)
    wq, wk = (torch.rand(NOPE + ROPE).to(dtype) + 0.5 for _ in range(2))
    cos, sin = (t.unsqueeze(2) for t in _tables(ROPE, full=True))
    out, p = compile_with_pass(normed_rope_at_end, q, k, wq, wk, cos, sin)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 1 and not rep.errors, rep.table()
    assert [s.norm for s in rep.sites] == ["rms folded"] * 2, rep.table()
    assert [s.rotary_offset for s in rep.sites] == [NOPE] * 2
    check_numerics(normed_rope_at_end, (q, k, wq, wk, cos, sin), out, context=rep.table())


@pytest.mark.parametrize("interleaved,deinterleave", [(False, False), (True, False), (True, True)],
                         ids=["neox", "interleaved", "deinterleave"])
def test_op_lowering_with_an_offset(interleaved, deinterleave):
    """The op's Inductor lowering (the CPU backend) against fp64, with a head and a tail around the rotated
    lanes; the eager op (the reference) agrees; the gradient of x is the inverse rotation, lanes outside the
    rotated ones passing theirs through."""
    x = torch.randn(3, S, 2, 40, dtype=torch.float64)
    cos, sin = (t[0].unsqueeze(1) for t in _tables(16, full=True, dtype=torch.float64))
    kw = dict(interleaved=interleaved, rotary_dim=16, full_tables=True, rotary_offset=8)
    if deinterleave:
        kw["deinterleave"] = True

    def f(x, cos, sin):
        return torch.ops.rope_fusion.rotary(x, cos, sin, conjugate=False, out_dtype=x.dtype, **kw)

    want = rotary_reference(x, cos, sin, **kw)
    assert torch.equal(want[..., :8], x[..., :8]) and torch.equal(want[..., 24:], x[..., 24:])
    got = torch.compile(f, backend="inductor")(x.float(), cos.float(), sin.float())
    assert (got.double() - want).abs().max().item() < 1e-5
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)
    (f(xg, cos, sin) * g).sum().backward()
    xr = x.clone().requires_grad_()
    (rotary_reference(xr, cos, sin, **kw) * g).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)


def test_public_api_and_errors():
    x = torch.randn(2, S, H, NOPE + ROPE)
    cos, sin = _tables(ROPE // 2, full=False)  # one entry per pair
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
    out = rope_fusion.apply_rotary(x, cos, sin, rotary_offset=NOPE)  # rotary_dim defaults to the rest
    want = rotary_reference(x.double(), cos.double(), sin.double(), interleaved=False, rotary_dim=ROPE,
                            full_tables=False, rotary_offset=NOPE)
    assert (out.double() - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="rotary_offset \\+ rotary_dim = 40 \\+ 16 exceeds the head dim"):
        rope_fusion.apply_rotary(x, cos, sin, rotary_dim=ROPE, rotary_offset=40)
    with pytest.raises(ValueError, match="rotary_offset must be >= 0"):
        rope_fusion.apply_rotary(x, cos, sin, rotary_dim=ROPE, rotary_offset=-2)
