"""A warm FX graph cache: the second run of a script reports what the cached code fused, not nothing.

On a cache hit Inductor skips every post-grad pass, ours included. The pass records counters that Inductor
stores with the cached graph and replays on a hit, and the report reads them back. Checked as a user meets
it: the same script run twice in fresh processes sharing one cache directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, torch, rope_fusion

def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)

def rope_qk(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

torch.manual_seed(0)
ang = torch.rand(6, 8) * 6
ang = torch.cat((ang, ang), -1)
args = (torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), ang.cos(), ang.sin())
p = rope_fusion.RopeFusionPass()
out = torch.compile(rope_qk, options={"post_grad_custom_post_pass": p})(*args)
ref = rope_qk(*args)
ok = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref))
c = p.report.cached
print(json.dumps([len(p.report.sites), len(p.report.kernels), c.graphs, c.sites, c.kernels, p.report.summary(), ok]))
"""


def _run(cache_dir: str) -> list:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_run_reports_the_sites_reused_from_the_cache(tmp_path):
    first = _run(str(tmp_path))
    assert first[:5] == [2, 1, 0, 0, 0] and first[6], first
    assert "reused" not in first[5]
    second = _run(str(tmp_path))
    assert second[:5] == [0, 0, 1, 2, 1] and second[6], second
    assert "reused from the FX graph cache: 2 sites in 1 kernels" in second[5]
