"""The Triton kernel's NeoX row with its pass-through tail in the halves' padding (ROW_TAIL), interpreted on the CPU.

A NeoX row that rotates R of D lanes, R/2 not a power of two and the tail no wider than the two halves' padding
(MiniMax-H3's 96 of 128), is loaded whole: the tail's lanes sit in the padding and the tables pass them through.
Each case runs the planner's launch in that form and in the form before it (two padded halves and a tail tile) and
holds both to an fp64 evaluation of the op's reference: per-head norms with a shared and a per-head weight, a norm
across heads, no norm, tails that fill the padding and tails that leave some of it masked (D=96 and D=48: padded
rows, the weight folded into the tables), conjugate and full tables, cache rows picked by positions, GQA, several
head blocks looped over or held, fp64 math.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import rope_fusion.kernels.triton_kernel as tk  # noqa: E402
import rope_fusion.kernels.triton_launch as launching  # noqa: E402
from rope_fusion.kernels.triton_plan import default_row_tail, row_tail_fits  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.ops.schema import RotaryParams  # noqa: E402

T, HQ, HK = 3, 4, 2


class Recorded:
    """The interpreted kernel behind a recorder of each launch's compile-time constants."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.meta: list = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.meta.append(kw)
            return self.kernel[grid](*args, **kw)
        return run


pytestmark = pytest.mark.triton_on_cpu(wrap=Recorded)  # each launch's compile-time constants recorded


@pytest.fixture
def kernel(triton_on_cpu, monkeypatch):
    """The recorded interpreted kernel (tests/conftest.py, which leaves no launch planned by another test)."""
    return triton_on_cpu.rotary


def _check(outs, xs, cos, sin, params, weights, positions, dtype):
    c, s = cos.double(), sin.double()
    for x, w, o in zip(xs, weights, outs):
        want = rotary_reference(x.double(), c, s, positions=positions, interleaved=False,
                                rotary_dim=params.rotary_dim, full_tables=params.full_tables,
                                conjugate=params.conjugate, norm=params.norm, norm_eps=params.norm_eps,
                                norm_weight=None if w is None else w.double(), out_dtype=torch.float64)
        err = (o.double() - want).abs().max().item()
        assert err <= 2 * torch.finfo(dtype).eps * want.abs().max().item() + 1e-6, err


CASES = [  # head_dim, rotary_dim, norm, weight per head, tiles
    (128, 96, "rms", False, {}),  # MiniMax-H3: the tail fills the padding
    (128, 96, "rms", False, dict(nsplit=1, block_h=2)),  # several blocks a program, looped
    (128, 96, "rms", False, dict(nsplit=1, held=True)),  # held rows
    (64, 48, "rms", True, dict(nsplit=1, block_h=1)),  # a weight per head
    (128, 100, "rms", False, {}),  # halves of 50 lanes: the tail of 28 fills 2 x 14 padded lanes
    (96, 80, "rms", False, dict(nsplit=1)),  # padded rows: 16 tail lanes in 2 x 24, the weight folded in the tables
    (48, 40, "rms_across_heads", False, dict(nsplit=1)),
    (64, 48, "none", False, {}),
]


@pytest.mark.parametrize("d,r,norm,per_head,tiles", CASES)
@pytest.mark.parametrize("row_tail", [True, False])
def test_row_tail_against_fp64(kernel, d, r, norm, per_head, tiles, row_tail):
    torch.manual_seed(d + r)
    dtype = torch.bfloat16
    q, k = torch.randn(T, HQ, d).to(dtype), torch.randn(T, HK, d).to(dtype)
    if norm == "none":
        weights = [None, None]
    elif per_head or norm == "rms_across_heads":
        weights = [(torch.rand(h, d) + 0.5).to(dtype) for h in (HQ, HK)]
    else:
        weights = [(torch.rand(d) + 0.5).to(dtype) for _ in range(2)]
    angles = torch.rand(T, 1, r // 2, dtype=torch.float64) * 20
    cos, sin = angles.cos().float(), angles.sin().float()
    params = RotaryParams(interleaved=False, rotary_dim=r, full_tables=False, conjugate=False, out_dtype=dtype,
                          norm=norm, norm_eps=1e-5)
    outs = launching.launch([q, k], cos, sin, params, None, weights, row_tail=row_tail, **tiles)
    assert [m["ROW_TAIL"] for m in kernel.meta] == [row_tail]
    assert kernel.meta[0]["TAIL_PAD"] == (0 if row_tail else triton.next_power_of_2(d - r))
    if tiles.get("held") and row_tail:  # without the form a tail is never held
        assert kernel.meta[0]["HELD"] > 0
    _check(outs, [q, k], cos, sin, params, weights, None, dtype)


@pytest.mark.parametrize("row_tail", [True, False])
def test_row_tail_conjugate_full_tables_and_positions(kernel, row_tail):
    """Full tables (one entry per lane), the inverse rotation, cache rows gathered by positions, fp64 math."""
    torch.manual_seed(7)
    d, r, rows = 128, 96, 11
    q, k = torch.randn(T, HQ, d, dtype=torch.float64), torch.randn(T, HK, d, dtype=torch.float64)
    angles = torch.rand(rows, r // 2, dtype=torch.float64) * 20
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    positions = torch.tensor([[4], [0], [10]])
    weights = [torch.rand(d, dtype=torch.float64) + 0.5 for _ in range(2)]
    params = RotaryParams(interleaved=False, rotary_dim=r, full_tables=True, conjugate=True,
                          out_dtype=torch.float64, norm="rms", norm_eps=1e-6)
    outs = launching.launch([q, k], cos, sin, params, positions, weights, row_tail=row_tail)
    assert kernel.meta[0]["ROW_TAIL"] is row_tail and kernel.meta[0]["MATH_FP64"]
    _check(outs, [q, k], cos, sin, params, weights, positions, torch.float64)


def test_which_rows_take_the_form():
    """The form fits where the tail is no wider than the halves' padding, NeoX rotating from lane 0; the planner
    takes it by default under a per-head norm only."""
    def p(r, **kw):
        return RotaryParams(**{**dict(interleaved=False, rotary_dim=r, full_tables=False, conjugate=False,
                                      out_dtype=torch.bfloat16, norm="rms"), **kw})
    assert row_tail_fits(p(96), 128) and row_tail_fits(p(100), 128) and row_tail_fits(p(80), 96)
    assert not row_tail_fits(p(128), 128)  # no tail
    assert not row_tail_fits(p(64), 128)  # halves of 32 lanes: no padding
    assert not row_tail_fits(p(40), 128)  # a tail of 88 lanes, 2 x 12 padded
    assert not row_tail_fits(p(96, interleaved=True), 128)
    assert not row_tail_fits(p(96, rotary_offset=16), 128)
    assert not row_tail_fits(p(96, rotary_blocks=3), 128)
    assert default_row_tail(p(96), 128)
    assert not default_row_tail(p(96, norm="none"), 128)
    assert not default_row_tail(p(96, norm="rms_across_heads"), 128)


def test_row_tail_loads_and_stores_are_vectors():
    """Compiled for sm_90 (no GPU needed), the form's loads and stores of x are 16-byte vectors, as the remapped
    NeoX row's are: a remap that Triton cannot see as runs of consecutive lanes turns them into 2-byte scalars, 8x
    the memory instructions."""
    import re

    from benchmarks import ptx_identity

    t, table = 64, torch.empty(64, 96)
    params = RotaryParams(interleaved=False, rotary_dim=96, full_tables=False, conjugate=False,
                          out_dtype=torch.bfloat16, norm="rms")
    case = dict(xs=[torch.empty(t, 24, 128, dtype=torch.bfloat16)] * 2, cos=table[:, None, :48],
                sin=table[:, None, 48:], params=params, weights=[torch.empty(128, dtype=torch.bfloat16)] * 2)
    (launch,) = ptx_identity.record_launches({"minimax": case})
    assert launch.kwargs["ROW_TAIL"]
    job, _ = ptx_identity.specialise(tk.rotary_kernel, launch)
    ptx = ptx_identity.compile_ptx(job)
    loads, stores = (re.findall(rf"{op}\.global[\w.:]*", ptx) for op in ("ld", "st"))
    assert not [op for op in loads + stores if op.endswith((".b16", ".u16"))], sorted(set(loads + stores))
    assert stores and all(op.endswith("v4.b32") for op in stores), sorted(set(stores))
    assert sum(op.endswith("v4.b32") for op in loads) >= 4  # x's rows (twice: q, k) and the weight tiles
