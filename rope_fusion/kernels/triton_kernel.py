"""The Triton rotary kernel: one program per token rotates every head row of q, k (and v) with one table row.

Why it looks the way it does (docs/design.md section 3, measured on the H200):
- RoPE is pure data movement, so the only goal is the copy floor. Every x access is a contiguous run: NeoX
  rows are loaded as their two halves, interleaved rows are loaded whole and their pairs split in registers
  (`tl.reshape` + `tl.split`, then `tl.join` to store). Loading pairs with stride 2 or through a computed
  partner index was 1.5-4.6x the floor. NeoX that rotates whole rows reads each row with one load whose
  lanes are remapped so that the tile's two halves are the row's halves (padded apart when half the head
  dim is not a power of two, as at D=80), and splits them in registers: 1.07x the floor at D=80 where two
  half loads were 1.19x. With a pass-through tail the two half loads stay (the tile sweep was even).
- q's and k's head blocks form one list of work items; NSPLIT programs per token share it (only for few
  tokens, as in decode: splitting large launches was always slower in the tile sweep; under a per-head norm,
  whose tile is small, up to 4096 tokens: the planner's NORM_SPLIT_PROGRAMS).
- The program loads its table row once and loops over the head blocks of q and then of k, so tables are read
  once and reused across all heads of both tensors, and q and k take one launch whatever their head counts.
- Tables are arbitrary strided views that broadcast against x (a slice of a packed table, the real part of
  complex freqs): they are never copied; their broadcast strides (0 on broadcast dims) come as arguments.
- Head dims that are not powers of two (80, 96, ...) are padded to one with masks. A NeoX row whose pass-through
  tail fits the padding of its two halves (96 of 128 lanes rotated) is loaded whole, the tail in the padding
  (ROW_TAIL): one load of 128 lanes, where the halves and a tail tile hold 160.
- A norm across heads, or a per-head norm over padded rows, holds the token's head rows in registers between its
  statistics and the rotation (HELD), with a pass-through tail after the rotated lanes where there is one; a
  tensor of one head takes several tokens a program (TOKS); a pass-through head gives every head block a program
  of its own; streaming cache hints (STREAM) only where the sweep measured them faster.

The three forms of a row's rotated lanes (`NEOX_ROW`, `INTERLEAVED`, else NeoX as two halves) differ in how a
block is loaded, split into the two members of each pair and stored; the `@triton.jit` helpers below hold those
forms, and Triton inlines them into the kernel. A block travels as a pair `(a, b)`: the halves in the halves form;
in the rows forms the loaded tile twice (`a is b`), which stays whole until the norm and the weight have acted on
it (a reduction or a weight on split halves costs layout conversions through shared memory) and is split then.

The host side (kernels/triton_plan.py) maps any layout onto the kernel's fixed form: up to three token dims (t0,
t1, t2, outermost first), taken by the grid, and one head dim, looped over inside a program.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as e:  # an optional backend: the registry tolerates this
    raise ImportError(f"rope_fusion.kernels.triton_kernel needs triton: {e}") from e


@triton.jit
def _rsqrt(ms, MATH_FP64: tl.constexpr):
    """1 / sqrt(ms): one instruction in fp32 where 1 / sqrt takes two and their range fix-ups (eps keeps ms
    normal); in fp64 the quotient, rsqrt being an approximation there too (rsqrt.approx.f64)."""
    if MATH_FP64:
        return 1.0 / tl.sqrt(ms)
    else:
        return tl.math.rsqrt(ms)


@triton.jit
def _block_row(lanes, row_off, lj, NEOX_ROW: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The lane offsets of a block's rotated lanes: the remapped NeoX row, the interleaved row, or the first NeoX
    half (the second is BH lanes on)."""
    if NEOX_ROW:
        return row_off
    elif INTERLEAVED:
        return lanes
    else:
        return lj


@triton.jit
def _block_mask(lanes, row_mask, j, ROT: tl.constexpr, HALF: tl.constexpr, NEOX_ROW: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """The lanes of `_block_row` that hold rotated lanes of x (the rest pad the tile to a power of two)."""
    if NEOX_ROW:
        return row_mask
    elif INTERLEAVED:
        return lanes < ROT
    else:
        return j < HALF


@triton.jit
def _load_block(ptr, row, m, BH: tl.constexpr, ROWS_FORM: tl.constexpr, XPOL: tl.constexpr, cdt: tl.constexpr):
    """A block's rotated lanes (offsets `row` from ptr, mask m) as (a, b), converted to cdt: a rows form's tile
    (twice), or the two NeoX halves."""
    if ROWS_FORM:
        v = tl.load(ptr + row, mask=m, other=0.0, eviction_policy=XPOL).to(cdt)
        return v, v
    else:
        a = tl.load(ptr + row, mask=m, other=0.0, eviction_policy=XPOL).to(cdt)
        b = tl.load(ptr + BH + row, mask=m, other=0.0, eviction_policy=XPOL).to(cdt)
        return a, b


@triton.jit
def _load_weights(wp, m, row, BH: tl.constexpr, ROWS_FORM: tl.constexpr, cdt: tl.constexpr):
    """A per-head weight's lanes for a block, as (a, b) like `_load_block`."""
    if ROWS_FORM:
        w = tl.load(wp + row, mask=m, other=0.0).to(cdt)
        return w, w
    else:
        wa = tl.load(wp + row, mask=m, other=0.0).to(cdt)
        wb = tl.load(wp + (BH + row), mask=m, other=0.0).to(cdt)
        return wa, wb


@triton.jit
def _sum_squares(a, b, ROWS_FORM: tl.constexpr):
    """Each row's sum of squares over its rotated lanes."""
    if ROWS_FORM:
        return tl.sum(a * a, axis=1)
    else:
        return tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)


@triton.jit
def _split_pairs(v, ROWS: tl.constexpr, HALF_PAD: tl.constexpr, NEOX_ROW: tl.constexpr):
    """A rows form's tile as the two members of each pair: the remapped NeoX row's halves (tile lanes l and
    HALF_PAD + l), or interleaved neighbours (lanes 2j and 2j + 1)."""
    if NEOX_ROW:
        return tl.split(tl.permute(tl.reshape(v, (ROWS, 2, HALF_PAD)), (0, 2, 1)))
    else:
        return tl.split(tl.reshape(v, (ROWS, HALF_PAD, 2)))


@triton.jit
def _join_pairs(oa, ob, ROWS: tl.constexpr, HALF_PAD: tl.constexpr, NEOX_ROW: tl.constexpr):
    """The inverse of `_split_pairs`: the rotated pairs as one tile of the row's form."""
    if NEOX_ROW:
        return tl.reshape(tl.permute(tl.join(oa, ob), (0, 2, 1)), (ROWS, 2 * HALF_PAD))
    else:
        return tl.reshape(tl.join(oa, ob), (ROWS, 2 * HALF_PAD))


@triton.jit
def _store_block(op, oa, ob, m, hmask, row, j, BH: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                 HALF_PAD: tl.constexpr, NEOX_ROW: tl.constexpr, INTERLEAVED: tl.constexpr,
                 DEINTERLEAVE: tl.constexpr, OMOD: tl.constexpr):
    """Store a block's rotated pairs in the row's form (de-interleaved: pairs read interleaved, written as the two
    NeoX halves)."""
    if DEINTERLEAVE:
        mo = hmask & (j < HALF)
        tl.store(op + j, oa.to(op.dtype.element_ty), mask=mo, cache_modifier=OMOD)
        tl.store(op + HALF + j, ob.to(op.dtype.element_ty), mask=mo, cache_modifier=OMOD)
    elif NEOX_ROW or INTERLEAVED:
        o = _join_pairs(oa, ob, ROWS, HALF_PAD, NEOX_ROW)
        tl.store(op + row, o.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
    else:
        tl.store(op + row, oa.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)
        tl.store(op + BH + row, ob.to(op.dtype.element_ty), mask=m, cache_modifier=OMOD)


@triton.jit
def _head_column(heads, HEAD_I64: tl.constexpr):
    """The block's head indices as a column; 32-bit where every head's offset in a token's rows is known to fit
    (32-bit multiplies, not 64-bit ones)."""
    if HEAD_I64:
        return heads.to(tl.int64)[:, None]
    else:
        return heads[:, None]


@triton.jit
def _token_row(ptr, i0, i1, i2, strides):
    """A token's first row of one tensor: strides (t0, t1, t2, head) hold its token dims' strides first."""
    return ptr + i0 * strides[0] + i1 * strides[1] + i2 * strides[2]


@triton.jit
def _packed_row(cu_ptr, off_ptr, batch, t):
    """Token t's row of the caches in packed sequences (ops/packed.py): t - cu_seqlens[b] (+ seqlen_offsets[b]) for
    the sequence b with cu_seqlens[b] <= t < cu_seqlens[b + 1], found by a binary search over the batch + 1 starts
    (the last start <= t: a sequence left empty by a repeated start is passed over). The range halves whatever the
    values, so every token of a (TOKS, 1) tile takes the same steps, and each step's start is in bounds. A token
    before cu_seqlens[0] or from cu_seqlens[-1] on fails the assert (compiled in where the row assert is)."""
    base = tl.full(t.shape, 0, tl.int64)
    size = batch + 1  # a runtime value: `batch` is never specialised (rotary_kernel's do_not_specialize)
    while size > 1:
        half = size // 2
        base = tl.where(tl.load(cu_ptr + base + half) <= t, base + half, base)
        size -= half
    start = tl.load(cu_ptr + base).to(tl.int64)
    inside = (start <= t) & (base < batch)
    tl.device_assert(inside, "rope_fusion: a token outside every sequence of cu_seqlens")
    row = t - start
    if off_ptr is not None:
        row += tl.load(off_ptr + base, mask=inside, other=0).to(tl.int64)
    return row


@triton.jit
def _load_tables(c_row, s_row, ia, ib, tmask, SCD: tl.constexpr, SSD: tl.constexpr, TOKS: tl.constexpr,
                 FULL_TABLES: tl.constexpr, ANGLES: tl.constexpr, CONJ: tl.constexpr, cdt: tl.constexpr):
    """The token's table row as (cos a, sin a, cos b, sin b), the entries of each pair's first and second
    member ((TOKS, 1) row pointers give (TOKS, lanes) tables); angles turned into their cos and sin, once per
    token for every head; sin negated for the conjugate rotation."""
    if TOKS > 1:
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
    if ANGLES:
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
    return ca, sa, cb, sb


E4M3_MAX = tl.constexpr(448.0)  # the largest finite float8 e4m3fn value: vLLM's FP8 cache writes saturate to it


@triton.jit
def _to_e4m3(x, scale):
    """x / scale as the float8 e4m3fn value it rounds to, in fp32: ties to even, saturated at +-448 (NaN stays NaN),
    as vLLM's reshape_and_cache_flash stores an FP8 cache (CUDA's satfinite conversion). The value is rounded here,
    in fp32 arithmetic, so that the store's conversion to fp8 is exact: on the GPU that conversion rounds the same
    way, and Triton's interpreter, which the CPU tests run, converts exact values exactly but rounds others wrongly
    (no carry into the exponent). Normal values keep 3 mantissa bits (the fp32 bit pattern rounded at bit 20);
    subnormal ones (below 2^-6) are multiples of 2^-9, rounded by the magic-number addition."""
    q = tl.math.div_rn(x.to(tl.float32), scale)
    q = tl.where(q > E4M3_MAX, E4M3_MAX, tl.where(q < -E4M3_MAX, -E4M3_MAX, q))
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = ((tl.abs(q) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sub = tl.where(bits < 0, -sub, sub)  # the sign, a negative zero's included
    out = tl.where(tl.abs(q) < 0.015625, sub, normal)
    return tl.where(q != q, q, out)


@triton.jit
def _copy_rows(src, dst, src_sh, dst_sh, heads_n, first, nsplit, eps, w_ptr, w_sh, scale_ptr,
               V_DIM: tl.constexpr, V_PAD: tl.constexpr, BLOCK_V: tl.constexpr, V_NORM: tl.constexpr,
               V_W: tl.constexpr, FP8: tl.constexpr, MATH_FP64: tl.constexpr, cdt: tl.constexpr):
    """Copy one token's rows of v (heads_n heads of V_DIM lanes, BLOCK_V heads a block, blocks first, first +
    nsplit, ...) into its cache slot: RMS-normalised and times the weight first with V_NORM (MLA's latent norm),
    quantised to FP8 by the cache's scale with FP8. Head offsets in 64 bits: a cache's head stride may be a page."""
    lanes = tl.arange(0, V_PAD)[None, :]
    nblocks = (heads_n + BLOCK_V - 1) // BLOCK_V
    for hb in range(first, nblocks, nsplit):
        heads = (hb * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)[:, None]
        m = (heads < heads_n) & (lanes < V_DIM)
        v = tl.load(src + heads * src_sh + lanes, mask=m, other=0.0)
        if V_NORM:
            vf = v.to(cdt)
            vf = vf * _rsqrt(tl.sum(vf * vf, axis=1) / V_DIM + eps, MATH_FP64)[:, None]
            if V_W:
                vf = vf * tl.load(w_ptr + heads * w_sh + lanes, mask=m, other=0.0).to(cdt)
            v = vf
        if FP8:
            v = _to_e4m3(v, tl.load(scale_ptr))
        tl.store(dst + heads * dst_sh + lanes, v.to(dst.dtype.element_ty), mask=m)


# `batch` stays a runtime value even where it is 1, so that the binary search over cu_seqlens is a loop of the
# compiled kernel on every Triton release (a specialised 1 would be a Python int there)
@triton.jit(do_not_specialize=["batch"])
def rotary_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, cos_ptr, sin_ptr, pos_ptr, wq_ptr, wk_ptr, wv_ptr,
    tokens_1, tokens_2, q_heads, k_heads, v_heads, nsplit, cos_stride_row, sin_stride_row, cache_rows,
    wq_stride_head, wk_stride_head, wv_stride_head, eps_bits,
    q_stride_t0, q_stride_t1, q_stride_t2, q_stride_head, qo_stride_t0, qo_stride_t1, qo_stride_t2, qo_stride_head,
    k_stride_t0, k_stride_t1, k_stride_t2, k_stride_head, ko_stride_t0, ko_stride_t1, ko_stride_t2, ko_stride_head,
    v_stride_t0, v_stride_t1, v_stride_t2, v_stride_head, vo_stride_t0, vo_stride_t1, vo_stride_t2, vo_stride_head,
    cos_stride_t0, cos_stride_t1, cos_stride_t2, sin_stride_t0, sin_stride_t1, sin_stride_t2,
    ROT: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, NSIDES: tl.constexpr, INTERLEAVED: tl.constexpr, FULL_TABLES: tl.constexpr,
    CONJ: tl.constexpr, MATH_FP64: tl.constexpr, NEOX_ROW: tl.constexpr, HAS_POS: tl.constexpr,
    NORM: tl.constexpr, HAS_W: tl.constexpr, HEAD_PAD: tl.constexpr, DEINTERLEAVE: tl.constexpr,
    ONE_BLOCK: tl.constexpr, SCD: tl.constexpr, SSD: tl.constexpr, BH: tl.constexpr, OFFSET: tl.constexpr,
    ANGLES: tl.constexpr, W_HEADS: tl.constexpr, W_TILE: tl.constexpr, HEAD_I64: tl.constexpr,
    STREAM: tl.constexpr, HELD: tl.constexpr, TOKS: tl.constexpr,
    off_ptr=None, batch=None, PACKED: tl.constexpr = False, OFFSET_Q_ONLY: tl.constexpr = False,
    CAT: tl.constexpr = False, CAT_SLOT: tl.constexpr = 0, cat_split=None, q2_ptr=None, k2_ptr=None,
    wq2_ptr=None, wk2_ptr=None, q2_stride_t0=None, q2_stride_t1=None, q2_stride_t2=None, q2_stride_head=None,
    k2_stride_t0=None, k2_stride_t1=None, k2_stride_t2=None, k2_stride_head=None,
    KV_CACHE: tl.constexpr = False, slot_ptr=None, n_slots=None, block_size=None, kv_capacity=None,
    kc_ptr=None, kc_stride_block=None, kc_stride_slot=None, kc_stride_head=None,
    vc_ptr=None, vc_stride_block=None, vc_stride_slot=None, vc_stride_head=None,
    vsrc_ptr=None, vsrc_stride_token=None, vsrc_stride_head=None, vsrc_heads=None,
    k_scale_ptr=None, v_scale_ptr=None, wvn_ptr=None, wvn_stride_head=None,
    KC_FP8: tl.constexpr = False, VC_FP8: tl.constexpr = False, V_DIM: tl.constexpr = 0, V_PAD: tl.constexpr = 0,
    BLOCK_V: tl.constexpr = 1, V_NORM: tl.constexpr = False, V_W: tl.constexpr = False,
    ROW_TAIL: tl.constexpr = False, qo_off=None, ko_off=None, vo_off=None,
):
    """Rotate the rows of one token of q (and k, and v): grid = (tokens, nsplit).

    Strides are named by tensor (q, its output qo, ...) and axis: t0, t1, t2 the token dims of the grid (sizes
    tokens_0 = the grid's share, tokens_1, tokens_2), head the dim looped over; with positions (HAS_POS) the
    cos_stride_t* are the strides of positions, and a row of the caches is cos_stride_row apart. With PACKED too,
    the tokens are packed sequences (`_packed_row`): pos_ptr holds their `batch` + 1 starts cu_seqlens, off_ptr
    their first rows seqlen_offsets (None: 0), and cos_stride_t* turn the token dims into the index along x's
    first dim (the planner's geometry of the positions the op would derive). Launches without it leave the last
    three parameters at their defaults, which compile to the code they compiled to before these existed.
    The head blocks of q, then of k, then of v form one list of work items; program `split` of a token takes items
    split, split + nsplit, ... (nsplit = 1: one program does all of q and k; nsplit = 2 with one block each:
    q and k in separate programs of the same launch). NORM 1 RMS-normalises each head row first, NORM 2 all
    heads of the token (from the tile itself when one block holds every head, ONE_BLOCK; else a first pass
    over the token's rows sums their squares), times the per-lane weight. NeoX pairs lie within blocks of
    2 * BH lanes (BH = ROT / 2: one block, plain NeoX). The rotated lanes start at lane OFFSET; the others
    (a pass-through head before them, a tail after them) form one pass-through tile of TAIL_PAD lanes; with
    OFFSET_Q_ONLY that is q's alone, and k (and v) rotate rows of ROT lanes from lane 0 (its default, off,
    compiles to the code before it existed). With CAT, x of q (and k) is the join of two pieces along token dim
    CAT_SLOT (0, 1, 2: t0, t1, t2), as `cat([x, x2], dim)` would write it: the tokens from index cat_split on
    read the second piece (q2_ptr, k2_ptr at index - cat_split, strides q2_stride_*, its norm weight wq2_ptr,
    wk2_ptr), the others the first; the output is the joined tensor (ops/cat_rotary.py, docs/design.md 4.4).
    Off by default, compiling to the code before it existed; one token a program (TOKS 1) under it.
    With KV_CACHE (ops/kv_cache.py, docs/design.md 4.6), the program is also its token's KV-cache write: the
    tokens are x's first dim, the token's slot is slot_mapping[token] (slot_ptr; -1, and every token from n_slots
    on, writes nothing; a slot past kv_capacity fails the device assert and writes nothing), and k's rotated rows
    (the whole head, pass-through lanes included) are stored into the slot's rows of the k cache (kc_ptr, strides
    per block, slot and head; lanes contiguous) instead of an output, quantised to FP8 by *k_scale_ptr with
    KC_FP8; then v's rows (vsrc_ptr, vsrc_heads heads of V_DIM lanes, BLOCK_V a block, work items after k's) are
    copied into the v cache's slot, normalised first with V_NORM. Off by default, compiling to the code before it
    existed; NSIDES 2 and one token a program under it. With ROW_TAIL (NEOX_ROW, OFFSET 0, TAIL_PAD 0), the lanes
    past ROT, no more than the halves' padding holds, are loaded into that padding and pass through the rotation;
    off, the code before it existed. With qo_off (and ko_off, vo_off), each output is written that many elements
    past its pointer: a rotation written into rows of a larger tensor that the launch is handed whole (the slice
    and into folds' user-kernel node, kernels/triton_slice.py); None, the code before it existed."""
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = HEAD_DIM - ROT
    ROWS_FORM: tl.constexpr = NEOX_ROW or INTERLEAVED  # a block is one tile, split into pairs in registers
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
    # eps comes as its fp32 bits (`triton_plan.eps_bits`): a float argument is fp32 to Triton's launcher and fp64 to
    # Inductor's, so a user-kernel node and a direct launch of one plan compiled two binaries, whose instruction
    # schedules differed and the node's ran 4-7% slower (the Flux joint cat). An int is i32 to both.
    eps = tl.cast(tl.cast(eps_bits, tl.int32), tl.float32, bitcast=True)
    eps = tl.cast(eps, cdt)
    tok = tl.program_id(0).to(tl.int64)
    if TOKS > 1:  # TOKS single-row tokens a program, as a (TOKS, lanes) tile (one head: MLA's k_pe)
        tok = tok * TOKS + tl.arange(0, TOKS).to(tl.int64)[:, None]
    ROWS: tl.constexpr = BLOCK_H * TOKS  # rows of a tile: heads of a token, or tokens of one head
    split = tl.program_id(1)
    i2 = tok % tokens_2
    rest = tok // tokens_2
    i1 = rest % tokens_1
    i0 = rest // tokens_1

    # The table row of this token: loaded once, reused by every head of q and k.
    lanes = tl.arange(0, 2 * HALF_PAD)[None, :]
    if NEOX_ROW:
        # NeoX as one row load: tile lane l < HALF_PAD holds x lane l, lane HALF_PAD + l holds x lane HALF + l,
        # so the (2, HALF_PAD) reshape of the tile is the two halves, split in registers like interleaved
        # pairs. Each half is one affine run of addresses, so the load stays vectorized.
        tl_half = lanes >= HALF_PAD
        if ROW_TAIL:
            # A pass-through tail that fits the halves' padding is loaded into it: tile lane HALF + m of the first
            # half holds x lane ROT + m, of the second half x lane ROT + HALF_PAD - HALF + m. The whole row is one
            # load with no lane wasted where the tail fills the padding (MiniMax-H3's 96 of 128 lanes: 128 register
            # lanes, not two padded halves and a tail tile, 160); its pairs (l, HALF_PAD + l) with l >= HALF are
            # tail lanes, which the tables pass through (cos 1, sin 0, below).
            # Each of the four runs is tile lane l plus a constant (the last run's is 0), spelled as a choice among
            # runs of consecutive addresses: Triton then keeps the loads and stores vectorised (as l plus a chosen
            # constant, or through each half's lane index, the loads were 2-byte scalars in the PTX for sm_90).
            second = tl.where(lanes < HALF_PAD + HALF, lanes + (HALF - HALF_PAD), lanes)
            row_off = tl.where(lanes < HALF, lanes, tl.where(lanes < HALF_PAD, lanes + (ROT - HALF), second))
            row_mask = row_off < HEAD_DIM
        else:
            row_off = tl.where(tl_half, lanes - HALF_PAD + HALF, lanes)
            row_mask = tl.where(tl_half, lanes - HALF_PAD, lanes) < HALF
    else:
        row_off = lanes  # unused: stand-ins for the helpers' arguments
        row_mask = lanes
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
    if HAS_POS:  # a cache row per token: cos_stride_t* are the strides of positions over the token dims
        if PACKED:  # pos_ptr holds cu_seqlens, and cos_stride_t* give the token's index in x's first dim
            pos = _packed_row(pos_ptr, off_ptr, batch, i0 * cos_stride_t0 + i1 * cos_stride_t1 + i2 * cos_stride_t2)
        else:
            pos = tl.load(pos_ptr + i0 * cos_stride_t0 + i1 * cos_stride_t1 + i2 * cos_stride_t2).to(tl.int64)
        # the op's rule, 0 <= row < cache_rows (the pass wraps negative positions in the graph where the model's
        # indexing wraps them): a row outside fails as Inductor's own gathers fail, a device-side assert, which
        # is compiled in where Inductor compiles its own (its kernels and this one: `assert_indirect_indexing`)
        tl.device_assert((pos >= 0) & (pos < cache_rows), "rope_fusion: a position outside [0, rows) of the cache")
        c_row = cos_ptr + pos * cos_stride_row
        s_row = sin_ptr + pos * sin_stride_row
    else:
        c_row = cos_ptr + i0 * cos_stride_t0 + i1 * cos_stride_t1 + i2 * cos_stride_t2
        s_row = sin_ptr + i0 * sin_stride_t0 + i1 * sin_stride_t1 + i2 * sin_stride_t2
    ca, sa, cb, sb = _load_tables(c_row, s_row, ia, ib, tmask, SCD, SSD, TOKS, FULL_TABLES, ANGLES, CONJ, cdt)
    if ROW_TAIL:  # the pairs past HALF are tail lanes in the padding: rotated by cos 1, sin 0, they pass through
        pair = tmask[None, :]
        ca = tl.where(pair, ca, 1.0)
        cb = tl.where(pair, cb, 1.0)
        sa = tl.where(pair, sa, 0.0)
        sb = tl.where(pair, sb, 0.0)

    hoffs = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF_PAD)[None, :]
    lj = lt[None, :]
    nbq = (q_heads + BLOCK_H - 1) // BLOCK_H
    nbk = (k_heads + BLOCK_H - 1) // BLOCK_H
    # each side's tensors, head count and strides, picked by the side's index (a compile-time constant)
    x_ptrs = (q_ptr, k_ptr, v_ptr)
    o_ptrs = (qo_ptr, ko_ptr, vo_ptr)
    if qo_off is not None:  # outputs at an offset into the tensors passed (a compile-time choice)
        o_ptrs = (qo_ptr + qo_off, ko_ptr + ko_off, vo_ptr + vo_off)
    w_ptrs = (wq_ptr, wk_ptr, wv_ptr)
    side_heads = (q_heads, k_heads, v_heads)
    w_strides = (wq_stride_head, wk_stride_head, wv_stride_head)
    x_strides = ((q_stride_t0, q_stride_t1, q_stride_t2, q_stride_head),
                 (k_stride_t0, k_stride_t1, k_stride_t2, k_stride_head),
                 (v_stride_t0, v_stride_t1, v_stride_t2, v_stride_head))
    o_strides = ((qo_stride_t0, qo_stride_t1, qo_stride_t2, qo_stride_head),
                 (ko_stride_t0, ko_stride_t1, ko_stride_t2, ko_stride_head),
                 (vo_stride_t0, vo_stride_t1, vo_stride_t2, vo_stride_head))
    # each side's first rotated lane and pass-through tile: with OFFSET_Q_ONLY the sides after q rotate their whole
    # head (ROT lanes) from lane 0, with no pass-through tile (DeepSeek's k_pe, in the launch of q's rope lanes
    # after its nope lanes); else every side alike
    KV_OFFSET: tl.constexpr = 0 if OFFSET_Q_ONLY else OFFSET
    KV_TAIL: tl.constexpr = 0 if OFFSET_Q_ONLY else TAIL_PAD
    SIDE_OFFSET: tl.constexpr = (OFFSET, KV_OFFSET, KV_OFFSET)
    SIDE_TAIL: tl.constexpr = (TAIL_PAD, KV_TAIL, KV_TAIL)
    SIDE_FP8: tl.constexpr = (False, KC_FP8, False)  # k's rows go to an FP8 cache (KV_CACHE)
    if KV_CACHE:  # the token's cache slot: a padding token (slot < 0), or one past slot_mapping, writes nothing
        slot = tl.load(slot_ptr + tok, mask=tok < n_slots, other=-1).to(tl.int64)
        tl.device_assert(slot < kv_capacity, "rope_fusion: a slot outside the KV cache's blocks")
        slot_ok = (slot >= 0) & (slot < kv_capacity)
        slot = tl.where(slot_ok, slot, 0)
        kc_row = kc_ptr + (slot // block_size) * kc_stride_block + (slot % block_size) * kc_stride_slot
        vc_row = vc_ptr + (slot // block_size) * vc_stride_block + (slot % block_size) * vc_stride_slot
        if KC_FP8:
            k_scale = tl.load(k_scale_ptr)
    for side in tl.static_range(NSIDES):
        # side 0 is q, 1 is k, 2 is v: a compile-time choice, so each side's code has its own dtypes.
        x_row = _token_row(x_ptrs[side], i0, i1, i2, x_strides[side])
        o_row = _token_row(o_ptrs[side], i0, i1, i2, o_strides[side])
        sxh = x_strides[side][3]
        soh = o_strides[side][3]
        nheads = side_heads[side]
        w_ptr = w_ptrs[side]
        swh = w_strides[side]
        if KV_CACHE:
            if side == 1:  # k's rows go to the slot's rows of the k cache; none for a token that writes nothing
                o_row = kc_row
                soh = kc_stride_head
                nheads = tl.where(slot_ok, nheads, 0)
        if CAT:  # the token's piece of a joined x: a select per program (the rows of a token are in one piece)
            ci = (i0, i1, i2)[CAT_SLOT]
            second = ci >= cat_split
            s2 = ((q2_stride_t0, q2_stride_t1, q2_stride_t2, q2_stride_head),
                  (k2_stride_t0, k2_stride_t1, k2_stride_t2, k2_stride_head))[side]
            if CAT_SLOT == 0:
                x2_row = _token_row((q2_ptr, k2_ptr)[side], i0 - cat_split, i1, i2, s2)
            elif CAT_SLOT == 1:
                x2_row = _token_row((q2_ptr, k2_ptr)[side], i0, i1 - cat_split, i2, s2)
            else:
                x2_row = _token_row((q2_ptr, k2_ptr)[side], i0, i1, i2 - cat_split, s2)
            x_row = tl.where(second, x2_row, x_row)
            sxh = tl.where(second, s2[3], sxh)
            if HAS_W:
                w_ptr = tl.where(second, (wq2_ptr, wk2_ptr)[side], w_ptr)
        if side == 0:
            first = split
        else:  # the split that takes this side's first block, after the blocks of q (and of k)
            before = nbq if side == 1 else nbq + nbk
            first = (split + nsplit - before % nsplit) % nsplit
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
            wrow = _block_row(lanes, row_off, lj, NEOX_ROW, INTERLEAVED)
            wmask = _block_mask(lanes, row_mask, j, ROT, HALF, NEOX_ROW, INTERLEAVED)
            w_a = tl.load(w_ptr + SIDE_OFFSET[side] + (wrow + wz), mask=wmask & (wz == 0), other=0.0).to(cdt)
            if ROWS_FORM:
                w_b = w_a
            else:
                w_b = tl.load(w_ptr + SIDE_OFFSET[side] + (BH + wrow + wz), mask=wmask & (wz == 0), other=0.0).to(cdt)
            if SIDE_TAIL[side] > 0:
                w_t = tl.load(w_ptr + (plane + wz), mask=(tl.arange(0, TAIL_PAD)[None, :] < PASS) & (wz == 0),
                              other=0.0).to(cdt)
            # A weight row broadcast over the heads (padded lanes: W_TILE off) is folded into this side's table
            # rows, once per program: x * w then the rotation is (x_a * w_a) * c_a - (x_b * w_b) * s_a =
            # x_a * (w_a * c_a) - x_b * (w_b * s_a), a multiply an element fewer in the loop (D=80: 1.26-1.34x ->
            # 1.20-1.31x the floor). A weight tile stays a multiply in the loop: folded, the four tables become
            # whole tiles too, and the registers they take cost more (D=128 NeoX 1.10 -> 1.18x; BENCHMARKS.md).
            if not W_TILE:
                if ROWS_FORM:
                    wa, wb = _split_pairs(w_a, 1, HALF_PAD, NEOX_ROW)
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
            # Tile choice). Blocks are held as loaded, in x's dtype (`held`, and `held_b` for the second halves).
            # A pass-through tail after the rotated lanes (a partial rotation: MiniMax-H3's 96 of 128 lanes) is
            # held beside them (`held_t`); without one (SIDE_TAIL 0, every held launch the planner made before it
            # held tails) none of its code is emitted.
            held = ()
            held_b = ()
            held_t = ()
            total = tl.full((BLOCK_H,), 0.0, cdt)
            for hb in tl.static_range(HELD):
                heads = hb * BLOCK_H + hoffs
                hcol = _head_column(heads, HEAD_I64)
                hmask = (heads < nheads)[:, None]
                row = _block_row(lanes, row_off, lj, NEOX_ROW, INTERLEAVED)
                # the mask a keyword: Triton evaluates a call's keywords before its positional arguments, and the
                # mask before the address is the order of the code this replaced (the same PTX)
                v, vb = _load_block(x_row + hcol * sxh, row,
                                    m=hmask & _block_mask(lanes, row_mask, j, ROT, HALF, NEOX_ROW, INTERLEAVED),
                                    BH=BH, ROWS_FORM=ROWS_FORM, XPOL=XPOL, cdt=x_row.dtype.element_ty)
                held_b = held_b + (vb,)
                held = held + (v,)
                if SIDE_TAIL[side] > 0:
                    t = tl.load(x_row + hcol * sxh + plane, mask=hmask & (tl.arange(0, TAIL_PAD)[None, :] < PASS),
                                other=0.0, eviction_policy=XPOL)
                    held_t = held_t + (t,)
                if NORM == 2:
                    vf = v.to(cdt)
                    total += tl.sum(vf * vf, axis=1)
                    if not ROWS_FORM:
                        vf = vb.to(cdt)
                        total += tl.sum(vf * vf, axis=1)
                    if SIDE_TAIL[side] > 0:
                        vf = t.to(cdt)
                        total += tl.sum(vf * vf, axis=1)
            if NORM == 2:
                token_scale = _rsqrt(tl.sum(total, axis=0) / (nheads * HEAD_DIM) + eps, MATH_FP64)
            for hb in tl.static_range(HELD):
                heads = hb * BLOCK_H + hoffs
                hmask = (heads < nheads)[:, None]
                hcol = _head_column(heads, HEAD_I64)
                row = _block_row(lanes, row_off, lj, NEOX_ROW, INTERLEAVED)
                m = hmask & _block_mask(lanes, row_mask, j, ROT, HALF, NEOX_ROW, INTERLEAVED)
                a = held[hb].to(cdt)
                b = held_b[hb].to(cdt)
                if SIDE_TAIL[side] > 0:
                    t = held_t[hb].to(cdt)
                    pmask = hmask & (tl.arange(0, TAIL_PAD)[None, :] < PASS)
                if NORM == 2:
                    scale = token_scale
                else:  # a per-head norm: each row's own scale
                    ss = _sum_squares(a, b, ROWS_FORM)
                    if SIDE_TAIL[side] > 0:
                        ss += tl.sum(t * t, axis=1)
                    scale = _rsqrt(ss / HEAD_DIM + eps, MATH_FP64)[:, None]
                a = a * scale
                b = b * scale
                if SIDE_TAIL[side] > 0:
                    t = t * scale
                if HAS_W and not W_HEADS:
                    if W_TILE:
                        a = a * w_a
                        b = b * w_b
                    if SIDE_TAIL[side] > 0:
                        t = t * w_t
                elif HAS_W:
                    wa, wb = _load_weights(w_ptr + hcol * swh, m, row, BH, ROWS_FORM, cdt)
                    a = a * wa
                    b = b * wb
                    if SIDE_TAIL[side] > 0:
                        t = t * tl.load(w_ptr + hcol * swh + plane, mask=pmask, other=0.0).to(cdt)
                if ROWS_FORM:
                    a, b = _split_pairs(a, BLOCK_H, HALF_PAD, NEOX_ROW)
                oa = a * ca_w - b * sa_w
                ob = b * cb_w + a * sb_w
                if SIDE_FP8[side]:
                    oa = _to_e4m3(oa, k_scale)
                    ob = _to_e4m3(ob, k_scale)
                _store_block(o_row + hcol * soh, oa, ob, m, hmask, row, j, BH, HALF, BLOCK_H, HALF_PAD, NEOX_ROW,
                             INTERLEAVED, False, OMOD)
                if SIDE_TAIL[side] > 0:
                    tl.store(o_row + hcol * soh + plane, t.to(o_row.dtype.element_ty), mask=pmask,
                             cache_modifier=OMOD)
        else:
            if NORM == 2 and not ONE_BLOCK:  # one scale for every head of the token: a first pass sums the squares
                total = tl.full((BLOCK_H,), 0.0, cdt)
                whole = tl.arange(0, HEAD_PAD)[None, :]
                for hb in range(0, nblocks):
                    heads = hb * BLOCK_H + hoffs
                    hcol = _head_column(heads, HEAD_I64)
                    xp = x_row + hcol * sxh
                    v = tl.load(xp + whole, mask=(heads < nheads)[:, None] & (whole < HEAD_DIM), other=0.0).to(cdt)
                    total += tl.sum(v * v, axis=1)
                token_scale = _rsqrt(tl.sum(total, axis=0) / (nheads * HEAD_DIM) + eps, MATH_FP64)
            for hb in range(first, nblocks, nsplit):
                heads = hb * BLOCK_H + hoffs
                hmask = (heads < nheads)[:, None]
                hcol = _head_column(heads, HEAD_I64)
                xh = x_row + hcol * sxh
                oh = o_row + hcol * soh
                row = _block_row(lanes, row_off, lj, NEOX_ROW, INTERLEAVED)
                m = hmask & _block_mask(lanes, row_mask, j, ROT, HALF, NEOX_ROW, INTERLEAVED)
                a, b = _load_block(xh + SIDE_OFFSET[side], row, m, BH, ROWS_FORM, XPOL, cdt)  # the rotated lanes
                if SIDE_TAIL[side] > 0:
                    pmask = hmask & (tl.arange(0, TAIL_PAD)[None, :] < PASS)
                    t = tl.load(xh + plane, mask=pmask, other=0.0, eviction_policy=XPOL).to(cdt)
                else:
                    t = tl.full((BLOCK_H, 1), 0.0, cdt)
                if NORM > 0:
                    ss = _sum_squares(a, b, ROWS_FORM) + tl.sum(t * t, axis=1)
                    if NORM == 1:
                        scale = _rsqrt(ss / HEAD_DIM + eps, MATH_FP64)[:, None]
                    elif ONE_BLOCK:  # every head of the token is in this tile: no first pass
                        scale = _rsqrt(tl.sum(ss, axis=0) / (nheads * HEAD_DIM) + eps, MATH_FP64)
                    else:
                        scale = token_scale
                    a = a * scale
                    b = b * scale
                    t = t * scale
                if HAS_W and not W_HEADS:  # a weight row is in the tables (above), a weight tile is applied here
                    if W_TILE:
                        a = a * w_a
                        b = b * w_b
                    if SIDE_TAIL[side] > 0:
                        t = t * w_t
                elif HAS_W:
                    wh = w_ptr + hcol * swh
                    wa, wb = _load_weights(wh + SIDE_OFFSET[side], m, row, BH, ROWS_FORM, cdt)
                    a = a * wa
                    b = b * wb
                    if SIDE_TAIL[side] > 0:
                        t = t * tl.load(wh + plane, mask=pmask, other=0.0).to(cdt)
                if ROWS_FORM:
                    a, b = _split_pairs(a, ROWS, HALF_PAD, NEOX_ROW)
                oa = a * ca_w - b * sa_w
                ob = b * cb_w + a * sb_w
                if SIDE_FP8[side]:
                    oa = _to_e4m3(oa, k_scale)
                    ob = _to_e4m3(ob, k_scale)
                _store_block(oh + SIDE_OFFSET[side], oa, ob, m, hmask, row, j, BH, HALF, ROWS, HALF_PAD, NEOX_ROW,
                             INTERLEAVED, DEINTERLEAVE, OMOD)
                if SIDE_TAIL[side] > 0:
                    if SIDE_FP8[side]:
                        t = _to_e4m3(t, k_scale)
                    tl.store(oh + plane, t.to(oh.dtype.element_ty), mask=pmask, cache_modifier=OMOD)
    if KV_CACHE:  # v's rows into the v cache's slot: work items after the head blocks of q and of k
        before = nbq + nbk
        _copy_rows(vsrc_ptr + tok * vsrc_stride_token, vc_row, vsrc_stride_head, vc_stride_head,
                   tl.where(slot_ok, vsrc_heads, 0), (split + nsplit - before % nsplit) % nsplit, nsplit, eps,
                   wvn_ptr, wvn_stride_head, v_scale_ptr, V_DIM, V_PAD, BLOCK_V, V_NORM, V_W, VC_FP8, MATH_FP64, cdt)
