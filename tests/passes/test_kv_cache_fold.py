"""The KV-cache fold (passes/kv_cache_fold.py) on a vLLM-style graph: vLLM's real RotaryEmbedding (get_rope) and
its real `vllm::unified_kv_cache_update` registration, compiled through Inductor with the pass.

Stand-ins, said so: vLLM's attention package does not import here (einops is missing from its --no-deps install,
after attention.py itself has registered the op), so the forward context is vLLM's own `ForwardContext` set with
`override_forward_context`, and the attention impl is a stand-in whose `do_kv_cache_update` writes the cache as
vLLM's FlashAttention backend does (its `[blocks, kv_heads, block_size, 2 * head_dim]` cache split by
`transpose(1, 2).split(head_dim, -1)`, reshape_and_cache_flash's slots: block s // block_size, offset
s % block_size, -1 skipped); it is registered with FlashAttention's own cache record.
"""

from __future__ import annotations

import types

import pytest
import torch

import rope_fusion
from rope_fusion.ops import layer_cache_op
from rope_fusion.ops.layer_caches import FLASH_ATTENTION, AttentionCache, register_attention_cache

T, HQ, HK, D, BLOCKS, BS = 5, 4, 2, 64, 4, 16
LAYER = "model.layers.0.self_attn.attn"


class StandInFlashImpl:
    attn_type = "decoder"
    kv_cache_dtype = "auto"
    head_size = D
    kv_sharing_target_layer_name = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        kc, vc = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                kc[s // BS, s % BS] = key[t]
                vc[s // BS, s % BS] = value[t]


class UnknownImpl:
    """An attention impl with no cache record (its cache written as FlashAttention's, by vLLM's path)."""

    head_size = D
    do_kv_cache_update = StandInFlashImpl.do_kv_cache_update


@pytest.fixture(scope="module")
def vllm_parts():
    try:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
        try:
            import vllm.model_executor.layers.attention  # noqa: F401  (attention.py registers the op first)
        except ImportError:
            pass
        import vllm.forward_context as fc
        from vllm.utils.torch_utils import _encode_layer_name
        assert torch.ops.vllm.unified_kv_cache_update.default is not None
    except Exception as e:
        pytest.skip(f"vLLM's layers are not importable here: {type(e).__name__}: {e}")
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(D, max_position=128, is_neox_style=True, dtype=torch.float32)
    register_attention_cache(AttentionCache(f"{__name__}.StandInFlashImpl", FLASH_ATTENTION.split))
    return rope, fc, _encode_layer_name(LAYER)


def _fn(rope, name):
    def fn(positions, qkv):
        q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
        q, k = rope.forward_native(positions, q, k)
        q, k, v = q.view(-1, HQ, D), k.view(-1, HK, D), v.view(-1, HK, D)
        dep = torch.ops.vllm.unified_kv_cache_update(k, v, name)
        return q * 2, k + 1, dep
    return fn


def _run(vllm_parts, impl, backend="auto"):
    from torch._inductor.compile_fx import compile_fx

    rope, fc, name = vllm_parts
    fn = _fn(rope, name)
    p = rope_fusion.RopeFusionPass(backend=backend)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    pos = torch.randint(0, 128, (T,), generator=g)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g)
    slots = torch.tensor([3, -1, 17, 40, 5])
    layer = types.SimpleNamespace(impl=impl, kv_cache=torch.zeros(BLOCKS, HK, BS, 2 * D))
    ctx = fc.ForwardContext(no_compile_layers={LAYER: layer}, attn_metadata=None, slot_mapping={LAYER: slots})
    torch._dynamo.reset()
    with fc.override_forward_context(ctx), torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(fn, fullgraph=True,
                            backend=lambda gm, ex: compile_fx(gm, ex, config_patches={
                                "post_grad_custom_post_pass": p}))(pos, qkv)
        fused_cache = layer.kv_cache.clone()
        layer.kv_cache.zero_()
        ref = fn(pos, qkv)
    return p, out, ref, fused_cache, layer.kv_cache, (pos, qkv, slots)


def test_fold_writes_the_layer_cache(vllm_parts):
    p, out, ref, fused_cache, ref_cache, (pos, qkv, slots) = _run(vllm_parts, StandInFlashImpl())
    (kernel,) = p.report.kernels
    assert kernel.op == "rope_fusion.rotary_qk_into_layer_cache", p.report.table(verbose=True)
    assert kernel.fold.startswith("kv-cache write of") and "folded (5 tokens" in kernel.fold
    for o, r in zip(out[:2], ref[:2]):
        torch.testing.assert_close(o, r)
    torch.testing.assert_close(fused_cache, ref_cache)
    # fp64 reference of the cache rows: k rotated, v as it is; slot -1 untouched
    q, k, v = qkv.double().split([HQ * D, HK * D, HK * D], dim=-1)
    cos, sin = vllm_parts[0].cos_sin_cache.double()[pos].chunk(2, dim=-1)
    k = k.view(T, HK, D)
    k1, k2 = k[..., : D // 2], k[..., D // 2:]
    k_rot = torch.cat((k1 * cos[:, None] - k2 * sin[:, None], k2 * cos[:, None] + k1 * sin[:, None]), -1)
    kc, vc = fused_cache.transpose(1, 2).split(D, dim=-1)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(kc[s // BS, s % BS].double(), k_rot[t], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(vc[s // BS, s % BS].double(), v.view(T, HK, D)[t])
    written = torch.zeros(BLOCKS * BS, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not kc.reshape(-1, HK, D)[~written].any()


def test_unknown_backend_runs_vllms_path(vllm_parts):
    layer_cache_op.FALLBACKS.clear()
    p, out, ref, fused_cache, ref_cache, _ = _run(vllm_parts, UnknownImpl())
    assert "no cache record" in layer_cache_op.FALLBACKS[LAYER]
    for o, r in zip(out[:2], ref[:2]):
        torch.testing.assert_close(o, r)
    torch.testing.assert_close(fused_cache, ref_cache)


def test_token_bound_under_auto():
    from rope_fusion.passes.kv_cache_fold_auto import MAX_TOKENS, decide

    assert decide("auto", MAX_TOKENS)[0] and not decide("auto", MAX_TOKENS + 1)[0]
    fold, why = decide("auto", MAX_TOKENS + 1)
    assert "past the bound" in why
    assert decide("inductor", 10 * MAX_TOKENS)[0]


class StandInFlashFp8Impl(StandInFlashImpl):
    """FlashAttention's FP8 write: reshape_and_cache_flash with kv_cache_dtype "fp8" stores x / scale as e4m3 bytes."""

    kv_cache_dtype = "fp8"

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        kc, vc = kv_cache.view(torch.float8_e4m3fn).transpose(1, 2).split(self.head_size, dim=-1)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                kc[s // BS, s % BS] = (key[t] / layer._k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                vc[s // BS, s % BS] = (value[t] / layer._v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_fp8_cache_within_e4m3_rounding(vllm_parts):
    from torch._inductor.compile_fx import compile_fx

    register_attention_cache(AttentionCache(f"{__name__}.StandInFlashFp8Impl", FLASH_ATTENTION.split))
    rope, fc, name = vllm_parts
    fn = _fn(rope, name)
    p = rope_fusion.RopeFusionPass()
    pos, qkv = torch.randint(0, 128, (T,)), torch.randn(T, (HQ + 2 * HK) * D)
    slots = torch.tensor([3, -1, 17, 40, 5])
    scale = torch.tensor(0.05)
    layer = types.SimpleNamespace(impl=StandInFlashFp8Impl(), kv_cache=torch.zeros(BLOCKS, HK, BS, 2 * D,
                                  dtype=torch.uint8), _k_scale=scale, _v_scale=scale)
    ctx = fc.ForwardContext(no_compile_layers={LAYER: layer}, attn_metadata=None, slot_mapping={LAYER: slots})
    torch._dynamo.reset()
    with fc.override_forward_context(ctx), torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(fn, fullgraph=True, backend=lambda gm, ex: compile_fx(gm, ex, config_patches={
            "post_grad_custom_post_pass": p}))(pos, qkv)
        fused = layer.kv_cache.view(torch.float8_e4m3fn).float()
        layer.kv_cache.zero_()
        fn(pos, qkv)
        ref = layer.kv_cache.view(torch.float8_e4m3fn).float()
    assert p.report.kernels[0].op == "rope_fusion.rotary_qk_into_layer_cache"
    # one e4m3 step (3 mantissa bits) where the unfused path's first rounding crosses a tie
    torch.testing.assert_close(fused, ref, atol=0.0, rtol=2 ** -3)
