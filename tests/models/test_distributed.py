"""The pass inside tensor-parallel and sequence-parallel ranks (issue 15): two gloo ranks on the CPU.

One torchrun launch of examples/distributed_attention.py runs every case, so the two processes, their imports
and their process group are shared; each case compiles once per rank, with RopeFusionPass, the rank's share of
a real block (transformers LlamaAttention: NeoX RoPE, GQA, causal; diffusers FluxAttention: interleaved RoPE)
with functional collectives in the graph: all_reduce (tp), all_to_all (ulysses), ring all_to_all (ring).
The tests read every rank's report, and check the gathered output here, in this process, against the whole
block run in one process: the numerics contract of docs/design.md section 2 in the output's dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from examples.distributed_attention import Case, Sizes, make_inputs
from tests.helpers.numerics import rel_err

pytestmark = pytest.mark.slow  # one two-rank launch of about 30 s: CI runs it with -m slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "distributed_attention.py")
WORLD = 2

# model:mode:offset:dtype. Every mode with both RoPE styles; every way the table offset reaches a
# sequence-parallel graph (a constant, a SymInt under dynamic=True, an unbacked .item()); one bf16 case.
CASES = (
    "llama:tp:static:float32",
    "llama:ulysses:symbolic:float32",
    "llama:ring:static:bfloat16",
    "flux:tp:symbolic:float32",
    "flux:ulysses:unbacked:float32",
    "flux:ring:static:float32",
)
STYLE = {"llama": "neox", "flux": "interleaved"}


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """Run all CASES in one `torchrun --standalone` (a free rendezvous port, picked by torchrun itself)."""
    out = tmp_path_factory.mktemp("distributed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", EXAMPLE,
           *(f"--case={c}" for c in CASES), f"--json={out / 'records.json'}", f"--save={out}"]
    # one compile thread: two ranks share the CI machine's two cores, a compile worker pool only adds startup
    env = dict(os.environ, HF_HUB_OFFLINE="1", TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = (proc.stdout + proc.stderr)[-6000:]
    path = out / "records.json"
    assert path.exists(), f"the launch wrote no records (exit {proc.returncode}):\n{log}"
    records = {(r["case"], r["rank"]): r for r in json.loads(path.read_text())}
    return dict(returncode=proc.returncode, log=log, records=records)


def test_launch_passes_its_own_checks(launch):
    """The example's verdict: every rank fused something, no pass errors, every check held."""
    assert launch["returncode"] == 0, launch["log"]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_fuses_q_and_k_into_one_kernel(launch, case):
    """On each rank, the block's q and k RoPE are two sites of one rotary_qk, in the graph that also holds the
    collectives (the ranks compile with fullgraph=True), with nothing left behind and no internal error."""
    model = case.split(":")[0]
    for rank in range(WORLD):
        rec = launch["records"][(case, rank)]
        where = f"{case} rank {rank}:\n{rec['table']}"
        assert rec["errors"] == [], where
        assert rec["misses"] == [], where
        assert rec["sites"] == 2, where
        assert rec["kernels"] == ["rope_fusion.rotary_qk"], where
        assert sorted(rec["roles"]) == ["k", "q"], where
        assert rec["styles"] == [STYLE[model]] * 2, where


@pytest.mark.parametrize("case", CASES)
def test_gathered_output_meets_the_numerics_contract(launch, case):
    """err(distributed compiled, fp64 whole block) <= err(single-process eager whole block, fp64) + eps, with
    the reference computed here, not by the ranks."""
    rec = launch["records"][(case, 0)]
    got = torch.load(rec["output"])
    block, x, cos, sin = make_inputs(Case.parse(case), Sizes(), "cpu")
    with torch.no_grad():
        eager = block.whole(x, cos, sin)
        ref = block.to(torch.float64).whole(x.double(), cos.double(), sin.double())
    assert got.shape == eager.shape and got.dtype == eager.dtype
    err_dist, err_eager, eps = rel_err(got, ref), rel_err(eager, ref), torch.finfo(eager.dtype).eps
    assert err_dist <= err_eager + eps, f"{case}: distributed {err_dist:.3g} > eager {err_eager:.3g} + {eps:.3g}"
