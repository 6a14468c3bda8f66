"""Triton kernels for the fused rotary op (the `triton` backend on CUDA / ROCm).

Why these kernels look the way they do (docs/design.md section 3, measured on the H200):
- RoPE is pure data movement, so the only goal is the copy floor. Every x access is a contiguous run: NeoX
  rows are loaded as their two halves, interleaved rows are loaded whole and their pairs split in registers
  (`tl.reshape` + `tl.split`, then `tl.join` to store). Loading pairs with stride 2 or through a computed
  partner index was 1.5-4.6x the floor. NeoX that rotates whole rows reads each row with one load whose
  lanes are remapped so that the tile's two halves are the row's halves (padded apart when half the head
  dim is not a power of two, as at D=80), and splits them in registers: 1.07x the floor at D=80 where two
  half loads were 1.19x. With a pass-through tail the two half loads stay (the tile sweep was even).
- q's and k's head blocks form one list of work items; NSPLIT programs per token share it (only for few
  tokens, as in decode: splitting large launches was always slower in the tile sweep).
- One program per token (per index of the dims along which the tables vary); the program loads its table
  row once and loops over the head blocks of q and then of k, so tables are read once and reused across all
  heads of both tensors, and q and k take one launch whatever their head counts.
- Tables are arbitrary strided views that broadcast against x (a slice of a packed table, the real part of
  complex freqs): they are never copied; their broadcast strides (0 on broadcast dims) go to the kernel.
- Head dims that are not powers of two (80, 96, ...) are padded to one with masks.
- A norm across heads, or a per-head norm over padded rows, holds the token's head rows in registers between its
  statistics and the rotation (HELD);
  a tensor of one head takes several tokens a program (TOKS); a pass-through head gives every head block a
  program of its own; streaming cache hints (STREAM) only where the sweep measured them faster.

The host side (`_plan`) maps any layout onto the kernel's fixed form: up to three "token" dims, taken by the
grid, and one "head" dim, looped over inside a program (the innermost dim along which the tables are
constant). It works on fake tensors too: kernels/triton_graph.py traces it on the node's fake values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # an optional backend: the registry tolerates this
    raise ImportError(f"rope_fusion.kernels.triton_rotary needs triton: {e}") from e

import logging

from torch.library import wrap_triton

from ..ops.backends import Backend, SiteSpec, emit_op_call, register_backend
from ..ops.library import define_rotary_ops, register_device_kernel
from ..ops.reference import gather_rows
from ..ops.schema import RotaryCall, RotaryParams, math_dtype

log = logging.getLogger("rope_fusion")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
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
MIN_PROGRAMS = 1024  # below this many tokens, head blocks are also spread over the grid
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


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, cos_ptr, sin_ptr, pos_ptr, wq_ptr, wk_ptr, wv_ptr,
    N1, N2, HQ, HK, HV, NSPLIT, crow, srow, nrows, swqh, swkh, swvh, eps,
    sq0, sq1, sq2, sqh, sqo0, sqo1, sqo2, sqoh,
    sk0, sk1, sk2, skh, sko0, sko1, sko2, skoh,
    sv0, sv1, sv2, svh, svo0, svo1, svo2, svoh,
    sc0, sc1, sc2, ss0, ss1, ss2,
    ROT: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, NSIDES: tl.constexpr, INTERLEAVED: tl.constexpr, FULL_TABLES: tl.constexpr,
    CONJ: tl.constexpr, MATH_FP64: tl.constexpr, NEOX_ROW: tl.constexpr, HAS_POS: tl.constexpr,
    NORM: tl.constexpr, HAS_W: tl.constexpr, HEAD_PAD: tl.constexpr, DEINTERLEAVE: tl.constexpr,
    ONE_BLOCK: tl.constexpr, SCD: tl.constexpr, SSD: tl.constexpr, BH: tl.constexpr, OFFSET: tl.constexpr,
    ANGLES: tl.constexpr, W_HEADS: tl.constexpr, W_TILE: tl.constexpr, HEAD_I64: tl.constexpr,
    STREAM: tl.constexpr, HELD: tl.constexpr, TOKS: tl.constexpr,
):
    """Rotate the rows of one token of q (and k, and v): grid = (tokens, NSPLIT).

    The head blocks of q, then of k, then of v form one list of work items; program `split` of a token takes items
    split, split + NSPLIT, ... (NSPLIT = 1: one program does all of q and k; NSPLIT = 2 with one block each:
    q and k in separate programs of the same launch). NORM 1 RMS-normalises each head row first, NORM 2 all
    heads of the token (from the tile itself when one block holds every head, ONE_BLOCK; else a first pass
    over the token's rows sums their squares), times the per-lane weight. NeoX pairs lie within blocks of
    2 * BH lanes (BH = ROT / 2: one block, plain NeoX). The rotated lanes start at lane OFFSET; the others
    (a pass-through head before them, a tail after them) form one pass-through tile of TAIL_PAD lanes."""
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = HEAD_DIM - ROT
    # STREAM: x's rows are read for the last time here and the outputs are not read back by this launch, so they
    # may leave L2 first (evict_first loads, streaming .cs stores): where the sweep measured it faster.
    XPOL: tl.constexpr = "evict_first" if STREAM else ""
    OMOD: tl.constexpr = ".cs" if STREAM else ""
    # lane of x held by pass-through tile lane p: the head [0, OFFSET) first, then the tail after the rotation
    if TAIL_PAD > 0:
        plane = tl.arange(0, TAIL_PAD)[None, :]
        if OFFSET == 0:
            plane = ROT + plane
        elif OFFSET < PASS:
            plane = tl.where(plane < OFFSET, plane, plane + ROT)
    if MATH_FP64:
        cdt = tl.float64
    else:
        cdt = tl.float32
    # Inductor's launcher types a float argument as fp64 (a direct launch: fp32); left so, eps would promote
    # the norm's scale and with it every product of the tile to fp64, 1.4-1.6x the fp32 kernel's time.
    eps = tl.cast(eps, cdt)
    tok = tl.program_id(0).to(tl.int64)
    if TOKS > 1:  # TOKS single-row tokens a program, as a (TOKS, lanes) tile (one head: MLA's k_pe)
        tok = tok * TOKS + tl.arange(0, TOKS).to(tl.int64)[:, None]
    ROWS: tl.constexpr = BLOCK_H * TOKS  # rows of a tile: heads of a token, or tokens of one head
    split = tl.program_id(1)
    i2 = tok % N2
    rest = tok // N2
    i1 = rest % N1
    i0 = rest // N1

    # The table row of this token: loaded once, reused by every head of q and k.
    lanes = tl.arange(0, 2 * HALF_PAD)[None, :]
    if NEOX_ROW:
        # NeoX as one row load: tile lane l < HALF_PAD holds x lane l, lane HALF_PAD + l holds x lane HALF + l,
        # so the (2, HALF_PAD) reshape of the tile is the two halves, split in registers like interleaved
        # pairs. Each half is one affine run of addresses, so the load stays vectorized.
        tl_half = lanes >= HALF_PAD
        row_off = tl.where(tl_half, lanes - HALF_PAD + HALF, lanes)
        row_mask = tl.where(tl_half, lanes - HALF_PAD, lanes) < HALF
    jt = tl.arange(0, HALF_PAD)
    tmask = jt < HALF
    if BH < HALF:  # the first lane of pair jt when NeoX pairs lie within blocks of 2 * BH lanes
        lt = (jt // BH) * (2 * BH) + jt % BH
    else:
        lt = jt
    if FULL_TABLES:
        if INTERLEAVED and not DEINTERLEAVE:  # a de-interleaved result indexes full tables by output lane
            ia = 2 * jt
            ib = 2 * jt + 1
        else:
            ia = lt
            ib = lt + BH
    else:
        ia = jt
        ib = jt
    if HAS_POS:  # a cache row per token: sc*/ss* are the strides of positions over the token dims
        pos = tl.load(pos_ptr + i0 * sc0 + i1 * sc1 + i2 * sc2).to(tl.int64)
        # the op's rule, 0 <= row < nrows (the pass wraps negative positions in the graph where the model's
        # indexing wraps them): a row outside fails as Inductor's own gathers fail, a device-side assert, which
        # is compiled in where Inductor compiles its own (its kernels and this one: `assert_indirect_indexing`)
        tl.device_assert((pos >= 0) & (pos < nrows), "rope_fusion: a position outside [0, rows) of the cache")
        c_row = cos_ptr + pos * crow
        s_row = sin_ptr + pos * srow
    else:
        c_row = cos_ptr + i0 * sc0 + i1 * sc1 + i2 * sc2
        s_row = sin_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2
    if TOKS > 1:  # the rows of TOKS tokens: (TOKS, 1) row pointers, (TOKS, lanes) tables
        ca = tl.load(c_row + (ia * SCD)[None, :], mask=tmask[None, :], other=0.0).to(cdt)
        sa = tl.load(s_row + (ia * SSD)[None, :], mask=tmask[None, :], other=0.0).to(cdt)
        if FULL_TABLES:
            cb = tl.load(c_row + (ib * SCD)[None, :], mask=tmask[None, :], other=0.0).to(cdt)
            sb = tl.load(s_row + (ib * SSD)[None, :], mask=tmask[None, :], other=0.0).to(cdt)
    else:
        ca = tl.load(c_row + ia * SCD, mask=tmask, other=0.0).to(cdt)[None, :]
        sa = tl.load(s_row + ia * SSD, mask=tmask, other=0.0).to(cdt)[None, :]
        if FULL_TABLES:
            cb = tl.load(c_row + ib * SCD, mask=tmask, other=0.0).to(cdt)[None, :]
            sb = tl.load(s_row + ib * SSD, mask=tmask, other=0.0).to(cdt)[None, :]
    if ANGLES:  # the tables hold angles: their cos and sin, once per token for every head
        ca = tl.cos(ca)
        sa = tl.sin(sa)
        if FULL_TABLES:
            cb = tl.cos(cb)
            sb = tl.sin(sb)
    if not FULL_TABLES:
        cb = ca
        sb = sa
    if CONJ:
        sa = -sa
        sb = -sb

    hoffs = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF_PAD)[None, :]
    lj = lt[None, :]
    nbq = (HQ + BLOCK_H - 1) // BLOCK_H
    nbk = (HK + BLOCK_H - 1) // BLOCK_H
    for side in tl.static_range(NSIDES):
        # side 0 is q, 1 is k, 2 is v: a compile-time choice, so each side's code has its own dtypes.
        if side == 0:
            first = split
            x_row = q_ptr + i0 * sq0 + i1 * sq1 + i2 * sq2
            o_row = qo_ptr + i0 * sqo0 + i1 * sqo1 + i2 * sqo2
            sxh = sqh
            soh = sqoh
            nheads = HQ
            w_ptr = wq_ptr
            swh = swqh
        elif side == 1:
            x_row = k_ptr + i0 * sk0 + i1 * sk1 + i2 * sk2
            o_row = ko_ptr + i0 * sko0 + i1 * sko1 + i2 * sko2
            sxh = skh
            soh = skoh
            nheads = HK
            w_ptr = wk_ptr
            swh = swkh
            first = (split + NSPLIT - nbq % NSPLIT) % NSPLIT
        else:
            x_row = v_ptr + i0 * sv0 + i1 * sv1 + i2 * sv2
            o_row = vo_ptr + i0 * svo0 + i1 * svo1 + i2 * svo2
            sxh = svh
            soh = svoh
            nheads = HV
            w_ptr = wv_ptr
            swh = swvh
            first = (split + NSPLIT - (nbq + nbk) % NSPLIT) % NSPLIT
        nblocks = (nheads + BLOCK_H - 1) // BLOCK_H
        ca_w = ca  # this side's table rows, with its weight row folded in where one is (below)
        sa_w = sa
        cb_w = cb
        sb_w = sb
        if HAS_W and not W_HEADS:
            # One weight row for every head, loaded once per side instead of once per head block. Held as a whole
            # (BLOCK_H, lanes) tile when the rows have no padded lanes, else as one (1, lanes) row that the loop
            # broadcasts (each the faster of the two in the norm sweep: BENCHMARKS.md, Tile choice).
            if W_TILE:
                wz = tl.full((BLOCK_H, 1), 0, tl.int32)
            else:
                wz = tl.full((1, 1), 0, tl.int32)
            if NEOX_ROW:
                w_row = tl.load(w_ptr + OFFSET + (row_off + wz), mask=row_mask & (wz == 0), other=0.0).to(cdt)
            elif INTERLEAVED:
                w_row = tl.load(w_ptr + OFFSET + (lanes + wz), mask=(lanes < ROT) & (wz == 0), other=0.0).to(cdt)
            else:
                w_a = tl.load(w_ptr + OFFSET + (lj + wz), mask=(j < HALF) & (wz == 0), other=0.0).to(cdt)
                w_b = tl.load(w_ptr + OFFSET + (BH + lj + wz), mask=(j < HALF) & (wz == 0), other=0.0).to(cdt)
            if TAIL_PAD > 0:
                w_t = tl.load(w_ptr + (plane + wz), mask=(tl.arange(0, TAIL_PAD)[None, :] < PASS) & (wz == 0),
                              other=0.0).to(cdt)
            # A weight row broadcast over the heads (padded lanes: W_TILE off) is folded into this side's table
            # rows, once per program: x * w then the rotation is (x_a * w_a) * c_a - (x_b * w_b) * s_a =
            # x_a * (w_a * c_a) - x_b * (w_b * s_a), a multiply an element fewer in the loop (D=80: 1.26-1.34x ->
            # 1.20-1.31x the floor). A weight tile stays a multiply in the loop: folded, the four tables become
            # whole tiles too, and the registers they take cost more (D=128 NeoX 1.10 -> 1.18x; BENCHMARKS.md).
            if not W_TILE:
                if NEOX_ROW:
                    wa, wb = tl.split(tl.permute(tl.reshape(w_row, (1, 2, HALF_PAD)), (0, 2, 1)))
                elif INTERLEAVED:
                    wa, wb = tl.split(tl.reshape(w_row, (1, HALF_PAD, 2)))
                else:
                    wa = w_a
                    wb = w_b
                ca_w = ca * wa
                sa_w = sa * wb
                cb_w = cb * wb
                sb_w = sb * wa
        if HELD:
            # Every head block of this side is loaded before any is used and held in registers (HELD blocks,
            # unrolled; a side with fewer heads masks the rest), so all of the side's loads are in flight at once.
            # A norm across heads then reads the token once where the two passes below read it twice, the second
            # time from L2 (12 heads 1.15 -> 1.10x the floor, 40 heads 1.16 -> 1.05x); a per-head norm over
            # padded rows (D=80) no longer waits on one block's loads at a time (1.24 -> 1.06x; BENCHMARKS.md,
            # Tile choice). NeoX as two halves holds them apart (`held_b`).
            held = ()
            held_b = ()
            total = tl.full((BLOCK_H,), 0.0, cdt)
            for hb in tl.static_range(HELD):
                heads = hb * BLOCK_H + hoffs
                if HEAD_I64:
                    hcol = heads.to(tl.int64)[:, None]
                else:
                    hcol = heads[:, None]
                hmask = (heads < nheads)[:, None]
                if NEOX_ROW:
                    v = tl.load(x_row + hcol * sxh + row_off, mask=hmask & row_mask, other=0.0, eviction_policy=XPOL)
                elif INTERLEAVED:
                    v = tl.load(x_row + hcol * sxh + lanes, mask=hmask & (lanes < ROT), other=0.0,
                                eviction_policy=XPOL)
                else:
                    v = tl.load(x_row + hcol * sxh + lj, mask=hmask & (j < HALF), other=0.0, eviction_policy=XPOL)
                    vb = tl.load(x_row + hcol * sxh + BH + lj, mask=hmask & (j < HALF), other=0.0,
                                 eviction_policy=XPOL)
                    held_b = held_b + (vb,)
                held = held + (v,)
                if NORM == 2:
                    vf = v.to(cdt)
                    total += tl.sum(vf * vf, axis=1)
                    if not (NEOX_ROW or INTERLEAVED):
                        vf = vb.to(cdt)
                        total += tl.sum(vf * vf, axis=1)
            if NORM == 2:
                if MATH_FP64:
                    token_scale = 1.0 / tl.sqrt(tl.sum(total, axis=0) / (nheads * HEAD_DIM) + eps)
                else:
                    token_scale = tl.math.rsqrt(tl.sum(total, axis=0) / (nheads * HEAD_DIM) + eps)
            for hb in tl.static_range(HELD):
                heads = hb * BLOCK_H + hoffs
                hmask = (heads < nheads)[:, None]
                if HEAD_I64:
                    hcol = heads.to(tl.int64)[:, None]
                else:
                    hcol = heads[:, None]
                if NEOX_ROW:
                    m = hmask & row_mask
                    row = row_off
                elif INTERLEAVED:
                    m = hmask & (lanes < ROT)
                    row = lanes
                else:
                    m = hmask & (j < HALF)
                if NEOX_ROW or INTERLEAVED:
                    v = held[hb].to(cdt)
                    if NORM == 2:
                        scale = token_scale
                    else:  # a per-head norm: each row's own scale
                        ms = tl.sum(v * v, axis=1) / HEAD_DIM + eps
                else:
                    a = held[hb].to(cdt)
                    b = held_b[hb].to(cdt)
                    if NORM == 2:
                        scale = token_scale
                    else:
                        ms = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps
                if NORM == 1:
                    if MATH_FP64:
                        scale = (1.0 / tl.sqrt(ms))[:, None]
                    else:
                        scale = tl.math.rsqrt(ms)[:, None]
                if NEOX_ROW or INTERLEAVED:
                    v = v * scale
                    if HAS_W and not W_HEADS:
                        if W_TILE:
                            v = v * w_row
                    elif HAS_W:
                        v = v * tl.load(w_ptr + hcol * swh + row, mask=m, other=0.0).to(cdt)
                    if NEOX_ROW:
                        a, b = tl.split(tl.permute(tl.reshape(v, (BLOCK_H, 2, HALF_PAD)), (0, 2, 1)))
                    else:
                        a, b = tl.split(tl.reshape(v, (BLOCK_H, HALF_PAD, 2)))
                else:
                    a = a * scale
                    b = b * scale
                    if HAS_W and not W_HEADS:
                        if W_TILE:
                            a = a * w_a
                            b = b * w_b
                    elif HAS_W:
                        a = a * tl.load(w_ptr + hcol * swh + lj, mask=m, other=0.0).to(cdt)
                        b = b * tl.load(w_ptr + hcol * swh + (BH + lj), mask=m, other=0.0).to(cdt)
                oa = a * ca_w - b * sa_w
                ob = b * cb_w + a * sb_w
                op = o_row + hcol * soh
                if NEOX_ROW:
                    o = tl.reshape(tl.permute(tl.join(oa, ob), (0, 2, 1)), (BLOCK_H, 2 * HALF_PAD))
                    tl.store(op + row, o.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
                elif INTERLEAVED:
                    o = tl.reshape(tl.join(oa, ob), (BLOCK_H, 2 * HALF_PAD))
                    tl.store(op + row, o.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
                else:
                    tl.store(op + lj, oa.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
                    tl.store(op + BH + lj, ob.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
        else:
            if NORM == 2 and not ONE_BLOCK:  # one scale for every head of the token: a first pass sums the squares
                total = tl.full((BLOCK_H,), 0.0, cdt)
                whole = tl.arange(0, HEAD_PAD)[None, :]
                for hb in range(0, nblocks):
                    heads = hb * BLOCK_H + hoffs
                    if HEAD_I64:
                        hcol = heads.to(tl.int64)[:, None]
                    else:
                        hcol = heads[:, None]
                    xp = x_row + hcol * sxh
                    v = tl.load(xp + whole, mask=(heads < nheads)[:, None] & (whole < HEAD_DIM), other=0.0).to(cdt)
                    total += tl.sum(v * v, axis=1)
                if MATH_FP64:  # rsqrt is an approximation in fp64 too (rsqrt.approx.f64)
                    token_scale = 1.0 / tl.sqrt(tl.sum(total, axis=0) / (nheads * HEAD_DIM) + eps)
                else:
                    token_scale = tl.math.rsqrt(tl.sum(total, axis=0) / (nheads * HEAD_DIM) + eps)
            for hb in range(first, nblocks, NSPLIT):
                heads = hb * BLOCK_H + hoffs
                hmask = (heads < nheads)[:, None]
                if HEAD_I64:
                    hcol = heads.to(tl.int64)[:, None]
                else:  # every head's offset in a token's rows fits 32 bits: 32-bit multiplies, not 64-bit ones
                    hcol = heads[:, None]
                xh = x_row + hcol * sxh
                oh = o_row + hcol * soh
                xp = xh + OFFSET  # the rotated lanes
                op = oh + OFFSET
                # Rows forms hold the head rows as loaded, (BLOCK_H, 2 * HALF_PAD): the norm's statistics and its
                # weight act on that tile, and only then are the pairs split in registers (a reduction or a weight
                # on the split halves costs layout conversions through shared memory).
                if NEOX_ROW:
                    m = hmask & row_mask
                    row = row_off
                    v = tl.load(xp + row_off, mask=m, other=0.0, eviction_policy=XPOL).to(cdt)
                elif INTERLEAVED:
                    m = hmask & (lanes < ROT)
                    row = lanes
                    v = tl.load(xp + lanes, mask=m, other=0.0, eviction_policy=XPOL).to(cdt)
                else:
                    m = hmask & (j < HALF)
                    a = tl.load(xp + lj, mask=m, other=0.0, eviction_policy=XPOL).to(cdt)
                    b = tl.load(xp + BH + lj, mask=m, other=0.0, eviction_policy=XPOL).to(cdt)
                if TAIL_PAD > 0:
                    pmask = hmask & (tl.arange(0, TAIL_PAD)[None, :] < PASS)
                    t = tl.load(xh + plane, mask=pmask, other=0.0, eviction_policy=XPOL).to(cdt)
                else:
                    t = tl.full((BLOCK_H, 1), 0.0, cdt)
                if NORM > 0:
                    if NEOX_ROW or INTERLEAVED:
                        ss = tl.sum(v * v, axis=1) + tl.sum(t * t, axis=1)
                    else:
                        ss = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(t * t, axis=1)
                    if NORM == 1:
                        ms = ss / HEAD_DIM + eps
                    elif ONE_BLOCK:  # every head of the token is in this tile: no first pass
                        ms = tl.sum(ss, axis=0) / (nheads * HEAD_DIM) + eps
                    if NORM == 2 and not ONE_BLOCK:
                        scale = token_scale
                    elif MATH_FP64:
                        scale = 1.0 / tl.sqrt(ms)
                    else:  # one instruction where 1 / sqrt takes two and their range fix-ups (eps keeps ms normal)
                        scale = tl.math.rsqrt(ms)
                    if NORM == 1:
                        scale = scale[:, None]
                    if NEOX_ROW or INTERLEAVED:
                        v = v * scale
                    else:
                        a = a * scale
                        b = b * scale
                    t = t * scale
                if HAS_W and not W_HEADS:  # a weight row is in the tables (above), a weight tile is applied here
                    if W_TILE:
                        if NEOX_ROW or INTERLEAVED:
                            v = v * w_row
                        else:
                            a = a * w_a
                            b = b * w_b
                    if TAIL_PAD > 0:
                        t = t * w_t
                elif HAS_W:
                    wh = w_ptr + hcol * swh
                    wp = wh + OFFSET
                    if NEOX_ROW or INTERLEAVED:
                        v = v * tl.load(wp + row, mask=m, other=0.0).to(cdt)
                    else:
                        a = a * tl.load(wp + lj, mask=m, other=0.0).to(cdt)
                        b = b * tl.load(wp + (BH + lj), mask=m, other=0.0).to(cdt)
                    if TAIL_PAD > 0:
                        t = t * tl.load(wh + plane, mask=pmask, other=0.0).to(cdt)
                if NEOX_ROW:
                    a, b = tl.split(tl.permute(tl.reshape(v, (ROWS, 2, HALF_PAD)), (0, 2, 1)))
                elif INTERLEAVED:
                    a, b = tl.split(tl.reshape(v, (ROWS, HALF_PAD, 2)))
                oa = a * ca_w - b * sa_w
                ob = b * cb_w + a * sb_w
                if DEINTERLEAVE:  # pairs read interleaved, written as the two NeoX halves
                    mo = hmask & (j < HALF)
                    tl.store(op + j, oa.to(op.dtype.element_ty), mask=mo, cache_modifier=OMOD)
                    tl.store(op + HALF + j, ob.to(op.dtype.element_ty), mask=mo, cache_modifier=OMOD)
                elif INTERLEAVED:
                    o = tl.reshape(tl.join(oa, ob), (ROWS, 2 * HALF_PAD))
                    tl.store(op + lanes, o.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
                elif NEOX_ROW:
                    o = tl.reshape(tl.permute(tl.join(oa, ob), (0, 2, 1)), (ROWS, 2 * HALF_PAD))
                    tl.store(op + row_off, o.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
                else:
                    tl.store(op + lj, oa.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
                    tl.store(op + BH + lj, ob.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
                if TAIL_PAD > 0:
                    tl.store(oh + plane, t.to(oh.dtype.element_ty), mask=pmask, cache_modifier=OMOD)


# ---------------------------------------------------------------------------------------------------------
# Host side: map any layout onto (3 token dims) x (1 head dim) x lanes.


def _is_true(cond: Any) -> bool:
    """True only when known without adding a guard (sizes may be symbolic under dynamic shapes)."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)


def _hint(v: Any, default: int) -> int:
    return v if isinstance(v, int) else default


@dataclasses.dataclass
class _Plan:
    tokens: list  # 3 sizes, outermost first
    x_strides: list  # per tensor: 4 strides (3 token dims, head dim) of x
    o_strides: list  # per tensor: the same for its output
    heads: list  # per tensor: its head count
    c_strides: list  # 3 token strides + last-dim stride of cos
    s_strides: list  # the same for sin
    head: int | None = None  # the dim of x looped over inside a program (None: one row per token)


@dataclasses.dataclass
class _Tables:
    """The tables of a launch: plain tables that broadcast against x, or cache rows picked by positions
    (then positions, with a trailing dim, stand in for the tables in the grid plan: the row is constant
    wherever positions are)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: Any = None
    weights: list = dataclasses.field(default_factory=list)  # norm weights, one per x (or None)

    def key(self) -> tuple:
        geo = [(tuple(t.shape), t.stride(), t.dtype) for t in (self.cos, self.sin, *self.weights) if t is not None]
        if self.positions is not None:
            geo.append((tuple(self.positions.shape), self.positions.stride()))
        return tuple(geo)

    def planned(self) -> tuple:
        if self.positions is None:
            return self.cos, self.sin
        p = self.positions.unsqueeze(-1)
        return p, p


def _plan(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], tables: _Tables) -> _Plan | None:
    """One launch's geometry for tensors that share tables, or None if they cannot share one grid."""
    cos, sin = tables.planned()
    lead = [tuple(x.shape[:-1]) for x in xs]
    n = len(lead[0])
    if any(len(s) != n for s in lead):
        return None
    width = cos.shape[-1]
    c_exp = [cos.expand(*s, width).stride() for s in lead]
    s_exp = [sin.expand(*s, width).stride() for s in lead]
    differ = [i for i in range(n) if any(not _is_true(s[i] == lead[0][i]) for s in lead)]
    if len(differ) > 1:
        return None
    if differ:
        head = differ[0]
    else:
        cands = [i for i in range(n)
                 if all(_is_true(st[i] == 0) for st in c_exp + s_exp)
                 and not _is_true(lead[0][i] == 1) and _hint(lead[0][i], MAX_LOOP_HEADS + 1) <= MAX_LOOP_HEADS]
        head = min(cands, key=lambda i: (_hint(abs(xs[0].stride(i)), 1 << 62), -i)) if cands else None

    # Token dims: every other non-unit dim, with the strides of every tensor that walks it.
    dims = []  # (size, [strides...]) with strides ordered: x0, o0, x1, o1, ..., cos, sin
    for i in range(n):
        if i == head or _is_true(lead[0][i] == 1):
            continue
        strides = []
        for x, o in zip(xs, outs):
            strides += [x.stride(i), o.stride(i)]
        strides += [c_exp[0][i], s_exp[0][i]]
        if any(not _is_true(c[i] == c_exp[0][i]) for c in c_exp) or \
           any(not _is_true(s[i] == s_exp[0][i]) for s in s_exp):
            return None
        dims.append((lead[0][i], strides))
    merged: list = []
    for size, strides in dims:
        if merged:
            psize, pstrides = merged[-1]
            if all(_is_true(ps == st * size) for ps, st in zip(pstrides, strides)):
                merged[-1] = (psize * size, strides)
                continue
        merged.append((size, strides))
    if len(merged) > 3:
        return None
    nstr = 2 * len(xs) + 2
    while len(merged) < 3:
        merged.insert(0, (1, [0] * nstr))
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
    return _Plan(tokens, x_strides, o_strides, heads, column(nstr - 2) + [tables.cos.stride(-1)],
                 column(nstr - 1) + [tables.sin.stride(-1)], head)


def _block_heads(heads: Sequence[Any], lanes_pad: int, tile: int = TILE_ELEMENTS) -> int:
    """Heads per loop step: the largest tile up to TILE_ELEMENTS whose padding of q's and k's head counts to
    whole blocks stays within HEAD_PAD_WASTE (the rule BENCHMARKS.md's tile sweep supports)."""
    hs = [_hint(h, 16) for h in heads if _hint(h, 16) > 0]
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
    the floor; `_launch_args` turns them off where those rows are held instead), a pass-through head (M8: 1.09 ->
    1.08), and a per-head norm over padded rows (D=80: 1.213 -> 1.209, 1.314 -> 1.301 in the head loop; held,
    1.075 -> 1.068, Flux form). At D=128 under a per-head
    norm they were slower (1.09 -> 1.12x), so nothing else takes them."""
    padded = triton.next_power_of_2(max(1, params.rotary_dim // 2)) * 2 != params.rotary_dim
    return params.norm == "rms_across_heads" or bool(params.rotary_offset) or (params.norm == "rms" and padded)


def _num_warps(tile: int, form: str) -> int:
    """A power of two (Triton requires it; a pass-through tile makes rows like 64 + 128 lanes)."""
    n = max(1, min(8, tile // ELEMENTS_PER_WARP[form]))
    return 1 << (n.bit_length() - 1)


def _prepare(x: torch.Tensor) -> torch.Tensor:
    """The kernel reads lanes with unit stride; anything else is made contiguous first."""
    if x.shape[-1] > 1 and not _is_true(x.stride(-1) == 1):
        return x.contiguous()
    return x


_LAUNCH_CACHE: dict = {}  # geometry key -> launches; keeps the host side of a repeated call to a few us


def launch(xs: list, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams, positions: Any = None,
           weights: Sequence | None = None, *, kernel: Any = None, block_h: int | None = None,
           num_warps: int | None = None, nsplit: int | None = None, neox_row: bool | None = None,
           stream: bool | None = None, held: bool | None = None) -> list:
    """Rotate 1-3 tensors sharing tables; one launch when their geometry allows it, else one each.
    With positions, the tables are rows of a cache read per token (`cos[positions]`); with a norm in params,
    each x is RMS-normalised (and scaled by its weight, one per x, which may vary over heads and lanes only)
    in the same pass. The tuning options override the rules below (the benchmarks' sweeps use them)."""
    weights = list(weights) if weights is not None else [None] * len(xs)
    tiles = dict(block_h=block_h, num_warps=num_warps, nsplit=nsplit, neox_row=neox_row, stream=stream, held=held)
    tuning = dict(kernel=kernel, **tiles)
    if params.norm != "none" and any(w is not None and not _per_lane(w, x) for w, x in zip(weights, xs)):
        return _normed_first(xs, cos, sin, params, positions, weights, tuning)
    xs = [_prepare(x) for x in xs]
    weights = [w if w is None or _is_true(w.stride(-1) == 1) else w.contiguous() for w in weights]
    outs = [torch.empty(x.shape, dtype=params.out_dtype, device=x.device) for x in xs]
    fn = kernel if kernel is not None else wrap_triton(_rotary_kernel) if _tracing(xs) else _rotary_kernel
    opts = (params, tuple(tiles.items()))
    tables = _Tables(cos, sin, positions, weights)
    try:
        key = (tuple((tuple(x.shape), x.stride(), x.dtype) for x in xs), tables.key(), opts)
        hash(key)
    except TypeError:  # symbolic sizes: plan every time
        key = None
    launches = _LAUNCH_CACHE.get(key) if key is not None else None
    if launches is None:
        launches = _make_launches(xs, outs, tables, params, **tiles)
        if launches is not None and key is not None:
            if len(_LAUNCH_CACHE) > 4096:
                _LAUNCH_CACHE.clear()
            _LAUNCH_CACHE[key] = launches
    if launches is NORM_FIRST:
        return _normed_first(xs, cos, sin, params, positions, weights, tuning)
    if launches is not None:
        pos = positions if positions is not None else cos  # unused pointers stand in for absent tensors
        checks = row_checks(positions) if fn is _rotary_kernel else {}
        for group, grid, scalars, meta in launches:
            sides = [group[min(i, len(group) - 1)] for i in range(3)]  # q, k, v; absent sides repeat the last
            ws = [weights[i] if weights[i] is not None else cos for i in sides]
            fn[grid](*(xs[i] for i in sides), *(outs[i] for i in sides), cos, sin, pos, *ws, *scalars, **meta,
                     **checks)
        return outs
    # More than 3 token dims that do not merge: materialize x and tables (rare, correct), one launch each.
    if params.norm != "none":  # materialized tables no longer show which dim holds the heads
        return _normed_first(xs, cos, sin, params, positions, weights, tuning)
    if positions is not None:  # checked: a position outside [0, rows) raises, as the kernel's assert does
        cos, sin = gather_rows(cos, positions), gather_rows(sin, positions)
    for i, x in enumerate(xs):
        if _is_true(x.numel() == 0):
            continue
        x = x.contiguous()
        c = cos.expand(*x.shape[:-1], cos.shape[-1]).contiguous()
        s = sin.expand(*x.shape[:-1], sin.shape[-1]).contiguous()
        t = _Tables(c, s, None, [weights[i]])
        p = _plan([x], [outs[i]], t)
        assert p is not None
        grid, scalars, meta = _launch_args(p, [x], [outs[i]], t, [0], params, **tiles)
        w = weights[i] if weights[i] is not None else c
        fn[grid](x, x, x, outs[i], outs[i], outs[i], c, s, c, w, w, w, *scalars, **meta)
    return outs


def row_checks(positions: Any) -> dict:
    """The compile options of a direct launch (the kernel's own launcher, outside Inductor): with positions, the
    kernel's row assert compiled in, as Inductor compiles it into the node it launches (`debug`, from its
    `assert_indirect_indexing`, with Triton's integer-overflow asserts off as Inductor turns them off). Triton
    drops `tl.device_assert` from a kernel compiled without `debug`, which on the GPU let an eager call read past
    the cache where the same call in a compiled graph raised a device-side assert."""
    return {"debug": True, "sanitize_overflow": False} if positions is not None and not _INTERPRETED else {}


def _tracing(xs: Sequence[torch.Tensor]) -> bool:
    """Whether a launch is being traced (torch.compile, make_fx, fake or functional tensors): then the kernel goes
    through `wrap_triton`, the higher-order op a tracer records. Eagerly the kernel's own launcher runs: the HOP,
    its pytree flattening and its dispatch cost about 1 ms of host time per q/k call on the H200's host."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return True
    return any(type(x) is not torch.Tensor or torch._is_functional_tensor(x) for x in xs)


class _DirectLaunches:
    """The launches of one call geometry, planned once (`plan_eager`): each later call allocates its outputs and
    launches. The first launch of an entry goes through the kernel's JIT launcher (`_rotary_kernel[grid]`), which
    returns the compiled kernel; later ones call that compiled kernel's launcher with the same arguments in the
    kernel's parameter order, as the JIT launcher does after binding them, skipping the binding and
    specialization of 80 arguments (the call geometry, the key of this plan, fixes every value and pointer
    alignment Triton specializes on). Its first use is checked once against the JIT launcher's result, outside
    CUDA graph capture; a mismatch or a launcher API this code does not know keeps the JIT launcher."""

    def __init__(self, launches: list, out_dtype: torch.dtype, checks: dict) -> None:
        # the kernel takes three sides (q, k, v); absent sides repeat the last, as in `launch`
        self.entries = [[[group[min(i, len(group) - 1)] for i in range(3)], grid, scalars, meta, None, False]
                        for group, grid, scalars, meta in launches]
        self.out_dtype = out_dtype
        self.checks = checks  # `row_checks`: compile options of the JIT launch, not kernel arguments

    def __call__(self, xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, positions: Any,
                 weights: Any) -> list:
        outs = [torch.empty(x.shape, dtype=self.out_dtype, device=x.device) for x in xs]
        pos = positions if positions is not None else cos  # unused pointers stand in for absent tensors
        weights = weights or [None] * len(xs)
        for entry in self.entries:
            sides, grid, scalars, meta, runner, checked = entry  # runner: None untried, False unavailable
            ws = [weights[i] if weights[i] is not None else cos for i in sides]
            args = (*(xs[i] for i in sides), *(outs[i] for i in sides), cos, sin, pos, *ws, *scalars)
            if checked:
                runner(*args)
            elif runner and not _capturing():
                runner = self._checked(runner, args, sides, outs, grid, {**meta, **self.checks})
                entry[4:] = (runner, True) if runner else (False, False)
            else:
                compiled = _rotary_kernel[grid](*args, **meta, **self.checks)
                if runner is None:
                    entry[4] = _compiled_runner(compiled, grid, meta, len(args)) or False
        return outs

    @staticmethod
    def _checked(runner: Any, args: tuple, sides: list, outs: list, grid: tuple, meta: dict) -> Any:
        """The compiled launcher where it writes what the JIT launcher writes, else None (one log line)."""
        mine = {i: torch.empty_like(outs[i]) for i in sides}
        jit_args = (*args[:3], *(mine[i] for i in sides), *args[6:])
        try:
            runner(*args)
        except Exception as e:  # a launcher API of another Triton version: the JIT launcher stays
            log.info("rope_fusion: Triton's compiled-kernel launcher failed (%s); the JIT launcher stays", e)
            _rotary_kernel[grid](*args, **meta)
            return None
        _rotary_kernel[grid](*jit_args, **meta)
        if all(torch.equal(outs[i].view(torch.uint8), m.view(torch.uint8)) for i, m in mine.items()):  # NaN too
            return runner
        log.warning("rope_fusion: Triton's compiled-kernel launcher wrote other values than its JIT launcher; the "
                    "JIT launcher stays")
        for i, m in mine.items():
            outs[i].copy_(m)
        return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _compiled_runner(compiled: Any, grid: tuple, meta: dict, n_args: int) -> Any:
    """`compiled[grid]` with the constexpr arguments appended in the kernel's parameter order, or None where the
    JIT launch returned no compiled kernel (the interpreter) or the parameters are not the ones expected."""
    from triton.compiler import CompiledKernel

    names = getattr(_rotary_kernel, "arg_names", None)
    if not isinstance(compiled, CompiledKernel) or names is None:
        return None
    tail = names[n_args:]
    if not all(n in meta for n in tail) or len(tail) + 1 != len(meta):  # meta also holds num_warps
        return None
    constants = tuple(meta[n] for n in tail)
    launcher = compiled[(*grid, 1, 1)[:3]]  # it reads three grid dims (the JIT launcher pads them)

    def run(*args: Any) -> None:
        launcher(*args, *constants)
    return run


def plan_eager(call: RotaryCall) -> Any:
    """The direct path of the public functions on CUDA (`library.register_device_kernel`'s planner): the launches
    of this call's geometry, planned once and reused by every call of that geometry. Geometries whose launch
    copies first (lanes with a stride, a norm applied before the rotation, dims that do not merge) call `launch`
    each time instead; other devices than CUDA: None (the reference), except under the interpreter."""
    xs, cos, sin, params = call.xs, call.cos, call.sin, call.params
    if any(t.device.type != "cuda" for t in (*xs, cos, sin)) and not _INTERPRETED:
        return None
    weights = call.norm_weights or [None] * len(xs)
    plain = (all(not (x.shape[-1] > 1 and x.stride(-1) != 1) for x in xs)
             and all(w is None or (_per_lane(w, x) and w.stride(-1) == 1) for w, x in zip(weights, xs)))
    if plain:
        outs = [torch.empty(x.shape, dtype=params.out_dtype, device=x.device) for x in xs]
        launches = _make_launches(xs, outs, _Tables(cos, sin, call.positions, weights), params)
        if isinstance(launches, list):
            return _DirectLaunches(launches, params.out_dtype, row_checks(call.positions))

    def run(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, positions: Any, weights: Any) -> list:
        return launch(list(xs), cos, sin, params, positions, weights)
    return run


def _per_lane(w: torch.Tensor, x: torch.Tensor) -> bool:
    """A norm weight the kernel may take: at most [heads, lanes] (`_norm_fits` checks it against the plan)."""
    return w.dim() <= 2


def _normed_first(xs: list, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams, positions: Any,
                  weights: list, tuning: dict) -> list:
    """A norm the kernel's loop cannot apply (a weight that varies over tokens, heads that are not the dim the
    kernel loops over): normalise first, then rotate. Correct, not fused; the pass never emits these."""
    from ..ops.reference import rms_norm

    xs = [rms_norm(x.float(), params.norm, params.norm_eps, w) for x, w in zip(xs, weights)]
    return launch(xs, cos, sin, params.replace(norm="none"), positions, None, **tuning)


NORM_FIRST = "normalise first"  # `_make_launches`: the kernel cannot apply this norm in its loop


def _norm_fits(p: _Plan, xs: list, weights: list, params: RotaryParams) -> bool:
    """The kernel normalises the rows it loops over: all heads of a token (x's dim -2) must be that loop for
    a norm across heads, and a weight may vary along that loop's dim and the lanes only."""
    if params.norm == "none":
        return True
    for x, w in zip(xs, weights):
        n = x.dim() - 1
        if params.norm == "rms_across_heads" and p.head != n - 1 and not _is_true(x.shape[-2] == 1):
            return False
        if w is not None:
            ws = w.expand(x.shape).stride()
            if not all(i == p.head or _is_true(ws[i] == 0) or _is_true(x.shape[i] == 1) for i in range(n)):
                return False
    return True


def _make_launches(xs: list, outs: list, tables: _Tables, params: RotaryParams, **tiles: Any) -> list | str | None:
    """[(tensor indices, grid, scalar args, meta args)]: one entry for all tensors together when possible;
    NORM_FIRST when the norm does not fit the kernel's loop. tiles: `launch`'s tile options (None: the rules)."""
    groups = [list(range(len(xs)))]
    plan = _plan(xs, outs, tables)
    weights = tables.weights or [None] * len(xs)
    if plan is None and len(xs) > 1:
        groups = [[i] for i in range(len(xs))]
    launches = []
    for group in groups:
        gx = [xs[i] for i in group]
        go = [outs[i] for i in group]
        if any(_is_true(x.numel() == 0) for x in gx):
            continue
        p = _plan(gx, go, tables) if len(groups) > 1 else plan
        if p is None:
            return None
        if not _norm_fits(p, gx, [weights[i] for i in group], params):
            return NORM_FIRST
        launches.append((group, *_launch_args(p, gx, go, tables, group, params, **tiles)))
    return launches


def _weight_head_stride(w: Any, x: torch.Tensor, head: int | None) -> int:
    """The head stride of a norm weight as it broadcasts against x (its lanes are contiguous: `launch`)."""
    if w is None or head is None:
        return 0
    return w.expand(x.shape).stride(head)


INT32_MAX = 2**31 - 1


def _heads_fit_int32(p: _Plan, block_h: int, weight_strides: Sequence) -> bool:
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


def _launch_args(p: _Plan, xs: list, outs: list, tables: _Tables, group: list, params: RotaryParams, *,
                 block_h: int | None = None, num_warps: int | None = None, nsplit: int | None = None,
                 neox_row: bool | None = None, stream: bool | None = None, held: bool | None = None) -> tuple:
    interleaved, rotary_dim = params.interleaved, params.rotary_dim
    head_dim = xs[0].shape[-1]
    half_pad = triton.next_power_of_2(max(1, rotary_dim // 2))
    tail_pad = triton.next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
    lanes_pad = 2 * half_pad + tail_pad  # registers per head row, the pass-through tail included
    ntok = p.tokens[0] * p.tokens[1] * p.tokens[2]
    if held is None:
        held = default_held(params, head_dim, p.heads)
    # rows held in registers (HELD, below): static head counts, a program per token, whole heads rotated from lane 0
    held = (held and params.norm != "none" and tail_pad == 0 and not params.rotary_offset
            and not params.deinterleave and all(isinstance(h, int) for h in p.heads) and isinstance(ntok, int)
            and (nsplit == 1 if nsplit is not None else ntok >= MIN_PROGRAMS)
            and max(p.heads) * lanes_pad <= HELD_ELEMENTS)
    if neox_row is None:  # held under a per-head norm, NeoX reads its halves apart (no split in registers)
        neox_row = default_neox_row(interleaved, rotary_dim, head_dim) and not (held and params.norm == "rms")
    neox_row = bool(neox_row) and not interleaved and params.rotary_blocks == 1
    tile = NORM_TILE_ELEMENTS if params.norm == "rms" else \
        HEAD_PASS_TILE_ELEMENTS if params.rotary_offset else TILE_ELEMENTS
    if held and (params.norm == "rms_across_heads" or not (interleaved or neox_row)):
        tile = HELD_TILE_ELEMENTS
    bh = block_h or _block_heads(p.heads, lanes_pad, tile)
    # a norm across heads whose heads all fit one block takes its statistics from that tile (a larger block to
    # get there was slower in the norm sweep: 1.32x against 1.17x the floor at 12 heads x 128)
    one_block = params.norm == "rms_across_heads" and all(_is_true(h <= bh) for h in p.heads)
    nblocks = sum(-(-_hint(h, 1) // bh) for h in p.heads)  # work items: head blocks of q, then of k
    if nsplit is None:
        nsplit = 1
        if params.rotary_offset:  # every head block a program of its own (HEAD_PASS_TILE_ELEMENTS)
            nsplit = nblocks
        elif isinstance(ntok, int):
            if ntok < MIN_PROGRAMS:
                nsplit = max(1, min(nblocks, -(-MIN_PROGRAMS // max(ntok, 1))))
        elif nblocks > 1:  # a symbolic token count (vLLM: decode and prefill run one graph): the same rule
            nsplit = torch.sym_max(1, torch.sym_min(nblocks, (ntok + MIN_PROGRAMS - 1) // ntok))
    toks = 1
    if (isinstance(ntok, int) and nsplit == 1 and all(isinstance(h, int) and h == 1 for h in p.heads)
            and params.norm != "rms_across_heads" and ntok % ROW_TOKENS == 0 and ntok // ROW_TOKENS >= MIN_PROGRAMS):
        toks = ROW_TOKENS
    side_blocks = [-(-h // bh) if isinstance(h, int) else 0 for h in p.heads]
    held = held and not one_block and max(side_blocks) * bh * lanes_pad <= HELD_ELEMENTS
    if held and num_warps is None:
        num_warps = _num_warps(max(side_blocks) * bh * lanes_pad,
                               "held" if params.norm == "rms_across_heads" else "held_heads")
    none = [0, 0, 0, 0]
    sk, sv = (p.x_strides[i] if len(xs) > i else none for i in (1, 2))
    sko, svo = (p.o_strides[i] if len(xs) > i else none for i in (1, 2))
    hk, hv = (p.heads[i] if len(xs) > i else 0 for i in (1, 2))
    cos, sin = tables.cos, tables.sin
    wide = math_dtype(xs, cos, sin, params.out_dtype) == torch.float64
    # with positions: the row strides and the rows that a position may pick (the kernel asserts 0 <= row < rows)
    rows = (cos.stride(0), sin.stride(0), _cache_rows(cos, sin)) if tables.positions is not None else (0, 0, 0)
    weights = [tables.weights[i] if tables.weights else None for i in group]
    wq, wk, wv = (_weight_head_stride(weights[i], xs[i], p.head) if len(xs) > i else 0 for i in range(3))
    scalars = (p.tokens[1], p.tokens[2], p.heads[0], hk, hv, nsplit, *rows, wq, wk, wv, float(params.norm_eps),
               *p.x_strides[0], *p.o_strides[0], *sk, *sko, *sv, *svo, *p.c_strides[:3], *p.s_strides[:3])
    meta = dict(ROT=rotary_dim, HEAD_DIM=head_dim, HALF_PAD=half_pad, TAIL_PAD=tail_pad, BLOCK_H=bh,
                NSIDES=len(xs), INTERLEAVED=interleaved, FULL_TABLES=params.full_tables, CONJ=params.conjugate,
                MATH_FP64=wide, NEOX_ROW=neox_row, HAS_POS=tables.positions is not None,
                NORM={"none": 0, "rms": 1, "rms_across_heads": 2}[params.norm],
                HAS_W=any(w is not None for w in weights), HEAD_PAD=triton.next_power_of_2(head_dim),
                # a weight that varies over heads is loaded per head block; one shared by every head, once
                W_HEADS=not all(_is_true(sw == 0) for sw in (wq, wk, wv)), W_TILE=lanes_pad == head_dim,
                HEAD_I64=not _heads_fit_int32(p, bh, (wq, wk, wv)),
                DEINTERLEAVE=params.deinterleave, ONE_BLOCK=one_block, OFFSET=params.rotary_offset,
                ANGLES=params.angle_tables,
                # the tables' lane strides are compile-time constants: Inductor launches the kernel with runtime
                # scalars that Triton does not specialize, and a lane stride only known at run time turns the
                # vector loads into gathers (the in-graph kernel ran at twice the time of a direct launch)
                SCD=p.c_strides[3], SSD=p.s_strides[3], BH=rotary_dim // 2 // params.rotary_blocks,
                STREAM=default_stream(params) and not (held and params.norm == "rms_across_heads")
                if stream is None else bool(stream),
                HELD=max(side_blocks) if held else 0,  # head blocks held per side (a constexpr: unrolled)
                TOKS=toks,
                num_warps=num_warps or _num_warps(bh * lanes_pad, "head_pass" if params.rotary_offset else
                                                  "rows" if interleaved or neox_row else "halves"))
    return (ntok // toks if toks > 1 else ntok, nsplit), scalars, meta


def _cache_rows(cos: torch.Tensor, sin: torch.Tensor) -> Any:
    """The rows of the cos and sin caches that a position may pick (the fewer, where the two differ)."""
    c, s = cos.shape[0], sin.shape[0]
    if isinstance(c, int) and isinstance(s, int):
        return min(c, s)
    return c if _is_true(c <= s) else s if _is_true(s <= c) else torch.sym_min(c, s)


# ---------------------------------------------------------------------------------------------------------
# The op variant, the eager kernel and the backend.


def _impl(call: RotaryCall) -> list | None:
    if any(t.device.type != "cuda" for t in (*call.xs, call.cos, call.sin)) and not _INTERPRETED:
        return None  # the reference serves other devices
    return launch(call.xs, call.cos, call.sin, call.params, call.positions, call.norm_weights)


def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(_rotary_kernel, InterpretedFunction)


_INTERPRETED = _interpreted()  # TRITON_INTERPRET=1: the kernel runs on CPU tensors (tests)

# `rope_fusion::rotary_triton` / `rotary_qk_triton`: the kernel behind an opaque op, for sites whose sizes are
# symbolic (the user-kernel node of kernels/triton_graph.py needs concrete sizes) and for direct calls.
TRITON_OPS = define_rotary_ops("_triton", _impl)  # by arity - 1
ROTARY_TRITON, ROTARY_QK_TRITON, ROTARY_QKV_TRITON = TRITON_OPS


def supports(spec: SiteSpec) -> str | None:
    """Sites this backend takes: GPU tensors of float dtypes and a static head dim the kernel can hold."""
    if spec.device_type != "cuda":  # ROCm tensors also have device type "cuda"
        return f"runs on CUDA/ROCm devices, the site is on {spec.device_type}"
    dtypes = (spec.x_dtype, spec.table_dtype, spec.params.out_dtype)
    if not all(d in SUPPORTED_DTYPES for d in dtypes):
        return f"dtypes {dtypes} not among {SUPPORTED_DTYPES}"
    head_dim = spec.head_dim
    if not isinstance(head_dim, int):
        return "the head dim is symbolic"
    if not head_dim <= MAX_HEAD_DIM:
        return f"head dim {head_dim} > {MAX_HEAD_DIM}"
    return None


def _emit(emitter: Any, call: RotaryCall, like: Any) -> list | None:
    """Inductor's own user-kernel node where the launch can be planned for the node's sizes (launched from
    generated code, no op dispatch per call). Where it cannot (sizes symbolic beyond what the node takes),
    `auto` declines the site, and the lowering takes it: the opaque op would pay the dispatcher on every call.
    Asked for by name, the backend emits that opaque op."""
    from .triton_graph import emit_triton

    if emitter.fake_mode is not None:
        outs = emit_triton(emitter.graph, emitter.fake_mode, call, like)
        if outs is not None:
            return outs
    if emitter.requested == "auto":
        emitter.declined = "its user-kernel node cannot be planned for these symbolic sizes"
        return None
    return emit_op_call(TRITON_OPS, emitter, call, like)


register_backend(Backend("triton", supports, _emit))
register_device_kernel("cuda", _impl, plan_eager)

__all__ = ["ROTARY_TRITON", "ROTARY_QK_TRITON", "ROTARY_QKV_TRITON", "TRITON_OPS", "launch", "plan_eager", "supports"]
