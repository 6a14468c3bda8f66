"""rope_fusion.compat against the upstream helpers it replaces (diffusers, transformers, vLLM), on the CPU.

Each drop-in runs on fresh random inputs against the upstream function within the numerics contract
(docs/design.md section 2: its error against an fp64 evaluation of the upstream is at most the upstream's own
plus one eps), over every branch; and the upstream compiled with the pass fuses into sites with the parameters
the drop-in passes to the op.
"""

from __future__ import annotations

import pytest
import torch

from rope_fusion import compat
from tests.helpers.compat import assert_pass_matches_dropin, dropin_calls
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

diffusers_emb = pytest.importorskip("diffusers.models.embeddings")
hf_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402
from transformers.models.glm import modeling_glm as hf_glm  # noqa: E402
from transformers.models.gptj import modeling_gptj as hf_gptj  # noqa: E402

B, H, HK, S, D = 2, 4, 2, 8, 64
DTYPES = [torch.float32, torch.bfloat16]


def _full_tables(*lead, width, dtype=torch.float32):
    f = torch.rand(*lead, width // 2) * 6
    e = torch.cat((f, f), dim=-1)
    return e.cos().to(dtype), e.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unbind", [-1, -2])
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_diffusers_real(dtype, unbind, sequence_dim):
    x = torch.randn(B, H, S, D, dtype=dtype) if sequence_dim == 2 else torch.randn(B, S, H, D, dtype=dtype)
    angles = torch.rand(S, D // 2) * 6
    lanes = angles.repeat_interleave(2, -1) if unbind == -1 else torch.cat((angles, angles), -1)
    freqs = (lanes.cos(), lanes.sin())

    def up(x, cos, sin):
        return diffusers_emb.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=unbind, sequence_dim=sequence_dim)

    out = compat.diffusers.apply_rotary_emb(x, freqs, use_real_unbind_dim=unbind, sequence_dim=sequence_dim)
    check_numerics(up, (x, *freqs), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_diffusers_complex(dtype):
    x = torch.randn(B, S, H, D, dtype=dtype)
    freqs_cis = torch.polar(torch.ones(B, S, D // 2), torch.rand(B, S, D // 2) * 6)

    def up(x, f):
        return diffusers_emb.apply_rotary_emb(x, f, use_real=False)

    check_numerics(up, (x, freqs_cis), compat.diffusers.apply_rotary_emb(x, freqs_cis, use_real=False))


def test_diffusers_bad_arguments():
    x, c = torch.randn(B, H, S, D), torch.ones(S, D)
    with pytest.raises(ValueError, match="sequence_dim"):
        compat.diffusers.apply_rotary_emb(x, (c, c), sequence_dim=3)
    with pytest.raises(ValueError, match="use_real_unbind_dim"):
        compat.diffusers.apply_rotary_emb(x, (c, c), use_real_unbind_dim=0)


@pytest.mark.parametrize("unbind", [-1, -2])
def test_diffusers_pass_emits_dropin_params(unbind):
    x = torch.randn(B, H, S, D)
    lanes = torch.rand(S, D) * 6
    cos, sin = lanes.cos(), lanes.sin()

    def up(x, cos, sin):
        return diffusers_emb.apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=unbind)

    out, p = compile_with_pass(up, x, cos, sin)
    calls = dropin_calls(lambda x, c, s: compat.diffusers.apply_rotary_emb(x, (c, s), use_real_unbind_dim=unbind),
                         x, cos, sin)
    assert_pass_matches_dropin(p.report, calls, 1, p.report.table())


HF_CASES = {
    "llama": (hf_llama.apply_rotary_pos_emb, compat.transformers.apply_rotary_pos_emb, D),
    "glm-partial-interleaved": (hf_glm.apply_rotary_pos_emb, compat.transformers.apply_rotary_pos_emb_glm, D // 2),
    "deepseek-interleave": (hf_deepseek.apply_rotary_pos_emb_interleave,
                            compat.transformers.apply_rotary_pos_emb_interleave, D),
}


def _phi_partial(q, k, cos, sin, unsqueeze_dim=1):
    """Phi / StableLM: the Llama helper on the first rotary_dim lanes, the rest concatenated back."""
    r = cos.shape[-1]
    q_rot, k_rot = hf_llama.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=unsqueeze_dim)
    return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)


HF_CASES["phi-partial"] = (_phi_partial, compat.transformers.apply_rotary_pos_emb, D // 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("name", list(HF_CASES))
def test_transformers(name, unsqueeze_dim, dtype):
    up, mine, width = HF_CASES[name]
    if unsqueeze_dim == 1:
        q, k = torch.randn(B, H, S, D, dtype=dtype), torch.randn(B, HK, S, D, dtype=dtype)
    else:
        q, k = torch.randn(B, S, H, D, dtype=dtype), torch.randn(B, S, HK, D, dtype=dtype)
    cos, sin = _full_tables(B, S, width=width, dtype=dtype)
    out = mine(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    check_numerics(lambda q, k, c, s: up(q, k, c, s, unsqueeze_dim=unsqueeze_dim), (q, k, cos, sin), out)


def test_transformers_old_position_ids_signature():
    q, k = torch.randn(B, H, S, D), torch.randn(B, HK, S, D)
    cos, sin = _full_tables(B, S, width=D)
    out = compat.transformers.apply_rotary_pos_emb(q, k, cos, sin, torch.arange(S)[None], 1)
    check_numerics(hf_llama.apply_rotary_pos_emb, (q, k, cos, sin), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transformers_gptj(dtype):
    x = torch.randn(B, S, H, D // 2, dtype=dtype)
    angles = torch.rand(B, S, D // 4) * 6
    sin, cos = angles.sin().to(dtype), angles.cos().to(dtype)
    out = compat.transformers.apply_rotary_pos_emb_gptj(x, sin, cos)
    check_numerics(hf_gptj.apply_rotary_pos_emb, (x, sin, cos), out)


@pytest.mark.parametrize("name", ["llama", "phi-partial"])
def test_transformers_pass_emits_dropin_params(name):
    up, mine, width = HF_CASES[name]
    q, k = torch.randn(B, H, S, D), torch.randn(B, HK, S, D)
    cos, sin = _full_tables(B, S, width=width)
    out, p = compile_with_pass(up, q, k, cos, sin)
    check_numerics(up, (q, k, cos, sin), out)
    calls = dropin_calls(lambda q, k, c, s: mine(q, k, c, s), q, k, cos, sin)
    assert_pass_matches_dropin(p.report, calls, 2, p.report.table())
