"""The warps of whole-row launches without a norm (kernels/triton_plan.py `wide_row_warps`): the planner's rule
against one warp (the rule before it) and each other count, q and k launched directly, replayed in a CUDA graph,
as multiples of the copy floor (a clone of q and of k), with the eager `apply_rotary_qk` (the rule's launch, host
time included, triton's do_bench) beside it.

Rows: [B, S, H, D] bf16 q and k with one table entry per pair, [S, D/2] bf16 (flash-attn's and Flux's layout),
interleaved and NeoX, at the sweep's head counts: 4608 x 24/24 x 128 (Flux), 32760 x 40/40 x 128 (Wan 14B),
32760 x 12/12 x 128 (Wan 1.3B), 8192 x 32/8 x 128 (GQA), 2 x 16384 x 16/16 x 80 (padded rows). The rule is right
where its row ("rule") is the lowest, or within the spread between calls (about 1%) of the lowest.

    python -m benchmarks.row_warps --out $OUT/row_warps.json          # GPU, about a minute
    python -m benchmarks.row_warps --quick                             # CPU smoke test: the plans, no timings
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks.kernels import bench_ms, environment, graph_ms, print_table, write_json  # noqa: E402

SHAPES = {"1x4608x24/24x128": (1, 4608, 24, 24, 128), "1x32760x40/40x128": (1, 32760, 40, 40, 128),
          "1x32760x12/12x128": (1, 32760, 12, 12, 128), "1x8192x32/8x128": (1, 8192, 32, 8, 128),
          "2x16384x16/16x80": (2, 16384, 16, 16, 80)}
WARPS = (None, 1, 2, 4, 8)  # None: the planner's rule


def _case(shape: tuple, interleaved: bool, device: str) -> tuple:
    from rope_fusion.ops.schema import RotaryParams

    b, s, hq, hk, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, s, hq, d, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hk, d, device=device, dtype=torch.bfloat16, generator=g)
    ang = torch.rand(s, d // 2, device=device, generator=g) * 6
    cos, sin = (t.to(torch.bfloat16)[:, None] for t in (ang.cos(), ang.sin()))  # [S, 1, D/2] against [B, S, H, D]
    params = RotaryParams(interleaved=interleaved, rotary_dim=d, full_tables=False, conjugate=False,
                          out_dtype=torch.bfloat16)
    return q, k, cos, sin, params


def rule_warps(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, params: Any) -> int:
    from rope_fusion.kernels import triton_plan as planner

    [(_, _, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, sin, None, [None, None]), params)
    return meta["num_warps"]


def run_row(name: str, shape: tuple, interleaved: bool, device: str) -> dict:
    import rope_fusion
    from rope_fusion.kernels import triton_rotary as tr

    q, k, cos, sin, params = _case(shape, interleaved, device)
    rec: dict = {"shape": name, "form": "interleaved" if interleaved else "neox",
                 "rule_warps": rule_warps(q, k, cos, sin, params), "x_floor": {}, "errors": {}}
    if device != "cuda":
        return rec
    floor = graph_ms(lambda: (q.clone(), k.clone()), device)
    for w in WARPS:
        label = "rule" if w is None else f"{w} warp{'s' if w > 1 else ''}"
        try:
            ms = graph_ms(lambda w=w: tr.launch([q, k], cos, sin, params, None, [None, None], num_warps=w), device)
            rec["x_floor"][label] = ms / floor
        except Exception as e:  # a count the registers do not allow, say
            rec["errors"][label] = f"{type(e).__name__}: {e}"[:200]
    rec["eager_apply_rotary_qk_ms"] = bench_ms(lambda: rope_fusion.apply_rotary_qk(
        q, k, cos, sin, interleaved=interleaved), device)
    rec["floor_ms"] = floor
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU: the rule's warps per row, nothing timed")
    ap.add_argument("--out", help="write the records as JSON here")
    args = ap.parse_args(argv)
    device = "cpu" if args.quick else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.row_warps times the kernel on a GPU and there is no CUDA device here: --quick prints the "
              "rule's warps on the CPU", file=sys.stderr)
        return 2
    records = [run_row(name, shape, il, device) for name, shape in SHAPES.items() for il in (True, False)]
    labels = ["rule"] + [f"{w} warp{'s' if w > 1 else ''}" for w in WARPS if w is not None]
    rows = [[r["shape"], r["form"], r["rule_warps"], *(f"{r['x_floor'][v]:.4f}" if v in r["x_floor"] else "-"
                                                        for v in labels),
             f"{r['eager_apply_rotary_qk_ms'] / r['floor_ms']:.3f}" if r.get("floor_ms") else "-"] for r in records]
    print_table("whole rows without a norm, q and k launched directly (CUDA-graph replay, x the floor); eager "
                "apply_rotary_qk (do_bench, x the floor's graph time)", rows,
                ["shape", "form", "rule's warps", *labels, "eager op"])
    write_json(args.out, {"environment": environment(), "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
