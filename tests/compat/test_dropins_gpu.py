"""The drop-ins on a CUDA GPU, the Triton kernel compiled: every call of a plan after the compiled launcher's check,
inside a CUDA graph, the held tail and the row with its tail in the padding compiled for the device, and the in-place
form leaving the lanes outside the rotation as they were; each against an fp64 evaluation of its contract.
Skipped without a GPU (the CPU runs of the same paths interpret the kernel: tests/compat/test_compat_*.py,
tests/kernels/test_kernel_held_tail.py)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.norm_tiles import held_tail_launch, norm_params
from rope_fusion.compat import vllm as compat_vllm
from rope_fusion.compat import vllm_omni, vllm_vision
from rope_fusion.ops.reference import rotary_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-6
BF16 = torch.bfloat16


def packed_table(rows, rotary_dim):
    angles = torch.rand(rows, rotary_dim // 2, dtype=torch.float64, device="cuda") * 50
    return torch.cat((angles.cos(), angles.sin()), -1).float()


def normed_rope(x, w, table, rotary_dim, interleaved):
    cos, sin = table.double()[..., None, :].chunk(2, -1)
    return rotary_reference(x.double(), cos, sin, interleaved=interleaved, rotary_dim=rotary_dim, full_tables=False,
                            norm="rms", norm_eps=EPS, norm_weight=w.double(), out_dtype=torch.float64)


def within_one_rounding(out, want, dtype=BF16):
    err = (out.double() - want).abs().max().item()
    assert err <= 2 * torch.finfo(dtype).eps * want.abs().max().item(), err


@pytest.mark.parametrize("hq,hk,d,r,interleaved", [(24, 24, 128, 96, False), (24, 24, 128, 128, True),
                                                    (32, 8, 128, 64, True), (16, 16, 80, 80, False)])
def test_cuda_fused_qk_norm_rope_every_call_and_in_a_graph(hq, hk, d, r, interleaved):
    torch.manual_seed(hq + r)
    qw, kw = (torch.rand(d, device="cuda") + 0.5).to(BF16), (torch.rand(d, device="cuda") + 0.5).to(BF16)
    for tokens in (1, 300, 300, 300, 2048):  # plan, the compiled launcher's check, then the launcher alone
        q, k = (torch.randn(tokens, h, d, device="cuda", dtype=BF16) for h in (hq, hk))
        table = packed_table(tokens, r)
        qo, ko = vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS, interleaved=interleaved)
        within_one_rounding(qo, normed_rope(q, qw, table, r, interleaved))
        within_one_rounding(ko, normed_rope(k, kw, table, r, interleaved))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qo, ko = vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS, interleaved=interleaved)
    q.copy_(torch.randn_like(q))
    graph.replay()
    within_one_rounding(qo, normed_rope(q, qw, table, r, interleaved))


@pytest.mark.parametrize("interleaved,table_dtype", [(False, torch.float32), (True, BF16)])
def test_cuda_fused_qk_norm_rope_launches_from_pointers(interleaved, table_dtype):
    """After a plan's check its calls launch from data pointers, the table's sin half at the offset the call's key
    fixes, and make no views. Tables cut from one buffer at other element offsets (other 16-byte residues, so keys
    of their own), q and k cut from one QKV or apart: each call against the fp64 contract."""
    from rope_fusion.ops.plan_cache import plan_cache

    torch.manual_seed(5)
    tokens, hq, hk, d, r = 257, 8, 2, 128, 96
    qw, kw = (torch.rand(d, device="cuda") + 0.5).to(BF16), (torch.rand(d, device="cuda") + 0.5).to(BF16)
    buffer = torch.empty(tokens * r + 8, device="cuda", dtype=table_dtype)
    for offset in (0, 1, 2, 3, 0):
        for joined in (True, False) * 3:  # a plan, its check, then its launches from pointers
            if joined:
                q, k, _ = torch.randn(tokens, hq + 2 * hk, d, device="cuda", dtype=BF16).split([hq, hk, hk], 1)
            else:
                q, k = (torch.randn(tokens, h, d, device="cuda", dtype=BF16) for h in (hq, hk))
            table = buffer[offset:offset + tokens * r].view(tokens, r)
            table.copy_(packed_table(tokens, r))
            qo, ko = vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS, interleaved=interleaved)
            within_one_rounding(qo, normed_rope(q, qw, table, r, interleaved))
            within_one_rounding(ko, normed_rope(k, kw, table, r, interleaved))
    runners = plan_cache("compat.qk_norm_rope").values()
    assert len(runners) == 8  # 4 residues x (joined, apart)
    assert all(runner.by_pointers is not None for runner in runners)


def test_cuda_fused_joint_qkv_norm_rope():
    torch.manual_seed(1)
    b, s0, s1, h, d = 1, 64, 512, 24, 128
    streams = [t for s in (s0, s1) for t in torch.randn(b, s, 3, h, d, device="cuda", dtype=BF16).unbind(2)]
    weights = [(torch.rand(d, device="cuda") + 0.5).to(BF16) for _ in range(4)]
    table = packed_table(b * (s0 + s1), d)
    for _ in range(3):
        q, k, v = vllm_omni.fused_joint_qkv_norm_rope(*streams, *weights, table, EPS)
    view = table.view(b, s0 + s1, d)
    for out, i, (w0, w1) in ((q, 0, weights[::2]), (k, 1, weights[1::2])):
        within_one_rounding(out[:, :s0], normed_rope(streams[i], w0, view[:, :s0], d, True))
        within_one_rounding(out[:, s0:], normed_rope(streams[i + 3], w1, view[:, s0:], d, True))
    assert torch.equal(v, torch.cat((streams[2], streams[5]), 1))


def test_cuda_vision_tower_view():
    torch.manual_seed(2)
    s, h, d = 4096, 16, 80
    qkv = torch.randn(s, 1, 3 * h * d, device="cuda", dtype=BF16)
    qk = qkv.view(s, 1, 3, h, d).permute(2, 1, 0, 3, 4)[:2].reshape(2, s, h, d)
    angles = torch.rand(s, d // 2, dtype=torch.float64, device="cuda") * 50
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    module = vllm_vision.ApplyRotaryEmb(enforce_enable=True)
    for _ in range(3):
        out = module(qk, cos, sin)
    want = rotary_reference(qk.double(), cos.double()[:, None], sin.double()[:, None], interleaved=False,
                            rotary_dim=d, full_tables=False, out_dtype=torch.float64)
    within_one_rounding(out, want)


@pytest.mark.parametrize("cache_dtype,rotary_dim", [(torch.float32, 128), (BF16, 64)])
def test_cuda_rotary_embedding_in_place_every_call_and_in_a_graph(cache_dtype, rotary_dim):
    torch.manual_seed(3)
    t, hq, hk, d = 1024, 32, 8, 128
    cache = packed_table(8192, rotary_dim).to(cache_dtype)
    positions = torch.randint(0, 8192, (t,), device="cuda")
    c, s = cache.double()[positions][:, None].chunk(2, -1)

    def want(x):
        return rotary_reference(x.double().view(t, -1, d), c, s, interleaved=False, rotary_dim=rotary_dim,
                                full_tables=False, out_dtype=torch.float64).view(x.shape)
    for _ in range(3):
        q, k = (torch.randn(t, n * d, device="cuda", dtype=BF16) for n in (hq, hk))
        qi, ki = q.clone(), k.clone()
        pointers = qi.data_ptr(), ki.data_ptr()
        compat_vllm.rotary_embedding(positions, qi, ki, d, cache, True)
        assert (qi.data_ptr(), ki.data_ptr()) == pointers
        within_one_rounding(qi, want(q))
        within_one_rounding(ki, want(k))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compat_vllm.rotary_embedding(positions, qi, ki, d, cache, True)
    qi.copy_(q)
    graph.replay()
    within_one_rounding(qi, want(q))


@pytest.mark.parametrize("block_h,warps", [(4, 1), (8, 2)])
def test_cuda_held_tail_compiled(block_h, warps):
    """The held tail compiled for the device (MiniMax-H3's geometry), as benchmarks/norm_tiles.py launches it."""
    torch.manual_seed(4)
    t, h, d, r = 2048, 24, 128, 96
    q, k = (torch.randn(t, h, d, device="cuda", dtype=BF16) for _ in range(2))
    weights = [(torch.rand(d, device="cuda") + 0.5).to(BF16) for _ in range(2)]
    table = packed_table(t, r)
    cos, sin = table.view(t, 1, 2, r // 2).unbind(-2)
    out = held_tail_launch(q, k, cos, sin, norm_params(r, False, BF16, EPS), weights, block_h, warps, True)()
    for x, w, o in zip((q, k), weights, out):
        within_one_rounding(o, normed_rope(x, w, table, r, False))


@pytest.mark.parametrize("row_tail", [True, False])
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_cuda_row_tail_and_the_halves(row_tail, tokens):
    """MiniMax-H3's rows both ways, compiled (the split launch at 1024 tokens, one program a token at 4096)."""
    from rope_fusion.kernels import triton_launch

    torch.manual_seed(5)
    h, d, r = 24, 128, 96
    q, k = (torch.randn(tokens, h, d, device="cuda", dtype=BF16) for _ in range(2))
    weights = [(torch.rand(d, device="cuda") + 0.5).to(BF16) for _ in range(2)]
    table = packed_table(tokens, r)
    cos, sin = table.view(tokens, 1, 2, r // 2).unbind(-2)
    out = triton_launch.launch([q, k], cos, sin, norm_params(r, False, BF16, EPS), None, weights, row_tail=row_tail)
    for x, w, o in zip((q, k), weights, out):
        within_one_rounding(o, normed_rope(x, w, table, r, False))


@pytest.mark.parametrize("offset,rotary_dim", [(0, 64), (64, 64)])
def test_cuda_in_place_leaves_the_other_lanes(offset, rotary_dim):
    """rotary_embedding in place at partial rotary and after a pass-through head: the lanes outside the rotation
    keep their bits, through the plan, the compiled launcher's check and the launcher alone."""
    torch.manual_seed(6)
    t, hq, hk, d = 1024, 32, 8, 128
    cache = packed_table(8192, rotary_dim)
    positions = torch.randint(0, 8192, (t,), device="cuda")
    lanes = [i for i in range(d) if not offset <= i < offset + rotary_dim]
    for _ in range(3):
        q, k = (torch.randn(t, n, d, device="cuda", dtype=BF16) for n in (hq, hk))
        qi, ki = q.clone(), k.clone()
        compat_vllm.rotary_embedding(positions, qi, ki, d, cache, True, rope_dim_offset=offset)
        c, s = cache.double()[positions][:, None].chunk(2, -1)
        for x, got in ((q, qi), (k, ki)):
            assert torch.equal(got[..., lanes], x[..., lanes])
            within_one_rounding(got, rotary_reference(x.double(), c, s, interleaved=False, rotary_dim=rotary_dim,
                                                      full_tables=False, rotary_offset=offset,
                                                      out_dtype=torch.float64))
