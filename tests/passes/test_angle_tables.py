"""Tables given as angles (the op's `angle_tables`): where the graph computes its tables as cos(a) and sin(a) of
one angle tensor, the op reads `a` and computes both per token, so the two tables are never written and read
back (docs/design.md section 2). HiDream builds its 2x2 rotation matrices this way."""

from __future__ import annotations

import pytest
import torch

from rope_fusion.ops.reference import rotary_reference
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

B, S, H, D = 1, 24, 4, 32


def hidream(xq, xk, ang):
    """diffusers HiDream: [.., D/2, 2, 2] matrices stacked from cos and sin of fp32 angles, a heads dim added,
    `.float()` math, `type_as`."""
    m = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], dim=-1)
    f = m.view(*m.shape[:-1], 2, 2)[:, :, None]
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = f[..., 0] * xq_[..., 0] + f[..., 1] * xq_[..., 1]
    xk_out = f[..., 0] * xk_[..., 0] + f[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def llama_from_positions(q, k, pos, inv_freq):
    """Tables computed from positions x frequencies in the graph, cast to x's dtype (transformers' Llama form
    without attention scaling): the angles are computed too, but written once instead of two tables."""
    ang = pos[:, :, None].float() * inv_freq[None, None, :]
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().to(q.dtype)[:, None], emb.sin().to(q.dtype)[:, None]

    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin
    return rot(q), rot(k)


def two_angle_tensors(q, k, a, b):
    """cos of one angle tensor and sin of another: not one angle, so the tables stay tables."""
    cos, sin = a.cos()[:, :, None], b.sin()[:, :, None]
    x1, x2 = q[..., 0::2], q[..., 1::2]
    y1, y2 = k[..., 0::2], k[..., 1::2]
    return (torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2),
            torch.stack((y1 * cos - y2 * sin, y2 * cos + y1 * sin), -1).flatten(-2))


def _trig_ops(p) -> int:
    return sum(c for t, c in p.capture.counts_after().items() if t.split(".")[-2:][0] in ("cos", "sin"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hidream_matrices_take_the_angles(dtype):
    ang = torch.rand(B, S, D // 2) * S  # angles up to S radians, as positions x frequencies give
    q, k = torch.randn(B, S, H, D).to(dtype), torch.randn(B, S, H, D).to(dtype)
    out, p = compile_with_pass(hidream, q, k, ang)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 1 and not rep.errors, rep.table()
    assert all(s.angle_tables for s in rep.sites) and "tables per-pair fp32 angles:" in rep.table(), rep.table()
    assert _trig_ops(p) == 0, p.capture.counts_after()  # cos and sin are computed inside the op only
    check_numerics(hidream, (q, k, ang), out, context=rep.table())


def test_computed_angles_are_read_once():
    pos = torch.arange(S)[None].repeat(2, 1) + torch.randint(0, 100, (2, 1))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    q, k = torch.randn(2, H, S, D, dtype=torch.bfloat16), torch.randn(2, 2, S, D, dtype=torch.bfloat16)
    out, p = compile_with_pass(llama_from_positions, q, k, pos, inv_freq)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 1 and not rep.errors, rep.table()
    assert all(s.angle_tables for s in rep.sites), rep.table()
    check_numerics(llama_from_positions, (q, k, pos, inv_freq), out, context=rep.table())


def test_cos_and_sin_of_different_angles_stay_tables():
    a, b = torch.rand(B, S, D // 2) * 6, torch.rand(B, S, D // 2) * 6
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    out, p = compile_with_pass(two_angle_tensors, q, k, a, b)
    rep = p.report
    assert len(rep.sites) == 2 and not rep.errors, rep.table()
    assert not any(s.angle_tables for s in rep.sites), rep.table()
    check_numerics(two_angle_tensors, (q, k, a, b), out, context=rep.table())


@pytest.mark.parametrize("full,conjugate", [(False, False), (True, True)])
def test_op_lowering_and_gradient(full, conjugate):
    """The op's lowering (the CPU backend) against fp64; the gradients of x and of the angles, through the
    reference, match autograd of cos and sin."""
    x = torch.randn(2, S, H, D, dtype=torch.float64)
    ang = torch.rand(2, S, 1, D if full else D // 2, dtype=torch.float64) * 50
    kw = dict(interleaved=False, rotary_dim=D, full_tables=full, conjugate=conjugate)

    def f(x, a):
        return torch.ops.rope_fusion.rotary(x, a, a, out_dtype=x.dtype, angle_tables=True, **kw)

    want = rotary_reference(x, ang.cos(), ang.sin(), **kw)
    got = torch.compile(f, backend="inductor")(x.float(), ang.float())
    assert (got.double() - want).abs().max().item() < 1e-4
    xg, ag = x.clone().requires_grad_(), ang.clone().requires_grad_()
    g = torch.randn_like(x)
    (f(xg, ag) * g).sum().backward()
    xr, ar = x.clone().requires_grad_(), ang.clone().requires_grad_()
    (rotary_reference(xr, ar.cos(), ar.sin(), **kw) * g).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    torch.testing.assert_close(ag.grad, ar.grad)
