"""The per-head QK-norm launches at vllm-omni's geometries: the planner's forms before and after, side by side.

Two planner choices changed at these geometries, and each is one line to switch back (kernels/triton_plan.py):
- `ROW_TAIL_UNDER_NORM`: MiniMax-H3's rows (head_dim 128, rotary_dim 96, half-split) were two 64-lane halves (48
  used each) and a 32-lane tail tile, 160 register lanes for 128, at 1.21-1.27x the copy floor from 4096 tokens
  on; neither holding the tail (HELD with TAIL_PAD) nor the loop's tiles got below 1.20x. The row-with-tail form
  (ROW_TAIL) loads each row whole, the tail in the halves' padding.
- `NORM_SPLIT_PROGRAMS`: a per-head norm's tile is 4 heads x 128 lanes with one warp, and from 1024 tokens on
  the launch ran one program per token (1024 warps at 1024 tokens); the rows of 256-2048 tokens were 1.1-2.4x
  the floor. Launches of fewer than 4096 tokens now spread a token's head blocks over the grid.

`--compare` (the default) times, per geometry and token count, in CUDA-graph replay as multiples of the floor (a
clone of q and k), and checks each variant's result against the planner's:
- `new`: the planner as it is;
- `old`: the planner before (the halves and the tail tile where the new form fits, `row_tail=False`; the split
  of the rule before, `nsplit` as MIN_PROGRAMS gives it);
- at MiniMax-H3 also `new form, old split` and `old form, new split`, which take the two changes apart, and the
  new form with two warps and with streaming cache hints (the rule gives it one warp and none).
The verdict lines at the end say, per change, whether its rows favour the new default: the figure that decides
`ROW_TAIL_UNDER_NORM` is MiniMax-H3's `new form, old split` against `old` at 4096 and 16384 tokens; the one that
decides `NORM_SPLIT_PROGRAMS` is `new` against `new form, old split` (MiniMax-H3) and `new` against `old` (the two
interleaved geometries) at 256-2048 tokens.

`--sweep` times the tiles the tuning options reach (the head loop's block_h/num_warps, each also at 1, 2, 4 and 8
programs a token and at one a head block, and the held form, a tail held beside the rotated lanes where the
geometry has one: `held_tail_launch`).

    python -m benchmarks.norm_tiles --out $OUT/tiles.json             # GPU: about a minute
    python -m benchmarks.norm_tiles --device cpu --quick              # CPU: the interpreter runs each launch once
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

from benchmarks import device_check  # noqa: E402
from benchmarks.kernels import environment, graph_ms, print_table, write_json  # noqa: E402
from rope_fusion.ops.schema import RotaryParams  # noqa: E402

# name: (q heads, k heads, head_dim, rotary_dim, interleaved): vllm-omni's three geometries (baselines.md)
GEOMETRIES = {
    "minimax-h3": (24, 24, 128, 96, False),
    "boogu": (24, 24, 128, 128, True),
    "gqa-r64": (32, 8, 128, 64, True),
}
TOKENS = (4096, 16384)  # the sweep's
COMPARE_TOKENS = (64, 256, 1024, 2048, 4096, 16384)
LOOP_TILES = ((None, None), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4))  # (block_h, num_warps); None: the planner's
HELD_TILES = ((2, 1), (4, 1), (4, 2), (8, 2), (8, 4))
SPLITS = (1, 2, 4, 8, 0)  # the sweep's programs a token for each loop tile (0: one program per head block)


def norm_params(rotary_dim: int, interleaved: bool, dtype: torch.dtype, eps: float = 1e-6) -> RotaryParams:
    return RotaryParams(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=False, conjugate=False,
                        out_dtype=dtype, norm="rms", norm_eps=eps)


def held_tail_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams,
                     weights: list, block_h: int, num_warps: int, stream: bool) -> Callable[[], list]:
    """q and k's rows held in registers, a pass-through tail included as a tile of its own (not in the halves'
    padding): the planner's plan and arguments for the given tile, then HELD = each side's head blocks and one
    program per token. A call returns (q_out, k_out)."""
    from rope_fusion.kernels import triton_launch
    from rope_fusion.kernels.triton_plan import Tables, launch_args, plan_launch

    outs = [torch.empty(x.shape, dtype=params.out_dtype, device=x.device) for x in (q, k)]
    tables = Tables(cos, sin, None, weights)
    plan = plan_launch([q, k], outs, tables)
    grid, scalars, meta = launch_args(plan, [q, k], outs, tables, [0, 1], params, block_h=block_h,
                                      num_warps=num_warps, stream=stream, nsplit=1, held=False, row_tail=False)
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


def old_nsplit(geometry: tuple, tokens: int, row_tail: bool) -> int:
    """The programs per token the rule before NORM_SPLIT_PROGRAMS gave a launch of this geometry (MIN_PROGRAMS
    for every launch), with the row form given."""
    from rope_fusion.kernels import triton_plan

    hq, hk, d, r, il = geometry
    half_pad, tail_pad, _ = triton_plan.row_lanes(norm_params(r, il, torch.bfloat16), d, row_tail)
    bh = triton_plan.block_heads([hq, hk], 2 * half_pad + tail_pad, triton_plan.NORM_TILE_ELEMENTS)
    blocks = -(-hq // bh) + -(-hk // bh)
    target = triton_plan.MIN_PROGRAMS
    return 1 if tokens >= target else max(1, min(blocks, -(-target // tokens)))


def split_blocks(geometry: tuple, block_h: int | None) -> int:
    """Head blocks of q and k together at this block (None: the planner's), the most programs a token can use."""
    from rope_fusion.kernels import triton_plan

    hq, hk, d, r, il = geometry
    half_pad, tail_pad, _ = triton_plan.row_lanes(norm_params(r, il, torch.bfloat16), d, None)
    bh = block_h or triton_plan.block_heads([hq, hk], 2 * half_pad + tail_pad, triton_plan.NORM_TILE_ELEMENTS)
    return -(-hq // bh) + -(-hk // bh)


def compare_variants(geometry: tuple, q: torch.Tensor, k: torch.Tensor, weights: list, cos: torch.Tensor,
                     sin: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """name -> call: the planner as it is (`new`), as it was (`old`), and at MiniMax-H3 each change alone."""
    from rope_fusion.kernels import triton_launch
    from rope_fusion.kernels.triton_plan import row_tail_fits

    _, _, d, r, il = geometry
    tokens = q.shape[0]
    params = norm_params(r, il, q.dtype)

    def call(**tiles: Any) -> Callable[[], Any]:
        return lambda: triton_launch.launch([q, k], cos, sin, params, None, weights, **tiles)
    out = {"new": call(), "old": call(row_tail=False, nsplit=old_nsplit(geometry, tokens, False))}
    if row_tail_fits(params, d):
        out["new form, old split"] = call(nsplit=old_nsplit(geometry, tokens, True))
        out["old form, new split"] = call(row_tail=False)
        out["new, 2 warps"] = call(num_warps=2)
        out["new, streaming hints"] = call(stream=True)
    return out


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
    for (bh, warps), nsplit in itertools.product(LOOP_TILES, SPLITS):
        blocks = split_blocks(geometry, bh)
        nsplit = blocks if nsplit == 0 else nsplit
        if nsplit > blocks:
            continue
        name = f"split={nsplit} " + ("default tile" if bh is None else f"bh={bh} w={warps}")
        # the programs a token are a runtime scalar of the kernel: these rows time without compiling anew
        out.setdefault(name, lambda bh=bh, warps=warps, nsplit=nsplit: triton_launch.launch(
            [q, k], cos, sin, params, None, weights, block_h=bh, num_warps=warps, nsplit=nsplit))
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


def run_geometry(name: str, tokens: int, device: str, compare: bool = False) -> dict:
    geometry = GEOMETRIES[name]
    q, k, weights, cos, sin = make_inputs(geometry, tokens, device)
    floor = graph_ms(lambda: (q.clone(), k.clone()), device)
    calls = (compare_variants if compare else variants)(geometry, q, k, weights, cos, sin)
    want = calls["new" if compare else "default"]()
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
    ap.add_argument("--tokens", nargs="+", type=int, default=None,
                    help=f"default: {COMPARE_TOKENS} (--compare), {TOKENS} (--sweep)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compare", action="store_true", help="the planner before and after (the default)")
    mode.add_argument("--sweep", action="store_true", help="the tiles the tuning options reach")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.quick and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.norm_tiles", "python -m benchmarks.norm_tiles --quick")
    device_check.announce(args.device)
    if args.device == "cpu":
        _interpret_on_cpu()
    compare = not args.sweep
    tokens_list = [8] if args.quick else args.tokens or list(COMPARE_TOKENS if compare else TOKENS)
    result: dict = {"env": environment(), "device": args.device, "mode": "compare" if compare else "sweep",
                    "records": []}
    for name in args.geometries:
        for tokens in tokens_list:
            rec = run_geometry(name, tokens, args.device, compare)
            result["records"].append(rec)
            write_json(args.out, result, quiet=True)
            rows = [[v, e.get("x_floor"), e.get("ms"), e.get("max_diff_vs_default"), e.get("error", "")]
                    for v, e in sorted(rec["variants"].items(), key=lambda kv: kv[1].get("x_floor") or 9e9)]
            note = "" if args.device == "cuda" else " (CPU: interpreted once for plumbing, nothing is timed)"
            print_table(f"{name} {GEOMETRIES[name]} at {tokens} tokens{note}", rows,
                        ["variant", "x floor", "graph ms", "max diff vs default", "error"])
    if compare:
        result["verdicts"] = verdicts(result["records"])
        print("\nVerdicts")
        for line in result["verdicts"]:
            print("  " + line)
    write_json(args.out, result)
    return 0


def _ratio(rec: dict, new: str, old: str) -> float | None:
    a, b = (rec["variants"].get(v, {}).get("x_floor") for v in (new, old))
    return a / b if a and b else None


def verdicts(records: list[dict]) -> list[str]:
    """Per planner change, the rows that decide it (time with the change / time without it) and what they say."""
    def verdict(name: str, ratios: list, keep: str, back: str) -> str:
        known = [(label, r) for label, r in ratios if r is not None]
        if not known:
            return f"{name}: not measured"
        text = ", ".join(f"{label} {r:.3f}" for label, r in known)
        worse = [label for label, r in known if r > 1.01]
        return f"{name} (new / old: {text}): " + (f"{back} (slower at {'; '.join(worse)})" if worse else keep)
    form = [(f"{r['geometry']} {r['tokens']}", _ratio(r, "new form, old split", "old")) for r in records
            if r["geometry"] == "minimax-h3" and r["tokens"] >= 4096]
    split = [(f"{r['geometry']} {r['tokens']}",
              _ratio(r, "new", "new form, old split") if "new form, old split" in r["variants"] else
              _ratio(r, "new", "old")) for r in records if 256 <= r["tokens"] < 4096]
    return [verdict("ROW_TAIL_UNDER_NORM", form, "keep True", "set it False"),
            verdict("NORM_SPLIT_PROGRAMS", split, "keep 4096", "set it to MIN_PROGRAMS")]


def _interpret_on_cpu() -> None:
    """The kernel interpreted for CPU tensors (Triton's interpreter), so that the CPU smoke test runs each launch."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from rope_fusion.kernels import triton_kernel, triton_launch

    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests", "helpers"))
    from triton_interpreted import interpreted

    triton_launch.rotary_kernel = interpreted(triton_kernel.rotary_kernel)
    triton_launch.INTERPRETED = True
    if not isinstance(triton.language.sum, InterpretedFunction):
        triton.language.sum = InterpretedFunction(triton.language.sum.fn)


if __name__ == "__main__":
    sys.exit(main())
