"""Reference semantics of the fused rotary op (docs/design.md section 2).

Every backend (Inductor lowering, Triton, NPU bridge) is tested against this function, so it is written
for clarity: plain slicing, no tricks. It is also the op's eager implementation where no device kernel is
registered, and the source of the table gradients in the op's autograd formula.
"""

from __future__ import annotations

import torch

from .schema import check_args, math_dtype  # noqa: F401  (re-exported: the reference validates like the op)


def _lane_tables(t: torch.Tensor, rotary_dim: int, interleaved: bool, full_tables: bool):
    """Table entries for the first and second lane of each pair, each of width rotary_dim/2."""
    if not full_tables:
        return t, t
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = rotary_dim // 2
    return t[..., :half], t[..., half:]


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
) -> torch.Tensor:
    """out[a]=x[a]C[a]-x[b]S[a], out[b]=x[b]C[b]+x[a]S[b] per pair (a,b); S negated when conjugate; with
    positions the tables are the rows cos[positions], sin[positions] of a cache; with a norm, x is first
    normalised (RMS over each head, or over all heads of a token) and scaled by the weight."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    cd = math_dtype([x], cos, sin, out_dtype)
    x = rms_norm(x.to(cd), norm, norm_eps, norm_weight) if norm != "none" else x
    r = rotary_dim
    xr = x[..., :r].to(cd)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
    else:
        a, b = xr[..., : r // 2], xr[..., r // 2 :]
    table_layout = interleaved and not deinterleave  # a de-interleaved result indexes full tables by output lane
    ca, cb = (t.to(cd) for t in _lane_tables(cos, r, table_layout, full_tables))
    sa, sb = (t.to(cd) for t in _lane_tables(sin, r, table_layout, full_tables))
    if conjugate:
        sa, sb = -sa, -sb
    oa = a * ca - b * sa
    ob = b * cb + a * sb
    if interleaved and not deinterleave:
        rot = torch.stack((oa, ob), dim=-1).flatten(-2)
    else:
        rot = torch.cat((oa, ob), dim=-1)
    rot = rot.to(out_dtype)
    if r < x.shape[-1]:
        rot = torch.cat((rot, x[..., r:].to(out_dtype)), dim=-1)
    return rot


def rms_norm(x: torch.Tensor, norm: str, eps: float, weight: torch.Tensor | None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight in x's dtype: over the head's lanes ("rms") or over every head of
    the token ("rms_across_heads", the last two dims)."""
    dims = (-1,) if norm == "rms" else (-2, -1)
    x = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    return x * weight.to(x.dtype) if weight is not None else x


def partner_lanes(t: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """A full-width table with each pair's two entries swapped: entry a_j of the result is t[b_j].

    The gradient of a rotation reads the sin entry of the partner lane (d out[b]/d x[a] = S[b]), so the
    backward is the conjugate rotation by (C, partner_lanes(S)); for one entry per pair this is S itself."""
    if interleaved:
        return t.unflatten(-1, (rotary_dim // 2, 2)).flip(-1).flatten(-2)
    half = rotary_dim // 2
    return torch.cat((t[..., half:], t[..., :half]), dim=-1)


def table_grads(grads, xs, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, rotary_dim: int,
                full_tables: bool, conjugate: bool,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the tables, summed over every rotated tensor and reduced to each table's shape.

    With pairs (a, b): out[a] = x[a]C[a] - x[b]S[a] and out[b] = x[b]C[b] + x[a]S[b] (S negated when
    conjugate), so dC[a] = g[a]x[a], dC[b] = g[b]x[b], dS[a] = -g[a]x[b], dS[b] = g[b]x[a]; a per-pair table
    receives the sum over both lanes of its pair; a gathered cache the sum over the tokens that read a row."""
    if positions is not None:  # the gradient of the gathered rows, accumulated into the cache's rows
        gc, gs = table_grads(grads, xs, cos[positions], sin[positions], interleaved=interleaved,
                             rotary_dim=rotary_dim, full_tables=full_tables, conjugate=conjugate)
        index = positions.reshape(-1)
        return (torch.zeros_like(cos).index_add_(0, index, gc.reshape(-1, cos.shape[-1])),
                torch.zeros_like(sin).index_add_(0, index, gs.reshape(-1, sin.shape[-1])))
    cd = torch.float64 if torch.float64 in (cos.dtype, sin.dtype) else torch.float32
    sign = -1.0 if conjugate else 1.0
    r = rotary_dim
    gc = gs = None
    for g, x in zip(grads, xs):
        if g is None:
            continue
        g, x = g[..., :r].to(cd), x[..., :r].to(cd)
        if interleaved:
            ga, gb, xa, xb = g[..., 0::2], g[..., 1::2], x[..., 0::2], x[..., 1::2]
        else:
            ga, gb, xa, xb = g[..., : r // 2], g[..., r // 2:], x[..., : r // 2], x[..., r // 2:]
        if full_tables:
            join = (lambda a, b: torch.stack((a, b), -1).flatten(-2)) if interleaved else \
                (lambda a, b: torch.cat((a, b), -1))
            c, s = join(ga * xa, gb * xb), join(-ga * xb, gb * xa) * sign
        else:
            c, s = ga * xa + gb * xb, (gb * xa - ga * xb) * sign
        c, s = c.sum_to_size(cos.shape), s.sum_to_size(sin.shape)  # q and k broadcast differently (GQA)
        gc = c if gc is None else gc + c
        gs = s if gs is None else gs + s
    if gc is None:
        return torch.zeros_like(cos), torch.zeros_like(sin)
    return gc.to(cos.dtype), gs.to(sin.dtype)
