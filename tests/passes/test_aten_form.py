"""`fx_pass` on ATen graphs that are not in the form the lane rules read (passes/analysis/aten_form.py).

`make_fx` without functionalization or decompositions keeps `aten.stack`, in-place writes (`fill_`, `copy_` into a
view) and, pre-dispatch, composite ops (`chunk`, `flatten`, `type_as`). Before, such a graph fused nothing, or
reported a pairing that is not there (Wan's unbind/stack), or fused a rotation of a tensor as if an in-place write
into it had not happened (5.4 off). Checked on the real catalogue spellings (tests/spellings) traced each way:
the sites the spelling must give, numerics against fp64 on fresh random inputs, a graph without RoPE left exactly
as it was, a graph that cannot be traced again reported with a true reason, and `fx_pass` given to torch.compile as
a backend raising what to use instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import rope_fusion
from rope_fusion.passes.analysis.lanes import RULES
from tests.helpers.numerics import as_tuple, check_numerics
from tests.spellings import ALL

aten = torch.ops.aten

_X = torch.randn(2, 3, 4)
# one call of every record of DECOMPOSED_FIRST: (args, kwargs)
SAMPLES = {
    aten.stack.default: (([_X, _X], -1), {}), aten.t.default: ((_X[0],), {}), aten.rsub.Tensor: ((_X, _X), {}),
    aten.new_zeros.default: ((_X, [2, 4]), {}),
    aten.new_empty.default: ((_X, [2, 4]), {}), aten.new_full.default: ((_X, [2, 4], 1.0), {}),
    aten.new_ones.default: ((_X, [2, 4]), {}), aten.ones.default: (([2, 4],), {}),
    aten.ones_like.default: ((_X,), {}), aten.fill.Scalar: ((_X, 1.0), {}),
    aten.fill.Tensor: ((_X, torch.tensor(1.0)), {}), aten.zero.default: ((_X,), {}),
    aten.unsafe_split.Tensor: ((_X, 2, -1), {}), aten.unsafe_split_with_sizes.default: ((_X, [1, 3], -1), {}),
    aten.view_copy.default: ((_X, [2, 12]), {}), aten.unsqueeze_copy.default: ((_X, 0), {}),
    aten.squeeze_copy.dim: ((_X[None], 0), {}), aten.permute_copy.default: ((_X, [1, 0, 2]), {}),
    aten.transpose_copy.int: ((_X, 0, 1), {}), aten.expand_copy.default: ((_X[..., :1], [2, 3, 4]), {}),
    aten.unbind_copy.int: ((_X, -1), {}), aten.alias_copy.default: ((_X,), {}),
    aten.split_with_sizes_copy.default: ((_X, [1, 3], -1), {}), aten.narrow_copy.default: ((_X, -1, 0, 2), {}),
}


def test_every_record_decomposes_into_ops_the_rules_read():
    """A record is an op Inductor decomposes before its post-grad passes, into ops with lane rules: the form the
    rules are written for. An op added without a sample call fails here."""
    from rope_fusion.passes.analysis import aten_form

    assert set(SAMPLES) == set(aten_form.DECOMPOSED_FIRST)
    for op, (args, kwargs) in SAMPLES.items():
        assert op not in RULES, op
        decomposition = aten_form.decomposition_of(op)
        assert decomposition is not None, op
        traced = make_fx(lambda *a, d=decomposition, kw=kwargs: d(*a, **kw), tracing_mode="fake")(*args)
        ops = {n.target for n in traced.graph.nodes if n.op == "call_function"}
        assert ops and all(o in RULES for o in ops), (op, ops)


# catalogue rows spelled with stack/unbind (I1, I3), an in-place write into an `empty_like` (I1's slice writes) or
# into the input (M6's CogVideoX assignment), chunk/cat (N1), complex views (C2), an addcmul_ (N6)
CASES = ["I1_wan", "I3_omni_wan_stack", "N1_llama", "C2_qwen_image_complex64", "M6_cogvideox_seq_assign",
         "N6_ltx2_split_addcmul", "V_scatter_base_zeros_like"]
TRACES = {"plain": dict(tracing_mode="fake"), "pre_dispatch": dict(tracing_mode="fake", pre_dispatch=True),
          "symbolic": dict(tracing_mode="symbolic"), "real": dict()}


def _fused_graph(case, trace):
    args = case.make(torch.float32)
    gm = make_fx(case.fn, **TRACES[trace])(*args)
    p = rope_fusion.FxPass()
    p(gm, args)
    return gm, p


@pytest.mark.parametrize("trace", list(TRACES))
@pytest.mark.parametrize("name", CASES)
def test_graphs_traced_without_functionalization_or_decompositions_fuse(name, trace):
    case = ALL[name]
    gm, p = _fused_graph(case, trace)
    if trace == "symbolic":  # every size symbolic, the head dim too: left and named, never guarded (design 5)
        assert not p.report.sites and p.report.misses and not p.report.errors, p.report.table()
        assert all("reads a symbolic size as a constant" in m.reason for m in p.report.misses), \
            p.report.table()
    else:
        assert len(p.report.sites) == case.expect.sites and not p.report.misses and not p.report.errors, \
            p.report.table()
        assert {k.op for k in p.report.kernels} == {case.expect.op}, p.report.table()
    args = case.make(torch.float32)  # fresh inputs; the graph runs op by op
    with torch.no_grad():
        out = gm(*[a.clone() for a in args])
    check_numerics(case.fn, args, out)


def test_a_write_in_place_is_seen():
    """A rotation of `y` after `y[..., :4] = 0`: fused, it rotates the zeroed y (it rotated x: 5.4 off)."""

    def f(x, cos, sin):
        y = x.clone()
        y[..., :4] = 0
        a, b = y.chunk(2, -1)
        return y * cos + torch.cat((-b, a), -1) * sin

    q, _, cos, sin = ALL["N1_llama"].make(torch.float32)  # q [B, H, S, D], tables [B, S, D]
    args = (q, cos.unsqueeze(1), sin.unsqueeze(1))
    gm = make_fx(f, tracing_mode="fake")(*args)
    p = rope_fusion.FxPass()
    p(gm, args)
    assert len(p.report.sites) == 1 and not p.report.errors, p.report.table()
    check_numerics(f, args, gm(*args))
    assert any(str(n.target) == "rope_fusion.rotary.default" for n in gm.graph.nodes)


def test_a_graph_it_cannot_trace_again_is_left_with_a_true_reason(monkeypatch):
    """Where the functional form cannot be traced, a graph that writes in place is not analysed (a fused rotation
    could read a value from before the write), and the near miss names the write."""
    from rope_fusion.passes.analysis import aten_form

    case = ALL["M6_cogvideox_seq_assign"]
    args = case.make(torch.float32)
    gm = make_fx(case.fn, tracing_mode="fake")(*args)
    before = gm.code

    def fails(graph, example_inputs=None):
        raise RuntimeError("no trace")

    monkeypatch.setattr(aten_form, "normal_form", fails)
    p = rope_fusion.FxPass()
    p(gm, args)
    assert not p.report.sites and len(p.report.misses) == 1, p.report.table()
    reason = p.report.misses[0].reason
    assert "writes in place (aten.copy_" in reason and "not analysed" in reason and "no trace" in reason, reason
    assert gm.code == before
    fresh = case.make(torch.float32)
    for a, b in zip(as_tuple(gm(*[t.clone() for t in fresh])), as_tuple(case.fn(*[t.clone() for t in fresh]))):
        torch.testing.assert_close(a, b)


def test_a_graph_without_rope_keeps_its_form():
    """A stack and an in-place write, and nothing to fuse: the graph is left exactly as it was (the normal form is
    taken only where it fused something)."""

    def f(x, y):
        z = torch.stack((x, y), 0)
        x.mul_(2)
        return z.sum(0) + x

    args = (torch.randn(3, 8), torch.randn(3, 8))
    gm = make_fx(f, tracing_mode="fake")(*args)
    before = gm.code
    p = rope_fusion.FxPass()
    p(gm, args)
    assert gm.code == before and not p.report.sites and not p.report.misses and not p.report.errors


def test_an_fx_graph_is_rewritten_in_place():
    """Given the graph rather than its module: the same graph object holds the fused normal form, its inputs the
    same nodes."""
    case = ALL["I1_wan"]
    args = case.make(torch.float32)
    gm = make_fx(case.fn, tracing_mode="fake")(*args)
    graph, inputs = gm.graph, [n for n in gm.graph.nodes if n.op == "placeholder"]
    p = rope_fusion.FxPass()
    p(graph)
    gm.recompile()
    assert gm.graph is graph and [n for n in graph.nodes if n.op == "placeholder"] == inputs
    assert len(p.report.sites) == case.expect.sites, p.report.table()
    check_numerics(case.fn, args, gm(*args))


@pytest.mark.parametrize("backend", [rope_fusion.fx_pass, rope_fusion.FxPass()], ids=["shared", "instance"])
def test_fx_pass_as_a_torch_compile_backend_says_what_to_use(backend):
    """Dynamo hands a backend its own graph and wants a callable back: torch's "compiler_fn did not return
    callable" said nothing of what to do."""
    case = ALL["N1_llama"]
    torch._dynamo.reset()
    before = len(backend.report.sites)  # the shared pass keeps the sites of earlier tests in this process
    with pytest.raises(Exception, match=r"not a backend|is a pass over the ATen graphs") as raised:
        torch.compile(case.fn, backend=backend)(*case.make(torch.float32))
    assert 'rope_fusion.backend("eager")' in str(raised.value)
    assert len(backend.report.sites) == before  # nothing was fused: the graph was never the pass's


def test_normal_form_keeps_the_inputs_names():
    """AOTAutograd's `tangents_*` inputs say a graph is a backward; the traced form keeps every input's name."""
    from rope_fusion.passes.analysis import aten_form

    g = fx.Graph()
    x, t = g.placeholder("primals_1"), g.placeholder("tangents_1")
    for node, shape in ((x, (2, 4)), (t, (2, 4))):
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            node.meta["val"] = mode.from_tensor(torch.randn(shape)) if node is x else torch.randn(shape)
    out = g.call_function(aten.stack.default, ([x, x], 0))
    g.output((out,))
    traced = aten_form.normal_form(g, [torch.randn(2, 4), torch.randn(2, 4)])
    assert [n.name for n in traced.graph.nodes if n.op == "placeholder"] == ["primals_1", "tangents_1"]
    assert aten.stack.default not in {n.target for n in traced.graph.nodes}
