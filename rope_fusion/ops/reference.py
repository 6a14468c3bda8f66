"""Reference semantics of the fused rotary op (docs/design.md section 2).

Every backend (Inductor lowering, Triton, NPU bridge) is tested against this function, so it is written
for clarity: plain slicing, no tricks. It is also the op's eager implementation where no device kernel is
registered, and the source of the table gradients in the op's autograd formula.
"""

from __future__ import annotations

import torch

from .packed import unpacked
from .schema import RotaryCall, check_args, math_dtype  # noqa: F401  (re-exported: the reference validates like the op)


def split_pairs(t: torch.Tensor, interleaved: bool, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the second lane of every pair of t's last dim (the rotated lanes), pairs in op order:
    interleaved (2j, 2j+1); NeoX (j, j + W/2) within each of `blocks` blocks of width W, block by block."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    t = t.unflatten(-1, (blocks, t.shape[-1] // blocks))
    half = t.shape[-1] // 2
    return t[..., :half].flatten(-2), t[..., half:].flatten(-2)


def join_pairs(a: torch.Tensor, b: torch.Tensor, interleaved: bool, blocks: int = 1) -> torch.Tensor:
    """The inverse of split_pairs: the lanes of every pair back in place."""
    if interleaved:
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a.unflatten(-1, (blocks, -1)), b.unflatten(-1, (blocks, -1))), dim=-1).flatten(-2)


def gather_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`table[positions]` for positions in [0, rows), the op's rule; any other position raises IndexError, a
    negative one included. Advanced indexing would wrap a negative position: the pass emits that wrap in the
    graph where the model indexed so (passes/analysis/gathers.py), so every backend checks one rule.

    Positions on the CPU are checked here, where reading them costs no device sync, so the error names them;
    elsewhere `index_select` checks them on the device (torch's own error)."""
    if type(positions) is torch.Tensor and positions.device.type == "cpu" and positions.numel():
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0 or high >= table.shape[0]:
            raise IndexError(positions_error(low if low < 0 else high, table.shape[0]))
    return table.index_select(0, positions.reshape(-1)).reshape(*positions.shape, *table.shape[1:])


def positions_error(row: int | None, rows: object) -> str:
    """The one message of a position outside the caches (the reference's check, the CPU lowering's assert)."""
    got = "" if row is None else f", got {row}"
    return (f"positions must pick rows in [0, {rows}) of cos and sin{got} (positions given, or derived from "
            "cu_seqlens and seqlen_offsets)")


def _lane_tables(t: torch.Tensor, interleaved: bool, full_tables: bool, blocks: int):
    """Table entries for the first and second lane of each pair, each of width rotary_dim/2."""
    if not full_tables:
        return t, t
    return split_pairs(t, interleaved, blocks)


def rotary_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: int,
    full_tables: bool,
    conjugate: bool = False,
    out_dtype: torch.dtype | None = None,
    positions: torch.Tensor | None = None,
    norm: str = "none",
    norm_eps: float = 1e-6,
    norm_weight: torch.Tensor | None = None,
    deinterleave: bool = False,
    rotary_blocks: int = 1,
    rotary_offset: int = 0,
    angle_tables: bool = False,
    offset_q_only: bool = False,
) -> torch.Tensor:
    """out[a]=x[a]C[a]-x[b]S[a], out[b]=x[b]C[b]+x[a]S[b] per pair (a,b); S negated when conjugate; with
    positions the tables are the rows cos[positions], sin[positions] of a cache; with a norm, x is first
    normalised (RMS over each head, or over all heads of a token) and scaled by the weight; lanes outside
    [rotary_offset, rotary_offset + rotary_dim) pass through; with angle_tables the tables are angles, and
    their cos and sin rotate. One tensor: offset_q_only, a flag of a call of q and k, is resolved per tensor
    first (`RotaryParams.of_tensor`)."""
    if offset_q_only:
        raise ValueError("offset_q_only=True is a flag of a call of q and k: rotate each tensor by "
                         "RotaryParams.of_tensor(i), which resolves it")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if positions is not None:
        cos, sin = gather_rows(cos, positions), gather_rows(sin, positions)
    cd = math_dtype([x], cos, sin, out_dtype)
    if angle_tables:
        cos, sin = cos.to(cd).cos(), sin.to(cd).sin()
    x = rms_norm(x.to(cd), norm, norm_eps, norm_weight) if norm != "none" else x
    r, off = rotary_dim, rotary_offset
    a, b = split_pairs(x[..., off:off + r].to(cd), interleaved, rotary_blocks)
    table_layout = interleaved and not deinterleave  # a de-interleaved result indexes full tables by output lane
    ca, cb = (t.to(cd) for t in _lane_tables(cos, table_layout, full_tables, rotary_blocks))
    sa, sb = (t.to(cd) for t in _lane_tables(sin, table_layout, full_tables, rotary_blocks))
    if conjugate:
        sa, sb = -sa, -sb
    oa = a * ca - b * sa
    ob = b * cb + a * sb
    rot = join_pairs(oa, ob, table_layout, rotary_blocks)  # de-interleaved: the two NeoX halves
    rot = rot.to(out_dtype)
    if off + r < x.shape[-1] or off:
        rot = torch.cat((x[..., :off].to(out_dtype), rot, x[..., off + r:].to(out_dtype)), dim=-1)
    return rot


def rms_norm(x: torch.Tensor, norm: str, eps: float, weight: torch.Tensor | None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight in x's dtype: over the head's lanes ("rms") or over every head of
    the token ("rms_across_heads", the last two dims)."""
    dims = (-1,) if norm == "rms" else (-2, -1)
    x = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    return x * weight.to(x.dtype) if weight is not None else x


def reference_outputs(call: RotaryCall) -> list:
    """The reference applied to every x of a call (packed sequences: at their derived positions)."""
    call = unpacked(call)
    return [rotary_reference(x, call.cos, call.sin, positions=call.positions, norm_weight=call.weight(i),
                             **call.params.of_tensor(i).kwargs()).contiguous() for i, x in enumerate(call.xs)]


def partner_lanes(t: torch.Tensor, interleaved: bool, blocks: int = 1) -> torch.Tensor:
    """A full-width table with each pair's two entries swapped: entry a_j of the result is t[b_j].

    The gradient of a rotation reads the sin entry of the partner lane (d out[b]/d x[a] = S[b]), so the
    backward is the conjugate rotation by (C, partner_lanes(S)); for one entry per pair this is S itself."""
    a, b = split_pairs(t, interleaved, blocks)
    return join_pairs(b, a, interleaved, blocks)


def table_grads(grads, xs, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, rotary_dim: int,
                full_tables: bool, conjugate: bool, positions: torch.Tensor | None = None,
                rotary_blocks: int = 1, rotary_offset: int = 0,
                offset_q_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the tables, summed over every rotated tensor and reduced to each table's shape.

    With pairs (a, b): out[a] = x[a]C[a] - x[b]S[a] and out[b] = x[b]C[b] + x[a]S[b] (S negated when
    conjugate), so dC[a] = g[a]x[a], dC[b] = g[b]x[b], dS[a] = -g[a]x[b], dS[b] = g[b]x[a]; a per-pair table
    receives the sum over both lanes of its pair; a gathered cache the sum over the tokens that read a row; with
    offset_q_only, the tensors after q read their lanes from 0."""
    if positions is not None:  # the gradient of the gathered rows, accumulated into the cache's rows
        gc, gs = table_grads(grads, xs, gather_rows(cos, positions), gather_rows(sin, positions),
                             interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full_tables,
                             conjugate=conjugate, rotary_blocks=rotary_blocks, rotary_offset=rotary_offset,
                             offset_q_only=offset_q_only)
        index = positions.reshape(-1)
        return (torch.zeros_like(cos).index_add_(0, index, gc.reshape(-1, cos.shape[-1])),
                torch.zeros_like(sin).index_add_(0, index, gs.reshape(-1, sin.shape[-1])))
    cd = torch.float64 if torch.float64 in (cos.dtype, sin.dtype) else torch.float32
    sign = -1.0 if conjugate else 1.0
    gc = gs = None
    for i, (g, x) in enumerate(zip(grads, xs)):
        if g is None:
            continue
        off = 0 if offset_q_only and i > 0 else rotary_offset
        lanes = slice(off, off + rotary_dim)
        (ga, gb), (xa, xb) = (split_pairs(t[..., lanes].to(cd), interleaved, rotary_blocks) for t in (g, x))
        if full_tables:
            c = join_pairs(ga * xa, gb * xb, interleaved, rotary_blocks)
            s = join_pairs(-ga * xb, gb * xa, interleaved, rotary_blocks) * sign
        else:
            c, s = ga * xa + gb * xb, (gb * xa - ga * xb) * sign
        c, s = c.sum_to_size(cos.shape), s.sum_to_size(sin.shape)  # q and k broadcast differently (GQA)
        gc = c if gc is None else gc + c
        gs = s if gs is None else gs + s
    if gc is None:
        return torch.zeros_like(cos), torch.zeros_like(sin)
    return gc.to(cos.dtype), gs.to(sin.dtype)
