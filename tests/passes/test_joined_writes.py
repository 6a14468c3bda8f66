"""A rotation joined after it is computed (HunyuanVideo's dual-stream `cat([rope(q_img), q_txt], 2)`, Qwen-Image's
`cat([rope(q_txt), rope(q_img)], 1)` with tables per stream) is written into its rows of the join by the fused node
for a backend whose node Inductor cannot write into the cat: `rope_fusion::rotary*_into_` writes each rotation into
an `empty` joined tensor, the groups that write into one join are chained, the other pieces are scattered into
their rows, and no cat is left.

The Triton kernel runs interpreted on the CPU (tests/helpers/triton_interpreted.py); Inductor compiles the rest of the
graph to C++. The numerics are checked against an fp64 evaluation of the model's own code on fresh inputs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from torch._inductor.utils import run_and_get_code  # noqa: E402

import rope_fusion  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from tests.helpers.auto_clock import stub_clock  # noqa: E402
from tests.helpers.compile_pass import compile_with_pass  # noqa: E402
from tests.helpers.diffusers_rotary import rms  # noqa: E402
from tests.helpers.diffusers_rotary import rope_heads_first as rope  # noqa: E402
from tests.helpers.numerics import check_numerics  # noqa: E402
from tests.helpers.triton_cpu import timed_as_nodes  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEXT, IMAGE, HEADS, D = 3, 5, 2, 16
pytestmark = pytest.mark.triton_on_cpu(serves=("slice_write",))  # the Triton backend, writing into slices too


def hunyuan_dual_stream(q, k, v, eq, ek, ev, wq, wk, weq, wek, cos, sin):
    """HunyuanVideo's dual-stream attention: the image stream normed and rotated, the text stream normed, joined
    after the rotation along the sequence ([B, H, S, D])."""
    q, k = rope(rms(q, wq), cos, sin), rope(rms(k, wk), cos, sin)
    q = torch.cat([q, rms(eq, weq)], dim=2)
    k = torch.cat([k, rms(ek, wek)], dim=2)
    return F.scaled_dot_product_attention(q, k, torch.cat([v, ev], dim=2))


def qwen_joint(tq, tk, tv, iq, ik, iv, tcos, tsin, icos, isin):
    """Qwen-Image's joint attention: each stream rotated with its own tables, then joined text first."""
    q = torch.cat([rope(tq, tcos, tsin), rope(iq, icos, isin)], dim=2)
    k = torch.cat([rope(tk, tcos, tsin), rope(ik, icos, isin)], dim=2)
    return F.scaled_dot_product_attention(q, k, torch.cat([tv, iv], dim=2))


def joined_twice(x, y, cos, sin):
    """The rotation read by the cat and by something else: the cat stays."""
    r = rope(x, cos, sin)
    return torch.cat([r, y], dim=2), r * 2.0


def hunyuan_inputs(dtype=torch.float32, b=2):
    xs = [torch.randn(b, HEADS, IMAGE, D, dtype=dtype) for _ in range(3)]
    es = [torch.randn(b, HEADS, TEXT, D, dtype=dtype) for _ in range(3)]
    ws = [torch.rand(D, dtype=dtype) + 0.5 for _ in range(4)]
    return (*xs, *es, *ws, torch.randn(IMAGE, D), torch.randn(IMAGE, D))


def qwen_inputs(dtype=torch.float32, b=2):
    t = [torch.randn(b, HEADS, TEXT, D, dtype=dtype) for _ in range(3)]
    i = [torch.randn(b, HEADS, IMAGE, D, dtype=dtype) for _ in range(3)]
    return (*t, *i, torch.randn(TEXT, D), torch.randn(TEXT, D), torch.randn(IMAGE, D), torch.randn(IMAGE, D))


def _counts(p):
    return p.capture.graphs[-1].after.counts


def _compiled_code(fn, args, **pass_kw):
    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass(**pass_kw)
    with torch._inductor.config.patch(post_grad_custom_post_pass=p, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hunyuan_dual_stream_writes_the_image_rows_of_the_join(triton_on_cpu, dtype):
    torch.manual_seed(0)
    args = hunyuan_inputs(dtype)
    out, p = compile_with_pass(hunyuan_dual_stream, *args, backend="triton")
    r = p.report
    assert (len(r.sites), len(r.kernels)) == (2, 1), r.table()
    assert r.kernels[0].fold.startswith("joined write:"), r.table()
    assert "[dim 2, 0:5]" in r.kernels[0].fold, r.table()
    counts = _counts(p)
    # the v cat stays (nothing rotates v); q's and k's are gone, their text rows scattered in
    assert counts["aten.cat.default"] == 1 and counts["auto_functionalized"] == 1, counts
    assert counts["aten.slice_scatter.default"] == 2, counts
    check_numerics(hunyuan_dual_stream, args, out, context=r.table())


def test_qwen_joint_chains_both_streams_into_one_join(triton_on_cpu):
    """Two groups (the text pair and the image pair, each its own tables) write into the same two joins."""
    torch.manual_seed(1)
    args = qwen_inputs()
    out, p = compile_with_pass(qwen_joint, *args, backend="triton")
    r = p.report
    assert (len(r.sites), len(r.kernels)) == (4, 2), r.table()
    assert all(k.fold.startswith("joined write:") for k in r.kernels), r.table()
    counts = _counts(p)
    assert counts["aten.cat.default"] == 1 and counts["auto_functionalized"] == 2, counts
    assert counts["aten.slice_scatter.default"] == 0, counts  # every row of q's and k's joins is written by the op
    check_numerics(qwen_joint, args, out, context=r.table())


def test_generated_code_writes_into_the_join_without_a_copy(triton_on_cpu):
    """Inductor's reinplacing writes the op's rows into the joined buffer (no clone of it), and the other pieces
    go into their rows (no full copy of the join)."""
    torch.manual_seed(2)
    args = qwen_inputs()
    out, code, p = _compiled_code(qwen_joint, args, backend="triton")
    assert "rope_fusion.rotary_qk_into_" in code, code
    for copy in ("clone", "slice_scatter"):
        assert copy not in code, f"{copy} in the generated code:\n{code}"
    check_numerics(qwen_joint, args, out, context=p.report.table())
    args = hunyuan_inputs()
    out, code, p = _compiled_code(hunyuan_dual_stream, args, backend="triton")
    assert "rope_fusion.rotary_qk_into_" in code and "clone" not in code, code
    check_numerics(hunyuan_dual_stream, args, out, context=p.report.table())


def test_a_rotation_read_elsewhere_keeps_the_cat_and_says_why(triton_on_cpu):
    torch.manual_seed(3)
    x, y = torch.randn(2, HEADS, IMAGE, D), torch.randn(2, HEADS, TEXT, D)
    cos, sin = torch.randn(IMAGE, D), torch.randn(IMAGE, D)
    out, p = compile_with_pass(joined_twice, x, y, cos, sin, backend="triton")
    r = p.report
    assert len(r.kernels) == 1 and r.kernels[0].fold == (
        "joined write not folded: the rotation is read by more than the cat that joins it"), r.table()
    assert _counts(p)["aten.cat.default"] == 1
    check_numerics(joined_twice, (x, y, cos, sin), out, context=r.table())


def test_the_lowering_leaves_the_join_to_inductor():
    """Inductor's cat has the lowering's kernels write into the join already: nothing folded, the cat kept."""
    torch.manual_seed(4)
    args = qwen_inputs()
    out, p = compile_with_pass(qwen_joint, *args, backend="inductor")
    r = p.report
    assert len(r.kernels) == 2 and all(not k.fold for k in r.kernels), r.table()
    assert _counts(p)["aten.cat.default"] == 3
    check_numerics(qwen_joint, args, out, context=r.table())


@pytest.mark.parametrize("in_place", [False, True])
def test_the_into_op_writes_only_its_rows(in_place, request):
    """The op on its own: rows [s, e) of each output hold the rotation of its source (fp64 reference), every other
    row is untouched; the reference on the CPU, the interpreted kernel with `in_place`."""
    if in_place:
        request.getfixturevalue("triton_on_cpu")
    torch.manual_seed(5)
    kw = dict(interleaved=True, rotary_dim=16, full_tables=True, conjugate=False, out_dtype=torch.float32)
    for s, e in ((0, 5), (3, 8)):
        q, k = torch.randn(2, HEADS, e - s, D), torch.randn(2, HEADS, e - s, D)
        qo, ko = torch.randn(2, HEADS, 8, D), torch.randn(2, HEADS, 8, D)
        qb, kb = qo.clone(), ko.clone()
        cos, sin = torch.randn(e - s, D), torch.randn(e - s, D)
        for _ in range(2):  # the second call runs the plan of the first's geometry
            torch.ops.rope_fusion.rotary_qk_into_(qb, kb, q, k, cos, sin, **kw, slice_dims=[2, 2],
                                                  slice_starts=[s, s], slice_ends=[e, e])
        for got, x, before in ((qb, q, qo), (kb, k, ko)):
            want = rotary_reference(x.double(), cos.double(), sin.double(), **{**kw, "out_dtype": torch.float64})
            torch.testing.assert_close(got[:, :, s:e].double(), want, rtol=1e-6, atol=1e-6)
            assert torch.equal(got[:, :, :s], before[:, :, :s]) and torch.equal(got[:, :, e:], before[:, :, e:])


def test_a_source_overlapping_its_rows_is_computed_apart(triton_on_cpu):
    """x a slice of the output shifted by one row: written row by row it would read rows already written; the op
    computes it apart, then copies it in."""
    torch.manual_seed(6)
    kw = dict(interleaved=False, rotary_dim=16, full_tables=True, conjugate=False, out_dtype=torch.float32)
    base = torch.randn(2, HEADS, 9, D)
    x = base[:, :, 0:8]
    c, s = torch.randn(8, D), torch.randn(8, D)
    want = rotary_reference(x.double(), c.double(), s.double(), **{**kw, "out_dtype": torch.float64})
    first = base[:, :, :1].clone()
    torch.ops.rope_fusion.rotary_into_(base, x, c, s, **kw, slice_dims=[2], slice_starts=[1], slice_ends=[9])
    torch.testing.assert_close(base[:, :, 1:].double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(base[:, :, :1], first)


def test_the_into_op_names_a_bad_call():
    kw = dict(interleaved=False, rotary_dim=16, full_tables=True, conjugate=False, out_dtype=torch.float32)
    out, x = torch.randn(2, 9, 16), torch.randn(2, 4, 16)
    cos, sin = torch.randn(4, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="written into a slice of shape"):
        torch.ops.rope_fusion.rotary_into_(out, x, cos, sin, **kw, slice_dims=[1], slice_starts=[0], slice_ends=[5])
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.rope_fusion.rotary_into_(out, x, cos, sin, **kw, slice_dims=[1], slice_starts=[7], slice_ends=[11])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fn,make", [(hunyuan_dual_stream, hunyuan_inputs), (qwen_joint, qwen_inputs)])
def test_gpu_joined_writes_write_into_the_join(fn, make):
    """On a GPU, compiled: the Triton kernel's user-kernel node writes each rotation into its rows of the join, no
    clone of the join and no cat of q or k is left, and every call keeps the numerics contract."""
    torch.manual_seed(32)
    args = [a.cuda() for a in make(torch.bfloat16)]
    out, code, p = _compiled_code(fn, args, backend="triton")
    assert p.report.kernels and all(k.fold.startswith("joined write:") for k in p.report.kernels), p.report.table()
    # the kernel's own launch (its user-kernel node, handed the whole join): no into op, no clone of the join
    assert "rotary_kernel" in code and "rotary_qk_into_" not in code and "clone" not in code, code
    check_numerics(fn, args, out, context=p.report.table())
    compiled = torch.compile(fn, fullgraph=True)
    with torch._inductor.config.patch(post_grad_custom_post_pass=p):
        for _ in range(3):
            args = [torch.randn_like(a) if a.dim() > 1 else a for a in args]
            check_numerics(fn, args, compiled(*args), context=p.report.table())


def prx_k_joined(q, k, v, tk, tv, cos, sin):
    """PRX's attention: image q and k rotated, text k (and v) joined before the image's, q not joined."""
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    k = torch.cat([tk, k], dim=2)
    return F.scaled_dot_product_attention(q, k, torch.cat([tv, v], dim=2))


def test_a_pair_with_one_member_joined_stays_one_launch(triton_on_cpu):
    """k is joined after its rotation, q is not: q is written whole into a tensor of its own, k into its rows of
    the join, in one call."""
    torch.manual_seed(8)
    args = (*[torch.randn(2, HEADS, IMAGE, D) for _ in range(3)], *[torch.randn(2, HEADS, TEXT, D) for _ in range(2)],
            torch.randn(IMAGE, D), torch.randn(IMAGE, D))
    out, p = compile_with_pass(prx_k_joined, *args, backend="triton")
    r = p.report
    assert (len(r.sites), len(r.kernels)) == (2, 1), r.table()
    assert r.kernels[0].fold.startswith("joined write: its own tensor, cat"), r.table()
    counts = _counts(p)
    assert counts["aten.cat.default"] == 1 and counts["auto_functionalized"] == 1, counts  # v's cat stays
    check_numerics(prx_k_joined, args, out, context=r.table())


def _run_zoo(name):
    """The zoo's tiny model (tests/zoo/entries.py) on fresh inputs through the pass with the Triton backend forced:
    (the pass, the fused output's error and the eager model's own, both against the model in fp64)."""
    pytest.importorskip("diffusers")
    from tests.zoo.entries import by_name

    torch.manual_seed(0)
    model, inputs = by_name(name).build()
    model.eval()
    inputs = {k: torch.randn_like(v) if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "timestep"
              else v for k, v in inputs.items()}
    names = list(inputs)

    def forward(*args):
        return model(**dict(zip(names, args)), return_dict=False)[0]

    p = rope_fusion.RopeFusionPass(backend="triton")
    joined = []  # per graph after the pass: the cats that read a fused op's result

    def fuse_then_look(graph):
        p(graph)
        joined.append([n.name for n in graph.nodes if n.target is torch.ops.aten.cat.default
                       and any(_reads_rotation(a) for a in n.args[0])])

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(post_grad_custom_post_pass=fuse_then_look,
                                                       fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(forward, fullgraph=False)(*inputs.values())
        eager = forward(*inputs.values())
        model.to(torch.float64)
        ref = forward(*(v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                        for v in inputs.values()))
        model.to(torch.float32)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    return p, joined, rel(out, ref), rel(eager, ref)


def _reads_rotation(node, depth=6):
    """Whether node is a fused op's result, through getitem and layout views."""
    for _ in range(depth):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return False
        if "rope_fusion" in str(node.target) or node.target is torch.ops.higher_order.auto_functionalized and \
                "rope_fusion" in str(node.args[0]):
            return True
        if not node.args:
            return False
        node = node.args[0]
    return False


@pytest.mark.parametrize("name,sites", [pytest.param("hunyuan_video", 4, marks=pytest.mark.slow),
                                        pytest.param("qwenimage", 8, marks=pytest.mark.slow),
                                        pytest.param("prx", 4, marks=pytest.mark.slow)])  # 25-36 s each: CI's -m slow
def test_diffusers_joins_after_the_rotation_are_written_into(triton_on_cpu, name, sites):
    """Unmodified diffusers models: every q/k kernel writes its rotations into the joins after them (HunyuanVideo's
    dual- and single-stream blocks, Qwen-Image's text and image streams, PRX's k), no cat of a rotation is left,
    and the result keeps the numerics contract against the model in fp64."""
    p, joined, err_fused, err_eager = _run_zoo(name)
    r = p.report
    assert len(r.sites) == sites and len(r.kernels) == sites // 2, r.table()
    assert all(k.fold.startswith("joined write:") for k in r.kernels), r.table()
    assert joined and all(not cats for cats in joined), (joined, r.table())
    assert err_fused <= err_eager + torch.finfo(torch.float32).eps, (err_fused, err_eager, r.table())


@pytest.mark.parametrize("fast,emitted", [("triton", "op"), ("left", "op"), ("triton", "node")])
def test_auto_times_the_joined_write_as_it_runs(triton_on_cpu, monkeypatch, tmp_path, fast, emitted):
    """Under `auto` the Triton candidate of a group joined after its rotation is the joined write as the graph runs
    it: each rotation written into its rows of a new tensor of the join's shape (not the plain kernel writing a
    tensor of its own), by the into op where the pass emits it, by the kernel's planned launch with no dispatcher
    where it emits the kernel's own node (CUDA; the CPU stands in, `timed_as_nodes`); its rows are the rotations
    "left" computes, and the fold is emitted exactly where its timing wins."""
    if emitted == "node":
        timed_as_nodes(monkeypatch)
    outputs, ops_called = stub_clock(monkeypatch, tmp_path, 5.0 if fast == "triton" else 11.0)
    torch.manual_seed(3)  # auto's check draws its inputs from the global generator
    args = hunyuan_inputs()
    out, p = compile_with_pass(hunyuan_dual_stream, *args, backend="auto")
    r = p.report
    assert sorted(outputs) == ["inductor", "left", "triton"], r.table()
    assert ("rope_fusion::rotary_qk_into_" in ops_called) == (emitted == "op"), sorted(set(ops_called))
    for got, want in zip(outputs["triton"], outputs["left"]):
        assert tuple(got.shape) == tuple(want.shape) and got.stride() != want.stride()  # rows of the join
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if fast == "triton":
        assert len(r.kernels) == 1 and r.kernels[0].fold.startswith("joined write:"), r.table()
        assert r.kernels[0].choice.startswith("measured triton 5.0 us, left 10.0 us"), r.table()
        assert "timed as the plain kernel" not in r.kernels[0].choice, r.table()
        assert _counts(p)["aten.cat.default"] == 1  # v's cat alone
    else:
        assert not r.kernels, r.table()
    check_numerics(hunyuan_dual_stream, args, out, context=r.table())
