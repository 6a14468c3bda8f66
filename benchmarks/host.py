"""Host time of one compiled call: the CPU side of launching a RoPE site's kernels, plain torch.compile against
the pass, where do_bench and model forwards without CUDA graphs see it (a host-bound call hides nothing).

Per variant: microseconds of CPU time per call (many calls back to back, no synchronisation inside the loop,
so the GPU never stalls the host), the GPU time of the same call, and a cProfile of the pass variant's calls
(which Python functions the time goes to: guards, the AOT wrapper, Inductor's launchers). Each variant is
compiled once per token count, on a code object of its own (so no call walks another variant's cache entry);
the repeats then time the variants in turn (reversed on odd repeats), so the pass's difference from plain
compile comes with the spread of that difference over the repeats.

    python -m benchmarks.host --out $OUT/host.json                      # GPU
    python -m benchmarks.host --tokens 1 8 64 256 8192 --repeats 5      # decode and prefill, 5 repeats
    python -m benchmarks.host --quick                                   # CPU smoke test

Without a GPU it stops with one line unless --quick asks for the CPU smoke test, which checks the plumbing and
prints no times (benchmarks/device_check.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import rope_fusion  # noqa: E402
from benchmarks import device_check  # noqa: E402
from benchmarks import spellings as sp  # noqa: E402
from benchmarks.kernels import own_code, raise_recompile_limits  # noqa: E402


def host_us(fn, args, calls: int, device: str) -> tuple[float, float]:
    """(host us per call, wall us per call including the GPU's catch-up)."""
    for _ in range(5):
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    host = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return 1e6 * host / calls, 1e6 * wall / calls


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200, help="calls per repeat (GPU; the CPU smoke test takes 20)")
    args = ap.parse_args()
    if not args.quick and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.host", "python -m benchmarks.host --quick")
    device = "cpu" if args.quick else "cuda"
    device_check.announce(device)
    smoke = device_check.is_smoke(device)
    heads, kv, d = (4, 2, 32) if args.quick else (32, 8, 128)
    calls = args.calls if device == "cuda" else 20
    raise_recompile_limits()
    cache = sp.vllm_cos_sin_cache(4096, d, 500000.0, device)
    results = []
    # "pass" is `auto` as plain compile runs it (no CUDA graphs): the cost model weighs launches as host time
    variants = {"compile": None, "pass": "auto", "pass-triton": "triton", "pass-inductor": "inductor"}
    if device != "cuda":
        del variants["pass-triton"]
    for t in args.tokens:
        pos = torch.randint(0, 4096, (t,), device=device)
        q = torch.randn(t, heads * d, device=device, dtype=torch.bfloat16)
        k = torch.randn(t, kv * d, device=device, dtype=torch.bfloat16)
        call_args = (pos, q, k, cache)
        torch._dynamo.reset()
        compiled = {}
        for name, backend in variants.items():
            fn = own_code(sp.vllm_rope(d, d, True))  # a code object per variant: one cache entry each
            p = rope_fusion.RopeFusionPass(backend=backend) if backend is not None else None
            compiled[name] = torch.compile(fn, options={} if p is None else {"post_grad_custom_post_pass": p})
            with torch._inductor.config.patch(fx_graph_cache=False):  # the pass runs, so its report says what
                compiled[name](*call_args)
            if p is not None:
                chosen = [k.backend for k in p.report.kernels] or ["left to Inductor"]
                print(f"T={t} {name}: {', '.join(chosen)}", flush=True)
        series: dict[str, list] = {name: [] for name in compiled}
        walls: dict[str, list] = {name: [] for name in compiled}
        for r in range(args.repeats):
            for name in (list(compiled) if r % 2 == 0 else list(compiled)[::-1]):
                host, wall = host_us(compiled[name], call_args, calls, device)
                series[name].append(host)
                walls[name].append(wall)
        base = series["compile"]
        for name in compiled:
            rec = {"T": t, "variant": name, "host_us": _spread(series[name]), "wall_us": _spread(walls[name]),
                   "repeats": args.repeats, "calls": calls}
            if name != "compile":
                rec["host_minus_compile_us"] = _spread([a - b for a, b in zip(series[name], base)])
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    compiled[name](*call_args)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
                rec["profile"] = s.getvalue()[-4000:]
            results.append(rec)
            extra = "" if name == "compile" else \
                f"; minus compile {rec['host_minus_compile_us']['median']:+.1f} " \
                f"[{rec['host_minus_compile_us']['min']:+.1f}, {rec['host_minus_compile_us']['max']:+.1f}]"
            print(f"T={t} {name}: ran" if smoke else
                  f"T={t} {name}: host {rec['host_us']['median']:.1f} us/call "
                  f"[{rec['host_us']['min']:.1f}, {rec['host_us']['max']:.1f}], wall {rec['wall_us']['median']:.1f}"
                  f"{extra}", flush=True)
    for r in results:
        if "profile" in r and not smoke:
            print(f"--- T={r['T']} {r['variant']}: cProfile of 50 calls, by own time\n{r['profile']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
