"""The slice and joined-write folds as Inductor's own user-kernel node: on CUDA the pass emits the Triton kernel's
launch with each written tensor passed whole and its slice's offset a kernel argument (kernels/triton_slice.py
`emit_node`), where it emitted `rotary*_slice_` / `rotary*_into_` through `auto_functionalized`. The kernel then
compiles in Inductor's workers with the rest of the graph (the op's launches compiled in the main process), and
Inductor's reinplacing writes the fresh join, or a base nothing reads afterwards, in place.

The graphs are traced with fake CUDA tensors, which needs no GPU: the node, its arguments and what Inductor's own
passes make of it are checked here. The kernel's offset outputs are checked against fp64 with the interpreted
kernel on the CPU (the function the node traces, on real tensors); the GPU tests of the folds
(tests/passes/test_joined_writes.py, test_slice_writes.py) compile the models and check their numerics.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

pytest.importorskip("triton")

from torch._higher_order_ops.triton_kernel_wrap import (  # noqa: E402
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from rope_fusion.kernels import triton_launch  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.ops.schema import RotaryCall, RotaryParams  # noqa: E402
from tests.helpers.diffusers_rotary import rms  # noqa: E402
from tests.helpers.fake_cuda import inductor_reinplaced, pass_graph, written_by_kernel  # noqa: E402

if triton_launch.INTERPRETED:  # TRITON_INTERPRET=1 set for the whole run
    pytest.skip("the kernel module was imported under TRITON_INTERPRET=1: make_fx cannot trace it",
                allow_module_level=True)

aten = torch.ops.aten


def rope(x, cos, sin):
    """NeoX rotate-half on [B, H, S, D] with [S, D] tables, broadcast with unsqueeze (make_fx on CPU-only torch
    cannot index fake CUDA tensors with None)."""
    cos, sin = cos.unsqueeze(0).unsqueeze(0), sin.unsqueeze(0).unsqueeze(0)
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def qwen_joint(tq, tk, iq, ik, tcos, tsin, icos, isin):
    """Qwen-Image's joint attention: each stream rotated with its own tables, joined text first."""
    q = torch.cat([rope(tq, tcos, tsin), rope(iq, icos, isin)], dim=2)
    k = torch.cat([rope(tk, tcos, tsin), rope(ik, icos, isin)], dim=2)
    return q, k


def hunyuan_dual_stream(q, k, eq, ek, wq, wk, weq, wek, cos, sin):
    """HunyuanVideo's dual stream: the image stream normed and rotated, the text stream normed, joined after."""
    q, k = rope(rms(q, wq), cos, sin), rope(rms(k, wk), cos, sin)
    return torch.cat([q, rms(eq, weq)], dim=2), torch.cat([k, rms(ek, wek)], dim=2)


def cogvideox_qk(q, k, cos, sin, text):
    """CogVideoX: the video rows of q and k rotated and written back (`q[:, :, text:text + rows] = rope(...)`, as
    the post-grad graph spells it)."""
    q, k = q * 1.0, k * 1.0  # bases the graph computes, which the fold may write in place
    rows = cos.shape[0]
    q = torch.slice_scatter(q, rope(q.narrow(2, text, rows), cos, sin), 2, text, text + rows)
    k = torch.slice_scatter(k, rope(k.narrow(2, text, rows), cos, sin), 2, text, text + rows)
    return q, k


def read_again(x, cos, sin, text):
    """The base is read again after the write: Inductor must write a clone of it."""
    x = x * 1.0
    y = torch.slice_scatter(x, rope(x.narrow(2, text, cos.shape[0]), cos, sin), 2, text)
    return x + 1.0, y


def _fake(shapes):
    with FakeTensorMode():
        return [torch.empty(s, device="cuda", dtype=dt) for s, dt in shapes]


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes]


def _no_ops_of_the_family(gm):
    targets = _targets(gm)
    assert not any("_into_" in t or "_slice_" in t or "auto_functionalized" in t for t in targets), targets


@pytest.mark.parametrize("text,image,heads,d", [(3, 5, 2, 16), (7, 64, 4, 128)])
def test_qwen_joint_writes_the_join_through_two_chained_nodes(text, image, heads, d):
    """Both streams' q and k go to one join each: the text's launch writes rows [0, text) of the fresh joins, the
    image's launch the rows after, each handed the whole join and its rows' offset; no cat, no into op."""
    bf, f32 = torch.bfloat16, torch.float32
    args = _fake([((2, heads, text, d), bf)] * 2 + [((2, heads, image, d), bf)] * 2 + [((text, d), f32)] * 2
                 + [((image, d), f32)] * 2)
    p, gm = pass_graph(qwen_joint, args)
    assert len(p.report.kernels) == 2 and all(k.fold.startswith("joined write:") for k in p.report.kernels), \
        p.report.table()
    _no_ops_of_the_family(gm)
    assert "aten.cat.default" not in _targets(gm)
    first, second = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    joins = [n for n in gm.graph.nodes if n.target is aten.empty_strided.default]
    assert [first.kwargs["kwargs"][k] for k in ("qo_ptr", "ko_ptr")] == joins
    for node, start in ((first, 0), (second, text)):
        kw = node.kwargs["kwargs"]
        stride = kw["qo_ptr"].meta["val"].stride(2)
        assert (kw["qo_off"], kw["ko_off"]) == (start * stride, start * stride)
        assert tuple(kw["qo_ptr"].meta["val"].shape) == (2, heads, text + image, d)
        assert sorted(node.kwargs["tensors_to_clone"]) == ["ko_ptr", "qo_ptr"]
    # the image's launch writes what the text's wrote: the chain Inductor reinplaces
    assert second.kwargs["kwargs"]["qo_ptr"].args == (first, "qo_ptr")
    gm = inductor_reinplaced(gm, args[0].fake_mode)
    assert "aten.clone.default" not in _targets(gm), _targets(gm)
    mutations = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_mutation]
    assert len(mutations) == 2 and all(m.kwargs["kwargs"]["qo_ptr"] is joins[0] for m in mutations)


def rope_bshd(x, cos, sin, interleaved=False, rotary_dim=None):
    """[B, S, H, D] with [S, R] tables: NeoX or interleaved pairs over the first R lanes, the rest passed through."""
    r = rotary_dim or x.shape[-1]
    rot, tail = x.narrow(-1, 0, r).float(), x.narrow(-1, r, x.shape[-1] - r)  # no [...] on fake CUDA: see above
    cos, sin = cos.unsqueeze(0).unsqueeze(2), sin.unsqueeze(0).unsqueeze(2)
    if interleaved:
        even, odd = rot.reshape(*rot.shape[:-1], r // 2, 2).unbind(-1)
        turned = torch.stack([-odd, even], -1).reshape(rot.shape)
    else:
        a, b = rot.chunk(2, -1)
        turned = torch.cat([-b, a], -1)
    return torch.cat([(rot * cos + turned * sin).to(x.dtype), tail], -1)


def joint_bshd(tq, tk, iq, ik, cos, sin, interleaved=False, rotary_dim=None):
    """Both streams' q and k rotated by one table each and joined along the sequence ([B, S, H, D], dim 1)."""
    t, i = tq.shape[1], iq.shape[1]
    ct, st, ci, si = cos.narrow(0, 0, t), sin.narrow(0, 0, t), cos.narrow(0, t, i), sin.narrow(0, t, i)
    q = torch.cat([rope_bshd(tq, ct, st, interleaved, rotary_dim), rope_bshd(iq, ci, si, interleaved, rotary_dim)], 1)
    k = torch.cat([rope_bshd(tk, ct, st, interleaved, rotary_dim), rope_bshd(ik, ci, si, interleaved, rotary_dim)], 1)
    return q, k


def prx_k_joined(q, k, tk, cos, sin):
    """PRX: the image q and k rotated, the text k joined before the image's, q not joined."""
    q, k = rope_bshd(q, cos, sin), rope_bshd(k, cos, sin)
    return q, torch.cat([tk, k], 1)


def qkv_rows(q, k, v, cos, sin, text):
    """q, k and v's video rows rotated by one table and written back ([B, S, H, D], dim 1)."""
    rows = cos.shape[0]
    out = []
    for x in (q * 1.0, k * 1.0, v * 1.0):
        out.append(torch.slice_scatter(x, rope_bshd(x.narrow(1, text, rows), cos, sin), 1, text, text + rows))
    return tuple(out)


_BF, _F32 = torch.bfloat16, torch.float32
_FORMS = {
    # name: (fn, the tensors' shapes and dtypes, extra args, the rows written: (dim, each launch's start) or None)
    "neox, GQA heads": (joint_bshd, [((2, 3, 8, 64), _BF), ((2, 3, 2, 64), _BF), ((2, 13, 8, 64), _BF),
                                     ((2, 13, 2, 64), _BF), ((16, 64), _F32), ((16, 64), _F32)], (False, None),
                        (1, [0, 3])),
    "interleaved, D=80": (joint_bshd, [((1, 5, 4, 80), _BF)] * 2 + [((1, 7, 4, 80), _BF)] * 2
                          + [((12, 80), _F32)] * 2, (True, None), (1, [0, 5])),
    "partial rotary": (joint_bshd, [((2, 4, 2, 64), _BF)] * 2 + [((2, 6, 2, 64), _BF)] * 2
                       + [((10, 32), _F32)] * 2, (False, 32), (1, [0, 4])),
    "PRX, q its own tensor": (prx_k_joined, [((2, 6, 4, 32), _BF)] * 2 + [((2, 3, 4, 32), _BF)]
                              + [((6, 32), _F32)] * 2, (), None),
    "q, k and v rows": (qkv_rows, [((2, 11, 4, 64), _BF)] * 3 + [((8, 64), _F32)] * 2, (3,), (1, [3])),
}


@pytest.mark.parametrize("form", list(_FORMS))
def test_every_form_is_a_node_on_the_whole_tensor_at_its_rows_offset(form):
    """Across layouts, pairings, partial rotary, GQA heads, a member written whole into its own tensor and three
    tensors: the writes are user-kernel nodes only, each handed whole tensors and each written tensor's offset the
    start of its rows times their stride, and Inductor's reinplacing writes them in place (no clone)."""
    fn, shapes, extra, rows = _FORMS[form]
    args = [*_fake(shapes), *extra]
    p, gm = pass_graph(fn, args)
    folds = [k.fold.split(":")[0] for k in p.report.kernels]
    assert folds and set(folds) <= {"joined write", "slice write"}, p.report.table()
    _no_ops_of_the_family(gm)
    nodes = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    assert nodes
    if rows is not None:
        dim, starts = rows
        got = []
        for node in nodes:  # every side of a launch starts at the same row of its own tensor (GQA: other strides)
            kw = node.kwargs["kwargs"]
            first = {divmod(kw[f"{s}o_off"], kw[f"{s}o_ptr"].meta["val"].stride(dim)) for s in "qkv"[:kw["NSIDES"]]}
            assert len(first) == 1 and next(iter(first))[1] == 0, first
            got.append(next(iter(first))[0])
        assert sorted(got) == starts
    else:  # PRX: q written whole into a tensor of its own, k into the image rows of the join after the text
        kw = nodes[0].kwargs["kwargs"]
        assert kw["qo_off"] == 0 and kw["ko_off"] == 3 * kw["ko_ptr"].meta["val"].stride(1)
    if "aten.slice_scatter.default" not in _targets(gm):  # (PRX's text k: a scatter CPU-only torch cannot reinplace)
        gm = inductor_reinplaced(gm, args[0].fake_mode)
        assert "aten.clone.default" not in _targets(gm), _targets(gm)


def test_hunyuan_normed_rotation_writes_the_image_rows_and_the_text_is_scattered():
    """The image stream's normed rotation writes rows [0, image) of each join; the text stream, normed by plain
    compile, is scattered into the rows after (the copy the cat made of it). (Inductor's reinplacing of that
    scatter copies fake CUDA tensors, which CPU-only torch cannot: the GPU test compiles it.)"""
    bf = torch.bfloat16
    args = _fake([((2, 2, 5, 16), bf)] * 2 + [((2, 2, 3, 16), bf)] * 2 + [((16,), bf)] * 4
                 + [((5, 16), torch.float32)] * 2)
    p, gm = pass_graph(hunyuan_dual_stream, args)
    assert len(p.report.kernels) == 1 and p.report.kernels[0].fold.startswith("joined write:"), p.report.table()
    _no_ops_of_the_family(gm)
    node, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    kw = node.kwargs["kwargs"]
    assert kw["NORM"] == 1 and (kw["qo_off"], kw["ko_off"]) == (0, 0)
    scatters = [n for n in gm.graph.nodes if n.target is aten.slice_scatter.default]
    assert len(scatters) == 2 and {s.args[0].args[0] for s in scatters} == {node}
    assert [s.args[3:5] for s in scatters] == [(5, 8), (5, 8)]


@pytest.mark.parametrize("text,rows,tail", [(3, 8, 0), (0, 8, 3), (5, 2, 1)])
def test_cogvideox_slice_write_rotates_the_base_in_place(text, rows, tail):
    """Each base is passed whole with the offset of its slice, read through the slice itself: Inductor's
    reinplacing then writes the bases the graph computed, with no clone and no scatter."""
    bf = torch.bfloat16
    args = [*_fake([((2, 4, text + rows + tail, 64), bf)] * 2 + [((rows, 64), torch.float32)] * 2), text]
    p, gm = pass_graph(cogvideox_qk, args)
    assert len(p.report.kernels) == 1 and p.report.kernels[0].fold.startswith("slice write:"), p.report.table()
    _no_ops_of_the_family(gm)
    assert "aten.slice_scatter.default" not in _targets(gm)
    node, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    kw = node.kwargs["kwargs"]
    bases = [kw["qo_ptr"], kw["ko_ptr"]]
    assert all(b.target is aten.mul.Tensor for b in bases)
    assert (kw["qo_off"], kw["ko_off"]) == (text * 64, text * 64)
    if text:  # x is read as the slice of its base (a slice from row 0 starts where its base does: the base)
        assert [kw[n].target for n in ("q_ptr", "k_ptr")] == [aten.slice.Tensor] * 2
        assert [kw[n].args[0] for n in ("q_ptr", "k_ptr")] == bases
    else:
        assert [kw[n] for n in ("q_ptr", "k_ptr")] == bases
    gm = inductor_reinplaced(gm, args[0].fake_mode)
    assert "aten.clone.default" not in _targets(gm), _targets(gm)
    mut, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_mutation]
    assert [mut.kwargs["kwargs"][k] for k in ("qo_ptr", "ko_ptr")] == bases


def test_a_base_read_again_is_written_as_a_clone():
    """The base is read after the write: Inductor clones it for the node, so the later read sees its old
    values."""
    args = [*_fake([((2, 4, 11, 64), torch.bfloat16)] + [((8, 64), torch.float32)] * 2), 3]
    p, gm = pass_graph(read_again, args)
    assert len(p.report.kernels) == 1 and p.report.kernels[0].fold.startswith("slice write:"), p.report.table()
    gm = inductor_reinplaced(gm, args[0].fake_mode)
    mut, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_mutation]
    base = mut.kwargs["kwargs"]["qo_ptr"]
    assert "aten.clone.default" in _targets(gm) and base.target is not aten.mul.Tensor


def test_inductors_analysis_finds_only_the_bases_written(monkeypatch):
    """Inductor reads a user kernel's TTIR to find what it writes and clones any other tensor it finds written:
    the offset launch writes the bases alone (a stand-in driver names an sm_90 target for the TTIR; nothing runs)."""
    args = [*_fake([((2, 4, 11, 64), torch.bfloat16)] * 2 + [((8, 64), torch.float32)] * 2), 3]
    _p, gm = pass_graph(cogvideox_qk, args)
    node, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    assert written_by_kernel(monkeypatch, node, args[0].fake_mode) == ["ko_ptr", "qo_ptr"]


def _params(out_dtype, *, interleaved=False, rotary_dim=64, norm="none"):
    return RotaryParams(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=True, conjugate=False,
                        out_dtype=out_dtype, norm=norm)


def _node(name, val):
    node = fx.Graph().placeholder(name)
    node.meta["val"] = val
    return node


def test_symbolic_bounds_and_the_cpu_keep_the_op():
    """A bound the graph computes (a symbolic text length) is no launch constant, and Inductor compiles user
    Triton kernels for GPUs only: both keep the op (`emit_node` declines, and the pass emits it)."""
    from rope_fusion.ops.slice_write import WrittenCall, emit_node

    for device in ("cuda", "cpu"):
        fm = FakeTensorMode()
        with fm:
            base, cos = torch.empty(2, 4, 11, 64, device=device), torch.empty(8, 64, device=device)
        nodes = [_node(n, v) for n, v in (("q", base), ("cos", cos), ("sin", cos))]
        call = RotaryCall([nodes[0]], nodes[1], nodes[2], _params(torch.float32))
        graph = fx.Graph()
        bound = _node("text", 3)
        got = [emit_node(graph, fm, WrittenCall([nodes[0]], call, [(2, start, 11)], False), nodes[0])
               for start in (3, bound)]
        if device == "cuda":
            assert got[0] is not None and got[1] is None
        else:
            assert got == [None, None]


# -- the offset outputs on real numbers: the interpreted kernel, the function the node traces --------------------


def _written(seed, *, into, interleaved, rotary_dim, normed, arity, heads=(3,)):
    """Bases [B, S, H, D] with a slice of rows along S, sources of the slice's shape (into), tables, weights; tensor
    i has heads[i] heads (the last entry repeats: GQA's k with fewer heads than q)."""
    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, 9, 16
    start, rows = 2, 5
    hs = [heads[min(i, len(heads) - 1)] for i in range(arity)]
    bases = [torch.randn(b, s, h, d, generator=g, dtype=torch.float64).float() for h in hs]
    xs = [torch.randn(b, rows, h, d, generator=g, dtype=torch.float64).float() for h in hs]
    angles = torch.randn(rows, rotary_dim // 2, generator=g, dtype=torch.float64)
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles, angles], -1)
    weights = [1.0 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64).float() for _ in range(arity)] \
        if normed else None
    params = _params(torch.float32, interleaved=interleaved, rotary_dim=rotary_dim, norm="rms" if normed else "none")
    cos, sin = angles.cos().float().unsqueeze(1), angles.sin().float().unsqueeze(1)  # [S, 1, R]: over the heads
    return bases, xs, cos, sin, weights, params, (1, start, start + rows)


@pytest.mark.triton_on_cpu(serves=("slice_write",))
@pytest.mark.parametrize("into", [True, False])
@pytest.mark.parametrize("interleaved,rotary_dim,normed,arity,heads", [
    (False, 16, False, 2, (3,)), (True, 16, True, 2, (3,)), (False, 8, False, 1, (3,)), (True, 12, False, 3, (3,)),
    (False, 16, True, 2, (4, 2))])
def test_the_offset_launch_writes_only_its_rows(triton_on_cpu, into, interleaved, rotary_dim, normed, arity, heads):
    """`launch_at_offsets` on real tensors: each base's slice holds the rotation (of its source, or of the slice
    itself) within the numbers contract of fp64, and every other row is the base's own, bit for bit."""
    from rope_fusion.kernels.triton_slice import launch_at_offsets, plan_in_place
    from rope_fusion.ops.reference import rms_norm

    bases, xs, cos, sin, weights, params, (dim, start, end) = _written(
        7 * arity + rotary_dim + sum(heads), into=into, interleaved=interleaved, rotary_dim=rotary_dim,
        normed=normed, arity=arity, heads=heads)
    before = [b.clone() for b in bases]
    views = [b.narrow(dim, start, end - start) for b in bases]
    sources = xs if into else [v.clone() for v in views]
    call = RotaryCall(xs if into else views, cos, sin, params, None, weights)
    runner = plan_in_place(call, views if into else None)
    assert runner is not None
    launch_at_offsets(runner, xs if into else views, bases, views, cos, sin, None, weights)
    for i, (base, old, src) in enumerate(zip(bases, before, sources)):
        x = src.double()
        if normed:
            x = rms_norm(x, "rms", params.norm_eps, weights[i].double())
        exact = params.replace(norm="none", out_dtype=torch.float64)
        want = rotary_reference(x, cos.double(), sin.double(), **exact.kwargs())
        torch.testing.assert_close(base.narrow(dim, start, end - start).double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(base.narrow(dim, 0, start), old.narrow(dim, 0, start))
        assert torch.equal(base.narrow(dim, end, base.shape[dim] - end), old.narrow(dim, end, old.shape[dim] - end))
