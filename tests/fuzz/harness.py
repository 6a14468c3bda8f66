"""Run a fuzz case with the pass, check it, and classify what happened.

Two ways to compile, because a real Inductor compile (C++ code generation) takes seconds on a small CPU:
- "graph" (most cases): `tests/zoo/harness.graph_level_backend`, Inductor's own front half (Dynamo, pre-grad
  passes, AOTAutograd with Inductor's decomposition table, joint-graph and post-grad passes, then the pass)
  whose inner compile runs the rewritten post-grad GraphModule eagerly: the graph the pass sees is the one
  real Inductor gives it, and the fused node runs its CPU eager implementation. About 0.4 s a case.
- "full" (every Nth case, and every case whose failure only the generated code can show: rows gathered out
  of range): real Inductor, as tests/helpers/compile_pass.compile_with_pass compiles, so the lowering runs too.

Every case is compared with eager and with an fp64 evaluation (the function on its inputs cast to fp64;
tests/helpers/numerics.fp64_eval), under the numerics contract of docs/design.md section 2: per output,
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
from tests.fuzz.generator import Case, generate
from tests.helpers.numerics import as_tuple, fp64_eval, rel_err
from tests.zoo.harness import Capture, graph_level_backend

# What can go wrong, in the order the summary prints them (a case can have several).
WRONG = "wrong numbers"
BROKEN = "broken compile"
SILENT = "silent miss"
FUSED_NONROT = "fused non-rotation"
INTERNAL = "internal error"
NO_RAISE = "no error where eager raises"
GUARDS = "added recompile"  # more graphs than plain compile over the same calls (a guard the pass added)
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
    guards_pass: int = 0  # shape guards the pass added (counted on the shape environment it ran in)
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


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


@contextlib.contextmanager
def no_caches():
    """Caches off: a hit would skip the pass (and hide a graph from the count). Data-dependent values
    (`.item()`, nonzero) are traced into the graph, not broken out of it (fullgraph=True)."""
    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield


def compiled(fn, pass_, full: bool, dynamic: bool | None, counter: list):
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


def _run(fn, args, pass_, full, dynamic, later=(), one_thread=False, marks=()):
    """(outputs, [outputs of each later call], graphs compiled, exception text). `later`: argument tuples to call
    the compiled function with after `args`; `marks`: (argument, dim) pairs marked dynamic before the first call.

    one_thread: generated C++ without OpenMP regions. A bounds assert that fires inside one throws through
    the parallel region and terminates the process (seen with plain compile on rows gathered out of range);
    outside one it is a RuntimeError, as a test needs it."""
    counter: list = []
    threads = torch._inductor.config.patch({"cpp.threads": 1}) if one_thread else contextlib.nullcontext()
    try:
        with no_caches(), threads:
            for i, dim in marks:
                torch._dynamo.mark_dynamic(args[i], dim)
            c = compiled(fn, pass_, full, True if dynamic else (None if marks else False), counter)
            out = as_tuple(c(*args))
            outs = [as_tuple(c(*a)) for a in later]
        return out, outs, len(counter), ""
    except Exception as e:  # recorded: the classification decides whose failure it is
        return None, None, len(counter), first_line(e)


def _shape_env(graph):
    for node in graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return mode.shape_env
    return None


class CountingPass(rope_fusion.RopeFusionPass):
    """The pass, counting the shape guards it adds to each graph's shape environment."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.guards_added = 0

    def __call__(self, graph, is_inference=None):
        env = _shape_env(graph)
        before = len(env.guards) if env is not None else 0
        super().__call__(graph, is_inference)
        self.guards_added += (len(env.guards) - before) if env is not None else 0


@contextlib.contextmanager
def backend_on_cpu(options: dict):
    """The Triton backend on CPU tensors where a case asks for it (tests/helpers/triton_cpu.py): its kernels
    interpreted, in place for the slice op and for the cat op too, as the project's tests run it."""
    if options.get("backend") != "triton":
        yield
        return
    from tests.helpers.triton_cpu import triton_on_cpu

    with triton_on_cpu(serves=("slice_write", "cat")):
        yield


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


def compute_eps(fn, args) -> float:
    """One rounding in the narrowest dtype the function computes in. fp64 data on which the graph computes in
    fp32 (`(x.float() * c.float() + ...).double()`) rounds in fp32: its fp64 evaluation keeps those casts, so
    eager is the reference there and a result that rounds the same math once more in fp32 meets the contract."""
    mode = _ComputeDtypes()
    with mode:
        fn(*args)
    return max((torch.finfo(d).eps for d in mode.dtypes), default=0.0)


def contract_rows(fn, args, outs, eager) -> tuple:
    """([err of outs], [err of eager], [eps], mismatch text) against the fp64 evaluation."""
    ref = fp64_eval(fn, *args)
    math_eps = compute_eps(fn, args)
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


def violates(ef, eo, eps) -> bool:
    return any(not (a <= b + e) for a, b, e in zip(ef, eo, eps))  # NaN is a violation


def run_case(case: Case, full: bool = False) -> Outcome:
    """Run one case the way its `run` says (tests/fuzz/hazards.py adds the ways beyond "forward") and classify it."""
    from tests.fuzz import hazard_runs

    full = full or case.needs_full
    if case.run == "forward":
        return _forward(case, full)
    return hazard_runs.RUNS[case.run](case, full)


def _sizes(case: Case) -> list:
    """The sizes a case's compiled function is called at, in order: S, then S2 under dynamic=True, then `sizes`."""
    return list(dict.fromkeys([case.S] + ([case.S2] if case.dynamic else []) + list(case.sizes)))


def record_report(res: Outcome, p) -> None:
    r = p.report
    res.sites, res.misses = len(r.sites), len(r.misses)
    res.miss_reasons = [str(m.reason) for m in r.misses]
    res.site_norms = [str(s.norm) for s in r.sites]
    res.errors = [str(e.error) for e in r.errors]
    res.guards_pass = getattr(p, "guards_added", 0)
    if res.errors:
        res.problems.append(INTERNAL)


def _forward(case: Case, full: bool) -> Outcome:
    t0 = time.perf_counter()
    res = Outcome(case.seed, case.family, case.tags, "full" if full else "graph", case.rotations)
    fn, make = case.build()
    sizes = _sizes(case)

    def inputs() -> list:  # fresh for every run: a case may write its inputs in place
        return [case.inputs(make, n) for n in sizes]

    try:
        eager = [as_tuple(fn(*a)) for a in inputs()]
    except Exception as e:
        res.eager_raised = first_line(e)
    options = dict(case.pass_options)
    p = CountingPass(**options)
    one_thread = bool(res.eager_raised)  # the inputs make the kernels fail: let them fail as exceptions
    dynamic, marks = case.dynamic, case.marks
    with backend_on_cpu(options):
        first, *later = inputs()
        out, outs, res.graphs_pass, res.pass_raised = _run(fn, first, p, full, dynamic, later, one_thread, marks)
    record_report(res, p)
    plain = None

    def plain_run():
        nonlocal plain
        if plain is None:
            first, *later = inputs()
            plain = _run(fn, first, None, full, dynamic, later, one_thread, marks)
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
    _judge_numbers(res, fn, inputs, [out, *outs], eager, plain_run)
    # recompiles: graphs compiled over every size, against plain compile
    if (case.dynamic or case.marks or len(sizes) > 1) and res.graphs_pass > 1:  # one graph is the least there is
        res.graphs_plain = plain_run()[2]
        if res.graphs_pass > res.graphs_plain:
            res.problems.append(GUARDS)
            res.detail = res.detail or f"{res.graphs_pass} graphs, plain {res.graphs_plain}; " \
                                       f"{res.guards_pass} shape guards added by the pass"
    classify_sites(res, case)
    res.seconds = time.perf_counter() - t0
    return res


def _judge_numbers(res: Outcome, fn, inputs, outs: list, eager: list, plain_run) -> None:
    """Each call's outputs against eager's and fp64's under the contract; a violation that plain compile shares is
    Inductor's ("plain off"), else wrong numbers."""
    violated, mismatch = False, ""
    for a, o, e in zip(inputs(), outs, eager):
        ef, eo, eps, bad = contract_rows(fn, a, o, e)
        res.err_pass += ef
        res.err_eager += eo
        mismatch = mismatch or bad
        violated = violated or violates(ef, eo, eps) or bool(bad)
    if violated:
        pl = plain_run()
        if pl[3]:
            res.plain_raised = pl[3]
        else:
            plain_ok, eps_all = True, []
            for a, po, e in zip(inputs(), [pl[0], *pl[1]], eager):
                pf, _eo, eps, pbad = contract_rows(fn, a, po, e)
                res.err_plain += pf
                eps_all += eps
                plain_ok = plain_ok and not pbad
            if not mismatch and plain_ok and not violates(res.err_pass, res.err_plain, eps_all):
                res.plain_off = True
                violated = False
        if violated:
            res.problems.append(WRONG)
            res.detail = mismatch


def classify_sites(res: Outcome, case: Case) -> None:
    """fused, near miss or silent miss (rotations); a non-rotation fused is a problem."""
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


def uses_full(case: Case, full_every: int) -> bool:
    return (full_every > 0 and case.seed % full_every == 0) or any(t in case.tags for t in FULL_ONLY_TAGS)


def run_seeds(seeds, full_every: int = 10, log=None, on_outcome=None, generate=generate) -> list:
    """Run the cases of `seeds` (`generate`: generator.generate, or hazards.generate for the hazard families)."""
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
             "no error where eager raises": "no-raise", "added recompile": "recompile"}
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


def read_outcomes(paths) -> list:
    """The outcomes that --jsonl files hold (one JSON line per case)."""
    fields = {f.name for f in dataclasses.fields(Outcome)}
    outcomes = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    o = Outcome(**{k: v for k, v in d.items() if k in fields})
                    o.tags = tuple(o.tags)
                    outcomes.append(o)
    return outcomes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run fuzz cases (python -m tests.fuzz.harness).")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--full-every", type=int, default=10, help="every Nth case through real Inductor (0: none)")
    ap.add_argument("--seed", type=int, help="one case: print its source and what happened")
    ap.add_argument("--full", action="store_true", help="with --seed: through real Inductor")
    ap.add_argument("--jsonl", help="append one JSON line per case")
    ap.add_argument("--hazards", action="store_true", help="the hazard families of tests/fuzz/hazards.py")
    ap.add_argument("--summary", nargs="+", metavar="JSONL", help="only print the summary of the cases in these "
                    "--jsonl files (one table for all: chunks of a profile run in parallel)")
    ap.add_argument("--family", help="with --hazards: only this family (seeds that draw it)")
    a = ap.parse_args(argv)
    if a.summary:
        outcomes = read_outcomes(a.summary)
        print(summary(outcomes))
        return 1 if any(o.problems for o in outcomes) else 0
    from tests.fuzz import hazards

    gen = generate
    if a.hazards:
        gen = (lambda seed: hazards.generate(seed, a.family)) if a.family else hazards.generate
    if a.seed is not None:
        case = gen(a.seed)
        print(case.reproducer())
        o = run_case(case, full=a.full or uses_full(case, 0))
        print(o.line())
        return 1 if o.problems else 0
    out = open(a.jsonl, "a") if a.jsonl else None

    def record(case, o):
        if out is not None:
            out.write(json.dumps(dataclasses.asdict(o), default=str) + "\n")
            out.flush()

    outcomes = run_seeds(range(a.start, a.start + a.cases), a.full_every, log=sys.stdout, on_outcome=record,
                         generate=gen)
    print(summary(outcomes))
    return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
