"""Rotary kernels already in the graph (passes/kernel_sites/kernel_scan.py) become one `rotary_qk` per q/k pair.

The graphs are the real ones of tests/helpers/kernel_sites.py (its module docstring says how: vLLM's flash-attn
Triton kernel traced on the CPU by `cpu_triton_tracing`, a capture backend that runs the post-grad passes and then
the graph with an fx Interpreter that launches Triton kernels interpreted; stand-ins with vLLM's schemas for its CUDA
ops, tests/helpers/vllm_ops.py). Here the post-grad custom pass is `RopeFusionPass` followed by that capture
(tests/helpers/pass_capture.py), so the compiled function runs the graph the pass left. Each case compiles the same
function twice, plainly (the kernels run, interpreted) and with the pass, and compares outputs and in-place updated
inputs: fp32 results agree to an ulp, bf16 ones to one rounding (Triton's interpreter rounds fp32 -> bf16 toward
zero, torch to nearest).
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

import rope_fusion  # noqa: E402
from examples.vllm_omni_block import cpu_triton_tracing  # noqa: E402
from rope_fusion.passes.kernel_sites.flash_attn_sites import FLASH_ATTN  # noqa: E402
from tests.helpers.kernel_sites import (  # noqa: E402
    FA_CASES,
    R,  # noqa: F401  (fixture)
    fa_inputs,
    interpreted,
    ulps_close,
)
from tests.helpers.pass_capture import (  # noqa: E402
    LAUNCH,
    PassCapture,
    assert_same,
    fused_call,
    plain_and_fused,
)
from tests.helpers.vllm_ops import (  # noqa: E402
    C_CASES,
    c_case_inputs,
    flashinfer_case,
    vllm_ops,  # noqa: F401  (fixture)
)


def assert_one_pair(cap: PassCapture, origin: str) -> None:
    rep = cap.p.report
    assert rep.errors == [] and rep.misses == [], (rep.errors, rep.misses)
    assert len(rep.sites) == 2 and len(rep.kernels) == 1, rep.table()
    assert rep.kernels[0].op == "rope_fusion.rotary_qk" and rep.kernels[0].sites == [0, 1]
    assert [s.origin for s in rep.sites] == [origin, origin]
    assert cap.sites == [] and cap.misses == []  # nothing of the kind is left in the graph the function runs


def assert_copies_read_fused(cap: PassCapture, n: int) -> None:
    """n in-place write-backs `copy_(input, value)`, each value the fused op's result (through getitem/reshape)."""
    fused = fused_call(cap)
    copies = [c for c in cap.gm.graph.nodes if c.target is torch.ops.aten.copy_.default]
    assert len(copies) == n
    for c in copies:
        v = c.args[1]
        while v is not fused and v.op == "call_function" and v.args and isinstance(v.args[0], torch.fx.Node):
            v = v.args[0]
        assert v is fused, c.format_node()


# ---------------------------------------------------------------------------------------------------------
# flash-attn's rotary_kernel, q and k by two launches


@pytest.mark.parametrize("case", list(FA_CASES))
def test_flash_attn_pair_becomes_one_rotary_qk(R, case):  # noqa: F811
    """NeoX and interleaved, full and partial rotary, int and tensor offsets (batch 1's offset 14 reaches past the
    16-row table: rows >= 16 rotate by the identity), conjugate, k rotated in place into a graph input."""
    dtype, rd, inter, conj, offs, inplace = FA_CASES[case]
    q, k, cos, sin = fa_inputs(dtype, rd)
    off = torch.tensor([2, 14], dtype=torch.int32) if offs == "tensor" else offs

    def f(q, k, cos, sin, off):
        kw = dict(seqlen_offsets=off, interleaved=inter, conjugate=conj)
        return R.apply_rotary(q, cos, sin, **kw) * 1, R.apply_rotary(k, cos, sin, inplace=inplace, **kw) * 1

    plain, pargs, fused, fargs, cap = plain_and_fused(f, q, k, cos, sin, off)
    assert_one_pair(cap, FLASH_ATTN)
    assert cap.before.count(LAUNCH) == 2 and LAUNCH not in cap.graph_text
    # the report points at the model line that called the library, not at the launch inside the kernel module
    assert all(s.source.startswith(__file__) for s in cap.p.report.sites), cap.p.report.table()
    node = fused_call(cap)
    assert node.kwargs["interleaved"] is inter and node.kwargs["rotary_dim"] == rd and node.kwargs["conjugate"] is conj
    has_positions = len(node.args) > 4 and node.args[4] is not None
    assert has_positions is (offs == "tensor")
    assert_same(fused, plain)
    assert_same(fargs, pargs)  # k written back in place: copy_(k, fused k)
    assert_copies_read_fused(cap, 1 if inplace else 0)
    if inplace:
        assert not torch.equal(fargs[1], k)


def test_fallback_without_ttir_analysis(R):  # noqa: F811
    """torch assumed every input mutated: getitem(launch, "X"/"COS"/"SIN") feed the next launch and are copied back
    into the graph inputs. They equal the inputs (the kernel stores only through OUT): nothing re-runs the kernel."""
    q, k, cos, sin = fa_inputs(torch.float32, 32)

    def f(q, k, cos, sin):
        return R.apply_rotary(q, cos, sin, seqlen_offsets=3), R.apply_rotary(k, cos, sin, seqlen_offsets=3)

    plain, pargs, fused, fargs, cap = plain_and_fused(f, q, k, cos, sin, ttir=False)
    assert "tensors_to_clone: [OUT, X, COS, SIN]" in cap.before
    assert_one_pair(cap, FLASH_ATTN)
    assert LAUNCH not in cap.graph_text
    copies = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert copies and all(n.args[0] is n.args[1] for n in copies)  # copy_(input, input): Inductor drops it
    assert_same(fused, plain)
    assert_same(fargs, pargs)


def test_vllm_apply_rotary_emb_forward_cuda(R):  # noqa: F811
    """vLLM's ApplyRotaryEmb.forward_cuda: [S, H, D] unsqueezed, fp32 compute, cast back. The op reads bf16 x (the
    upcast is exact) and rounds once to fp32; the cast back stays."""
    q, k = (t[0] for t in fa_inputs(torch.bfloat16, 64, b=1)[:2])
    cos, sin = (t[:8] for t in fa_inputs(torch.float32, 64)[2:])

    def forward_cuda(x, cos, sin):
        out = R.apply_rotary(x.unsqueeze(0).float(), cos.float(), sin.float(), interleaved=True)
        return out.squeeze(0).to(x.dtype)

    def f(q, k, cos, sin):
        return forward_cuda(q, cos, sin), forward_cuda(k, cos, sin)

    plain, _, fused, _, cap = plain_and_fused(f, q, k, cos, sin)
    assert_one_pair(cap, FLASH_ATTN)
    assert fused_call(cap).args[0].meta["val"].dtype == torch.bfloat16
    assert_same(fused, plain)


def test_dynamic_token_count(R):  # noqa: F811
    """Symbolic sequence length and table rows (vLLM marks the token count dynamic); q and k are head slices of one
    projection, strided views with one sequence-length symbol. Int offset 3 slices the tables by a symbolic end; the
    tensor offset 20 reaches past the 24 rows."""
    q, k, cos, sin = fa_inputs(torch.float32, 32, s=16, seqlen_ro=24)
    qk = torch.cat([q, k], dim=2)
    off = torch.tensor([0, 20], dtype=torch.int64)

    def f(qk, cos, sin, off):
        q, k = qk[:, :, :4], qk[:, :, 4:]
        return (R.apply_rotary(q, cos, sin, seqlen_offsets=off, interleaved=True),
                R.apply_rotary(k, cos, sin, seqlen_offsets=off, interleaved=True),
                R.apply_rotary(q, cos, sin, seqlen_offsets=3), R.apply_rotary(k, cos, sin, seqlen_offsets=3))

    plain, _, fused, _, cap = plain_and_fused(f, qk, cos, sin, off, dynamic_dims={0: 1, 1: 0, 2: 0})
    assert cap.pairs() == [[0, 1], [2, 3]], cap.p.report.table()
    assert "sym_size" in cap.graph_text and LAUNCH not in cap.graph_text
    assert_same(fused, plain)


def test_rewritten_graph_compiles_with_inductor(R):  # noqa: F811
    """Real Inductor on the CPU: it cannot generate code for a user Triton kernel on the CPU, so the compile only
    succeeds because no launch is left; the op's lowering (per-batch offsets past the table, a symbolic sequence
    length) matches the kernel run eagerly (interpreted) to one bf16 rounding, on two sequence lengths."""
    q, k, cos, sin = fa_inputs(torch.bfloat16, 48, s=16, seqlen_ro=24)
    qk, off = torch.cat([q, k], dim=2), torch.tensor([4, 19], dtype=torch.int32)

    def f(qk, cos, sin, off):
        q, k = qk[:, :, :4], qk[:, :, 4:]
        return (R.apply_rotary(q, cos, sin, seqlen_offsets=off, interleaved=True),
                R.apply_rotary(k, cos, sin, seqlen_offsets=off, interleaved=True))

    p = rope_fusion.RopeFusionPass()
    torch._dynamo.reset()
    with cpu_triton_tracing(), torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        compiled = torch.compile(f, options={"post_grad_custom_post_pass": p})
        for s in (16, 12):
            args = (qk[:, :s].clone(), cos, sin, off)
            torch._dynamo.mark_dynamic(args[0], 1)
            out = compiled(*args)
            with interpreted(R):
                expected = f(*args)
            assert_same(out, expected)
    assert p.report.graphs == 1 and len(p.report.sites) == 2, p.report.table()
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qk"]


def test_varlen_is_the_packed_op(R):  # noqa: F811
    """A varlen launch becomes the op's packed form: cu_seqlens goes to the op, which derives the rows
    (tests/ops/test_packed_sequences.py covers offsets, pairs and numerics)."""
    from rope_fusion.ops.schema import RotaryCall

    x = torch.randn(12, 4, 64)
    cos, sin = (torch.rand(16, 16) * 3).cos(), (torch.rand(16, 16) * 3).sin()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def f(x, cos, sin, cu):
        return (R.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=7),)

    plain, _, fused, _, cap = plain_and_fused(f, x, cos, sin, cu)
    rep = cap.p.report
    assert rep.errors == [] and rep.misses == [] and len(rep.sites) == 1 and len(rep.kernels) == 1, rep.table()
    assert cap.sites == [] and cap.misses == []
    node = fused_call(cap)
    call = RotaryCall.parse(node.args, node.kwargs, 1)
    assert call.cu_seqlens is not None and call.cu_seqlens.op == "placeholder" and call.positions is None
    ulps_close(fused[0], plain[0])


def test_different_tables_do_not_pair(R):  # noqa: F811
    """Two attentions (tables a and b) called as q_a, q_b, k_a, k_b, and q_a again at another offset: pairs follow
    the tables, not the order; the odd one out is a single `rotary`."""
    q, k, ca, sa = fa_inputs(torch.float32, 32, seed=1)
    cb, sb = fa_inputs(torch.float32, 32, seed=2)[2:]

    def f(q, k, ca, sa, cb, sb):
        return (R.apply_rotary(q, ca, sa), R.apply_rotary(q, cb, sb), R.apply_rotary(k, ca, sa),
                R.apply_rotary(k, cb, sb), R.apply_rotary(q, ca, sa, seqlen_offsets=2))

    plain, _, fused, _, cap = plain_and_fused(f, q, k, ca, sa, cb, sb)
    assert cap.pairs() == [[0, 2], [1, 3], [4]], cap.p.report.table()
    assert sorted(k.op for k in cap.p.report.kernels) == ["rope_fusion.rotary"] + ["rope_fusion.rotary_qk"] * 2
    assert LAUNCH not in cap.graph_text
    assert_same(fused, plain)


# ---------------------------------------------------------------------------------------------------------
# vLLM's in-place ops (stand-ins with the real schemas)



@pytest.mark.parametrize("case", list(C_CASES))
def test_vllm_c_rotary_embedding(vllm_ops, case):  # noqa: F811
    c_op, _ = vllm_ops
    v2, qs, ks, dtype, rd, is_neox, inverse = C_CASES[case]
    pos, q, k, cache = c_case_inputs(case)

    def f(pos, q, k, cache):
        c_op(pos, q, k, 64, cache, is_neox, 0, inverse)
        return (q * 2, k * 2) if k is not None else (q * 2,)

    plain, pargs, fused, fargs, cap = plain_and_fused(f, pos, q, k, cache, v2=v2)
    rep = cap.p.report
    assert rep.errors == [] and rep.misses == [] and cap.sites == []
    assert [s.origin for s in rep.sites] == ["vllm._C.rotary_embedding"] * (2 if ks else 1)
    assert [k.op for k in rep.kernels] == ["rope_fusion.rotary_qk" if ks else "rope_fusion.rotary"]
    assert "auto_functionalized" in cap.before and "auto_functionalized" not in cap.graph_text
    node = fused_call(cap)
    positions = node.args[4 if ks else 3]
    assert positions.meta["val"].shape == (7, 1)
    assert_same(fused, plain)
    assert_copies_read_fused(cap, 2 if ks else 1)
    assert_same(fargs, pargs)  # query and key updated in place: copy_(input, fused result)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_vllm_c_rope_dim_offset(vllm_ops, is_neox):  # noqa: F811
    """DeepSeek-V4's call: the rope part is the last 32 lanes of each 64-lane head (`rope_dim_offset=32`). The op
    takes it as its rotary_offset: q and k in one rotary_qk, the other lanes copied, the same numbers."""
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(6)
    pos, cache = torch.randint(0, 32, (7,), generator=g), torch.randn(32, 32, generator=g)
    q, k = torch.randn(7, 4 * 64, generator=g), torch.randn(7, 2, 64, generator=g)

    def f(pos, q, k, cache):
        c_op(pos, q, k, 64, cache, is_neox, 32)
        return q * 2, k * 2

    plain, pargs, fused, fargs, cap = plain_and_fused(f, pos, q, k, cache, v2=False)
    rep = cap.p.report
    assert rep.errors == [] and rep.misses == [] and cap.sites == []
    assert [(s.origin, s.rotary_offset, s.rotary_dim) for s in rep.sites] == [("vllm._C.rotary_embedding", 32, 32)] * 2
    assert [k.op for k in rep.kernels] == ["rope_fusion.rotary_qk"]
    assert fused_call(cap).kwargs["rotary_offset"] == 32
    assert_same(fused, plain)
    assert_same(fargs, pargs)
    assert not torch.equal(fused[0][:, 32:64], 2 * q[:, 32:64])  # the rotated lanes did change


def test_vllm_c_batched_positions_and_dynamic_tokens(vllm_ops):  # noqa: F811
    """[B, S] positions with [B, S, H*D] / [B, S, H, D] x; then a token count that is symbolic (positions and x
    may carry different symbols: the op checks them)."""
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(32, 64, generator=g)

    def f(pos, q, k, cache):
        c_op(pos, q, k, 64, cache, True)
        return q + 0, k + 0

    args = (torch.randint(0, 32, (2, 3), generator=g), torch.randn(2, 3, 4 * 64, generator=g),
            torch.randn(2, 3, 2, 64, generator=g), cache)
    plain, _, fused, _, cap = plain_and_fused(f, *args, v2=False)
    assert_one_pair(cap, "vllm._C.rotary_embedding")
    assert fused_call(cap).args[4].meta["val"].shape == (2, 3, 1)
    assert_same(fused, plain)

    args = (torch.randint(0, 32, (7,), generator=g), torch.randn(7, 4 * 64, generator=g),
            torch.randn(7, 2, 64, generator=g), cache)
    plain, _, fused, _, cap = plain_and_fused(f, *args, v2=False, dynamic_dims={0: 0, 1: 0, 2: 0})
    assert not isinstance(fused_call(cap).args[0].meta["val"].shape[0], int)  # the token count is symbolic
    assert_one_pair(cap, "vllm._C.rotary_embedding")
    assert_same(fused, plain)


def test_vllm_flashinfer_op(vllm_ops):  # noqa: F811
    _, fi_op = vllm_ops
    f, pos, q, k, cache, _ = flashinfer_case(fi_op)
    plain, pargs, fused, fargs, cap = plain_and_fused(f, pos, q, k, cache, v2=False)
    assert_one_pair(cap, "vllm.flashinfer_rotary_embedding")
    node = fused_call(cap)
    assert node.kwargs["interleaved"] is True and node.kwargs["rotary_dim"] == 32
    assert node.args[4].meta["val"].dtype == torch.int32
    assert_same(fused, plain)
    assert_same(fargs, pargs)


def test_two_vllm_ops_on_one_cache_pair_per_op(vllm_ops):  # noqa: F811
    """Two layers' ops on the same cache and positions (the same numbers): two launches, q and k of one op each."""
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(8)
    pos, cache = torch.randint(0, 32, (5,), generator=g), torch.randn(32, 64, generator=g)
    q1, k1, q2, k2 = (torch.randn(5, h * 64, generator=g) for h in (4, 2, 4, 2))

    def f(pos, q1, k1, q2, k2, cache):
        c_op(pos, q1, k1, 64, cache, True)
        q2, k2 = q2 * q1[:, :1], k2 * k1[:, :1]  # the second layer reads the first one's results
        c_op(pos, q2, k2, 64, cache, True)
        return q2 + 0, k2 + 0

    plain, pargs, fused, fargs, cap = plain_and_fused(f, pos, q1, k1, q2, k2, cache, v2=False)
    rep = cap.p.report
    assert cap.pairs() == [[0, 1], [2, 3]] and rep.misses == [] and rep.errors == []
    assert not re.search(r"auto_functionalized\b", cap.graph_text)
    assert_same(fused, plain)
    assert_same(fargs, pargs)


def test_positions_computed_in_the_graph(vllm_ops):  # noqa: F811
    """A pair's launch goes right after the last x and table node of the two, positions included: whether the
    positions are computed before q and k or right before the call, q and k take one launch and read them."""
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(9)
    pos, cache = torch.randint(0, 31, (5,), generator=g), torch.randn(32, 64, generator=g)
    q, k = torch.randn(5, 4 * 64, generator=g), torch.randn(5, 2 * 64, generator=g)

    def early(pos, q, k, cache):
        pos = pos + 1
        q, k = q * 2, k * 2
        c_op(pos, q, k, 64, cache, True)
        return q + 0, k + 0

    def late(pos, q, k, cache):
        c_op(pos + 1, q, k, 64, cache, True)
        return q + 0, k + 0

    for fn, pairs in ((early, [[0, 1]]), (late, [[0, 1]])):
        plain, pargs, fused, fargs, cap = plain_and_fused(fn, pos, q, k, cache, v2=False)
        rep = cap.p.report
        assert cap.pairs() == pairs and rep.errors == [] and rep.misses == [], rep.table()
        assert_same(fused, plain)
        assert_same(fargs, pargs)
