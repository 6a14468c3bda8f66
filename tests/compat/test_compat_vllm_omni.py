"""rope_fusion.compat.vllm_omni against references written from vllm-omni's helpers' semantics (vllm-omni is not
installed here), within the numerics contract (docs/design.md section 2); Qwen-Image's real-table branch is
diffusers' function, checked against it where diffusers imports. The Wan helper's hand-written form compiled with
the pass fuses into the op parameters the drop-in passes."""

from __future__ import annotations

import pytest
import torch

from rope_fusion.compat import vllm_omni
from tests.helpers.compat import assert_pass_matches_dropin, dropin_calls
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

B, S, H, D = 2, 8, 4, 64
DTYPES = [torch.float32, torch.bfloat16]


def wan_reference(x, freqs_cos, freqs_sin):
    """Wan 2.2: pairs (2j, 2j + 1), cos read from the even lanes of the full-width table, sin from the odd."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).type_as(x)


def torch_reference(x, cos, sin, interleaved):
    """The shared helper: half tables [S, R/2] (or [B, S, R/2]) repeated per lane, the lanes past R kept."""
    r = 2 * cos.shape[-1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot = x[..., :r]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, -1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return torch.cat((out, x[..., r:]), -1)


def qwen_complex_reference(x, freqs_cis):
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wan(dtype):
    x = torch.randn(B, S, H, D).to(dtype)
    lanes = (torch.rand(1, S, 1, D // 2) * 6).repeat_interleave(2, -1)
    cos, sin = lanes.cos(), lanes.sin()
    check_numerics(wan_reference, (x, cos, sin), vllm_omni.apply_rotary_emb_wan(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_helios_against_diffusers(dtype):
    helios = pytest.importorskip("diffusers.models.transformers.transformer_helios")
    x = torch.randn(B, S, H, D).to(dtype)
    lanes = (torch.rand(B, S, D // 2) * 6).repeat_interleave(2, -1)
    freqs_cis = torch.cat((lanes.cos(), lanes.sin()), -1)  # [B, S, 2D]: cos, then sin
    out = vllm_omni.apply_rotary_emb_helios(x, freqs_cis)
    check_numerics(helios.apply_rotary_emb_transposed, (x, freqs_cis), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("batched_tables", [False, True])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
def test_shared_torch_helper(dtype, interleaved, batched_tables, rotary_dim):
    x = torch.randn(B, S, H, D).to(dtype)
    angles = torch.rand(*((B,) if batched_tables else ()), S, rotary_dim // 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out = vllm_omni.apply_rotary_emb_torch(x, cos, sin, interleaved=interleaved)
    check_numerics(lambda x, c, s: torch_reference(x, c, s, interleaved), (x, cos, sin), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen_image_complex(dtype):
    x = torch.randn(B, S, H, D).to(dtype)
    freqs_cis = torch.polar(torch.ones(S, D // 2), torch.rand(S, D // 2) * 6)
    out = vllm_omni.apply_rotary_emb_qwen(x, freqs_cis, use_real=False)
    check_numerics(qwen_complex_reference, (x, freqs_cis), out)


@pytest.mark.parametrize("unbind", [-1, -2])
def test_qwen_image_real(unbind):
    emb = pytest.importorskip("diffusers.models.embeddings")
    x = torch.randn(B, H, S, D)  # upstream broadcasts the tables as [1, 1, S, D]
    lanes = torch.rand(S, D) * 6
    freqs = (lanes.cos(), lanes.sin())
    out = vllm_omni.apply_rotary_emb_qwen(x, freqs, use_real_unbind_dim=unbind)
    check_numerics(lambda x, c, s: emb.apply_rotary_emb(x, (c, s), use_real_unbind_dim=unbind), (x, *freqs), out)


def test_wan_pass_emits_dropin_params():
    x = torch.randn(B, S, H, D)
    lanes = (torch.rand(1, S, 1, D // 2) * 6).repeat_interleave(2, -1)
    cos, sin = lanes.cos(), lanes.sin()
    out, p = compile_with_pass(wan_reference, x, cos, sin)
    check_numerics(wan_reference, (x, cos, sin), out)
    calls = dropin_calls(vllm_omni.apply_rotary_emb_wan, x, cos, sin)
    assert_pass_matches_dropin(p.report, calls, 1, p.report.table())
