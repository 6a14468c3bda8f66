"""The failure policy: whatever step of the pass raises, the compile goes on and the result is right.

Faults are injected into the real pass at each step: analysis, the emission of the k-th site, host-table
caching, and after the uses of the original nodes were replaced. Each time the post-grad graph is either
exactly what it was (compared as text) or holds exactly the sites the report lists, the compiled result
equals plain torch.compile (or meets the numerics contract where sites did fuse), and the report and the one
log line say which happened.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import rope_fusion
from rope_fusion.ops import backends as B
from rope_fusion.passes import emission, host_tables, rope_pass
from tests.helpers.numerics import check_numerics
from tests.zoo.harness import InOrder


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def three_ropes(q, k, v, cos, sin):
    """Three rotations by one table (fuse_qk=False keeps them three sites)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v * cos + rotate_half(v) * sin


def _inputs():
    torch.manual_seed(0)
    ang = torch.rand(6, 8) * 6
    ang = torch.cat((ang, ang), -1)
    return (torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 1, 6, 16), ang.cos(), ang.sin())


class GraphText(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.texts = []

    def __call__(self, graph):
        self.texts.append(str(graph))

    def uuid(self):
        return None


def compile_three(p):
    before, after = GraphText(), GraphText()
    args = _inputs()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, post_grad_custom_post_pass=InOrder([before, p, after])), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(three_ropes, fullgraph=True)(*args)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        plain = torch.compile(three_ropes, fullgraph=True)(*args)
    return args, out, plain, before.texts[0], after.texts[0]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "rope_fusion" and r.levelno >= logging.WARNING]


def _assert_unchanged(p, out, plain, before, after, caplog, where):
    assert after == before, "the graph was not restored"
    for a, b in zip(out, plain):
        assert torch.equal(a, b)
    assert p.report.sites == [] and p.report.kernels == [], p.report.table()
    assert [e.outcome for e in p.report.errors] == ["graph unchanged"], p.report.table()
    assert where in p.report.errors[0].error
    assert p.report.graph_records[0].outcome == "unchanged after an error"
    lines = _warnings(caplog)
    assert len(lines) == 1 and "graph unchanged after an internal error" in lines[0], lines


def test_fault_in_analysis_leaves_the_graph_unchanged(monkeypatch, caplog):
    def broken(graph):
        raise RuntimeError("injected: analysis")

    monkeypatch.setattr(rope_pass, "find_sites", broken)
    p = rope_fusion.RopeFusionPass(fuse_qk=False)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        _, out, plain, before, after = compile_three(p)
    _assert_unchanged(p, out, plain, before, after, caplog, "injected: analysis")


def test_fault_after_uses_were_replaced_restores_the_graph(monkeypatch, caplog):
    replaced = []

    def broken(graph, planned, order):
        replaced.append(sum(len(m.node.users) for pg in planned for m in pg.group))
        raise RuntimeError("injected: after commit")

    monkeypatch.setattr(emission, "finish", broken)
    p = rope_fusion.RopeFusionPass(fuse_qk=False)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        _, out, plain, before, after = compile_three(p)
    assert replaced == [0]  # the fault came when no original node had users left
    _assert_unchanged(p, out, plain, before, after, caplog, "injected: after commit")


@pytest.mark.parametrize("k", [0, 1, 2])
def test_fault_in_the_kth_site_leaves_exactly_that_site(monkeypatch, caplog, k):
    inductor = B.get_backend("inductor")
    calls = []

    def emit(em, call, like):
        calls.append(like.name)
        outs = inductor.emit(em, call, like)  # nodes are made, then the fault
        if len(calls) == k + 1:
            raise RuntimeError(f"injected: site {k}")
        return outs

    monkeypatch.setitem(B._BACKENDS, "inductor", dataclasses.replace(inductor, emit=emit))
    p = rope_fusion.RopeFusionPass(fuse_qk=False)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        args, out, plain, before, after = compile_three(p)
    assert len(calls) == 3
    assert len(p.report.sites) == 2 and len(p.report.kernels) == 2, p.report.table()
    assert [e.outcome for e in p.report.errors] == ["site left unfused"]
    assert calls[k] in p.report.errors[0].error and calls[k] not in {s.node for s in p.report.sites}
    assert p.report.graph_records[0].outcome == "partly fused after an error"
    assert after.count("rope_fusion.rotary.default") == 2  # exactly the committed sites
    check_numerics(three_ropes, args, out)
    lines = _warnings(caplog)
    assert len(lines) == 1 and "left unfused" in lines[0], lines


def test_fault_in_host_table_caching_keeps_the_fused_sites(monkeypatch, caplog):
    real = host_tables.cache_host_tables

    def broken(graph, tables):
        real(graph, tables)
        table = tables[0]
        with graph.inserting_after(table):  # a half-done rewrite, then the fault
            bogus = graph.call_function(torch.ops.aten.clone.default, (table,))
        bogus.meta["val"] = table.meta["val"]
        table.replace_all_uses_with(bogus, delete_user_cb=lambda u: u is not bogus)
        raise RuntimeError("injected: host tables")

    monkeypatch.setattr(host_tables, "cache_host_tables", broken)
    p = rope_fusion.RopeFusionPass(fuse_qk=False)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        args, out, plain, before, after = compile_three(p)
    assert len(p.report.sites) == 3 and len(p.report.kernels) == 3, p.report.table()
    assert [e.outcome for e in p.report.errors] == ["host-table copies left as they were; the sites are fused"]
    assert "clone" not in after and after.count("rope_fusion.rotary.default") == 3
    check_numerics(three_ropes, args, out)
    lines = _warnings(caplog)
    assert len(lines) == 1 and "host tables left as they were" in lines[0], lines
