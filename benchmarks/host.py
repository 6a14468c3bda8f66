"""Host time of one compiled call: the CPU side of launching a RoPE site's kernels, plain torch.compile against
the pass, where do_bench and model forwards without CUDA graphs see it (a host-bound call hides nothing).

Per variant: microseconds of CPU time per call (many calls back to back, no synchronisation inside the loop,
so the GPU never stalls the host), the GPU time of the same call, and a cProfile of the pass variant's calls
(which Python functions the time goes to: guards, the AOT wrapper, Inductor's launchers).

    python -m benchmarks.host --out $OUT/host.json       # GPU
    python -m benchmarks.host --quick                    # CPU smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import rope_fusion  # noqa: E402
from benchmarks import spellings as sp  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 64])
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    heads, kv, d = (4, 2, 32) if args.quick else (32, 8, 128)
    fn = sp.vllm_rope(d, d, True)
    cache = sp.vllm_cos_sin_cache(4096, d, 500000.0, device)
    results = []
    variants = {"compile": None, "pass-triton": "triton", "pass-inductor": "inductor"}
    for t in args.tokens:
        pos = torch.randint(0, 4096, (t,), device=device)
        q = torch.randn(t, heads * d, device=device, dtype=torch.bfloat16)
        k = torch.randn(t, kv * d, device=device, dtype=torch.bfloat16)
        for name, backend in variants.items():
            if backend == "triton" and device != "cuda":
                continue
            torch._dynamo.reset()
            opts = {} if backend is None else {
                "post_grad_custom_post_pass": rope_fusion.RopeFusionPass(backend=backend)}
            compiled = torch.compile(fn, options=opts)
            call_args = (pos, q, k, cache)
            host, wall = host_us(compiled, call_args, 200 if device == "cuda" else 20, device)
            rec = {"T": t, "variant": name, "host_us": round(host, 1), "wall_us": round(wall, 1)}
            if name.startswith("pass"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    compiled(*call_args)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
                rec["profile"] = s.getvalue()[-4000:]
            results.append(rec)
            print(f"T={t} {name}: host {host:.1f} us/call, wall {wall:.1f} us/call", flush=True)
    for r in results:
        if "profile" in r:
            print(f"--- T={r['T']} {r['variant']}: cProfile of 50 calls, by own time\n{r['profile']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
