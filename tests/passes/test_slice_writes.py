"""A rotation written back into a slice of a larger tensor (CogVideoX's `q[:, :, text:] = rope(q[:, :, text:])`)
is folded into the fused node for a backend whose node Inductor cannot fuse with the scatter: the op
`rope_fusion::rotary*_slice_` rotates the rows of the slice in place, emitted as `auto_functionalized`, and
Inductor's reinplacing writes into the base (or into a clone of it, where the base is read again).

The Triton kernel runs interpreted on the CPU (tests/helpers/triton_interpreted.py); Inductor compiles the rest of the
graph to C++. The numerics are checked against an fp64 evaluation of the model's own code on fresh inputs.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from torch._inductor.utils import run_and_get_code  # noqa: E402

import rope_fusion  # noqa: E402
from rope_fusion.ops import slice_write  # noqa: E402
from rope_fusion.ops.plan_cache import plan_cache  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from tests.helpers.compile_pass import compile_with_pass  # noqa: E402
from tests.helpers.numerics import check_numerics, fp64_eval  # noqa: E402

TEXT = 3


pytestmark = pytest.mark.triton_on_cpu(serves=("slice_write",))  # the Triton backend, in place for the slice op too


def rope(x, cos, sin):
    """diffusers' apply_rotary_emb (use_real, unbind -1), as CogVideoX calls it on [B, H, S, D]."""
    cos, sin = cos[None, None], sin[None, None]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def cogvideox_attention(q, k, v, cos, sin):
    q = F.layer_norm(q, (q.shape[-1],))
    k = F.layer_norm(k, (k.shape[-1],))
    q[:, :, TEXT:] = rope(q[:, :, TEXT:], cos, sin)
    k[:, :, TEXT:] = rope(k[:, :, TEXT:], cos, sin)
    return F.scaled_dot_product_attention(q, k, v)


def middle_rows(x, cos, sin):
    y = x * 1.0
    y[:, :, TEXT:TEXT + cos.shape[0]] = rope(y[:, :, TEXT:TEXT + cos.shape[0]], cos, sin)
    return y


def read_again(x, cos, sin):
    """The base is read after the write (its old values): Inductor must write into a clone."""
    y = x * 2.0
    z = torch.slice_scatter(y, rope(y[:, :, TEXT:], cos, sin), 2, TEXT)
    return z, y + 1.0


def shifted_rows(x, cos, sin):
    """Rows read and rows written differ: not a write of the rotation into its own slice."""
    y = x * 1.0
    y[:, :, TEXT + 1:] = rope(y[:, :, TEXT:-1], cos, sin)
    return y


def inputs(s=11, rows=None, heads=2, d=16, dtype=torch.float32, n=3):
    rows = rows if rows is not None else s - TEXT
    xs = [torch.randn(2, heads, s, d, dtype=dtype) for _ in range(n)]
    return (*xs, torch.randn(rows, d), torch.randn(rows, d))


def _compiled_code(fn, args, **pass_kw):
    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass(**pass_kw)
    with torch._inductor.config.patch(post_grad_custom_post_pass=p, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code), p


def _after(p):
    return p.capture.graphs[-1].after.counts


def test_cogvideox_attention_writes_into_q_and_k(triton_on_cpu):
    args = inputs()
    out, p = compile_with_pass(cogvideox_attention, *[a.clone() for a in args], backend="triton")
    r = p.report
    assert (len(r.sites), len(r.kernels)) == (2, 1), r.table()
    assert r.kernels[0].op == "rope_fusion.rotary_qk" and r.kernels[0].fold.startswith("slice write:"), r.table()
    counts = _after(p)
    assert counts["aten.slice_scatter.default"] == 0 and counts["aten.copy.default"] == 0, counts
    assert counts["auto_functionalized"] == 1 and p.capture.graphs[-1].after.rope_ops == 1, counts
    check_numerics(cogvideox_attention, [a.clone() for a in args], out, context=r.table())


def test_generated_code_rotates_in_place(triton_on_cpu):
    args = inputs()
    out, code, p = _compiled_code(cogvideox_attention, [a.clone() for a in args], backend="triton")
    assert "rope_fusion.rotary_qk_slice_" in code, code
    for copy in ("slice_scatter", "clone", ".copy_("):
        assert copy not in code, f"{copy} in the generated code:\n{code}"
    check_numerics(cogvideox_attention, [a.clone() for a in args], out, context=p.report.table())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untouched_rows_equal_the_input(triton_on_cpu, dtype):
    x, cos, sin = inputs(s=13, rows=6, dtype=dtype, n=1)
    out, p = compile_with_pass(middle_rows, x, cos, sin, backend="triton")
    assert p.report.kernels and p.report.kernels[0].fold, p.report.table()
    assert torch.equal(out[:, :, :TEXT], x[:, :, :TEXT]) and torch.equal(out[:, :, TEXT + 6:], x[:, :, TEXT + 6:])
    check_numerics(middle_rows, (x, cos, sin), out, context=p.report.table())


def test_a_base_read_again_keeps_its_values(triton_on_cpu):
    x, cos, sin = inputs(n=1)
    (z, y1), code, p = _compiled_code(read_again, (x, cos, sin), backend="triton")
    assert p.report.kernels and p.report.kernels[0].fold, p.report.table()
    assert "rope_fusion.rotary_slice_" in code and "slice_scatter" not in code, code
    assert "clone" in code, code  # Inductor's reinplacing left the base alone and wrote into its copy
    want = fp64_eval(read_again, x, cos, sin)
    torch.testing.assert_close(y1, (2.0 * x + 1.0))  # the old values of the base, not the rotated ones
    check_numerics(read_again, (x, cos, sin), (z, y1), context=p.report.table())
    assert torch.equal(z[:, :, :TEXT], (2.0 * x)[:, :, :TEXT]) and want[0].dtype == torch.float64


def test_other_rows_are_not_folded_and_say_why(triton_on_cpu):
    x, cos, sin = inputs(rows=7, n=1)
    out, p = compile_with_pass(shifted_rows, x, cos, sin, backend="triton")
    r = p.report
    assert len(r.sites) == 1, r.table()
    assert r.kernels[0].fold == "slice write not folded: it is written into other rows than its x is read from", \
        r.table()
    assert "slice write not folded" in r.table(verbose=True) and "slice write not folded" not in r.table()
    assert _after(p)["aten.slice_scatter.default"] == 1
    check_numerics(shifted_rows, (x, cos, sin), out, context=r.table())


def test_the_lowering_keeps_the_scatter_it_fuses_with():
    """On the CPU (`auto`: the lowering) nothing is folded: Inductor fuses the op's lowering with the scatter and
    writes each row once, which the fold would only split into two kernels."""
    args = inputs()
    out, code, p = _compiled_code(cogvideox_attention, [a.clone() for a in args])
    assert [k.fold for k in p.report.kernels] == [""], p.report.table()
    assert "rotary_qk_slice_" not in code
    check_numerics(cogvideox_attention, [a.clone() for a in args], out, context=p.report.table())


@pytest.mark.parametrize("in_place", [False, True])
def test_the_op_rotates_only_its_rows(monkeypatch, in_place, request):
    if in_place:
        request.getfixturevalue("triton_on_cpu")
    q, k = torch.randn(2, 5, 3, 32), torch.randn(2, 5, 1, 32)
    cos, sin = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    kw = dict(interleaved=False, rotary_dim=32, full_tables=False, conjugate=False, out_dtype=torch.float32)
    qb, kb = q.clone(), k.clone()
    torch.ops.rope_fusion.rotary_qk_slice_(qb, kb, cos, sin, **kw, slice_dims=[1, 1], slice_starts=[1, 2],
                                           slice_ends=[4, 5])
    for got, x, (s, e) in ((qb, q, (1, 4)), (kb, k, (2, 5))):
        want = rotary_reference(x[:, s:e].double(), cos.double(), sin.double(), **{**kw, "out_dtype": torch.float64})
        torch.testing.assert_close(got[:, s:e].double(), want, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[:, :s], x[:, :s]) and torch.equal(got[:, e:], x[:, e:])


def test_repeated_calls_run_the_plan_of_their_geometry(triton_on_cpu, monkeypatch):
    """A geometry is checked and planned on its first call; later calls of it (other bases, other rows, fresh
    values) run that plan, each rotating its own rows in place, and a new geometry plans again. A bad slice still
    raises on a planned geometry."""
    planned = []
    kernel = slice_write.IN_PLACE_KERNELS.kernels["cpu"]
    monkeypatch.setitem(slice_write.IN_PLACE_KERNELS.kernels, "cpu", dataclasses.replace(
        kernel, plan=lambda call: planned.append(call) or kernel.plan(call)))
    rope_fusion.clear_caches()
    kw = dict(interleaved=True, rotary_dim=32, full_tables=True, conjugate=False, out_dtype=torch.float32)
    for shape, (s, e) in (((2, 3, 9, 32), (2, 7)), ((2, 3, 9, 32), (4, 9)), ((2, 3, 9, 32), (0, 5)),
                          ((1, 3, 12, 32), (2, 7))):
        q, k = torch.randn(shape), torch.randn(shape)
        cos, sin = torch.randn(e - s, 32), torch.randn(e - s, 32)
        qb, kb = q.clone(), k.clone()
        torch.ops.rope_fusion.rotary_qk_slice_(qb, kb, cos, sin, **kw, slice_dims=[2, 2], slice_starts=[s, s],
                                               slice_ends=[e, e])
        for got, x in ((qb, q), (kb, k)):
            want = rotary_reference(x[:, :, s:e].double(), cos.double(), sin.double(),
                                    **{**kw, "out_dtype": torch.float64})
            torch.testing.assert_close(got[:, :, s:e].double(), want, rtol=1e-6, atol=1e-6)
            assert torch.equal(got[:, :, :s], x[:, :, :s]) and torch.equal(got[:, :, e:], x[:, :, e:])
    # one plan per geometry: the three [2, 3, 9, 32] calls rotate 5 rows each (one view geometry), the last is new
    assert len(planned) == 2 and len(plan_cache("slice.runners")) == 2
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.rope_fusion.rotary_qk_slice_(qb, kb, cos, sin, **kw, slice_dims=[2, 2], slice_starts=[9, 9],
                                               slice_ends=[14, 14])


@pytest.mark.parametrize("form", ["packed", "weight per token"])
def test_calls_the_plan_cache_does_not_keep_rotate_in_place(triton_on_cpu, form):
    """Packed sequences (positions derived per call) and a norm weight that varies over tokens (normalised before
    the launch, then copied in) are not kept by the op's plan cache: they rotate their rows in place all the same,
    on every call."""
    torch.manual_seed(3)
    q = torch.randn(10, 2, 16)
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    kw = dict(interleaved=False, rotary_dim=16, full_tables=True, conjugate=False, out_dtype=torch.float32)
    s, e = 2, 9
    for _ in range(2):
        qb = q.clone()
        if form == "packed":
            cu = torch.tensor([0, 3, 7], dtype=torch.int32)
            torch.ops.rope_fusion.rotary_slice_(qb, cos, sin, cu_seqlens=cu, **kw, slice_dims=[0], slice_starts=[s],
                                                slice_ends=[e])
            rows = torch.tensor([0, 1, 2, 0, 1, 2, 3])
            want = rotary_reference(q[s:e].double(), cos[rows][:, None].double(), sin[rows][:, None].double(),
                                    **{**kw, "out_dtype": torch.float64})
        else:
            w = torch.rand(e - s, 1, 16) + 0.5
            torch.ops.rope_fusion.rotary_slice_(qb, cos[:e - s, None], sin[:e - s, None], x_norm_weight=w,
                                                **kw, norm="rms", slice_dims=[0], slice_starts=[s], slice_ends=[e])
            x = q[s:e].double()
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
            want = rotary_reference(normed, cos[:e - s, None].double(), sin[:e - s, None].double(),
                                    **{**kw, "out_dtype": torch.float64})
        torch.testing.assert_close(qb[s:e].double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(qb[:s], q[:s]) and torch.equal(qb[e:], q[e:])


def test_the_op_names_a_bad_slice():
    x, cos, sin = torch.randn(2, 5, 32), torch.randn(3, 16), torch.randn(3, 16)
    kw = dict(interleaved=False, rotary_dim=32, full_tables=False, conjugate=False, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="before the lanes"):
        torch.ops.rope_fusion.rotary_slice_(x, cos, sin, **kw, slice_dims=[2], slice_starts=[0], slice_ends=[3])
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.rope_fusion.rotary_slice_(x, cos, sin, **kw, slice_dims=[1], slice_starts=[3], slice_ends=[6])
    with pytest.raises(ValueError, match="out_dtype"):
        torch.ops.rope_fusion.rotary_slice_(x, cos, sin, **{**kw, "out_dtype": torch.bfloat16}, slice_dims=[1],
                                            slice_starts=[2], slice_ends=[5])


def test_diffusers_cogvideox_fuses_its_sites_with_the_fold(triton_on_cpu):
    from tests.zoo.entries import ENTRIES

    entry = next(e for e in ENTRIES if e.name == "cogvideox")
    model, kwargs = entry.build()
    model = model.eval()
    names = list(kwargs)

    def forward(*args):
        return model(**dict(zip(names, args)), return_dict=False)[0]

    args = list(kwargs.values())
    with torch.no_grad():
        want = forward(*args)
        got, p = compile_with_pass(forward, *args, backend="triton")
    r = p.report
    folded = [k for k in r.kernels if k.fold.startswith("slice write:")]
    assert (len(r.sites), len(r.kernels), len(folded)) == (entry.sites, entry.kernels, entry.kernels), r.table()
    assert _after(p)["aten.slice_scatter.default"] == 0, r.table()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast,emitted", [("triton", "op"), ("left", "op"), ("triton", "node")])
def test_auto_times_the_fold_with_the_scatter_it_removes(triton_on_cpu, monkeypatch, tmp_path, fast, emitted):
    """Under `auto` a slice-write group is timed as each candidate would run it: "left" and "inductor" compute the
    written bases (the scatters Inductor fuses into the rotation), "triton" is the fold itself, the bases' slices
    rotated in place: by the in-place op where the pass emits it, by the kernel's planned launch with no dispatcher
    where it emits the kernel's own node (CUDA; the CPU stands in, `timed_as_nodes`). The three compute the same
    bases, and the fold is emitted exactly where its timing wins."""
    from rope_fusion.ops import backends
    from rope_fusion.passes.auto import auto_decisions, auto_timing
    from tests.helpers.triton_cpu import timed_as_nodes

    if emitted == "node":
        timed_as_nodes(monkeypatch)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    monkeypatch.setattr(auto_timing, "_MEASURE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ["triton", "inductor"])
    times = {"left": 10e-6, "inductor": 12e-6, "triton": 5e-6 if fast == "triton" else 11e-6}
    outputs: dict = {}
    ops_called = []

    def clock(name, run):
        if name == "triton":
            with torch.profiler.profile() as prof:
                outputs[name] = run()
            ops_called.extend(e.name for e in prof.events())
        else:
            outputs[name] = run()
        return times[name]

    monkeypatch.setattr(auto_timing, "TIMER", clock)
    assert not os.path.exists(auto_decisions.decisions_path())
    args = inputs()
    out, p = compile_with_pass(cogvideox_attention, *[a.clone() for a in args], backend="auto")
    r = p.report
    assert sorted(outputs) == ["inductor", "left", "triton"], r.table()
    assert ("rope_fusion::rotary_qk_slice_" in ops_called) == (emitted == "op"), sorted(set(ops_called))
    for name in ("inductor", "triton"):  # every candidate's values are the written bases, [2, heads, s, d]
        assert len(outputs[name]) == 2, name
        for got, want in zip(outputs[name], outputs["left"]):
            assert got.shape == args[0].shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if fast == "triton":
        assert [k.backend for k in r.kernels] == ["triton"] and r.kernels[0].fold.startswith("slice write:"), \
            r.table()
        assert r.kernels[0].choice.startswith("measured triton 5.0 us, left 10.0 us"), r.table()
        assert _after(p)["aten.slice_scatter.default"] == 0 and _after(p)["auto_functionalized"] == 1
    else:
        assert not r.kernels and all(m.reason.startswith("left to Inductor: measured left 10.0 us")
                                     for m in r.misses), r.table()
    check_numerics(cogvideox_attention, [a.clone() for a in args], out, context=r.table())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fn,n,clone", [(cogvideox_attention, 3, False), (middle_rows, 1, False),
                                        (read_again, 1, True)])
def test_gpu_slice_writes_rotate_in_place(fn, n, clone):
    """On a GPU, compiled: the Triton kernel writes the rows of the slice in place (into a clone where the base is
    read again), no scatter is left in the generated code, and the results keep the numerics contract."""
    torch.manual_seed(31)
    rows = 6 if fn is middle_rows else None
    args = [a.cuda() for a in inputs(s=40, rows=rows if rows else 40 - TEXT, heads=4, d=64, n=n)]
    out, code, p = _compiled_code(fn, [a.clone() for a in args], backend="triton")
    assert p.report.kernels and all(k.fold.startswith("slice write:") for k in p.report.kernels), p.report.table()
    assert "slice_scatter" not in code and ("clone" in code) == clone, code
    # the kernel's own launch (its user-kernel node, handed the whole base), not the slice op
    assert "rotary_kernel" in code and not re.search(r"rotary(_qk|_qkv)?_slice_", code), code
    check_numerics(fn, args, out, context=p.report.table())
    # later calls run the compiled graph's own launch of the node
    compiled = torch.compile(fn, fullgraph=True)
    with torch._inductor.config.patch(post_grad_custom_post_pass=p):
        for _ in range(3):
            args = [torch.randn_like(a) for a in args]
            check_numerics(fn, args, compiled(*[a.clone() for a in args]), context=p.report.table())


def write_into_inputs(q, k, cos, sin):
    """The rotations written into the function's own inputs: the graph returns nothing, and each rotation's only
    use is the copy back into its input."""
    q[:, :, TEXT:] = rope(q[:, :, TEXT:], cos, sin)
    k[:, :, TEXT:] = rope(k[:, :, TEXT:], cos, sin)


@pytest.mark.parametrize("backend", ["triton", "inductor"])
def test_rotations_written_into_inputs_fuse(triton_on_cpu, backend):
    """Two rotations whose results only write back into graph inputs are sites: a copy into an input is an effect
    of the graph, not dead work (they were dropped as dead before, with no report line)."""
    q, k, _, cos, sin = inputs()
    want_q, want_k = q.clone(), k.clone()
    write_into_inputs(want_q, want_k, cos, sin)
    fq, fk = q.clone(), k.clone()
    _, p = compile_with_pass(write_into_inputs, fq, fk, cos, sin, backend=backend)
    r = p.report
    assert (len(r.sites), len(r.kernels)) == (2, 1), r.table()
    assert torch.equal(fq[:, :, :TEXT], q[:, :, :TEXT]) and torch.equal(fk[:, :, :TEXT], k[:, :, :TEXT])
    for got, x in ((fq, q), (fk, k)):
        want = rotary_reference(x[:, :, TEXT:].double(), cos.double()[None, None], sin.double()[None, None],
                                interleaved=True, rotary_dim=x.shape[-1], full_tables=True, conjugate=False,
                                out_dtype=torch.float64)
        torch.testing.assert_close(got[:, :, TEXT:].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fq, want_q, rtol=1e-5, atol=1e-5)


def scatter_into_input(x, cos, sin):
    """The rotation scattered into a copy of the input, which stays as it was: written, it needs a clone."""
    return torch.slice_scatter(x, rope(x[:, :, TEXT:], cos, sin), 2, TEXT)


@pytest.mark.parametrize("fn,n,clone", [(cogvideox_attention, 3, False), (read_again, 1, True),
                                        (write_into_inputs, 2, False), (scatter_into_input, 1, True)])
def test_the_timed_fold_clones_a_base_where_inductor_would(fn, n, clone):
    """`auto` times the fold on a clone of a base exactly where Inductor's reinplacing writes into one: a base the
    graph reads again, or a graph input that is not written back; the input a `copy_` writes back is written."""
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    from rope_fusion.passes.auto import auto_timing
    from rope_fusion.passes.folds.slice_writes import SliceWrite

    q, k, v, cos, sin = inputs()
    args = [q, k, v][:n] + [cos, sin]
    graph = make_fx(functionalize(fn, remove="mutations"))(*[a.clone() for a in args]).graph
    scatters = [node for node in graph.nodes if node.target is torch.ops.aten.slice_scatter.default]
    assert scatters
    for node in scatters:
        dim, start, end = (list(node.args[2:5]) + [None, None, None])[:3]
        write = SliceWrite(node.args[0], dim, start, end, node)
        assert auto_timing._clones(write) == clone, (node.name, [u.name for u in node.args[0].users])


def test_timed_candidates_write_back_into_inputs_as_the_graph_does(triton_on_cpu, monkeypatch, tmp_path):
    """Rotations written back into the function's inputs: plain compile copies each written base into its input
    (`copy_`), so "left" and "inductor" are timed with those copies, and the fold writes the inputs in place."""
    from rope_fusion.ops import backends
    from rope_fusion.passes.auto import auto_timing

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    monkeypatch.setattr(auto_timing, "_MEASURE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ["triton", "inductor"])
    built = []
    real_build = auto_timing.build
    monkeypatch.setattr(auto_timing, "build", lambda site, cg: built.append(real_build(site, cg)) or built[-1])
    monkeypatch.setattr(auto_timing, "TIMER", lambda name, run: (run(), {"left": 10e-6, "inductor": 12e-6,
                                                                          "triton": 5e-6}[name])[1])
    q, k, _, cos, sin = inputs()
    fq, fk = q.clone(), k.clone()
    _, p = compile_with_pass(write_into_inputs, fq, fk, cos, sin, backend="auto")
    assert [k_.fold.startswith("slice write:") for k_ in p.report.kernels] == [True], p.report.table()
    (b,) = built
    copies = [n for n in b.left.nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 2 and all(c.args[0].op == "placeholder" for c in copies), b.left
    want_q, want_k = q.clone(), k.clone()
    write_into_inputs(want_q, want_k, cos, sin)
    torch.testing.assert_close(fq, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fk, want_k, rtol=1e-5, atol=1e-5)


def test_the_compiled_launchers_check_writes_a_slice_with_its_strides(triton_on_cpu, monkeypatch):
    """A plan's compiled launcher is checked on its first use against the JIT launcher's result in fresh buffers.
    Those buffers take the slice's strides, which the plan's scalars hold: a slice of a base is not dense, and a
    contiguous buffer would be written past its end and read back in another layout (the launcher then judged
    wrong, its rows overwritten with those values). The launcher here is the kernel itself: the check keeps it,
    and the rows are the reference's."""
    import rope_fusion.kernels.triton_launch as launching

    rope_fusion.clear_caches()
    torch.manual_seed(7)
    kw = dict(interleaved=True, rotary_dim=16, full_tables=True, conjugate=False, out_dtype=torch.float32)
    x = torch.randn(2, 2, 11, 16)
    cos, sin = torch.randn(11 - TEXT, 16), torch.randn(11 - TEXT, 16)
    bounds = dict(slice_dims=[2], slice_starts=[TEXT], slice_ends=[11])
    torch.ops.rope_fusion.rotary_slice_(x.clone(), cos, sin, **kw, **bounds)  # plans the geometry
    (runner,) = plan_cache("slice.runners").values()
    for entry in runner.entries:  # a compiled launcher that writes what the kernel writes
        entry[4] = (lambda *a, grid=entry[1], meta=entry[3]: launching.rotary_kernel[grid](*a, **meta))
    got = x.clone()
    torch.ops.rope_fusion.rotary_slice_(got, cos, sin, **kw, **bounds)
    assert all(entry[4] and entry[5] for entry in runner.entries), "the check judged a correct launcher wrong"
    want = rotary_reference(x[:, :, TEXT:].double(), cos.double(), sin.double(), **{**kw, "out_dtype": torch.float64})
    torch.testing.assert_close(got[:, :, TEXT:].double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[:, :, :TEXT], x[:, :, :TEXT])
