"""Inductor lowering of the rotary ops: one pointwise node per rotated tensor.

The inner function loads x at the lane and at its partner (index arithmetic with ModularIndexing, so
every load stays in bounds) and the tables at the lane or pair index; a cache row picked by positions is a
checked indirect index, so a position outside [0, rows) raises (on the CPU an error naming positions, on a GPU
Inductor's device-side assert, as plain compile's own gather). Packed sequences
(`cu_seqlens`) get their positions from ops/packed.py's arithmetic applied to Inductor's own lowerings, then
take the same path. Inductor then fuses
the node with its neighbours (casts, norms) into one generated kernel. On the GPU this form of access is
slower than the hand-written Triton kernel (docs/design.md section 3), so there it is chosen only where the
cost model says fusing with neighbours wins.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.lowering import register_lowering
from torch._inductor.utils import sympy_index_symbol  # noqa: F401  (import check for old torch)
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import ModularIndexing

from .op_definition import OPS
from .packed import packed_positions
from .reference import positions_error
from .schema import RotaryCall, RotaryParams


def _compute_dtype(x, cos, sin, out_dtype):
    wide = torch.float64 in (x.get_dtype(), cos.get_dtype(), sin.get_dtype())
    return torch.float64 if wide and out_dtype in (torch.float32, torch.float64) else torch.float32


def _rotary_pointwise(x, cos, sin, p: RotaryParams, positions=None):
    full_tables, conjugate, out_dtype = p.full_tables, p.conjugate, p.out_dtype
    size = list(x.get_size())
    nd = len(size)
    head = size[-1]
    r = p.rotary_dim
    cd = _compute_dtype(x, cos, sin, out_dtype)
    x_load = x.make_loader()
    tables = []
    if positions is not None:  # tables are cache rows: the row index is loaded from positions per token
        psize = list(positions.get_size())
        pos_load = positions.make_loader()
        rows = cos.get_size()[0]
        named = x.get_device() is not None and x.get_device().type == "cpu"  # `_cache_row`
    for t in (cos, sin):
        tsize = list(t.get_size()) if positions is None else [*positions.get_size(), t.get_size()[-1]]
        offset = nd - len(tsize)
        tables.append((t.make_loader(), tsize, offset))

    def table_index(tsize, offset, idx, lane):
        out = []
        for i, s in enumerate(tsize[:-1]):
            out.append(0 if s == 1 else idx[offset + i])
        if positions is not None:
            row = pos_load([0 if s == 1 else idx[nd - len(psize) - 1 + i] for i, s in enumerate(psize)])
            return [_cache_row(row, rows, named), lane]
        out.append(lane)
        return out

    off = p.rotary_offset
    # the lane within the rotated part; with a pass-through head, taken modulo R so that the index arithmetic
    # (and so every load) stays in bounds on the lanes outside it, whose value the final `where` discards
    shift = (-off) % r

    def inner_fn(idx):
        *lead, d_out = idx
        d = ModularIndexing(d_out + shift, 1, r) if off else d_out
        lane_x, partner, is_second, pair = _pair_lanes(d, p)
        lane = ModularIndexing(d, 1, r) if full_tables else pair
        xv = ops.to_dtype(x_load([*lead, off + lane_x]), cd)
        xp = ops.to_dtype(x_load([*lead, off + partner]), cd)
        (cl, cs, co), (sl, ss, so) = tables
        c = ops.to_dtype(cl(table_index(cs, co, lead, lane)), cd)
        s = ops.to_dtype(sl(table_index(ss, so, lead, lane)), cd)
        if p.angle_tables:
            c, s = ops.cos(c), ops.sin(s)
        second = ops.index_expr(is_second, torch.int32)
        sign_pos = ops.eq(second, ops.constant(0 if conjugate else 1, torch.int32))
        xs = ops.mul(xp, s)
        rot = ops.where(sign_pos, ops.add(ops.mul(xv, c), xs), ops.sub(ops.mul(xv, c), xs))
        if off:
            lane = ops.index_expr(d_out, torch.int64)
            in_rot = ops.and_(ops.ge(lane, ops.constant(off, torch.int64)),
                              ops.lt(lane, ops.constant(off + r, torch.int64)))
            rot = ops.where(in_rot, rot, ops.to_dtype(x_load([*lead, d_out]), cd))
        elif not V.graph.sizevars.statically_known_equals(head, r):
            in_rot = ops.lt(ops.index_expr(d, torch.int64), ops.constant(r, torch.int64))
            rot = ops.where(in_rot, rot, xv if not p.deinterleave else ops.to_dtype(x_load([*lead, d]), cd))
        return ops.to_dtype(rot, out_dtype)

    return ir.Pointwise.create(device=x.get_device(), dtype=out_dtype, inner_fn=inner_fn, ranges=size)


def _pair_lanes(d, p: RotaryParams) -> tuple:
    """(x's lane, its partner's, whether it is the pair's second, the pair) of output lane d of the rotated part."""
    r = p.rotary_dim
    half = r // 2
    if p.deinterleave:  # out lane d: pair j = d mod R/2 of x, its first (d < R/2) or second element
        pair = ModularIndexing(d, 1, half)
        is_second = ModularIndexing(d, half, 2)
        return 2 * pair + is_second, 2 * pair + 1 - is_second, is_second, pair
    if p.interleaved:
        return d, d + 1 - 2 * ModularIndexing(d, 1, 2), ModularIndexing(d, 1, 2), ModularIndexing(d, 2, half)
    if p.rotary_blocks > 1:  # NeoX pairs within each block of width w = 2 * bh
        bh = half // p.rotary_blocks
        w = 2 * bh
        block = ModularIndexing(d, w, p.rotary_blocks)
        return d, block * w + ModularIndexing(d + bh, 1, w), ModularIndexing(d, bh, 2), \
            block * bh + ModularIndexing(d, 1, bh)
    return d, ModularIndexing(d + half, 1, r), ModularIndexing(d, half, 2), ModularIndexing(d, 1, half)


def _cache_row(row, rows, named: bool):
    """The cache row that positions pick, as an index: checked, and negatives not wrapped. The op's rule is
    0 <= row < rows (the pass emits the wrap of `cache[positions]` before the op), and a row outside fails as plain
    compile fails instead of reading past the cache: `named` (the CPU), by an assert whose error names positions (one
    compare, in place of Inductor's own check); else by Inductor's check, a device-side assert on the GPU that it
    drops where it proves the rows in range."""
    if named:
        wide = ops.to_dtype(row, torch.int64)
        inside = ops.and_(ops.ge(wide, ops.constant(0, torch.int64)), ops.lt(wide, ops.index_expr(rows, torch.int64)))
        ops.device_assert_async(inside, "rope_fusion: " + positions_error(None, rows))
    return ops.indirect_indexing(row, rows, check=not named, wrap_neg=False)


def _rms_norm(x, p: RotaryParams, weight, cd):
    """The norm prologue as Inductor's own lowerings (a reduction and pointwise nodes that it fuses with the
    rotation), in the math dtype."""
    from torch._inductor.lowering import lowerings

    aten, prims = torch.ops.aten, torch.ops.prims
    xf = lowerings[prims.convert_element_type.default](x, cd)
    dims = [-1] if p.norm == "rms" else [-2, -1]
    var = lowerings[aten.mean.dim](lowerings[aten.mul.Tensor](xf, xf), dims, True)
    xn = lowerings[aten.mul.Tensor](xf, lowerings[aten.rsqrt.default](lowerings[aten.add.Tensor](var, p.norm_eps)))
    if weight is not None:
        xn = lowerings[aten.mul.Tensor](xn, lowerings[prims.convert_element_type.default](weight, cd))
    return xn


def _packed_positions(call: RotaryCall):
    """The positions of packed sequences as Inductor IR: the op's rule (ops/packed.py) on Inductor's lowerings of
    the ATen ops it is spelled in, so the gathers of the sequence starts are checked as Inductor checks its own."""
    from torch._inductor.lowering import lowerings

    x = call.xs[0]
    size = x.get_size()
    return packed_positions(lambda target, *a, **kw: lowerings[target](*a, **kw), call.cu_seqlens,
                            call.seqlen_offsets, size[0], len(size), x.get_device())


def _lowering(arity: int):
    def lower(*args, **kw):
        call = RotaryCall.parse(args, kw, arity)
        p = call.params
        positions = call.positions
        if call.cu_seqlens is not None:
            positions = _packed_positions(call)
        outs = []
        for i, x in enumerate(call.xs):
            if p.norm != "none":
                x = _rms_norm(x, p, call.weight(i), _compute_dtype(x, call.cos, call.sin, p.out_dtype))
            outs.append(_rotary_pointwise(x, call.cos, call.sin, p.of_tensor(i), positions))
        return outs[0] if len(outs) == 1 else tuple(outs)
    return lower


for _arity, _op in enumerate(OPS, start=1):
    register_lowering(_op, type_promotion_kind=None)(_lowering(_arity))
