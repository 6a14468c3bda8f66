"""Training benchmark: one training step (forward + backward, bf16) of real models, with and without the pass.

Models (random weights, the real dims, 2 layers or blocks; every parameter trains):
- diffusers Flux (FluxTransformer2DModel, Flux.1-dev dims: 24 heads x 128, joint_attention_dim 4096, pooled 768,
  guidance embeds, axes_dims_rope (16, 56, 56)), num_layers=2, num_single_layers=2; 1024x1024 image: 4096 image
  + 512 text tokens;
- diffusers Wan2.1 1.3B (WanTransformer3DModel: dim 1536 = 12 heads x 128, ffn 8960, in_channels 16, text_dim 4096,
  patch (1, 2, 2)), num_layers=2; 480x832, 81 frames: latents 16 x 21 x 60 x 104, 32760 tokens, 512 text tokens;
- transformers Llama-3-8B dims (LlamaModel: hidden 4096, 32 q / 8 kv heads x 128, intermediate 14336, vocab
  128256, rope_theta 5e5), num_hidden_layers=2, 4096 tokens.

Per model: plain torch.compile and torch.compile + RopeFusionPass (fresh copies of the same weights), each
compiled once; then three repeats, alternating which variant goes first, of the median ms of STEPS steps; the
median over the repeats, their spread ((max - min) / median) and the ratio pass / plain. Then the profiler's GPU
time of the forward and of the backward (all kernels; and kernels whose name contains "rotary": the pass's fused
kernels, for plain compile none are named so, so its RoPE share is not separated: compare totals), and the copy
floor of the fused sites per graph: bytes of reading each rotated tensor once and writing it once (in the
backward: grad q and grad k), over the bandwidth of `dst.copy_(src)` measured on tensors of the sites' shapes.
The ratio rotary time / floor is per launch (every layer's q/k pair is one launch of the same shape). Gradients
of every parameter are compared (relative 2-norm) between the variants and against eager, and peak memory of
a step is recorded. A model whose build or a variant that fails is reported and skipped, never fatal.

    python -m benchmarks.training --out $OUT/training.json          # GPU (H200), bf16
    python benchmarks/training.py --quick                           # tiny configs on the CPU (smoke test)

Without a CUDA device it exits 2 with one line, unless --quick or `--device cpu` says to run on the CPU: a smoke
run, which checks the plumbing and prints no times or ratios (benchmarks/device_check.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# As a script, benchmarks/ would come first on sys.path and its profile.py shadow the standard library's.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import device_check  # noqa: E402
from benchmarks.kernels import bench_ms, environment, num, write_json  # noqa: E402
from benchmarks.models import flux  # noqa: E402  (the same Flux as the inference benchmark)
from benchmarks.timing import step_ms, sync  # noqa: E402

REPEATS, STEPS, WARMUP, PROFILED = 3, 10, 3, 3
QUICK_STEPS, QUICK_WARMUP, QUICK_PROFILED = 2, 1, 1
VARIANTS = ("plain", "pass")  # the default; "pass-triton" is the pass with backend="triton"


# ------------------------------------------------------------------------------------------------ models
def wan(quick: bool) -> tuple[torch.nn.Module, dict]:
    from diffusers import WanTransformer3DModel

    if quick:
        cfg = dict(num_layers=1, num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                   ffn_dim=32, text_dim=16, freq_dim=256, rope_max_seq_len=32)
        frames, hh, ww, txt = 2, 8, 8, 6
    else:  # Wan2.1-T2V-1.3B (diffusers config); 81 frames 480x832 -> latents 21 x 60 x 104 -> 32760 tokens
        cfg = dict(num_layers=2, num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                   ffn_dim=8960, text_dim=4096, freq_dim=256, patch_size=(1, 2, 2), cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
        frames, hh, ww, txt = 21, 60, 104, 512
    m = WanTransformer3DModel(**cfg)
    c = m.config
    return m, dict(hidden_states=torch.randn(1, c.in_channels, frames, hh, ww), timestep=torch.tensor([500]),
                   encoder_hidden_states=torch.randn(1, txt, c.text_dim), return_dict=False)


def llama(quick: bool) -> tuple[torch.nn.Module, dict]:
    import transformers

    if quick:
        cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
        tokens = 16
    else:  # Llama-3-8B dims
        cfg = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                   rope_theta=500000.0)
        tokens = 4096
    config = transformers.LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    m = transformers.LlamaModel(config)
    return m, dict(input_ids=torch.randint(0, cfg["vocab_size"], (1, tokens)), use_cache=False)


MODELS: dict[str, Callable[[bool], tuple[torch.nn.Module, dict]]] = {
    "flux": flux, "wan-1.3b": wan, "llama3-8b": llama}


# ------------------------------------------------------------------------------------------------ measurement
def _out(o: Any) -> torch.Tensor:
    if isinstance(o, torch.Tensor):
        return o
    if hasattr(o, "last_hidden_state"):
        return o.last_hidden_state
    return o[0]


def forward_loss(fn: Callable, inputs: dict) -> torch.Tensor:
    return _out(fn(**inputs)).float().square().mean()


def train_step(fn: Callable, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = forward_loss(fn, inputs)
    loss.backward()
    return loss


def _kernel_events(prof: Any, device: str) -> list:
    if not device.startswith("cuda"):
        return []  # the CPU backend inlines the fused op into Inductor's C++ kernels: nothing to separate
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _us(e: Any) -> float:
    return e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total


def phase_times(fn: Callable, model: torch.nn.Module, inputs: dict, device: str, calls: int) -> dict:
    """Per step, for the forward (with the loss) and the backward separately: GPU time of all kernels, of the
    kernels whose name contains "rotary" (and their launches and names), and wall ms."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    acc = {ph: {"total_us": 0.0, "rotary_us": 0.0, "rotary_launches": 0, "wall_ms": 0.0, "rotary_kernels": set()}
           for ph in ("forward", "backward")}
    for _ in range(calls):
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        with profile(activities=acts) as pf:
            loss = forward_loss(fn, inputs)
            sync(device)
        t1 = time.perf_counter()
        with profile(activities=acts) as pb:
            loss.backward()
            sync(device)
        t2 = time.perf_counter()
        for ph, prof, wall in (("forward", pf, t1 - t0), ("backward", pb, t2 - t1)):
            a, evs = acc[ph], _kernel_events(prof, device)
            rot = [e for e in evs if "rotary" in e.name.lower()]
            a["total_us"] += sum(_us(e) for e in evs)
            a["rotary_us"] += sum(_us(e) for e in rot)
            a["rotary_launches"] += len(rot)
            a["wall_ms"] += wall * 1e3
            a["rotary_kernels"] |= {e.name for e in rot}
    out = {}
    for ph, a in acc.items():
        gpu = device.startswith("cuda")
        out[ph] = {"total_us": a["total_us"] / calls if gpu else None,
                   "rotary_us": a["rotary_us"] / calls if gpu else None,
                   "rotary_launches": a["rotary_launches"] / calls if gpu else None,
                   "wall_ms": a["wall_ms"] / calls, "rotary_kernels": sorted(a["rotary_kernels"])}
    return out


def copy_floor(sites: list, device: str) -> dict:
    """Bytes of reading every rotated tensor of `sites` once and writing its output once, and that over the
    bandwidth of `dst.copy_(src)` on tensors of the sites' shapes and dtypes (q and k: the two copies' times)."""
    if not sites:
        return {}
    srcs, rope_bytes = [], 0
    for s in sites:
        shape = tuple(int(d) for d in s.shape)
        x_dt, o_dt = getattr(torch, s.x_dtype), getattr(torch, s.out_dtype)
        t = torch.randn(shape, device=device).to(x_dt)
        srcs.append(t)
        rope_bytes += t.numel() * (t.element_size() + torch.empty((), dtype=o_dt).element_size())
    dsts = [torch.empty_like(t) for t in srcs]
    copy_ms = sum(bench_ms(lambda d=d, t=t: d.copy_(t), device) for d, t in zip(dsts, srcs))
    copy_bytes = sum(2 * t.numel() * t.element_size() for t in srcs)
    bandwidth = copy_bytes / (copy_ms * 1e-3)
    return {"bandwidth_gbs": bandwidth / 1e9, "rope_bytes": rope_bytes, "floor_us": rope_bytes / bandwidth * 1e6}


def grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Relative 2-norm difference of all parameter gradients of a against b's (accumulated per parameter)."""
    num = den = 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        if pa.grad is None or pb.grad is None:
            if (pa.grad is None) != (pb.grad is None):
                return float("inf")
            continue
        ga, gb = pa.grad.double(), pb.grad.double()
        num += (ga - gb).square().sum().item()
        den += gb.square().sum().item()
    return (num / den) ** 0.5 if den else float("nan")


def _to(v: Any, device: str, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(device, dtype) if v.is_floating_point() else v.to(device)
    return v


def _peak_gib(call: Callable[[], Any], device: str) -> float | None:
    if not device.startswith("cuda"):
        call()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _site_rows(report: Any, kind: str) -> tuple[list, list]:
    sites = [s for s in report.sites if s.graph_kind == kind]
    kernels = [k for k in report.kernels if report.graph_records[k.graph].kind == kind]
    return sites, kernels


# ------------------------------------------------------------------------------------------------ one model
def bench_model(name: str, quick: bool, device: str, dtype: torch.dtype, backend: str,
                variants: tuple = VARIANTS) -> dict:
    """`variants` in the order they are compiled and first run (a fault that kills the CUDA context then
    names the variant that ran first)."""
    import rope_fusion

    steps, warmup, profiled = (QUICK_STEPS, QUICK_WARMUP, QUICK_PROFILED) if quick else (STEPS, WARMUP, PROFILED)
    rec: dict = {"model": name, "ms": {}, "repeats_ms": {v: [] for v in variants}, "errors": {}}
    try:
        torch.manual_seed(0)
        base, inputs = MODELS[name](quick)
        base = base.to(device, dtype).train()
        inputs = {k: _to(v, device, dtype) for k, v in inputs.items()}
    except Exception as e:
        rec["errors"]["build"] = f"{type(e).__name__}: {e}"
        traceback.print_exc(limit=4)
        return rec
    models, fns, passes = {}, {}, {}
    for v in variants:
        try:
            m = copy.deepcopy(base)
            vb = "triton" if v == "pass-triton" else backend
            p = None if v == "plain" else rope_fusion.RopeFusionPass(backend=vb)
            fn = torch.compile(m, options={"post_grad_custom_post_pass": p}) if p else torch.compile(m)
            t0 = time.perf_counter()
            train_step(fn, m, inputs)  # compiles the forward, and the backward on its first call
            sync(device)
            rec.setdefault("compile_s", {})[v] = round(time.perf_counter() - t0, 1)
            models[v], fns[v], passes[v] = m, fn, p
        except Exception as e:  # a failing variant is reported, never fatal
            rec["errors"][v] = f"{type(e).__name__}: {e}"
            traceback.print_exc(limit=4)
    try:  # gradients of one step from the same weights: the variants against each other and against eager
        eager = copy.deepcopy(base)
        train_step(eager, eager, inputs)
        for v in models:
            train_step(fns[v], models[v], inputs)
        rec["grad_rel_diff"] = {f"{v} vs eager": grad_diff(models[v], eager) for v in models}
        for v in models:
            if v != "plain" and "plain" in models:
                rec["grad_rel_diff"][f"{v} vs plain"] = grad_diff(models[v], models["plain"])
        del eager
    except Exception as e:
        rec["errors"]["grads"] = f"{type(e).__name__}: {e}"
    for r in range(REPEATS):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            if v in models:
                call = lambda v=v: train_step(fns[v], models[v], inputs)
                rec["repeats_ms"][v].append(step_ms(call, device, steps, warmup))
    for v, ts in rec["repeats_ms"].items():
        if ts:
            med = statistics.median(ts)
            rec["ms"][v] = med
            rec.setdefault("spread", {})[v] = (max(ts) - min(ts)) / med
    if "plain" in rec["ms"] and "pass" in rec["ms"]:
        rec["ratio"] = rec["ms"]["pass"] / rec["ms"]["plain"]
    if "plain" in rec["ms"] and "pass-triton" in rec["ms"]:
        rec["ratio_triton"] = rec["ms"]["pass-triton"] / rec["ms"]["plain"]
    for v in models:
        rec.setdefault("phases", {})[v] = phase_times(fns[v], models[v], inputs, device, profiled)
        rec.setdefault("peak_gib", {})[v] = _peak_gib(lambda v=v: train_step(fns[v], models[v], inputs), device)
    p = passes.get("pass")
    if p is not None:
        rep = p.report
        rec["report"] = {"summary": rep.summary(), "graphs": [(g.kind, g.outcome, g.sites, g.kernels, g.misses)
                                                              for g in rep.graph_records],
                         "errors": [e.error for e in rep.errors], "misses": [m.reason for m in rep.misses]}
        rec["fused"] = {}
        for kind in ("forward", "backward"):
            sites, kernels = _site_rows(rep, kind)
            floor = copy_floor(sites, device)
            f = {"sites": len(sites), "kernels": len(kernels),
                 "ops": sorted({f"{k.op}[{k.backend}]" for k in kernels}),
                 "conjugate": sum(s.conjugate for s in sites), **floor}
            measured = rec["phases"]["pass"][kind]
            if floor and measured["rotary_us"] and measured["rotary_launches"]:
                # every launch is one q/k pair of one layer, all of the same shape: ratio per launch
                per_launch = measured["rotary_us"] / measured["rotary_launches"]
                f["rotary_us_per_launch"] = per_launch
                f["floor_us_per_kernel"] = floor["floor_us"] / max(len(kernels), 1)
                f["x_floor"] = per_launch / f["floor_us_per_kernel"]
                f["launches_match_kernels"] = measured["rotary_launches"] == len(kernels)
            rec["fused"][kind] = f
    models.clear()
    fns.clear()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rec


# ------------------------------------------------------------------------------------------------ output
HEADER = ["model", "plain ms", "pass ms", "pass/plain", "spread plain / pass", "fwd sites/kernels",
          "bwd sites/kernels", "fwd GPU us plain / pass", "bwd GPU us plain / pass", "fwd rotary us (x floor)",
          "bwd rotary us (x floor)", "grad diff pass vs plain", "pass-triton/plain", "errors"]
# What a smoke run leaves out (benchmarks/device_check.py): its times and ratios of them.
TIMED = {"plain ms", "pass ms", "pass/plain", "spread plain / pass", "fwd GPU us plain / pass",
         "bwd GPU us plain / pass", "fwd rotary us (x floor)", "bwd rotary us (x floor)", "pass-triton/plain"}


def _cells(r: dict) -> list[str]:
    """The cells of one model, in HEADER's order."""
    ms, sp, ph, fu = r.get("ms", {}), r.get("spread", {}), r.get("phases", {}), r.get("fused", {})
    tot = {kind: " / ".join(num(ph.get(v, {}).get(kind, {}).get("total_us"), 0) for v in VARIANTS)
           for kind in ("forward", "backward")}
    rot = {kind: f"{num(ph.get('pass', {}).get(kind, {}).get('rotary_us'), 1)} "
                 f"({num(fu.get(kind, {}).get('x_floor'))})" for kind in ("forward", "backward")}
    sk = {kind: f"{fu.get(kind, {}).get('sites', '-')}/{fu.get(kind, {}).get('kernels', '-')}"
          for kind in ("forward", "backward")}
    errors = "; ".join(f"{k}: {v[:80]}" for k, v in r.get("errors", {}).items())
    cells = [r["model"], num(ms.get("plain")), num(ms.get("pass")), num(r.get("ratio"), 3),
             f"{num(sp.get('plain'), 1, '%')} / {num(sp.get('pass'), 1, '%')}", sk["forward"], sk["backward"],
             tot["forward"], tot["backward"], rot["forward"], rot["backward"],
             num(r.get("grad_rel_diff", {}).get("pass vs plain"), 2, "e"), num(r.get("ratio_triton"), 3),
             errors]
    return cells


def markdown(records: list[dict], smoke: bool = False) -> str:
    """One row per model; a smoke run's without its times."""
    header = [h for h in HEADER if not (smoke and h in TIMED)]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        cells = dict(zip(HEADER, _cells(r)))
        rows.append("| " + " | ".join(cells[h] for h in header) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None,
                    help="default: cuda (cpu for --quick without a GPU); `--device cpu` without --quick trains the "
                         "real sizes in bf16 on the CPU (many minutes per model)")
    ap.add_argument("--quick", action="store_true", help="tiny configs (the CPU smoke test)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help=f"subset of {list(MODELS)}")
    ap.add_argument("--backend", default="auto", help="RopeFusionPass backend")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS),
                    help="of plain, pass, pass-triton; compiled and first run in this order")
    ap.add_argument("--cudnn-attention", action="store_true", help="leave cuDNN's SDPA backend enabled")
    args = ap.parse_args(argv)
    args.variants = tuple(x for v in args.variants for x in v.split(",") if x)
    if args.device is None:  # the GPU where there is one; --quick alone falls back to the CPU
        args.device = "cuda" if torch.cuda.is_available() or not args.quick else "cpu"
    if args.device.startswith("cuda") and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.training", "python -m benchmarks.training --quick (tiny configs; "
                                   "--device cpu trains the real sizes there)")
    smoke = device_check.is_smoke(args.device)
    if args.device.startswith("cuda") and not args.cudnn_attention:
        # Plain torch.compile of the Flux step fails in cuDNN's SDPA backward on the H200 with torch 2.11 /
        # CUDA 13 ("mha_graph.execute(...).is_good()", then an illegal memory access that kills the context),
        # with or without the pass: attention uses the flash / memory-efficient kernels instead, for every variant.
        torch.backends.cuda.enable_cudnn_sdp(False)
    # the pass must see every graph (an FX graph cache hit skips it) and both variants compile alike
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    dtype = getattr(torch, args.dtype)
    env = environment()
    print("environment:", env, "device:", args.device, flush=True)
    result: dict = {"environment": env, "device": args.device, "dtype": args.dtype, "quick": args.quick,
                    "repeats": REPEATS, "records": []}
    device_check.announce(args.device, result)
    t_start = time.perf_counter()
    for name in args.models:
        rec = bench_model(name, args.quick, args.device, dtype, args.backend, args.variants)
        result["records"].append(rec)
        write_json(args.out, result, quiet=True)
        timed = "" if smoke else (f"ms {rec['ms']} ratio {rec.get('ratio')} ratio_triton {rec.get('ratio_triton')} ")
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name}: {timed}grad {rec.get('grad_rel_diff')} "
              f"fused {rec.get('report', {}).get('graphs')} errors {rec['errors']}", flush=True)
    table = markdown(result["records"], smoke)
    print(f"\ntraining step (forward + backward), {args.dtype}, {args.device}, median of {REPEATS} repeats, "
          f"pass backend {args.backend}\n")
    print(table)
    result["markdown"] = table
    result["seconds"] = time.perf_counter() - t_start
    write_json(args.out, result)
    return 0 if all(not r["errors"] for r in result["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
