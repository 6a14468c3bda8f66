"""Run a fuzz case with the pass, check it, and classify what happened.

Two ways to compile, because a real Inductor compile (C++ code generation) takes seconds on a small CPU:
- "graph" (most cases): `tests/zoo/harness.graph_level_backend`, Inductor's own front half (Dynamo, pre-grad
  passes, AOTAutograd with Inductor's decomposition table, joint-graph and post-grad passes, then the pass)
  whose inner compile runs the rewritten post-grad GraphModule eagerly: the graph the pass sees is the one
  real Inductor gives it, and the fused node runs its CPU eager implementation. About 0.4 s a case.
- "full" (every Nth case, and every case whose failure only the generated code can show: rows gathered out
  of range): real Inductor, as tests/conftest.compile_with_pass compiles, so the lowering runs too.

Every case is compared with eager and with an fp64 evaluation (the function on its inputs cast to fp64;
tests/conftest.fp64_eval), under the numerics contract of docs/design.md section 2: per output,
err(pass) <= err(eager) + eps, one rounding in the output dtype or in the narrowest dtype the function computes
in, whichever is coarser (`_compute_eps`). A violation is a wrong number unless plain compile in the same
mode is off by as much (then Inductor, not the pass, changed the result; counted as "plain off"). Plain
compile also decides whether a failing compile is the pass's: a compile that fails with the pass and not
without it is broken. Under dynamic=True the case runs at a second size, and compiles no more graphs than
plain compile does (a guard the pass added would recompile). Plain compile runs only where it decides something
(a failure, a violation, more than one graph), so most cases cost one compile.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import sys
import time

import torch

import rope_fusion
from tests.conftest import as_tuple, fp64_eval, rel_err
from tests.fuzz.generator import Case, generate
from tests.zoo.harness import Capture, graph_level_backend

# What can go wrong, in the order the summary prints them (a case can have several).
WRONG = "wrong numbers"
BROKEN = "broken compile"
SILENT = "silent miss"
FUSED_NONROT = "fused non-rotation"
INTERNAL = "internal error"
NO_RAISE = "no error where eager raises"
GUARDS = "more graphs than plain"
PROBLEMS = (WRONG, BROKEN, SILENT, FUSED_NONROT, INTERNAL, NO_RAISE, GUARDS)
# non-rotations of x that are rotations of a value the graph computes from x: fusing those is not a problem
ROTATION_OF_COMPUTED_X = frozenset({"nonrot:complex_reflection"})

# Cases that only the generated code can check (the lowering's bounds on gathered rows): always "full".
FULL_ONLY_TAGS = ("gather:out_of_range", "gather:negative")


@dataclasses.dataclass
class Outcome:
    seed: int
    family: str
    tags: tuple
    mode: str  # "graph" or "full"
    rotations: int
    status: str = ""  # fused / partly fused / near miss / silent miss / not fused (non-rotation) / ...
    problems: list = dataclasses.field(default_factory=list)
    sites: int = 0
    misses: int = 0
    miss_reasons: list = dataclasses.field(default_factory=list)
    site_norms: list = dataclasses.field(default_factory=list)  # per site: "rms folded", or why the norm stayed
    errors: list = dataclasses.field(default_factory=list)
    err_pass: list = dataclasses.field(default_factory=list)
    err_eager: list = dataclasses.field(default_factory=list)
    err_plain: list = dataclasses.field(default_factory=list)
    plain_off: bool = False
    eager_raised: str = ""
    pass_raised: str = ""
    plain_raised: str = ""
    graphs_pass: int = 0
    graphs_plain: int = 0
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        errs = ", ".join(f"{a:.3g}/{b:.3g}" for a, b in zip(self.err_pass, self.err_eager))
        return (f"seed {self.seed} [{self.family}, {self.mode}] {self.status}: sites {self.sites}/{self.rotations}, "
                f"misses {self.misses}; err pass/eager {errs or '-'}"
                + (f"; plain {', '.join(f'{e:.3g}' for e in self.err_plain)}" if self.err_plain else "")
                + (f"; PROBLEMS: {', '.join(self.problems)}" if self.problems else "")
                + (f"\n    {self.detail}" if self.detail else ""))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


@contextlib.contextmanager
def _no_caches():
    """Caches off: a hit would skip the pass (and hide a graph from the count). Data-dependent values
    (`.item()`, nonzero) are traced into the graph, not broken out of it (fullgraph=True)."""
    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield


def _compiled(fn, pass_, full: bool, dynamic: bool, counter: list):
    """fn compiled at the graph level or through real Inductor, with `pass_` (None: plain compile); every
    graph compiled appends to `counter`."""
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    if full:
        patches = {} if pass_ is None else {"post_grad_custom_post_pass": pass_}

        def backend(gm, example_inputs):
            counter.append(1)
            return compile_fx(gm, example_inputs, config_patches=patches)
    else:
        inner = graph_level_backend(pass_, Capture())

        def backend(gm, example_inputs):
            counter.append(1)
            return inner(gm, example_inputs)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)


def _run(fn, args, pass_, full, dynamic, args2=None, one_thread=False):
    """(outputs, outputs at the second size, graphs compiled, exception text).

    one_thread: generated C++ without OpenMP regions. A bounds assert that fires inside one throws through
    the parallel region and terminates the process (seen with plain compile on rows gathered out of range);
    outside one it is a RuntimeError, as a test needs it."""
    counter: list = []
    threads = torch._inductor.config.patch({"cpp.threads": 1}) if one_thread else contextlib.nullcontext()
    try:
        with _no_caches(), threads:
            c = _compiled(fn, pass_, full, dynamic, counter)
            out = as_tuple(c(*args))
            out2 = as_tuple(c(*args2)) if args2 is not None else None
        return out, out2, len(counter), ""
    except Exception as e:  # recorded: the classification decides whose failure it is
        return None, None, len(counter), _first_line(e)


class _ComputeDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The real floating dtypes that the ops of a call produce (complex counts as its real dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                self.dtypes.add(t.real.dtype if t.is_complex() else t.dtype)
        return out


def _compute_eps(fn, args) -> float:
    """One rounding in the narrowest dtype the function computes in. fp64 data on which the graph computes in
    fp32 (`(x.float() * c.float() + ...).double()`) rounds in fp32: its fp64 evaluation keeps those casts, so
    eager is the reference there and a result that rounds the same math once more in fp32 meets the contract."""
    mode = _ComputeDtypes()
    with mode:
        fn(*args)
    return max((torch.finfo(d).eps for d in mode.dtypes), default=0.0)


def _errors(fn, args, outs, eager) -> tuple:
    """([err of outs], [err of eager], [eps], mismatch text) against the fp64 evaluation."""
    ref = fp64_eval(fn, *args)
    math_eps = _compute_eps(fn, args)
    ef, eo, eps, bad = [], [], [], ""
    for i, (o, e, r) in enumerate(zip(outs, eager, ref)):
        if o.shape != e.shape or o.dtype != e.dtype:
            bad = f"output {i}: {tuple(o.shape)} {o.dtype}, eager {tuple(e.shape)} {e.dtype}"
            continue
        ef.append(rel_err(o, r))
        eo.append(rel_err(e, r))
        eps.append(max(torch.finfo(e.dtype).eps, math_eps))
    if len(outs) != len(eager):
        bad = f"{len(outs)} outputs, eager {len(eager)}"
    return ef, eo, eps, bad


def _violates(ef, eo, eps) -> bool:
    return any(not (a <= b + e) for a, b, e in zip(ef, eo, eps))  # NaN is a violation


def run_case(case: Case, full: bool = False) -> Outcome:
    t0 = time.perf_counter()
    res = Outcome(case.seed, case.family, case.tags, "full" if full else "graph", case.rotations)
    fn, make = case.build()
    args = case.inputs(make)
    args2 = case.inputs(make, case.S2) if case.dynamic else None
    try:
        eager = as_tuple(fn(*args))
        eager2 = as_tuple(fn(*args2)) if args2 is not None else None
    except Exception as e:
        res.eager_raised = _first_line(e)
    p = rope_fusion.RopeFusionPass()
    one_thread = bool(res.eager_raised)  # the inputs make the kernels fail: let them fail as exceptions
    out, out2, res.graphs_pass, res.pass_raised = _run(fn, args, p, full, case.dynamic, args2, one_thread)
    r = p.report
    res.sites, res.misses = len(r.sites), len(r.misses)
    res.miss_reasons = [str(m.reason) for m in r.misses]
    res.site_norms = [str(s.norm) for s in r.sites]
    res.errors = [str(e.error) for e in r.errors]
    if res.errors:
        res.problems.append(INTERNAL)
    plain = None

    def plain_run():
        nonlocal plain
        if plain is None:
            plain = _run(fn, args, None, full, case.dynamic, args2, one_thread)
        return plain

    if res.eager_raised:
        res.status = "eager raises"
        if not res.pass_raised:
            res.problems.append(NO_RAISE)
            res.detail = f"eager: {res.eager_raised}; with the pass it returned (max |out| " \
                         f"{max(o.abs().max().item() for o in out):.3g})"
        res.seconds = time.perf_counter() - t0
        return res
    if res.pass_raised:
        pl = plain_run()
        res.plain_raised = pl[3]
        res.status = "plain broken too" if pl[3] else "broken"
        if not pl[3]:
            res.problems.append(BROKEN)
        res.detail = f"with the pass: {res.pass_raised}" + (f"; plain: {pl[3]}" if pl[3] else "")
        res.seconds = time.perf_counter() - t0
        return res
    # numbers (both sizes under dynamic=True)
    pairs = [(args, out, eager)] + ([(args2, out2, eager2)] if args2 is not None else [])
    violated, mismatch = False, ""
    for a, o, e in pairs:
        ef, eo, eps, bad = _errors(fn, a, o, e)
        res.err_pass += ef
        res.err_eager += eo
        mismatch = mismatch or bad
        violated = violated or _violates(ef, eo, eps) or bool(bad)
    if violated:
        pl = plain_run()
        if pl[3]:
            res.plain_raised = pl[3]
        else:
            plain_ok = True
            for (a, _o, e), po in zip(pairs, [pl[0]] + ([pl[1]] if args2 is not None else [])):
                pf, _eo, _eps, pbad = _errors(fn, a, po, e)
                res.err_plain += pf
                plain_ok = plain_ok and not pbad
            eps_all = [max(torch.finfo(e.dtype).eps, _compute_eps(fn, a)) for a, _o, ee in pairs for e in ee]
            if not mismatch and plain_ok and not _violates(res.err_pass, res.err_plain, eps_all):
                res.plain_off = True
                violated = False
        if violated:
            res.problems.append(WRONG)
            res.detail = mismatch
    # guards: graphs compiled over the two sizes, against plain compile
    if case.dynamic and res.graphs_pass > 1:  # one graph is the least plain compile can do: compiled only then
        res.graphs_plain = plain_run()[2]
        if res.graphs_pass > res.graphs_plain:
            res.problems.append(GUARDS)
    # fused, near miss, silent
    if case.rotations:
        if res.sites >= case.rotations:
            res.status = "fused"
        elif res.misses:
            res.status = "near miss" if not res.sites else "partly fused, near miss"
        else:
            res.status = "silent miss"
            res.problems.append(SILENT)
    else:
        res.status = "not fused (non-rotation)" if not res.sites else "fused"
        # conj(x) * freqs reflects x, but it is also the rotation of the computed conj(x): fusing that (x's
        # negated imaginary lanes as the op's x) is exact, and the numbers above are checked like any site's
        if res.sites and not set(case.tags) & ROTATION_OF_COMPUTED_X:
            res.problems.append(FUSED_NONROT)
    if res.problems and not res.detail:
        res.detail = " | ".join(dict.fromkeys(res.miss_reasons + res.errors))[:600]
    res.seconds = time.perf_counter() - t0
    return res


def uses_full(case: Case, full_every: int) -> bool:
    return (full_every > 0 and case.seed % full_every == 0) or any(t in case.tags for t in FULL_ONLY_TAGS)


def run_seeds(seeds, full_every: int = 10, log=None, on_outcome=None) -> list:
    outcomes = []
    for seed in seeds:
        case = generate(seed)
        o = run_case(case, full=uses_full(case, full_every))
        outcomes.append(o)
        if on_outcome is not None:
            on_outcome(case, o)
        if log is not None and o.problems:
            print(o.line(), file=log, flush=True)
    return outcomes


# -- the summary -----------------------------------------------------------------------------------------------

COLUMNS = ("cases", "fused", "near miss") + PROBLEMS + ("plain off", "full")


def tally(outcomes) -> dict:
    """{class: Counter(column -> count)}: "all", then every tag a case has (a case counts in each)."""
    rows: dict = collections.defaultdict(collections.Counter)
    for o in outcomes:
        for key in ("all",) + tuple(o.tags):
            row = rows[key]
            row["cases"] += 1
            row["fused"] += o.status == "fused"
            row["near miss"] += o.status.endswith("near miss")
            for prob in o.problems:
                row[prob] += 1
            row["plain off"] += o.plain_off
            row["full"] += o.mode == "full"
    return rows


def summary(outcomes) -> str:
    rows = tally(outcomes)
    short = {"wrong numbers": "wrong", "broken compile": "broken", "silent miss": "silent",
             "fused non-rotation": "fused-nonrot", "internal error": "internal",
             "no error where eager raises": "no-raise", "more graphs than plain": "guards"}
    heads = [short.get(c, c) for c in COLUMNS]
    width = max(len(k) for k in rows) + 2
    lines = ["class".ljust(width) + " ".join(h.rjust(max(6, len(h))) for h in heads)]
    for key in ["all"] + sorted(k for k in rows if k != "all"):
        lines.append(key.ljust(width) + " ".join(str(rows[key][c]).rjust(max(6, len(h)))
                                                 for c, h in zip(COLUMNS, heads)))
    bad = [o for o in outcomes if o.problems]
    if bad:
        lines.append(f"\n{len(bad)} failing cases:")
        lines += [o.line() for o in bad]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run fuzz cases (python -m tests.fuzz.harness).")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--full-every", type=int, default=10, help="every Nth case through real Inductor (0: none)")
    ap.add_argument("--seed", type=int, help="one case: print its source and what happened")
    ap.add_argument("--full", action="store_true", help="with --seed: through real Inductor")
    ap.add_argument("--jsonl", help="append one JSON line per case")
    a = ap.parse_args(argv)
    if a.seed is not None:
        case = generate(a.seed)
        print(case.reproducer())
        o = run_case(case, full=a.full or uses_full(case, 0))
        print(o.line())
        return 1 if o.problems else 0
    out = open(a.jsonl, "a") if a.jsonl else None

    def record(case, o):
        if out is not None:
            out.write(json.dumps(dataclasses.asdict(o), default=str) + "\n")
            out.flush()

    outcomes = run_seeds(range(a.start, a.start + a.cases), a.full_every, log=sys.stdout, on_outcome=record)
    print(summary(outcomes))
    return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
