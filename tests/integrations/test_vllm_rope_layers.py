"""vLLM 0.33's own rotary layers, built with `vllm.model_executor.layers.rotary_embedding.get_rope` on the CPU,
compiled with the pass (issue 11, part 4).

Every variant vLLM serves with Inductor: default, linear scaling, dynamic NTK, Llama-3, YaRN, LongRoPE (Phi-3),
DeepSeek YaRN (alone, and as MLA calls it: the rope part at the end of each q head), partial rotary, GPT-J
pairs, MRoPE (Qwen2-VL / Qwen2.5-VL sections over 3 position streams, and the interleaved Qwen3-VL layout).
Each layer's `forward_native` (Phi-3's `forward`: that class has no native/custom split) is compiled through
full Inductor with a fresh `RopeFusionPass`. Checked: q and k are 2 sites in one `rope_fusion.rotary_qk`, with
the layer's pairing and rotary dim, no near miss and no pass error; an independent taint analysis of the
post-grad graph (tests/zoo/harness.py) sees RoPE products before the pass and none after; and the numerics
contract (docs/design.md section 2) against an fp64 evaluation of the same layer (its tables cast to fp64).

vLLM is installed with `pip install --no-deps vllm==0.33.0`; importing its layers needs more of its Python
dependencies (psutil, pyzmq, cbor2, aiohttp, openai, xgrammar, ...). Without them every test here skips and
says which import failed. vLLM is imported lazily by a fixture, never at collection: its import sets
TORCHINDUCTOR_COMPILE_THREADS and patches Inductor for the rest of the process.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import rope_fusion
from tests.helpers.numerics import rel_err
from tests.zoo.harness import Capture, GraphRecord, InOrder, probe_passes

os.environ.setdefault("HF_HUB_OFFLINE", "1")

T, HQ, HK, MAX_POS = 7, 4, 2, 64  # tokens, q heads, kv heads, max_position
TABLES = r"cos_sin_cache"  # the layers' cache buffers (`cos_sin_cache`, Phi-3's `long_short_cos_sin_cache`)
DEEPSEEK = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA_NOPE, MLA_LORA = 64, 32  # MLA: q heads are [nope | rope]; the latent is [kv_lora_rank | k_pe]


@dataclasses.dataclass
class Case:
    head_size: int
    rope: dict = dataclasses.field(default_factory=dict)  # rope_parameters
    neox: bool = True
    inputs: str = "flat"  # flat [T, H*D]; heads [T, H, D] (DeepSeek); mla (mla.py's call); mrope ([3, T] positions)
    dtype: torch.dtype = torch.float32
    dynamic: bool = False  # vLLM's symbolic token count: dim 0 (positions: last dim) marked dynamic


CASES = {
    "default": Case(64),
    "default-bf16": Case(64, dtype=torch.bfloat16),
    "default-dynamic-tokens": Case(64, dynamic=True),
    "linear": Case(64, {"rope_type": "linear", "factor": 2.0}),
    "dynamic-ntk": Case(64, {"rope_type": "dynamic", "factor": 2.0}),
    "llama3": Case(128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 500000.0}),
    "yarn": Case(64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "longrope-phi3-partial": Case(64, {"rope_type": "longrope", "short_factor": [1.0] * 16,
                                       "long_factor": [2.0] * 16, "original_max_position_embeddings": 16,
                                       "partial_rotary_factor": 0.5}),
    "deepseek-yarn": Case(64, DEEPSEEK, neox=False, inputs="heads"),
    "deepseek-yarn-mla": Case(64, DEEPSEEK, neox=False, inputs="mla"),
    "partial": Case(128, {"partial_rotary_factor": 0.25}),
    "gptj": Case(64, neox=False),
    "gptj-partial": Case(64, {"partial_rotary_factor": 0.5}, neox=False),
    "mrope-qwen2-vl": Case(128, {"mrope_section": [16, 24, 24]}, inputs="mrope"),
    "mrope-interleaved": Case(128, {"mrope_section": [24, 20, 20], "mrope_interleaved": True}, inputs="mrope"),
}


@pytest.fixture(scope="module")
def vllm_rope():
    """(get_rope, a VllmConfig to build layers under), or skip with the failing import."""
    try:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
    except Exception as e:  # missing vLLM or its Python deps: ImportError, or what a partial install raises
        pytest.skip(f"vLLM's rotary layers are not importable here: {type(e).__name__}: {e}")
    # CustomOp.__init__ reads the current config; "auto" device detection fails without a vLLM platform
    # build, so the device is given. Phi-3's LongRoPE reads model_config.max_model_len only, and a real
    # ModelConfig needs a Hugging Face model config: a stand-in with max_model_len > 16 (the original
    # max position) selects the long factors, as a long-context deployment does.
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.model_config = types.SimpleNamespace(max_model_len=MAX_POS)
    return get_rope, cfg, set_current_vllm_config


def _forward(layer):
    return layer.forward_native if hasattr(type(layer), "forward_native") else layer.forward


def _function_and_inputs(case: Case, layer):
    """fn(*args, layer=...) calling the layer as vLLM does, and its inputs."""
    g = torch.Generator().manual_seed(0)
    D, dt = case.head_size, case.dtype
    pos_shape = (3, T) if case.inputs == "mrope" else (T,)
    positions = torch.randint(0, MAX_POS, pos_shape, generator=g)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dt)
    if case.inputs == "mla":
        def fn(positions, q, latent, layer=layer):
            # vllm/model_executor/layers/mla.py: q [T, H, nope + rope], k_pe from the latent, rotated in place
            q = q.clone()
            k_pe = latent[..., MLA_LORA:].unsqueeze(1)
            q[..., MLA_NOPE:], k_pe = layer.forward_native(positions, q[..., MLA_NOPE:], k_pe)
            return q, k_pe
        return fn, (positions, r(T, HQ, MLA_NOPE + D), r(T, MLA_LORA + D))

    def fn(positions, q, k, layer=layer):
        return _forward(layer)(positions, q, k)
    if case.inputs == "heads":  # DeepSeek's q_pe [T, H, R] and k_pe [T, 1, R]
        return fn, (positions, r(T, HQ, D), r(T, 1, D))
    return fn, (positions, r(T, HQ * D), r(T, HK * D))


class _GraphText(CustomGraphPass):
    """Keeps the post-grad graph as the pass receives it (for failure messages)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append(str(graph))

    def uuid(self):
        return None


def _compile(fn, args, dynamic: bool):
    """fn compiled through full Inductor with [graph text, probe, pass, probe]: (out, pass, capture, texts)."""
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    p, capture, text = rope_fusion.RopeFusionPass(), Capture(), _GraphText()

    def inductor(gm, example_inputs):
        capture.graphs.append(GraphRecord([n.name for n in gm.graph.nodes if n.op == "placeholder"]))
        passes = InOrder([text] + probe_passes(p, capture, TABLES))
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": passes})

    if dynamic:
        for a in args:
            torch._dynamo.mark_dynamic(a, a.dim() - 1 if a.dtype == torch.int64 else 0)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(fn, fullgraph=True, backend=inductor)(*args)
    return out, p, capture, text.graphs


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_rope_layer_fuses(vllm_rope, name):
    get_rope, cfg, set_current_vllm_config = vllm_rope
    case = CASES[name]
    with set_current_vllm_config(cfg):
        layer = get_rope(case.head_size, max_position=MAX_POS, is_neox_style=case.neox,
                         rope_parameters=case.rope or None, dtype=case.dtype)
    fn, args = _function_and_inputs(case, layer)
    out, p, capture, graphs = _compile(fn, args, case.dynamic)
    rep = p.report
    context = f"{type(layer).__name__}\n{rep.table()}\npost-grad graph before the pass:\n{graphs[0] if graphs else '-'}"

    assert not rep.errors, context
    assert not rep.misses, context
    assert len(rep.sites) == 2 and len(rep.kernels) == 1, context
    (kernel,) = rep.kernels
    assert kernel.op == "rope_fusion.rotary_qk" and sorted(kernel.sites) == [0, 1], context
    assert sorted(s.role for s in rep.sites) == ["k", "q"], context
    for s in rep.sites:  # the layer's pairing and rotary dim, the rest passed through
        assert s.style == ("neox" if case.neox else "interleaved"), context
        assert (s.rotary_dim, s.head_dim) == (layer.rotary_dim, case.head_size), context
    assert capture.products_before, context  # the independent analysis saw the RoPE...
    assert not capture.products_after and not capture.negations_after, context  # ...and none is left
    assert capture.rope_ops == 1, context

    # numerics contract: err(fused) <= err(eager, same dtype) + eps, both against fp64 (layer and inputs)
    eager = fn(*args)
    ref_layer = copy.deepcopy(layer).to(torch.float64)
    ref = fn(*(a.double() if a.is_floating_point() else a for a in args), layer=ref_layer)
    for i, (f, e, r) in enumerate(zip(out, eager, ref)):
        assert f.shape == e.shape and f.dtype == e.dtype, (i, f.shape, e.shape, f.dtype, e.dtype)
        ef, ee, eps = rel_err(f, r), rel_err(e, r), torch.finfo(e.dtype).eps
        assert ef <= ee + eps, f"output {i}: fused rel. error {ef:.3g} > eager {ee:.3g} + eps {eps:.3g}\n{context}"
