"""vllm-omni's rotary layer on the GPU: flash-attn's kernel launched for q and for k, against rope_fusion's fused op.

vllm-omni's shared RotaryEmbedding layer rotates q and k of every attention by two calls of flash-attn's Triton
`rotary_kernel` (vLLM's copy, `vllm.vllm_flash_attn.ops.triton.rotary.apply_rotary`; interleaved, half tables
cos/sin [S, D/2]; examples/vllm_omni_block.py is the block). This times the rotation alone, q and k, in bf16:

- kernel: `torch.compile` of the two calls without the pass (two flash-attn launches);
- fused:  the same with RopeFusionPass (one `rope_fusion.rotary_qk`; `--backends`, default `auto`);
- floor:  a clone of q and of k (the bytes the rotation must read and write);

each by `triton.testing.do_bench` (median) and by replaying a CUDA graph (`do_bench_cudagraph`, median), as
multiples of the floor, with the GPU kernels one call launches (torch.profiler) and the largest difference between
the kernel's and the fused outputs (and of each against an fp32 evaluation of the same rotation). Shapes: the
Qwen2.5-VL ViT (32768 tokens, 16 heads, D=80), Wan2.1 14B (32760 tokens, 40 heads, D=128), Flux (4608 tokens, 24
heads, D=128) and Llama-3-8B prefill (8192 tokens, 32 q / 8 k heads, D=128), batch 1. Prints a Markdown table and
writes JSON to --out.

    python -m benchmarks.vllm_omni --rotary-file PATH/vllm/vllm_flash_attn/ops/triton/rotary.py --out $OUT/omni.json
    python -m benchmarks.vllm_omni --device cpu --quick       # CPU smoke test: tiny shapes
    python -m benchmarks.vllm_omni --rotary-file PATH --merge-all  # the merged launch also where the pass keeps
                                                                   # flash-attn's (flash_attn_sites.KEPT_LAUNCHES)

Without vLLM (or with a vLLM whose `vllm.vllm_flash_attn` package cannot load) the kernel file is loaded from
`--rotary-file` under its real module name `vllm.vllm_flash_attn.ops.triton.rotary`, which is what the pass
identifies (examples/vllm_omni_block.py `load_rotary`). On the CPU the compile uses the tests' tracing recipe
(`cpu_triton_tracing`), "kernel" is the two calls run eagerly with the kernel in Triton's interpreter (Inductor's CPU
code generation cannot compile a Triton kernel), and CUDA graphs and launch counts are absent: a smoke run, which
checks the plumbing and prints no times or ratios (benchmarks/device_check.py). Without a GPU and without
`--device cpu` it stops with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# Run as a script (python benchmarks/vllm_omni.py) this directory comes first on sys.path, and its profile.py would
# shadow the standard library's `profile` (which cProfile, and so torch._dynamo, import): the root takes its place.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import rope_fusion  # noqa: E402
from benchmarks import device_check  # noqa: E402
from benchmarks.kernels import bench_ms, count_launches, environment, num, write_json  # noqa: E402
from examples.vllm_omni_block import KERNELS, cpu_triton_tracing, interpreted, load_rotary, rope_tables  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402

# name: (batch, tokens, q heads, k heads, head_dim)
SHAPES = {
    "qwen2.5-vl-vit": (1, 32768, 16, 16, 80),
    "wan2.1-14b": (1, 32760, 40, 40, 128),
    "flux": (1, 4608, 24, 24, 128),
    "llama3-8b-prefill": (1, 8192, 32, 8, 128),
}
QUICK_SHAPES = {
    "vit-tiny": (1, 16, 2, 2, 80),
    "gqa-tiny": (1, 12, 4, 2, 64),
}
STYLES = ("interleaved", "neox")
BACKENDS = ("auto", "triton", "inductor")


def rotation(rotary, interleaved: bool) -> Callable:
    """The layer's two calls: q, then k, each one launch of flash-attn's rotary_kernel."""
    def rotate(q, k, cos, sin):
        return (rotary.apply_rotary(q, cos, sin, interleaved=interleaved),
                rotary.apply_rotary(k, cos, sin, interleaved=interleaved))
    return rotate


def inputs(shape: tuple, device: str, dtype: torch.dtype) -> tuple:
    b, s, hq, hk, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(b, s, hk, d, device=device, dtype=dtype, generator=g)
    cos, sin = rope_tables(s, d, device, dtype)
    return q, k, cos, sin


def fp32_reference(args: tuple, interleaved: bool) -> tuple:
    q, k, cos, sin = args
    cos, sin = cos.float()[:, None], sin.float()[:, None]  # [S, 1, D/2] against x [B, S, H, D]
    return tuple(rotary_reference(x.float(), cos, sin, interleaved=interleaved,
                                  rotary_dim=x.shape[-1], full_tables=False) for x in (q, k))


def max_diff(a: tuple, b: tuple) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def cudagraph_ms(fn: Callable[[], Any], device: str) -> float | None:
    """Median ms per call replayed from a CUDA graph; None off the GPU."""
    if device != "cuda":
        return None
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def _safe(what: str, fn: Callable[[], Any], errors: list) -> Any:
    try:
        return fn()
    except Exception as e:  # one failed measurement must not lose the others
        errors.append(f"{what}: {type(e).__name__}: {e}")
        traceback.print_exc()
        return None


def run_case(name: str, shape: tuple, style: str, backend: str, rotary, device: str, dtype: torch.dtype) -> dict:
    """One shape, style and backend: times, launches and numerics of kernel, fused and floor."""
    interleaved = style == "interleaved"
    args = inputs(shape, device, dtype)
    q, k = args[:2]
    f = rotation(rotary, interleaved)
    cpu = device == "cpu"
    tracing = cpu_triton_tracing if cpu else contextlib.nullcontext
    errors: list = []
    rec: dict = dict(shape=name, dims=dict(zip(("batch", "tokens", "q_heads", "k_heads", "head_dim"), shape)),
                     style=style, backend=backend, dtype=str(dtype).replace("torch.", ""), errors=errors)

    p = rope_fusion.RopeFusionPass(backend=backend)
    torch._dynamo.reset()
    # a cache hit would skip the pass: caches off (torch.compiler's force_disable_caches, patched through Inductor's)
    with torch.no_grad(), tracing(), torch._inductor.config.patch(force_disable_caches=True):
        fused_fn = torch.compile(f, options={"post_grad_custom_post_pass": p})
        fused_out = _safe("fused compile", lambda: fused_fn(*args), errors)
        if cpu:  # Inductor cannot compile the kernel for the CPU: the kernel runs eagerly, interpreted
            def kernel_fn(*a):
                with interpreted(rotary):
                    return f(*a)
        else:
            kernel_fn = torch.compile(f)
        kernel_out = _safe("kernel compile", lambda: kernel_fn(*args), errors)
        calls = {"kernel": lambda: kernel_fn(*args), "fused": lambda: fused_fn(*args),
                 "floor": lambda: (q.clone(), k.clone())}
        if fused_out is None:
            del calls["fused"]
        if kernel_out is None:
            del calls["kernel"]
        rec["ms"] = {v: _safe(f"{v} do_bench", lambda c=c: bench_ms(c, device), errors) for v, c in calls.items()}
        rec["cudagraph_ms"] = {v: _safe(f"{v} cudagraph", lambda c=c: cudagraph_ms(c, device), errors)
                               for v, c in calls.items()}
        rec["launches"] = {v: _safe(f"{v} launches", lambda c=c: count_launches(c, device), errors)
                           for v, c in calls.items()}
    rep = p.report
    rec.update(sites=len(rep.sites), kernels=[f"{k.op}[{k.backend}]" for k in rep.kernels],
               origins=sorted({s.origin for s in rep.sites}), pass_errors=[e.error for e in rep.errors],
               misses=[m.reason for m in rep.misses])
    floor, floor_g = rec["ms"].get("floor"), rec["cudagraph_ms"].get("floor")
    rec["x_floor"] = {v: (t / floor if t and floor else None) for v, t in rec["ms"].items()}
    rec["cudagraph_x_floor"] = {v: (t / floor_g if t and floor_g else None) for v, t in rec["cudagraph_ms"].items()}
    moved = sum(t.numel() * t.element_size() * 2 for t in (q, k))  # read once, write once
    rec["floor_gbs"] = moved / (floor * 1e-3) / 1e9 if floor else None
    if fused_out is not None and kernel_out is not None:
        ref = fp32_reference(args, interleaved)
        rec["max_diff_kernel_vs_fused"] = max_diff(kernel_out, fused_out)
        rec["max_diff_kernel_vs_fp32"] = max_diff(kernel_out, ref)
        rec["max_diff_fused_vs_fp32"] = max_diff(fused_out, ref)
    return rec


def markdown(records: list[dict], device: str) -> str:
    """One row per shape, style and backend; a smoke run's without its times (benchmarks/device_check.py)."""
    smoke = device_check.is_smoke(device)
    timed_head = "" if smoke else ("kernel ms, do_bench median | fused | floor | kernel x floor | fused x floor | "
                                   "speedup | cudagraph kernel x floor | cudagraph fused x floor | ")
    head = (f"| shape | tokens x heads (q/k) x D | style | backend | {timed_head}"
            "launches kernel/fused/floor | sites / kernels | max abs diff kernel vs fused (vs fp32: kernel, fused) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        d = r["dims"]
        ms, xf, cg, la = r["ms"], r["x_floor"], r["cudagraph_x_floor"], r["launches"]
        speed = ms["kernel"] / ms["fused"] if ms.get("kernel") and ms.get("fused") else None
        timed = "" if smoke else (
            f"{num(ms.get('kernel'), 4)} | {num(ms.get('fused'), 4)} | {num(ms.get('floor'), 4)} | "
            f"{num(xf.get('kernel'), 2)} | {num(xf.get('fused'), 2)} | {num(speed, 2)} | {num(cg.get('kernel'), 2)} | "
            f"{num(cg.get('fused'), 2)} | ")
        rows.append(
            f"| {r['shape']} | {d['tokens']} x {d['q_heads']}/{d['k_heads']} x {d['head_dim']} | {r['style']} | "
            f"{r['backend']} | {timed}"
            f"{la.get('kernel') or '-'}/{la.get('fused') or '-'}/{la.get('floor') or '-'} | "
            f"{r['sites']} / {', '.join(r['kernels']) or '-'} | {num(r.get('max_diff_kernel_vs_fused'), 3, 'g')} "
            f"({num(r.get('max_diff_kernel_vs_fp32'), 3, 'g')}, {num(r.get('max_diff_fused_vs_fp32'), 3, 'g')}) |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test, also on the CPU")
    ap.add_argument("--shapes", nargs="+", default=None, help="names from SHAPES (QUICK_SHAPES with --quick)")
    ap.add_argument("--styles", nargs="+", choices=STYLES, default=["interleaved"],
                    help="interleaved is vllm-omni's (is_neox_style=False); neox for comparison")
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=["auto"], help="RopeFusionPass backends")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--kernel", choices=list(KERNELS), default="vllm", help="whose copy of flash-attn's kernel")
    ap.add_argument("--rotary-file", default=None,
                    help="the kernel file (vllm/vllm_flash_attn/ops/triton/rotary.py), loaded under its real name")
    ap.add_argument("--merge-all", action="store_true",
                    help="merge every launch, also those the pass keeps as flash-attn's own where they measured "
                         "faster (rope_fusion.passes.kernel_sites.flash_attn_sites.KEPT_LAUNCHES): the merged "
                         "launch's own time")
    ap.add_argument("--out", default=None, help="JSON file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.vllm_omni", "python -m benchmarks.vllm_omni --device cpu --quick")
    table = QUICK_SHAPES if args.quick else SHAPES
    unknown = [s for s in args.shapes or [] if s not in table]
    if unknown:
        print(f"unknown shapes {unknown}; known: {list(table)}", file=sys.stderr)
        return 2
    rotary = load_rotary(args.kernel, args.rotary_file, try_import=args.device == "cuda")
    if args.merge_all:
        from rope_fusion.passes.kernel_sites import flash_attn_sites

        flash_attn_sites.KEPT_LAUNCHES = ()
    dtype = getattr(torch, args.dtype)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    print(f"kernel: {rotary.__name__} from {rotary.__file__}; {args.device}, {args.dtype}", flush=True)
    result: dict = dict(environment=environment(), device=args.device, dtype=args.dtype, kernel=rotary.__name__,
                        kernel_file=rotary.__file__, records=[])
    device_check.announce(args.device, result)
    t0 = time.perf_counter()
    for name in args.shapes or list(table):
        for style in args.styles:
            for backend in args.backends:
                r = run_case(name, table[name], style, backend, rotary, args.device, dtype)
                result["records"].append(r)
                write_json(args.out, result, quiet=True)  # partial results survive a time limit
                timed = "" if device_check.is_smoke(args.device) else ", x floor " + ", ".join(
                    f"{v} {num(x)}" for v, x in r["x_floor"].items())
                print(f"[{time.perf_counter() - t0:6.1f}s] {name} {style} {backend}: sites {r['sites']} "
                      f"{r['kernels']}{timed}", flush=True)
    print()
    print(markdown(result["records"], args.device))
    write_json(args.out, result)
    kept = "flash-attn's own launch kept"  # flash_attn_sites.KEPT_LAUNCHES: left as they are, and said so
    bad = [f"{r['shape']} {r['style']} {r['backend']}" for r in result["records"]
           if (r["sites"] != 2 and not (r["sites"] == 0 and r["misses"] and all(kept in m for m in r["misses"])))
           or r["errors"] or r["pass_errors"]]
    if bad:
        print(f"not fused into one launch, or a measurement failed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
