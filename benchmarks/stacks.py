"""Compile stacks without Inductor: `rope_fusion.backend(inner)` against the same inner backend without the pass.

For each model (benchmarks/models.py builders: `flux` is Flux.1-dev dims, 2 double + 2 single blocks, 4096 +
512 tokens; `wan-1.3b` is Wan2.1 1.3B dims at 480x832, 81 frames, 32760 tokens; bf16) and each inner backend
("cudagraphs", "eager"), two variants compile on their first call:
- plain: `torch.compile(model, backend=inner)` (torch's own backend: "eager" runs Dynamo's graph as it is,
  "cudagraphs" runs AOTAutograd's graphs under CUDA graph trees);
- pass: `torch.compile(model, backend=rope_fusion.backend(inner))` (AOTAutograd with Inductor's decompositions,
  fx_pass on each graph, then the same inner runner).
Outputs are compared with eager. Then `--repeats` alternating repeats (plain, pass on even repeats; pass, plain on
odd ones), each variant timed as the median of several forwards (CUDA events; wall clock on the CPU; under
cudagraphs each call marks a new step). Printed and written per model and inner: the median speedup of the pass
and its range over the repeats, compile seconds, and what fused.

    python -m benchmarks.stacks --out $OUT/stacks.json                   # flux and wan-1.3b, both inners (GPU)
    python -m benchmarks.stacks --models flux --inners eager --repeats 5
    python -m benchmarks.stacks --device cpu --quick                     # tiny configs on the CPU (smoke test)

Without a CUDA device it exits 2 with one line, unless --quick or `--device cpu` says to run on the CPU (where
"cudagraphs" is skipped: CUDA graphs need CUDA): a smoke run, which checks the plumbing and prints no times or
speedups (benchmarks/device_check.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import device_check  # noqa: E402
from benchmarks.kernels import environment, pass_summary, print_table, raise_recompile_limits, write_json  # noqa: E402
from benchmarks.models import build, caller, compare, time_calls  # noqa: E402

DEFAULT_MODELS = ["flux", "wan-1.3b"]
INNERS = ["cudagraphs", "eager"]


def _calls_for(call, device: str, target_s: float, max_calls: int) -> int:
    """How many calls fill about target_s (at least 3)."""
    t0 = time.perf_counter()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    return max(3, min(max_calls, int(target_s / one)))


def run(name: str, inner: str, quick: bool, device: str, dtype: torch.dtype, repeats: int, target_s: float,
        max_calls: int) -> dict:
    import rope_fusion

    rec: dict = {"model": name, "inner": inner, "compile_s": {}, "err": {}, "ms": {}, "errors": {}}
    model, inputs = build(name, quick, device, dtype)
    with torch.no_grad():
        want = model(**inputs)
        backends = {"plain": inner, "pass": rope_fusion.backend(inner)}
        fns = {}
        for variant, be in backends.items():
            try:
                torch._dynamo.reset()
                fn = torch.compile(model, backend=be)
                call = caller(fn, inputs, inner == "cudagraphs")
                t0 = time.perf_counter()
                got = call()
                if device == "cuda":
                    torch.cuda.synchronize()
                rec["compile_s"][variant] = time.perf_counter() - t0
                rec["err"][variant] = compare(got, want)
                call()  # cudagraphs: the second call records the graph
                fns[variant] = call
            except Exception as e:  # a variant that fails is reported, the others go on
                rec["errors"][variant] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        if "pass" in fns:
            rec["pass"] = pass_summary(backends["pass"])
        runs = {v: [] for v in fns}
        n = _calls_for(fns["plain"], device, target_s, max_calls) if "plain" in fns else 3
        for r in range(repeats):
            for v in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                runs[v].append(time_calls(fns[v], n, device))
    rec["ms"] = {v: {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}
                 for v, xs in runs.items() if xs}
    if "plain" in runs and "pass" in runs and runs["plain"] and runs["pass"]:
        ratios = [a / b for a, b in zip(runs["plain"], runs["pass"])]
        rec["speedup"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                          "runs": ratios}
    rec["calls_per_repeat"] = n
    del model, fns
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny configs (smoke test)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda if available; cpu only with --quick or when asked")
    ap.add_argument("--out", help="write the results as JSON here (rewritten after every model)")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, default {DEFAULT_MODELS}")
    ap.add_argument("--inners", default=",".join(INNERS), help=f"comma-separated inner backends, default {INNERS}")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats per variant (default 3)")
    ap.add_argument("--seconds-per-repeat", type=float, default=0.3, help="timed seconds per variant and repeat")
    ap.add_argument("--max-calls", type=int, default=30, help="most calls per repeat (default 30)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if device_check.gpu_present() or not args.quick else "cpu")
    if device == "cuda" and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.stacks", "python -m benchmarks.stacks --device cpu --quick")
    smoke = device_check.is_smoke(device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    inners = [i for i in args.inners.split(",") if i]
    if device != "cuda" and "cudagraphs" in inners:
        print("benchmarks.stacks: cudagraphs needs CUDA; skipped on the CPU")
        inners.remove("cudagraphs")
    raise_recompile_limits()
    result = {"environment": environment(), "device": device, "dtype": str(dtype), "quick": args.quick,
              "records": []}
    device_check.announce(device, result)
    for name in [m for m in args.models.split(",") if m]:
        for inner in inners:
            print(f"{name} / {inner} ...", flush=True)
            try:
                rec = run(name, inner, args.quick, device, dtype, args.repeats, args.seconds_per_repeat,
                          args.max_calls)
            except Exception as e:
                traceback.print_exc()
                rec = {"model": name, "inner": inner, "errors": {"build": f"{type(e).__name__}: {e}"}}
            result["records"].append(rec)
            write_json(args.out, result, quiet=True)
    rows = []
    for r in result["records"]:
        ms, sp, p = r.get("ms", {}), r.get("speedup", {}), r.get("pass", {})
        timed = [] if smoke else [ms.get("plain", {}).get("median"), ms.get("pass", {}).get("median"),
                                  sp.get("median"), f"{sp.get('min', 0):.3f}-{sp.get('max', 0):.3f}" if sp else ""]
        rows.append([r["model"], r["inner"], *timed, p.get("sites"), p.get("kernels"),
                     r.get("err", {}).get("pass", {}).get("rel"),
                     "; ".join(f"{k}: {v}" for k, v in r.get("errors", {}).items())[:80]])
    print_table(f"rope_fusion.backend(inner) against inner alone ({device}, {dtype}, {args.repeats} repeats)", rows,
                ["model", "inner", *([] if smoke else ["plain ms", "pass ms", "speedup", "range"]), "sites",
                 "kernels", "rel err", "errors"])
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
