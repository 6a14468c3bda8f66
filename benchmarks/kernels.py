"""Kernel-level benchmark: RoPE sites, q and k, against the copy floor (a clone of q and k: the same bytes read
and written once), measured side by side in one run.

Row groups (`--groups`, default all; they run in the order norm, flux, vllm, backward, coverage, spellings):
- `spellings`: every catalogue spelling (benchmarks/spellings.py) at four shapes: eager, plain torch.compile
  (twice, for the run-to-run spread), torch.compile + RopeFusionPass(backend="auto" | "triton" | "inductor"),
  the Triton op called directly with the arguments the pass would emit, Liger (NeoX only, if installed);
  kernel launches of the decode shape; which fused backend is faster per spelling (the data behind `auto`).
- `norm`: a per-head RMSNorm (diffusers and transformers spellings, fp32 math) before Flux's interleaved
  `apply_rotary_emb` or HF rotate_half, D 80 and 128, and Wan's RMSNorm across all heads before its RoPE;
  plain compile against the pass, and whether the pass folded the norm into the op (`report.sites[i].norm`).
- `flux`: the Flux site [B,H,S,D] = [1,24,4608,128], interleaved, fp32 full-width tables, `.float()` math.
- `vllm`: vLLM's `RotaryEmbedding.forward_native` (cos_sin_cache gathered by positions, flat [T, H*D] q/k):
  Llama-3-8B (32/8 heads x 128, NeoX) at T = 1, 8, 64, 256, 8192, GPT-J-style partial (64 of 128,
  interleaved) and Qwen3 (per-head RMSNorm first) at T = 8192, Qwen2.5-7B (28/4 heads x 128, NeoX) at
  T = 1, 64, 8192, and vLLM's MRotaryEmbedding (Qwen2-VL: three position streams, mrope_section [16, 24, 24], 28/4
  heads x 128) at T = 64 and 8192, static compiles only; static compiles, `-dyn` compiles whose
  token count is dynamic as vLLM compiles (`mark_dynamic` on the token dim, static otherwise), and `-dynall`
  ones (`torch.compile(dynamic=True)`: every size symbolic, head counts and widths too); each dynamic
  variant compiled once per form and reused for every T; kernel launches per call.
- `backward`: a training step's RoPE in isolation (q, k require grad): forward and forward+backward, plain
  against the pass, and from the profiler the backward's rotary kernel (named *rotary*) against the floor.
- `coverage`: the catalogue's rarer forms at their models' shapes (`coverage_rows` gives shapes and floors):
  M8 DeepSeek-V3 MLA (de-interleave then rotate_half on the 64 rope lanes of q's 192, single-head k_pe; floor
  q_pe and k_pe), M9 HiDream (2x2 rotation matrices built in the graph), M10 CLVP (q, k and v by one table,
  partial NeoX; floor q, k and v; also from the hidden states, projections included), M11 Allegro (three
  NeoX blocks, tables gathered by F.embedding) and V-JEPA 2 (three interleaved blocks, tables from positions
  in the graph, int64 and fp32 positions), M12 CogVideoX (the rotation written back into the video rows of
  q and k, `q[:, :, text:] = rope(q[:, :, text:])`; alone, and after the processor's LayerNorm), M13 Flux's
  joint attention (text and image q and k normed apart, joined by a cat, rotated; floor the four pieces), M14
  HunyuanVideo's dual-stream attention (the image q and k normed and rotated, the normed text joined after them;
  floor the four pieces); plain
  compile against the pass (auto, and backend="triton"), kernel launches per call.

Rows of the norm, flux, vllm, backward and coverage groups are timed with triton's do_bench (L2 flushed between
calls) and, but for `backward`, in CUDA-graph replay (do_bench_cudagraph: no host overhead, as vLLM replays
decode). The pass's report of each variant is kept (sites, backends, norms folded, misses such as "left to
Inductor").
A row or variant that fails is reported with its error and the run goes on; the JSON is rewritten after every
row, so a time limit still leaves the rows done so far.

    python -m benchmarks.kernels --out $OUT/kernels.json                    # every group (GPU)
    python -m benchmarks.kernels --groups norm,vllm --rows llama            # a subset
    python -m benchmarks.kernels --quick                                    # tiny shapes on the CPU (smoke test)

Without a GPU it stops with one line unless --quick asks for the CPU smoke test, which checks the plumbing and
prints no times (benchmarks/device_check.py).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

# As a script, benchmarks/ would come first on sys.path and its profile.py shadow the standard library's.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import device_check  # noqa: E402
from benchmarks import spellings as sp  # noqa: E402
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
VARIANTS = ("eager", "compile", "compile#2", "pass-auto", "pass-triton", "pass-inductor", "triton-op", "liger",
            "floor")
GROUPS = ("norm", "flux", "vllm", "backward", "coverage", "spellings")  # the order they run in

# ---------------------------------------------------------------------------------------------------------
# measurement helpers (models.py and profile.py use them too)


def bench_ms(fn: Callable[[], Any], device: str, grad_to_none: list | None = None) -> float:
    """Median milliseconds per call: triton's do_bench on a GPU (L2 flushed between calls), wall clock else."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                             return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn: Callable[[], Any], device: str) -> float | None:
    """Median milliseconds per call replayed in a CUDA graph (triton's do_bench_cudagraph); None off the GPU."""
    if device != "cuda":
        return None
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


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


def kernel_times(call: Callable[[], Any], calls: int = 5, device: str = "cuda") -> dict[str, tuple[float, float]]:
    """{kernel name: (launches per call, us per call)} over `calls` profiled calls: GPU kernels on a GPU, the
    profiler's CPU ops (self time) elsewhere (the CPU smoke test of the same code)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device == "cuda"
    call()
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
        if gpu:
            torch.cuda.synchronize()
    acc: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if gpu and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        a = acc[e.name]
        a[0] += 1
        if gpu:
            a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        else:
            a[1] += e.self_cpu_time_total
    return {k: (v[0] / calls, v[1] / calls) for k, v in acc.items()}


def max_err(got: Any, want: Any) -> float:
    """Largest absolute difference over matching tensors of two (nested) outputs."""
    if isinstance(got, torch.Tensor):
        return float((got.detach().double() - want.detach().double()).abs().max()) if got.numel() else 0.0
    if hasattr(got, "to_tuple"):
        got, want = got.to_tuple(), want.to_tuple()
    if isinstance(got, (tuple, list)):
        return max((max_err(g, w) for g, w in zip(got, want) if g is not None), default=0.0)
    if hasattr(got, "sample"):
        return max_err(got.sample, want.sample)
    if hasattr(got, "last_hidden_state"):
        return max_err(got.last_hidden_state, want.last_hidden_state)
    return float("nan")


def num(v: float | None, digits: int = 2, kind: str = "f") -> str:
    """A table cell: `v` formatted as `{:.<digits><kind>}`, "-" when it was not measured."""
    return "-" if v is None else f"{v:.{digits}{kind}}"


def print_table(title: str, rows: list[list[Any]], header: list[str]) -> None:
    cells = [[_fmt(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def _fmt(c: Any) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1e-2 and c else f"{c:.3f}"
    return str(c)


def write_json(path: str | None, data: dict, quiet: bool = False) -> None:
    """Write atomically (a time limit mid-write leaves the previous version, never half a file)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)
    if not quiet:
        print(f"\nwrote {path}")


def environment() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    for mod in ("triton", "diffusers", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # missing, or broken by a version mismatch
            info[mod] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def raise_recompile_limits(n: int = 64) -> None:
    """Every variant compiles the same code object; its cache must hold them all (else Dynamo runs eager)."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), n))


def warm_up(device: str) -> float:
    """Start what the first compile of a process would otherwise pay for (Inductor's compile workers, Triton,
    the CUDA context), so that first-call seconds are compile time. Returns the seconds it took."""
    t0 = time.perf_counter()
    try:
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
        if hasattr(AsyncCompile, "wait_pool_ready"):
            AsyncCompile.wait_pool_ready(timeout=120)
    except Exception as e:  # no pool (one compile thread) or another torch: compile in process
        print(f"  compile workers not warmed: {type(e).__name__}: {e}", flush=True)
    try:
        fn = torch.compile(lambda x: (x * 2).sin() + 1, dynamic=False)
        fn(torch.randn(1024, device=device))
    except Exception as e:
        print(f"  warm-up compile failed: {type(e).__name__}: {e}", flush=True)
    return time.perf_counter() - t0


def no_graph_caches() -> None:
    """FX graph and AOTAutograd caches off: variants compile the same graph with the same pass options (a
    static and a dynamic compile at one size, say), and a hit would skip the pass and leave its report empty."""
    torch._inductor.config.fx_graph_cache = False
    try:
        torch._functorch.config.enable_autograd_cache = False
    except AttributeError:
        pass


def pass_summary(p: Any) -> dict:
    """What the pass did, in plain data: sites, kernels and their backends, norms folded, misses (those left to
    Inductor by the cost model counted apart), host tables, errors."""
    r = p.report
    norms = collections.Counter(s.norm for s in r.sites if s.norm)
    misses = [m.reason for m in r.misses]
    out = {"sites": len(r.sites), "kernels": len(r.kernels),
           "backends": dict(collections.Counter(f"{k.op.split('.')[-1]}[{k.backend}]" for k in r.kernels)),
           "norms_folded": sum(n for k, n in norms.items() if k.endswith("folded")),
           "norms": dict(norms), "misses": len(misses),
           "left_to_inductor": sum("left to inductor" in m.lower() for m in misses),
           "miss_reasons": sorted({m[:200] for m in misses}), "host_tables": len(r.host_tables),
           "errors": [f"{e.outcome}: {e.error}"[:300] for e in r.errors],
           "fallbacks": sorted({k.fallback[:200] for k in r.kernels if k.fallback}),
           "folds": sorted({k.fold[:200] for k in r.kernels if k.fold}),  # a slice write or cat in the node, or why not
           "graphs": len(r.graph_records) or r.graphs, "pass_s": round(r.seconds, 2),
           "backward_sites": sum(s.graph_kind == "backward" for s in r.sites)}
    c = r.cached
    if c.graphs:
        out["cached"] = {"graphs": c.graphs, "sites": c.sites, "kernels": c.kernels}
    return out


def short_summary(s: dict | None) -> str:
    """One cell: sites/kernels, backends, norms folded, left to Inductor."""
    if not s:
        return "-"
    text = f"{s['sites']}s/{s['kernels']}k"
    if s["backends"]:
        text += " " + ",".join(f"{k}x{n}" for k, n in s["backends"].items())
    if s["graphs"] > 1:
        text += f" in {s['graphs']} graphs"
    if s["norms_folded"]:
        text += f" norm-folded x{s['norms_folded']}"
    if s["left_to_inductor"]:
        text += f" left-to-inductor x{s['left_to_inductor']}"
    elif s["misses"]:
        text += f" misses x{s['misses']}"
    if s["errors"]:
        text += f" ERRORS x{len(s['errors'])}"
    if s.get("cached"):
        text += f" (FX graph cache: {s['cached']['sites']}s/{s['cached']['kernels']}k not seen)"
    return text


def own_code(fn: Callable) -> Callable:
    """fn with a code object of its own. Dynamo keeps its compiled entries on the code object, so variants
    compiled from one function share a list that every call walks (each other variant's entry fails its
    backend guard first): host time that depends on the order the variants were compiled in, a few us a call,
    as large as the launch costs that host-bound rows compare."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copy, fn)


def compiled(fn: Callable, backend: str | None, dynamic: bool | None = False) -> tuple[Callable, Any]:
    """torch.compile(fn) (static shapes by default), with the fusion pass for `backend` (None: plain; a name
    ending in "+cg": the pass told that the call is replayed in CUDA graphs, as do_bench_cudagraph replays it);
    each compile on a code object of its own (`own_code`)."""
    fn = own_code(fn)
    if backend is None:
        return torch.compile(fn, dynamic=dynamic), None
    import rope_fusion

    name, _, flag = backend.partition("+")
    p = rope_fusion.RopeFusionPass(backend=name, cuda_graphs=True if flag == "cg" else None)
    return torch.compile(fn, dynamic=dynamic, options={"post_grad_custom_post_pass": p}), p


# ---------------------------------------------------------------------------------------------------------
# group "spellings": the catalogue spellings at the table's shapes


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
    if variant.startswith("pass-") and variant[5:] in ("auto", "triton", "inductor"):
        if variant == "pass-triton" and device != "cuda":
            return None, None
        return compiled(spelling.apply, variant[5:])
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
    rec: dict = {"group": "spellings", "shape": shape_name, "dims": shape, "spelling": spelling.code,
                 "name": spelling.name, "ms": {}, "err": {}, "fused_kernels": {}, "pass": {}, "launches": {},
                 "errors": {}}
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
                rec["pass"][v] = pass_summary(p)
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


def run_spellings(args: argparse.Namespace, device: str, result: dict, t_start: float) -> None:
    shapes = QUICK_SHAPES if device == "cpu" else SHAPES
    smoke = device_check.is_smoke(device)
    if args.shapes:
        shapes = {n: s for n, s in shapes.items() if n in args.shapes}
    spellings = [SPELLINGS[c] for c in (args.spellings or SPELLINGS)]
    variants = [v for v in VARIANTS if v in args.variants]
    records = result["records"]
    mine = []
    for sname, shape in shapes.items():
        for spl in spellings:
            try:
                r = run_case(sname, shape, spl, device, variants, torch.bfloat16)
            except Exception as e:  # inputs that do not fit, say: the row is reported, the run goes on
                traceback.print_exc(limit=3)
                r = {"group": "spellings", "shape": sname, "spelling": spl.code, "name": spl.name, "ms": {},
                     "x_floor": {}, "err": {}, "pass": {}, "launches": {}, "fused_kernels": {},
                     "compile_spread": None, "errors": {"row": f"{type(e).__name__}: {e}"}}
            records.append(r)
            mine.append(r)
            write_json(args.out, result, quiet=True)  # partial results survive a time limit
            print(f"[{time.perf_counter() - t_start:6.1f}s] {sname} {spl.code}: " + ", ".join(
                f"{v} ran" if smoke else f"{v} {r['x_floor'].get(v) or 0:.2f}x" for v in r["ms"]), flush=True)
    if not mine:
        return
    cols = [v for v in variants if any(v in r["ms"] for r in mine)]
    header = ["shape", "spelling"] + cols
    if not smoke:
        print_table("spellings: ms per call (median), q and k, bf16", [[r["shape"], f"{r['spelling']} {r['name']}"]
                    + [r["ms"].get(v) for v in cols] for r in mine], header)
        print_table("spellings: x copy floor (do_bench)", [[r["shape"], r["spelling"]]
                    + [r["x_floor"].get(v) for v in cols] for r in mine], header)
    print_table("spellings: max abs error against eager", [[r["shape"], r["spelling"]]
                + [r["err"].get(v) for v in cols] for r in mine], header)
    pcols = [v for v in cols if v.startswith("pass-")]
    print_table("spellings: what the pass did (sites/kernels, op[backend], misses)", [[r["shape"], r["spelling"]]
                + [short_summary(r["pass"].get(v)) for v in pcols] for r in mine], ["shape", "spelling"] + pcols)
    dec = [r for r in mine if any(n is not None for n in r["launches"].values())]
    if dec:
        print_table("spellings: kernel launches per call, decode shape", [[r["shape"], r["spelling"]]
                    + [r["launches"].get(v) for v in cols] for r in dec], header)
    if smoke:
        return
    spreads = [r["compile_spread"] for r in mine if r["compile_spread"] is not None]
    if spreads:
        print(f"\nplain torch.compile timed twice: run-to-run spread median {statistics.median(spreads):.1%}, "
              f"max {max(spreads):.1%}")
    rule = auto_rule(mine)
    print("\nfaster fused backend per spelling and shape (auto rule data):")
    for code, per in rule.items():
        print(f"  {code}: {per}")
    result["auto_rule"] = rule


# ---------------------------------------------------------------------------------------------------------
# groups "norm", "flux", "vllm", "backward": one function per row, compiled once per variant

# variant: (RopeFusionPass backend, None for plain compile; dynamic sizes: "" none, "mark" the token dim marked
# dynamic (vLLM), "all" torch.compile(dynamic=True))
ROW_VARIANTS = {"compile": (None, ""), "pass": ("auto", ""), "pass-cg": ("auto+cg", ""),
                "pass-triton": ("triton", ""), "pass-inductor": ("inductor", ""), "compile-dyn": (None, "mark"),
                "pass-dyn": ("auto", "mark"),
                "pass-triton-dyn": ("triton", "mark"), "pass-inductor-dyn": ("inductor", "mark"),
                "compile-dynall": (None, "all"), "pass-dynall": ("auto", "all")}
FORCED = ("compile", "pass", "pass-triton", "pass-inductor")


@dataclasses.dataclass
class Row:
    group: str
    name: str
    shape: str
    fn: Callable
    make: Callable[[str], tuple]  # device -> the arguments of fn
    floor: Callable[[tuple], tuple]  # the arguments -> the tensors whose clone is the copy floor
    variants: tuple
    form: str = ""  # rows of one form share their -dyn compiles (one compiled function for every T)
    dyn: tuple = ()  # arguments whose dim 0 is the token count (marked dynamic for -dyn variants)
    norm: bool = False  # the pass should fold a QK-norm into the op
    launches: bool = False  # count kernel launches per call
    backward: bool = False  # time forward + backward; the first two arguments require grad
    mutates: bool = False  # fn writes into its arguments: the reference and each checked call get clones


def _randn(*shape: int, device: str, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, device=device, dtype=torch.bfloat16) * scale
    return t.requires_grad_() if grad else t


def _weight(n: int, device: str) -> torch.Tensor:
    return 1 + 0.1 * _randn(n, device=device)


def _qk_args(a: tuple) -> tuple:
    return a[:2]


def norm_rows(quick: bool) -> list[Row]:
    """(a) per-head RMSNorm + RoPE ([B,S,H,D]) at D 80 and 128, and Wan's RMSNorm across heads ([B,S,H*D])."""
    per_head = {"1x64x4x80": (1, 64, 4, 80), "1x48x2x128": (1, 48, 2, 128)} if quick else \
        {"1x16384x16x80": (1, 16384, 16, 80), "1x32760x12x128": (1, 32760, 12, 128)}
    across = {"1x48x4x32": (1, 48, 4, 32)} if quick else \
        {"1x32760x12x128": (1, 32760, 12, 128), "1x32760x40x128": (1, 32760, 40, 128)}
    rows = []
    for label, (B, S, H, D) in per_head.items():
        def make_il(device, B=B, S=S, H=H, D=D):
            return (_randn(B, S, H, D, device=device), _randn(B, S, H, D, device=device), _weight(D, device),
                    _weight(D, device), *sp.flux_tables(S, D, device))

        def make_neox(device, B=B, S=S, H=H, D=D):
            return (_randn(B, S, H, D, device=device), _randn(B, S, H, D, device=device), _weight(D, device),
                    _weight(D, device), *SPELLINGS["N1"].make_tables(B, S, D, torch.device(device)))

        rows.append(Row("norm", "rms+flux-il", label, sp.rms_flux_rotary, make_il, _qk_args, FORCED, norm=True))
        rows.append(Row("norm", "rms+hf-neox", label, sp.rms_hf_neox, make_neox, _qk_args, FORCED, norm=True))
    for label, (B, S, H, D) in across.items():
        def make_wan(device, B=B, S=S, H=H, D=D):
            return (_randn(B, S, H * D, device=device), _randn(B, S, H * D, device=device), _weight(H * D, device),
                    _weight(H * D, device), *SPELLINGS["I1"].make_tables(B, S, D, torch.device(device)))

        rows.append(Row("norm", "wan-rms-heads+I1", label, sp.wan_rms_across_heads, make_wan, _qk_args, FORCED,
                        norm=True))
    return rows


def flux_rows(quick: bool) -> list[Row]:
    """(b) the Flux site: [B,H,S,D], interleaved, fp32 full-width tables, `.float()` math."""
    B, H, S, D = (1, 2, 64, 32) if quick else (1, 24, 4608, 128)

    def make(device):
        return (_randn(B, H, S, D, device=device), _randn(B, H, S, D, device=device), *sp.flux_tables(S, D, device))

    return [Row("flux", "flux-il fp32 [B,H,S,D]", f"{B}x{H}x{S}x{D}", sp.flux_site_bhsd, make, _qk_args, FORCED)]


# form: (head size, rotary dim, NeoX, q heads, k heads, max positions, base, QK-norm first), its token counts
VLLM_FORMS = {
    "llama3-8b": ((128, 128, True, 32, 8, 8192, 500000.0, False), (1, 8, 64, 256, 8192)),
    "gptj-partial": ((128, 64, False, 32, 32, 8192, 10000.0, False), (8192,)),
    "qwen3-8b+norm": ((128, 128, True, 32, 8, 40960, 1000000.0, True), (8192,)),
    "qwen2.5-7b": ((128, 128, True, 28, 4, 32768, 1000000.0, False), (1, 64, 8192)),
}
QUICK_VLLM_FORMS = {
    "llama3-8b": ((32, 32, True, 4, 2, 256, 500000.0, False), (1, 8, 64)),
    "gptj-partial": ((32, 16, False, 4, 4, 256, 10000.0, False), (64,)),
    "qwen3-8b+norm": ((32, 32, True, 4, 2, 256, 1000000.0, True), (64,)),
    "qwen2.5-7b": ((32, 32, True, 7, 1, 256, 1000000.0, False), (8,)),
}
# "pass" is `auto` as a plain compile runs it (no CUDA graphs: launches cost host time), "pass-cg" `auto` told that
# the call is replayed in CUDA graphs (as vLLM replays decode, and as the CUDA-graph column times it)
VLLM_VARIANTS = ("compile", "pass", "pass-cg", "pass-triton", "compile-dyn", "pass-dyn")
DYNALL = ("compile-dynall", "pass-dynall")  # for the Llama form only: the pass fuses nothing there (CPU, torch 2.13)


def vllm_rows(quick: bool) -> list[Row]:
    """(c) vLLM's RotaryEmbedding.forward_native, the cos|sin cache gathered by positions, flat q and k."""
    rows = []
    for form, (dims, tokens) in (QUICK_VLLM_FORMS if quick else VLLM_FORMS).items():
        head, rot, neox, hq, hk, max_pos, base, norm = dims
        fn = sp.vllm_qwen3_rope(head) if norm else sp.vllm_rope(head, rot, neox)  # one object for every T
        for T in tokens:
            def make(device, T=T, head=head, rot=rot, hq=hq, hk=hk, max_pos=max_pos, base=base, norm=norm):
                # decode batches read scattered rows, a prefill reads consecutive ones
                pos = (torch.randint(0, max_pos, (T,), device=device) if T <= 256
                       else torch.arange(T, device=device) % max_pos)
                q, k = _randn(T, hq * head, device=device), _randn(T, hk * head, device=device)
                cache = sp.vllm_cos_sin_cache(max_pos, rot, base, device)
                return (pos, q, k, _weight(head, device), _weight(head, device), cache) if norm else (pos, q, k, cache)

            variants = VLLM_VARIANTS + (DYNALL if form.startswith("llama") else ())
            rows.append(Row("vllm", form, f"T={T} {hq}/{hk}x{head} R={rot}", fn, make, lambda a: a[1:3],
                            variants, form=form, dyn=(0, 1, 2), norm=norm, launches=True))
    return rows + mrope_rows(quick)


# MRoPE (vLLM's MRotaryEmbedding, Qwen2-VL's and Qwen2.5-VL's text model): (head size, rotary dim, q heads, k heads,
# max positions, base, mrope_section), its token counts. Positions are [3, T], the token count their dim 1, so the
# -dyn variants (which mark dim 0 of the token arguments) are not run.
MROPE_FORM = ((128, 128, 28, 4, 32768, 1000000.0, (16, 24, 24)), (64, 8192))
QUICK_MROPE_FORM = ((32, 32, 4, 2, 256, 1000000.0, (4, 6, 6)), (8,))
MROPE_VARIANTS = ("compile", "pass", "pass-cg", "pass-triton")


def mrope_rows(quick: bool) -> list[Row]:
    """vLLM's MRotaryEmbedding.forward_native with [3, T] positions: three position streams, each pair's table row
    from the stream whose section holds it (Qwen2-VL, Qwen2.5-VL text)."""
    (head, rot, hq, hk, max_pos, base, section), tokens = QUICK_MROPE_FORM if quick else MROPE_FORM
    fn = sp.vllm_mrope(head, rot, True, section)
    rows = []
    for T in tokens:
        def make(device, T=T):
            pos = torch.stack([torch.arange(T, device=device) % max_pos,  # text tokens: the three streams agree
                               torch.randint(0, max_pos, (T,), device=device),
                               torch.randint(0, max_pos, (T,), device=device)])
            return (pos, _randn(T, hq * head, device=device), _randn(T, hk * head, device=device),
                    sp.vllm_cos_sin_cache(max_pos, rot, base, device))

        rows.append(Row("vllm", "qwen2-vl-mrope", f"T={T} {hq}/{hk}x{head} R={rot} mrope {list(section)}", fn, make,
                        lambda a: a[1:3], MROPE_VARIANTS, form="qwen2-vl-mrope", launches=True))
    return rows


def backward_rows(quick: bool) -> list[Row]:
    """(d) a training step's RoPE alone: NeoX (HF rotate_half) and interleaved (Flux), q and k require grad."""
    B, S, H, D = (1, 64, 2, 32) if quick else (1, 32760, 12, 128)
    label = f"{B}x{S}x{H}x{D}"

    def make_neox(device):
        return (_randn(B, S, H, D, device=device, grad=True), _randn(B, S, H, D, device=device, grad=True),
                *SPELLINGS["N1"].make_tables(B, S, D, torch.device(device)))

    def make_il(device):
        return (_randn(B, S, H, D, device=device, grad=True), _randn(B, S, H, D, device=device, grad=True),
                *sp.flux_tables(S, D, device))

    return [Row("backward", "N1 hf-neox", label, sp.hf_neox, make_neox, _qk_args, ("compile", "pass"), backward=True),
            Row("backward", "flux-il [B,S,H,D]", label, sp.flux_site_bshd, make_il, _qk_args, ("compile", "pass"),
                backward=True)]


COVERAGE_VARIANTS = ("compile", "pass", "pass-triton")


def _neox_table(S: int, rot: int, device: str, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """Full NeoX cos and sin [S, rot] (cat(freqs, freqs)), as the HF rotary embeddings return them."""
    a = sp._angles(S, rot // 2, device)
    a = torch.cat((a, a), -1)
    return a.cos().to(dtype), a.sin().to(dtype)


def coverage_rows(quick: bool) -> list[Row]:
    """(e) catalogue rows M8-M12 (the forms the pass fuses beyond the common ones) at their models' shapes:
    the copy floor, plain compile, the pass (auto) and the pass with backend="triton", kernel launches per call.

    - M8 deepseek-v3 mla: q [B, 128, T, 192] of which the last 64 lanes (q_pe) are rotated, k_pe [B, 1, T, 64]
      shared by the heads, bf16 full NeoX tables [B, T, 64]; de-interleave then rotate_half, q put back
      together as cat((q_nope, q_pe), -1). Floor: a clone of q (whole: the function returns all of it) and of
      k_pe; a clone of the strided q_pe alone measured 3x its bytes' time, so it is no floor. The pass makes q
      (the cat, the whole head) and k_pe one `rotary_qk` (`offset_q_only`: the pass-through head is q's alone),
      so pass-triton times one launch where q and k_pe took two before (docs/design.md 1.3).
    - M9 hidream 2x2: q, k [B, S, H, D] (S = 4096 image + 128 text tokens), fp32 angles [B, S, D/2], the 2x2
      rotation matrices stacked from cos and sin in the graph, `.float()` math, `type_as`. Floor: q and k.
    - M10 clvp qkv: q, k and v [B, H, T, 64] rotated by one bf16 table pair [B, 1, T, 32] (partial NeoX, 32 of
      64 lanes), each cat with its pass-through half. Floor: q, k and v. The pass takes a third tensor into a
      q/k launch when all three are graph inputs (here) or projections of one activation: `M10 clvp qkv+proj`
      starts from CLVP's hidden states (three [E, E] matmuls, view to heads, transpose). Its times include the
      three matmuls (cuBLAS, the same in every variant: compare variants in ms); its floor is a clone of the
      three projections ([B, H, T, D] strided views).
    - M11 allegro 3-block: q, k [B, H, t*h*w, 96] chunked in three blocks of 32, each NeoX by its own fp32
      cache [t|h|w, 32] gathered with F.embedding by int64 positions [3, B, t*h*w]. Floor: q and k.
    - M11 vjepa2 3-block: q, k [B, H, N, 64], three interleaved blocks of 20 lanes (d, h, w) with tables
      computed in the graph from the positions of V-JEPA 2's `get_position_ids` ([1, 1, N] each), 4 lanes
      passed through. With int64 positions, as the model makes them, omega (in x's dtype) keeps the tables and
      outputs bf16; the `fp32-pos` row passes float positions (the catalogue's form): the tables are fp32
      and so are the outputs (type promotion), so its ideal is 1.5x the floor (bf16 read, fp32 written).
      Floor: q and k (bf16).
    - M12 cogvideox slice write: q, k [B, H, 226 text + 17550 video tokens, 64] (CogVideoX-5B: 48 heads x 64;
      49 frames at 480x720 are 13 x 30 x 45 latent patches), `q[:, :, text:] = apply_rotary_emb(q[:, :, text:],
      (cos, sin))` and the same for k, full-width interleaved fp32 tables [17550, 64]. The function writes into
      q and k (graph inputs, mutated): its reference and each variant's checked call run on clones; timed
      calls rotate the same tensors again (the same work). Floor: q and k (the rows written are 98.7% of them).
    - M12 cogvideox slice write+norm: the same from the projections on, as CogVideoXAttnProcessor2_0 runs it:
      q, k [B, S, H*D] viewed to heads and transposed, the processor's LayerNorm (norm_q, norm_k: D, affine,
      eps 1e-6), then the slice writes into the norm's output (a fresh tensor, as in the model). Plain compile
      can do norm, rotation and scatter in one kernel per tensor; a fold that keeps the norm out of the kernel
      reads and writes q and k twice. Floor: q and k.
    - M13 flux joint cat: Flux.1's double-stream attention at 1024x1024 (B=1, 512 text + 4096 image tokens, 24
      heads x 128): image and text q, k [B, S, H, D] each RMS-normed with its own weight, joined along the
      sequence dim, Flux's interleaved rotation by fp32 tables [4608, 128]. With backend="triton" the cat and
      the four norms fold into one `rotary_qk_cat` launch reading the pieces (docs/design.md 4.4). Floor: the
      four pieces (the bytes of the joined q and k).
    - M14 hunyuan joined write: HunyuanVideo's dual-stream attention (B=1, 18104 image + 256 text tokens, 24 heads
      x 128): image q, k [B, H, S, D] RMS-normed and rotated (interleaved, fp32 tables [18104, 128]), the normed
      text q, k joined after them along the sequence. With backend="triton" the rotation is written into its rows
      of the join (`rotary_qk_into_`, docs/design.md 4.5) and the text rows are copied in; no cat of q or k is
      left. Floor: the four pieces.
    """
    rows = []
    # M8: (B, heads, T, nope, rope)
    B, H, T, NOPE, ROPE = (1, 4, 64, 32, 16) if quick else (1, 128, 8192, 128, 64)

    def make_m8(device, B=B, H=H, T=T, NOPE=NOPE, ROPE=ROPE):
        cos, sin = _neox_table(T, ROPE, device)
        return (_randn(B, H, T, NOPE + ROPE, device=device), _randn(B, 1, T, ROPE, device=device),
                cos.expand(B, T, ROPE).contiguous(), sin.expand(B, T, ROPE).contiguous())

    rows.append(Row("coverage", "M8 deepseek-v3 mla", f"q {B}x{H}x{T}x{NOPE + ROPE}[{NOPE}:] k_pe {B}x1x{T}x{ROPE}",
                    sp.deepseek_v3_mla, make_m8, lambda a: (a[0], a[1]),
                    COVERAGE_VARIANTS, launches=True))
    # M9: (B, image + text tokens, heads, D)
    B, S, H, D = (1, 64 + 8, 4, 32) if quick else (1, 4096 + 128, 20, 128)

    def make_m9(device, B=B, S=S, H=H, D=D):
        ang = sp._angles(S, D // 2, device).float().expand(B, S, D // 2).contiguous()
        return _randn(B, S, H, D, device=device), _randn(B, S, H, D, device=device), ang

    rows.append(Row("coverage", "M9 hidream 2x2", f"{B}x{S}x{H}x{D}", sp.hidream, make_m9, _qk_args,
                    COVERAGE_VARIANTS, launches=True))
    # M10: (B, heads, T, D, rotary dim)
    B, H, T, D, R = (1, 4, 64, 16, 8) if quick else (1, 16, 8192, 64, 32)

    def make_m10(device, B=B, H=H, T=T, D=D, R=R):
        cos, sin = _neox_table(T, R, device)
        return (*(_randn(B, H, T, D, device=device) for _ in range(3)), cos.view(1, 1, T, R).expand(B, 1, T, R),
                sin.view(1, 1, T, R).expand(B, 1, T, R))

    rows.append(Row("coverage", "M10 clvp qkv", f"{B}x{H}x{T}x{D} R={R}", sp.clvp_qkv, make_m10, lambda a: a[:3],
                    COVERAGE_VARIANTS, launches=True))

    def make_m10_proj(device, B=B, H=H, T=T, D=D):
        E = H * D
        h = _randn(B, T, E, device=device)
        ws = [_randn(E, E, device=device, scale=E ** -0.5) for _ in range(3)]
        return (h, *ws, *make_m10(device)[3:])

    def m10_proj_floor(a, H=H, D=D):  # the projections' results, as the function's rotation reads them
        h, ws = a[0], a[1:4]
        return tuple((h @ w).view(h.shape[0], h.shape[1], H, D).transpose(1, 2) for w in ws)

    rows.append(Row("coverage", "M10 clvp qkv+proj", f"{B}x{T}x{H * D} @ 3x{H * D}x{H * D} -> {B}x{H}x{T}x{D} R={R}",
                    sp.clvp_projected(D), make_m10_proj, m10_proj_floor, COVERAGE_VARIANTS, launches=True))
    # M11 Allegro: (B, heads, (t, h, w) grid, D)
    B, H, grid, D = (2, 4, (2, 3, 4), 24) if quick else (2, 24, (8, 22, 40), 96)
    N = grid[0] * grid[1] * grid[2]

    def make_allegro(device, B=B, H=H, grid=grid, D=D, N=N):
        return (_randn(B, H, N, D, device=device), _randn(B, H, N, D, device=device),
                *sp.allegro_caches(grid, D // 3, device), sp.allegro_positions(B, *grid, device))

    rows.append(Row("coverage", "M11 allegro 3-block", f"{B}x{H}x{N}x{D} grid {'x'.join(map(str, grid))}",
                    sp.allegro, make_allegro, _qk_args, COVERAGE_VARIANTS, launches=True))
    # M11 V-JEPA 2: (B, heads, frames, grid, D): N = frames * grid * grid tokens
    B, H, F, G, D = (1, 4, 4, 4, 16) if quick else (1, 16, 32, 16, 64)
    N = F * G * G
    for suffix, pos_dtype in (("", torch.int64), (" fp32-pos", torch.float32)):
        def make_vjepa2(device, B=B, H=H, G=G, D=D, N=N, pos_dtype=pos_dtype):
            return (_randn(B, H, N, D, device=device), _randn(B, H, N, D, device=device),
                    *sp.vjepa2_positions(N, G, device, pos_dtype))

        block = 2 * ((D // 3) // 2)
        rows.append(Row("coverage", f"M11 vjepa2 3-block{suffix}", f"{B}x{H}x{N}x{D} 3x{block}+{D - 3 * block}",
                        sp.vjepa2, make_vjepa2, _qk_args, COVERAGE_VARIANTS, launches=True))
    # M12 CogVideoX-5B: (B, heads, text tokens, video tokens, D); 49 frames 480x720 -> 13 x 30 x 45 latent patches
    B, H, TXT, VID, D = (1, 2, 3, 13, 16) if quick else (1, 48, 226, 13 * 30 * 45, 64)
    S = TXT + VID

    def make_m12(device, B=B, H=H, S=S, VID=VID, D=D):
        return (_randn(B, H, S, D, device=device), _randn(B, H, S, D, device=device), *sp.flux_tables(VID, D, device))

    rows.append(Row("coverage", "M12 cogvideox slice write", f"{B}x{H}x({TXT}+{VID})x{D}",
                    sp.cogvideox_slice_write(TXT), make_m12, _qk_args, COVERAGE_VARIANTS, launches=True,
                    mutates=True))

    def make_m12_norm(device, B=B, H=H, S=S, VID=VID, D=D):
        ln = [_weight(D, device) if i % 2 == 0 else 0.1 * _randn(D, device=device) for i in range(4)]
        return (_randn(B, S, H * D, device=device), _randn(B, S, H * D, device=device), *ln,
                *sp.flux_tables(VID, D, device))

    rows.append(Row("coverage", "M12 cogvideox slice write+norm", f"{B}x({TXT}+{VID})x{H * D} -> {B}x{H}x{S}x{D}",
                    sp.cogvideox_norm_slice_write(TXT, H), make_m12_norm, _qk_args, COVERAGE_VARIANTS,
                    launches=True))
    # M13 Flux.1 joint attention: (B, text tokens, image tokens, heads, D)
    B, TXT, IMG, H, D = (1, 3, 13, 2, 16) if quick else (1, 512, 4096, 24, 128)

    def make_m13(device, B=B, TXT=TXT, IMG=IMG, H=H, D=D):
        return (_randn(B, IMG, H, D, device=device), _randn(B, IMG, H, D, device=device),
                _randn(B, TXT, H, D, device=device), _randn(B, TXT, H, D, device=device),
                *(_weight(D, device) for _ in range(4)), *sp.flux_tables(TXT + IMG, D, device))

    rows.append(Row("coverage", "M13 flux joint cat", f"{B}x({TXT}+{IMG})x{H}x{D}", sp.flux_joint, make_m13,
                    lambda a: a[:4], COVERAGE_VARIANTS, norm=True, launches=True))
    # M14 HunyuanVideo dual-stream attention: (B, text tokens, image tokens, heads, D)
    B, TXT, IMG, H, D = (1, 3, 13, 2, 16) if quick else (1, 256, 18104, 24, 128)

    def make_m14(device, B=B, TXT=TXT, IMG=IMG, H=H, D=D):
        return (_randn(B, H, IMG, D, device=device), _randn(B, H, IMG, D, device=device),
                _randn(B, H, TXT, D, device=device), _randn(B, H, TXT, D, device=device),
                *(_weight(D, device) for _ in range(4)), *sp.flux_tables(IMG, D, device))

    rows.append(Row("coverage", "M14 hunyuan joined write", f"{B}x{H}x({IMG}+{TXT})x{D}", sp.hunyuan_joined,
                    make_m14, lambda a: a[:4], COVERAGE_VARIANTS, norm=True, launches=True))
    return rows


ROW_GROUPS = {"norm": norm_rows, "flux": flux_rows, "vllm": vllm_rows, "backward": backward_rows,
              "coverage": coverage_rows}


def _time(rec: dict, v: str, call: Callable, device: str, cudagraph: bool, launches: bool) -> None:
    rec["ms"][v] = bench_ms(call, device)
    if cudagraph and device == "cuda":
        try:
            rec["graph_ms"][v] = graph_ms(call, device)
        except Exception as e:  # a call that cannot be captured is reported
            rec["errors"][f"{v}@graph"] = f"{type(e).__name__}: {e}"[:500]
    if launches:
        rec["launches"][v] = count_launches(call, device)


def _variant(row: Row, v: str, shared: dict) -> tuple[Callable, Any]:
    backend, dyn = ROW_VARIANTS[v]
    if not dyn:
        return compiled(row.fn, backend)
    key = (row.form or row.name, v)
    if key not in shared:  # one compiled function per form, reused for every token count
        dyn_arg = dyn == "all"
        # each compile has a code object of its own (`own_code`), so a plain static compile and a plain dynamic
        # one never share cache entries (equal backends would: one would run the other's graph)
        shared[key] = compiled(row.fn, backend, dynamic=dyn_arg)
    return shared[key]


def run_row(row: Row, device: str, variants: list[str], cudagraph: bool, shared: dict) -> dict:
    rec: dict = {"group": row.group, "name": row.name, "shape": row.shape, "ms": {}, "graph_ms": {}, "err": {},
                 "pass": {}, "launches": {}, "first_call_s": {}, "errors": {}}
    try:
        torch.manual_seed(0)
        args = row.make(device)
        if row.backward:
            _run_backward(row, rec, args, device, variants)
        else:
            with torch.no_grad():
                _run_forward(row, rec, args, device, variants, cudagraph, shared)
    except Exception as e:  # the row is reported, the run goes on
        rec["errors"]["row"] = f"{type(e).__name__}: {e}"[:500]
        traceback.print_exc(limit=4)
    for key, per in (("x_floor", "ms"), ("x_floor_graph", "graph_ms")):
        floor = rec[per].get("floor")
        rec[key] = {v: (ms / floor if floor else None) for v, ms in rec[per].items()}
    if row.norm:
        rec["norm_folded"] = {v: (s["norms_folded"] == s["sites"] > 0) for v, s in rec["pass"].items()}
    return rec


def _run_forward(row: Row, rec: dict, args: tuple, device: str, variants: list[str], cudagraph: bool,
                 shared: dict) -> None:
    def clones(ts: tuple) -> tuple:
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in ts)

    # a function that writes into its arguments is checked on clones of them as made (timed calls write into
    # `args` again and again)
    made = clones(args) if row.mutates else args

    def fresh() -> tuple:
        return clones(made) if row.mutates else args

    want = row.fn(*fresh())
    floor_ts = row.floor(args)
    _time(rec, "floor", lambda: tuple(t.clone() for t in floor_ts), device, cudagraph, row.launches)
    for v in variants:
        try:
            backend, dyn = ROW_VARIANTS[v]
            if (backend == "triton" and device != "cuda") or (dyn and not row.dyn):
                continue
            fn, p = _variant(row, v, shared)
            vargs = args
            if dyn == "mark":  # vLLM marks the token dim dynamic (on aliases: not the static rows')
                vargs = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                for i in row.dyn:
                    torch._dynamo.maybe_mark_dynamic(vargs[i], 0)
            call = (lambda fn=fn, a=vargs: fn(*a))
            t0 = time.perf_counter()
            got = call() if not row.mutates else fn(*fresh())
            rec["first_call_s"][v] = round(time.perf_counter() - t0, 2)
            rec["err"][v] = max_err(got, want)
            if p is not None:
                rec["pass"][v] = pass_summary(p)
            _time(rec, v, call, device, cudagraph, row.launches)
        except Exception as e:  # a variant that fails is reported, never fatal
            rec["errors"][v] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc(limit=4)


def _rotary_us(times: dict) -> tuple[float, float]:
    sel = [v for n, v in times.items() if "rotary" in n.lower()]
    return sum(c for c, _ in sel), sum(us for _, us in sel)


def _run_backward(row: Row, rec: dict, args: tuple, device: str, variants: list[str]) -> None:
    """Forward and forward+backward timed; the backward's kernels are those of a step less those of a forward
    (the profiler's GPU time per call); its rotary kernels (named *rotary*) against the copy floor's kernels."""
    q, k, rest = args[0], args[1], args[2:]
    out = row.fn(q, k, *rest)
    grads = tuple(torch.randn_like(o) for o in out)
    torch.autograd.backward(out, grads)
    want, want_grads = tuple(o.detach() for o in out), (q.grad, k.grad)
    floor_ts = (q.detach(), k.detach())
    floor = (lambda: tuple(t.clone() for t in floor_ts))
    rec["ms"]["floor"] = bench_ms(floor, device)
    floor_us = sum(us for _, us in kernel_times(floor, device=device).values())
    rec["floor_us"] = floor_us
    rec["bwd"] = {}
    for v in variants:
        try:
            backend, _ = ROW_VARIANTS[v]
            if backend == "triton" and device != "cuda":
                continue
            fn, p = compiled(row.fn, backend)

            def fwd(fn=fn):
                return fn(q, k, *rest)

            def step(fwd=fwd):
                q.grad = k.grad = None
                torch.autograd.backward(fwd(), grads)

            t0 = time.perf_counter()
            step()
            rec["first_call_s"][v] = round(time.perf_counter() - t0, 2)
            rec["err"][v] = max_err(fwd(), want)
            rec["err"][f"{v}:grad"] = max_err((q.grad, k.grad), want_grads)
            if p is not None:
                rec["pass"][v] = pass_summary(p)
            rec["ms"][f"{v}:fwd"] = bench_ms(fwd, device)
            rec["ms"][f"{v}:fwd+bwd"] = bench_ms(step, device)
            kf, ks = kernel_times(fwd, device=device), kernel_times(step, device=device)
            f_us, s_us = sum(us for _, us in kf.values()), sum(us for _, us in ks.values())
            (rf_n, rf_us), (rs_n, rs_us) = _rotary_us(kf), _rotary_us(ks)
            bwd_names = sorted((n for n in ks if ks[n][1] - kf.get(n, (0, 0.0))[1] > 0),
                               key=lambda n: -(ks[n][1] - kf.get(n, (0, 0.0))[1]))
            rec["bwd"][v] = {"fwd_us": f_us, "bwd_us": s_us - f_us, "bwd_x_floor": (s_us - f_us) / floor_us
                             if floor_us else None, "bwd_rotary_launches": rs_n - rf_n,
                             "bwd_rotary_us": rs_us - rf_us, "fwd_rotary_us": rf_us,
                             "bwd_rotary_x_floor": (rs_us - rf_us) / floor_us if floor_us and rs_n > rf_n else None,
                             "bwd_kernels": [n[:80] for n in bwd_names[:4]]}
        except Exception as e:  # a variant that fails is reported, never fatal
            rec["errors"][v] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc(limit=4)
        finally:
            q.grad = k.grad = None
    floor_ms = rec["ms"]["floor"]
    rec["x_floor_step"] = {v: ms / floor_ms for v, ms in rec["ms"].items()}


def run_group(group: str, args: argparse.Namespace, device: str, result: dict, t_start: float) -> None:
    """One of the row groups: every row (filtered by --rows), its variants, the JSON rewritten after each."""
    shared: dict = {}  # the -dyn compiled functions of each form
    mine = []
    for row in ROW_GROUPS[group](device == "cpu"):
        label = f"{row.name} {row.shape} {row.form}"
        if args.rows and not any(s in label for s in args.rows):
            continue
        variants = [v for v in (args.row_variants or row.variants) if v in ROW_VARIANTS]
        rec = run_row(row, device, variants, not args.no_cudagraph, shared)
        result["records"].append(rec)
        mine.append(rec)
        write_json(args.out, result, quiet=True)
        timed = {} if device_check.is_smoke(device) else rec.get("x_floor_step", rec["x_floor"])
        print(f"[{time.perf_counter() - t_start:6.1f}s] {group} {row.name} {row.shape}: " + (", ".join(
            f"{v} {x:.2f}x" for v, x in timed.items() if x) or "ran " + ", ".join(rec["ms"]))
            + ("  graph: " + ", ".join(f"{v} {x:.2f}x" for v, x in rec["x_floor_graph"].items() if x)
               if rec["x_floor_graph"] and timed else "")
            + (f"  ERRORS {rec['errors']}" if rec["errors"] else ""), flush=True)
    if mine:
        print_rows(group, mine, device_check.is_smoke(device))


def print_rows(group: str, recs: list[dict], smoke: bool = False) -> None:
    """The group's tables; a smoke run's without its times (benchmarks/device_check.py)."""
    if group == "backward" and smoke:
        print_table("backward: gradient errors and what the pass did", [
            [r["shape"], r["name"], v, r["err"].get(f"{v}:grad"), short_summary(r["pass"].get(v))]
            for r in recs for v in r.get("bwd", {})], ["shape", "row", "variant", "grad err", "pass"])
        return
    if group == "backward":
        rows = []
        for r in recs:
            for v, b in r.get("bwd", {}).items():
                rows.append([r["shape"], r["name"], v, r["x_floor_step"].get(f"{v}:fwd"),
                             r["x_floor_step"].get(f"{v}:fwd+bwd"), b["bwd_us"], b["bwd_x_floor"],
                             b["bwd_rotary_launches"], b["bwd_rotary_us"], b["bwd_rotary_x_floor"], r.get("floor_us"),
                             r["err"].get(f"{v}:grad"), short_summary(r["pass"].get(v))])
        print_table("backward: fwd and fwd+bwd (do_bench, x the floor of a clone of q and k); from the profiler: "
                    "the backward's kernels, its rotary kernels, us per step and x the floor's kernels", rows,
                    ["shape", "row", "variant", "fwd x", "fwd+bwd x", "bwd us", "bwd x", "rot launches",
                     "bwd rot us", "bwd rot x", "floor us", "grad err", "pass"])
        return
    cols = [v for v in ROW_VARIANTS if any(v in r["ms"] for r in recs)]
    header = ["shape", "row", "floor ms"] + cols
    if not smoke:
        print_table(f"{group}: x copy floor, do_bench (L2 flushed)", [[r["shape"], r["name"], r["ms"].get("floor")]
                    + [r["x_floor"].get(v) for v in cols] for r in recs], header)
    if any(r["graph_ms"] for r in recs) and not smoke:
        print_table(f"{group}: x copy floor, CUDA-graph replay", [[r["shape"], r["name"], r["graph_ms"].get("floor")]
                    + [r["x_floor_graph"].get(v) for v in cols] for r in recs], header)
    if any(n is not None for r in recs for n in r["launches"].values()):
        print_table(f"{group}: kernel launches per call", [[r["shape"], r["name"], r["launches"].get("floor")]
                    + [r["launches"].get(v) for v in cols] for r in recs], header)
    print_table(f"{group}: max abs error against eager", [[r["shape"], r["name"], None]
                + [r["err"].get(v) for v in cols] for r in recs], header)
    pcols = [v for v in cols if v.startswith("pass")]
    print_table(f"{group}: what the pass did", [[r["shape"], r["name"]] + [short_summary(r["pass"].get(v))
                for v in pcols] for r in recs], ["shape", "row"] + pcols)
    for r in recs:
        for v, s in r["pass"].items():
            notes = s["miss_reasons"] + s["errors"] + s["fallbacks"]
            notes += [f"norm {n}" for n in s["norms"] if not n.endswith("folded")]
            for note in notes:
                print(f"  {r['shape']} {r['name']} {v}: {note}")
        for v, e in r["errors"].items():
            print(f"  ERROR {r['shape']} {r['name']} {v}: {e[:300]}")


# (shape, spelling, choices per option): the tile choices measured by --sweep. Besides the table's shapes, the
# head counts of the benchmarked models: Wan 1.3B (12 heads) and Qwen-Image (24 heads, 4096 image tokens).
SWEEP_SHAPES = {**SHAPES, "1x32760x12x128": (1, 32760, 12, 12, 128), "1x4096x24x128": (1, 4096, 24, 24, 128),
                "1x16384x16x80": (1, 16384, 16, 16, 80)}
_TILES = {"block_h": (None, 4, 8, 16, 32), "num_warps": (None, 1, 2, 4)}
_NEOX = {"block_h": (None, 16), "num_warps": (None, 1, 2, 4), "neox_row": (False, True)}
# with a norm, also the rule for holding a side's rows in registers (`held`) against the head loop (False)
_NORM_TILES = {"block_h": (None, 4, 8, 16), "num_warps": (None, 1, 2), "held": (None, False)}
_NORM_NEOX = {"block_h": (None, 4, 8, 16), "num_warps": (None, 1, 2), "held": (None, False), "neox_row": (None, True)}
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
    # QK-norm prologues (a 4th element: the norm), at the norm rows' shapes
    ("1x16384x16x80", "I1", _NORM_TILES, "rms"),
    ("1x16384x16x80", "N1", _NORM_NEOX, "rms"),
    ("1x16384x16x80", "flux", _NORM_TILES, "rms"),
    ("1x32760x12x128", "flux", _NORM_TILES, "rms"),
    ("1x32760x12x128", "N1", _NORM_NEOX, "rms"),
    ("1x32760x12x128", "I1", _NORM_TILES, "rms_across_heads"),
    ("1x32760x40x128", "I1", _NORM_TILES, "rms_across_heads"),
]


def sweep(device: str, cases: list = SWEEP_CASES) -> list[dict]:
    """Triton tile choices (heads per step, warps, NeoX form) of the kernel alone, on the tables the pass
    feeds it, timed through a CUDA graph so that host-side cost does not hide the kernel's own time."""
    import itertools

    import triton.testing

    from rope_fusion.kernels import triton_rotary as tr
    from rope_fusion.kernels.triton_plan import default_neox_row
    from rope_fusion.ops.schema import RotaryParams

    out = []
    for sname, code, choices, *norm in cases:
        norm = norm[0] if norm else "none"
        B, S, HQ, HK, D = SWEEP_SHAPES[sname]
        q = torch.randn(B, S, HQ, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(B, S, HK, D, device=device, dtype=torch.bfloat16)
        floor = triton.testing.do_bench_cudagraph(lambda q=q, k=k: (q.clone(), k.clone()), rep=50)
        if code == "flux":  # diffusers' full-width fp32 [S, D] tables, broadcast over heads as the pass feeds them
            c, s_ = sp.flux_tables(S, D, device)
            cos, sin, kw = c[None, :, None, :], s_[None, :, None, :], dict(interleaved=True, full_tables=True)
        else:
            spelling = SPELLINGS[code]
            cos, sin, kw = spelling.fused(*spelling.make_tables(B, S, D, torch.device(device)))
        rd = cos.shape[-1] * (1 if kw["full_tables"] else 2)
        names = list(choices)
        res = []
        for values in itertools.product(*(choices[n] for n in names)):
            opt = dict(zip(names, values))

            params = RotaryParams(rotary_dim=rd, conjugate=False, out_dtype=q.dtype, norm=norm, **kw)
            ws = [None, None] if norm == "none" else \
                [_weight(D, device) if norm == "rms" else _weight(h * D, device).view(h, D) for h in (HQ, HK)]

            def call(opt=opt, q=q, k=k, cos=cos, sin=sin, params=params, ws=ws):
                return tr.launch([q, k], cos, sin, params, None, ws, **opt)
            try:
                call()
                ms = triton.testing.do_bench_cudagraph(call, rep=50)
            except Exception as e:  # a tile too large for the registers, say
                print(f"  sweep {sname} {code} {opt}: {type(e).__name__}")
                continue
            res.append({"shape": sname, "spelling": code, "norm": norm, **opt, "ms": ms, "x_floor": ms / floor})
        out += res
        best = sorted(res, key=lambda o: o["x_floor"])[:4]
        form = default_neox_row(kw["interleaved"], rd, D)
        default = [o for o in res if all(o.get(n) is None for n in ("block_h", "num_warps", "held"))
                   and o.get("neox_row") in (None, form)]
        print(f"sweep {sname} {code} norm={norm}: default "
              + ", ".join(f"{o['x_floor']:.3f}x" for o in default) + "; best "
              + ", ".join(" ".join(f"{n}={o[n]}" for n in names) + f" {o['x_floor']:.3f}x" for o in best), flush=True)
    return out




def _split(values: list[str] | None) -> list[str] | None:
    """`a,b c` -> [a, b, c]: lists are accepted comma- or space-separated."""
    return [x for v in values for x in v.split(",") if x] if values else values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--out", help="write the results as JSON here (rewritten after every row)")
    ap.add_argument("--groups", nargs="*", default=list(GROUPS), help=f"row groups, of {GROUPS}")
    ap.add_argument("--rows", nargs="*", help="only rows of the non-spelling groups whose name, shape or form "
                                              "contains one of these strings")
    ap.add_argument("--row-variants", nargs="*", help=f"variants of those rows (default per group), of "
                                                      f"{list(ROW_VARIANTS)}")
    ap.add_argument("--no-cudagraph", action="store_true", help="skip the CUDA-graph replay timings")
    ap.add_argument("--shapes", nargs="*", help="spellings group: subset of shape names")
    ap.add_argument("--spellings", nargs="*", help="spellings group: subset of catalogue codes "
                                                   "(I1 I2 I3 N1 N3 C2 C1)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), help=f"spellings group: subset of {VARIANTS}")
    ap.add_argument("--sweep", action="store_true", help="also sweep Triton tile choices (GPU)")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (GPU)")
    ap.add_argument("--sweep-cases", nargs="*", help="subset of the sweep, as shape:spelling[:norm]")
    args = ap.parse_args(argv)
    for name in ("groups", "rows", "row_variants", "shapes", "spellings", "variants", "sweep_cases"):
        setattr(args, name, _split(getattr(args, name)))
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        ap.error(f"unknown groups {unknown}, of {GROUPS}")

    if not args.quick and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.kernels", "python -m benchmarks.kernels --quick")
    device = "cpu" if args.quick else "cuda"
    raise_recompile_limits()
    no_graph_caches()  # a cache hit skips the pass, and its report (Triton's kernel cache stays on)
    print("environment:", json.dumps(environment()), "device:", device, flush=True)

    t_start = time.perf_counter()
    print(f"warm-up {warm_up(device):.1f} s", flush=True)
    result: dict = {"environment": environment(), "device": device, "dtype": "torch.bfloat16",
                    "argv": sys.argv[1:] if argv is None else argv, "records": []}
    device_check.announce(device, result)
    if (args.sweep or args.sweep_only) and device == "cuda":
        cases = [c for c in SWEEP_CASES if not args.sweep_cases
                 or f"{c[0]}:{c[1]}" in args.sweep_cases or ":".join([c[0], c[1], *c[3:]]) in args.sweep_cases]
        result["sweep"] = sweep(device, cases)
        write_json(args.out, result)
        if args.sweep_only:
            return 0
    for group in [g for g in GROUPS if g in args.groups]:
        try:
            if group == "spellings":
                run_spellings(args, device, result, t_start)
            else:
                run_group(group, args, device, result, t_start)
        except Exception as e:  # never fatal: the other groups still run
            traceback.print_exc()
            result.setdefault("group_errors", {})[group] = f"{type(e).__name__}: {e}"
        torch._dynamo.reset()
    errors = [(r.get("spelling") or r["name"], r["shape"], v, e) for r in result["records"]
              for v, e in r["errors"].items()]
    for name, shape, v, e in errors:
        print(f"  ERROR {shape} {name} {v}: {e[:200]}")
    result["seconds"] = time.perf_counter() - t_start
    print(f"\nkernels: {len(result['records'])} rows, {len(errors)} errors, {result['seconds']:.0f} s", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
