"""The host planner of the Triton rotary kernel: any layout mapped onto the kernel's fixed form.

The kernel (kernels/triton_kernel.py) takes up to three token dims, spread over the grid, and one head dim, looped
over inside a program (the innermost dim along which the tables are constant); `plan_launch` finds them for the
tensors of one launch (`Plan`), and `launch_args` turns a plan into the grid, the scalar arguments and the
compile-time constants, with the tile rules measured on the H200 (the constants below; BENCHMARKS.md, Tile choice
and the tile sweep). `make_launches` is both for a call: one launch for all tensors where their geometry allows,
else one each. It works on fake tensors too: kernels/triton_graph.py plans on the node's fake values, symbolic
sizes included (hence `is_true`: a fact known without adding a guard).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

try:
    import triton
except ImportError as e:  # an optional backend: the registry tolerates this
    raise ImportError(f"rope_fusion.kernels.triton_plan needs triton: {e}") from e

from ..ops.schema import RotaryParams, math_dtype

MAX_HEAD_DIM = 1024  # beyond this one row no longer fits a program's registers comfortably
MAX_LOOP_HEADS = 512  # a broadcast dim longer than this is spread over the grid instead of looped over
TILE_ELEMENTS = 2048  # target size of the register tile (heads x padded lanes) of one loop step
NORM_TILE_ELEMENTS = 512  # the same with a per-head norm (its statistics need registers: norm sweep)
# the same after a pass-through head (DeepSeek-V3's 128 + 64 lanes): 4 heads, two warps, every head block a program
# of its own and streaming loads and stores: 1.07x the copy floor of q, against 1.13x for 2 heads a step and one
# warp looping over a token's heads (BENCHMARKS.md, Tile choice)
HEAD_PASS_TILE_ELEMENTS = 1024
HEAD_PAD_WASTE = 1.25  # at most this many padded heads per real head across q and k
# num_warps = tile / elements per warp: whole rows (interleaved, NeoX as rows) want few warps with many
# elements each; NeoX read as two half tiles wants four times the warps (BENCHMARKS.md, tile sweep).
ELEMENTS_PER_WARP = {"rows": 2048, "halves": 512, "head_pass": 384, "held": 2560, "held_heads": 1024}
# Whole rows of 128 lanes without a norm, 8 or more heads a step, a program per token (the whole-row tile sweeps on
# the H200, q and k launched directly, CUDA-graph replay, x the floor). The warps follow the elements a program
# rotates (all its heads of q and k), not the step: interleaved 24+24 heads 1.072 with one warp, 1.043-1.059 with 4;
# 40+40 1.044 with one, 1.016 with 8; GQA 32/8 (a step as large as 40+40's, half the rows) 1.027 with one, 1.018
# with 4, 1.046 with 8; NeoX as rows 24+24 1.105-1.124 with one, 1.028-1.048 with 2; 40+40 1.043 -> 1.022 with 4;
# GQA 32/8 1.031 with one, 1.019 with 2, 1.049 with 4. With 12+12 heads and at D=80 (padded rows) one warp stayed the
# best.
WIDE_ROW_LANES = 128
WIDE_ROW_TILE = 1024  # the smallest tile (heads x lanes) of a step that takes these warps
# (at least this many elements a program, warps for interleaved rows and for NeoX rows), the largest first
WIDE_ROW_WARPS = ((10240, {"interleaved": 8, "neox": 4}), (5120, {"interleaved": 4, "neox": 2}))
MIN_PROGRAMS = 1024  # below this many tokens, head blocks are also spread over the grid
# The same under a per-head norm, whose tile is a quarter of the others' (NORM_TILE_ELEMENTS, one warp): one program
# per token left 1024 warps on the chip at 1024 tokens, and the rows of 256-2048 tokens ran at 1.1-2.4x the floor
# where those of 4096 and more ran at 1.03-1.27x (vllm-omni's kernel, a program per token and head group, 1.5-1.9x).
# Held rows are never split (the held form takes every block of a token). At most NORM_SPLIT_MAX programs a token
# on that account: MiniMax-H3, Boogu and GQA 32/8 geometries at 1024 and 2048 tokens took 0.77-0.86x the time of a
# program per token with 4 and 2 programs a token, and at 256 tokens 16 programs a token took 1.03-1.08x the time of
# the 4 that MIN_PROGRAMS gives (benchmarks/norm_tiles.py times the rules side by side).
NORM_SPLIT_PROGRAMS = 4096
NORM_SPLIT_MAX = 4
# A held side (HELD: a norm across heads, or a per-head norm over padded rows) keeps every head row in registers up
# to this many elements (64 heads of 128 lanes). Across heads: blocks of up to HELD_TILE_ELEMENTS, a warp per
# ELEMENTS_PER_WARP["held"] of the side: 12 heads 4 a block, one warp, 1.10x the floor (1.05x on contiguous
# tables); 40 heads 8 a block, two warps, 1.05x. Per head at D=80: rows in NORM_TILE_ELEMENTS blocks, NeoX halves
# in HELD_TILE_ELEMENTS blocks, a warp per ELEMENTS_PER_WARP["held_heads"] (16 heads: two warps, interleaved
# 1.06-1.07x, NeoX 1.08-1.10x), up to HELD_HEADS_ELEMENTS a side (`default_held`; BENCHMARKS.md, Tile choice)
HELD_ELEMENTS = 8192
HELD_TILE_ELEMENTS = 1024
HELD_HEADS_ELEMENTS = 3072  # a per-head norm's rule holds a side up to this many elements (24 heads of 80 lanes)
# Tensors of one head (MLA's k_pe [B, 1, T, 64]) take this many tokens a program once that leaves MIN_PROGRAMS
# programs: k_pe at 8192 tokens 1.9 us against 6.3 us a token a program (floor 1.5 us; BENCHMARKS.md, Tile choice)
ROW_TOKENS = 8


def is_true(cond: Any) -> bool:
    """True only when known without adding a guard (sizes may be symbolic under dynamic shapes)."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)


def hint(v: Any, default: int) -> int:
    """A size as it is, or `default` where it is symbolic (for rules that need only its order of magnitude)."""
    return v if isinstance(v, int) else default


@dataclasses.dataclass
class Plan:
    """One launch's geometry: the sizes and strides the kernel's arguments take."""

    tokens: list  # 3 sizes, outermost first
    x_strides: list  # per tensor: 4 strides (3 token dims, head dim) of x
    o_strides: list  # per tensor: the same for its output
    heads: list  # per tensor: its head count
    c_strides: list  # 3 token strides + last-dim stride of cos
    s_strides: list  # the same for sin
    head: int | None = None  # the dim of x looped over inside a program (None: one row per token)
    # a joined x (`plan_launch`'s cat): the token slot (0-2) of the dim the pieces join along, never merged with
    # another, and per tensor the 4 strides of its second piece
    cat_slot: int | None = None
    cat_strides: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Tables:
    """The tables of a launch: plain tables that broadcast against x, or cache rows picked by positions
    (then positions, with a trailing dim, stand in for the tables in the grid plan: the row is constant
    wherever positions are)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: Any = None
    weights: list = dataclasses.field(default_factory=list)  # norm weights, one per x (or None)
    # packed sequences (ops/packed.py), read by the kernel itself: each token's row is found from these
    cu_seqlens: Any = None
    seqlen_offsets: Any = None

    @property
    def rows(self) -> bool:
        """Whether the tables are cache rows picked per token (by positions, or by packed sequences)."""
        return self.positions is not None or self.cu_seqlens is not None

    def key(self) -> tuple:
        geo = [(tuple(t.shape), t.stride(), t.dtype) for t in (self.cos, self.sin, *self.weights) if t is not None]
        if self.positions is not None:
            geo.append((tuple(self.positions.shape), self.positions.stride()))
        if self.cu_seqlens is not None:  # the sequence count is a kernel argument; the offsets' presence a constant
            geo.append(("packed", tuple(self.cu_seqlens.shape), self.seqlen_offsets is None))
        return tuple(geo)

    def planned(self) -> tuple:
        if self.positions is None:
            return self.cos, self.sin
        p = self.positions.unsqueeze(-1)
        return p, p


def _table_strides(tables: Tables, lead: list, n: int) -> tuple[list, list]:
    """The strides of cos and sin as they broadcast against each tensor's leading dims (`Tables.planned`)."""
    if tables.cu_seqlens is not None:
        # packed sequences: the row varies along x's first dim only, as the positions the op would derive
        # ([T, 1, ..., 1]) vary; their strides over the token dims give the kernel each token's index in that dim
        c_exp = s_exp = [(1, *[0] * n) for _ in lead]
        return c_exp, s_exp
    cos, sin = tables.planned()
    width = cos.shape[-1]
    return [cos.expand(*s, width).stride() for s in lead], [sin.expand(*s, width).stride() for s in lead]


def _looped_dim(xs: Sequence[torch.Tensor], lead: list, table_strides: list) -> int | None:
    """The dim looped over inside a program where the tensors agree on every size: along which the tables are
    constant, not of size one, at most MAX_LOOP_HEADS long; of those, the one of x's smallest stride (the
    innermost); None where there is none (a row per token)."""
    n = len(lead[0])
    cands = [i for i in range(n)
             if all(is_true(st[i] == 0) for st in table_strides)
             and not is_true(lead[0][i] == 1) and hint(lead[0][i], MAX_LOOP_HEADS + 1) <= MAX_LOOP_HEADS]
    return min(cands, key=lambda i: (hint(abs(xs[0].stride(i)), 1 << 62), -i)) if cands else None


def _token_dims(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], lead: list, head: int | None,
                c_exp: list, s_exp: list, cat: tuple | None) -> list | None:
    """Every non-unit dim but the looped one as (size, strides, kept): the strides ordered x0, o0, x1, o1, ...,
    cos, sin, then the second pieces; `kept` marks the dim a joined x joins along. None where the tables' strides
    differ between tensors along a token dim (one launch reads one table row per token)."""
    dims = []
    for i in range(len(lead[0])):
        if i == head or is_true(lead[0][i] == 1):
            continue
        strides = []
        for x, o in zip(xs, outs):
            strides += [x.stride(i), o.stride(i)]
        strides += [c_exp[0][i], s_exp[0][i]]
        if any(not is_true(c[i] == c_exp[0][i]) for c in c_exp) or \
           any(not is_true(s[i] == s_exp[0][i]) for s in s_exp):
            return None
        if cat is not None:
            strides += [y.stride(i) for y in cat[1]]
        dims.append((lead[0][i], strides, cat is not None and i == cat[0]))
    return dims


def _merge_token_dims(dims: list) -> list:
    """Neighbouring token dims that every tensor walks as one (outer stride = inner stride x inner size) merged,
    so that more layouts fit the kernel's three; the joined dim stays apart."""
    merged: list = []
    for size, strides, kept in dims:
        if merged and not kept and not merged[-1][2]:
            psize, pstrides, _ = merged[-1]
            if all(is_true(ps == st * size) for ps, st in zip(pstrides, strides)):
                merged[-1] = (psize * size, strides, False)
                continue
        merged.append((size, strides, kept))
    return merged


def _plan_of(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], tables: Tables, merged: list,
             head: int | None, cat: tuple | None) -> Plan:
    """The Plan of three token dims (`merged`, outermost first) and the looped dim: each tensor's strides read off
    the token dims' stride columns, with the head stride (0 and one head where nothing is looped)."""
    tokens = [m[0] for m in merged]

    def column(k: int) -> list:
        return [m[1][k] for m in merged]

    x_strides, o_strides, heads = [], [], []
    for t, (x, o) in enumerate(zip(xs, outs)):
        if head is None:
            x_strides.append(column(2 * t) + [0])
            o_strides.append(column(2 * t + 1) + [0])
            heads.append(1)
        else:
            x_strides.append(column(2 * t) + [x.stride(head)])
            o_strides.append(column(2 * t + 1) + [o.stride(head)])
            heads.append(x.shape[head])
    c_at = 2 * len(xs)  # the tables' columns, after every x and output
    plan = Plan(tokens, x_strides, o_strides, heads, column(c_at) + [tables.cos.stride(-1)],
                column(c_at + 1) + [tables.sin.stride(-1)], head)
    if cat is not None:
        plan.cat_slot = next(k for k, m in enumerate(merged) if m[2])
        plan.cat_strides = [column(c_at + 2 + t) + [y.stride(head) if head is not None else 0]
                            for t, y in enumerate(cat[1])]
    return plan


def plan_launch(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], tables: Tables,
                cat: tuple | None = None) -> Plan | None:
    """One launch's geometry for tensors that share tables, or None if they cannot share one grid. With `cat`,
    (dim, second pieces): each x is the first piece of a joined tensor of its output's shape (ops/cat_rotary.py),
    and the dim they join along stays a token dim of its own."""
    lead = [tuple((o if cat else x).shape[:-1]) for x, o in zip(xs, outs)]
    n = len(lead[0])
    if any(len(s) != n for s in lead):
        return None
    c_exp, s_exp = _table_strides(tables, lead, n)
    differ = [i for i in range(n) if any(not is_true(s[i] == lead[0][i]) for s in lead)]
    if len(differ) > 1:  # tensors may differ in one dim only, the one looped over (q's heads and k's)
        return None
    head = differ[0] if differ else _looped_dim(xs, lead, c_exp + s_exp)
    if cat is not None and (cat[0] == head or is_true(lead[0][cat[0]] == 1)):
        return None
    dims = _token_dims(xs, outs, lead, head, c_exp, s_exp, cat)
    if dims is None:
        return None
    merged = _merge_token_dims(dims)
    if len(merged) > 3:
        return None
    nstr = 2 * len(xs) + 2 + (len(cat[1]) if cat is not None else 0)
    while len(merged) < 3:
        merged.insert(0, (1, [0] * nstr, False))
    return _plan_of(xs, outs, tables, merged, head, cat)


def block_heads(heads: Sequence[Any], lanes_pad: int, tile: int = TILE_ELEMENTS) -> int:
    """Heads per loop step: the largest tile up to TILE_ELEMENTS whose padding of q's and k's head counts to
    whole blocks stays within HEAD_PAD_WASTE (the rule BENCHMARKS.md's tile sweep supports)."""
    hs = [hint(h, 16) for h in heads if hint(h, 16) > 0]
    cap = max(1, tile // lanes_pad)
    top = min(cap, triton.next_power_of_2(max(hs)))
    best = 1
    bh = 1
    while bh <= top:
        padded = sum(-(-h // bh) * bh for h in hs)
        if padded <= sum(hs) * HEAD_PAD_WASTE:
            best = bh
        bh *= 2
    return best


def default_neox_row(interleaved: bool, rotary_dim: int, head_dim: int) -> bool:
    """NeoX rotating whole rows takes the one-remapped-load form, a norm before the rotation included (1.09x
    against 1.17x the floor at D=128, 1.39x against 1.41x at D=80); with a pass-through tail the two half loads
    stay (tile sweeps, BENCHMARKS.md)."""
    return not interleaved and rotary_dim == head_dim


def token_split(ntok: Any, nblocks: int, params: RotaryParams, held: bool) -> Any:
    """Programs a token of a launch of few tokens spreads its head blocks over: enough for MIN_PROGRAMS programs,
    and under a per-head norm (its small tile) enough for NORM_SPLIT_PROGRAMS, at most NORM_SPLIT_MAX on that
    account; held rows are not split. Symbolic for a symbolic token count (vLLM's one graph for decode and
    prefill), without a guard."""
    if isinstance(ntok, int):
        splits = -(-MIN_PROGRAMS // max(ntok, 1))
        if params.norm == "rms" and not held:
            splits = max(splits, min(NORM_SPLIT_MAX, -(-NORM_SPLIT_PROGRAMS // max(ntok, 1))))
        return max(1, min(nblocks, splits))
    splits = (ntok + MIN_PROGRAMS - 1) // ntok
    if params.norm == "rms" and not held:
        splits = torch.sym_max(splits, torch.sym_min(NORM_SPLIT_MAX, (ntok + NORM_SPLIT_PROGRAMS - 1) // ntok))
    return torch.sym_max(1, torch.sym_min(nblocks, splits))


def row_tail_fits(params: RotaryParams, head_dim: int) -> bool:
    """Whether a NeoX row's pass-through tail fits the padding of its two halves (HALF_PAD - R/2 lanes each), so
    the kernel can load the row whole with the tail there (ROW_TAIL): R/2 not a power of two and the tail no
    wider than that padding, as where R > D/2 for a power-of-two D (MiniMax-H3's 96 of 128 lanes)."""
    half = params.rotary_dim // 2
    pad = triton.next_power_of_2(max(1, half)) - half
    return (not params.interleaved and params.rotary_blocks == 1 and not params.rotary_offset
            and not params.deinterleave and 0 < head_dim - params.rotary_dim <= 2 * pad)


# Whether the planner takes the row-with-tail form (ROW_TAIL) where it fits, under a per-head norm: one load of the
# whole row, the norm's statistics over it, 128 register lanes for MiniMax-H3's 128 where the halves and a tail tile
# took 160 (1.21-1.27x the floor at >= 4096 tokens; benchmarks/norm_tiles.py times both). The one line that decides
# the default.
ROW_TAIL_UNDER_NORM = True


def default_row_tail(params: RotaryParams, head_dim: int) -> bool:
    """The row-with-tail form where it fits (`row_tail_fits`) under a per-head norm (`ROW_TAIL_UNDER_NORM`), whose
    statistics read the whole row; without a norm the halves and the tail tile stay (a tile sweep found the
    remapped row and the halves even there)."""
    return ROW_TAIL_UNDER_NORM and params.norm == "rms" and row_tail_fits(params, head_dim)


def row_lanes(params: RotaryParams, head_dim: int, row_tail: bool | None,
              in_place: bool = False) -> tuple[int, int, bool]:
    """(HALF_PAD, TAIL_PAD, ROW_TAIL) of a row: each half padded to a power of two, and the pass-through tile's
    lanes, none where the tail is loaded into the halves' padding (`row_tail`, None: `default_row_tail`) and none
    where the launch writes x in place without a norm: the lanes outside the rotation are then x's own already, and
    are neither read nor written (vLLM's in-place rotary_embedding at partial rotary, or after DeepSeek's nope
    lanes, moves only the rotated lanes)."""
    rotary_dim = params.rotary_dim
    half_pad = triton.next_power_of_2(max(1, rotary_dim // 2))
    row_tail = (default_row_tail(params, head_dim) if row_tail is None else bool(row_tail)) \
        and row_tail_fits(params, head_dim)
    passes = head_dim > rotary_dim and not row_tail and not (in_place and params.norm == "none")
    tail_pad = triton.next_power_of_2(head_dim - rotary_dim) if passes else 0
    return half_pad, tail_pad, row_tail


def default_held(params: RotaryParams, head_dim: int, heads: Sequence[Any]) -> bool:
    """Hold a side's head rows in registers (HELD) under a norm across heads (read once, not twice), and under a
    per-head norm whose rows are padded (D=80 in 128 lanes), where the head loop left too few bytes in flight:
    8-24 heads of 80, 1.17-1.34x the floor -> 1.06-1.19x (level at worst). Not at D=128, where the loop is level
    or faster (1.09 against 1.10-1.16x), nor past HELD_HEADS_ELEMENTS a side (40 heads level, 64 heads up to
    2.5x slower with the warps the rule would give), nor with fewer k heads than q heads (GQA: the short side's
    unrolled blocks are masked loads, 1.33-1.63x against the loop's 1.19-1.28x; BENCHMARKS.md, Tile choice)."""
    if params.norm == "rms_across_heads":
        return True
    rows = 2 * triton.next_power_of_2(max(1, params.rotary_dim // 2))
    return (params.norm == "rms" and params.rotary_dim == head_dim and rows != head_dim
            and all(isinstance(h, int) for h in heads) and len(set(heads)) == 1
            and heads[0] * rows <= HELD_HEADS_ELEMENTS)


def default_stream(params: RotaryParams) -> bool:
    """Streaming cache hints (evict_first loads of x, .cs stores) where the sweep measured them faster: a norm
    across heads read in two passes, whose second pass re-reads the token's rows from L2 (12 heads 1.15 -> 1.13x
    the floor; `launch_args` turns them off where those rows are held instead), a pass-through head (M8: 1.09 ->
    1.08), and a per-head norm over padded rows (D=80: 1.213 -> 1.209, 1.314 -> 1.301 in the head loop; held,
    1.075 -> 1.068, Flux form). At D=128 under a per-head
    norm they were slower (1.09 -> 1.12x), so nothing else takes them."""
    padded = triton.next_power_of_2(max(1, params.rotary_dim // 2)) * 2 != params.rotary_dim
    return params.norm == "rms_across_heads" or bool(params.rotary_offset) or (params.norm == "rms" and padded)


def warps_for(tile: int, form: str) -> int:
    """A power of two (Triton requires it; a pass-through tile makes rows like 64 + 128 lanes)."""
    n = max(1, min(8, tile // ELEMENTS_PER_WARP[form]))
    return 1 << (n.bit_length() - 1)



def wide_row_warps(params: RotaryParams, head_dim: Any, lanes_pad: int, tile: int, rows: bool,
                   looped: bool, heads: Sequence[Any] = ()) -> int | None:
    """The warps of a whole-row launch (`rows`: interleaved, or NeoX as rows) without a norm whose rows are 128
    unpadded lanes, with WIDE_ROW_TILE or more elements a step and a program per token looping over its heads
    (`looped`), its tables read as they are (`looped` is false for rows gathered by positions or packed
    sequences); None elsewhere, where the general rule (`warps_for`) measured the faster or the sweep did not
    reach (other head dims, a pass-through head or tail, norms, angle tables, gathered rows, decode's split
    programs, symbolic token counts)."""
    if not (looped and rows and params.norm == "none" and not params.rotary_offset and not params.deinterleave
            and not params.angle_tables
            and params.rotary_blocks == 1 and isinstance(head_dim, int)
            and head_dim == params.rotary_dim == lanes_pad == WIDE_ROW_LANES
            and tile >= WIDE_ROW_TILE and all(isinstance(h, int) for h in heads)):
        return None
    elements = sum(heads) * lanes_pad  # what one program rotates: every head row of its token, q's and k's
    for least, warps in WIDE_ROW_WARPS:
        if elements >= least:
            return warps["interleaved" if params.interleaved else "neox"]
    return None


# A per-head norm's rows of 128 lanes, (heads a block, warps) by the launch's regime (benchmarks/norm_tiles.py
# --sweep on an H200, CUDA-graph replay, x the copy floor, the rule's NORM_TILE_ELEMENTS block of 4 heads and one
# warp against these): a launch of so few tokens that every head block is a program of its own (64 tokens: 24+24
# heads interleaved 0.89-1.05 -> 0.85-0.98, 32/8 heads interleaved with a 64-lane tail 0.94 -> 0.82, MiniMax-H3's
# NeoX 96 of 128 1.18 -> 1.15) takes 8 heads and 4 warps; a program per token of GQA's interleaved rows (32/8 heads,
# rotary 64 of 128) takes 8 heads and 2 warps (4096 tokens 1.043 -> 1.009, 32768 1.062 -> 1.030), where equal q and
# k head counts measured slower with them (24+24 interleaved 1.04 -> 1.16 at 4096 tokens).
NORM_FEW_TOKENS_TILE = (8, 4)
NORM_GQA_TILE = (8, 2)


def norm_row_tile(params: RotaryParams, heads: Sequence[Any], lanes_pad: int, ntok: Any, tables: Tables,
                  held: bool) -> tuple[int, int] | None:
    """(heads a block, warps) of a per-head norm's launch over rows of 128 lanes where a measured regime has its
    own (`NORM_FEW_TOKENS_TILE`, `NORM_GQA_TILE`), None elsewhere: the general rules then decide. Static sizes
    only, tables read per token (no positions, no packed sequences), no pass-through head, rows not held."""
    if not (params.norm == "rms" and lanes_pad == WIDE_ROW_LANES and not held and not params.rotary_offset
            and not params.deinterleave and not params.angle_tables and not tables.rows
            and isinstance(ntok, int) and ntok > 0 and all(isinstance(h, int) and h > 0 for h in heads)):
        return None
    bh = NORM_FEW_TOKENS_TILE[0]
    if ntok * sum(-(-h // bh) for h in heads) <= MIN_PROGRAMS:
        return NORM_FEW_TOKENS_TILE
    if ntok >= MIN_PROGRAMS and params.interleaved and len(set(heads)) > 1:
        return NORM_GQA_TILE
    return None


def per_lane(w: torch.Tensor, x: torch.Tensor) -> bool:
    """A norm weight the kernel may take: at most [heads, lanes] (`norm_fits` checks it against the plan)."""
    return w.dim() <= 2



NORM_FIRST = "normalise first"  # `make_launches`: the kernel cannot apply this norm in its loop


def norm_fits(p: Plan, xs: list, weights: list, params: RotaryParams) -> bool:
    """The kernel normalises the rows it loops over: all heads of a token (x's dim -2) must be that loop for
    a norm across heads, and a weight may vary along that loop's dim and the lanes only."""
    if params.norm == "none":
        return True
    for x, w in zip(xs, weights):
        n = x.dim() - 1
        if params.norm == "rms_across_heads" and p.head != n - 1 and not is_true(x.shape[-2] == 1):
            return False
        if w is not None:
            ws = w.expand(x.shape).stride()
            if not all(i == p.head or is_true(ws[i] == 0) or is_true(x.shape[i] == 1) for i in range(n)):
                return False
    return True


# The RotaryParams fields that `launch_args` hands the kernel: a field outside them (one added to the schema later)
# makes the backend refuse the site (`triton_rotary.supports`) and an eager call run the reference
# (`triton_launch`), never a launch that ignores it.
KERNEL_FIELDS = ("interleaved", "rotary_dim", "full_tables", "conjugate", "out_dtype", "norm", "norm_eps",
                 "deinterleave", "rotary_blocks", "rotary_offset", "angle_tables", "offset_q_only")


def make_launches(xs: list, outs: list, tables: Tables, params: RotaryParams, **tiles: Any) -> list | str | None:
    """[(tensor indices, grid, scalar args, meta args)]: one entry for all tensors together when possible;
    NORM_FIRST when the norm does not fit the kernel's loop. tiles: `launch`'s tile options (None: the rules).
    A launch of one tensor of several takes that tensor's own parameters (`RotaryParams.of_tensor`). q with a
    pass-through head and k without (offset_q_only) share a launch without a norm only: the kernel's norm takes
    one head dim for every side, so under a norm each is a launch of its own."""
    groups = [list(range(len(xs)))]
    plan = plan_launch(xs, outs, tables)
    weights = tables.weights or [None] * len(xs)
    if (plan is None or params.offset_q_only and params.norm != "none") and len(xs) > 1:
        groups = [[i] for i in range(len(xs))]
    launches = []
    for group in groups:
        gx = [xs[i] for i in group]
        go = [outs[i] for i in group]
        if any(is_true(x.numel() == 0) for x in gx):
            continue
        p = plan_launch(gx, go, tables) if len(groups) > 1 else plan
        if p is None:
            return None
        gp = params if len(group) == len(xs) else params.of_tensor(group[0])
        if not norm_fits(p, gx, [weights[i] for i in group], gp):
            return NORM_FIRST
        launches.append((group, *launch_args(p, gx, go, tables, group, gp, **tiles)))
    return launches


def weight_head_stride(w: Any, x: torch.Tensor, head: int | None) -> int:
    """The head stride of a norm weight as it broadcasts against x (its lanes are contiguous: `launch`)."""
    if w is None or head is None:
        return 0
    return w.expand(x.shape).stride(head)


INT32_MAX = 2**31 - 1


def heads_fit_int32(p: Plan, block_h: int, weight_strides: Sequence) -> bool:
    """Whether every head offset the loop computes (head index, padded to whole blocks, times the head stride of
    x, its output or a per-head weight) is known to fit 32 bits; symbolic strides that might not keep 64."""
    for i, h in enumerate(p.heads):
        strides = [p.x_strides[i][3], p.o_strides[i][3], weight_strides[i]]
        if not all(isinstance(v, int) for v in (h, *strides)):
            return False
        top = -(-h // block_h) * block_h  # past the last head of the last (padded) block
        if any(top * abs(st) > INT32_MAX for st in strides):
            return False
    return True


@dataclasses.dataclass
class Tiling:
    """How one launch tiles its work: the decisions the grid, the scalar arguments and the constants all read,
    made once from the tile rules above and the tuning options (`launch_args`)."""

    head_dim: Any
    half_pad: int
    tail_pad: int
    row_tail: bool
    ntok: Any  # tokens of the launch (symbolic under dynamic shapes)
    held: bool
    neox_row: bool
    block_h: int
    one_block: bool
    nsplit: Any  # programs a token spreads its head blocks over
    toks: int  # tokens a program
    side_blocks: list  # head blocks per side (0 for a symbolic head count)
    num_warps: int = 0  # decided last (`plan_tiles`): the warps follow every other decision

    @property
    def lanes_pad(self) -> int:
        """Registers per head row, the pass-through tail included."""
        return 2 * self.half_pad + self.tail_pad


def _may_hold(p: Plan, params: RotaryParams, head_dim: Any, tail_pad: int, lanes_pad: int, ntok: Any,
              nsplit: int | None, held: bool | None) -> bool:
    """Whether rows may be held in registers (HELD), before the head block is known: asked for (None: the rule,
    `default_held`) and possible: static head counts, a program per token, whole heads rotated from lane 0."""
    if held is None:
        held = default_held(params, head_dim, p.heads)
    return (held and params.norm != "none" and tail_pad == 0 and not params.rotary_offset
            and not params.deinterleave and all(isinstance(h, int) for h in p.heads) and isinstance(ntok, int)
            and (nsplit == 1 if nsplit is not None else ntok >= MIN_PROGRAMS)
            and max(p.heads) * lanes_pad <= HELD_ELEMENTS)


def _loop_tile(params: RotaryParams, held: bool, rows: bool) -> int:
    """The register tile (heads x padded lanes) of one loop step: the norm's, the pass-through head's, the held
    rows' (a norm across heads, or NeoX halves) or the plain one (`rows`: interleaved, or NeoX as rows)."""
    tile = NORM_TILE_ELEMENTS if params.norm == "rms" else \
        HEAD_PASS_TILE_ELEMENTS if params.rotary_offset else TILE_ELEMENTS
    if held and (params.norm == "rms_across_heads" or not rows):
        tile = HELD_TILE_ELEMENTS
    return tile


def _splits(params: RotaryParams, ntok: Any, nblocks: int, held: bool) -> Any:
    """Programs a token spreads its head blocks over where no option sets it: every block its own program after a
    pass-through head (HEAD_PASS_TILE_ELEMENTS), else `token_split`."""
    if params.rotary_offset:
        return nblocks
    if isinstance(ntok, int) or nblocks > 1:
        return token_split(ntok, nblocks, params, held)
    return 1


def _row_tokens(p: Plan, params: RotaryParams, ntok: Any, nsplit: Any, copy_blocks: int) -> int:
    """Tokens a program: ROW_TOKENS for tensors of one head once that leaves MIN_PROGRAMS programs, else one."""
    if (isinstance(ntok, int) and nsplit == 1 and all(isinstance(h, int) and h == 1 for h in p.heads)
            and params.norm != "rms_across_heads" and ntok % ROW_TOKENS == 0 and ntok // ROW_TOKENS >= MIN_PROGRAMS
            and not copy_blocks):
        return ROW_TOKENS
    return 1


def _warps(t: Tiling, p: Plan, tables: Tables, params: RotaryParams, num_warps: int | None) -> int:
    """The launch's warps: the option, else the held rows' rule, the wide rows' or the general one (`warps_for`)."""
    interleaved, lanes_pad = params.interleaved, t.lanes_pad
    if t.held and num_warps is None:
        num_warps = warps_for(max(t.side_blocks) * t.block_h * lanes_pad,
                              "held" if params.norm == "rms_across_heads" else "held_heads")
    if num_warps is None:
        looped = (isinstance(t.ntok, int) and t.ntok >= MIN_PROGRAMS and isinstance(t.nsplit, int) and t.nsplit == 1
                  and not tables.rows)
        num_warps = wide_row_warps(params, t.head_dim, lanes_pad, t.block_h * lanes_pad,
                                   interleaved or t.neox_row, looped and t.toks == 1, p.heads)
    return num_warps or warps_for(t.block_h * lanes_pad, "head_pass" if params.rotary_offset else
                                  "rows" if interleaved or t.neox_row else "halves")


def plan_tiles(p: Plan, xs: list, tables: Tables, params: RotaryParams, *, block_h: int | None = None,
               num_warps: int | None = None, nsplit: int | None = None, neox_row: bool | None = None,
               held: bool | None = None, row_tail: bool | None = None, in_place: bool = False,
               copy_blocks: int = 0) -> Tiling:
    """The tiling of one launch of plan p (`launch_args` says what the options mean). The decisions depend on one
    another in this order: the rows' lanes, whether rows may be held, NeoX as rows, the head block, the programs a
    token, the tokens a program, whether rows are held after all, the warps."""
    head_dim = xs[0].shape[-1]
    half_pad, tail_pad, row_tail = row_lanes(params, head_dim, row_tail, in_place)
    lanes_pad = 2 * half_pad + tail_pad
    ntok = p.tokens[0] * p.tokens[1] * p.tokens[2]
    held = _may_hold(p, params, head_dim, tail_pad, lanes_pad, ntok, nsplit, held)
    if neox_row is None:  # held under a per-head norm, NeoX reads its halves apart (no split in registers)
        neox_row = default_neox_row(params.interleaved, params.rotary_dim, head_dim) \
            and not (held and params.norm == "rms")
    neox_row = bool(neox_row) and not params.interleaved and params.rotary_blocks == 1 or row_tail
    tile = None if block_h or num_warps else norm_row_tile(params, p.heads, lanes_pad, ntok, tables, held)
    if tile is not None:
        block_h, num_warps = tile
    bh = block_h or block_heads(p.heads, lanes_pad, _loop_tile(params, held, params.interleaved or neox_row))
    # a norm across heads whose heads all fit one block takes its statistics from that tile (a larger block to
    # get there was slower in the norm sweep: 1.32x against 1.17x the floor at 12 heads x 128)
    one_block = params.norm == "rms_across_heads" and all(is_true(h <= bh) for h in p.heads)
    nblocks = sum(-(-hint(h, 1) // bh) for h in p.heads) + copy_blocks  # work items: q's blocks, k's, copies
    if nsplit is None:
        nsplit = _splits(params, ntok, nblocks, held)
    toks = _row_tokens(p, params, ntok, nsplit, copy_blocks)
    side_blocks = [-(-h // bh) if isinstance(h, int) else 0 for h in p.heads]
    held = held and not one_block and max(side_blocks) * bh * lanes_pad <= HELD_ELEMENTS
    t = Tiling(head_dim, half_pad, tail_pad, row_tail, ntok, held, neox_row, bh, one_block, nsplit, toks,
               side_blocks)
    t.num_warps = _warps(t, p, tables, params, num_warps)
    return t


def eps_bits(eps: float) -> int:
    """The norm's eps as the kernel takes it: its fp32 bit pattern as a signed 32-bit int. A Python float is fp32 to
    Triton's launcher and fp64 to Inductor's (its user-kernel nodes), so one plan compiled two binaries; an int is
    i32 to both, and both specialise it alike (a 1, a multiple of 16)."""
    try:
        packed = struct.pack("<f", float(eps))
    except OverflowError:  # beyond fp32's range: inf, as the launchers' conversion of a float gives
        packed = struct.pack("<f", math.copysign(math.inf, eps))
    return struct.unpack("<i", packed)[0]


def _scalar_args(p: Plan, xs: list, tables: Tables, params: RotaryParams, t: Tiling, w_strides: tuple) -> tuple:
    """The kernel's runtime scalars, in its parameter order: token sizes, head counts, splits, table rows, weight
    head strides, eps (`eps_bits`), then the strides of each side (absent sides zero) and of the tables."""
    none = [0, 0, 0, 0]
    sk, sv = (p.x_strides[i] if len(xs) > i else none for i in (1, 2))
    sko, svo = (p.o_strides[i] if len(xs) > i else none for i in (1, 2))
    hk, hv = (p.heads[i] if len(xs) > i else 0 for i in (1, 2))
    cos, sin = tables.cos, tables.sin
    # with positions: the row strides and the rows that a position may pick (the kernel asserts 0 <= row < rows)
    rows = (cos.stride(0), sin.stride(0), cache_rows(cos, sin)) if tables.rows else (0, 0, 0)
    return (p.tokens[1], p.tokens[2], p.heads[0], hk, hv, t.nsplit, *rows, *w_strides, eps_bits(params.norm_eps),
            *p.x_strides[0], *p.o_strides[0], *sk, *sko, *sv, *svo, *p.c_strides[:3], *p.s_strides[:3])


def _constants(p: Plan, xs: list, tables: Tables, params: RotaryParams, t: Tiling, weights: list,
               w_strides: tuple, stream: bool | None) -> dict:
    """The kernel's compile-time constants (and num_warps): every one passed, the joined form's and the KV-cache
    write's at their defaults, since the user-kernel node takes none of a kernel's defaults."""
    lanes_pad, held = t.lanes_pad, t.held
    wide = math_dtype(xs, tables.cos, tables.sin, params.out_dtype) == torch.float64
    return dict(ROT=params.rotary_dim, HEAD_DIM=t.head_dim, HALF_PAD=t.half_pad, TAIL_PAD=t.tail_pad,
                BLOCK_H=t.block_h, NSIDES=len(xs), INTERLEAVED=params.interleaved, FULL_TABLES=params.full_tables,
                CONJ=params.conjugate, MATH_FP64=wide, NEOX_ROW=t.neox_row, HAS_POS=tables.rows,
                NORM={"none": 0, "rms": 1, "rms_across_heads": 2}[params.norm],
                HAS_W=any(w is not None for w in weights), HEAD_PAD=triton.next_power_of_2(t.head_dim),
                # a weight that varies over heads is loaded per head block; one shared by every head, once
                W_HEADS=not all(is_true(sw == 0) for sw in w_strides), W_TILE=lanes_pad == t.head_dim,
                HEAD_I64=not heads_fit_int32(p, t.block_h, w_strides),
                DEINTERLEAVE=params.deinterleave, ONE_BLOCK=t.one_block, OFFSET=params.rotary_offset,
                ANGLES=params.angle_tables,
                # the tables' lane strides are compile-time constants: Inductor launches the kernel with runtime
                # scalars that Triton does not specialize, and a lane stride only known at run time turns the
                # vector loads into gathers (the in-graph kernel ran at twice the time of a direct launch)
                SCD=p.c_strides[3], SSD=p.s_strides[3], BH=params.rotary_dim // 2 // params.rotary_blocks,
                # (rows whole with the tail in their padding take none: whole D=128 rows under a per-head norm
                # measured slower with them)
                STREAM=default_stream(params) and not (held and params.norm == "rms_across_heads") and not t.row_tail
                if stream is None else bool(stream),
                HELD=max(t.side_blocks) if held else 0,  # head blocks held per side (a constexpr: unrolled)
                TOKS=t.toks,
                # packed sequences: their count (the search's range) and the constant that turns the search on;
                # off_ptr, the offsets, is a tensor of each call (`launch` passes it), None here
                off_ptr=None, batch=packed_batch(tables), PACKED=tables.cu_seqlens is not None,
                # q's pass-through head alone: k (and v) rotate their whole head from lane 0 (`make_launches`
                # gives a norm with it a launch per tensor)
                OFFSET_Q_ONLY=bool(params.offset_q_only),
                # the joined form off (kernels/triton_cat.py sets it): every parameter is passed, at its default
                # here, since the user-kernel node of torch 2.11 takes none of a kernel's defaults ("Incorrect
                # number of arguments passed to kernel") and the compiled launcher's check wants them all
                **CAT_OFF, **KV_OFF, **OUT_AT_BASE,
                ROW_TAIL=t.row_tail,  # the pass-through tail in the NeoX row's padding
                num_warps=t.num_warps)


def launch_args(p: Plan, xs: list, outs: list, tables: Tables, group: list, params: RotaryParams, *,
                block_h: int | None = None, num_warps: int | None = None, nsplit: int | None = None,
                neox_row: bool | None = None, stream: bool | None = None, held: bool | None = None,
                row_tail: bool | None = None, in_place: bool = False, copy_blocks: int = 0) -> tuple:
    """(grid, scalar arguments, compile-time constants with num_warps) of one launch of plan p: the tile rules
    above, where the tuning options (`launch`'s) do not set them. `row_tail` asks for the row-with-tail form where
    it fits (`row_tail_fits`; it is the remapped NeoX row, whatever `neox_row` says). `in_place`: the outputs are
    the xs themselves (`row_lanes`). `copy_blocks`: work items the launch does after the rotated head blocks (the
    KV-cache write's v rows, kernels/triton_kv_cache.py), counted where the programs per token are chosen; a launch
    with them takes one token a program."""
    if params.offset_q_only and params.norm != "none":
        raise ValueError("offset_q_only with a norm: the kernel's norm takes one head dim for every side; "
                         "make_launches gives each tensor a launch of its own")
    t = plan_tiles(p, xs, tables, params, block_h=block_h, num_warps=num_warps, nsplit=nsplit, neox_row=neox_row,
                   held=held, row_tail=row_tail, in_place=in_place, copy_blocks=copy_blocks)
    weights = [tables.weights[i] if tables.weights else None for i in group]
    w_strides = tuple(weight_head_stride(weights[i], xs[i], p.head) if len(xs) > i else 0 for i in range(3))
    scalars = _scalar_args(p, xs, tables, params, t, w_strides)
    meta = _constants(p, xs, tables, params, t, weights, w_strides, stream)
    return (t.ntok // t.toks if t.toks > 1 else t.ntok, t.nsplit), scalars, meta


# the kernel's joined-form parameters at their defaults: a launch that reads no second pieces
CAT_OFF = dict(CAT=False, CAT_SLOT=0, cat_split=None, q2_ptr=None, k2_ptr=None, wq2_ptr=None, wk2_ptr=None,
               **{f"{s}2_stride_{a}": None for s in "qk" for a in ("t0", "t1", "t2", "head")})
# the outputs written from their pointers (the slice and into folds' node passes offsets: kernels/triton_slice.py)
OUT_AT_BASE = dict(qo_off=None, ko_off=None, vo_off=None)
# the kernel's KV-cache write at its defaults: a launch that writes no cache (kernels/triton_kv_cache.py sets it)
KV_OFF = dict(KV_CACHE=False, slot_ptr=None, n_slots=None, block_size=None, kv_capacity=None, kc_ptr=None,
              kc_stride_block=None, kc_stride_slot=None, kc_stride_head=None, vc_ptr=None, vc_stride_block=None,
              vc_stride_slot=None, vc_stride_head=None, vsrc_ptr=None, vsrc_stride_token=None, vsrc_stride_head=None,
              vsrc_heads=None, k_scale_ptr=None, v_scale_ptr=None, wvn_ptr=None, wvn_stride_head=None, KC_FP8=False,
              VC_FP8=False, V_DIM=0, V_PAD=0, BLOCK_V=1, V_NORM=False, V_W=False)


def packed_batch(tables: Tables) -> Any:
    """The number of packed sequences (cu_seqlens holds batch + 1 starts), or None without them: the kernel's
    `batch`, left at its default where nothing is packed."""
    return tables.cu_seqlens.shape[0] - 1 if tables.cu_seqlens is not None else None


def cache_rows(cos: torch.Tensor, sin: torch.Tensor) -> Any:
    """The rows of the cos and sin caches that a position may pick (the fewer, where the two differ)."""
    c, s = cos.shape[0], sin.shape[0]
    if isinstance(c, int) and isinstance(s, int):
        return min(c, s)
    return c if is_true(c <= s) else s if is_true(s <= c) else torch.sym_min(c, s)
