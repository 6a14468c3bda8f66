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
"""

from __future__ import annotations

import argparse
import os
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

SITES = {  # name: (tokens, heads, head dim, interleaved)
    "qwen_vit": (32768, 16, 80, False),
    "flux": (4608, 24, 128, True),
    "llama": (8192, 32, 128, False),
}
COLUMNS = ("floor", "rope_fusion", "rope_fusion_op", "flash_attn", "liger", "torch_ops", "diffusers")


def _flash_attn_rotary() -> tuple[Callable | None, str]:
    """flash-attn's Triton `apply_rotary`, else vLLM's copy of it; (None, why) when neither imports."""
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


def make_site(tokens: int, heads: int, head_dim: int, interleaved: bool, device: str) -> dict:
    """q, k [1, T, H, D] and the same angles in every function's table layout."""
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
    return dict(q=q, k=k, cos=cos, sin=sin, cos_full=cos_full, sin_full=sin_full, interleaved=interleaved)


def variants(site: dict, device: str) -> dict[str, tuple[Callable[[], Any] | None, str]]:
    """column -> (call, note): the call returns (q_out, k_out) [1, T, H, D]; None with the reason it is missing."""
    q, k, cos, sin, il = site["q"], site["k"], site["cos"], site["sin"], site["interleaved"]
    c3, s3 = cos[:, None], sin[:, None]  # [T, 1, D/2] against [1, T, H]
    out: dict[str, tuple[Callable[[], Any] | None, str]] = {}
    out["floor"] = (lambda: (q.clone(), k.clone()), "")
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


def host_us(fn: Callable[[], Any], device: str, calls: int) -> float:
    """Host microseconds per call over `calls` back-to-back calls; on the GPU a sleep kernel queued first keeps
    it busy throughout, so no call waits for it (what an eager model's host sees when it runs ahead)."""
    for _ in range(3):
        fn()
    sync(device)
    if device == "cuda":
        torch.cuda._sleep(200_000_000)  # about 0.1 s at 2 GHz: longer than the calls' host time
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync(device)
    return 1e6 * elapsed / calls


def run_site(name: str, shape: tuple, device: str, calls: int) -> dict:
    site = make_site(*shape, device=device)
    calls_by_column = variants(site, device)
    want = calls_by_column["rope_fusion"][0]()
    rec: dict = {"site": name, "tokens": shape[0], "heads": shape[1], "head_dim": shape[2],
                 "interleaved": shape[3], "columns": {}}
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
            entry["host_us"] = host_us(fn, device, calls)
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
    args = ap.parse_args()
    calls = 20 if args.quick else args.calls
    result: dict = {"env": environment(), "device": args.device, "calls": calls, "sites": []}
    cpu_note = "" if args.device == "cuda" else "; on the CPU rope_fusion runs the reference: a smoke test, not timings"
    for name in args.sites:
        tokens, heads, dim, il = SITES[name]
        shape = (max(16, tokens // 256) if args.quick else tokens, heads, dim, il)
        rec = run_site(name, shape, args.device, calls)
        result["sites"].append(rec)
        rows = []
        for column, e in rec["columns"].items():
            rows.append([column, e.get("graph_ms"), e.get("x_floor"), e.get("bench_ms"), e.get("host_us"),
                         e.get("max_err"), e.get("error") or e.get("note") or ""])
        print_table(f"{name}: {shape[0]} tokens x {heads} heads x {dim}, {'interleaved' if il else 'NeoX'} "
                    f"({args.device}; ms per q+k call{cpu_note})", rows,
                    ["column", "graph ms", "x floor", "do_bench ms", "host us", "max err", "note"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
