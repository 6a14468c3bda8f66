"""RoPE and the paged KV-cache write: `rope_fusion.apply_rotary_qk_kv_cache` (one launch) against the unfused pairs.

Rows: T = 1, 8, 64, 256, 2048, 8192 tokens (decode batches to prefill), MHA 32/32 and GQA 32/8 heads of 128, bf16
q, k, v and positions into vLLM's cos|sin cache (NeoX), an NHD cache of 16-slot blocks in bf16 or FP8 (e4m3, per-
tensor scales), each token written to a distinct slot drawn at random from twice the blocks it needs.

Columns:
- `fused`: `rope_fusion.apply_rotary_qk_kv_cache` eagerly (the Triton kernel's KV_CACHE form, one launch);
- `rf+write`: `rope_fusion.apply_rotary_qk` (the same kernel without the cache) then the cache write: vLLM's own
  Triton `triton_reshape_and_cache_flash` where vLLM imports, else an `index_put` of the rows (the note says which);
- `native+put`: vLLM's pure-torch `RotaryEmbedding.forward_native` (the layer itself where vLLM imports, else its
  math spelled here) then an `index_put` of k and v into the cache rows (FP8: divided by the scale, saturated and
  converted first).

Per column: GPU us per call replayed in a CUDA graph (no host time: how vLLM runs decode), and the pair's time over
the fused one; for `fused`, its bytes over the time (GB/s) and the host us of one eager call (back-to-back calls
while a sleep kernel keeps the GPU busy). Targets (the issue's): T=1, 32/32 x 128, bf16: fused at most 7 us, and at
least 1.5x faster than each pair at T <= 64.

    python -m benchmarks.kv_cache --out $OUT/kv_cache.json     # H200
    python -m benchmarks.kv_cache --device cpu --quick          # CPU: a plumbing smoke test, it measures nothing

On the CPU every column runs (the op's reference, small shapes) and the results are compared, but no time is
measured: the GPU's launches and bytes are what the rows are about.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import rope_fusion  # noqa: E402
from benchmarks import device_check  # noqa: E402
from benchmarks.eager_op import host_us  # noqa: E402
from benchmarks.kernels import environment, graph_ms, max_err, print_table, write_json  # noqa: E402

TOKENS = (1, 8, 64, 256, 2048, 8192)
HEADS = {"mha 32/32": (32, 32), "gqa 32/8": (32, 8)}
HEAD_DIM, BLOCK_SIZE, MAX_POS = 128, 16, 16384
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
COLUMNS = ("fused", "rf+write", "native+put")
TARGET_US, TARGET_RATIO, TARGET_TOKENS = 7.0, 1.5, 64


def vllm_cache(max_pos: int, dim: int, device: str) -> torch.Tensor:
    """vLLM's cos|sin cache [max_pos, dim] (base 10000), bf16 as its layer keeps it for a bf16 model."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), -1).to(device, torch.bfloat16)


def make_row(tokens: int, hq: int, hk: int, cache: str, device: str) -> dict:
    g = torch.Generator().manual_seed(tokens * 131 + hk)
    bf16 = torch.bfloat16
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, generator=g).to(device, bf16) for h in (hq, hk, hk))
    blocks = max(8, 2 * -(-tokens // BLOCK_SIZE))
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=g)[:tokens].to(device)
    cdt = CACHE_DTYPES[cache]
    caches = [torch.zeros(blocks, BLOCK_SIZE, hk, HEAD_DIM, dtype=cdt, device=device) for _ in range(2)]
    scales = (torch.tensor([0.05], device=device), torch.tensor([0.04], device=device)) if cache == "fp8" else None
    return dict(q=q, k=k, v=v, positions=torch.randint(0, MAX_POS, (tokens,), generator=g).to(device),
                cos_sin=vllm_cache(MAX_POS, HEAD_DIM, device), slots=slots, caches=caches, scales=scales)


def _vllm_layer(device: str) -> tuple[Any, str]:
    """vLLM's RotaryEmbedding for the rows (forward_native), or None and why."""
    try:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
    except Exception as e:  # vLLM or its dependencies missing
        return None, f"vLLM does not import ({type(e).__name__}): forward_native's math spelled here"
    cfg = VllmConfig(device_config=DeviceConfig(device=device))
    cfg.model_config = types.SimpleNamespace(max_model_len=MAX_POS)
    with set_current_vllm_config(cfg):
        layer = get_rope(HEAD_DIM, max_position=MAX_POS, is_neox_style=True, dtype=torch.bfloat16)
    return layer.to(device), "vLLM's RotaryEmbedding.forward_native"


def _native(layer: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple:
    """forward_native: the layer's where vLLM imports, else its arithmetic (NeoX halves in the model dtype)."""
    if layer is not None:
        T = q.shape[0]
        qo, ko = layer.forward_native(positions, q.view(T, -1), k.view(T, -1))
        return qo.view(q.shape), ko.view(k.shape)
    cos, sin = cos_sin.index_select(0, positions).to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotate(q), rotate(k)


def _put(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None) -> None:
    """An index_put of rows into the cache's slots (FP8: x / scale saturated at 448, then converted)."""
    if scale is not None:
        rows = (rows.float() / scale).clamp(-448.0, 448.0).to(cache.dtype)
    cache.view(-1, *cache.shape[2:])[slots] = rows


def _vllm_write() -> tuple[Callable | None, str]:
    try:
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
    except Exception as e:  # vLLM or its dependencies missing
        return None, f"vLLM's triton_reshape_and_cache_flash does not import ({type(e).__name__}): an index_put"
    return triton_reshape_and_cache_flash, "vLLM's triton_reshape_and_cache_flash"


def columns(row: dict, device: str) -> dict[str, tuple[Callable[[], Any], str]]:
    """Each column's call on the row (writing its own caches) and a note; the call returns (q, k cache, v cache)."""
    q, k, v, pos, cos_sin, slots = (row[n] for n in ("q", "k", "v", "positions", "cos_sin", "slots"))
    cos, sin = cos_sin.chunk(2, dim=-1)
    scales = row["scales"] or (None, None)
    own = {c: [t.clone() for t in row["caches"]] for c in COLUMNS}
    kw = dict(k_scale=scales[0], v_scale=scales[1]) if row["scales"] else {}

    def fused():
        kc, vc = own["fused"]
        out = rope_fusion.apply_rotary_qk_kv_cache(q, k, v, cos, sin, kc, vc, slots, positions=pos, **kw)
        return out, kc, vc

    write, write_note = _vllm_write() if device == "cuda" else (None, "index_put (CPU)")
    kv_dtype = "fp8" if row["scales"] else "auto"
    one = torch.ones(1, device=q.device)
    write_scales = scales if row["scales"] else (one, one)

    def rf_write():
        kc, vc = own["rf+write"]
        qo, ko = rope_fusion.apply_rotary_qk(q, k, cos, sin, positions=pos[:, None])
        if write is not None:
            write(ko, v, kc, vc, slots, kv_dtype, *write_scales)
        else:
            _put(kc, ko, slots, scales[0])
            _put(vc, v, slots, scales[1])
        return qo, kc, vc

    if write is not None:
        try:  # vLLM's kernel checks the device's FP8 support and its platform when called
            rf_write()
        except Exception as e:
            write, write_note = None, f"vLLM's triton_reshape_and_cache_flash failed ({type(e).__name__}: {e}): " \
                                      "an index_put"

    layer, native_note = _vllm_layer(device)

    def native_put():
        kc, vc = own["native+put"]
        qo, ko = _native(layer, pos, q, k, cos_sin)
        _put(kc, ko, slots, scales[0])
        _put(vc, v, slots, scales[1])
        return qo, kc, vc
    return {"fused": (fused, "one launch"), "rf+write": (rf_write, f"apply_rotary_qk, then {write_note}"),
            "native+put": (native_put, f"{native_note}, then an index_put")}


def row_bytes(row: dict) -> int:
    """What the fused call must move: q read and written, k and v read, their cache rows written, positions, slots
    and the tables' rows read."""
    q, k, v = row["q"], row["k"], row["v"]
    cache_item = row["caches"][0].element_size()
    T = q.shape[0]
    return (2 * q.numel() * q.element_size() + (k.numel() + v.numel()) * (k.element_size() + cache_item)
            + T * (8 + 8 + HEAD_DIM * row["cos_sin"].element_size()))


def run_row(tokens: int, heads: str, cache: str, device: str, calls: int) -> dict:
    hq, hk = HEADS[heads]
    row = make_row(tokens, hq, hk, cache, device)
    rec: dict = {"tokens": tokens, "heads": heads, "cache": cache, "columns": {}}
    fns = columns(row, device)
    results = {}
    for name, (fn, note) in fns.items():
        entry: dict = {"note": note}
        rec["columns"][name] = entry
        try:
            results[name] = fn()
            entry["graph_us"] = None if device != "cuda" else 1e3 * graph_ms(fn, device)
        except Exception as e:  # one column failing leaves the others
            entry["error"] = f"{type(e).__name__}: {e}"
    want = results.get("fused")
    for name, got in results.items():
        if name != "fused" and want is not None:
            rec["columns"][name]["max_err_vs_fused"] = [max_err(g.float(), w.float()) for g, w in zip(got, want)]
    fused = rec["columns"]["fused"]
    if fused.get("graph_us"):
        fused["GB/s"] = row_bytes(row) / fused["graph_us"] / 1e3
        fused["host_us"] = host_us(fns["fused"][0], device, calls)
        for name in COLUMNS[1:]:
            pair = rec["columns"][name].get("graph_us")
            if pair:
                rec["columns"][name]["x_fused"] = pair / fused["graph_us"]
    return rec


def targets(records: list[dict]) -> list[str]:
    """The issue's targets, met or missed, from the records (GPU only)."""
    lines = []
    for r in records:
        f = r["columns"]["fused"].get("graph_us")
        if f is None or r["heads"] != "mha 32/32" or r["cache"] != "bf16":
            continue
        if r["tokens"] == 1:
            lines.append(f"T=1 32/32x128 bf16: fused {f:.2f} us (target <= {TARGET_US}): "
                         f"{'met' if f <= TARGET_US else 'missed'}")
        if r["tokens"] <= TARGET_TOKENS:
            for name in COLUMNS[1:]:
                x = r["columns"][name].get("x_fused")
                if x is not None:
                    lines.append(f"T={r['tokens']} {name} / fused = {x:.2f}x (target >= {TARGET_RATIO}): "
                                 f"{'met' if x >= TARGET_RATIO else 'missed'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="T = 1, 8, 64 only")
    ap.add_argument("--caches", nargs="*", default=list(CACHE_DTYPES), choices=list(CACHE_DTYPES))
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls of the host timing")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    args = ap.parse_args(argv)
    device = args.device
    if not args.quick and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.kv_cache", "python -m benchmarks.kv_cache --quick")
    device_check.announce(device)
    tokens = TOKENS[:3] if args.quick or device != "cuda" else TOKENS
    result: dict = {"environment": environment(), "device": device, "records": []}
    for cache in args.caches:
        for heads in HEADS:
            for t in tokens:
                rec = run_row(t, heads, cache, device, args.calls)
                result["records"].append(rec)
                write_json(args.out, result, quiet=True)
    rows = []
    for r in result["records"]:
        cols = r["columns"]
        rows.append([r["cache"], r["heads"], r["tokens"], *(cols[c].get("graph_us") for c in COLUMNS),
                     *(cols[c].get("x_fused") for c in COLUMNS[1:]), cols["fused"].get("GB/s"),
                     cols["fused"].get("host_us"),
                     max((e for c in COLUMNS[1:] for e in cols[c].get("max_err_vs_fused", [])), default=None)])
    print_table("RoPE + KV-cache write: GPU us per call in CUDA-graph replay (host us: one eager fused call)", rows,
                ["cache", "heads", "T", *(f"{c} us" for c in COLUMNS), *(f"{c}/fused" for c in COLUMNS[1:]),
                 "fused GB/s", "host us", "max |diff|"])
    for c in COLUMNS:
        print(f"  {c}: {result['records'][0]['columns'][c]['note']}")
    errors = [(r["tokens"], r["heads"], r["cache"], c, e["error"]) for r in result["records"]
              for c, e in r["columns"].items() if "error" in e]
    for e in errors:
        print(f"  error {e}")
    result["targets"] = targets(result["records"])
    for line in result["targets"]:
        print("  target: " + line)
    write_json(args.out, result)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
