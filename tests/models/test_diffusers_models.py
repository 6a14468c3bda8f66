"""Unmodified diffusers Wan and Helios transformers, compiled through full Inductor with the pass.

Every q and k RoPE of every layer must fuse, grouped into one rotary_qk per attention, with no RoPE
arithmetic left, and the output must agree with plain torch.compile within the numerics contract.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
diffusers = pytest.importorskip("diffusers")

import rope_fusion  # noqa: E402

HELIOS_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
    text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_dim=(4, 4, 4), has_multi_term_memory_patch=True,
    guidance_cross_attn=True, zero_history_timestep=True, is_amplify_history=False,
)


def _wan():
    from examples.wan_demo import tiny_wan

    return tiny_wan()


def _helios():
    torch.manual_seed(0)
    model = diffusers.HeliosTransformer3DModel(**HELIOS_CONFIG).eval()
    r = torch.randn
    inputs = dict(
        hidden_states=r(1, 4, 2, 16, 16), timestep=torch.tensor([1]), encoder_hidden_states=r(1, 12, 16),
        indices_hidden_states=r(1, 2), indices_latents_history_short=r(1, 1),
        indices_latents_history_mid=r(1, 1), indices_latents_history_long=r(1, 4),
        latents_history_short=r(1, 4, 1, 16, 16), latents_history_mid=r(1, 4, 1, 16, 16),
        latents_history_long=r(1, 4, 4, 16, 16), return_dict=False,
    )
    return model, inputs


class _GraphAfter(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Runs the pass and keeps the rewritten post-grad graphs for inspection."""

    def __init__(self, inner):
        self.inner = inner
        self.graphs = []

    def __call__(self, graph):
        self.inner(graph)
        self.graphs.append(str(graph))

    def uuid(self):
        return None


@pytest.mark.parametrize("build,source_file", [
    (_wan, "transformer_wan.py"),
    # Wan's attention again with Helios's history tokens: 42 s on 2 cores, with -m slow
    pytest.param(_helios, "transformer_helios.py", marks=pytest.mark.slow)])
def test_every_rope_of_every_layer_fuses(build, source_file):
    model, inputs = build()
    for k, v in inputs.items():  # fresh random inputs each run
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            inputs[k] = torch.randn_like(v)
    p = rope_fusion.RopeFusionPass()
    spy = _GraphAfter(p)
    with torch.no_grad():
        torch._dynamo.reset()
        fused = torch.compile(model, options={"post_grad_custom_post_pass": spy})(**inputs)[0]
        torch._dynamo.reset()
        plain = torch.compile(model)(**inputs)[0]
        model64 = model.to(torch.float64)
        ref = model64(**{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                         for k, v in inputs.items()})[0]
        model.to(torch.float32)
    r = p.report
    assert not r.errors
    layers = model.config.num_layers
    assert len(r.sites) == 2 * layers  # q and k of each self-attention
    assert len(r.kernels) == layers and all(k.op == "rope_fusion.rotary_qk" for k in r.kernels)
    assert all(s.style == "interleaved" and s.rotary_dim == 12 for s in r.sites)
    assert all(source_file in s.source for s in r.sites)
    graph = "\n".join(spy.graphs)
    assert "slice_scatter" not in graph and "unbind" not in graph  # no RoPE arithmetic left
    err_fused = ((fused.double() - ref).norm() / ref.norm()).item()
    err_plain = ((plain.double() - ref).norm() / ref.norm()).item()
    assert err_fused <= err_plain + torch.finfo(torch.float32).eps
