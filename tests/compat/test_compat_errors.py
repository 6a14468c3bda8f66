"""A drop-in's errors name its caller's arguments, not the op's (compat/arguments.py): diffusers' `freqs_cis`,
vllm-omni's `hidden_states`, vLLM's `query` and `cos_sin_cache`; once, by the drop-in the caller called, when one
drop-in calls another; and the wrapper costs a compiled drop-in no graph break."""

from __future__ import annotations

import re

import pytest
import torch

from rope_fusion.compat import diffusers, transformers, vllm, vllm_omni
from rope_fusion.compat.arguments import DropInArgumentError
from rope_fusion.ops import rotary_reference


def _words(message: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))


# (name, a call with a table too narrow for the head, the caller's argument, the op's names it must not use)
BAD_CALLS = [
    ("diffusers real", lambda: diffusers.apply_rotary_emb(torch.randn(1, 2, 6, 64), (torch.randn(6, 32),
                                                                                        torch.randn(6, 32))),
     "apply_rotary_emb", "freqs_cis", {"cos", "sin"}),
    ("diffusers complex", lambda: diffusers.apply_rotary_emb(
        torch.randn(1, 6, 2, 64), torch.randn(1, 6, 16, dtype=torch.complex64), use_real=False),
     "apply_rotary_emb", "freqs_cis", {"cos", "sin"}),
    ("vllm-omni wan", lambda: vllm_omni.apply_rotary_emb_wan(torch.randn(1, 6, 2, 64), torch.randn(1, 6, 1, 32),
                                                             torch.randn(1, 6, 1, 32)),
     "apply_rotary_emb_wan", "freqs_cos", {"cos", "sin"}),
    ("vllm-omni helios (calls wan)", lambda: vllm_omni.apply_rotary_emb_helios(torch.randn(1, 6, 2, 64),
                                                                               torch.randn(1, 6, 40)),
     "apply_rotary_emb_helios", "freqs_cis", {"cos", "sin", "freqs_cos", "freqs_sin", "apply_rotary_emb_wan"}),
    ("vllm dtypes", lambda: vllm.mrope_rotary_embedding(torch.arange(6), torch.randn(6, 128),
                                                        torch.randn(6, 64).half(), 64, torch.randn(100, 64), True),
     "mrope_rotary_embedding", "query", {"q", "k"}),
    ("gptj", lambda: transformers.apply_rotary_pos_emb_gptj(torch.randn(1, 6, 2, 64), torch.randn(1, 6, 1, 8),
                                                            torch.randn(1, 6, 1, 1, 8)),
     "apply_rotary_pos_emb_gptj", "tensor", {"x"}),
]


@pytest.mark.parametrize("name,call,function,caller_arg,op_names", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_an_op_error_names_the_callers_argument(name, call, function, caller_arg, op_names):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{function}: ") and caller_arg in _words(message), message
    assert not (_words(message) - {function}) & op_names, message
    assert isinstance(info.value, DropInArgumentError)
    assert _words(info.value.op_message) & op_names, info.value.op_message  # the op said it in its own names


def test_the_in_place_serving_drop_in_names_query_and_key():
    """rotary_embedding checks its own contract (one dtype for both, rotated in place) before the op sees them."""
    with pytest.raises(ValueError, match=r"^rotary_embedding: query is torch.float32 and key torch.float16"):
        vllm.rotary_embedding(torch.arange(6), torch.randn(6, 128), torch.randn(6, 64).half(), 64,
                              torch.randn(100, 64), True)


def test_a_drop_ins_own_error_keeps_its_words():
    with pytest.raises(ValueError, match=r"^apply_rotary_emb: `sequence_dim=3` but should be 1 or 2\.$"):
        diffusers.apply_rotary_emb(torch.randn(1, 2, 6, 64), (torch.randn(6, 64), torch.randn(6, 64)),
                                   sequence_dim=3)


def test_a_compiled_drop_in_has_no_graph_break_and_the_reference_numbers():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 6, 64)
    ang = torch.rand(6, 32, dtype=torch.float64) * 6
    cos, sin = ang.repeat_interleave(2, -1).cos(), ang.repeat_interleave(2, -1).sin()
    torch._dynamo.reset()
    out = torch.compile(diffusers.apply_rotary_emb, fullgraph=True)(x, (cos.float(), sin.float()))
    ref = rotary_reference(x.double(), cos[None, None], sin[None, None], interleaved=True, rotary_dim=64,
                           full_tables=True, conjugate=False, out_dtype=torch.float64)
    assert out.dtype == x.dtype and (out.double() - ref).abs().max().item() < 1e-5
