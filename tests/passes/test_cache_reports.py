"""A warm compile cache reports what the cold compile did: the same sites, kernels, near misses, table and log
lines, marked as served by the compile cache.

On a cache hit Inductor runs no post-grad pass; the pass stores each graph's records with the compiled graph and
a hit hands them to the pass that asked for the compile. Checked as a user meets it: the same script run twice
in fresh processes that share one cache directory. In each, a second pass with the same options compiles the
same model after the first: a cache hit in the same process, whose records go to that second pass only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import dataclasses, json, logging, torch, rope_fusion

def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)

def model(q, k, cos, sin):
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin   # a RoPE: fuses
    torch._dynamo.graph_break()                                             # a second graph
    return q * cos + rotate_half(q) * cos, k * cos + rotate_half(k) * cos   # cos twice: two near misses

lines = []
class Lines(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
log = logging.getLogger("rope_fusion")
log.setLevel(logging.INFO)
log.addHandler(Lines())

torch.manual_seed(0)
ang = torch.rand(6, 8) * 6
ang = torch.cat((ang, ang), -1)
args = (torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), ang.cos(), ang.sin())
ref = model(*args)

def compile_and_run(p):
    torch._dynamo.reset()
    del lines[:]
    out = torch.compile(model, options={"post_grad_custom_post_pass": p})(*args)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref))
    return list(lines)

def state(p, logged):
    r = p.report
    c = r.cached
    return {"sites": [dataclasses.asdict(s) for s in r.sites], "kernels": [dataclasses.asdict(k) for k in r.kernels],
            "misses": [dataclasses.asdict(m) for m in r.misses], "table": r.table(), "summary": r.summary(),
            "cached": [c.graphs, c.sites, c.kernels, c.misses], "graphs": r.graphs, "logged": logged}

first = rope_fusion.RopeFusionPass()
logged = compile_and_run(first)
second = rope_fusion.RopeFusionPass()  # the same options: the same cache entries
logged_second = compile_and_run(second)
print(json.dumps({"first": state(first, logged), "second": state(second, logged_second)}))
"""

MARK = " (from the compile cache)"


def _run(tmp_path) -> dict:
    script = tmp_path / "warm_cache_script.py"  # a file: the records name its lines
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _script_line(marker: str) -> str:
    return f"warm_cache_script.py:{next(i for i, ln in enumerate(SCRIPT.splitlines(), 1) if marker in ln)}"


def _records_text(table: str) -> list[str]:
    """The report's lines of sites and near misses."""
    return [ln for ln in table.splitlines() if ln.startswith(("  site ", "  near miss "))]


def _records(state: dict) -> tuple:
    return state["sites"], state["kernels"], state["misses"]


@pytest.mark.slow  # two fresh processes, each a real compile
def test_a_warm_cache_reports_what_the_cold_compile_did(tmp_path):
    cold, warm = _run(tmp_path), _run(tmp_path)
    fresh = cold["first"]
    # what the pass did when it ran: a q/k pair fused in graph 0, the two near misses of graph 1
    assert len(fresh["sites"]) == 2 and len(fresh["kernels"]) == 1, fresh["table"]
    assert [m["graph"] for m in fresh["misses"]] == [1, 1], fresh["table"]
    assert all(s["source"].endswith(_script_line("# a RoPE")) for s in fresh["sites"]), fresh["table"]
    assert all(m["source"].endswith(_script_line("# cos twice")) for m in fresh["misses"]), fresh["table"]
    assert fresh["cached"] == [0, 0, 0, 0] and "compile cache" not in fresh["table"], fresh["table"]
    assert fresh["summary"] == "fused 2 sites in 1 kernel, 2 near misses", fresh["summary"]
    assert fresh["logged"] == ["rope_fusion graph 0 (inference): fused 2 sites in 1 kernel, 0 near misses",
                               "rope_fusion graph 1 (inference): fused 0 sites in 0 kernels, 2 near misses"]
    # every later report, of this process's second pass and of both passes in the second process, is the same,
    # each line of it marked as served by the cache
    for name, state in (("second pass, first process", cold["second"]), ("first pass, second process",
                        warm["first"]), ("second pass, second process", warm["second"])):
        assert _records(state) == _records(fresh), name
        assert state["cached"] == [2, 2, 1, 2], (name, state["table"])
        assert state["summary"] == fresh["summary"] + MARK, (name, state["summary"])
        assert _records_text(state["table"]) == _records_text(fresh["table"]), (name, state["table"])
        # said once in the header and once per graph, on none of the sites' and near misses' lines
        marked = [ln for ln in state["table"].splitlines() if "from the compile cache" in ln]
        assert len(marked) == 1 + 2 and marked[0].startswith("  all 2 compiled graphs came"), (name, state["table"])
        assert state["logged"] == [line + MARK for line in fresh["logged"]], (name, state["logged"])
        assert state["graphs"] == 2, name
    assert all("cos and sin are one table" in m["reason"] for m in fresh["misses"]), fresh["table"]


OTHER_COMPILES = r"""
import json, torch, rope_fusion
from torch._dynamo.utils import counters

def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)

def trained(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

def served(q, k, cos, sin):
    return (q * cos + rotate_half(q) * sin).relu(), (k * cos + rotate_half(k) * sin).relu()

torch.manual_seed(0)
ang = torch.rand(6, 8) * 6
ang = torch.cat((ang, ang), -1)
q, k = torch.randn(2, 4, 6, 16, requires_grad=True), torch.randn(2, 2, 6, 16, requires_grad=True)
tables = (ang.cos(), ang.sin())

def summary(p):
    return p.report.summary(), len(p.report.sites), p.report.cached.graphs

# 1. a forward and a backward through rope_fusion.backend: the process's first compiles, which run Inductor's
# lazy pattern init (it swaps counters["inductor"] for a copy of itself)
fb = rope_fusion.backend("eager")
a, b = torch.compile(trained, backend=fb)(q, k, *tables)
(a.sum() + b.sum()).backward()
trained_before = summary(fb)

# 2. a new pass compiles another function: its report holds that compile only
served_pass = rope_fusion.RopeFusionPass()
with torch.no_grad():
    torch.compile(served, options={"post_grad_custom_post_pass": served_pass})(q.detach(), k.detach(), *tables)

# 3. the counters cleared, then the same compile again with a new pass of the same options: a cache hit,
# handed to that pass as a replay
counters.clear()
torch._dynamo.reset()
again = rope_fusion.RopeFusionPass()
with torch.no_grad():
    torch.compile(served, options={"post_grad_custom_post_pass": again})(q.detach(), k.detach(), *tables)
print(json.dumps({"trained": [trained_before, summary(fb)], "served": summary(served_pass),
                  "again": summary(again)}))
"""


def test_other_compiles_in_the_process_are_not_reported_as_cache_replays(tmp_path):
    """A pass reports its own compiles only, whatever else the process compiled: a backend's forward and
    backward before it once showed as "4 graphs from the compile cache" in a new pass's report."""
    script = tmp_path / "other_compiles.py"
    script.write_text(OTHER_COMPILES)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = got["trained"]
    assert before == after and before[2] == 0 and before[1] >= 2, got  # the backend's report is left as it was
    assert got["served"] == ["fused 2 sites in 1 kernel, 0 near misses", 2, 0], got
    assert got["again"] == ["fused 2 sites in 1 kernel, 0 near misses" + MARK, 2, 1], got
