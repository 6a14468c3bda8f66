"""Compile time: plain torch.compile against torch.compile with RopeFusionPass, cold and warm, per model, with
what `auto` measured to decide.

Per model (benchmarks/models.py's builders at their real attention shapes, `--layers` layers or blocks of each
kind, default 1: the pass's sites and signatures are the same as with 2, plain compile's own seconds smaller, so
the ratio is the harder one), each compile the first call of a fresh `torch.compile` (Dynamo reset), in this
order:

1. `plain warm-up`: only before the process's first model, reported and not compared: the first compile of a
   process pays for what every later one reuses (CUDA libraries, the compile workers' first kernels);
2. `plain cold`: a fresh TORCHINDUCTOR_CACHE_DIR (Inductor's FX graph and AOTAutograd caches, its Triton kernels:
   all empty), the FX graph and AOTAutograd caches off in every step;
3. `pass cold`: the same in a fresh dir of its own: no `auto` decisions on disk either, measuring as `--measure`
   says (the pass's default, "auto": only where the factor table cannot call the choice);
4. `plain warm`: plain's dir again (its Triton kernels cached), the FX graph and AOTAutograd caches still off;
5. `pass warm`: the pass's dir again: its decisions and kernels cached, the FX graph cache off, so the pass runs,
   reads its decisions and times nothing.

Printed per model: the seconds of each, pass cold / plain cold and pass warm / plain warm, the pass's own seconds in
each (its report: analysis and measuring), what `auto` did (signatures timed, decisions read, sites left unmeasured
as clear-cut, table fallbacks) and each kernel's or left site's choice, and whether the outputs agree. Models run
with CUDA graphs where the issue's table has them (`--modes`).

    python -m benchmarks.compile_time --out $OUT/compile_time.json      # every model (GPU, about 5 minutes)
    python -m benchmarks.compile_time --models flux ltx-video --modes both --layers 2
    python -m benchmarks.compile_time --quick                             # tiny configs on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import shutil
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
def _graph_caches_off() -> Any:
    """The FX graph and AOTAutograd caches off, so that every compile runs (the pass included); Inductor's Triton
    kernels and `auto`'s decisions are read from the cache dir, empty when cold. Not `force_disable_caches`: under
    it Inductor compiles in a fresh directory of its own every time, so a warm compile found neither (an earlier
    version of this benchmark measured its "warm" column that way)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _compile_seconds(m: torch.nn.Module, inputs: dict, cache_dir: str, cudagraphs: bool, device: str,
                     p: Any = None) -> tuple[float, Any]:
    """Seconds of the first call of a fresh compile (the compile and one forward) in `cache_dir`, and its output."""
    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    opts: dict = {"triton.cudagraphs": True} if cudagraphs else {}
    if p is not None:
        opts["post_grad_custom_post_pass"] = p
    fn = torch.compile(m, options=opts) if opts else torch.compile(m)
    call = caller(fn, inputs, cudagraphs)
    t0 = time.perf_counter()
    with torch.no_grad(), _graph_caches_off():
        out = call()
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    first = first_tensor(out)
    return seconds, (first.detach().clone() if first is not None else None)


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


def run_model(name: str, args: argparse.Namespace, device: str, cudagraphs: bool, first: bool) -> dict:
    import rope_fusion

    rec: dict = {"model": name, "mode": "CUDA graphs" if cudagraphs else "launches", "layers": args.layers,
                 "s": {}, "pass_s": {}, "errors": {}}
    dirs = {v: tempfile.mkdtemp(prefix=f"compile_time_{v}_") for v in ("warm-up", "plain", "pass")}
    try:
        m, inputs = build(name, args.quick, device, torch.bfloat16, layers=args.layers)
        steps: list[tuple[str, str, bool]] = [("plain warm-up", "warm-up", False)] if first else []
        steps += [("plain cold", "plain", False), ("pass cold", "pass", True), ("plain warm", "plain", False),
                  ("pass warm", "pass", True)]
        outs = {}
        for step, d, with_pass in steps:
            p = rope_fusion.RopeFusionPass(measure=MEASURE[args.measure]) if with_pass else None
            before = _stats()
            try:
                rec["s"][step], outs[step] = _compile_seconds(m, inputs, dirs[d], cudagraphs, device, p)
            except Exception as e:  # a failing step is reported, the others still run
                rec["errors"][step] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc(limit=3)
                continue
            if p is not None:
                rec["pass_s"][step] = round(_pass_seconds(p), 3)
                rec.setdefault("auto", {})[step] = {k: round(v, 3) if isinstance(v, float) else v
                                                    for k, v in (_stats() - before).items() if v}
                rec.setdefault("choices", {})[step] = _choices(p)
                rec.setdefault("sites", {})[step] = len(p.report.sites)
            _free(device)
        if outs.get("plain cold") is not None and outs.get("pass cold") is not None:
            rec["pass_vs_plain"] = compare(outs["pass cold"], outs["plain cold"])
        s = rec["s"]
        for kind in ("cold", "warm"):
            if f"plain {kind}" in s and f"pass {kind}" in s:
                rec[f"ratio_{kind}"] = s[f"pass {kind}"] / s[f"plain {kind}"]
    except Exception as e:
        rec["errors"]["build"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc(limit=3)
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        _free(device)
    return rec


def _num(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def summary(records: list[dict]) -> None:
    rows = []
    for r in records:
        s, ps, a = r["s"], r["pass_s"], r.get("auto", {}).get("pass cold", {})
        rows.append([r["model"], r["mode"], _num(s.get("plain cold")), _num(s.get("pass cold")),
                     _num(r.get("ratio_cold"), ".2f"), _num(ps.get("pass cold"), ".2f"), _num(s.get("plain warm")),
                     _num(s.get("pass warm")), _num(r.get("ratio_warm"), ".2f"), _num(ps.get("pass warm"), ".2f"),
                     a.get("timed", 0), a.get("cached", 0), a.get("clear", 0), a.get("table", 0),
                     _num((r.get("pass_vs_plain") or {}).get("rel"), ".1e"),
                     "; ".join(f"{k}: {v[:60]}" for k, v in r["errors"].items()) or "-"])
    print_table("compile seconds (first call, FX graph cache off): plain and with the pass, cold and warm; the pass's "
                "own seconds; auto: signatures timed, decisions read, sites left unmeasured (clear-cut), table",
                rows, ["model", "mode", "plain cold", "pass cold", "x", "pass's own", "plain warm", "pass warm", "x",
                       "pass's own", "timed", "cached", "clear-cut", "table", "out rel err", "errors"])
    for r in records:
        for step in ("pass cold", "pass warm"):
            print(f"  {r['model']} ({r['mode']}) {step}: auto {(r.get('auto') or {}).get(step)}")
            for line in (r.get("choices") or {}).get(step, []):
                print(f"    {line}")


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
    ap.add_argument("--out", help="write the records as JSON here (rewritten after every model)")
    args = ap.parse_args(argv)
    names = [x for v in args.models for x in v.split(",") if x]
    device = "cpu" if args.quick else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.compile_time compiles real-size models on a GPU and there is no CUDA device here: --quick "
              "runs tiny configs on the CPU (a smoke test)", file=sys.stderr)
        return 2
    raise_recompile_limits()
    saved_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    t_start = time.perf_counter()
    print(f"environment: {environment()}; warm-up {warm_up(device):.1f} s", flush=True)
    result: dict = {"environment": environment(), "argv": sys.argv[1:] if argv is None else argv, "records": []}
    runs: list[tuple[str, bool]] = []
    for name in names:
        modes = {"table": [name in GRAPHS], "launches": [False], "graphs": [True], "both": [False, True]}[args.modes]
        runs += [(name, cg and device == "cuda") for cg in modes]
    try:
        for i, (name, cg) in enumerate(runs):
            rec = run_model(name, args, device, cg, first=i == 0)
            result["records"].append(rec)
            write_json(args.out, result, quiet=True)
            print(f"[{time.perf_counter() - t_start:6.1f}s] {name} ({rec['mode']}): {rec['s']}, pass's own "
                  f"{rec['pass_s']}, auto {rec.get('auto', {})}, errors {rec['errors']}", flush=True)
    finally:
        if saved_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_dir
    summary(result["records"])
    result["seconds"] = time.perf_counter() - t_start
    print(f"\ncompile_time: {len(result['records'])} runs, {result['seconds']:.0f} s", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
