"""Where the time of one compiled call goes: GPU kernels per call, with and without the fusion pass.

A benchmark ratio says that a compiled model or spelling is slower or faster; this says why. For each
target it compiles plain and with RopeFusionPass, profiles a few calls, and prints the kernels sorted by GPU
time per call (name, launches per call, microseconds per call) and the total, side by side, with the pass's
report (sites, kernels, norms folded, misses). Targets: models of benchmarks.models (`--model all` for every
default one), catalogue spellings at a kernel-benchmark shape, and rows of the kernel benchmark (`--row`).
With --code-dir it also writes Inductor's generated code of each variant there (what the user-kernel node,
the fallbacks and the copies around the fused op look like). A target that fails is reported and the
others still run; --out keeps the results as JSON.

    python -m benchmarks.profile --model qwen-image --code-dir $OUT/code
    python -m benchmarks.profile --model all --out $OUT/profile.json
    python -m benchmarks.profile --spelling C2 --shape gqa8192x32/8x128
    python -m benchmarks.profile --row rms+flux-il --backend triton --code-dir $OUT/code   # a kernel row
    python -m benchmarks.profile --quick --model flux --spelling N1     # the CPU smoke test: CPU ops, tiny configs

Without a GPU it stops with one line unless --quick asks for the CPU smoke test, whose CPU op times check the
plumbing, not speed (benchmarks/device_check.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# As a script, benchmarks/ would come first on sys.path and this file shadow the standard library's profile.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import device_check  # noqa: E402
from benchmarks.kernels import (  # noqa: E402
    QUICK_SHAPES,
    SHAPES,
    bench_ms,
    environment,
    kernel_times,
    pass_summary,
    print_table,
    raise_recompile_limits,
    short_summary,
    write_json,
)
from benchmarks.spellings import SPELLINGS  # noqa: E402

CALLS = 5


def compile_with(fn: Callable, with_pass: bool, backend: str) -> tuple[Callable, Any]:
    import rope_fusion

    p = rope_fusion.RopeFusionPass(backend=backend) if with_pass else None
    opts = {"post_grad_custom_post_pass": p} if p is not None else {}
    return torch.compile(fn, options=opts), p


def first_call(cfn: Callable, args: tuple, kwargs: dict, code_path: str | None) -> Any:
    """Run the first (compiling) call; keep Inductor's generated code if asked."""
    if code_path is None:
        return cfn(*args, **kwargs)
    from torch._inductor.utils import run_and_get_code

    out, codes = run_and_get_code(cfn, *args, **kwargs)
    os.makedirs(os.path.dirname(code_path), exist_ok=True)
    with open(code_path, "w") as f:
        f.write("\n\n# ======== next graph ========\n\n".join(codes))
    return out


def profile_target(name: str, fn: Callable, args: tuple, kwargs: dict, backend: str, code_dir: str | None,
                   top: int, device: str = "cuda") -> dict:
    result: dict = {}
    for variant in ("compile", "compile+pass"):
        torch._dynamo.reset()
        cfn, p = compile_with(fn, variant != "compile", backend)
        code = os.path.join(code_dir, f"{name.replace('/', '_')}.{variant}.py") if code_dir else None
        with torch.no_grad():
            t0 = time.perf_counter()
            first_call(cfn, args, kwargs, code)
            first = time.perf_counter() - t0
            ms = bench_ms(lambda cfn=cfn: cfn(*args, **kwargs), device)
            times = kernel_times(lambda cfn=cfn: cfn(*args, **kwargs), CALLS, device)
        result[variant] = {"ms": ms, "first_call_s": round(first, 1), "kernels": times,
                           "pass": pass_summary(p) if p is not None else None}
    names = sorted(set(result["compile"]["kernels"]) | set(result["compile+pass"]["kernels"]),
                   key=lambda n: -max(result[v]["kernels"].get(n, (0, 0.0))[1] for v in result))
    rows = []
    for n in names[:top]:
        row = [n[:70]]
        for v in ("compile", "compile+pass"):
            c, us = result[v]["kernels"].get(n, (0, 0.0))
            row += [c, us]
        rows.append(row)
    rows.append(["(all)"] + [x for v in ("compile", "compile+pass") for x in
                             (sum(c for c, _ in result[v]["kernels"].values()),
                              sum(us for _, us in result[v]["kernels"].values()))])
    what = "GPU kernels" if device == "cuda" else "CPU ops (self time)"
    print_table(f"{name}: {what} per call (compile: {result['compile']['ms']:.4f} ms, compile+pass: "
                f"{result['compile+pass']['ms']:.4f} ms; pass: {short_summary(result['compile+pass']['pass'])})",
                rows, ["kernel", "launches", "us", "launches+pass", "us+pass"])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="*", default=[], help="models of benchmarks.models (comma- or space-"
                                                           "separated), or 'all'")
    ap.add_argument("--spelling", nargs="*", default=[], help="catalogue codes of benchmarks.spellings")
    ap.add_argument("--shape", default=None, help=f"for --spelling: one of {list(SHAPES)} (default "
                                                  "1x32760x40x128; --quick: a tiny one)")
    ap.add_argument("--row", nargs="*", default=[], help="rows of the kernel benchmark's norm, flux and vllm "
                                                        "groups whose name, shape or form contains one of these")
    ap.add_argument("--backend", default="auto", help="RopeFusionPass backend")
    ap.add_argument("--code-dir", help="write Inductor's generated code of every variant here")
    ap.add_argument("--top", type=int, default=20, help="kernels listed per target")
    ap.add_argument("--quick", action="store_true", help="tiny configs on the CPU, CPU ops (smoke test)")
    ap.add_argument("--out", help="write the results as JSON here (rewritten after every target)")
    args = ap.parse_args(argv)
    device = "cpu" if args.quick else "cuda"
    if device == "cuda" and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.profile", "python -m benchmarks.profile --quick --model flux "
                                   "--spelling N1")
    from benchmarks.models import DEFAULT_MODELS, MODELS, build

    models = [x for v in args.model for x in v.split(",") if x]
    models = DEFAULT_MODELS if models == ["all"] else models
    unknown = [n for n in models if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}, of {list(MODELS)}")
    raise_recompile_limits()
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass (and its report)
    print("environment:", environment(), flush=True)
    dtype = torch.bfloat16
    shapes = QUICK_SHAPES if args.quick else SHAPES
    shape = args.shape or (next(iter(QUICK_SHAPES)) if args.quick else "1x32760x40x128")
    result: dict = {"environment": environment(), "device": device, "targets": {}, "errors": {}}
    device_check.announce(device, result)

    def run(name: str, make: Callable[[], tuple]) -> None:
        try:
            fn, a, kw = make()
            result["targets"][name] = profile_target(name, fn, a, kw, args.backend, args.code_dir, args.top, device)
        except Exception as e:  # reported, the other targets still run
            traceback.print_exc(limit=4)
            result["errors"][name] = f"{type(e).__name__}: {e}"[:600]
            print(f"{name}: ERROR {result['errors'][name]}", flush=True)
        write_json(args.out, result, quiet=True)

    for code in [x for v in args.spelling for x in v.split(",") if x]:
        def make(code=code):
            sp = SPELLINGS[code]
            B, S, HQ, HK, D = shapes[shape]
            q = torch.randn(B, S, HQ, D, device=device, dtype=dtype)
            k = torch.randn(B, S, HK, D, device=device, dtype=dtype)
            return sp.apply, (q, k, *sp.make_tables(B, S, D, torch.device(device))), {}
        run(f"{code}@{shape}", make)
    from benchmarks.kernels import ROW_GROUPS

    wanted = [x for v in args.row for x in v.split(",") if x]
    for group in ("norm", "flux", "vllm") if wanted else ():
        for row in ROW_GROUPS[group](args.quick):
            if any(w in f"{row.name} {row.shape} {row.form}" for w in wanted):
                def make(row=row):
                    return row.fn, row.make(device), {}
                run(f"{row.name}@{row.shape}", make)
    for name in models:
        def make(name=name):
            m, inputs = build(name, args.quick, device, dtype)
            return m, (), inputs
        run(name, make)
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, e in result["errors"].items():
        print(f"  ERROR {name}: {e[:300]}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
