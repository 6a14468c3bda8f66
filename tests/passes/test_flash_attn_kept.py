"""flash-attn's own launches stay where a `flash_attn_sites.KEPT_LAUNCHES` record says they measured faster than
the one fused launch that would replace them; elsewhere its launches become sites. No record is kept today (the
merged launch measured faster at every geometry), so the tests register one for whole 128-lane interleaved rows
over 16 tokens or more. The real kernel module of the installed vLLM, traced on the CPU (tests/helpers/kernel_sites.py's
capture backend: Inductor's front half and post-grad passes, the graph the pass sees).
"""

from __future__ import annotations

import pytest
import torch

from rope_fusion.passes.kernel_sites import flash_attn_sites as fas
from tests.helpers.kernel_sites import compile_capture, vllm_rotary_module


@pytest.fixture(scope="module")
def R():
    return vllm_rotary_module()


@pytest.fixture
def small_bound(monkeypatch):
    monkeypatch.setattr(fas, "KEPT_LAUNCHES", (fas.KeptLaunches(128, True, 16, "at 128-lane interleaved rows its two "
                                                                "launches measured faster than the fused launch"),))


def _launches(R, tokens, head_dim, interleaved, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, 2, head_dim, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, tokens, 1, head_dim, generator=g, dtype=torch.bfloat16)
    ang = torch.rand(tokens, head_dim // 2, generator=g) * 6.0
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)

    def f(q, k, cos, sin):
        return (R.apply_rotary(q, cos, sin, interleaved=interleaved) * 1,
                R.apply_rotary(k, cos, sin, interleaved=interleaved) * 1)
    return compile_capture(f, q, k, cos, sin)[1]


def test_flash_attn_keeps_its_launches_at_128_lane_interleaved_rows(R, small_bound):
    cap = _launches(R, 16, 128, True)
    assert cap.sites == [] and len(cap.misses) == 2, cap.misses
    assert all(r.startswith("flash-attn's own launch kept: at 128-lane interleaved rows") for _, r in cap.misses)


def test_no_launch_is_kept_by_default(R):
    cap = _launches(R, 16, 128, True)
    assert [s.kind for s in cap.sites] == ["flash_attn.rotary_kernel"] * 2 and cap.misses == [], cap.misses


@pytest.mark.parametrize("tokens,head_dim,interleaved", [(16, 80, True), (16, 128, False), (8, 128, True)],
                         ids=["D=80", "neox", "fewer tokens"])
def test_other_flash_attn_launches_are_merged(R, small_bound, tokens, head_dim, interleaved):
    cap = _launches(R, tokens, head_dim, interleaved)
    assert [s.kind for s in cap.sites] == ["flash_attn.rotary_kernel"] * 2 and cap.misses == [], cap.misses
