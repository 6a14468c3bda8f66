"""What measured `auto` chooses, against what each choice really costs, and what measuring adds to the compile.

Kernel rows (the calibration rows of rope_fusion/passes/auto/calibration.py, and the Qwen2.5-VL vision tower's site:
32768 tokens, 16 heads, D=80, NeoX, fp32 math), in both modes (without CUDA graphs, and replayed in them):
- `auto`: the backend measured `auto` took (or "left"), and the timings it chose by (the report's words);
- `table`: what the factor table takes (`RopeFusionPass(measure=False)`);
- `us plain / triton / inductor`: each choice compiled and timed here, the way `auto` times (CUDA-graph replay, or
  a timed loop of calls with their launches), so the choice can be checked against the fastest;
- `cold s` / `warm s` / `off s`: the first call's seconds (the compile) with measuring on and an empty decision
  cache, again with the decisions cached (Dynamo reset, FX graph cache off: the pass runs and times nothing), and
  with measuring off;
- `check %`: the self-check's share of the cold compile (passes/fusion_check.py: the fused candidates' first
  outputs against left's under the numbers contract; the target is at most 2%), and how many it refused.

Models (benchmarks/models.py builders, default flux and qwen2.5-vl-vision): per model and mode the compile's
seconds cold (measure on, empty caches), warm (decisions cached) and with measure off, the sites each fused or
left (with the measured timings), and the median ms of a call with measure on against off.

Every compile runs in a fresh Inductor cache dir (`TORCHINDUCTOR_CACHE_DIR`), so "cold" is cold. One compact
table per group; `--out` writes the records as JSON.

    python -m benchmarks.auto_choice                                  # GPU: every row and the default models
    python -m benchmarks.auto_choice --rows vision --models flux --modes graphs
    python -m benchmarks.auto_choice --dry                            # CPU: tiny shapes, measuring on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import rope_fusion  # noqa: E402
from benchmarks import device_check  # noqa: E402
from rope_fusion.passes import fusion_check  # noqa: E402
from rope_fusion.passes.auto import auto_clock, auto_timing, calibration  # noqa: E402

VISION = calibration.Row("vision D=80 fp32 math (32768x16x80)", "neox", "none", 80, 16, 16,
                         {"triton": ("triton_padded", "none")})
ROWS = (*calibration.ROWS, VISION)
ROW_TOKENS = {VISION.name: 32768}


def fresh_cache() -> str:
    path = tempfile.mkdtemp(prefix="auto_choice_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def first_call(fn: Callable, args: tuple, kwargs: dict | None = None) -> float:
    """Seconds of the first call (the compile), with FX graph and AOTAutograd caches off."""
    torch._dynamo.reset()
    t0 = time.perf_counter()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        fn(*args, **(kwargs or {}))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return time.perf_counter() - t0


def choice_of(p: Any) -> str:
    """What the pass chose, in a few words: backends of its kernels, or "left", and the timings behind it."""
    r = p.report
    chosen = [k.backend for k in r.kernels] + ["left"] * sum(m.reason.startswith("left to Inductor") for m in r.misses)
    words = [k.choice for k in r.kernels if k.choice] + [m.reason[len("left to Inductor: "):] for m in r.misses
                                                        if m.reason.startswith("left to Inductor")]
    return f"{'+'.join(dict.fromkeys(chosen)) or 'nothing'}" + (f" [{words[0]}]" if words else "")


def choices(p: Any) -> list[str]:
    """One line per kernel and per site left: the backend and how `auto` chose it."""
    r = p.report
    return sorted({f"{k.backend}: {k.choice}" for k in r.kernels}
                  | {f"left: {m.reason}" for m in r.misses if m.reason.startswith("left to Inductor")})


@contextlib.contextmanager
def check_share(rec: dict, key: str):
    """The self-check's seconds, checks and refusals while the block runs, and its share of `rec[key]` (seconds
    the block sets)."""
    before = dict(fusion_check.STATS)
    yield
    rec["check_s"] = fusion_check.STATS["seconds"] - before.get("seconds", 0.0)
    rec["checked"] = fusion_check.STATS["checked"] - before.get("checked", 0)
    rec["refused"] = fusion_check.STATS["refused"] - before.get("refused", 0)
    rec["check_share"] = rec["check_s"] / rec[key] if rec.get(key) else None


def compiled(fn: Callable, p: Any | None) -> Callable:
    return torch.compile(fn, options={"post_grad_custom_post_pass": p} if p is not None else None)


def run_row(row: calibration.Row, graphs: bool, device: str, tokens: int, dtype: torch.dtype) -> dict:
    args = calibration.row_inputs(row, tokens, device, dtype)
    site = calibration.site_fn(row)
    rec: dict = {"row": row.name, "mode": "graphs" if graphs else "launches"}
    fresh_cache()
    p = rope_fusion.RopeFusionPass(cuda_graphs=graphs, verify=False)
    with check_share(rec, "cold_s"):
        rec["cold_s"] = first_call(compiled(site, p), args)
    rec["auto"] = choice_of(p)
    p = rope_fusion.RopeFusionPass(cuda_graphs=graphs)
    timed = auto_timing.STATS["timed"]
    rec["warm_s"] = first_call(compiled(site, p), args)
    rec["warm_timed"] = auto_timing.STATS["timed"] - timed
    fresh_cache()
    p = rope_fusion.RopeFusionPass(cuda_graphs=graphs, measure=False)
    rec["off_s"] = first_call(compiled(site, p), args)
    rec["table"] = choice_of(p)
    timer = auto_clock.default_timer(graphs)
    rec["us"] = {}
    for name, p in (("plain", None), ("triton", rope_fusion.RopeFusionPass(backend="triton", measure=False)),
                    ("inductor", rope_fusion.RopeFusionPass(backend="inductor", measure=False))):
        if name == "triton" and not device.startswith("cuda"):
            continue
        fn = compiled(site, p)
        first_call(fn, args)
        with torch.no_grad():
            rec["us"][name] = timer(name, lambda f=fn: f(*args)) * 1e6
    return rec


def run_model(name: str, graphs: bool, device: str, dtype: torch.dtype, quick: bool, calls: int) -> dict:
    from benchmarks import models

    model, inputs = models.build(name, quick, device, dtype)
    rec: dict = {"model": name, "mode": "graphs" if graphs else "launches"}
    fns = {}
    for label, measure in (("on", True), ("off", False)):
        fresh_cache()
        p = rope_fusion.RopeFusionPass(cuda_graphs=graphs, measure=measure, verify=False)
        fn = torch.compile(model, options={"post_grad_custom_post_pass": p, "triton.cudagraphs": graphs})
        with check_share(rec, f"cold_{label}_s") if measure else contextlib.nullcontext():
            rec[f"cold_{label}_s"] = first_call(fn, (), inputs)
        rec[f"sites_{label}"] = p.report.summary()
        rec[f"auto_{label}"] = choices(p)
        if measure:
            timed = auto_timing.STATS["timed"]
            p2 = rope_fusion.RopeFusionPass(cuda_graphs=graphs)
            fn2 = torch.compile(model, options={"post_grad_custom_post_pass": p2, "triton.cudagraphs": graphs})
            rec["warm_on_s"] = first_call(fn2, (), inputs)
            rec["warm_timed"] = auto_timing.STATS["timed"] - timed
        fns[label] = fn
    with torch.no_grad():
        for label, fn in fns.items():
            for _ in range(2):
                fn(**inputs)
            rec[f"ms_{label}"] = models.time_calls(lambda f=fn: f(**inputs), calls, device)
    return rec


def _num(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _share(r: dict) -> str:
    """The self-check's share of the cold compile, and its refusals if any."""
    share = r.get("check_share")
    return "-" if share is None else f"{share:.2%}" + (f" R{r['refused']}" if r.get("refused") else "")


def print_rows(records: list[dict]) -> None:
    print(f"{'row':38s} {'mode':8s} {'plain':>8s} {'triton':>8s} {'induct':>8s} {'cold s':>7s} {'warm s':>7s} "
          f"{'off s':>6s} {'check %':>8s}  auto / table")
    for r in records:
        if "error" in r:
            print(f"{r['row']:38s} {r['mode']:8s} error: {r['error']}")
            continue
        us = r["us"]
        print(f"{r['row']:38s} {r['mode']:8s} {_num(us.get('plain'), '.1f'):>8s} {_num(us.get('triton'), '.1f'):>8s} "
              f"{_num(us.get('inductor'), '.1f'):>8s} {r['cold_s']:7.1f} {r['warm_s']:7.1f} {r['off_s']:6.1f} "
              f"{_share(r):>8s}  {r['auto']} / {r['table']}")


def print_models(records: list[dict]) -> None:
    print(f"{'model':20s} {'mode':8s} {'cold on':>8s} {'cold off':>8s} {'warm on':>8s} {'ms on':>8s} {'ms off':>8s}"
          f" {'check %':>8s}  sites (on)")
    for r in records:
        if "error" in r:
            print(f"{r['model']:20s} {r['mode']:8s} error: {r['error']}")
            continue
        print(f"{r['model']:20s} {r['mode']:8s} {r['cold_on_s']:8.1f} {r['cold_off_s']:8.1f} {r['warm_on_s']:8.1f} "
              f"{r['ms_on']:8.3f} {r['ms_off']:8.3f} {_share(r):>8s}  {r['sites_on']}")
        for line in r["auto_on"]:
            print(f"    {line}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="comma-separated substrings of row names (default all)")
    ap.add_argument("--models", default="flux,qwen2.5-vl-vision", help="benchmarks/models.py names ('' for none)")
    ap.add_argument("--modes", default="launches,graphs", help="launches, graphs or both")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=20, help="calls per model timing")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, measuring on the CPU (a smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.dry:
        device, dtype, tokens, quick = "cpu", torch.float32, 16, True
        auto_timing._MEASURE_DEVICE_TYPES = (*auto_timing._MEASURE_DEVICE_TYPES, "cpu")
        modes = [False]
        wanted = [w for w in args.rows.split(",") if w]
        model_names = [m for m in args.models.split(",") if m][:1] if args.models else []
    else:
        if not device_check.gpu_present():
            return device_check.no_gpu("benchmarks.auto_choice", "python -m benchmarks.auto_choice --dry")
        device, dtype, tokens, quick = "cuda", torch.bfloat16, args.tokens, False
        modes = [m == "graphs" for m in args.modes.split(",") if m]
        wanted = [w for w in args.rows.split(",") if w]
        model_names = [m for m in args.models.split(",") if m]
    rows = [r for r in ROWS if not wanted or any(w in r.name for w in wanted)]
    if args.dry:
        rows = rows[:1]
    result: dict = {"rows": [], "models": [], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    device_check.announce(device, result)
    for graphs in modes:
        for row in rows:
            n = tokens if args.dry else ROW_TOKENS.get(row.name, tokens)
            try:
                result["rows"].append(run_row(row, graphs, device, n, dtype))
            except Exception as e:  # a row that fails is reported and the run goes on
                result["rows"].append({"row": row.name, "mode": "graphs" if graphs else "launches",
                                       "error": f"{type(e).__name__}: {e}"})
            print_rows(result["rows"][-1:])
    for graphs in modes:
        for name in model_names:
            try:
                result["models"].append(run_model(name, graphs, device, dtype, quick, 3 if args.dry else args.calls))
            except Exception as e:
                result["models"].append({"model": name, "mode": "graphs" if graphs else "launches",
                                         "error": f"{type(e).__name__}: {e}"})
    print()
    print_rows(result["rows"])
    if result["models"]:
        print()
        print_models(result["models"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(f"measured signatures {auto_timing.STATS['timed']}, cached {auto_timing.STATS['cached']}, "
          f"table {auto_timing.STATS['table']}; median cold compile with measuring on / off: "
          f"{statistics.median([r['cold_s'] for r in result['rows'] if 'cold_s' in r] or [0]):.1f} s / "
          f"{statistics.median([r['off_s'] for r in result['rows'] if 'off_s' in r] or [0]):.1f} s")
    shares = [r["check_share"] for r in result["rows"] + result["models"] if r.get("check_share") is not None]
    print(f"self-check: {fusion_check.STATS['checked']} candidates compared, {fusion_check.STATS['refused']} refused; "
          f"its share of a cold compile: max {max(shares, default=0):.2%}, median "
          f"{statistics.median(shares or [0]):.2%} (target: at most 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
