"""`with rope_fusion.debug(dump_dir):` with the real depyf: per compiled graph, the post-grad graph before
and after the pass and a readable report with the model source lines."""

from __future__ import annotations

import glob
import inspect
import os

import pytest
import torch
import torch._inductor.config as inductor_config

import rope_fusion

depyf = pytest.importorskip("depyf")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_qk(q, k, cos, sin):
    q_out = q * cos + rotate_half(q) * sin
    k_out = k * cos + rotate_half(k) * sin
    return q_out, k_out


def near_miss(x, cos, sin):
    return x * cos + rotate_half(x) * cos  # sin replaced by cos in the second product: not a rotation


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def _inputs():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 8, 32), torch.randn(1, 2, 8, 32)
    ang = torch.rand(8, 16) * 6
    ang = torch.cat((ang, ang), -1)
    return q, k, ang.cos(), ang.sin()


def test_debug_dumps_graphs_and_report(tmp_path):
    dump = str(tmp_path / "dump")
    q, k, cos, sin = _inputs()
    torch._dynamo.reset()
    assert inductor_config.post_grad_custom_post_pass is None
    with rope_fusion.debug(dump) as session:
        compiled = torch.compile(rope_qk)  # plain compile: the context installs a pass
        qo, ko = compiled(q, k, cos, sin)
    assert inductor_config.post_grad_custom_post_pass is None  # removed again
    assert isinstance(session.pass_, rope_fusion.RopeFusionPass)
    eq, ek = rope_qk(q, k, cos, sin)
    torch.testing.assert_close(qo, eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, ek, rtol=1e-5, atol=1e-5)

    files = sorted(os.listdir(dump))
    assert any(f.startswith("full_code_for_") for f in files), files  # depyf's own dump is there
    assert [g.number for g in session.graphs] == [0]
    before = open(os.path.join(dump, "rope_fusion_graph_0_before.py")).read()
    after = open(os.path.join(dump, "rope_fusion_graph_0_after.py")).read()
    report = open(os.path.join(dump, "rope_fusion_graph_0_report.txt")).read()

    line = _line_of(rope_qk, "q_out = q * cos")
    here = f"{os.path.basename(__file__)}:{line}"
    assert "rope_fusion." not in before and "aten.cat" in before
    assert here in before  # the graph printout keeps the model source lines
    assert "torch.ops.rope_fusion.rotary_qk" in after and "aten.cat" not in after
    assert "fused 2 sites in 1 kernel, 0 near misses" in report
    assert here in report  # fused sites name the model's file:line
    assert "rope_fusion.rotary_qk" in report and "neox" in report
    assert session.graphs[0].summary == "fused 2 sites in 1 kernel, 0 near misses"


def test_debug_reports_near_misses_and_uses_a_configured_pass(tmp_path):
    dump = str(tmp_path / "dump")
    q, _, cos, sin = _inputs()
    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass()
    with rope_fusion.debug(dump) as session:
        torch.compile(near_miss, options={"post_grad_custom_post_pass": p})(q, cos, sin)
        torch.compile(rope_qk, options={"post_grad_custom_post_pass": p})(*_inputs())
    assert len(session.graphs) == 2
    reports = [open(g.report).read() for g in session.graphs]
    assert "fused 0 sites in 0 kernels, 1 near miss" in reports[0], reports[0]
    assert f"{os.path.basename(__file__)}:{_line_of(near_miss, 'return x * cos')}" in reports[0]
    assert len(p.report.misses) == 1 and p.report.misses[0].reason in reports[0]
    assert "fused 2 sites in 1 kernel," in reports[1]
    # a second session into the same folder numbers on
    torch._dynamo.reset()
    with rope_fusion.debug(dump) as again:
        torch.compile(rope_qk)(*_inputs())
    assert [g.number for g in again.graphs] == [2]
    assert len(glob.glob(os.path.join(dump, "rope_fusion_graph_*_report.txt"))) == 3
    assert rope_fusion.RopeFusionPass.__call__.__name__ == "__call__"  # the class is restored
