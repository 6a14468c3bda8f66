"""The Triton kernel's held rows with a pass-through tail (HELD with TAIL_PAD), interpreted on the CPU.

The planner holds a token's rows in registers only where no lanes pass through after the rotated ones; the kernel
now holds such a tail beside them (a partial rotation under a norm, MiniMax-H3's 96 of 128 lanes), which
benchmarks/norm_tiles.py times against the head loop before the planner's rule takes it. Launched as that benchmark
launches it, the form is checked here against an fp64 evaluation of the op's reference: both pairings, a per-head
norm and one across heads, a weight shared by the heads and one per head, GQA (the short side's blocks masked),
several head blocks a side.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.norm_tiles import held_tail_launch  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.ops.schema import RotaryParams  # noqa: E402

T, HQ, HK = 3, 4, 2


CASES = [  # head_dim, rotary_dim, interleaved, norm, weight per head, block_h
    (64, 48, False, "rms", False, 2),
    (64, 32, True, "rms", True, 1),
    (80, 64, False, "rms_across_heads", False, 2),
    (48, 16, True, "rms_across_heads", True, 4),
]


@pytest.mark.parametrize("d,r,interleaved,norm,per_head,block_h", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_held_rows_with_a_tail(triton_on_cpu, d, r, interleaved, norm, per_head, block_h, dtype):
    torch.manual_seed(d + r)
    q, k = torch.randn(T, HQ, d).to(dtype), torch.randn(T, HK, d).to(dtype)
    weights = [torch.rand(h, d) + 0.5 if per_head or norm == "rms_across_heads" else torch.rand(d) + 0.5
               for h in (HQ, HK)]
    angles = torch.rand(T, 1, r // 2, dtype=torch.float64) * 20
    cos, sin = angles.cos().float(), angles.sin().float()
    params = RotaryParams(interleaved=interleaved, rotary_dim=r, full_tables=False, conjugate=False, out_dtype=dtype,
                          norm=norm, norm_eps=1e-5)
    out = held_tail_launch(q, k, cos, sin, params, weights, block_h, 1, True)()
    for x, w, o in zip((q, k), weights, out):
        want = rotary_reference(x.double(), cos.double(), sin.double(), interleaved=interleaved, rotary_dim=r,
                                full_tables=False, norm=norm, norm_eps=1e-5, norm_weight=w.double(),
                                out_dtype=torch.float64)
        err = (o.double() - want).abs().max().item()
        assert err <= 2 * torch.finfo(dtype).eps * want.abs().max().item() + 1e-6, err
