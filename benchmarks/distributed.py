"""Distributed benchmark: the example's tensor-parallel and Ulysses blocks at real attention shapes, per rank.

For each shape and mode (tp, ulysses) every rank compiles its share of the block (examples/
distributed_attention.py, diffusers FluxAttention with diffusers' interleaved RoPE by default) plainly and
with RopeFusionPass, and measures: the time per step of each (median over fixed repetitions, CUDA events,
collectives included), the fused rotary kernel's GPU time per step (torch.profiler, kernels whose name has
"rotary"), and the copy floor of that rotation (bytes of reading q and k once and writing them once, divided
by the copy bandwidth measured on this GPU with `torch.empty_like(t).copy_(t)` of the rank's q and k). Rank 0
checks the gathered output against one process running the whole block eagerly, writes JSON to --out and
prints a Markdown table.

    torchrun --nproc-per-node 2 benchmarks/distributed.py --out $OUT/distributed.json      # 2 GPUs, bf16
    torchrun --nproc-per-node 2 benchmarks/distributed.py --device cpu --quick              # CPU smoke test

Without a GPU it stops with one line unless `--device cpu` asks for the CPU: a smoke run, which checks the
plumbing and prints no times or speedups (benchmarks/device_check.py).

Shapes: Wan 1.3B self-attention (diffusers config: dim 1536, 12 heads x 128; 32760 tokens, the 81-frame 480p
video) and Flux (dim 3072, 24 heads x 128; 4608 tokens = 512 text + 4096 image). Wan's own RoPE helper is a
closure inside WanAttnProcessor that a parallel forward cannot call, so the Wan shape runs the Flux block (the
same interleaved rotation, diffusers' `apply_rotary_emb`); `--model llama` runs the NeoX spelling instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

# Run as a script (torchrun benchmarks/distributed.py), this directory comes first on sys.path, and its
# profile.py would shadow the standard library's `profile` (which cProfile, and so torch._dynamo, import):
# the repository root takes its place.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import device_check, timing  # noqa: E402
from benchmarks.kernels import bench_ms, environment, num, write_json  # noqa: E402
from examples.distributed_attention import Case, Sizes, build, compile_and_run, gather_output, init  # noqa: E402

SHAPES = {
    "wan1.3b": Sizes(batch=1, tokens=32760, hidden=1536, heads=12, kv_heads=12, head_dim=128),
    "flux": Sizes(batch=1, tokens=4608, hidden=3072, heads=24, kv_heads=24, head_dim=128),
}
QUICK_SHAPES = {
    "wan-tiny": Sizes(batch=1, tokens=32, hidden=64, heads=4, kv_heads=4, head_dim=16),
    "flux-tiny": Sizes(batch=1, tokens=16, hidden=128, heads=4, kv_heads=4, head_dim=32),
}
MODES = ("tp", "ulysses")
WARMUP, REPS, PROFILED_CALLS = 5, 20, 5


def step_ms(call: Callable[[], Any], device: str, reps: int = REPS) -> float:
    """Median ms per step. The ranks start each step together (barrier), so that a step does not include
    waiting for the other rank; every rank makes the same number of calls (they hold collectives), which
    rules out triton's do_bench (its repetition count is chosen per rank)."""
    return timing.step_ms(call, device, reps, WARMUP, before=dist.barrier)


def rotary_kernel_us(call: Callable[[], Any], device: str) -> tuple[float | None, list[str]]:
    """GPU time per step of the kernels whose name has "rotary" (the rope_fusion Triton kernel, or an Inductor
    kernel fused from the rotary op), and their names. None off the GPU: the CPU backend inlines the op."""
    if not device.startswith("cuda"):
        return None, []
    from torch.profiler import ProfilerActivity, profile

    timing.sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            call()
        timing.sync(device)
    hits = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "rotary" in e.name.lower()]
    total = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in hits)
    return total / PROFILED_CALLS, sorted({e.name for e in hits})


def copy_floor(sites: list, device: str) -> dict:
    """The rotation's copy floor on this rank: bytes of reading every rotated tensor once and writing its
    output once, over the bandwidth of `torch.empty_like(t).copy_(t)` measured on tensors of the sites'
    shapes and input dtypes (q and k: the sum of the two copies' times)."""
    tensors, rope_bytes = [], 0
    for s in sites:
        shape, dtype, out_dtype = tuple(int(d) for d in s.shape), getattr(torch, s.x_dtype), getattr(torch, s.out_dtype)
        t = torch.randn(shape, device=device).to(dtype)
        tensors.append(t)
        rope_bytes += t.numel() * (t.element_size() + torch.empty((), dtype=out_dtype).element_size())
    copy_ms = sum(bench_ms(lambda t=t: torch.empty_like(t).copy_(t), device) for t in tensors)
    copy_bytes = sum(2 * t.numel() * t.element_size() for t in tensors)
    bandwidth = copy_bytes / (copy_ms * 1e-3)
    return dict(copy_ms=copy_ms, bandwidth_gbs=bandwidth / 1e9, rope_bytes=rope_bytes,
                floor_us=rope_bytes / bandwidth * 1e6)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def bench_case(shape: str, sizes: Sizes, mode: str, model: str, dtype: str, device: str) -> dict:
    """One shape and mode on this rank: plain and fused step times, the rotary kernel against its floor, and
    (rank 0) the fused output against the whole block in one process."""
    case = Case(model, mode, "static", dtype)
    built = build(case, sizes, device)
    with torch.no_grad():
        plain_fn, plain_out, _ = compile_and_run(built, with_pass=False)
        plain_ms = step_ms(lambda: plain_fn(*built.args), device)
        fused_fn, fused_out, p = compile_and_run(built, with_pass=True)
        fused_ms = step_ms(lambda: fused_fn(*built.args), device)
        rot_us, rot_names = rotary_kernel_us(lambda: fused_fn(*built.args), device)
        whole, whole_plain = gather_output(case, fused_out), gather_output(case, plain_out)
        rec = dict(shape=shape, mode=mode, model=model, dtype=dtype, rank=dist.get_rank(),
                   sizes=dataclasses.asdict(sizes), step_ms_plain=plain_ms, step_ms_fused=fused_ms,
                   speedup=plain_ms / fused_ms, sites=len(p.report.sites), kernels=[k.op for k in p.report.kernels],
                   backends=[k.backend for k in p.report.kernels], site_shapes=[list(s.shape) for s in p.report.sites],
                   errors=[e.error for e in p.report.errors], rotary_us=rot_us, rotary_kernels=rot_names,
                   **copy_floor(p.report.sites, device))
        rec["x_floor"] = rot_us / rec["floor_us"] if rot_us is not None and rec["floor_us"] else None
        if dist.get_rank() == 0:
            eager = built.block.whole(built.x, built.cos, built.sin)
            rec.update(rel_err_vs_whole_eager=_rel(whole, eager),
                       max_diff_vs_plain_compile=(whole.double() - whole_plain.double()).abs().max().item())
    return rec


def markdown(records: list[dict], smoke: bool = False) -> str:
    """One row per shape, mode and rank; a smoke run's without its times (benchmarks/device_check.py)."""
    timed_head = "" if smoke else "step ms plain | step ms fused | speedup | rotary us | copy floor us | x floor | "
    head = f"| shape | mode | rank | sites/kernels | {timed_head}rel. err vs whole eager |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        timed = "" if smoke else (f"{r['step_ms_plain']:.3f} | {r['step_ms_fused']:.3f} | {r['speedup']:.3f} | "
                                  f"{num(r['rotary_us'], 1)} | {r['floor_us']:.1f} | {num(r['x_floor'], 2)} | ")
        rows.append(f"| {r['shape']} | {r['mode']} | {r['rank']} | {r['sites']}/{len(r['kernels'])} | {timed}"
                    f"{num(r.get('rel_err_vs_whole_eager'), 3, 'g')} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="default: bfloat16 on GPUs, float32 on the CPU")
    ap.add_argument("--model", choices=["flux", "llama"], default="flux")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--shapes", nargs="+", default=None, help="names from SHAPES (QUICK_SHAPES with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test, also on the CPU")
    ap.add_argument("--out", default=None, help="JSON file (rank 0 writes)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks/distributed.py", "torchrun --nproc-per-node 2 benchmarks/distributed.py "
                                   "--device cpu --quick")
    device = init(args.device)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    table = QUICK_SHAPES if args.quick else SHAPES
    records = [bench_case(name, table[name], mode, args.model, dtype, device)
               for name in (args.shapes or list(table)) for mode in args.modes]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    flat = sorted((r for recs in everyone for r in recs), key=lambda r: (r["shape"], r["mode"], r["rank"]))
    if dist.get_rank() == 0:
        result = dict(environment=environment(), world=dist.get_world_size(), device=args.device, dtype=dtype,
                      model=args.model, results=flat)
        device_check.announce(device, result)
        print(f"\n{dist.get_world_size()} ranks, {device.split(':')[0]}, {dtype}, model {args.model}\n")
        print(markdown(flat, device_check.is_smoke(device)))
        write_json(args.out, result)
    unfused = [f"{r['shape']} {r['mode']} rank {r['rank']}" for r in flat if not r["sites"] or r["errors"]]
    dist.destroy_process_group()
    if unfused:
        print(f"nothing fused (or a pass error) on: {', '.join(unfused)}", file=sys.stderr)
    return 1 if unfused else 0


if __name__ == "__main__":
    sys.exit(main())
