"""Compile time: plain torch.compile against torch.compile with RopeFusionPass, cold, warm and at a restart, per
model, with what `auto` measured to decide.

Per model (benchmarks/models.py's builders at their real attention shapes, `--layers` layers or blocks of each
kind, default 1: the pass's sites and signatures are the same as with 2, plain compile's own seconds smaller, so
the ratio is the harder one), each compile the first call of a fresh `torch.compile` (Dynamo reset), in this
order:

1. `plain warm-up`: only before the process's first model, reported and not compared: the first compile of a
   process pays for what every later one reuses (CUDA libraries, the compile workers' first kernels);
2. `plain cold`: a process's first start: a fresh TORCHINDUCTOR_CACHE_DIR (Inductor's FX graph and AOTAutograd
   caches, its Triton kernels: all empty), torch.compile's defaults (both graph caches on: the compile writes them);
3. `pass cold`: the same in a fresh dir of its own: no `auto` decisions on disk either, measuring as `--measure`
   says (the pass's default, "auto": only where the factor table cannot call the choice);
4. `plain warm`: plain's dir again (its Triton kernels cached), the FX graph and AOTAutograd caches off, so that
   everything compiles again (a changed graph whose kernels are known);
5. `pass warm`: the pass's dir again: its decisions and kernels cached, the graph caches off, so the pass runs,
   reads its decisions and times nothing;
6. the restarts: plain's dir and the pass's, torch.compile's defaults again, each served by the graph caches its
   cold compile wrote (the pass's cache key is left as it was by the decisions its cold compile wrote): one of each
   (a process's second start, kept apart), then `--restarts` rounds alternating which goes first, whose median
   is the figure and whose range is plain's noise (`_alternating_restarts`).

Each step records Inductor's FX graph and AOTAutograd cache counters (hits, misses, bypasses), so a restart that
compiled again shows as such. Printed per model: the seconds of each, the pass's over plain's for each kind, the
pass's own seconds in each (its report: analysis and measuring), what `auto` did (signatures timed, decisions read,
sites left unmeasured as clear-cut, table fallbacks) and each kernel's or left site's choice, and whether the outputs
agree (the restart's against cold's too). Models run with CUDA graphs where the issue's table has them (`--modes`).

    python -m benchmarks.compile_time --out $OUT/compile_time.json      # every model (GPU, about 5 minutes)
    python -m benchmarks.compile_time --models flux ltx-video --modes both --layers 2
    python -m benchmarks.compile_time --quick                             # tiny configs on the CPU (smoke test)
    python -m benchmarks.compile_time --models ltx-video flux --isolate --profile 30

`--isolate` compiles each model's plain and pass variants in a fresh process of their own (cold, then warm in the
same cache dir), then restarts both in a third process from those dirs: in one process the variant compiled first
pays for the model's and the pass's first use (its imports, Dynamo's first trace of the model's code), which on the
CPU made plain cold 2-4x pass cold on every model after the first. `import rope_fusion` is then timed apart and
reported. `--repeats N` runs the plain and pass processes N times, alternating which goes first, each pair in fresh
dirs, and reports each cold and warm step's median (every run kept): one cold compile a variant moved by up to 1.5x
between runs on one host kind. `--profile N` runs the cold and warm steps under cProfile and prints the N functions
with the most own time, and under --isolate the N whose cumulative seconds grew most from plain's to the pass's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks.kernels import environment, print_table, raise_recompile_limits, warm_up, write_json  # noqa: E402
from benchmarks.models import build, caller, compare, first_tensor  # noqa: E402

# the models whose sites are measured first, the vision tower (the longest compile) last: a time limit keeps the rest
MODELS = ["ltx-video", "flux", "qwen-image", "wan-1.3b", "qwen3-8b", "hunyuan-video", "helios", "qwen2.5-vl-vision"]
GRAPHS = {"flux", "hunyuan-video"}  # compiled with CUDA graphs in the table; the others without
MEASURE = {"auto": "auto", "all": True, "off": False}


@contextlib.contextmanager
def _graph_caches(on: bool) -> Any:
    """The FX graph and AOTAutograd caches on or off (off: every compile runs, the pass included); Inductor's Triton
    kernels and `auto`'s decisions are read from the cache dir either way, empty when cold. Not
    `force_disable_caches`: under it Inductor compiles in a fresh directory of its own every time, so a warm compile
    found neither (an earlier version of this benchmark measured its "warm" column that way)."""
    with torch._inductor.config.patch(fx_graph_cache=on), \
            torch._functorch.config.patch(enable_autograd_cache=on):
        yield


def _cache_counters() -> collections.Counter:
    """Inductor's FX graph and AOTAutograd cache counters (hit, miss, bypass)."""
    from torch._dynamo.utils import counters

    return collections.Counter({k: v for k, v in counters["inductor"].items()
                                if k.startswith(("fxgraph_cache_", "autograd_cache_"))})


def _compile_seconds(m: torch.nn.Module, inputs: dict, cache_dir: str, cudagraphs: bool, device: str,
                     p: Any = None, caches: bool = False) -> tuple[float, Any]:
    """Seconds of the first call of a fresh compile (the compile and one forward) in `cache_dir`, and its output.
    Triton's own cache goes there too: a kernel launched by its JIT launcher (the folds' ops) compiles into
    TRITON_CACHE_DIR, by default one directory per user that outlives the process, where an earlier run's kernels
    made a cold compile warm for them."""
    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    opts: dict = {"triton.cudagraphs": True} if cudagraphs else {}
    if p is not None:
        opts["post_grad_custom_post_pass"] = p
    fn = torch.compile(m, options=opts) if opts else torch.compile(m)
    call = caller(fn, inputs, cudagraphs)
    t0 = time.perf_counter()
    with torch.no_grad(), _graph_caches(caches):
        out = call()
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    first = first_tensor(out)
    return seconds, (first.detach().clone() if first is not None else None)


def _profiled(step: str, top: int, run: Any, dump: str | None = None) -> Any:
    """run() under cProfile where `top` > 0: prints the `top` functions by own time, and dumps the profile to
    `dump` (the parent of --isolate prints the pass's difference from plain from the two dumps)."""
    if top <= 0:
        return run()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(run)
    finally:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
        body = buf.getvalue()
        print(f"--- profile of {step} by own time\n{body[body.find('ncalls'):]}", flush=True)
        if dump:
            prof.dump_stats(dump)


def profile_difference(plain: str, with_pass: str, top: int, kind: str = "cold") -> None:
    """The functions whose cumulative seconds grew most from plain's `kind` compile to the pass's (cProfile
    dumps)."""
    import pstats

    root = os.path.dirname(_HERE) + os.sep  # the checkout's own files by their paths in it

    def load(path: str) -> dict:
        out: dict = {}
        for (file, line, fn), (_, calls, own, cum, _) in pstats.Stats(path).stats.items():
            key = f"{file.split('site-packages/')[-1].removeprefix(root)}:{line}({fn})"
            if not os.path.basename(file).startswith("tmp"):  # generated modules: a new name every compile
                out[key] = (cum, own, calls)
        return out
    a, b = load(plain), load(with_pass)
    rows = sorted(((b.get(k, (0, 0, 0))[0] - a.get(k, (0, 0, 0))[0], k) for k in set(a) | set(b)), reverse=True)
    whole = max((d for d, k in rows if "contextlib" not in k), default=0.0)
    # the frames that hold the whole difference (Dynamo's and Inductor's entry points, decorators) say nothing
    rows = [(d, k) for d, k in rows if d < 0.8 * whole and "contextlib" not in k]
    print(f"--- cumulative seconds, pass {kind} minus plain {kind} (cProfile; {whole:+.2f} s in all; the {top} largest "
          "parts under the entry points)")
    for diff, k in rows[:top]:
        (ca, oa, na), (cb, ob, nb) = a.get(k, (0, 0, 0)), b.get(k, (0, 0, 0))
        print(f"  {diff:+7.2f}  plain {ca:6.2f} pass {cb:6.2f}  own {oa:5.2f}->{ob:5.2f}  calls {na}->{nb}  {k[-120:]}")


def _pass_seconds(p: Any) -> float:
    return sum(r.seconds for r in p.report.graph_records if not r.from_cache)


def _choices(p: Any) -> list[str]:
    r = p.report
    lines = [f"{k.op}[{k.backend}]: {k.choice}" for k in r.kernels]
    lines += [f"{m.node}: {m.reason}" for m in r.misses if m.reason.startswith("left to Inductor")]
    return [line[:400] for line in lines]


def _stats() -> collections.Counter:
    """auto's counters and its measuring seconds by phase (as "s <phase>")."""
    from rope_fusion.passes.auto import auto_timing

    return collections.Counter(auto_timing.STATS) + collections.Counter(
        {f"s {k}": v for k, v in auto_timing.SECONDS.items()})


def _free(device: str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# (step, its cache dir, with the pass, the graph caches on); the restarts are `_alternating_restarts`'
STEPS = {v: [(f"{v} cold", v, v == "pass", True), (f"{v} warm", v, v == "pass", False)] for v in ("plain", "pass")}
RESTARTS = (("plain restart", "plain", False), ("pass restart", "pass", True))
KINDS = ("cold", "warm", "restart")


def _cache_dirs(cache_root: str | None) -> dict[str, str]:
    """Each variant's cache dir: fresh ones of this process's own, or those under `cache_root` that the children of
    --isolate share (the restarts' child reads what the cold children wrote)."""
    if cache_root is None:
        return {v: tempfile.mkdtemp(prefix=f"compile_time_{v}_") for v in ("warm-up", "plain", "pass")}
    dirs = {v: os.path.join(cache_root, v) for v in ("warm-up", "plain", "pass")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    return dirs


def run_model(name: str, args: argparse.Namespace, device: str, cudagraphs: bool, first: bool,
              variant: str | None = None, cache_root: str | None = None) -> dict:
    """One model's compiles in this process: every step below and the alternating restarts, or only `variant`'s
    ("plain" or "pass": its cold and warm steps; "restarts": the restarts, from what the others wrote)."""
    rec: dict = {"model": name, "mode": "CUDA graphs" if cudagraphs else "launches", "layers": args.layers,
                 "s": {}, "pass_s": {}, "errors": {}}
    dirs = _cache_dirs(cache_root)
    try:
        m, inputs = build(name, args.quick, device, torch.bfloat16, layers=args.layers)
        if variant is not None:
            steps = STEPS.get(variant, [])
        else:
            steps = [("plain warm-up", "warm-up", False, False)] if first else []
            steps += [step for pair in zip(STEPS["plain"], STEPS["pass"]) for step in pair]
        if variant != "plain":
            t0 = time.perf_counter()
            import rope_fusion
            rec["import_s"] = round(time.perf_counter() - t0, 3)
        outs = {}
        for step, d, with_pass, caches in steps:
            p = rope_fusion.RopeFusionPass(measure=MEASURE[args.measure]) if with_pass else None
            before = _stats() if with_pass else collections.Counter()
            kind = step.rsplit(" ", 1)[-1]
            top = args.profile if kind in ("cold", "warm") else 0
            counted = _cache_counters()
            try:
                dump = f"{args.save_outs}.{d}.{kind}.prof" if args.save_outs else None
                rec["s"][step], outs[step] = _profiled(
                    f"{name} {step}", top,
                    lambda d=d, p=p, c=caches: _compile_seconds(m, inputs, dirs[d], cudagraphs, device, p, c), dump)
            except Exception as e:  # a failing step is reported, the others still run
                rec["errors"][step] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc(limit=3)
                continue
            rec.setdefault("caches", {})[step] = dict(_cache_counters() - counted)
            if p is not None:
                rec["pass_s"][step] = round(_pass_seconds(p), 3)
                rec.setdefault("auto", {})[step] = {k: round(v, 3) if isinstance(v, float) else v
                                                    for k, v in (_stats() - before).items() if v}
                rec.setdefault("choices", {})[step] = _choices(p)
                rec.setdefault("sites", {})[step] = len(p.report.sites)
            _free(device)
        if variant in (None, "restarts"):
            _alternating_restarts(rec, m, inputs, dirs, args, device, cudagraphs, outs)
        if args.save_outs:  # a child of --isolate: its parent compares the two variants' outputs
            torch.save({k: v.cpu() for k, v in outs.items() if v is not None}, args.save_outs)
        if outs.get("plain cold") is not None and outs.get("pass cold") is not None:
            rec["pass_vs_plain"] = compare(outs["pass cold"], outs["plain cold"])
        if outs.get("pass restart") is not None and outs.get("pass cold") is not None:
            rec["restart_vs_cold"] = compare(outs["pass restart"], outs["pass cold"])
        _ratios(rec)
    except Exception as e:
        rec["errors"]["build"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc(limit=3)
    finally:
        if cache_root is None:
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
        _free(device)
    return rec


def _alternating_restarts(rec: dict, m: torch.nn.Module, inputs: dict, dirs: dict, args: argparse.Namespace,
                          device: str, cudagraphs: bool, outs: dict) -> None:
    """plain's and the pass's restarts (torch.compile's defaults, each variant's own cache dir, which its cold
    compile wrote), one of each first, then `args.restarts` rounds alternating which goes first. A restart is a
    second or less, where a process's load drifts by a tenth: run one after the other, the variant run later read
    up to 1.2x the other on the CPU, where alternating in one process put the pass at 0.99-1.03x plain. The first
    pair is a process's second start (under --isolate, its own new process) and is kept apart (`first_restart_s`);
    the rounds' median is the restart figure, their range plain's noise."""
    import rope_fusion

    runs: dict = {step: [] for step, _, _ in RESTARTS}
    counts: dict = {step: collections.Counter() for step, _, _ in RESTARTS}
    for i in range(args.restarts + 1):
        for step, d, with_pass in (RESTARTS if i % 2 == 0 else RESTARTS[::-1]):
            p = rope_fusion.RopeFusionPass(measure=MEASURE[args.measure]) if with_pass else None
            counted = _cache_counters()
            try:
                seconds, out = _compile_seconds(m, inputs, dirs[d], cudagraphs, device, p, True)
            except Exception as e:  # reported; the other variant's restarts still run
                rec["errors"][step] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc(limit=3)
                continue
            counts[step].update(_cache_counters() - counted)
            if i == 0:
                rec.setdefault("first_restart_s", {})[step] = round(seconds, 3)
                outs[step] = out
            else:
                runs[step].append(seconds)
            if p is not None:
                rec["pass_s"][step] = round(_pass_seconds(p), 3)
            _free(device)
    for step, seconds in runs.items():
        rec.setdefault("caches", {})[step] = dict(counts[step])
        if seconds:
            rec.setdefault("s_all", {})[step] = [round(x, 3) for x in seconds]
            rec["s"][step] = statistics.median(seconds)


def isolated(name: str, cudagraphs: bool, args: argparse.Namespace) -> dict:
    """The model's plain and pass variants, each in a fresh process (cold, then warm), `--repeats` times alternating
    which goes first, each pair in fresh cache dirs; then a third process that restarts both from the caches the
    last pair wrote, alternating (`_alternating_restarts`); merged into one record. A cold or warm figure is the
    median of its repeats, each kept in `s_all`: a cold compile's seconds moved by up to 1.5x between runs on one
    host kind where the pass's graph was plain's."""
    import json
    import subprocess

    rec: dict = {"model": name, "mode": "CUDA graphs" if cudagraphs else "launches", "layers": args.layers,
                 "s": {}, "pass_s": {}, "errors": {}, "isolated": True, "repeats": args.repeats}
    outs: dict = {}
    runs: dict = collections.defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="compile_time_child_") as tmp:
        children = []
        for r in range(args.repeats):
            pair = ("plain", "pass") if r % 2 == 0 else ("pass", "plain")
            children += [(variant, os.path.join(tmp, f"caches{r}")) for variant in pair]
        children.append(("restarts", children[-1][1]))
        for n, (variant, root) in enumerate(children):
            js, pt = os.path.join(tmp, f"{variant}{n}.json"), os.path.join(tmp, f"{variant}.pt")
            cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", variant, "--models", name,
                   "--modes", "graphs" if cudagraphs else "launches", "--layers", str(args.layers),
                   "--measure", args.measure, "--profile", str(args.profile), "--restarts", str(args.restarts),
                   "--cache-root", root, "--out", js, "--save-outs", pt]
            cmd += ["--quick"] if args.quick else []
            done = subprocess.run(cmd, cwd=os.path.dirname(_HERE), capture_output=True, text=True)
            sys.stdout.write("".join(f"  [{variant}] {line}\n" for line in done.stdout.splitlines()
                                     if not line.startswith("There are modules")))
            if done.returncode != 0 or not os.path.exists(js):
                rec["errors"][variant] = f"child exited {done.returncode}: {done.stderr.strip()[-300:]}"
                continue
            (child,) = json.load(open(js))["records"]
            for key in ("s", "s_all", "first_restart_s", "pass_s", "errors", "auto", "choices", "sites", "caches"):
                rec.setdefault(key, {}).update(child.get(key, {}))
            if variant != "restarts":
                for step, seconds in child.get("s", {}).items():
                    runs[step].append(round(seconds, 3))
            if "import_s" in child and variant == "pass":
                rec["import_s"] = child["import_s"]
            if os.path.exists(pt) and not outs.keys() & {f"{variant} cold", f"{variant} restart"}:
                outs.update(torch.load(pt))  # the first repeat's outputs
        if args.repeats > 1:
            for step, seconds in runs.items():
                rec.setdefault("s_all", {})[step] = seconds
                rec["s"][step] = statistics.median(seconds)
        for kind in ("cold", "warm"):
            profiles = [os.path.join(tmp, f"{v}.pt.{v}.{kind}.prof") for v in ("plain", "pass")]
            if args.profile and all(os.path.exists(f) for f in profiles):
                profile_difference(*profiles, top=args.profile, kind=kind)
    if "plain cold" in outs and "pass cold" in outs:
        rec["pass_vs_plain"] = compare(outs["pass cold"], outs["plain cold"])
    if "pass restart" in outs and "pass cold" in outs:  # the graph a restart is served computes what cold's did
        rec["restart_vs_cold"] = compare(outs["pass restart"], outs["pass cold"])
    _ratios(rec)
    return rec


def _ratios(rec: dict) -> None:
    for kind in KINDS:
        if f"plain {kind}" in rec["s"] and f"pass {kind}" in rec["s"]:
            rec[f"ratio_{kind}"] = rec["s"][f"pass {kind}"] / rec["s"][f"plain {kind}"]


def _num(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _spread(rec: dict, step: str) -> str:
    """The step's runs as "min-max" (a step run once: "-")."""
    runs = rec.get("s_all", {}).get(step)
    return f"{min(runs):.2f}-{max(runs):.2f}" if runs else "-"


def _served(counts: dict | None) -> str:
    """"hit" where the graph caches served every graph of the step, else what they did ("2 miss", "1 bypass")."""
    counts = counts or {}
    hits = sum(v for k, v in counts.items() if k.endswith("_hit"))
    other = {k.rsplit("_", 1)[-1]: v for k, v in counts.items() if not k.endswith("_hit") and v}
    if not other:
        return "hit" if hits else "-"
    return " ".join(f"{v} {k}" for k, v in sorted(other.items()))


def summary(records: list[dict]) -> None:
    rows = []
    for r in records:
        s, ps, a, c = r["s"], r["pass_s"], r.get("auto", {}).get("pass cold", {}), r.get("caches", {})
        rows.append([r["model"], r["mode"], _num(s.get("plain cold")), _num(s.get("pass cold")),
                     _num(r.get("ratio_cold"), ".2f"), _num(ps.get("pass cold"), ".2f"), _num(s.get("plain warm")),
                     _num(s.get("pass warm")), _num(r.get("ratio_warm"), ".2f"), _num(ps.get("pass warm"), ".2f"),
                     _num(s.get("plain restart"), ".2f"), _num(s.get("pass restart"), ".2f"),
                     _num(r.get("ratio_restart"), ".2f"), _spread(r, "plain restart"), _spread(r, "pass restart"),
                     f"{_served(c.get('plain restart'))} / {_served(c.get('pass restart'))}",
                     a.get("timed", 0), a.get("cached", 0), a.get("clear", 0), a.get("over allowance", 0),
                     a.get("table", 0),
                     _num((r.get("pass_vs_plain") or {}).get("rel"), ".1e"),
                     _num(r.get("import_s"), ".2f"),
                     "; ".join(f"{k}: {v[:60]}" for k, v in r["errors"].items()) or "-"])
    print_table("compile seconds (first call): plain and with the pass; cold (empty caches, graph caches on), warm "
                "(Inductor's kernels cached, graph caches off: everything compiles, the pass reads its decisions), "
                "restart (graph caches on again: what cold wrote serves it; the median of --restarts, and their "
                "range); the pass's own seconds; the graph caches at the restart (plain / pass); auto: signatures "
                "timed, decisions read, sites left unmeasured (clear-cut, or beyond the compile's allowance for "
                "measuring), table",
                rows, ["model", "mode", "plain cold", "pass cold", "x", "pass's own", "plain warm", "pass warm", "x",
                       "pass's own", "plain restart", "pass restart", "x",
                       "plain restarts", "pass restarts", "restart caches", "timed", "cached",
                       "clear-cut", "over allowance", "table", "out rel err", "import s", "errors"])
    for r in records:
        for step in ("pass cold", "pass warm"):
            print(f"  {r['model']} ({r['mode']}) {step}: auto {(r.get('auto') or {}).get(step)}")
            for line in (r.get("choices") or {}).get(step, []):
                print(f"    {line}")
        if r.get("restart_vs_cold"):
            print(f"  {r['model']} ({r['mode']}) pass restart against pass cold: {r['restart_vs_cold']}")
        if r.get("s_all"):
            print(f"  {r['model']} ({r['mode']}) every run (s): {r['s_all']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=MODELS, help=f"of {MODELS} (comma- or space-separated)")
    ap.add_argument("--layers", type=int, default=1, help="layers or blocks of each kind (default 1)")
    ap.add_argument("--modes", choices=["table", "launches", "graphs", "both"], default="table",
                    help="with CUDA graphs or not: as the issue's table (Flux and HunyuanVideo with), or all one way, "
                         "or both")
    ap.add_argument("--measure", choices=list(MEASURE), default="auto",
                    help="the pass's measure policy: auto (its default), all (every site), off (the table)")
    ap.add_argument("--quick", action="store_true", help="tiny configs on the CPU (smoke test: nothing measures)")
    ap.add_argument("--restarts", type=int, default=3,
                    help="rounds of alternating restarts after the first (their median is reported, each one kept: "
                         "plain's range is the noise)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --isolate: cold and warm compiles per variant, alternating (the median is reported)")
    ap.add_argument("--isolate", action="store_true",
                    help="each model's plain and pass variants in a fresh process of their own")
    ap.add_argument("--profile", type=int, default=0,
                    help="cProfile the cold and warm steps: print this many functions")
    ap.add_argument("--child", choices=[*STEPS, "restarts"], help=argparse.SUPPRESS)  # one part, for --isolate
    ap.add_argument("--cache-root", help=argparse.SUPPRESS)  # the cache dirs the children of --isolate share
    ap.add_argument("--save-outs", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the records as JSON here (rewritten after every model)")
    args = ap.parse_args(argv)
    names = [x for v in args.models for x in v.split(",") if x]
    device = "cpu" if args.quick else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.compile_time compiles real-size models on a GPU and there is no CUDA device here: --quick "
              "runs tiny configs on the CPU (a smoke test)", file=sys.stderr)
        return 2
    raise_recompile_limits()
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    t_start = time.perf_counter()
    warm = 0.0 if args.isolate and not args.child else warm_up(device)  # each child warms its own process
    print(f"environment: {environment()}; warm-up {warm:.1f} s", flush=True)
    result: dict = {"environment": environment(), "argv": sys.argv[1:] if argv is None else argv, "records": []}
    runs: list[tuple[str, bool]] = []
    for name in names:
        modes = {"table": [name in GRAPHS], "launches": [False], "graphs": [True], "both": [False, True]}[args.modes]
        runs += [(name, cg and device == "cuda") for cg in modes]
    try:
        for i, (name, cg) in enumerate(runs):
            if args.isolate and not args.child:
                rec = isolated(name, cg, args)
            else:
                rec = run_model(name, args, device, cg, first=i == 0, variant=args.child, cache_root=args.cache_root)
            result["records"].append(rec)
            write_json(args.out, result, quiet=True)
            print(f"[{time.perf_counter() - t_start:6.1f}s] {name} ({rec['mode']}): {rec['s']}, pass's own "
                  f"{rec['pass_s']}, auto {rec.get('auto', {})}, errors {rec['errors']}", flush=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not args.child:
        summary(result["records"])
    result["seconds"] = time.perf_counter() - t_start
    print(f"\ncompile_time: {len(result['records'])} runs, {result['seconds']:.0f} s", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
