"""Compile-cache records belong to the pass that compiled: a hit's records go to the pass that asked for that
compile, not to every pass with the same options (issue 27), and they are the records the pass made.

The records of a fused graph travel with its cached artifact (`Report.graph_payload`, replayed by Inductor on a
hit; fresh processes: tests/passes/test_cache_reports.py). Here, in one process with Inductor's own caches on: two
passes with the same options compile the same function one after the other (the second compile is a hit), and
a pass with other options compiles it too (its own cache entry).
"""

from __future__ import annotations

import dataclasses

import torch

import rope_fusion
from rope_fusion.passes.report import Report


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def _rope_qk_cache_reuse(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _args():
    torch.manual_seed(0)
    ang = torch.rand(6, 8) * 6
    ang = torch.cat((ang, ang), -1)
    return torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), ang.cos(), ang.sin()


def _compile(p, args):
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        out = torch.compile(_rope_qk_cache_reuse, options={"post_grad_custom_post_pass": p})(*args)
    ref = _rope_qk_cache_reuse(*args)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref))


def test_each_pass_gets_the_graphs_of_its_own_compiles():
    args = _args()
    first, second = rope_fusion.RopeFusionPass(), rope_fusion.RopeFusionPass()
    other = rope_fusion.RopeFusionPass(fuse_qk=False)
    assert first.uuid() == second.uuid() != other.uuid()  # the cache key: options, never the instance
    _compile(first, args)  # a miss, or a hit of an earlier session's cache: one graph either way
    _compile(second, args)  # a hit: the pass does not run
    _compile(other, args)
    for p in (first, second, other):
        assert p.report.graphs == len(p.report.graph_records) == 1, (p, p.report.table())
    assert second.report.graph_records[0].from_cache, second.report.table()
    assert second.report.cached.graphs == 1 and second.report.cached.sites == 2, second.report.table()
    assert second.report.sites == first.report.sites and second.report.kernels == first.report.kernels
    assert [k.op for k in first.report.kernels] == ["rope_fusion.rotary_qk"], first.report.table()
    assert [k.op for k in other.report.kernels] == ["rope_fusion.rotary"] * 2, other.report.table()


def _two_graphs(q, k, cos, sin):
    q = q * cos + _rotate_half(q) * sin
    torch._dynamo.graph_break()
    return q, k * cos + _rotate_half(k) * cos  # cos twice: a near miss


def test_graph_records_survive_the_round_trip():
    """What travels with a cached graph rebuilds the same records, renumbered for the report that reads them."""
    p = rope_fusion.RopeFusionPass()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(_two_graphs, options={"post_grad_custom_post_pass": p})(*_args())
    r = p.report
    assert len(r.sites) == 1 and len(r.misses) == 1 and r.graphs == 2, r.table()
    rebuilt = Report()
    rebuilt.add_cached_graph(r.graph_payload(1))  # the near miss's graph first: its index becomes 0
    rebuilt.add_cached_graph(r.graph_payload(0))
    assert [dataclasses.replace(m, graph=1) for m in rebuilt.misses] == r.misses
    assert [dataclasses.replace(s, graph=0) for s in rebuilt.sites] == r.sites
    assert [dataclasses.replace(k, graph=0) for k in rebuilt.kernels] == r.kernels
    assert [(g.index, g.sites, g.kernels, g.misses, g.from_cache) for g in rebuilt.graph_records] == \
        [(0, 0, 0, 1, True), (1, 1, 1, 0, True)]
    # said once in the header and once per graph, never on a site's or a near miss's line
    marked = [ln for ln in rebuilt.table().splitlines() if "from the compile cache" in ln]
    assert len(marked) == 3 and marked[0].startswith("  all 2 compiled graphs came from the compile cache"), marked
    assert marked[1:] == [f"graph {g} (inference, from the compile cache):" for g in (0, 1)], marked
