"""Packed sequences searched inside the Triton kernel (`PACKED`): cu_seqlens and seqlen_offsets as kernel inputs.

The kernel finds each token's sequence by a binary search over cu_seqlens and reads its cache row as the positions
path does (ops/packed.py's contract). Checked under Triton's interpreter, on fresh random inputs: the rotation
against an fp64 evaluation computed sequence by sequence (each sequence's slice of x by its own rows, without the
op's positions or ops/packed.py), the two asserts (a row outside the caches, a token outside every sequence), that
the Triton launch of a packed call runs no ATen op deriving positions, and that a compiled graph's user-kernel node
takes cu_seqlens as its input.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")

import triton.runtime.interpreter as interpreter  # noqa: E402

import rope_fusion  # noqa: E402
import rope_fusion.kernels.triton_launch as launching  # noqa: E402
from rope_fusion.ops.packed import unpacked  # noqa: E402
from rope_fusion.ops.plan_cache import plan_cache  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.ops.schema import RotaryCall, RotaryParams  # noqa: E402
from tests.helpers.interpreted_rotary import KERNEL, poisoned_outputs  # noqa: E402


def expected(x, cos, sin, cu, offsets, weight, **kw) -> torch.Tensor:
    """fp64: sequence b's tokens rotated by rows offsets[b] + 0, 1, ... of the caches."""
    outs = []
    for b in range(cu.shape[0] - 1):
        start, end = int(cu[b]), int(cu[b + 1])
        o = 0 if offsets is None else int(offsets[b])
        rows = torch.arange(o, o + end - start)
        w = None if weight is None else weight.double()
        outs.append(rotary_reference(x[start:end].double(), cos[rows][:, None].double(), sin[rows][:, None].double(),
                                     out_dtype=torch.float64, norm_weight=w, **kw))
    return torch.cat(outs)


def random_case(seed: int, lengths: list, cu_dtype: torch.dtype, with_offsets: bool, heads=(4, 2), head_dim=32,
                rotary_dim=32, rows=48):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    xs = [torch.randn(total, h, head_dim, generator=g) for h in heads]
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=cu_dtype)
    offsets = None
    if with_offsets:  # each sequence's rows within the caches
        offsets = torch.tensor([int(torch.randint(0, rows - n + 1, (), generator=g)) for n in lengths],
                               dtype=random.Random(seed).choice([torch.int32, torch.int64]))
    ang = torch.rand(rows, rotary_dim // 2, generator=g, dtype=torch.float64) * 6
    return xs, cu, offsets, ang.cos().float(), ang.sin().float()


def random_lengths(seed: int, batch: int) -> list:
    """Uneven lengths, some sequences empty (a start repeated in cu_seqlens), at least one token in all."""
    r = random.Random(seed)
    lengths = [r.choice([0, 0, 1, r.randint(2, 13)]) for _ in range(batch)]
    if sum(lengths) == 0:
        lengths[r.randrange(batch)] = r.randint(1, 9)
    return lengths


CASES = [  # batch, cu dtype, offsets, interleaved, norm
    (1, torch.int32, False, False, "none"),
    (1, torch.int64, True, True, "rms"),
    (2, torch.int64, False, True, "none"),
    (3, torch.int32, True, False, "rms"),
    (5, torch.int32, True, True, "none"),
    (8, torch.int64, True, False, "none"),
    (13, torch.int64, False, False, "rms"),
    (17, torch.int32, True, True, "rms"),
]


@pytest.mark.parametrize("batch,cu_dtype,with_offsets,interleaved,norm", CASES)
def test_packed_rows_found_in_the_kernel(batch, cu_dtype, with_offsets, interleaved, norm):
    """q (4 heads) and k (2 heads) of packed sequences in one launch, against the per-sequence fp64 rotation."""
    seed = 1000 + CASES.index((batch, cu_dtype, with_offsets, interleaved, norm))
    lengths = random_lengths(seed, batch)
    (q, k), cu, offsets, cos, sin = random_case(seed, lengths, cu_dtype, with_offsets)
    weight = torch.rand(32, generator=torch.Generator().manual_seed(seed)) + 0.5 if norm == "rms" else None
    params = RotaryParams(interleaved=interleaved, rotary_dim=32, full_tables=False, conjugate=False,
                          out_dtype=torch.float32, norm=norm)
    with poisoned_outputs():
        outs = launching.launch([q, k], cos, sin, params, None, [weight, weight] if weight is not None else None,
                                cu_seqlens=cu, seqlen_offsets=offsets, kernel=KERNEL)
    kw = dict(interleaved=interleaved, rotary_dim=32, full_tables=False, norm=norm)
    for out, x in zip(outs, (q, k)):
        want = expected(x, cos, sin, cu, offsets, weight, **kw)
        assert not out.isnan().any(), "some output elements were never written"
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_one_head_several_tokens_a_program(monkeypatch, request):
    """One head takes several tokens a program (TOKS) once that leaves MIN_PROGRAMS programs: the search runs over
    a column of tokens. The rule's threshold is lowered to 16 programs, so that 256 tokens take that form (8192
    at the planner's 1024; the interpreter runs every program, 23 s of a 2-core CPU)."""
    from rope_fusion.kernels import triton_plan

    monkeypatch.setattr(triton_plan, "MIN_PROGRAMS", 16)
    rope_fusion.clear_caches()  # no launch planned under the lowered rule outlives the test: planned again after
    request.addfinalizer(rope_fusion.clear_caches)
    lengths = random_lengths(7, 9)
    lengths[0] += 256 - sum(lengths)
    (x,), cu, offsets, cos, sin = random_case(7, lengths, torch.int64, True, heads=(1,), head_dim=16, rotary_dim=16,
                                              rows=256 + 16)
    params = RotaryParams(interleaved=False, rotary_dim=16, full_tables=False, conjugate=False,
                          out_dtype=torch.float32)
    p = launching.make_launches([x], [x], launching.Tables(cos, sin, None, [None], cu, offsets), params)
    assert p[0][3]["TOKS"] > 1 and p[0][3]["PACKED"]
    with poisoned_outputs():
        (out,) = launching.launch([x], cos, sin, params, cu_seqlens=cu, seqlen_offsets=offsets, kernel=KERNEL)
    want = expected(x, cos, sin, cu, offsets, None, interleaved=False, rotary_dim=16, full_tables=False)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def device_asserts(monkeypatch):
    """The interpreter with device asserts on, as Inductor and the direct launches compile the kernel."""
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))


BAD = {  # 10 tokens in sequences of 4 and 6, 12 cache rows
    "row past the caches": ([0, 4, 10], [0, 7], "a position outside"),
    "negative row": ([0, 4, 10], [-1, 0], "a position outside"),
    "tokens after cu_seqlens[-1]": ([0, 4, 8], None, "a token outside every sequence"),
    "tokens before cu_seqlens[0]": ([2, 4, 10], [3, 0], "a token outside every sequence"),
}


@pytest.mark.parametrize("what", list(BAD))
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_rows_and_tokens_outside_fail_the_asserts(device_asserts, what, cu_dtype):
    starts, offs, match = BAD[what]
    (x,), _, _, cos, sin = random_case(3, [4, 6], cu_dtype, False, heads=(2,), rows=12)
    cu = torch.tensor(starts, dtype=cu_dtype)
    offsets = torch.tensor(offs, dtype=cu_dtype) if offs is not None else None
    params = RotaryParams(interleaved=False, rotary_dim=32, full_tables=False, conjugate=False,
                          out_dtype=torch.float32)
    with pytest.raises(Exception, match=match), poisoned_outputs():
        launching.launch([x], cos, sin, params, cu_seqlens=cu, seqlen_offsets=offsets, kernel=KERNEL)
    # the same tensors inside the contract rotate
    good = torch.tensor([0, 4, 10], dtype=cu_dtype)
    (out,) = launching.launch([x], cos, sin, params, cu_seqlens=good, kernel=KERNEL)
    want = expected(x, cos, sin, good, None, None, interleaved=False, rotary_dim=32, full_tables=False)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def _aten_ops(fn) -> set:
    """The ATen ops `fn` runs, as the profiler records them (no dispatch mode: the launch is not traced)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("aten::")}


def test_the_launch_of_a_packed_call_derives_no_positions(monkeypatch):
    """`launch_call`, the op's Triton kernel, takes cu_seqlens to the kernel: no searchsorted, embedding or
    arithmetic runs, while `packed.unpacked` (what the reference and the lowering run) does run them."""
    monkeypatch.setattr(launching, "rotary_kernel", KERNEL)
    monkeypatch.setattr(launching, "INTERPRETED", True)
    (q, k), cu, offsets, cos, sin = random_case(11, [3, 0, 5, 2], torch.int32, True)
    params = RotaryParams(interleaved=True, rotary_dim=32, full_tables=False, conjugate=False,
                          out_dtype=torch.float32)
    call = RotaryCall([q, k], cos, sin, params, cu_seqlens=cu, seqlen_offsets=offsets)
    got = {}
    ops = _aten_ops(lambda: got.setdefault("outs", launching.launch_call(call)))
    derived = _aten_ops(lambda: unpacked(call))
    deriving = {"aten::searchsorted", "aten::embedding", "aten::sub"}  # sequence, its start, the row
    assert deriving <= derived, derived
    assert not ops & (deriving | {"aten::add", "aten::arange"}), ops  # allocations and copies only
    for out, x in zip(got["outs"], (q, k)):
        want = expected(x, cos, sin, cu, offsets, None, interleaved=True, rotary_dim=32, full_tables=False)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_offsets", [False, True])
def test_the_user_kernel_node_takes_cu_seqlens(with_offsets):
    """The pass's Triton emission of a packed call on CUDA values (fake tensors): one user-kernel node whose positions
    pointer is the graph's cu_seqlens and whose offsets pointer its seqlen_offsets, and no node deriving positions
    (searchsorted, embedding, iota) before it."""
    import torch.fx as fx
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rope_fusion.kernels.triton_graph import emit_triton

    if launching.INTERPRETED:
        pytest.skip("the kernel module was imported under TRITON_INTERPRET=1: make_fx cannot trace it")
    lengths = random_lengths(21, 5)
    (q, k), cu, offsets, cos, sin = random_case(21, lengths, torch.int64, with_offsets)
    fm = FakeTensorMode(allow_non_fake_inputs=False)
    g = fx.Graph()
    nodes = []
    real = (q, k, cos, sin, cu, offsets)
    for name, t in zip(("q", "k", "cos", "sin", "cu", "off"), real):
        if t is None:
            nodes.append(None)
            continue
        n = g.placeholder(name)
        with fm:
            n.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
        nodes.append(n)
    params = RotaryParams(interleaved=False, rotary_dim=32, full_tables=False, conjugate=False,
                          out_dtype=torch.bfloat16)
    call = RotaryCall(nodes[:2], nodes[2], nodes[3], params, cu_seqlens=nodes[4], seqlen_offsets=nodes[5])
    outs = emit_triton(g, fm, call, nodes[0])
    assert outs is not None and len(outs) == 2
    (hop,) = [n for n in g.nodes if n.target is triton_kernel_wrapper_functional]
    # the node's arguments: graph values, and the constants torch keeps in its side table (None among them)
    kw = {**kernel_side_table.get_constant_args(hop.kwargs["constant_args_idx"]), **hop.kwargs["kwargs"]}
    assert kw["PACKED"] and kw["HAS_POS"] and kw["batch"] == len(lengths)
    assert kw["pos_ptr"] is nodes[4]
    assert kw["off_ptr"] is nodes[5]  # None without offsets
    deriving = {torch.ops.aten.searchsorted.Tensor, torch.ops.aten.embedding.default, torch.ops.prims.iota.default}
    assert not {n.target for n in g.nodes} & deriving, str(g)


@pytest.mark.parametrize("with_offsets", [False, True])
def test_the_public_functions_direct_path_takes_packed_sequences_to_the_kernel(monkeypatch, with_offsets):
    """`apply_rotary_qk(..., cu_seqlens=)` eagerly: its plan launches the kernel with cu_seqlens (one launch a call,
    no positions derived by ATen ops once planned), every call of the geometry after the first replaying the plan; the
    results match the per-sequence fp64 rotation, with and without per-sequence offsets."""
    from rope_fusion.kernels import triton_rotary  # noqa: F401  (registers the CUDA kernel served here)
    from rope_fusion.ops.device_runners import ROTARY_KERNELS

    launches = []

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return KERNEL[grid]

    monkeypatch.setattr(launching, "rotary_kernel", Counting())
    monkeypatch.setattr(launching, "INTERPRETED", True)
    rope_fusion.clear_caches()
    monkeypatch.setitem(ROTARY_KERNELS.kernels, "cpu", ROTARY_KERNELS.kernels["cuda"])  # CPU tensors, the kernel's
    for call in range(3):
        (q, k), cu, offsets, cos, sin = random_case(20 + call, [3, 0, 5, 2], torch.int64, with_offsets)
        offsets = offsets.long() if offsets is not None else None  # one geometry: one plan
        args, kw = (q, k, cos, sin), dict(interleaved=False, cu_seqlens=cu, seqlen_offsets=offsets)
        ops = _aten_ops(lambda a=args, kw=kw: launches.append(rope_fusion.apply_rotary_qk(*a, **kw)))
        qo, ko = launches.pop()
        if call:  # the plan replayed (the first call plans and validates)
            assert not ops & {"aten::searchsorted", "aten::embedding", "aten::sub", "aten::arange"}, ops
        for out, x in zip((qo, ko), (q, k)):
            want = expected(x, cos, sin, cu, offsets, None, interleaved=False, rotary_dim=x.shape[-1],
                            full_tables=False)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert len(launches) == 3 and len(plan_cache("rotary.direct")) == 1  # one launch of q and k a call, one plan
