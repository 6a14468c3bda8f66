"""rope_fusion.compat.vllm against vLLM 0.33's own rotary layers (`get_rope(...).forward_native`) on the CPU.

`rotary_embedding` rotates query and key in place as vLLM's `_C.rotary_embedding` does; it is checked against the
layer's `forward_native` on the same cache, within the numerics contract (docs/design.md section 2), for NeoX and
GPT-J pairs, full and partial rotary, flat [T, H * D] and [T, H, D] inputs, and key None; through the Triton
kernel's in-place form (interpreted) as one launch writing query's and key's own memory, with fp32 and bf16
caches; vLLM 0.33's `rope_dim_offset` and `inverse` against an fp64 reference. MRoPE
(`mrope_rotary_embedding`) against `MRotaryEmbedding.forward_native`, chunked (Qwen2-VL) and interleaved
(Qwen3-VL) sections and 1-D text positions. vLLM's layers import lazily; without them the tests skip.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from rope_fusion.compat import vllm as compat_vllm
from rope_fusion.ops.reference import rotary_reference
from tests.helpers.compat import assert_pass_matches_dropin, dropin_calls, kernel_on_cpu  # noqa: F401  (a fixture)
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics, rel_err

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T, HQ, HK, MAX_POS = 7, 4, 2, 64


@pytest.fixture(scope="module")
def make_layer():
    try:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
    except Exception as e:  # missing vLLM or its Python deps
        pytest.skip(f"vLLM's rotary layers are not importable here: {type(e).__name__}: {e}")
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.model_config = types.SimpleNamespace(max_model_len=MAX_POS)

    def make(head_size, neox=True, rope=None, dtype=torch.float32):
        with set_current_vllm_config(cfg):
            return get_rope(head_size, max_position=MAX_POS, is_neox_style=neox, rope_parameters=rope, dtype=dtype)
    return make


def _cache(layer, query):
    return layer._match_cos_sin_cache_dtype(query)


def _in_place(positions, q, k, layer):
    """The drop-in as vLLM calls its _C op: on clones, rotated in place, returned."""
    q, k = q.clone(), None if k is None else k.clone()
    ret = compat_vllm.rotary_embedding(positions, q, k, layer.head_size, _cache(layer, q), layer.is_neox_style)
    assert ret is None
    return q, k


@pytest.mark.parametrize("layout", ["flat", "heads", "key-none"])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding(make_layer, layout, neox, partial, dtype):
    D = 64
    layer = make_layer(D, neox, {"partial_rotary_factor": partial} if partial != 1.0 else None, dtype)
    positions = torch.randint(0, MAX_POS, (T,))
    shape = (lambda h: (T, h, D)) if layout == "heads" else (lambda h: (T, h * D))
    q, k = torch.randn(shape(HQ)).to(dtype), torch.randn(shape(HK)).to(dtype)
    if layout == "key-none":
        out = _in_place(positions, q, None, layer)
        assert out[1] is None
        check_numerics(lambda p, q: layer.forward_native(p, q, None)[0], (positions, q), out[0])
        return
    out = _in_place(positions, q, k, layer)
    check_numerics(lambda p, q, k: layer.forward_native(p, q, k), (positions, q, k), out)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["flat", "heads", "key-none"])
@pytest.mark.parametrize("neox,partial", [(True, 1.0), (False, 0.5), (True, 0.75)])
def test_rotary_embedding_in_place_one_launch(kernel_on_cpu, make_layer, neox, partial, layout,  # noqa: F811
                                              cache_dtype):
    """The kernel's in-place form: one launch for query and key (GQA), reading and writing their own memory, the
    cache in fp32 (FlashInfer's) or in the activations' bf16; fresh tensors of the same geometry replay the plan."""
    D = 64
    layer = make_layer(D, neox, {"partial_rotary_factor": partial} if partial != 1.0 else None)
    cache = layer.cos_sin_cache.to(cache_dtype)
    shape = (lambda h: (T, h, D)) if layout == "heads" else (lambda h: (T, h * D))
    for call in range(2):
        positions = torch.randint(0, MAX_POS, (T,))
        q, k = torch.randn(shape(HQ)).to(torch.bfloat16), torch.randn(shape(HK)).to(torch.bfloat16)
        key = None if layout == "key-none" else k.clone()
        query = q.clone()
        compat_vllm.rotary_embedding(positions, query, key, D, cache, neox)
        assert kernel_on_cpu.count == call + 1
        # read from and written into q's own memory: no copy before the kernel, none after it
        assert kernel_on_cpu.reads[-1][0].data_ptr() == kernel_on_cpu.writes[-1][0].data_ptr() == query.data_ptr()
        layer.cos_sin_cache = cache
        if key is None:
            check_numerics(lambda p, q: layer.forward_native(p, q, None)[0], (positions, q), query)
        else:
            check_numerics(lambda p, q, k: layer.forward_native(p, q, k), (positions, q, k), (query, key))


@pytest.mark.parametrize("offset,inverse", [(16, False), (0, True), (32, True)])
def test_rotary_embedding_offset_and_inverse(kernel_on_cpu, offset, inverse):  # noqa: F811
    """vLLM 0.33's `rope_dim_offset` (DeepSeek's rope lanes after its nope lanes) and `inverse` (minus the angle):
    the lanes [offset, offset + rot_dim) rotate, the others keep their values."""
    torch.manual_seed(offset)
    D, R = 64, 32
    angles = torch.rand(MAX_POS, R // 2, dtype=torch.float64) * 20
    cache = torch.cat((angles.cos(), angles.sin()), -1).float()
    positions = torch.randint(0, MAX_POS, (T,))
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    query, key = q.clone(), k.clone()
    compat_vllm.rotary_embedding(positions, query, key, D, cache, True, rope_dim_offset=offset, inverse=inverse)
    assert kernel_on_cpu.count == 1
    c, s = cache.double()[positions][:, None].chunk(2, -1)
    for x, out in ((q, query), (k, key)):
        want = rotary_reference(x.double(), c, s, interleaved=False, rotary_dim=R, full_tables=False,
                                conjugate=inverse, rotary_offset=offset, out_dtype=torch.float64)
        assert rel_err(out, want) < 1e-6
    with pytest.raises(ValueError, match="rope_dim_offset=40"):
        compat_vllm.rotary_embedding(positions, query, key, D, cache, True, rope_dim_offset=40)


@pytest.mark.parametrize("offset,rot,norm", [(0, 32, "none"), (16, 32, "none"), (0, 64, "none"), (0, 32, "rms")])
def test_in_place_launches_leave_the_other_lanes_alone(kernel_on_cpu, offset, rot, norm):  # noqa: F811
    """Planned in place without a norm, the kernel neither reads nor writes the lanes outside the rotation (a tail,
    DeepSeek's nope lanes before it): no pass-through tile. With a norm it rescales them, so it moves them; into
    other outputs it writes them. Each against fp64, the other lanes exactly x's."""
    from rope_fusion.kernels import triton_slice
    from rope_fusion.ops.schema import RotaryCall, RotaryParams

    torch.manual_seed(offset + rot)
    D = 64
    angles = torch.rand(MAX_POS, rot // 2, dtype=torch.float64) * 20
    cos, sin = angles.cos().float(), angles.sin().float()
    positions = torch.randint(0, MAX_POS, (T, 1))
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    weights = [torch.rand(D) + 0.5, torch.rand(D) + 0.5] if norm == "rms" else None
    params = RotaryParams(interleaved=False, rotary_dim=rot, full_tables=False, conjugate=False,
                          out_dtype=torch.float32, rotary_offset=offset, norm=norm)
    query, key = q.clone(), k.clone()
    call = RotaryCall([query, key], cos, sin, params, positions, weights)
    runner = triton_slice.plan_in_place(call)
    moved = norm != "none" and (offset > 0 or offset + rot < D)  # lanes outside the rotation, rescaled
    assert [e[3]["TAIL_PAD"] > 0 for e in runner.entries] == [moved]
    runner([query, key], cos, sin, positions, weights)
    outs = [torch.empty_like(q), torch.empty_like(k)]
    into = triton_slice.plan_in_place(RotaryCall([q, k], cos, sin, params, positions, weights), outs)
    assert [e[3]["TAIL_PAD"] > 0 for e in into.entries] == [offset > 0 or offset + rot < D]
    into([q, k], cos, sin, positions, weights, outs)
    with pytest.raises(ValueError, match="in place"):
        runner([q, k], cos, sin, positions, weights, outs)
    c, s = cos.double()[positions], sin.double()[positions]
    for x, got, other in ((q, query, outs[0]), (k, key, outs[1])):
        w = None if weights is None else weights[0 if x is q else 1].double()
        want = rotary_reference(x.double(), c, s, interleaved=False, rotary_dim=rot, full_tables=False,
                                rotary_offset=offset, norm=norm, norm_weight=w, out_dtype=torch.float64)
        assert rel_err(got, want) < 1e-6 and rel_err(other, want) < 1e-6
        if norm == "none":
            lanes = [i for i in range(D) if not offset <= i < offset + rot]
            assert torch.equal(got[..., lanes], x[..., lanes])


def test_rotary_embedding_bad_cache(make_layer):
    q = torch.randn(T, HQ * 32)
    with pytest.raises(ValueError, match="rot_dim <= head_size"):
        compat_vllm.rotary_embedding(torch.zeros(T, dtype=torch.long), q, None, 32, torch.randn(MAX_POS, 64), True)


@pytest.mark.parametrize("section,interleaved", [([16, 24, 24], False), ([24, 20, 20], True)])
@pytest.mark.parametrize("text_only", [False, True])
def test_mrope(make_layer, section, interleaved, text_only):
    D = 128
    layer = make_layer(D, True, {"mrope_section": section, "mrope_interleaved": interleaved})
    positions = torch.randint(0, MAX_POS, (T,) if text_only else (3, T))
    q, k = torch.randn(T, HQ * D), torch.randn(T, HK * D)

    def mine(p, q, k):
        return compat_vllm.mrope_rotary_embedding(p, q, k, D, layer.cos_sin_cache, True, section, interleaved)

    check_numerics(lambda p, q, k: layer.forward_native(p, q, k), (positions, q, k), mine(positions, q, k))


@pytest.mark.parametrize("neox,partial", [(True, 1.0), (False, 0.5)])
def test_pass_emits_dropin_params(make_layer, neox, partial):
    D = 64
    layer = make_layer(D, neox, {"partial_rotary_factor": partial} if partial != 1.0 else None)
    positions = torch.randint(0, MAX_POS, (T,))
    q, k = torch.randn(T, HQ * D), torch.randn(T, HK * D)
    fn = lambda p, q, k: layer.forward_native(p, q, k)  # noqa: E731
    out, p = compile_with_pass(fn, positions, q, k)
    check_numerics(fn, (positions, q, k), out)
    calls = dropin_calls(lambda p, q, k: _in_place(p, q, k, layer), positions, q, k)
    assert_pass_matches_dropin(p.report, calls, 2, p.report.table())
