"""The QK-norm before a rotation becomes the fused op's prologue (docs/design.md section 2, passes/analysis/norms.py):
each norm spelling of real code folds, the normed tensor is never written, and the result keeps the numerics
contract against fp64; norms the op cannot take stay in the graph with the reason in the report."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

H, D, S = 4, 32, 16


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def neox(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def interleaved(x, cos, sin):
    """Flux's apply_rotary_emb (use_real, unbind_dim=-1) with full-width per-lane tables, in fp32."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rot = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rot.float() * sin).to(x.dtype)


def diffusers_rms(x, w, eps=1e-6):
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(var + eps)).to(w.dtype) * w


def hf_rms(x, w, eps=1e-6):
    dt = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


def flux_block(q, k, wq, wk, cos, sin):
    """diffusers RMSNorm per head on [B, S, H, D], transpose to [B, H, S, D], interleaved rotation."""
    q, k = diffusers_rms(q, wq).transpose(1, 2), diffusers_rms(k, wk).transpose(1, 2)
    return interleaved(q, cos, sin), interleaved(k, cos, sin)


def qwen3_block(q, k, wq, wk, cos, sin):
    """transformers' Qwen3RMSNorm (cast back before the weight), NeoX rotate_half."""
    return neox(hf_rms(q, wq).transpose(1, 2), cos, sin), neox(hf_rms(k, wk).transpose(1, 2), cos, sin)


def wan_block(q, k, wq, wk, cos, sin):
    """torch.nn.RMSNorm over every head of a token ([B, S, H*D]), then unflatten to heads (Wan, Helios)."""
    q = F.rms_norm(q.flatten(2), (H * D,), wq.flatten(), 1e-6).unflatten(2, (H, D))
    k = F.rms_norm(k.flatten(2), (H * D,), wk.flatten(), 1e-6).unflatten(2, (H, D))
    return neox(q, cos, sin), neox(k, cos, sin)


def unweighted_block(q, k, wq, wk, cos, sin):
    q, k = F.rms_norm(q, (D,), None, 1e-5), F.rms_norm(k, (D,), None, 1e-5)
    return neox(q, cos, sin), neox(k, cos, sin)


def pow_rms(x, w, eps=1e-6):
    """transformers' Gemma4RMSNorm: torch.pow(mean + eps, -0.5) instead of rsqrt, in fp32, weight in fp32."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5) * w.float()).type_as(x)


def gemma4_block(q, k, wq, wk, cos, sin):
    return neox(pow_rms(q, wq), cos, sin), neox(pow_rms(k, wk), cos, sin)


def _args(dtype, across=False, tables_fp32=True):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k = (torch.randn(2, S, H, D, generator=g).to(dtype) for _ in range(2))
    wq, wk = ((torch.rand((H, D) if across else (D,), generator=g) + 0.5).to(dtype) for _ in range(2))
    ang = torch.rand(S, D // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    cos, sin = (t.to(torch.float32 if tables_fp32 else dtype) for t in (cos, sin))
    return q, k, wq, wk, cos, sin


def _interleaved_tables(cos, sin):
    half = cos.shape[-1] // 2
    return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)


def _rsqrts(p) -> int:
    """rsqrt and pow nodes left after the pass (a folded norm leaves neither)."""
    return sum(c for g in p.capture.graphs if g.after for t, c in g.after.counts.items()
               if "rsqrt" in t or "pow" in t)


CASES = [
    ("flux", flux_block, "rms folded"),
    ("qwen3", qwen3_block, "rms folded"),
    ("wan", wan_block, "rms_across_heads folded"),
    ("unweighted", unweighted_block, "rms folded"),
    ("gemma4_pow", gemma4_block, "rms folded"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,fn,folded", CASES, ids=[c[0] for c in CASES])
def test_norm_folds_into_the_op(name, fn, folded, dtype):
    q, k, wq, wk, cos, sin = _args(dtype, across=name == "wan")
    if name == "flux":
        cos, sin = _interleaved_tables(cos, sin)
    else:  # [S, D] tables against [B, H, S, D] (Qwen3) or [B, S, H, D] (the others)
        cos, sin = (cos, sin) if name == "qwen3" else (cos[:, None], sin[:, None])
    out, p = compile_with_pass(fn, q, k, wq, wk, cos, sin)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 1 and not rep.errors, rep.table()
    assert [s.norm for s in rep.sites] == [folded] * 2, rep.table()
    assert _rsqrts(p) == 0, "the norm is still computed in the graph"
    check_numerics(fn, (q, k, wq, wk, cos, sin), out, context=rep.table())


def norm_used_twice(q, k, wq, wk, cos, sin):
    qn, kn = hf_rms(q, wq), hf_rms(k, wk)
    return neox(qn, cos, sin), neox(kn, cos, sin), qn.sum(-1)


def layer_norm_block(q, k, wq, wk, cos, sin):
    return neox(F.layer_norm(q, (D,), wq), cos, sin), neox(F.layer_norm(k, (D,), wk), cos, sin)


def only_q_normed(q, k, wq, wk, cos, sin):
    return neox(hf_rms(q, wq), cos, sin), neox(k, cos, sin)


def half_head_norm(q, k, wq, wk, cos, sin):
    """The norm spans half a head: not a QK-norm the op computes."""
    qn = hf_rms(q.unflatten(-1, (2, D // 2)), wq[: D // 2]).flatten(-2)
    kn = hf_rms(k.unflatten(-1, (2, D // 2)), wk[: D // 2]).flatten(-2)
    return neox(qn, cos, sin), neox(kn, cos, sin)


def scaled_rsqrt(q, k, wq, wk, cos, sin):
    """rsqrt of the sum (not the mean) of squares: not an RMSNorm."""
    def nrm(x, w):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) * w
    return neox(nrm(q, wq), cos, sin), neox(nrm(k, wk), cos, sin)


NEAR = [
    ("used_twice", norm_used_twice, "left in the graph: the norm's values are used elsewhere"),
    ("layer_norm", layer_norm_block, "left in the graph: x is scaled by an rsqrt that is not"),
    ("only_q", only_q_normed, "left in the graph: q and k are normed differently"),
    ("half_head", half_head_norm, "left in the graph: the norm spans 16 lanes"),
    ("sum_not_mean", scaled_rsqrt, "left in the graph: x is scaled by an rsqrt that is not"),
]


@pytest.mark.parametrize("name,fn,note", NEAR, ids=[c[0] for c in NEAR])
def test_norms_the_op_cannot_take_stay_in_the_graph(name, fn, note):
    """The rotation still fuses; the norm is computed by the model's own code, and the report says why."""
    q, k, wq, wk, cos, sin = _args(torch.float32)
    cos, sin = cos[:, None], sin[:, None]
    out, p = compile_with_pass(fn, q, k, wq, wk, cos, sin)
    rep = p.report
    assert len(rep.sites) == 2 and not rep.errors, rep.table()
    notes = [s.norm for s in rep.sites]
    assert all(n.startswith(note) for n in notes), notes
    assert _rsqrts(p) > 0
    check_numerics(fn, (q, k, wq, wk, cos, sin), out, context=rep.table())


def test_training_graph_keeps_the_norm_it_saves_for_backward():
    """With weights that need gradients the forward graph saves the rsqrt: folding would compute the norm
    twice, so the norm stays and the report says so."""
    q, k, wq, wk, cos, sin = _args(torch.float32)
    wq.requires_grad_(), wk.requires_grad_()
    cos, sin = cos[:, None], sin[:, None]
    out, p = compile_with_pass(qwen3_block_nhd, q, k, wq, wk, cos, sin)
    fwd = [s for s in p.report.sites if s.norm]
    assert fwd and all(s.norm.startswith("left in the graph: the norm's values are used elsewhere") for s in fwd)
    ref = qwen3_block_nhd(q, k, wq, wk, cos, sin)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)


def qwen3_block_nhd(q, k, wq, wk, cos, sin):
    return neox(hf_rms(q, wq), cos, sin), neox(hf_rms(k, wk), cos, sin)


@pytest.mark.parametrize("name,folded", [("wan", "rms_across_heads folded"), ("qwen3", "rms folded")])
def test_real_models_fold_their_qk_norm(name, folded):
    """diffusers' Wan (torch.nn.RMSNorm over every head) and transformers' Qwen3 (per-head Qwen3RMSNorm),
    tiny random configs, inference: every site takes its norm, and the model keeps the numerics contract."""
    from tests.zoo.entries import by_name
    from tests.zoo.harness import run_entry

    res = run_entry(by_name(name), torch.float32)
    assert not res.failure and not res.errors, res.failure or res.errors
    assert res.sites == by_name(name).compiled_sites, res.report.table()
    assert [s.norm for s in res.report.sites] == [folded] * res.sites, res.report.table()
    assert res.err_pass <= res.tol, (res.err_pass, res.tol)


def wan_strided(q, k, wq, wk, cos, sin):
    """diffusers Wan exactly: nn.RMSNorm over [B, S, H*D], unflatten, strided-slice assignment (I1)."""
    def rot(x):
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[..., 0::2], sin[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x1 * s + x2 * c
        return out.type_as(x)
    d = cos.shape[-1]
    q = F.rms_norm(q, (q.shape[-1],), wq, 1e-6).unflatten(2, (-1, d))
    k = F.rms_norm(k, (k.shape[-1],), wk, 1e-6).unflatten(2, (-1, d))
    return rot(q), rot(k)


@pytest.mark.parametrize("heads", [4, 40])
def test_wan_norm_across_many_heads(heads):
    """Inductor sees x of 40 heads as [B, S, H, D] rather than a flat row split into head blocks: the weight
    [H*D] must reach the op as [H, D] either way."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    d = 128
    q, k = (torch.randn(1, 8, heads * d, generator=g) for _ in range(2))
    wq, wk = (torch.rand(heads * d, generator=g) + 0.5 for _ in range(2))
    ang = torch.rand(8, 1, d // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = ang.cos().repeat_interleave(2, -1).float(), ang.sin().repeat_interleave(2, -1).float()
    out, p = compile_with_pass(wan_strided, q, k, wq, wk, cos, sin)
    rep = p.report
    assert len(rep.sites) == 2 and not rep.errors, rep.table()
    assert [s.norm for s in rep.sites] == ["rms_across_heads folded"] * 2, rep.table()
    check_numerics(wan_strided, (q, k, wq, wk, cos, sin), out, context=rep.table())
