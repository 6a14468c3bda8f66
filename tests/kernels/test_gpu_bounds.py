"""On the GPU, a position outside [0, rows) of a gathered cache fails loudly, in the graph and eagerly.

The CPU tests (test_bounds.py) check the lowering, the reference and the kernel under Triton's interpreter. On a
GPU the Triton kernel's row check is a `tl.device_assert`, which Triton compiles in only where the kernel is
compiled for debugging: these tests prove that it is, in both ways the kernel runs (Inductor's user-kernel node
and the op's eager launch). A device-side assert leaves the CUDA context unusable, so each case runs in a
process of its own and the test reads its exit status and its error. In-range positions give the reference's
numbers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_PRELUDE = """
import torch, rope_fusion
from rope_fusion.ops.reference import rotary_reference
D, ROWS, T, H = 64, 16, 5, 4
torch.manual_seed(0)
cache = torch.randn(ROWS, D, device="cuda")
q = torch.randn(T, H * D, device="cuda")
k = torch.randn(T, H * D, device="cuda")

def rotate(positions, q, k, cache):
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    def one(x):
        x = x.view(positions.shape[0], -1, D)
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    return one(q), one(k)
"""

_GRAPH = """
p = rope_fusion.RopeFusionPass(backend="triton")
f = torch.compile(rotate, options={"post_grad_custom_post_pass": p}, fullgraph=True)
out = f(POS, q, k, cache)
torch.cuda.synchronize()
print("RAN", flush=True)
assert p.report.sites, p.report.summary()
ref = rotate(POS.cpu(), q.cpu(), k.cpu(), cache.cpu())
err = max((o.cpu() - r).abs().max().item() for o, r in zip(out, ref))
print("OK", len(p.report.sites), err)
"""

_EAGER = """
pos = POS
cos, sin = cache[:, : D // 2], cache[:, D // 2:]
qo, ko = rope_fusion.apply_rotary_qk(q.view(T, H, D), k.view(T, H, D), cos, sin, positions=pos.view(T, 1))
torch.cuda.synchronize()
print("RAN", flush=True)
ref = rotate(POS.cpu(), q.cpu(), k.cpu(), cache.cpu())
err = max((o.reshape(T, -1).cpu() - r).abs().max().item() for o, r in zip((qo, ko), ref))
print("OK", err)
"""


def _run(body: str, positions: list[int]) -> subprocess.CompletedProcess:
    code = _PRELUDE + f"POS = torch.tensor({positions}, device='cuda')\n" + body
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def _failed_loudly(r: subprocess.CompletedProcess) -> bool:
    text = r.stdout + r.stderr
    return r.returncode != 0 and "RAN" not in r.stdout and any(
        m in text for m in ("device-side assert", "out of bounds", "outside [0, rows)", "IndexError"))


@pytest.mark.parametrize("body", [_GRAPH, _EAGER], ids=["gpu_graph", "gpu_eager"])
def test_gpu_positions_in_range_are_exact(body):
    r = _run(body, [0, 3, 15, 2, 1])
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
    assert float(r.stdout.split()[-1]) < 1e-5


@pytest.mark.parametrize("body", [_GRAPH, _EAGER], ids=["gpu_graph", "gpu_eager"])
@pytest.mark.parametrize("positions", [[0, 3, 16, 2, 1000], [0, -1, 2, 3, 4]], ids=["past_end", "negative"])
def test_gpu_positions_out_of_range_fail(body, positions):
    r = _run(body, positions)
    assert _failed_loudly(r), f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
