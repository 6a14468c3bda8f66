"""A rotary kernel call and a native spelling of the same rotation on the same tables share one `rotary_qk`.

vllm-omni style blocks may rotate q with flash-attn's Triton kernel (vLLM's copy, traced on the CPU as in
tests/helpers/kernel_sites.py) and k with torch ops on the same cos/sin [S, R/2] tensors (vLLM's
`_apply_rotary_emb_torch`: NeoX halves joined by `cat`, interleaved pairs by `stack(...).flatten(-2)`). They pair
exactly when the native tables are views of the kernel's cos and sin that read, over either x, the rows the
kernel reads (its int offset included); anything else (other tables, another offset, another pairing style,
tensor offsets) stays two launches. Each case compiles the function plainly (the kernel runs interpreted) and with
the pass (tests/helpers/pass_capture.py), compares the two, and the fused result with an fp64 reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from examples.vllm_omni_block import cpu_triton_tracing  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.passes.kernel_sites.flash_attn_sites import FLASH_ATTN  # noqa: E402
from tests.helpers.kernel_sites import (  # noqa: E402
    R,  # noqa: F401  (fixture)
    capture_backend,
    compile_capture,
    fa_inputs,
)
from tests.helpers.pass_capture import LAUNCH, PassCapture, assert_same  # noqa: E402

QK = "rope_fusion.rotary_qk"


def native(x, cos, sin, interleaved: bool = False):
    """vLLM's `_apply_rotary_emb_torch` on half-width tables [S, R/2] (R = 2 * cos.shape[-1]; lanes >= R pass)."""
    r = 2 * cos.shape[-1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xr = x[..., :r]
    if interleaved:
        x1, x2 = xr[..., ::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
    else:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    return torch.cat([out, x[..., r:]], -1)


class OrderCapture(PassCapture):
    """PassCapture that also records, before the pass, which output of the function each node feeds."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        out = next(n for n in graph.nodes if n.op == "output")
        self.feeds: dict = {}  # node name -> indices of the outputs computed from it
        for i, o in enumerate(out.args[0]):
            todo = [o]
            while todo:
                n = todo.pop()
                if i not in self.feeds.setdefault(n.name, set()):
                    self.feeds[n.name].add(i)
                    todo.extend(n.all_input_nodes)
        super().__call__(graph)

    def groups(self) -> list:
        """The sites of each fused launch, each as the index of the function output it computes (Inductor's graph
        order need not be the order of the calls)."""
        rep = self.p.report

        def output(i: int) -> int:
            (j,) = self.feeds[rep.sites[i].node]
            return j
        return sorted(sorted(output(i) for i in k.sites) for k in rep.kernels)


def plain_and_fused(fn, *args):
    """(plain outputs, fused outputs, OrderCapture): fn compiled through the capture backend without and with the
    pass (test_kernel_rewrite.plain_and_fused, with the outputs each node feeds kept)."""
    import torch._functorch.config as fconfig

    plain, _ = compile_capture(fn, *args)
    torch._dynamo.reset()
    cap = OrderCapture()
    with cpu_triton_tracing(), fconfig.patch(enable_autograd_cache=False), torch.no_grad():
        fused = torch.compile(fn, fullgraph=True, dynamic=False, backend=capture_backend(cap))(*args)
    return plain, fused, cap


def reference(x, cos, sin, off: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """fp64 rotation of x [B, S, H, D] by rows [off, off + S) of the half-width tables."""
    s = x.shape[1]
    c, si = (t[off: off + s, None, :].double() for t in (cos, sin))
    return rotary_reference(x.double(), c, si, interleaved=interleaved, rotary_dim=rotary_dim, full_tables=False)


def assert_close_to(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5 * max(ref.abs().max().item(), 1.0))


def assert_clean(cap: OrderCapture) -> None:
    rep = cap.p.report
    assert rep.errors == [] and rep.misses == [], (rep.errors, rep.misses)
    assert LAUNCH in cap.before and LAUNCH not in cap.graph_text  # every kernel launch was replaced


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("kernel_first", [True, False], ids=["kernel-q", "native-q"])
@pytest.mark.parametrize("rd", [64, 32], ids=["full", "partial"])
def test_kernel_and_native_become_one_rotary_qk(R, interleaved, kernel_first, rd):  # noqa: F811
    """q by the kernel and k natively (or the other way round; the group reads the first site's tables), full and
    partial rotary: one `rotary_qk` for both sites, the launch gone."""
    q, k, cos, sin = fa_inputs(torch.float32, rd, seqlen_ro=8)

    def f(q, k, cos, sin):
        if kernel_first:
            return R.apply_rotary(q, cos, sin, interleaved=interleaved), native(k, cos, sin, interleaved)
        return native(q, cos, sin, interleaved), R.apply_rotary(k, cos, sin, interleaved=interleaved)

    plain, fused, cap = plain_and_fused(f, q, k, cos, sin)
    assert_clean(cap)
    rep = cap.p.report
    assert len(rep.sites) == 2 and [(k.op, k.sites) for k in rep.kernels] == [(QK, [0, 1])], rep.table()
    assert sorted(s.origin for s in rep.sites) == sorted([FLASH_ATTN, "arithmetic"])
    assert_same(fused, plain)
    for out, x in zip(fused, (q, k)):
        assert_close_to(out, reference(x, cos, sin, 0, rd, interleaved))


def test_same_offset_pairs(R):  # noqa: F811
    """Kernel offset 3 against native rows `cos[3:3+S]`, and offset 0 against `cos[:S]` of a longer table: the
    same rows, one launch each."""
    q, k, cos, sin = fa_inputs(torch.float32, 32)
    s = q.shape[1]

    def f(q, k, cos, sin):
        return (R.apply_rotary(q, cos, sin, seqlen_offsets=3), native(k, cos[3: 3 + s], sin[3: 3 + s]),
                R.apply_rotary(q * 2, cos, sin), native(k * 2, cos[:s], sin[:s]))

    plain, fused, cap = plain_and_fused(f, q, k, cos, sin)
    assert_clean(cap)
    assert cap.groups() == [[0, 1], [2, 3]], cap.p.report.table()
    assert [k.op for k in cap.p.report.kernels] == [QK, QK]
    assert_same(fused, plain)
    for out, x, off in zip(fused, (q, k, q * 2, k * 2), (3, 3, 0, 0)):
        assert_close_to(out, reference(x, cos, sin, off, 32, False))


NEAR_MISSES = {
    # name: (kernel kwargs, native(k, cos, sin, cos2, sin2, s))
    "other-tables": ({}, lambda k, c, s, c2, s2, n: native(k, c2, s2)),
    "other-offset": ({"seqlen_offsets": 3}, lambda k, c, s, c2, s2, n: native(k, c[:n], s[:n])),
    "offset-vs-shifted-rows": ({}, lambda k, c, s, c2, s2, n: native(k, c[1: 1 + n], s[1: 1 + n])),
    "other-interleaving": ({"interleaved": True}, lambda k, c, s, c2, s2, n: native(k, c, s, False)),
    "tensor-offsets": ({"seqlen_offsets": torch.tensor([0, 0])}, lambda k, c, s, c2, s2, n: native(k, c[:n], s[:n])),
    "other-cos-same-sin": ({}, lambda k, c, s, c2, s2, n: native(k, c2, s)),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_misses_stay_two_launches(R, case):  # noqa: F811
    """Not provably the same numbers: each site keeps its own `rotary` launch. (Tensor offsets: rows by run-time
    values, even when they happen to be 0.)"""
    kw, nat = NEAR_MISSES[case]
    q, k, cos, sin = fa_inputs(torch.float32, 32, seqlen_ro=8)
    cos2, sin2 = fa_inputs(torch.float32, 32, seqlen_ro=8, seed=1)[2:]
    if case in ("other-offset", "offset-vs-shifted-rows"):
        q, k, cos, sin = fa_inputs(torch.float32, 32, seqlen_ro=16)

    def f(q, k, cos, sin, cos2, sin2):
        return R.apply_rotary(q, cos, sin, **kw), nat(k, cos, sin, cos2, sin2, q.shape[1])

    plain, fused, cap = plain_and_fused(f, q, k, cos, sin, cos2, sin2)
    assert_clean(cap)
    rep = cap.p.report
    assert len(rep.sites) == 2 and cap.groups() == [[0], [1]], rep.table()
    assert [k.op for k in rep.kernels] == ["rope_fusion.rotary"] * 2
    assert_same(fused, plain)


def test_four_calls_two_tables(R):  # noqa: F811
    """Image q/k on one table, text q/k on another (same shapes), called q_img, q_txt, k_txt, k_img with q by the
    kernel and k natively: two `rotary_qk`, each on one table (first come first paired would take q_img, k_txt)."""
    q, k, ci, si = fa_inputs(torch.float32, 64, seqlen_ro=8, seed=2)
    qt, kt, ct, st = fa_inputs(torch.float32, 64, seqlen_ro=8, seed=3)

    def f(q, k, qt, kt, ci, si, ct, st):
        return (R.apply_rotary(q, ci, si), R.apply_rotary(qt, ct, st), native(kt, ct, st), native(k, ci, si))

    plain, fused, cap = plain_and_fused(f, q, k, qt, kt, ci, si, ct, st)
    assert_clean(cap)
    assert cap.groups() == [[0, 3], [1, 2]], cap.p.report.table()
    assert [k.op for k in cap.p.report.kernels] == [QK, QK]
    assert_same(fused, plain)
    for out, x, c, s in zip(fused, (q, qt, kt, k), (ci, ct, ct, ci), (si, st, st, si)):
        assert_close_to(out, reference(x, c, s, 0, 64, False))
