"""The drop-ins side by side with what model code calls today, on the GPU (on the CPU a plumbing smoke test that
measures nothing).

Sections (`--sections`):
- qk: `compat.vllm_omni.fused_qk_norm_rope` against vllm-omni's own `fused_qk_norm_rope` (its Triton kernels,
  launched as it launches them, from `--kernel-file`), its eager chain (`_eager_qk_norm_rope`: what its token gate
  keeps below the crossover) and `rope_fusion.rms_norm_rope_qk` on the same table's views, at MiniMax-H3 (24/24
  heads x 128, rotary 96, half-split), Boogu-Image (24/24 x 128, interleaved; Flux's single-stream blocks have
  this geometry) and GQA (32/8 x 128, rotary 64, interleaved), 64 to 32768 tokens, bf16, an fp32 table.
- joint: `fused_joint_qkv_norm_rope` at Flux's double-stream blocks (512 text + 4096 image tokens, 24 x 128, q, k,
  v views of each stream's chunked QKV) against vllm-omni's joint op (`--joint-kernel-file`, its dual-stream PRs'
  file) and that file's eager chain; `before` is the drop-in as it was (v by torch.cat), and the parts alone:
  q and k's launch, v by torch.cat, v by the join kernel.
- vision: `compat.vllm_vision.ApplyRotaryEmb` on the Qwen2.5-VL tower's q/k view (32768 and 49152 tokens x 16 x 80)
  against vLLM's path, the view made contiguous and then rotated by flash-attn's kernel (`--rotary-file`, vLLM's
  CUDA path) or by the torch form (vLLM's `forward_native`); bf16 tables, as the tower computes them. `before`:
  the view rotated as one tensor (the drop-in as it was); `apart_contiguous`: q and k contiguous, apart.
- serving: `compat.vllm.rotary_embedding` in place (Llama-3-8B 32/8 x 128 at 64, 1024 and 8192 tokens; fp32 and
  bf16 caches; whole and partial rotary, 64 of 128) against the op out of place with positions, `before` (in
  place with every lane read and written, as it was) and the path before that (the op, then a copy into query
  and key); `floor_mul` and `floor_mul_in_place` are torch's own multiply by 1 out of place and in place, so the
  in-place call can be read against an in-place floor.

Per column: GPU us a call in CUDA-graph replay and as a multiple of the floor (the tensors read and written once:
clones); host us a call (back-to-back calls while a sleep kernel keeps the GPU busy); end-to-end us a call
(back-to-back calls, then a synchronize: what an eager caller waits for); launches a call; the largest error
against an fp64 evaluation of the contract, relative to the largest magnitude. The targets are checked at the end,
then each change against the drop-in before it (`comparisons`).

    python -m benchmarks.dropins --kernel-file .kernels/qk_norm_rope.py \\
        --joint-kernel-file .kernels/fused_qk_norm_rope.py --rotary-file .kernels/rotary.py --out $OUT/dropins.json
    python -m benchmarks.dropins --device cpu --quick ...        # CPU smoke test (tiny shapes, nothing measured)

Old against new in about two minutes (with benchmarks/norm_tiles.py, about a minute, for the planner's forms):

    python -m benchmarks.dropins --kernel-file .kernels/qk_norm_rope.py \
        --joint-kernel-file .kernels/fused_qk_norm_rope.py --rotary-file .kernels/rotary.py \
        --tokens 64 256 1024 4096 16384 --serving-tokens 1024 8192 --calls 100 --no-launches \
        --skip-columns omni_eager rms_norm_rope_qk copy_torch copied_in --out $OUT/dropins.json
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
from benchmarks import device_check  # noqa: E402
from benchmarks.eager_op import host_us  # noqa: E402
from benchmarks.kernels import count_launches, environment, graph_ms, print_table, write_json  # noqa: E402
from benchmarks.timing import sync  # noqa: E402
from benchmarks.upstream_files import load_flash_attn_rotary, load_omni_kernels  # noqa: E402
from rope_fusion.compat import vllm as compat_vllm  # noqa: E402
from rope_fusion.compat import vllm_omni, vllm_vision  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402

EPS = 1e-6
BF16 = torch.bfloat16
QK_GEOMETRIES = {  # name: (q heads, k heads, head_dim, rotary_dim, interleaved)
    "minimax-h3": (24, 24, 128, 96, False),
    "boogu": (24, 24, 128, 128, True),
    "gqa-r64": (32, 8, 128, 64, True),
}
QK_TOKENS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
VISION_TOKENS = (32768, 49152)
SERVING = {"tokens": (64, 1024, 8192), "caches": ("fp32", "bf16"), "rotary": (128, 64)}
Column = tuple  # (call or None, note)
NOT_THE_RESULT = ("floor", "v_")  # columns that compute something else than the row's result (floors, v alone)


def e2e_us(fn: Callable[[], Any], device: str, calls: int) -> float:
    """Wall us a call over back-to-back calls from an idle GPU, synchronized at the end."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return 1e6 * (time.perf_counter() - t0) / calls


def rel_error(got: Any, want: Any) -> float:
    if isinstance(want, torch.Tensor) and not isinstance(got, torch.Tensor):  # the rows of the result apart
        want = tuple(want.unbind(0))
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    return max(float((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-30)) for g, w in zip(got, want))


def measure(columns: dict[str, Column], reference: Any, device: str, calls: int, launches: bool) -> dict:
    """Every column of a row: its numbers, or why it has none; x_floor against the row's `floor` column."""
    out: dict = {}
    for name, (fn, note) in columns.items():
        entry: dict = {"note": note}
        out[name] = entry
        if fn is None:
            continue
        try:
            got = fn()
            entry["rel_err"] = None if name.startswith(NOT_THE_RESULT) or reference is None else \
                rel_error(got, reference)
            ms = graph_ms(fn, device)
            entry["graph_us"] = None if ms is None else 1e3 * ms
            entry["host_us"] = host_us(fn, device, calls)
            entry["e2e_us"] = e2e_us(fn, device, calls)
            entry["launches"] = count_launches(fn, device) if launches else None
        except Exception as e:  # one column failing leaves the others
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
    floor = out.get("floor", {}).get("graph_us")
    for entry in out.values():
        if floor and entry.get("graph_us"):
            entry["x_floor"] = entry["graph_us"] / floor
    return out


def host_profile(fn: Callable[[], Any], device: str, calls: int) -> str:
    """Where a column's host time goes: cProfile of back-to-back calls (the GPU kept busy, as `host_us` times)."""
    import cProfile
    import io
    import pstats

    for _ in range(3):
        fn()
    sync(device)
    if device == "cuda":
        torch.cuda._sleep(200_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync(device)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(16)
    return text.getvalue()


def packed_table(rows: int, rotary_dim: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    angles = torch.rand(rows, rotary_dim // 2, dtype=torch.float64) * 50
    return torch.cat((angles.cos(), angles.sin()), -1).to(device, dtype)


def qk_reference(q, k, qw, kw, table, rotary_dim, interleaved) -> tuple:
    cos, sin = table.double()[:, None].chunk(2, -1)
    return tuple(rotary_reference(x.double(), cos, sin, interleaved=interleaved, rotary_dim=rotary_dim,
                                  full_tables=False, norm="rms", norm_eps=EPS, norm_weight=w.double(),
                                  out_dtype=torch.float64) for x, w in ((q, qw), (k, kw)))


def qk_columns(geometry: tuple, tokens: int, device: str, omni: Any) -> tuple[dict, Any]:
    hq, hk, d, r, il = geometry
    q, k = (torch.randn(tokens, h, d, device=device, dtype=BF16) for h in (hq, hk))
    qw, kw = (torch.rand(d, device=device) + 0.5).to(BF16), (torch.rand(d, device=device) + 0.5).to(BF16)
    table = packed_table(tokens, r, device)
    h = r // 2
    cols: dict[str, Column] = {
        "floor": (lambda: (q.clone(), k.clone()), "q and k cloned"),
        "rope_fusion": (lambda: vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS, interleaved=il), ""),
        "rms_norm_rope_qk": (lambda: rope_fusion.rms_norm_rope_qk(q, k, qw, kw, EPS, table[:, None, :h],
                                                                   table[:, None, h:], interleaved=il, rotary_dim=r),
                             "the library's function, the table's views made per call"),
    }
    why = "no --kernel-file"
    cols["omni"] = (lambda: omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS, interleaved=il), "") if omni else \
        (None, why)
    cols["omni_eager"] = (lambda: omni._eager_qk_norm_rope(q, k, qw, kw, table, EPS, d, r, il),
                          "its eager chain (below its token gate)") if omni else (None, why)
    return cols, qk_reference(q, k, qw, kw, table, r, il)


def joint_columns(text: int, image: int, heads: int, d: int, device: str, joint: Any) -> tuple[dict, Any]:
    """Flux's double-stream block: each stream's q, k, v are views of its chunked QKV projection."""
    streams = []
    for s in (text, image):
        streams += list(torch.randn(1, s, 3, heads, d, device=device, dtype=BF16).unbind(2))
    weights = [(torch.rand(d, device=device) + 0.5).to(BF16) for _ in range(4)]
    table = packed_table(text + image, d, device)
    args = (*streams, *weights, table, EPS)
    joined = [torch.cat((streams[i], streams[i + 3]), 1).contiguous() for i in range(3)]
    qk_only, v_cat, v_join = joint_parts(streams, weights, table)
    cols: dict[str, Column] = {
        "floor": (lambda: tuple(t.clone() for t in joined), "q, k, v cloned at the joint size"),
        "rope_fusion": (lambda: vllm_omni.fused_joint_qkv_norm_rope(*args),
                        "q and k one launch, v one launch of the join kernel"),
        "before": (lambda: (*qk_only(), v_cat()), "q and k one launch, v by torch.cat (the drop-in before)"),
        "q_k_alone": (qk_only, "the cat op's launch alone"),
        "v_torch_cat": (v_cat, "torch.cat of the streams' v views alone"),
        "v_join_kernel": (v_join, "the join kernel alone"),
    }
    why = "no --joint-kernel-file"
    cols["omni"] = (lambda: joint.fused_joint_qkv_norm_rope(*args), "") if joint else (None, why)
    cols["omni_eager"] = (lambda: joint._eager_joint_qkv_norm_rope(*args, d, d, True), "norms, cats, RoPE") \
        if joint else (None, why)
    cos, sin = table.double().view(1, text + image, 1, d).chunk(2, -1)
    ref = []
    for i, (w0, w1) in enumerate(((weights[0], weights[2]), (weights[1], weights[3]))):
        pieces = [rotary_reference(x.double(), c, s, interleaved=True, rotary_dim=d, full_tables=False, norm="rms",
                                   norm_eps=EPS, norm_weight=w.double(), out_dtype=torch.float64)
                  for x, w, c, s in ((streams[i], w0, cos[:, :text], sin[:, :text]),
                                     (streams[i + 3], w1, cos[:, text:], sin[:, text:]))]
        ref.append(torch.cat(pieces, 1))
    ref.append(joined[2].double())
    return cols, tuple(ref)


def joint_parts(streams: list, weights: list, table: torch.Tensor) -> tuple[Callable, Callable, Callable]:
    """The joint call's parts: q and k through the cat op (one launch), v by torch.cat, v by the join kernel."""
    from rope_fusion.ops import joins

    q0, k0, v0, q1, k1, v1 = streams
    b, s0, s1, d = q0.shape[0], q0.shape[1], q1.shape[1], q0.shape[-1]
    cos, sin = table.view(b, s0 + s1, 1, 2, d // 2).unbind(-2)
    join = joins.plan_join(v0, v1, 1)

    def qk() -> tuple:
        return torch.ops.rope_fusion.rotary_qk_cat(
            q0, k0, cos, sin, None, weights[0], weights[1], second_pieces=[q1, k1],
            second_norm_weights=[weights[2], weights[3]], cat_dims=[1, 1], interleaved=True, rotary_dim=d,
            full_tables=False, conjugate=False, out_dtype=q0.dtype, norm="rms", norm_eps=EPS)
    return qk, lambda: torch.cat((v0, v1), 1), lambda: join(v0, v1)


def vision_columns(tokens: int, heads: int, d: int, device: str, rotary: Any) -> tuple[dict, Any]:
    """The tower's q/k: a `(two b) s h d` view of the qkv projection `[s, 1, 3 * h * d]` (b = 1)."""
    qkv = torch.randn(tokens, 1, 3 * heads * d, device=device, dtype=BF16)
    qk = qkv.view(tokens, 1, 3, heads, d).permute(2, 1, 0, 3, 4)[:2].reshape(2, tokens, heads, d)
    angles = torch.rand(tokens, d // 2, dtype=torch.float64, device=device) * 50
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)  # the tower's tables, in the model's dtype
    dense = qk.contiguous()
    module = vllm_vision.ApplyRotaryEmb(enforce_enable=True)
    fa = rotary is not None and device == "cuda"

    def torch_form() -> torch.Tensor:  # vLLM's forward_static (NeoX), on the contiguous copy
        x = qk.contiguous()
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    c1, s1 = cos[:, None], sin[:, None]
    cols: dict[str, Column] = {
        "floor": (lambda: dense.clone(), "q and k cloned"),
        "rope_fusion": (lambda: module(qk, cos, sin), "the view as it comes: q's and k's rows two tensors"),
        "before": (lambda: rope_fusion.apply_rotary(qk, c1, s1, rotary_dim=d, out_dtype=BF16),
                   "the view as one tensor (the drop-in before): every token of q, then of k"),
        "apart_contiguous": (lambda: rope_fusion.apply_rotary_qk(dense[0], dense[1], c1, s1, rotary_dim=d,
                                                                 out_dtype=BF16), "q and k contiguous, apart"),
        "copy_flash_attn": ((lambda: rotary.apply_rotary(qk.contiguous(), cos, sin)) if fa else None,
                            "contiguous, then flash-attn's kernel (vLLM's CUDA path)" if fa else
                            "no --rotary-file" if rotary is None else "a Triton kernel: CUDA only"),
        "copy_torch": (torch_form, "contiguous, then vLLM's torch form"),
    }
    ref = rotary_reference(qk.double(), cos.double()[:, None], sin.double()[:, None], interleaved=False,
                           rotary_dim=d, full_tables=False, out_dtype=torch.float64)
    return cols, ref


def serving_columns(tokens: int, cache_dtype: str, rotary_dim: int, device: str) -> tuple[dict, Any]:
    hq, hk, d, max_pos = 32, 8, 128, 8192
    q, k = (torch.randn(tokens, h * d, device=device, dtype=BF16) for h in (hq, hk))
    cache = packed_table(max_pos, rotary_dim, device, torch.float32 if cache_dtype == "fp32" else BF16)
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    qi, ki = q.clone(), k.clone()

    def in_place() -> tuple:
        compat_vllm.rotary_embedding(positions, qi, ki, d, cache, True)
        return qi, ki

    def op() -> tuple:
        cos, sin = cache.chunk(2, -1)
        qo, ko = rope_fusion.apply_rotary_qk(q.view(tokens, hq, d), k.view(tokens, hk, d), cos, sin,
                                             positions=positions[:, None], rotary_dim=rotary_dim)
        return qo.view(q.shape), ko.view(k.shape)

    def copied_in() -> tuple:
        qo, ko = op()
        qi.copy_(qo)
        ki.copy_(ko)
        return qi, ki
    moved = lanes_moved_in_place(q.clone(), k.clone(), cache, positions, rotary_dim, d)
    qf, kf = q.clone(), k.clone()
    cols: dict[str, Column] = {
        "floor": (lambda: (q.clone(), k.clone()), "q and k cloned"),
        "rope_fusion": (in_place, "in place, one launch, the rotated lanes only"),
        "op": (op, "the op out of place, positions gathered in the kernel"),
        "before": (moved, "in place, every lane read and written (the drop-in before)") if moved else
        (None, "no in-place kernel on this device"),
        "copied_in": (copied_in, "the path before that: the op, then two copies"),
        "floor_mul": (lambda: (torch.mul(q, 1.0), torch.mul(k, 1.0)), "torch's multiply out of place"),
        "floor_mul_in_place": (lambda: (qf.mul_(1.0), kf.mul_(1.0)), "torch's multiply in place"),
    }
    c, s = cache.double()[positions][:, None].chunk(2, -1)
    ref = tuple(rotary_reference(x.double().view(tokens, -1, d), c, s, interleaved=False, rotary_dim=rotary_dim,
                                 full_tables=False, out_dtype=torch.float64).view(x.shape) for x in (q, k))
    return cols, ref


def lanes_moved_in_place(query: torch.Tensor, key: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                         rotary_dim: int, d: int) -> Callable[[], tuple] | None:
    """The in-place launch as it was before it left the lanes outside the rotation alone: the in-place planner
    given the tensors themselves as outputs (it then writes every lane)."""
    from rope_fusion.ops import slice_write
    from rope_fusion.ops.optional_backends import load_backends
    from rope_fusion.ops.schema import RotaryCall, RotaryParams

    load_backends()
    t = positions.shape[0]
    xs = [query.view(t, -1, d), key.view(t, -1, d)]
    cos, sin = cache.chunk(2, dim=-1)
    params = RotaryParams(interleaved=False, rotary_dim=rotary_dim, full_tables=False, conjugate=False,
                          out_dtype=query.dtype)
    call = RotaryCall(xs, cos, sin, params, positions.view(t, 1))
    kernel = slice_write.IN_PLACE_KERNELS.get(query.device.type)
    runner = kernel.plan(call, xs) if kernel is not None and kernel.plan is not None else None
    if runner is None:
        return None

    def run() -> tuple:
        runner(xs, cos, sin, positions.view(t, 1), None, xs)
        return query, key
    return run


def section_rows(section: str, args: argparse.Namespace, upstream: dict) -> list[tuple[dict, Callable]]:
    """(the row's key fields, a builder of its columns and reference) for every row of a section."""
    quick, dev = args.quick, args.device
    if section == "qk":
        tokens = (8, 64) if quick else args.tokens
        return [({"geometry": g, "tokens": t}, lambda g=g, t=t: qk_columns(QK_GEOMETRIES[g], t, dev, upstream["omni"]))
                for g in args.geometries for t in tokens]
    if section == "joint":
        text, image, heads = (4, 8, 2) if quick else (512, 4096, 24)
        return [({"text": text, "image": image, "heads": heads},
                 lambda: joint_columns(text, image, heads, 128, dev, upstream["joint"]))]
    if section == "vision":
        return [({"tokens": t, "heads": 16, "head_dim": 80}, lambda t=t: vision_columns(t, 16, 80, dev,
                                                                                         upstream["rotary"]))
                for t in ((16,) if quick else VISION_TOKENS)]
    rows = []
    for t in (8,) if quick else args.serving_tokens:
        for c in SERVING["caches"]:
            for r in SERVING["rotary"]:
                rows.append(({"tokens": t, "cache": c, "rotary_dim": r},
                             lambda t=t, c=c, r=r: serving_columns(t, c, r, dev)))
    return rows


def print_rows(section: str, recs: list[dict], device: str) -> None:
    note = "" if device == "cuda" else " (CPU smoke test: nothing here is a measurement)"
    for rec in recs:
        key = ", ".join(f"{k} {v}" for k, v in rec.items() if k not in ("section", "columns"))
        rows = [[name, e.get("graph_us"), e.get("x_floor"), e.get("host_us"), e.get("e2e_us"), e.get("launches"),
                 e.get("rel_err"), e.get("error") or e.get("note") or ""] for name, e in rec["columns"].items()]
        print_table(f"{section}: {key}{note}", rows,
                    ["column", "graph us", "x floor", "host us", "e2e us", "launches", "rel err", "note"])


def _val(rec: dict, column: str, field: str) -> float | None:
    return rec["columns"].get(column, {}).get(field)


def targets(records: list[dict]) -> list[str]:
    """The issue's targets, each as met, missed or not measured, with the rows that decide it."""
    lines = []
    qk = [r for r in records if r["section"] == "qk"]

    def check(name: str, rows: list, ok: Callable[[dict], bool | None]) -> None:
        verdicts = [(r, ok(r)) for r in rows]
        known = [(r, v) for r, v in verdicts if v is not None]
        missed = [f"{r.get('geometry', '')} {r.get('tokens', '')}".strip() for r, v in known if not v]
        state = "not measured" if not known else "MET" if not missed else "MISSED at " + "; ".join(missed)
        lines.append(f"{name}: {state} ({len(known)} rows)")

    def le(a: float | None, b: float | None, factor: float = 1.0) -> bool | None:
        return None if a is None or b is None else a <= factor * b
    check("fused_qk_norm_rope GPU time <= vllm-omni's", qk,
          lambda r: le(_val(r, "rope_fusion", "graph_us"), _val(r, "omni", "graph_us")))
    check("fused_qk_norm_rope <= 1.05x the floor at >= 4096 tokens", [r for r in qk if r["tokens"] >= 4096],
          lambda r: le(_val(r, "rope_fusion", "x_floor"), 1.05))
    check("fused_qk_norm_rope host time <= 25 us a call", qk, lambda r: le(_val(r, "rope_fusion", "host_us"), 25.0))
    check("fused_qk_norm_rope end to end faster than vllm-omni's eager chain", qk,
          lambda r: le(_val(r, "rope_fusion", "e2e_us"), _val(r, "omni_eager", "e2e_us")))
    check("fused_qk_norm_rope end to end faster than vllm-omni's op", qk,
          lambda r: le(_val(r, "rope_fusion", "e2e_us"), _val(r, "omni", "e2e_us")))
    vision = [r for r in records if r["section"] == "vision"]
    check("vision drop-in <= 1.06x the floor at 32768 x 16 x 80", [r for r in vision if r["tokens"] == 32768],
          lambda r: le(_val(r, "rope_fusion", "x_floor"), 1.06))
    check("vision drop-in <= half of copy-then-rotate (flash-attn)", vision,
          lambda r: le(_val(r, "rope_fusion", "graph_us"), _val(r, "copy_flash_attn", "graph_us"), 0.5))
    serving = [r for r in records if r["section"] == "serving"]
    check("rotary_embedding in place <= the op out of place (GPU time, 2% spread)", serving,
          lambda r: le(_val(r, "rope_fusion", "graph_us"), _val(r, "op", "graph_us"), 1.02))
    joint = [r for r in records if r["section"] == "joint"]
    check("fused_joint_qkv_norm_rope GPU time <= vllm-omni's", joint,
          lambda r: le(_val(r, "rope_fusion", "graph_us"), _val(r, "omni", "graph_us")))
    return lines


def comparisons(records: list[dict]) -> list[str]:
    """Each change against the drop-in before it (GPU time now / before), and the in-place floor: torch's own
    multiply in place against out of place, the part of an in-place call's time that is the memory's, not the
    kernel's."""
    lines = []
    for section, now, before in (("joint", "rope_fusion", "before"), ("vision", "rope_fusion", "before"),
                                 ("serving", "rope_fusion", "before"), ("serving", "floor_mul_in_place", "floor_mul"),
                                 ("serving", "rope_fusion", "op")):
        for r in (r for r in records if r["section"] == section):
            a, b = _val(r, now, "graph_us"), _val(r, before, "graph_us")
            key = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("section", "columns", "host_profile"))
            if a and b:
                lines.append(f"{section} {key}: {now} / {before} = {a / b:.3f} ({a:.1f} / {b:.1f} us)")
    return lines


def load_upstream(args: argparse.Namespace) -> dict:
    out = {"omni": None, "joint": None, "rotary": None}
    for key, path, loader in (("omni", args.kernel_file, load_omni_kernels),
                              ("joint", args.joint_kernel_file, load_omni_kernels),
                              ("rotary", args.rotary_file, load_flash_attn_rotary)):
        if path:
            out[key] = loader(path)
            print(f"{key}: {path}", flush=True)
    if out["joint"] is not None and not hasattr(out["joint"], "fused_joint_qkv_norm_rope"):
        print(f"{args.joint_kernel_file} has no fused_joint_qkv_norm_rope: the joint section's vllm-omni columns "
              "are left out", flush=True)
        out["joint"] = None
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the CPU smoke test)")
    ap.add_argument("--sections", nargs="+", default=["qk", "joint", "vision", "serving"],
                    choices=["qk", "joint", "vision", "serving"])
    ap.add_argument("--geometries", nargs="+", default=list(QK_GEOMETRIES), choices=list(QK_GEOMETRIES))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(QK_TOKENS), help="the qk section's token counts")
    ap.add_argument("--serving-tokens", nargs="+", type=int, default=list(SERVING["tokens"]),
                    help="the serving section's token counts")
    ap.add_argument("--kernel-file", help="vllm-omni's qk_norm_rope.py (vllm_omni/diffusion/layers/ops/rope/)")
    ap.add_argument("--joint-kernel-file", help="vllm-omni's dual-stream PRs' fused_qk_norm_rope.py")
    ap.add_argument("--rotary-file", help="flash-attn's Triton rotary.py (vLLM's copy)")
    ap.add_argument("--calls", type=int, default=200, help="calls of the host and end-to-end timings")
    ap.add_argument("--no-launches", action="store_true", help="skip counting each column's launches")
    ap.add_argument("--skip-columns", nargs="+", default=[], help="columns left out (the floor is always kept)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile rope_fusion's calls in the qk section")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.quick and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.dropins", "python -m benchmarks.dropins --quick")
    device_check.announce(args.device)
    torch.manual_seed(0)
    upstream = load_upstream(args)
    calls = 10 if args.quick else args.calls
    result: dict = {"env": environment(), "device": args.device, "records": []}
    for section in args.sections:
        for key, build in section_rows(section, args, upstream):
            columns, reference = build()
            columns = {n: c for n, c in columns.items() if n == "floor" or n not in args.skip_columns}
            rec = {"section": section, **key,
                   "columns": measure(columns, reference, args.device, calls, not args.no_launches)}
            if args.host_profile and section == "qk" and columns["rope_fusion"][0] is not None:
                rec["host_profile"] = host_profile(columns["rope_fusion"][0], args.device, calls)
                print(rec["host_profile"])
            result["records"].append(rec)
            write_json(args.out, result, quiet=True)  # partial results survive a time limit
            print_rows(section, [rec], args.device)
    result["targets"] = targets(result["records"]) if args.device == "cuda" else ["not measured on the CPU"]
    result["comparisons"] = comparisons(result["records"])
    print("\nTargets")
    for line in result["targets"]:
        print("  " + line)
    print("\nAgainst the drop-ins before (GPU time in CUDA-graph replay)")
    for line in result["comparisons"]:
        print("  " + line)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
