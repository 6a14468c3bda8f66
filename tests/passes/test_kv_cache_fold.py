"""The KV-cache fold (passes/folds/kv_cache_fold.py) on a vLLM-style graph: vLLM's real RotaryEmbedding (get_rope) and
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
    from rope_fusion.passes.folds.kv_cache_fold_auto import MAX_TOKENS, decide

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


def _compile_and_check(vllm_parts, counts, dynamic=False, compile_range=None, p=None):
    """Each token count of `counts` through one compiled function (the count marked dynamic where asked, vLLM's
    compile range set around the compile where given) with the pass `p` (`auto` by default): q, k and the cache
    checked against the graph run eagerly, vLLM's own write included. Returns the pass and how many graphs were
    compiled."""
    from torch._inductor.compile_fx import compile_fx

    p = p or rope_fusion.RopeFusionPass()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": p})

    rope, _, name = vllm_parts
    torch._dynamo.reset()
    compiled = torch.compile(_fn(rope, name), fullgraph=True, backend=backend)
    for tokens in counts:
        _check_call(vllm_parts, compiled, tokens, dynamic, compile_range)
    return p, len(compiles)


def _check_call(vllm_parts, compiled, tokens, dynamic, compile_range):
    import contextlib

    rope, fc, name = vllm_parts
    fn = _fn(rope, name)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    blocks = tokens // BS + 2
    pos = torch.randint(0, 128, (tokens,), generator=g)
    qkv = torch.randn(tokens, (HQ + 2 * HK) * D, generator=g)
    slots = torch.randperm(blocks * BS, generator=g)[:tokens]
    slots[::3] = -1  # padding tokens write nothing
    layer = types.SimpleNamespace(impl=StandInFlashImpl(), kv_cache=torch.zeros(blocks, HK, BS, 2 * D))
    ctx = fc.ForwardContext(no_compile_layers={LAYER: layer}, attn_metadata=None, slot_mapping={LAYER: slots})
    if dynamic:
        torch._dynamo.mark_dynamic(pos, 0)
        torch._dynamo.mark_dynamic(qkv, 0)
    if compile_range is not None:
        from vllm.compilation.passes.inductor_pass import pass_context
        from vllm.config.utils import Range

        ranged = pass_context(Range(*compile_range))
    else:
        ranged = contextlib.nullcontext()
    with fc.override_forward_context(ctx), torch._inductor.config.patch(fx_graph_cache=False):
        with ranged:
            out = compiled(pos, qkv)
        fused_cache = layer.kv_cache.clone()
        layer.kv_cache.zero_()
        ref = fn(pos, qkv)
    for o, r in zip(out[:2], ref[:2]):
        torch.testing.assert_close(o, r)
    torch.testing.assert_close(fused_cache, layer.kv_cache)
    assert fused_cache.any()


def test_auto_leaves_the_write_past_the_token_bound(vllm_parts):
    """300 tokens, past vLLM's 256: the rotation fuses, the cache write stays vLLM's, and the fold line says why."""
    p, _ = _compile_and_check(vllm_parts, [300])
    (kernel,) = p.report.kernels
    assert kernel.op != "rope_fusion.rotary_qk_into_layer_cache"
    assert "not folded (300 tokens, past the bound" in kernel.fold, p.report.table(verbose=True)


@pytest.mark.parametrize("compile_range, folded", [(None, False), ((1, 256), True), ((1, 8192), False)],
                         ids=["no_range", "range_within_bound", "range_past_bound"])
def test_symbolic_token_count_folds_by_vllms_compile_range(vllm_parts, compile_range, folded):
    """A token count marked dynamic: folded only where vLLM's compile range lies within the bound; never a guard
    on the count (the same graph serves another count)."""
    p, graphs = _compile_and_check(vllm_parts, [7, 12], dynamic=True, compile_range=compile_range)
    assert graphs == 1
    (kernel,) = p.report.kernels
    assert (kernel.op == "rope_fusion.rotary_qk_into_layer_cache") is folded, p.report.table(verbose=True)
    want = "no compile range known" if compile_range is None else f"compile range [{compile_range[0]}, " \
        f"{compile_range[1]}] tokens"
    assert want in kernel.fold, kernel.fold


def _triton_chosen():
    """`auto` asked for, with a chooser that takes the Triton kernel for every site: what `auto` picks on a GPU
    where the kernel measures fastest, on the CPU's interpreted kernel."""
    from rope_fusion.ops.backends import get_backend
    from rope_fusion.passes.auto.choosers import Choice, Chooser

    triton, inductor = get_backend("triton"), get_backend("inductor")

    def choose(p, spec, facts):
        return Choice(triton, "rule", "the test's chooser", instead=inductor)

    return rope_fusion.RopeFusionPass(chooser=Chooser("triton-always", choose, reads_decisions=False))


@pytest.mark.triton_on_cpu(serves=("eager", "kv_cache"))
@pytest.mark.parametrize("tokens", [5, 300])
def test_triton_chosen_folds_within_the_token_bound(vllm_parts, triton_on_cpu, tokens):
    """Where `auto` takes the Triton kernel, the backend would emit a node of its own (the user-kernel node on a GPU),
    which the epilogue cannot read: a pair whose k feeds the cache update is emitted as the op call where the token
    bound folds it, then folded (the cache written by the interpreted kernel); past the bound the fold line says
    why, and the backend's own emission stands (on CPU tensors the kernel's node is not planned, so the lowering
    takes the site, as `auto` does on a GPU for sizes the node cannot take). No near miss either way."""
    p, _ = _compile_and_check(vllm_parts, [tokens], p=_triton_chosen())
    (kernel,) = p.report.kernels
    assert not p.report.misses, p.report.table(verbose=True)
    if tokens <= 256:
        assert kernel.op == "rope_fusion.rotary_qk_into_layer_cache", p.report.table(verbose=True)
        assert kernel.backend == "triton" and f"folded ({tokens} tokens" in kernel.fold, kernel.fold
    else:
        assert kernel.op == "rope_fusion.rotary_qk", p.report.table(verbose=True)
        assert kernel.fold.startswith("kv-cache write not folded: 300 tokens, past the bound"), kernel.fold


@pytest.mark.slow  # about 39 s on 2 cores (a 300-token launch interpreted): CI's -m slow
@pytest.mark.triton_on_cpu(serves=("eager", "kv_cache"))
def test_triton_backend_asked_for_folds(vllm_parts, triton_on_cpu):
    """The backend asked for by name emits its own op (`rotary_qk_triton`) for the sites it takes; the pair that
    feeds the cache update is folded all the same, at any token count."""
    p, _ = _compile_and_check(vllm_parts, [300], p=rope_fusion.RopeFusionPass(backend="triton"))
    (kernel,) = p.report.kernels
    assert kernel.op == "rope_fusion.rotary_qk_into_layer_cache" and not p.report.misses, p.report.table(verbose=True)
    assert "backend 'triton' asked for" in kernel.fold
