"""Kernel-level benchmark: every RoPE spelling, q and k, against the copy floor.

One run times, per shape and spelling: eager, plain torch.compile (twice, for the run-to-run spread),
torch.compile + RopeFusionPass(backend="triton"), + RopeFusionPass(backend="inductor"), the Triton op called
directly with the arguments the pass would emit, Liger (NeoX only, if installed) and the copy floor (a clone
of q and k: the same bytes read and written). It prints ms and multiples of the floor, the max error of each
variant against eager, the kernel launches of the decode shape, and which backend is faster per spelling
(the data behind the `auto` rule), and writes everything as JSON to --out.

    python -m benchmarks.kernels --out $OUT/kernels.json      # H200 shapes (GPU)
    python -m benchmarks.kernels --quick                      # tiny shapes on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.spellings import SPELLINGS, Spelling, fused_call  # noqa: E402

# name: (B, S, q heads, k heads, D)
SHAPES = {
    "2x16384x16x80": (2, 16384, 16, 16, 80),
    "1x32760x40x128": (1, 32760, 40, 40, 128),
    "decode64x32x128": (64, 1, 32, 32, 128),
    "gqa8192x32/8x128": (1, 8192, 32, 8, 128),
}
QUICK_SHAPES = {
    "1x64x4x80": (1, 64, 4, 4, 80),
    "decode4x4x64": (4, 1, 4, 4, 64),
    "gqa2x16x4/2x64": (2, 16, 4, 2, 64),
}
DECODE = ("decode64x32x128", "decode4x4x64")
VARIANTS = ("eager", "compile", "compile#2", "pass-triton", "pass-inductor", "triton-op", "liger", "floor")

# ---------------------------------------------------------------------------------------------------------
# measurement helpers (models.py uses them too)


def bench_ms(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds per call: triton's do_bench on a GPU (L2 flushed between calls), wall clock else."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def count_launches(fn: Callable[[], Any], device: str) -> int | None:
    """GPU kernels launched by one call (memcpy/memset excluded), from the profiler; None off the GPU."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kinds = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for e in kinds if "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def max_err(got: Any, want: Any) -> float:
    """Largest absolute difference over matching tensors of two (nested) outputs."""
    if isinstance(got, torch.Tensor):
        return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    if hasattr(got, "to_tuple"):
        got, want = got.to_tuple(), want.to_tuple()
    if isinstance(got, (tuple, list)):
        return max((max_err(g, w) for g, w in zip(got, want) if g is not None), default=0.0)
    if hasattr(got, "sample"):
        return max_err(got.sample, want.sample)
    return float("nan")


def print_table(title: str, rows: list[list[Any]], header: list[str]) -> None:
    cells = [[_fmt(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(c: Any) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1e-2 and c else f"{c:.3f}"
    return str(c)


def write_json(path: str | None, data: dict, quiet: bool = False) -> None:
    if not path:
        return
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    if not quiet:
        print(f"\nwrote {path}")


def environment() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def compiled(fn: Callable, backend: str | None) -> tuple[Callable, Any]:
    """torch.compile(fn), static shapes, with the fusion pass for `backend` (None: plain compile)."""
    if backend is None:
        return torch.compile(fn, dynamic=False), None
    import rope_fusion

    p = rope_fusion.RopeFusionPass(backend=backend)
    return torch.compile(fn, dynamic=False, options={"post_grad_custom_post_pass": p}), p


def _liger(spelling: Spelling) -> Callable | None:
    if not spelling.neox_full_tables:
        return None
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None

    def run(q, k, cos, sin):  # Liger wants [B,H,S,D] and [1,S,D] tables
        qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos[:, :, 0], sin[:, :, 0])
        return qo.transpose(1, 2), ko.transpose(1, 2)

    return run


def _variant_fn(variant: str, spelling: Spelling, device: str) -> tuple[Callable | None, Any]:
    if variant == "eager":
        return spelling.apply, None
    if variant in ("compile", "compile#2"):
        return compiled(spelling.apply, None)
    if variant == "pass-triton":
        return compiled(spelling.apply, "triton") if device == "cuda" else (None, None)
    if variant == "pass-inductor":
        return compiled(spelling.apply, "inductor")
    if variant == "triton-op":
        if device != "cuda":
            return None, None
        import rope_fusion.kernels.triton_rotary  # noqa: F401

        op = torch.ops.rope_fusion.rotary_qk_triton
        return (lambda q, k, *t: fused_call(spelling, q, k, t, op)), None
    if variant == "liger":
        return _liger(spelling) if device == "cuda" else None, None
    if variant == "floor":
        return (lambda q, k, *t: (q.clone(), k.clone())), None
    raise ValueError(variant)


def run_case(shape_name: str, shape: tuple, spelling: Spelling, device: str, variants: list[str],
             dtype: torch.dtype) -> dict:
    B, S, HQ, HK, D = shape
    torch.manual_seed(0)
    q = torch.randn(B, S, HQ, D, device=device, dtype=dtype)
    k = torch.randn(B, S, HK, D, device=device, dtype=dtype)
    tables = spelling.make_tables(B, S, D, torch.device(device))
    want = spelling.apply(q, k, *tables)
    rec: dict = {"shape": shape_name, "dims": shape, "spelling": spelling.code, "name": spelling.name,
                 "ms": {}, "err": {}, "fused_kernels": {}, "launches": {}, "errors": {}}
    fns: dict = {}
    for v in variants:
        if v == "compile#2":  # the same compiled function timed again: run-to-run spread
            if "compile" in fns:
                rec["ms"][v] = bench_ms(fns["compile"], device)
            continue
        try:
            fn, p = _variant_fn(v, spelling, device)
            if fn is None:
                continue
            call = (lambda fn=fn: fn(q, k, *tables))
            t0 = time.perf_counter()
            got = call()
            first = time.perf_counter() - t0
            if v != "floor":
                rec["err"][v] = max_err(got, want)
            rec["ms"][v] = bench_ms(call, device)
            if p is not None:
                rec["fused_kernels"][v] = len(p.report.kernels)
            if v != "eager" and v != "floor":
                rec.setdefault("first_call_s", {})[v] = round(first, 2)
            if shape_name in DECODE:
                rec["launches"][v] = count_launches(call, device)
            fns[v] = call
        except Exception as e:  # a variant that fails is reported, never fatal
            rec["errors"][v] = f"{type(e).__name__}: {e}"
            traceback.print_exc(limit=3)
    floor = rec["ms"].get("floor")
    rec["x_floor"] = {v: (ms / floor if floor else None) for v, ms in rec["ms"].items()}
    c = [rec["ms"][v] for v in ("compile", "compile#2") if v in rec["ms"]]
    rec["compile_spread"] = (max(c) / min(c) - 1) if len(c) == 2 else None
    return rec


def auto_rule(records: list[dict]) -> dict:
    """Per spelling: which fused backend was faster on each shape (the GPU side of `auto`)."""
    rule: dict = {}
    for r in records:
        t, i = r["ms"].get("pass-triton"), r["ms"].get("pass-inductor")
        if t is None or i is None:
            t, i = r["ms"].get("triton-op"), r["ms"].get("pass-inductor")
        if t is None or i is None:
            continue
        rule.setdefault(r["spelling"], {})[r["shape"]] = "triton" if t <= i else "inductor"
    return rule


# (shape, spelling, choices per option): the tile choices measured by --sweep. Besides the table's shapes, the
# head counts of the benchmarked models: Wan 1.3B (12 heads) and Qwen-Image (24 heads, 4096 image tokens).
SWEEP_SHAPES = {**SHAPES, "1x32760x12x128": (1, 32760, 12, 12, 128), "1x4096x24x128": (1, 4096, 24, 24, 128)}
_TILES = {"block_h": (None, 4, 8, 16, 32), "num_warps": (None, 1, 2, 4)}
_NEOX = {"block_h": (None, 16), "num_warps": (None, 1, 2, 4), "neox_row": (False, True)}
SWEEP_CASES = [
    ("2x16384x16x80", "N1", _NEOX),
    ("2x16384x16x80", "N3", _NEOX),
    ("1x32760x40x128", "N1", _NEOX),
    ("1x32760x40x128", "N3", _NEOX),
    ("1x32760x12x128", "N1", _NEOX),
    ("2x16384x16x80", "I3", _TILES),
    ("1x32760x40x128", "I1", _TILES),
    ("1x32760x40x128", "N1", _TILES),
    ("1x32760x12x128", "I1", _TILES),
    ("1x32760x12x128", "N1", _TILES),
    ("1x4096x24x128", "C2", _TILES),
]


def sweep(device: str, cases: list = SWEEP_CASES) -> list[dict]:
    """Triton tile choices (heads per step, warps, NeoX form) of the kernel alone, on the tables the pass
    feeds it, timed through a CUDA graph so that host-side cost does not hide the kernel's own time."""
    import itertools

    import triton.testing

    from rope_fusion.kernels import triton_rotary as tr
    from rope_fusion.ops.schema import RotaryParams

    out = []
    for sname, code, choices in cases:
        B, S, HQ, HK, D = SWEEP_SHAPES[sname]
        q = torch.randn(B, S, HQ, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(B, S, HK, D, device=device, dtype=torch.bfloat16)
        floor = triton.testing.do_bench_cudagraph(lambda q=q, k=k: (q.clone(), k.clone()), rep=50)
        sp = SPELLINGS[code]
        cos, sin, kw = sp.fused(*sp.make_tables(B, S, D, torch.device(device)))
        rd = cos.shape[-1] * (1 if kw["full_tables"] else 2)
        names = list(choices)
        res = []
        for values in itertools.product(*(choices[n] for n in names)):
            opt = dict(zip(names, values))

            params = RotaryParams(rotary_dim=rd, conjugate=False, out_dtype=q.dtype, **kw)

            def call(opt=opt, q=q, k=k, cos=cos, sin=sin, params=params):
                return tr.launch([q, k], cos, sin, params, **opt)
            try:
                call()
                ms = triton.testing.do_bench_cudagraph(call, rep=50)
            except Exception as e:  # a tile too large for the registers, say
                print(f"  sweep {sname} {code} {opt}: {type(e).__name__}")
                continue
            res.append({"shape": sname, "spelling": code, **opt, "ms": ms, "x_floor": ms / floor})
        out += res
        best = sorted(res, key=lambda o: o["x_floor"])[:4]
        form = tr.default_neox_row(kw["interleaved"], rd, D)
        default = [o for o in res if all(o.get(n) is None for n in ("block_h", "num_warps"))
                   and o.get("neox_row") in (None, form)]
        print(f"sweep {sname} {code}: default " + ", ".join(f"{o['x_floor']:.3f}x" for o in default) + "; best "
              + ", ".join(" ".join(f"{n}={o[n]}" for n in names) + f" {o['x_floor']:.3f}x" for o in best), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--shapes", nargs="*", help="subset of shape names")
    ap.add_argument("--spellings", nargs="*", help="subset of catalogue codes (I1 I2 I3 N1 N3 C2 C1)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), help=f"subset of {VARIANTS}")
    ap.add_argument("--sweep", action="store_true", help="also sweep Triton tile choices (GPU)")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (GPU)")
    ap.add_argument("--sweep-cases", nargs="*", help="subset of the sweep, as shape:spelling")
    args = ap.parse_args(argv)

    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    shapes = QUICK_SHAPES if device == "cpu" else SHAPES
    if args.shapes:
        shapes = {n: s for n, s in shapes.items() if n in args.shapes}
    spellings = [SPELLINGS[c] for c in (args.spellings or SPELLINGS)]
    variants = [v for v in VARIANTS if v in args.variants]
    dtype = torch.bfloat16
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    print("environment:", json.dumps(environment()), "device:", device, flush=True)

    t_start = time.perf_counter()
    result: dict = {"environment": environment(), "device": device, "dtype": str(dtype), "records": []}
    if (args.sweep or args.sweep_only) and device == "cuda":
        cases = [c for c in SWEEP_CASES if not args.sweep_cases or f"{c[0]}:{c[1]}" in args.sweep_cases]
        result["sweep"] = sweep(device, cases)
        write_json(args.out, result)
        if args.sweep_only:
            return 0
    records = result["records"]
    for sname, shape in shapes.items():
        for sp in spellings:
            r = run_case(sname, shape, sp, device, variants, dtype)
            records.append(r)
            write_json(args.out, result, quiet=True)  # partial results survive a time limit
            print(f"[{time.perf_counter() - t_start:6.1f}s] {sname} {sp.code}: " + ", ".join(
                f"{v} {r['x_floor'].get(v) or 0:.2f}x" for v in r["ms"]), flush=True)

    cols = [v for v in variants if any(v in r["ms"] for r in records)]
    header = ["shape", "spelling"] + cols
    print_table("ms per call (median), q and k, bf16", [[r["shape"], f"{r['spelling']} {r['name']}"]
                + [r["ms"].get(v) for v in cols] for r in records], header)
    print_table("x copy floor", [[r["shape"], r["spelling"]] + [r["x_floor"].get(v) for v in cols]
                                  for r in records], header)
    print_table("max abs error against eager", [[r["shape"], r["spelling"]] + [r["err"].get(v) for v in cols]
                                                for r in records], header)
    fcols = [v for v in ("pass-triton", "pass-inductor") if v in cols]
    print_table("fused kernels emitted by the pass", [[r["shape"], r["spelling"]]
                + [r["fused_kernels"].get(v) for v in fcols] for r in records], ["shape", "spelling"] + fcols)
    dec = [r for r in records if any(n is not None for n in r["launches"].values())]
    if dec:
        print_table("kernel launches per call, decode shape", [[r["shape"], r["spelling"]]
                    + [r["launches"].get(v) for v in cols] for r in dec], header)
    spreads = [r["compile_spread"] for r in records if r["compile_spread"] is not None]
    if spreads:
        print(f"\nplain torch.compile timed twice: run-to-run spread median {statistics.median(spreads):.1%}, "
              f"max {max(spreads):.1%}")
    rule = auto_rule(records)
    print("\nfaster fused backend per spelling and shape (auto rule data):")
    for code, per in rule.items():
        print(f"  {code}: {per}")
    errors = {f"{r['shape']} {r['spelling']} {v}": e for r in records for v, e in r["errors"].items()}
    for key, e in errors.items():
        print(f"  ERROR {key}: {e[:200]}")
    result.update(auto_rule=rule, seconds=time.perf_counter() - t_start)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
