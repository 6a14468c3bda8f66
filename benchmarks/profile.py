"""Where the time of one compiled call goes: GPU kernels per call, with and without the fusion pass.

A benchmark ratio says that a compiled model or spelling is slower or faster; this says why. For each
target it compiles plain and with RopeFusionPass, profiles a few calls, and prints the kernels sorted by GPU
time per call (name, launches per call, microseconds per call) and the total, side by side. With --code-dir
it also writes Inductor's generated code of each variant there (what the user-kernel node, the fallbacks
and the copies around the fused op look like).

    python -m benchmarks.profile --model qwen-image --code-dir $OUT/code
    python -m benchmarks.profile --spelling C2 --shape gqa8192x32/8x128
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.kernels import SHAPES, bench_ms, environment, print_table  # noqa: E402
from benchmarks.spellings import SPELLINGS  # noqa: E402

CALLS = 5


def kernel_times(call: Callable[[], Any]) -> dict[str, tuple[float, float]]:
    """{kernel name: (launches per call, us per call)} over CALLS profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    acc: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = acc[e.name]
            a[0] += 1
            a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: (v[0] / CALLS, v[1] / CALLS) for k, v in acc.items()}


def compile_with(fn: Callable, with_pass: bool, backend: str) -> tuple[Callable, Any]:
    import rope_fusion

    p = rope_fusion.RopeFusionPass(backend=backend) if with_pass else None
    opts = {"post_grad_custom_post_pass": p, "fx_graph_cache": False} if p is not None else {}
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
                   top: int) -> dict:
    result: dict = {}
    for variant in ("compile", "compile+pass"):
        torch._dynamo.reset()
        cfn, p = compile_with(fn, variant != "compile", backend)
        code = os.path.join(code_dir, f"{name.replace('/', '_')}.{variant}.py") if code_dir else None
        with torch.no_grad():
            first_call(cfn, args, kwargs, code)
            ms = bench_ms(lambda cfn=cfn: cfn(*args, **kwargs), "cuda")
            times = kernel_times(lambda cfn=cfn: cfn(*args, **kwargs))
        result[variant] = {"ms": ms, "kernels": times,
                           "fused": (len(p.report.sites), len(p.report.kernels), len(p.report.host_tables))
                           if p is not None else None}
    names = sorted(set(result["compile"]["kernels"]) | set(result["compile+pass"]["kernels"]),
                   key=lambda n: -max(result[v]["kernels"].get(n, (0, 0.0))[1] for v in result))
    rows = []
    for n in names[:top]:
        row = [n[:70]]
        for v in ("compile", "compile+pass"):
            c, us = result[v]["kernels"].get(n, (0, 0.0))
            row += [c, us]
        rows.append(row)
    rows.append(["(all kernels)"] + [x for v in ("compile", "compile+pass") for x in
                                      (sum(c for c, _ in result[v]["kernels"].values()),
                                       sum(us for _, us in result[v]["kernels"].values()))])
    print_table(f"{name}: GPU kernels per call (compile: {result['compile']['ms']:.4f} ms, "
                f"compile+pass: {result['compile+pass']['ms']:.4f} ms, fused sites/kernels/host tables "
                f"{result['compile+pass']['fused']})", rows,
                ["kernel", "launches", "us", "launches+pass", "us+pass"])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="*", default=[], help="models of benchmarks.models")
    ap.add_argument("--spelling", nargs="*", default=[], help="catalogue codes of benchmarks.spellings")
    ap.add_argument("--shape", default="1x32760x40x128", help=f"for --spelling: one of {list(SHAPES)}")
    ap.add_argument("--backend", default="auto", help="RopeFusionPass backend")
    ap.add_argument("--code-dir", help="write Inductor's generated code of every variant here")
    ap.add_argument("--top", type=int, default=20, help="kernels listed per target")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.profile needs a CUDA GPU")
        return 1
    print("environment:", environment(), flush=True)
    dtype = torch.bfloat16
    for code in args.spelling:
        sp = SPELLINGS[code]
        B, S, HQ, HK, D = SHAPES[args.shape]
        q = torch.randn(B, S, HQ, D, device="cuda", dtype=dtype)
        k = torch.randn(B, S, HK, D, device="cuda", dtype=dtype)
        tabs = sp.make_tables(B, S, D, torch.device("cuda"))
        profile_target(f"{code}@{args.shape}", sp.apply, (q, k, *tabs), {}, args.backend, args.code_dir,
                       args.top)
    from benchmarks.models import MODELS, _to

    for name in args.model:
        m, inputs = MODELS[name](False, "cuda", dtype)
        m = m.to("cuda", dtype).eval()
        inputs = {k: _to(v, "cuda", dtype) for k, v in inputs.items()}
        profile_target(name, m, (), inputs, args.backend, args.code_dir, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
