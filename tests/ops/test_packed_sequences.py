"""Packed sequences in the op (`cu_seqlens`, `seqlen_offsets`; ops/packed.py) in every backend.

x packs the tokens of several sequences back to back, [T, H, D]; token t of sequence b rotates by table row
(t - cu_seqlens[b]) + seqlen_offsets[b]. The expected values here are computed sequence by sequence, each
sequence's slice of x rotated by its own rows of the tables in fp64 (`per_sequence`), without the op's positions
or ops/packed.py. Checked: the reference (eager, CPU), the Inductor lowering (torch.compile), the Triton kernel
under Triton's interpreter (as an op, as the public functions' direct path and as the user-kernel node the pass
emits), the NPU bridge and its graph form with the stand-in torch_npu ops of tests/helpers/npu_standins.py, gradients,
the checks that fail loudly, and flash-attn's varlen launch in a compiled graph becoming one fused site.
"""

from __future__ import annotations

import pytest
import torch

import rope_fusion
from rope_fusion.ops.optional_backends import load_backends
from rope_fusion.ops.plan_cache import plan_cache
from rope_fusion.ops.reference import rotary_reference
from rope_fusion.ops.schema import RotaryCall, RotaryParams

pytestmark = pytest.mark.triton_on_cpu(serves=("eager",))  # the CUDA device kernel serving CPU tensors

load_backends()


def packed_batch(lengths, heads=(3, 2), head_dim=32, rows=40, width=8, dtype=torch.float32, seed=0):
    """Random packed q, k ([T, H, D]), cu_seqlens (int32) and [rows, width] caches."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    xs = [torch.randn(total, h, head_dim, generator=g).to(dtype) for h in heads]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ang = torch.rand(rows, width, generator=g, dtype=torch.float64) * 6
    return xs, cu, ang.cos().to(dtype), ang.sin().to(dtype)


def per_sequence(x, cos, sin, cu, offsets, **kw):
    """fp64: each sequence's tokens rotated by its rows of the tables, offsets[b] + 0, 1, ..."""
    outs = []
    for b in range(cu.shape[0] - 1):
        start, end = int(cu[b]), int(cu[b + 1])
        o = offsets if isinstance(offsets, int) else int(offsets[b])
        rows = slice(o, o + end - start)
        outs.append(rotary_reference(x[start:end].double(), cos[rows, None].double(), sin[rows, None].double(),
                                     out_dtype=torch.float64, **kw))
    return torch.cat(outs)


def close(out, want, dtype):
    """One rounding to the output dtype plus fp32 math, against the fp64 expectation."""
    tol = torch.finfo(dtype).eps * want.abs() + 8 * torch.finfo(torch.float32).eps * want.abs().max() + 1e-30
    err = (out.double() - want).abs()
    assert out.dtype == dtype and (err <= tol).all(), f"max err {err.max().item():.3g}"


def opts(interleaved, rotary_dim, full_tables=False):
    return dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables)


def op_kwargs(interleaved, rotary_dim, dtype, full_tables=False):
    return dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables, conjugate=False,
                out_dtype=dtype)


LENGTHS = [5, 1, 9, 3]  # uneven, one of a single token
OFFSETS = {"none": 0, "int": 7, "tensor": torch.tensor([0, 30, 3, 11])}
CASES = [  # interleaved, rotary_dim (head dim 32), full tables, offsets, dtype
    (False, 32, False, "none", torch.float32),
    (True, 16, False, "int", torch.float32),  # partial rotary
    (False, 24, False, "tensor", torch.bfloat16),  # partial NeoX
    (True, 32, True, "tensor", torch.float32),  # full-width tables
]


def case_inputs(interleaved, rotary_dim, full, offs, dtype, seed=0):
    width = rotary_dim if full else rotary_dim // 2
    (q, k), cu, cos, sin = packed_batch(LENGTHS, width=width, dtype=dtype, seed=seed)
    return q, k, cu, cos, sin, OFFSETS[offs]


def offset_kw(off):
    return {} if isinstance(off, int) and off == 0 else {"seqlen_offsets": off}


def _placeholders(real: tuple) -> tuple:
    """(fake mode, graph, nodes): a graph with one placeholder per tensor of a packed call, fake values kept."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    fm = FakeTensorMode()
    g = fx.Graph()
    nodes = []
    for name, t in zip(("q", "k", "cos", "sin", "cu", "off"), real):
        n = g.placeholder(name)
        n.meta["val"] = fm.from_tensor(t)
        nodes.append(n)
    return fm, g, nodes


# -- the reference: eager on the CPU -------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved,rotary_dim,full,offs,dtype", CASES)
def test_eager_reference(interleaved, rotary_dim, full, offs, dtype):
    q, k, cu, cos, sin, off = case_inputs(interleaved, rotary_dim, full, offs, dtype)
    kw = opts(interleaved, rotary_dim, full)
    want = [per_sequence(x, cos, sin, cu, off, **kw) for x in (q, k)]
    close(rope_fusion.apply_rotary(q, cos, sin, cu_seqlens=cu, **offset_kw(off), **kw), want[0], dtype)
    for got in (rope_fusion.apply_rotary_qk(q, k, cos, sin, cu_seqlens=cu, **offset_kw(off), **kw),
                rope_fusion.apply_rotary_qkv(q, k, q, cos, sin, cu_seqlens=cu.long(), **offset_kw(off), **kw)):
        for g, w in zip(got, [*want, want[0]]):
            close(g, w, dtype)
    if isinstance(off, torch.Tensor):  # the op itself, its packed tensors by keyword and positionally
        opk = op_kwargs(interleaved, rotary_dim, dtype, full)
        got = torch.ops.rope_fusion.rotary_qk(q, k, cos, sin, cu_seqlens=cu, seqlen_offsets=off, **opk)
        got2 = torch.ops.rope_fusion.rotary_qk(q, k, cos, sin, None, None, None, cu, off, **opk)
        for g, g2, w in zip(got, got2, want):
            close(g, w, dtype)
            torch.testing.assert_close(g, g2, rtol=0, atol=0)


def test_random_batches_match_positions():
    """Random lengths and offsets: the packed call equals the same call with each token's position."""
    g = torch.Generator().manual_seed(3)
    for trial in range(6):
        lengths = torch.randint(1, 12, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        (x,), cu, cos, sin = packed_batch(lengths, heads=(2,), rows=64, seed=trial)
        off = torch.randint(0, 64 - max(lengths), (len(lengths),), generator=g)
        pos = torch.cat([torch.arange(n) + int(o) for n, o in zip(lengths, off)])[:, None]
        got = rope_fusion.apply_rotary(x, cos, sin, cu_seqlens=cu, seqlen_offsets=off, rotary_dim=16)
        torch.testing.assert_close(got, rope_fusion.apply_rotary(x, cos, sin, positions=pos, rotary_dim=16),
                                   rtol=0, atol=0)


def test_gradients():
    """The backward (the inverse rotation, the tables' sums) at the derived positions, q and x and the caches."""
    q, k, cu, cos, sin, off = case_inputs(False, 32, False, "tensor", torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, cos)]
    out = rope_fusion.apply_rotary_qk(leaves[0], leaves[1], leaves[2], sin, cu_seqlens=cu, seqlen_offsets=off)
    (out[0].sin().sum() + out[1].square().sum()).backward()
    ref = [t.clone().requires_grad_() for t in (q, k, cos)]
    want = [per_sequence(x, ref[2], sin, cu, off, **opts(False, 32)) for x in ref[:2]]
    (want[0].sin().sum() + want[1].square().sum()).backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)


# -- the lowering: torch.compile on the CPU ------------------------------------------------------------------

@pytest.mark.parametrize("interleaved,rotary_dim,full,offs,dtype", CASES[1:3])
def test_compiled_lowering(interleaved, rotary_dim, full, offs, dtype):
    q, k, cu, cos, sin, off = case_inputs(interleaved, rotary_dim, full, offs, dtype)
    kw = opts(interleaved, rotary_dim, full)

    def fn(q, k, cos, sin, cu, off):
        return rope_fusion.apply_rotary_qk(q, k, cos, sin, cu_seqlens=cu, seqlen_offsets=off, **kw)

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, dynamic=False)(q, k, cos, sin, cu, off)
    for g, x in zip(got, (q, k)):
        close(g, per_sequence(x, cos, sin, cu, off, **kw), dtype)


def test_compiled_lowering_dynamic_token_count():
    """Compiled with dynamic=True, batches of other lengths and counts: the derived positions follow the sizes."""
    def fn(q, k, cos, sin, cu, off):
        return rope_fusion.apply_rotary_qk(q, k, cos, sin, cu_seqlens=cu, seqlen_offsets=off, rotary_dim=16)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for seed, lengths in enumerate(([3, 5, 2], [4, 4, 1, 7])):
        (q, k), cu, cos, sin = packed_batch(lengths, seed=seed)
        off = torch.arange(len(lengths)) * 3
        for g, x in zip(compiled(q, k, cos, sin, cu, off), (q, k)):
            close(g, per_sequence(x, cos, sin, cu, off, **opts(False, 16)), torch.float32)


# -- the Triton kernel under Triton's interpreter ------------------------------------------------------------

@pytest.fixture
def interpreted_kernel(triton_on_cpu, monkeypatch):
    """The CUDA device kernel (the Triton planner and launch) serving CPU tensors (tests/conftest.py), with no plan
    of another test (tests/conftest.py clears them)."""
    return triton_on_cpu


@pytest.mark.parametrize("interleaved,rotary_dim,full,offs,dtype", [CASES[0], CASES[2]])
def test_triton_kernel_interpreted(interpreted_kernel, interleaved, rotary_dim, full, offs, dtype):
    q, k, cu, cos, sin, off = case_inputs(interleaved, rotary_dim, full, offs, dtype)
    kw = opts(interleaved, rotary_dim, full)
    want = [per_sequence(x, cos, sin, cu, off, **kw) for x in (q, k)]
    seq_off = off if isinstance(off, torch.Tensor) else None
    ops_out = torch.ops.rope_fusion.rotary_qk_triton(q, k, cos, sin, cu_seqlens=cu, seqlen_offsets=seq_off,
                                                     **op_kwargs(interleaved, rotary_dim, dtype, full))
    for _ in range(2):  # the direct path: planned on the first call, the plan reused on the second
        direct = rope_fusion.apply_rotary_qk(q, k, cos, sin, cu_seqlens=cu, **offset_kw(off), **kw)
        for a, b, w in zip(ops_out, direct, want):
            close(a, w, dtype)
            close(b, w, dtype)
    assert len(plan_cache("rotary.direct")) == 1


def test_triton_user_kernel_node():
    """The pass's Triton emission of a packed call: cu_seqlens and seqlen_offsets are the user-kernel node's
    inputs, no ATen op derives positions before it; the graph, run with the kernel interpreted, gives the packed
    rotation."""
    pytest.importorskip("triton")
    import torch.fx as fx
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    from rope_fusion.kernels import triton_launch
    from rope_fusion.kernels.triton_graph import emit_triton
    from tests.helpers.kernel_sites import GraphRun

    if triton_launch.INTERPRETED:
        pytest.skip("the kernel module was imported under TRITON_INTERPRET=1: make_fx cannot trace it")
    q, k, cu, cos, sin, off = case_inputs(True, 16, False, "tensor", torch.float32)
    real = (q, k, cos, sin, cu, off)
    fm, g, nodes = _placeholders(real)
    params = RotaryParams(**op_kwargs(True, 16, torch.float32))
    call = RotaryCall(nodes[:2], nodes[2], nodes[3], params, cu_seqlens=nodes[4], seqlen_offsets=nodes[5])
    outs = emit_triton(g, fm, call, nodes[0])
    g.output(tuple(outs))
    (hop,) = [n for n in g.nodes if n.target is triton_kernel_wrapper_functional]
    kw = hop.kwargs["kwargs"]
    assert kw["HAS_POS"] and kw["PACKED"] and kw["pos_ptr"] is nodes[4] and kw["off_ptr"] is nodes[5]
    assert not any(n.target is torch.ops.aten.searchsorted.Tensor for n in g.nodes)
    got = GraphRun(fx.GraphModule({}, g)).run(*real)
    for o, x in zip(got, (q, k)):
        close(o, per_sequence(x, cos, sin, cu, off, **opts(True, 16)), torch.float32)


# -- the NPU bridge, with the stand-in torch_npu ops of tests/helpers/npu_standins.py -----------------------------

@pytest.fixture
def npu_stand_ins(monkeypatch):
    from rope_fusion.kernels import npu as bridge
    from tests.helpers import npu_standins

    monkeypatch.setattr(bridge, "OP_NAMESPACE", npu_standins.NS)
    npu_standins.CALLS.clear()
    bridge.stats.clear()
    return npu_standins.CALLS


def test_npu_bridge(npu_stand_ins):
    """q and k of head dim 64, NeoX: one npu_apply_rotary_pos_emb (TND) on the gathered rows; interleaved: one
    npu_rotary_mul per tensor."""
    (q, k), cu, cos, sin = packed_batch(LENGTHS, head_dim=64, width=32)
    off = OFFSETS["tensor"]
    for interleaved, calls in ((False, ["apply"]), (True, ["rotary_mul", "rotary_mul"])):
        npu_stand_ins.clear()
        kw = op_kwargs(interleaved, 64, torch.float32)
        got = torch.ops.rope_fusion.rotary_qk_npu(q, k, cos, sin, cu_seqlens=cu, seqlen_offsets=off, **kw)
        for o, x in zip(got, (q, k)):
            close(o, per_sequence(x, cos, sin, cu, off, **opts(interleaved, 64)), torch.float32)
        assert [c[0] for c in npu_stand_ins] == calls


def test_npu_graph_form(npu_stand_ins):
    """The graph form (kernels/npu_graph.py, what fx_pass writes on NPU graphs): the positions' ATen ops, then
    npu_rotary_mul per tensor; the graph run gives the packed rotation."""
    import torch.fx as fx

    from rope_fusion.kernels import npu_graph
    from rope_fusion.passes.emission import Emitter

    (q, k), cu, cos, sin = packed_batch(LENGTHS, head_dim=64, width=32)
    off = OFFSETS["int"] * torch.ones(len(LENGTHS), dtype=torch.int64)
    real = (q, k, cos, sin, cu, off)
    fm, g, nodes = _placeholders(real)
    em = Emitter(g)
    em.fake_mode = fm
    params = RotaryParams(**op_kwargs(False, 64, torch.float32))
    call = RotaryCall(nodes[:2], nodes[2], nodes[3], params, cu_seqlens=nodes[4], seqlen_offsets=nodes[5])
    outs = npu_graph.emit(em, call, nodes[0])
    g.output(tuple(outs))
    npu_stand_ins.clear()  # the emitter ran the stand-ins on fake values: count the graph's run only
    got = fx.GraphModule({}, g)(*real)
    for o, x in zip(got, (q, k)):
        close(o, per_sequence(x, cos, sin, cu, off, **opts(False, 64)), torch.float32)
    assert [c[0] for c in npu_stand_ins] == ["rotary_mul", "rotary_mul"]


# -- what fails loudly ---------------------------------------------------------------------------------------

def bad_inputs():
    (x,), cu, cos, sin = packed_batch([4, 6], heads=(2,), rows=12, width=16)  # 10 tokens, 12 table rows
    return x, cu, cos, sin


ROW_ERRORS = {  # a token's row outside the tables, or a token that no sequence holds
    "row past the tables": lambda cu: dict(cu_seqlens=cu, seqlen_offsets=torch.tensor([0, 7])),
    "int offset past the tables": lambda cu: dict(cu_seqlens=cu, seqlen_offsets=7),
    "negative row": lambda cu: dict(cu_seqlens=cu, seqlen_offsets=torch.tensor([-1, 0])),
    "tokens after cu_seqlens[-1]": lambda cu: dict(cu_seqlens=torch.tensor([0, 4, 8])),
    "tokens before cu_seqlens[0]": lambda cu: dict(cu_seqlens=torch.tensor([2, 4, 10]),
                                                   seqlen_offsets=torch.tensor([3, 0])),
}


@pytest.mark.parametrize("what", list(ROW_ERRORS))
def test_rows_outside_raise(what):
    x, cu, cos, sin = bad_inputs()
    kw = ROW_ERRORS[what](cu)
    with pytest.raises(IndexError):
        rope_fusion.apply_rotary(x, cos, sin, **kw)
    if isinstance(kw.get("seqlen_offsets"), int):
        return
    opk = op_kwargs(False, 32, torch.float32)
    with pytest.raises(IndexError):
        torch.ops.rope_fusion.rotary(x, cos, sin, **kw, **opk)
    torch._dynamo.reset()
    f = torch.compile(lambda x, c, s, cu, o: torch.ops.rope_fusion.rotary(x, c, s, cu_seqlens=cu, seqlen_offsets=o,
                                                                          **opk), fullgraph=True, dynamic=False)
    # a row outside the tables: the lowering's check, naming positions; a token outside every sequence: the C++
    # check of Inductor's own gather of its sequence's start
    row = "row" in what
    with pytest.raises(RuntimeError, match="positions must pick rows" if row else "index out of bounds"):
        f(x, cos, sin, kw["cu_seqlens"], kw.get("seqlen_offsets", torch.zeros(2, dtype=torch.int64)))


def test_rows_outside_raise_in_the_interpreted_kernel(interpreted_kernel, monkeypatch):
    """The kernel's row assert on a derived row, under the interpreter with device asserts on (as
    tests/ops/test_bounds.py runs it: Inductor and the direct launches compile the assert in)."""
    import dataclasses

    import triton.runtime.interpreter as interpreter

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    x, cu, cos, sin = bad_inputs()
    with pytest.raises(Exception, match="position outside"):  # the kernel's device assert
        torch.ops.rope_fusion.rotary_triton(x, cos, sin, cu_seqlens=cu, seqlen_offsets=torch.tensor([0, 7]),
                                            **op_kwargs(False, 32, torch.float32))


@pytest.mark.parametrize("kw,match", [
    (lambda cu, x: dict(cu_seqlens=cu, positions=torch.zeros(10, 1, dtype=torch.int64)), "not both"),
    (lambda cu, x: dict(seqlen_offsets=torch.zeros(2, dtype=torch.int64)), "need cu_seqlens"),
    (lambda cu, x: dict(seqlen_offsets=3), "need cu_seqlens"),
    (lambda cu, x: dict(cu_seqlens=cu, seqlen_offsets=-1), ">= 0"),
    (lambda cu, x: dict(cu_seqlens=cu, seqlen_offsets=torch.zeros(3, dtype=torch.int64)), "one offset per"),
    (lambda cu, x: dict(cu_seqlens=cu.float()), "int32 or int64"),
    (lambda cu, x: dict(cu_seqlens=cu[None]), "one-dimensional"),
    (lambda cu, x: dict(cu_seqlens=cu, seqlen_offsets=torch.zeros(2)), "int32 or int64"),
], ids=["positions too", "offsets alone", "int offset alone", "negative int", "offsets shape", "float cu",
        "2-D cu", "float offsets"])
def test_bad_arguments_raise_value_error(kw, match):
    x, cu, cos, sin = bad_inputs()
    with pytest.raises(ValueError, match=match):
        rope_fusion.apply_rotary(x, cos, sin, **kw(cu, x))


def test_bad_shapes_raise_value_error():
    x, cu, cos, sin = bad_inputs()
    with pytest.raises(ValueError, match="packed tokens"):
        rope_fusion.apply_rotary(x[0, 0], cos, sin, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cache"):
        rope_fusion.apply_rotary(x, cos[None], sin[None], cu_seqlens=cu)
    with pytest.raises(ValueError, match="same tokens"):
        rope_fusion.apply_rotary_qk(x, x[:5], cos, sin, cu_seqlens=cu)


# -- flash-attn's varlen launch in a compiled graph ----------------------------------------------------------

@pytest.mark.parametrize("offs,interleaved,inplace", [("none", False, False), ("int", False, False),
                                                     ("tensor", False, False), ("int", True, True)])
def test_flash_attn_varlen_launches_become_one_fused_site(offs, interleaved, inplace):
    """q and k rotated by two launches of vLLM's copy of flash-attn's rotary kernel (varlen): one rotary_qk,
    compared with the kernels themselves (interpreted) in the plain compile. Int offsets: the op's cu_seqlens;
    tensor offsets, whose rows past the tables the kernel rotates by the identity: the positions the op would
    derive, clamped into an identity row."""
    pytest.importorskip("triton")
    from tests.helpers.kernel_sites import vllm_rotary_module
    from tests.helpers.pass_capture import assert_same, fused_call, plain_and_fused

    R = vllm_rotary_module()
    (q, k), cu, cos, sin = packed_batch(LENGTHS, heads=(4, 2), head_dim=64, rows=16, width=16)
    off = {"none": 0, "int": 7, "tensor": torch.tensor([0, 15, 10, 9], dtype=torch.int32)}[offs]
    # (sequence 2, 9 tokens from row 10, reaches past the 16 rows)

    def f(q, k, cos, sin, cu, off):
        kw = dict(seqlen_offsets=off, cu_seqlens=cu, max_seqlen=max(LENGTHS), interleaved=interleaved,
                  inplace=inplace)
        return R.apply_rotary(q, cos, sin, **kw) * 1, R.apply_rotary(k, cos, sin, **kw) * 1

    plain, plain_args, fused, fused_args, cap = plain_and_fused(f, q, k, cos, sin, cu, off)
    rep = cap.p.report
    assert rep.errors == [] and rep.misses == [], rep.table()
    assert len(rep.sites) == 2 and [kk.op for kk in rep.kernels] == ["rope_fusion.rotary_qk"], rep.table()
    assert [s.origin for s in rep.sites] == ["flash_attn.rotary_kernel"] * 2
    assert cap.sites == [] and cap.misses == []  # no launch left
    node = fused_call(cap)
    call = RotaryCall.parse(node.args, node.kwargs, 2)
    if offs == "tensor":
        assert call.cu_seqlens is None and call.positions is not None
    else:
        assert call.cu_seqlens is not None and call.cu_seqlens.op == "placeholder" and call.positions is None
    assert_same(fused, plain)
    assert_same(fused_args, plain_args)  # inplace: q and k written back alike
    if offs != "tensor":  # and both are the packed rotation
        for o, x in zip(fused, (q, k)):
            close(o, per_sequence(x, cos, sin, cu, off, **opts(interleaved, 32)), torch.float32)


def test_flash_attn_varlen_with_a_dynamic_token_count():
    """q and k split from one packed projection whose token count is dynamic: one rotary_qk all the same."""
    pytest.importorskip("triton")
    from tests.helpers.kernel_sites import vllm_rotary_module
    from tests.helpers.pass_capture import assert_same, plain_and_fused

    R = vllm_rotary_module()
    (qk,), cu, cos, sin = packed_batch(LENGTHS, heads=(6,), head_dim=64, rows=16, width=16)

    def f(qk, cos, sin, cu):
        q, k = qk[:, :4], qk[:, 4:]
        kw = dict(seqlen_offsets=2, cu_seqlens=cu, max_seqlen=max(LENGTHS))
        return R.apply_rotary(q, cos, sin, **kw) * 1, R.apply_rotary(k, cos, sin, **kw) * 1

    plain, _, fused, _, cap = plain_and_fused(f, qk, cos, sin, cu, dynamic_dims={0: 0})
    rep = cap.p.report
    assert rep.misses == [] and [kk.op for kk in rep.kernels] == ["rope_fusion.rotary_qk"], rep.table()
    assert_same(fused, plain)


# -- on a GPU: the Triton kernel launched directly, and a varlen site as its user-kernel node -------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offs", ["int", "tensor"])
def test_gpu_eager_and_compiled_varlen_site(offs):
    """Eagerly the Triton kernel at the derived positions; compiled, flash-attn's varlen launches of q and k become
    one rotary_qk on the Triton backend (its user-kernel node, which takes cu_seqlens), both the packed rotation."""
    from tests.helpers.compile_pass import compile_with_pass
    from tests.helpers.kernel_sites import vllm_rotary_module

    (q, k), cu, cos, sin = packed_batch(LENGTHS, heads=(4, 2), head_dim=64, rows=48, width=16)
    off = 5 if offs == "int" else torch.tensor([0, 30, 3, 11], dtype=torch.int32)
    want = [per_sequence(x, cos, sin, cu, off, **opts(False, 32)) for x in (q, k)]
    dev = [t.cuda() for t in (q, k, cos, sin, cu)] + [off.cuda() if isinstance(off, torch.Tensor) else off]
    for _ in range(2):  # planned, then the plan reused
        got = rope_fusion.apply_rotary_qk(*dev[:4], cu_seqlens=dev[4], seqlen_offsets=dev[5], rotary_dim=32)
        for g, w in zip(got, want):
            close(g.cpu(), w, torch.float32)
    R = vllm_rotary_module()

    def f(q, k, cos, sin, cu, off):
        kw = dict(seqlen_offsets=off, cu_seqlens=cu, max_seqlen=max(LENGTHS))
        return R.apply_rotary(q, cos, sin, **kw) * 1, R.apply_rotary(k, cos, sin, **kw) * 1

    out, p = compile_with_pass(f, *dev, backend="triton")
    assert [(kk.op, kk.backend) for kk in p.report.kernels] == [("rope_fusion.rotary_qk", "triton")], \
        p.report.table()
    for o, w in zip(out, want):
        close(o.cpu(), w, torch.float32)
