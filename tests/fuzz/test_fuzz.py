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

The hazard families (tests/fuzz/hazards.py: slice-write bases, marked-dynamic dims, recompiles, backward row
slices, FxPass on undecomposed graphs, host tables written in place, regrouped matrix tables) have profiles of
their own: the host-table cases in the default suite (`test_hazard_fast_profile`), every family with `-m fuzz`
(`test_hazard_long_profile`: ROPE_FUZZ_HAZARD_CASES cases, default 14, from seed ROPE_FUZZ_HAZARD_START, default
20000, in ROPE_FUZZ_HAZARD_CHUNKS chunks for pytest-xdist, ROPE_FUZZ_HAZARD_JSONL to collect them;
`python -m tests.fuzz.harness --summary FILE` prints the table of all chunks).
One case alone, with its source: `python -m tests.fuzz.harness --seed N` (add --full for real Inductor).
"""

from __future__ import annotations

import collections
import os

import pytest

from tests.fuzz import hazards
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


# -- the hazard families (tests/fuzz/hazards.py) ------------------------------------------------------------------

# The fast profile's hazard cases: host tables written between calls through every path (a few ms each). The other
# families compile (1-15 s each on 2 cores; the slice-write bases through real Inductor and the interpreted kernel):
# they run in the long profile.
HAZARD_FAST_SEEDS = tuple(s for s in range(140) if hazards.HAZARD_FAMILIES[s % 7] == "host_table")


@pytest.mark.parametrize("seed", HAZARD_FAST_SEEDS)
def test_hazard_fast_profile(seed):
    case = hazards.generate(seed)
    o = run_case(case)
    assert not o.problems, f"{o.line()}\n\n{case.source}"


# Each class of the round-4 table, as the tag of the draws that produce it.
HAZARD_CLASSES = {
    "1. a slice-write base whose rows overlap": "base:overlap",
    "1b. a non-dense base with gaps, read again": "base:gaps",
    "1b. a base of every other row": "base:steps",
    "1b. a base that is a view of wider lanes": "base:lanes_view",
    "1b. a base read again after the write": "read_again:True",
    "2. an expanded base": "base:expanded",
    "2. k expanded over q's heads": "k_expanded",
    "slice write into a graph input": "base:input",
    "3. vLLM's flat dim marked dynamic": "marked:vllm_flat",
    "3. a head dim marked dynamic": "marked:head_dim",
    "4. a write-back at a symbolic start": "recompile:write_back_start",
    "5. a head dim that changes under dynamic=True": "recompile:head_dim",
    "6. the backward of a row-slice rotation": "backward:rows",
    "6. the backward of a row slice written back": "backward:rows_written_back",
    "7. fx_pass on unbind/stack kept whole": "spelling:unbind_stack",
    "8. a host table written through .data.copy_": "write:data_copy",
    "8. a host table written through .data.mul_": "write:data_mul",
    "8. a host table's storage filled": "write:storage_fill",
    "8. a host table written through another tensor on its storage": "write:alias_set",
    "8. a host table set_ to another tensor": "write:set_",
    "8. a host table written through a numpy view": "write:numpy_view",
    "8. a host table written through the array from_numpy aliases": "write:from_numpy_array",
    "9. a 2x2 matrix table regrouped into tiles": "tokens:tiles",
}


def test_hazard_generator_reaches_every_class():
    """700 hazard seeds draw every class of the table at least 3 times, each family 100 times, and every case runs
    in eager (its host-table writes too)."""
    counts: collections.Counter = collections.Counter()
    for seed in range(30000, 30700):
        case = hazards.generate(seed)
        counts.update(case.tags)
        ns: dict = {}
        exec(compile(case.source, case.filename, "exec"), ns)
        args = case.inputs(ns["make"])
        if case.run == "host_table":
            x, table, array = args
            for i in range(ns["WRITES"]):
                ns[f"write{i}"](table, array)
            ns["fn"](x, table)
        else:
            ns["fn"](*args)
            for n in case.sizes:
                ns["fn"](*case.inputs(ns["make"], n))
    missing = {name: counts[tag] for name, tag in HAZARD_CLASSES.items() if counts[tag] < 3}
    assert not missing, f"classes drawn fewer than 3 times in 700 cases: {missing}"
    assert all(counts[f"family:{f}"] == 100 for f in hazards.HAZARD_FAMILIES)


# The long profile of the hazard families, in chunks that pytest-xdist can run apart (ROPE_FUZZ_HAZARD_CHUNKS): each
# chunk takes every chunks-th seed, so each sees every family. ROPE_FUZZ_HAZARD_JSONL=path appends one JSON line per
# case, and `python -m tests.fuzz.harness --summary path` prints the table of all chunks.
HAZARD_CHUNKS = int(os.environ.get("ROPE_FUZZ_HAZARD_CHUNKS", "1"))


@pytest.mark.fuzz
@pytest.mark.parametrize("chunk", range(HAZARD_CHUNKS))
def test_hazard_long_profile(chunk, capsys):
    import dataclasses
    import json

    n = int(os.environ.get("ROPE_FUZZ_HAZARD_CASES", "14"))
    start = int(os.environ.get("ROPE_FUZZ_HAZARD_START", "20000"))
    seeds = range(start + chunk, start + n, HAZARD_CHUNKS)
    path = os.environ.get("ROPE_FUZZ_HAZARD_JSONL")

    def record(case, o):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(dataclasses.asdict(o), default=str) + "\n")

    outcomes = run_seeds(seeds, 0, on_outcome=record, generate=hazards.generate)
    with capsys.disabled():
        print(f"\nfuzz hazard profile, chunk {chunk} of {HAZARD_CHUNKS}: {len(outcomes)} cases of seeds {start}-"
              f"{start + n - 1}\n{summary(outcomes)}")
    bad = [o for o in outcomes if o.problems]
    assert not bad, f"{len(bad)} of {len(outcomes)} cases failed:\n" + "\n".join(o.line() for o in bad[:50])


def test_the_harness_classifies_a_stale_host_table(monkeypatch):
    """A cache keyed on the version counter alone (as before the snapshot) serves stale copies after writes through
    `.data`: the harness counts those cases as wrong numbers, and the cache as it is as fresh."""
    from rope_fusion.ops import host_tables

    class VersionKeyed(host_tables.HostTableCache):
        def get(self, src, device):
            hit = self._entries.get(src)
            if hit is not None and hit.state == host_tables._state(src, device):
                return hit.copy
            return super().get(src, device)

    seeds = [s for s in range(40000, 40140) if "write:data_copy" in hazards.generate(s, "host_table").tags][:3]
    assert seeds
    for seed in seeds:
        case = hazards.generate(seed, "host_table")
        assert not run_case(case).problems
        with monkeypatch.context() as m:
            m.setattr(host_tables, "HostTableCache", VersionKeyed)
            o = run_case(case)
        assert o.problems == ["wrong numbers"] and o.status == "stale", o.line()
