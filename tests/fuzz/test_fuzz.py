"""The differential fuzz suite (issue 27): random RoPE-like functions and non-rotations, each compiled with
the pass and compared with eager, an fp64 evaluation and plain compile (tests/fuzz/harness.py says how).

Every case asserts: no fused site changes the numbers beyond the contract (docs/design.md section 2), no
compile breaks, every RoPE-like tensor is fused or leaves a near miss, no non-rotation is fused, the pass
records no internal error, rows gathered out of range fail as eager fails, and under dynamic=True the pass
compiles no more graphs than plain compile.

Two profiles, one marker:
- the fast profile runs in the default suite: the fixed seeds FAST_SEEDS, one test per case, at the graph
  level (cases with rows gathered out of range or at negative positions would go through real Inductor,
  since only the generated code can check them; FAST_SEEDS has none);
- the long profile is marked `fuzz` and deselected by default (pyproject.toml's addopts):
  `pytest -m fuzz tests/fuzz` runs ROPE_FUZZ_CASES cases (default 2000) from seed ROPE_FUZZ_START (default
  1000, after the fast seeds), every ROPE_FUZZ_FULL_EVERY-th (default 20) through real Inductor, and prints
  the counts per class (cases, fused, near miss, wrong numbers, broken compiles, silent misses, ...) at the
  end. ROPE_FUZZ_REPORT=path also writes that summary to a file.
The reduced reproducers of FINDINGS.md (tests/fuzz/reproducers.py) run as `test_reproducer`: the static ones in
the default suite, the dynamic and real-Inductor ones with the long profile (`-m fuzz`).
One case alone, with its source: `python -m tests.fuzz.harness --seed N` (add --full for real Inductor).
"""

from __future__ import annotations

import collections
import os

import pytest

from tests.fuzz.generator import FAMILIES, generate
from tests.fuzz.harness import run_case, run_seeds, summary, uses_full
from tests.fuzz.reproducers import REPRODUCERS

# Three of each family, four of them under dynamic=True: about 90 s on a loaded 2-core CPU (the dynamic ones
# cost 8-17 s each there, a static one 1-7 s). No real Inductor compile (30 s there): the lowering runs in the
# long profile, every 20th case and every case with rows gathered out of range.
FAST_SEEDS = tuple(range(18))
FAST_FULL_EVERY = 0  # only the cases that need real Inductor (none among FAST_SEEDS)


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_fast_profile(seed):
    case = generate(seed)
    o = run_case(case, full=uses_full(case, FAST_FULL_EVERY))
    assert not o.problems, f"{o.line()}\n\n{case.reproducer()}"


def _reproducer_param(name: str):
    r = REPRODUCERS[name]
    return pytest.param(name, marks=pytest.mark.fuzz if r.full or r.case.dynamic else (), id=name)


@pytest.mark.parametrize("name", [_reproducer_param(n) for n in REPRODUCERS])
def test_reproducer(name):
    """FINDINGS.md's reduced reproducers (the static ones in the default suite, a few seconds in all; the
    dynamic and real-Inductor ones in the fuzz profile)."""
    r = REPRODUCERS[name]
    o = run_case(r.case, full=r.full)
    assert not o.problems, f"{r.what}: {o.line()}\n\n{r.case.source}"


# Findings of issue 27 that the generator must be able to produce unprompted: each is a feature the draws
# combine (the tag that marks it), not a case written down.
ISSUE_CLASSES = {
    "norm followed by layout ops that move the lane axis": "norm:lane_axis_moved",
    "norm across heads, then view and transpose": "norm:across",
    "eps with alpha": "norm:eps_alpha",
    "table rows selected from a computed table": "table:select_of_computed",
    "packed [S, 2, W] table scaled, then selected": "table:packed_pair_select_scaled",
    "fp64 angles cast to fp16": "table:angles_fp64_cast_to_fp16",
    "fp64 angles cast to bf16": "table:angles_fp64_cast_to_bf16",
    "fp64 data with fp32 math": "math:fp32_on_fp64",
    "negated tables": "table:negate",
    "positions out of range": "gather:out_of_range",
    "negative positions": "gather:negative",
    "negative-start slice of a packed cache": "gather:packed_negative_slice",
    "tables computed in the graph (sums)": "table:sum",
    "angle-sum identity": "table:angle_sum",
    "gated tables": "table:gate",
    "conj(x) * freqs": "nonrot:complex_reflection",
    "torch.roll half swap": "spelling:neox_roll",
    "dynamic sizes": "dynamic",
}


def test_generator_reaches_every_issue_class():
    """The long profile's seeds draw every class of issue 27's findings, several times, and every case the
    generator writes runs in eager (or raises where its positions are out of range: the case's point)."""
    counts: collections.Counter = collections.Counter()
    for seed in range(1000, 1600):
        case = generate(seed)
        counts.update(case.tags)
        fn, make = case.build()
        try:
            fn(*case.inputs(make))
        except IndexError:
            assert "gather:out_of_range" in case.tags or "gather:negative" in case.tags, case.reproducer()
    missing = {name: counts[tag] for name, tag in ISSUE_CLASSES.items() if counts[tag] < 3}
    assert not missing, f"classes drawn fewer than 3 times in 600 cases: {missing}"
    assert all(counts[f"family:{f}"] == 100 for f in FAMILIES)


@pytest.mark.fuzz
def test_long_profile(capsys):
    n = int(os.environ.get("ROPE_FUZZ_CASES", "2000"))
    start = int(os.environ.get("ROPE_FUZZ_START", "1000"))
    full_every = int(os.environ.get("ROPE_FUZZ_FULL_EVERY", "20"))
    outcomes = run_seeds(range(start, start + n), full_every)
    text = summary(outcomes)
    with capsys.disabled():
        print(f"\nfuzz long profile: {n} cases from seed {start}, every {full_every}th through real Inductor\n{text}")
    if os.environ.get("ROPE_FUZZ_REPORT"):
        with open(os.environ["ROPE_FUZZ_REPORT"], "w") as f:
            f.write(text + "\n")
    bad = [o for o in outcomes if o.problems]
    assert not bad, f"{len(bad)} of {n} cases failed:\n" + "\n".join(o.line() for o in bad[:50])
