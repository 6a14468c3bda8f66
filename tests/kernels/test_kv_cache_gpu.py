"""The KV-cache op's Triton kernel on the GPU (skipped without CUDA): `rope_fusion.apply_rotary_qk_kv_cache` against
the op's reference on the same CUDA tensors, and against vLLM's own cache write where vLLM imports.

Rows of vLLM's decode and prefill shapes, NHD and HND caches in bf16 and FP8 (e4m3, per-tensor scales), MHA and GQA,
the QK-norm, and MLA's one cache: q equal to the reference within one bf16 rounding, every written cache row within
one rounding of the reference's (FP8: one e4m3 step), every other byte of caches filled with random bytes as it
was. In a CUDA graph, replays write the caches the captured call names, with the slots of each replay.
"""

from __future__ import annotations

import pytest
import torch

import rope_fusion
from rope_fusion.ops.kv_cache import parse_joint, parse_separate
from rope_fusion.ops.kv_cache_reference import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP8 = torch.float8_e4m3fn
BS = 16


def _random_bytes(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return t


def _row(T: int, hq: int, hk: int, layout: str, cache_dtype: torch.dtype, norm: bool = False) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(T * 7 + hk)
    bf16 = torch.bfloat16
    q, k, v = (torch.randn(T, h, 128, generator=g, device="cuda").to(bf16) for h in (hq, hk, hk))
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    freqs = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    cos, sin = freqs.cos().to(bf16), freqs.sin().to(bf16)
    blocks = max(4, 2 * -(-T // BS))
    shape = (blocks, BS, hk, 128) if layout == "NHD" else (blocks, hk, BS, 128)
    slots = torch.randperm(blocks * BS, device="cuda")[:T]
    slots[::5] = -1  # padding tokens
    kw = dict(positions=torch.randint(0, 4096, (T,), device="cuda"), kv_layout=layout)
    if cache_dtype == FP8:
        kw.update(k_scale=torch.tensor([0.03], device="cuda"), v_scale=torch.tensor([0.02], device="cuda"))
    if norm:
        kw.update(norm="rms", q_norm_weight=torch.rand(128, device="cuda") + 0.5,
                  k_norm_weight=torch.rand(128, device="cuda") + 0.5)
    caches = [_random_bytes(shape, cache_dtype) for _ in range(2)]
    return [q, k, v, cos, sin, *caches, slots], kw


def _check_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Byte for byte, except values one rounding apart (the kernel's fused multiply-adds): bf16 within one ulp, FP8
    within one e4m3 step."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    differ = got.view(ints) != want.view(ints)  # elements, their bytes compared (random bytes hold NaNs)
    if not differ.any():
        return
    g, w = got[differ].float(), want[differ].float()
    step = 2.0 ** (torch.floor(torch.log2(w.abs().clamp_min(2.0 ** -6))) - (3 if got.dtype == FP8 else 7))
    assert ((g - w).abs() <= step * 1.001).all(), f"max difference {(g - w).abs().max().item()}"


CASES = [(1, 32, 32, "NHD", torch.bfloat16, False), (64, 32, 8, "NHD", FP8, False),
         (256, 32, 8, "HND", torch.bfloat16, False), (8192, 32, 8, "HND", FP8, False),
         (2048, 32, 8, "NHD", torch.bfloat16, True), (8, 32, 32, "HND", FP8, True)]


@pytest.mark.parametrize("T,hq,hk,layout,cache_dtype,norm", CASES)
def test_gpu_kernel_matches_the_reference(T, hq, hk, layout, cache_dtype, norm):
    args, kw = _row(T, hq, hk, layout, cache_dtype, norm)
    ref_caches = [c.clone() for c in args[5:7]]
    out = rope_fusion.apply_rotary_qk_kv_cache(*args, **kw)
    q, k, v, cos, sin, _, _, slots = args
    positions = kw.pop("positions")
    cc = parse_separate((q, k, v, cos, sin, *ref_caches, slots, positions, kw.pop("q_norm_weight", None),
                         kw.pop("k_norm_weight", None), None, None, kw.pop("k_scale", None), kw.pop("v_scale", None),
                         None), dict(interleaved=False, rotary_dim=128, full_tables=False, conjugate=False,
                                     out_dtype=torch.bfloat16, **kw))
    want = reference(cc)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    for got, ref in zip(args[5:7], ref_caches):
        _check_cache(got, ref)


def test_gpu_mla_joint_cache_fp8():
    """DeepSeek's MLA: q's rope lanes after 128 nope lanes, the one k_pe head, the 512-lane latent, one FP8 cache."""
    T, H = 48, 16
    bf16 = torch.bfloat16
    q, k, v = (torch.randn(*s, device="cuda").to(bf16) for s in ((T, H, 192), (T, 64), (T, 512)))
    ang = torch.rand(1024, 32, device="cuda") * 6
    cos, sin = ang.cos(), ang.sin()
    kv = _random_bytes((8, BS, 576), FP8)
    slots = torch.randperm(8 * BS, device="cuda")[:T]
    scale = torch.tensor([0.05], device="cuda")
    positions = torch.randint(0, 1024, (T,), device="cuda")
    opts = dict(interleaved=True, rotary_dim=64, full_tables=False, conjugate=False, out_dtype=bf16, rotary_offset=128,
                offset_q_only=True)
    ref_kv = kv.clone()
    out = rope_fusion.apply_rotary_qk_kv_cache(q, k, v, cos, sin, kv, None, slots, positions=positions, k_scale=scale,
                                               **opts)
    want = reference(parse_joint((q, k, v, cos, sin, ref_kv, slots, positions, None, None, None, None, scale, None),
                                 opts))
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    _check_cache(kv, ref_kv)


def test_gpu_cuda_graph_replays_write_the_cache():
    """Captured once, replayed with new slots and new k: each replay writes its slots (the slot mapping and the
    tensors are read at replay, as vLLM's decode graphs need)."""
    args, kw = _row(8, 32, 8, "NHD", torch.bfloat16)
    rope_fusion.apply_rotary_qk_kv_cache(*args, **kw)  # planned and compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_fusion.apply_rotary_qk_kv_cache(*args, **kw)
    q, k, v, cos, sin, kc, vc, slots = args
    for _ in range(2):
        slots.copy_(torch.randperm(kc.shape[0] * BS, device="cuda")[:8])
        k.copy_(torch.randn_like(k))
        kc.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.zeros_like(kc)
        cc = parse_separate((q, k, v, cos, sin, ref, torch.zeros_like(vc), slots, kw["positions"], None, None, None,
                             None, None, None, None),
                            dict(interleaved=False, rotary_dim=128, full_tables=False, conjugate=False,
                                 out_dtype=torch.bfloat16, kv_layout="NHD"))
        want = reference(cc)
        torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
        _check_cache(kc, ref)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_matches_vllm_reshape_and_cache_flash(cache_dtype):
    """The fused write against apply_rotary_qk then vLLM's own Triton cache write: bf16 caches byte for byte (k is
    rounded once either way), FP8 within one e4m3 step (vLLM's pair rounds k to bf16 before it quantises)."""
    try:
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
    except Exception as e:
        pytest.skip(f"vLLM's cache write does not import: {type(e).__name__}: {e}")
    args, kw = _row(64, 32, 8, "NHD", cache_dtype)
    q, k, v, cos, sin, kc, vc, slots = args
    theirs = [c.clone() for c in (kc, vc)]
    rope_fusion.apply_rotary_qk_kv_cache(*args, **kw)
    _, k_rot = rope_fusion.apply_rotary_qk(q, k, cos, sin, positions=kw["positions"][:, None])
    one = torch.ones(1, device="cuda")
    fp8 = cache_dtype == FP8
    try:
        triton_reshape_and_cache_flash(k_rot, v, *theirs, slots, "fp8" if fp8 else "auto",
                                       kw["k_scale"] if fp8 else one, kw["v_scale"] if fp8 else one)
    except Exception as e:  # vLLM's platform or FP8 support
        pytest.skip(f"vLLM's cache write does not run here: {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    for got, want in zip((kc, vc), theirs):
        if fp8:
            _check_cache(got, want)
        else:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
