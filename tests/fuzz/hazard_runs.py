"""How the harness runs the hazard cases that are not one compiled forward call (tests/fuzz/hazards.py): the
gradients of a training step, `FxPass` on a graph traced without decompositions, and a host table written in place
between calls. Each classifies its case as the forward run does (harness.py): fused, near miss, wrong numbers,
broken compile, silent miss.
"""

from __future__ import annotations

import time

import torch

import rope_fusion
from tests.fuzz.generator import Case
from tests.fuzz.harness import (
    BROKEN,
    SILENT,
    WRONG,
    CountingPass,
    Outcome,
    classify_sites,
    compiled,
    compute_eps,
    contract_rows,
    first_line,
    no_caches,
    record_report,
    violates,
)
from tests.helpers.numerics import as_tuple, rel_err

# -- the backward of a training step ---------------------------------------------------------------------------------


def _leaf(a, dtype=None):
    if not isinstance(a, torch.Tensor):
        return a
    t = a.detach().to(dtype) if dtype is not None and (a.is_floating_point() or a.is_complex()) else a.detach()
    return t.clone().requires_grad_(a.requires_grad)


def _step(f, args, seed: int) -> list:
    """The outputs of f and the gradients of a random linear loss of them with respect to every input that
    requires grad."""
    out = as_tuple(f(*args))
    g = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in out]
    loss = sum((o * c).sum() for o, c in zip(out, cotangents))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in out] + [gr if gr is not None else torch.zeros_like(a) for gr, a in zip(grads, leaves)]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_err, or the absolute 2-norm error where the reference is zero (an input's gradient that is)."""
    if not bool(ref.ne(0).any()):
        return float(torch.linalg.vector_norm(out.double()))
    return rel_err(out, ref)


def run_backward(case: Case, full: bool) -> Outcome:
    t0 = time.perf_counter()
    res = Outcome(case.seed, case.family, case.tags, "full" if full else "graph", case.rotations)
    fn, make = case.build()

    def fresh(dtype=None):
        return [_leaf(a, dtype) for a in case.inputs(make)]

    eager = _step(fn, fresh(), case.seed)
    ref = _step(fn, fresh(torch.float64), case.seed)
    p = CountingPass(**dict(case.pass_options))
    counter: list = []
    try:
        with no_caches():
            got = _step(compiled(fn, p, full, False, counter), fresh(), case.seed)
    except Exception as e:
        res.pass_raised = first_line(e)
    res.graphs_pass = len(counter)
    record_report(res, p)
    if res.pass_raised:
        try:
            with no_caches():
                _step(compiled(fn, None, full, False, []), fresh(), case.seed)
        except Exception as e:
            res.plain_raised = first_line(e)
        res.status = "plain broken too" if res.plain_raised else "broken"
        if not res.plain_raised:
            res.problems.append(BROKEN)
        res.detail = f"with the pass: {res.pass_raised}"
        res.seconds = time.perf_counter() - t0
        return res
    math_eps = compute_eps(fn, fresh())  # one rounding in the narrowest dtype the step computes in
    eps = [max(torch.finfo(e.dtype).eps, math_eps) for e in eager]
    res.err_pass = [_rel(o, r) for o, r in zip(got, ref)]
    res.err_eager = [_rel(e, r) for e, r in zip(eager, ref)]
    if violates(res.err_pass, res.err_eager, eps):
        res.problems.append(WRONG)
        res.detail = "outputs, then gradients: pass/eager " + ", ".join(
            f"{a:.3g}/{b:.3g}" for a, b in zip(res.err_pass, res.err_eager))
    _classify_by_graph(res, p)
    res.seconds = time.perf_counter() - t0
    return res


def _classify_by_graph(res: Outcome, p) -> None:
    """A training step has a rotation in its forward graph and one in its backward graph: each graph's is fused,
    or a near miss, else a silent miss of that graph."""
    r = p.report
    kinds = {g.index: ("backward" if g.kind == "backward" else "forward") for g in r.graph_records}
    states = []
    for kind in ("forward", "backward"):
        graphs = {i for i, k in kinds.items() if k == kind}
        sites = sum(s.graph in graphs for s in r.sites)
        misses = sum(m.graph in graphs for m in r.misses)
        states.append("fused" if sites else "near miss" if misses else f"silent miss ({kind})")
    silent = [s for s in states if s.startswith("silent")]
    if silent:
        res.status = silent[0]
        res.problems.append(SILENT)
        res.detail = res.detail or " | ".join(res.miss_reasons)[:600]
    elif all(s == "fused" for s in states):
        res.status = "fused"
    else:
        res.status = "near miss" if "fused" not in states else "partly fused, near miss"


# -- FxPass on a graph traced without decompositions ------------------------------------------------------------------

def run_fx_pass(case: Case, full: bool) -> Outcome:
    from torch.fx.experimental.proxy_tensor import make_fx

    t0 = time.perf_counter()
    res = Outcome(case.seed, case.family, case.tags, "fx_pass", case.rotations)
    fn, make = case.build()
    eager = as_tuple(fn(*case.inputs(make)))
    p = rope_fusion.FxPass()
    try:
        gm = make_fx(fn, tracing_mode="fake")(*case.inputs(make))
        kept = sorted({str(n.target) for n in gm.graph.nodes if "unbind" in str(n.target) or "stack" in str(n.target)})
        p(gm)
        out = as_tuple(gm(*case.inputs(make)))
    except Exception as e:
        res.pass_raised = first_line(e)
        res.status, res.detail = "broken", f"with FxPass: {res.pass_raised}"
        res.problems.append(BROKEN)
        res.seconds = time.perf_counter() - t0
        return res
    record_report(res, p)
    ef, eo, eps, bad = contract_rows(fn, case.inputs(make), out, eager)
    res.err_pass, res.err_eager = ef, eo
    if violates(ef, eo, eps) or bad:
        res.problems.append(WRONG)
        res.detail = bad
    classify_sites(res, case)
    if kept:
        res.detail = (res.detail + "; " if res.detail else "") + f"kept whole: {', '.join(kept)}"
    res.seconds = time.perf_counter() - t0
    return res


# -- a host table written between calls ---------------------------------------------------------------------------

def run_host_table(case: Case, full: bool) -> Outcome:
    """Calls interleaved with writes through the case's paths. On a GPU the compiled function moves the host table
    to the device inside (`t.to(x.device)`), which the pass serves from its cache: each result against eager's
    under the contract. Without one, the cache itself (the op's) serves a CPU copy: bit for bit the table as it is
    now, or the copy is stale."""
    t0 = time.perf_counter()
    res = Outcome(case.seed, case.family, case.tags, "cuda" if torch.cuda.is_available() else "cache",
                  case.rotations)
    ns: dict = {}
    exec(compile(case.source, case.filename, "exec"), ns)
    case.build()  # the source in linecache for tracebacks
    x, table, array = ns["make"](torch.Generator().manual_seed(case.seed), case.S)
    step = _compiled_step(ns["fn"], res) if torch.cuda.is_available() else _cache_step(ns["fn"], res)
    try:
        for i in range(ns["WRITES"] + 1):
            step(x, table, i)
            if i < ns["WRITES"]:
                ns[f"write{i}"](table, array)
    except Exception as e:
        res.pass_raised = first_line(e)
        res.problems.append(BROKEN)
        res.detail = res.pass_raised
    if res.problems and res.status == "":
        res.status = "stale" if WRONG in res.problems else "broken"
    res.status = res.status or "fresh"
    res.seconds = time.perf_counter() - t0
    return res


def _cache_step(fn, res: Outcome):
    from rope_fusion.ops.host_tables import HostTableCache

    cache = HostTableCache()

    def step(x, table, i):
        served = cache.get(table, torch.device("cpu"))
        same = _bits_equal(served, table)
        if (not same or not torch.equal(as_tuple(fn(x, served))[0], as_tuple(fn(x, table))[0])) \
                and WRONG not in res.problems:
            res.problems.append(WRONG)
            res.detail = f"call {i}: the cached copy differs from the table as written"
    return step


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.flatten().view(torch.uint8),
                                                                          b.contiguous().flatten().view(torch.uint8)))


def _compiled_step(fn, res: Outcome):
    def moved(x, t):
        return fn(x, t.to(x.device))

    p = CountingPass()
    with no_caches():
        f = compiled(moved, p, True, False, [])

    def step(x, table, i):
        args = (x.cuda(), table)
        out = as_tuple(f(*args))
        ef, eo, eps, bad = contract_rows(moved, args, out, as_tuple(moved(*args)))
        if (violates(ef, eo, eps) or bad) and WRONG not in res.problems:
            res.problems.append(WRONG)
            res.detail = f"call {i}: pass/eager {ef}/{eo}"
        if i == 0:
            record_report(res, p)
    return step


RUNS = {"backward": run_backward, "fx_pass": run_fx_pass, "host_table": run_host_table}
