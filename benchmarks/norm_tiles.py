"""Tile choices of the Triton kernel under a per-head QK-norm at vllm-omni's geometries, the held tail among them.

Why the MiniMax-H3 geometry (head_dim 128, rotary_dim 96, half-split, a per-head norm) sat at 1.26-1.54x the copy
floor: its rows are rotated lanes [0, 96) and a pass-through tail [96, 128), which the kernel keeps in registers as
two 64-lane halves (48 used each) and a 32-lane tail, 160 register lanes a row. The planner's norm tile of 512
elements then holds 2 heads a step (3 would not be a power of two) and gives it one warp: 2 x 256 bytes of q in
flight per step, a quarter of what a warp has in flight at D=128 without the tail (4 heads of whole rows), and the
head loop waits on each step's loads (the D=80 rows had the same fault, design section 3.1, which holding the
token's rows fixed: 1.24 -> 1.06x). The planner holds rows only without a tail (`launch_args`: tail_pad == 0), so
this geometry always took the loop.

The kernel now holds a tail beside the rotated lanes (HELD with TAIL_PAD: every held launch the planner makes
compiles to the PTX it compiled to before, benchmarks/ptx_identity.py). `held_tail_launch` launches that form as
the planner would once its rule allows it: the planner's own plan and arguments (`plan_launch`, `launch_args` with
the tile given), then HELD set to the side's head blocks, one program per token. The sweep times it against the
head loop at the tiles the planner's tuning options reach, in CUDA-graph replay, as multiples of the floor (a
clone of q and k), and checks every variant against the default's result.

    python -m benchmarks.norm_tiles --out $OUT/tiles.json          # GPU
    python -m benchmarks.norm_tiles --device cpu --quick            # CPU: the interpreter runs the launches once
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks.kernels import environment, graph_ms, print_table, write_json  # noqa: E402
from rope_fusion.ops.schema import RotaryParams  # noqa: E402

# name: (q heads, k heads, head_dim, rotary_dim, interleaved): vllm-omni's three geometries (baselines.md)
GEOMETRIES = {
    "minimax-h3": (24, 24, 128, 96, False),
    "boogu": (24, 24, 128, 128, True),
    "gqa-r64": (32, 8, 128, 64, True),
}
TOKENS = (4096, 16384)
LOOP_TILES = ((None, None), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4))  # (block_h, num_warps); None: the planner's
HELD_TILES = ((2, 1), (4, 1), (4, 2), (8, 2), (8, 4))


def norm_params(rotary_dim: int, interleaved: bool, dtype: torch.dtype, eps: float = 1e-6) -> RotaryParams:
    return RotaryParams(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=False, conjugate=False,
                        out_dtype=dtype, norm="rms", norm_eps=eps)


def held_tail_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams,
                     weights: list, block_h: int, num_warps: int, stream: bool) -> Callable[[], list]:
    """q and k's rows held in registers, a pass-through tail included: the planner's plan and arguments for the
    given tile, then HELD = each side's head blocks and one program per token. A call returns (q_out, k_out)."""
    from rope_fusion.kernels import triton_launch
    from rope_fusion.kernels.triton_plan import Tables, launch_args, plan_launch

    outs = [torch.empty(x.shape, dtype=params.out_dtype, device=x.device) for x in (q, k)]
    tables = Tables(cos, sin, None, weights)
    plan = plan_launch([q, k], outs, tables)
    grid, scalars, meta = launch_args(plan, [q, k], outs, tables, [0, 1], params, block_h=block_h,
                                      num_warps=num_warps, stream=stream, nsplit=1, held=False)
    meta = dict(meta, HELD=max(-(-h // block_h) for h in plan.heads))

    def run() -> list:
        qo, ko = (torch.empty(x.shape, dtype=params.out_dtype, device=x.device) for x in (q, k))
        triton_launch.rotary_kernel[grid](q, k, k, qo, ko, ko, cos, sin, cos, weights[0], weights[1], weights[1],
                                          *scalars, **meta)
        return [qo, ko]
    return run


def make_inputs(geometry: tuple, tokens: int, device: str) -> tuple:
    hq, hk, d, r, _ = geometry
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, hq, d, generator=g).to(device, torch.bfloat16)
    k = torch.randn(tokens, hk, d, generator=g).to(device, torch.bfloat16)
    weights = [(torch.rand(d, generator=g) + 0.5).to(device, torch.bfloat16) for _ in range(2)]
    angles = torch.rand(tokens, r // 2, generator=g, dtype=torch.float64) * 20
    table = torch.cat((angles.cos(), angles.sin()), -1).float().to(device)
    cos, sin = table.view(tokens, 1, 2, r // 2).unbind(-2)
    return q, k, weights, cos, sin


def variants(geometry: tuple, q: torch.Tensor, k: torch.Tensor, weights: list, cos: torch.Tensor,
             sin: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """name -> call: the head loop at the planner's tuning options, and the held form (a tail where the geometry
    has one), each with and without streaming cache hints."""
    from rope_fusion.kernels import triton_launch

    _, _, d, r, il = geometry
    params = norm_params(r, il, q.dtype)
    out: dict[str, Callable[[], Any]] = {}
    for (bh, warps), stream in itertools.product(LOOP_TILES, (None, True, False)):
        if bh is None and stream is not None:
            continue
        name = "default" if bh is None else f"loop bh={bh} w={warps} stream={stream}"
        out[name] = (lambda bh=bh, warps=warps, stream=stream:
                     triton_launch.launch([q, k], cos, sin, params, None, weights, block_h=bh, num_warps=warps,
                                          stream=stream))
    for (bh, warps), stream in itertools.product(HELD_TILES, (True, False)):
        if r < d:
            out[f"held+tail bh={bh} w={warps} stream={stream}"] = held_tail_launch(q, k, cos, sin, params, weights,
                                                                                   bh, warps, stream)
        else:  # no tail: the planner's own held form, asked for by its tuning option
            out[f"held bh={bh} w={warps} stream={stream}"] = (
                lambda bh=bh, warps=warps, stream=stream: triton_launch.launch(
                    [q, k], cos, sin, params, None, weights, block_h=bh, num_warps=warps, stream=stream, held=True,
                    nsplit=1))
    return out


def run_geometry(name: str, tokens: int, device: str) -> dict:
    geometry = GEOMETRIES[name]
    q, k, weights, cos, sin = make_inputs(geometry, tokens, device)
    floor = graph_ms(lambda: (q.clone(), k.clone()), device)
    calls = variants(geometry, q, k, weights, cos, sin)
    want = calls["default"]()
    rec: dict = {"geometry": name, "tokens": tokens, "floor_ms": floor, "variants": {}}
    for vname, call in calls.items():
        entry: dict = {}
        try:
            got = call()
            entry["max_diff_vs_default"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
            ms = graph_ms(call, device)
            entry.update(ms=ms, x_floor=ms / floor if ms and floor else None)
        except Exception as e:  # a tile too large for the registers, say: the others go on
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        rec["variants"][vname] = entry
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="64 tokens (the CPU smoke test)")
    ap.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        _interpret_on_cpu()
    result: dict = {"env": environment(), "device": args.device, "records": []}
    for name in args.geometries:
        for tokens in ([8] if args.quick else args.tokens):
            rec = run_geometry(name, tokens, args.device)
            result["records"].append(rec)
            write_json(args.out, result, quiet=True)
            rows = [[v, e.get("x_floor"), e.get("ms"), e.get("max_diff_vs_default"), e.get("error", "")]
                    for v, e in sorted(rec["variants"].items(), key=lambda kv: kv[1].get("x_floor") or 9e9)]
            note = "" if args.device == "cuda" else " (CPU: interpreted once for plumbing, nothing is timed)"
            print_table(f"{name} {GEOMETRIES[name]} at {tokens} tokens{note}", rows,
                        ["variant", "x floor", "graph ms", "max diff vs default", "error"])
    write_json(args.out, result)
    return 0


def _interpret_on_cpu() -> None:
    """The kernel interpreted for CPU tensors (Triton's interpreter), so that the CPU smoke test runs each launch."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from rope_fusion.kernels import triton_kernel, triton_launch

    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
    from triton_interpreted import interpreted

    triton_launch.rotary_kernel = interpreted(triton_kernel.rotary_kernel)
    triton_launch.INTERPRETED = True
    if not isinstance(triton.language.sum, InterpretedFunction):
        triton.language.sum = InterpretedFunction(triton.language.sum.fn)


if __name__ == "__main__":
    sys.exit(main())
