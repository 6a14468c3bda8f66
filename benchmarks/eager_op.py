"""The fused op called eagerly from model code: `rope_fusion.apply_rotary_qk` against the rotary functions that
model code calls today, q and k at three sites.

Sites (bf16 x [1, T, H, D], tables of one entry per pair [T, D/2] in bf16, as flash-attn takes them; the other
functions get the same angles in their own layout):
- qwen_vit: 32768 tokens x 16 heads x 80, NeoX (the Qwen2.5-VL vision tower)
- flux: 4608 x 24 x 128, interleaved (Flux)
- llama: 8192 x 32 x 128, NeoX (Llama)

Columns, each where it runs (a note says why a column is empty):
- `floor`: a clone of q and of k, the copy floor (the same bytes read and written once);
- `rope_fusion`: `rope_fusion.apply_rotary_qk`, its eager path (the Triton kernel launched directly);
- `rope_fusion_op`: the same call through `torch.ops.rope_fusion.rotary_qk` (the dispatcher, as autograd sees it);
- `flash_attn`: flash-attn's `apply_rotary`, on q then on k (else vLLM's copy of that Triton kernel);
- `liger`: Liger's `LigerRopeFunction` (NeoX only; [B, H, S, D] views, full-width tables);
- `torch_ops`: the models' own eager spelling in torch ops: HF `rotate_half` with `cat(freqs, freqs)` tables
  for NeoX, the pairs unbound and stacked for interleaved;
- `diffusers`: diffusers' `apply_rotary_emb` with `(cos, sin)` full-width tables, on q then on k.

Per column: GPU ms per q+k call in CUDA-graph replay (no host time) and under triton's do_bench (host time
included: an eager caller's view), the graph figure as a multiple of the floor, host us per call (perf_counter
over back-to-back calls while a sleep kernel keeps the GPU busy, so the host never waits), and the largest
difference from rope_fusion's result.

    python -m benchmarks.eager_op --out $OUT/eager_op.json         # GPU
    python -m benchmarks.eager_op --device cpu --quick              # CPU smoke test (small shapes, host times)
    python -m benchmarks.eager_op --host-rounds 5 --sites flux llama  # host times, site after site, 5 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import rope_fusion  # noqa: E402
from benchmarks.kernels import bench_ms, environment, graph_ms, max_err, print_table, write_json  # noqa: E402
from benchmarks.timing import step_ms, sync  # noqa: E402

SITES = {  # name: (tokens, heads, head dim, interleaved, packed sequences: 0 none)
    "qwen_vit": (32768, 16, 80, False, 0),
    "flux": (4608, 24, 128, True, 0),
    "llama": (8192, 32, 128, False, 0),
    "qwen_vit_varlen": (32768, 16, 80, False, 8),  # the tower's batch of 8 images packed, [T, H, D], cu_seqlens
}
COLUMNS = ("floor", "rope_fusion", "rope_fusion_op", "flash_attn", "liger", "torch_ops", "diffusers")


HOST_REPEATS = 1  # --host-repeats: host timings per column, the median reported
ROTARY_FILE: str | None = None  # --rotary-file: a copy of flash-attn's rotary.py (it needs only triton)


def _flash_attn_rotary() -> tuple[Callable | None, str]:
    """flash-attn's Triton `apply_rotary`, else vLLM's copy of it, else the file given by --rotary-file; (None,
    why) when none imports."""
    if ROTARY_FILE:
        import importlib.util

        spec = importlib.util.spec_from_file_location("flash_attn_rotary", ROTARY_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.apply_rotary, f"apply_rotary of {os.path.basename(ROTARY_FILE)} (flash-attn's Triton kernel)"
    try:
        from flash_attn.ops.triton.rotary import apply_rotary

        return apply_rotary, "flash_attn.ops.triton.rotary.apply_rotary"
    except ImportError:
        pass
    try:
        from vllm.vllm_flash_attn.ops.triton.rotary import apply_rotary

        return apply_rotary, "vllm.vllm_flash_attn.ops.triton.rotary.apply_rotary (vLLM's copy)"
    except ImportError:
        return None, "neither flash-attn nor vLLM's copy of its rotary kernel imports: column skipped"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def make_site(tokens: int, heads: int, head_dim: int, interleaved: bool, device: str, packed: int = 0) -> dict:
    """q, k [1, T, H, D] and the same angles in every function's table layout; with `packed`, that many sequences
    of T / packed tokens each: q, k [T, H, D], `cu_seqlens`, and tables of one sequence's rows."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, tokens, heads, head_dim, generator=g).to(device, torch.bfloat16)
    k = torch.randn(1, tokens, heads, head_dim, generator=g).to(device, torch.bfloat16)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(tokens).float(), inv).to(device)  # [T, D/2]
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    if interleaved:
        cos_full, sin_full = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    else:
        cos_full, sin_full = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    site = dict(q=q, k=k, cos=cos, sin=sin, cos_full=cos_full, sin_full=sin_full, interleaved=interleaved,
                cu_seqlens=None)
    if packed:
        n = tokens // packed
        site.update(q=q[0], k=k[0], cos=cos[:n], sin=sin[:n], max_seqlen=n,
                    positions=torch.arange(tokens, device=device) % n,
                    cu_seqlens=torch.arange(0, tokens + 1, n, device=device, dtype=torch.int32))
    return site


def variants(site: dict, device: str) -> dict[str, tuple[Callable[[], Any] | None, str]]:
    """column -> (call, note): the call returns (q_out, k_out) [1, T, H, D]; None with the reason it is missing."""
    q, k, cos, sin, il = site["q"], site["k"], site["cos"], site["sin"], site["interleaved"]
    out: dict[str, tuple[Callable[[], Any] | None, str]] = {}
    out["floor"] = (lambda: (q.clone(), k.clone()), "")
    cu = site["cu_seqlens"]
    if cu is not None:
        return _packed_variants(site, device, out)
    c3, s3 = cos[:, None], sin[:, None]  # [T, 1, D/2] against [1, T, H]
    out["rope_fusion"] = (lambda: rope_fusion.apply_rotary_qk(q, k, c3, s3, interleaved=il), "")
    kw = dict(interleaved=il, rotary_dim=q.shape[-1], full_tables=False, conjugate=False, out_dtype=q.dtype)
    op = torch.ops.rope_fusion.rotary_qk.default
    out["rope_fusion_op"] = (lambda: op(q, k, c3, s3, **kw), "")

    fa, why = _flash_attn_rotary()
    if fa is None or device != "cuda":
        out["flash_attn"] = (None, why if fa is None else "a Triton kernel: CUDA only")
    else:
        out["flash_attn"] = (lambda: (fa(q, cos, sin, interleaved=il), fa(k, cos, sin, interleaved=il)), why)

    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError as e:
        LigerRopeFunction, why = None, f"liger_kernel does not import ({type(e).__name__}): column skipped"
    if LigerRopeFunction is None or il or device != "cuda":
        out["liger"] = (None, why if LigerRopeFunction is None else "NeoX only" if il else "CUDA only")
    else:
        cl, sl = site["cos_full"][None], site["sin_full"][None]  # [1, T, D]

        def liger():
            qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cl, sl)
            return qo.transpose(1, 2), ko.transpose(1, 2)
        out["liger"] = (liger, "")

    cf, sf = site["cos_full"][:, None], site["sin_full"][:, None]  # [T, 1, D]
    rot = _rotate_pairs if il else _rotate_half
    out["torch_ops"] = (lambda: (q * cf + rot(q) * sf, k * cf + rot(k) * sf),
                        "the pairs unbound and stacked" if il else "HF rotate_half")

    try:
        from diffusers.models.embeddings import apply_rotary_emb
    except Exception as e:  # missing, or broken by a version mismatch
        out["diffusers"] = (None, f"diffusers does not import ({type(e).__name__}): column skipped")
    else:
        freqs = (site["cos_full"], site["sin_full"])
        unbind = -1 if il else -2

        def diffusers():
            return (apply_rotary_emb(q, freqs, use_real_unbind_dim=unbind, sequence_dim=1),
                    apply_rotary_emb(k, freqs, use_real_unbind_dim=unbind, sequence_dim=1))
        out["diffusers"] = (diffusers, "")
    return out


def _packed_variants(site: dict, device: str, out: dict) -> dict:
    """The columns that take packed sequences: rope_fusion (cu_seqlens), the op with the positions they derive,
    flash-attn's varlen call on q then k, and the torch spelling of a gather by those positions."""
    q, k, cos, sin, il, cu = site["q"], site["k"], site["cos"], site["sin"], site["interleaved"], site["cu_seqlens"]
    out["rope_fusion"] = (lambda: rope_fusion.apply_rotary_qk(q, k, cos, sin, interleaved=il, cu_seqlens=cu), "")
    out["rope_fusion_op"] = (None, "the op takes cu_seqlens through the same planner: see rope_fusion")
    fa, why = _flash_attn_rotary()
    if fa is None or device != "cuda":
        out["flash_attn"] = (None, why if fa is None else "a Triton kernel: CUDA only")
    else:
        n = site["max_seqlen"]
        out["flash_attn"] = (lambda: (fa(q, cos, sin, interleaved=il, cu_seqlens=cu, max_seqlen=n),
                                      fa(k, cos, sin, interleaved=il, cu_seqlens=cu, max_seqlen=n)), why)
    out["liger"] = (None, "no packed sequences")
    pos = site["positions"]
    width = cos.shape[-1] * 2
    rot = _rotate_pairs if il else _rotate_half

    def torch_ops():
        c, s = cos[pos], sin[pos]
        cf = (c.repeat_interleave(2, -1) if il else torch.cat((c, c), -1))[:, None, :width]
        sf = (s.repeat_interleave(2, -1) if il else torch.cat((s, s), -1))[:, None, :width]
        return q * cf + rot(q) * sf, k * cf + rot(k) * sf
    out["torch_ops"] = (torch_ops, "tables gathered by the positions cu_seqlens gives")
    out["diffusers"] = (None, "no packed sequences")
    return out


def host_us(fn: Callable[[], Any], device: str, calls: int, rounds: int = 5) -> float:
    """Host microseconds per call: the median over `rounds` rounds of the mean of back-to-back calls (`calls` in
    all), so that one pause of the host (a collection, another process) moves one round, not the figure: a single
    mean over every call put 3 of 9 rows of an H100 host's drop-in table 25-60% over the others, one of them over
    its own end-to-end time a call. On the GPU a sleep kernel queued first keeps it busy throughout, so no call
    waits for it (what an eager model's host sees when it runs ahead)."""
    for _ in range(3):
        fn()
    sync(device)
    if device == "cuda":
        torch.cuda._sleep(200_000_000)  # about 0.1 s at 2 GHz: longer than the calls' host time
    per = max(1, calls // rounds)
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        means.append((time.perf_counter() - t0) / per)
    sync(device)
    return 1e6 * statistics.median(means)


def host_profile(shape: tuple, device: str, calls: int) -> dict:
    """Where an eager call's host time goes: the call, its two output allocations, its plan's launches alone and
    the launcher they use, each timed as `host_us` times the call; then the call under cProfile."""
    import cProfile
    import io
    import pstats

    from rope_fusion.ops.plan_cache import plan_cache

    site = make_site(*shape[:4], device=device, packed=shape[4])
    call = variants(site, device)["rope_fusion"][0]
    call()
    q, k = site["q"], site["k"]
    parts = {"call": host_us(call, device, calls),
             "two torch.empty": host_us(lambda: (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                                  torch.empty(k.shape, dtype=k.dtype, device=k.device)),
                                        device, calls)}
    nq, nk = q.numel(), k.numel()
    parts["one torch.empty, two views"] = host_us(
        lambda: (lambda b: (b[:nq].view(q.shape), b[nq:].view(k.shape)))(
            torch.empty(nq + nk, dtype=q.dtype, device=q.device)), device, calls)
    cf = torch.contiguous_format
    parts["two empty_like"] = host_us(
        lambda: (torch.empty_like(q, memory_format=cf), torch.empty_like(k, memory_format=cf)), device, calls)
    plans = list(plan_cache("rotary.direct").values())
    plan = plans[-1] if plans else None
    runner = getattr(plan, "run", None)
    entries = getattr(runner, "entries", None)
    if entries:
        parts["launchers"] = [getattr(e[4], "__qualname__", repr(e[4])) for e in entries]
        cos, sin = site["cos"][:, None], site["sin"][:, None]
        if site["cu_seqlens"] is None:
            parts["plan.run (allocations + launches)"] = host_us(lambda: runner((q, k), cos, sin, None, None),
                                                                 device, calls)
    if device == "cuda":
        parts["current stream"] = host_us(lambda: torch._C._cuda_getCurrentRawStream(0), device, calls)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    sync(device)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    parts["cprofile"] = text.getvalue()
    for name, value in parts.items():
        print(f"  host {name}: {value if isinstance(value, (str, list)) else f'{value:.1f} us'}")
    return parts


def host_rounds(names: list[str], quick: bool, device: str, calls: int, rounds: int) -> dict:
    """Host us per call of rope_fusion and of the floor, site after site, `rounds` times over: one site's figure
    that stays high in every round is that call's cost, one round high at every site is the host's noise (a
    column's repeats, back to back, cannot tell the two apart)."""
    built = {}
    for name in names:
        tokens, heads, dim, il, packed = SITES[name]
        shape = (max(16 * max(packed, 1), tokens // 256) if quick else tokens, heads, dim, il, packed)
        site = make_site(*shape[:4], device=device, packed=shape[4])
        fns = variants(site, device)
        built[name] = {c: fns[c][0] for c in ("rope_fusion", "floor")}
    out: dict = {name: {c: [] for c in fns} for name, fns in built.items()}
    for _ in range(rounds):
        for name, fns in built.items():
            for column, fn in fns.items():
                out[name][column].append(host_us(fn, device, calls))
    for name, cols in out.items():
        print(f"host rounds {name}: " + "; ".join(
            f"{c} median {statistics.median(v):.1f} us [{min(v):.1f}, {max(v):.1f}] "
            f"({', '.join(f'{x:.1f}' for x in v)})" for c, v in cols.items()))
    return out


def run_site(name: str, shape: tuple, device: str, calls: int) -> dict:
    site = make_site(*shape[:4], device=device, packed=shape[4])
    calls_by_column = variants(site, device)
    want = calls_by_column["rope_fusion"][0]()
    rec: dict = {"site": name, "tokens": shape[0], "heads": shape[1], "head_dim": shape[2],
                 "interleaved": shape[3], "packed": shape[4], "columns": {}}
    for column in COLUMNS:
        fn, note = calls_by_column[column]
        entry: dict = {"note": note}
        rec["columns"][column] = entry
        if fn is None:
            continue
        try:
            got = fn()
            entry["max_err"] = None if column == "floor" else max_err(got, want)
            entry["graph_ms"] = graph_ms(fn, device)
            entry["bench_ms"] = bench_ms(fn, device) if device == "cuda" else step_ms(fn, device, 5, 1)
            runs = [host_us(fn, device, calls) for _ in range(HOST_REPEATS)]
            entry["host_us"] = statistics.median(runs)
            entry["host_us_runs"] = runs
        except Exception as e:  # one column failing leaves the others
            entry["error"] = f"{type(e).__name__}: {e}"
    floor = rec["columns"]["floor"].get("graph_ms")
    for entry in rec["columns"].values():
        if floor and entry.get("graph_ms"):
            entry["x_floor"] = entry["graph_ms"] / floor
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes (tokens / 256) and 20 host-timed calls")
    ap.add_argument("--sites", nargs="*", default=list(SITES), choices=list(SITES))
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls of the host timing")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--rotary-file", help="flash-attn's rotary.py to load when neither flash-attn nor vLLM imports")
    ap.add_argument("--host-repeats", type=int, default=1,
                    help="time each column's host time this many times (each --calls calls) and report the median")
    ap.add_argument("--host-profile", action="store_true",
                    help="also where rope_fusion's host time goes: its parts timed alone, and a cProfile")
    ap.add_argument("--host-rounds", type=int, default=0,
                    help="then time the host of rope_fusion and the floor at every site, round after round, this "
                         "many rounds (a slow site in every round is the site's; in one round, the host's)")
    args = ap.parse_args()
    global ROTARY_FILE, HOST_REPEATS
    ROTARY_FILE, HOST_REPEATS = args.rotary_file, args.host_repeats
    calls = 20 if args.quick else args.calls
    result: dict = {"env": environment(), "device": args.device, "calls": calls, "sites": []}
    cpu_note = "" if args.device == "cuda" else "; on the CPU rope_fusion runs the reference: a smoke test, not timings"
    for name in args.sites:
        tokens, heads, dim, il, packed = SITES[name]
        shape = (max(16 * max(packed, 1), tokens // 256) if args.quick else tokens, heads, dim, il, packed)
        rec = run_site(name, shape, args.device, calls)
        result["sites"].append(rec)
        rows = []
        for column, e in rec["columns"].items():
            rows.append([column, e.get("graph_ms"), e.get("x_floor"), e.get("bench_ms"), e.get("host_us"),
                         e.get("max_err"), e.get("error") or e.get("note") or ""])
        packing = f", {packed} sequences packed" if packed else ""
        print_table(f"{name}: {shape[0]} tokens x {heads} heads x {dim}, {'interleaved' if il else 'NeoX'}"
                    f"{packing} ({args.device}; ms per q+k call{cpu_note})", rows,
                    ["column", "graph ms", "x floor", "do_bench ms", "host us", "max err", "note"])
        if args.host_profile:
            rec["host_profile"] = host_profile(shape, args.device, calls)
            write_json(args.out, result)
    if args.host_rounds:
        result["host_rounds"] = host_rounds(args.sites, args.quick, args.device, calls, args.host_rounds)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
