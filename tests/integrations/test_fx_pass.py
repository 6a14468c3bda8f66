"""`rope_fusion.fx_pass` / `FxPass` on AOTAutograd's ATen graphs, outside Inductor.

The graphs are what AOTAutograd hands a backend's forward compiler (Inductor's decompositions); the pass is
called as a custom pass `fn(gm, example_inputs, config)` and the rewritten GraphModule is run as it is (op by op).
Checked: the fused op replaces q and k (one launch), the report is reachable from the shared instance and from
a fresh one, a graph without RoPE is left exactly as it was, a `view` after a fused result still runs (the fused
op's layout is not the replaced arithmetic's), the failure policy (an internal error leaves the graph as it was,
with the error in the report), fx.Graph input, and copies that keep the options and not the report.
"""

from __future__ import annotations

import copy
import pickle

import torch

import rope_fusion
from rope_fusion.passes import emission
from tests.helpers.numerics import check_numerics


def aten_graph(fn, *args):
    """(gm, example_inputs) of fn's forward ATen graph, as AOTAutograd gives it to a backend."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    got = []

    def capture(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture, decompositions=select_decomp_table()),
                      fullgraph=True)(*args)
    (gm, example_inputs), = got
    return gm, example_inputs


def _run(gm, args):
    with torch.no_grad():
        out = gm(*args)
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def bhsd_attention_input(q, k, cos, sin):
    """q, k [B, S, H, D] rotated as [B, H, S, D], then back and flattened with view (Llama's order)."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    b, h, s, d = q.shape
    return q.transpose(1, 2).contiguous().view(b, s, h * d) + k.transpose(1, 2).reshape(b, s, h * d)


def _inputs():
    torch.manual_seed(0)
    ang = torch.rand(8, 16, dtype=torch.float64) * 6
    ang = torch.cat((ang, ang), -1)
    return torch.randn(2, 8, 4, 32), torch.randn(2, 8, 4, 32), ang.cos().float(), ang.sin().float()


def test_custom_pass_call_fuses_and_reports():
    args = _inputs()
    gm, ex = aten_graph(bhsd_attention_input, *args)
    p = rope_fusion.FxPass()
    assert p(gm, ex, None) is None
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("rope_fusion.rotary_qk.default") == 1 and "aten.cat.default" not in targets, targets
    assert [(k.op, k.backend) for k in p.report.kernels] == [("rope_fusion.rotary_qk", "op")], p.report.table()
    assert len(p.report.sites) == 2 and not p.report.errors
    check_numerics(bhsd_attention_input, args, _run(gm, [a for a in args])[0])

    n = len(rope_fusion.fx_pass.report.kernels)  # the shared instance keeps its own report
    gm2, ex2 = aten_graph(bhsd_attention_input, *args)
    rope_fusion.fx_pass(gm2, ex2, None)
    assert len(rope_fusion.fx_pass.report.kernels) == n + 1


def test_a_view_after_the_fused_result_runs():
    """The fused op returns a contiguous [B, H, S, D]; the arithmetic it replaced kept q's transposed layout, on
    which `.transpose(1, 2).view(...)` was traced. The views after a fused node become reshapes."""
    def fn(q, k, cos, sin):
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        b, h, s, d = q.shape
        return (q + k).transpose(1, 2).view(b, s, h * d)  # viewable only in the replaced layout

    args = _inputs()
    gm, ex = aten_graph(fn, *args)
    assert any(n.target is torch.ops.aten.view.default for n in gm.graph.nodes)
    rope_fusion.FxPass()(gm, ex)
    assert not any(n.target is torch.ops.aten.view.default for n in gm.graph.nodes), gm.code
    check_numerics(fn, args, _run(gm, args)[0])


def test_a_graph_without_rope_is_left_as_it_was():
    def fn(x, w):
        return torch.cat((x, -x), -1) * w

    gm, ex = aten_graph(fn, torch.randn(4, 8), torch.randn(16))
    code = gm.code
    p = rope_fusion.FxPass()
    p(gm, ex)
    assert gm.code == code and not p.report.kernels and p.report.graph_records[0].outcome == "nothing to fuse"


def test_an_internal_error_leaves_the_graph_as_it_was(monkeypatch):
    args = _inputs()
    gm, ex = aten_graph(bhsd_attention_input, *args)
    code = gm.code

    def broken(planned):
        raise RuntimeError("injected")

    monkeypatch.setattr(emission, "commit", broken)
    p = rope_fusion.FxPass()
    p(gm, ex)
    assert gm.code == code and not p.report.kernels
    assert [(e.outcome, "injected" in e.error) for e in p.report.errors] == [("graph unchanged", True)]
    torch.testing.assert_close(_run(gm, args)[0], bhsd_attention_input(*args))


def test_takes_an_fx_graph_and_copies_keep_options_not_the_report():
    args = _inputs()
    gm, ex = aten_graph(bhsd_attention_input, *args)
    p = rope_fusion.FxPass(fuse_qk=False)
    p(gm.graph)  # an fx.Graph: rewritten in place; its module's code is the caller's to regenerate
    gm.recompile()
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary"] * 2
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert type(q) is rope_fusion.FxPass and q.fuse_qk is False and q.report.kernels == []
        assert q.uuid() == p.uuid() != rope_fusion.FxPass().uuid()
    check_numerics(bhsd_attention_input, args, _run(gm, args)[0])
