"""flash-attn's `flash_attn.layers.rotary.apply_rotary_emb` on the fused op.

flash-attn's layout: x [B, S, H, D] (or packed [T, H, D] with `cu_seqlens`), tables cos/sin [S_ro, R/2] with
R = 2 * cos.shape[-1] <= D; lanes past R pass through. Sequence b's token s reads table row
s + seqlen_offsets (an int, or one offset per sequence, [B]). A plain int offset slices the tables; per-sequence
offsets become per-token positions, which the op gathers (its `positions` form), so the tables are never
expanded. Packed sequences go to the op's own packed form (`cu_seqlens`, `seqlen_offsets`), which derives each
token's row.

One difference, on purpose: flash-attn's kernel rotates a row past the end of the tables by cos=1, sin=0 (it
leaves it unrotated). Here such a row raises: an offset past the tables is a caller's bug, and a silent
pass-through would hide it. A static int offset is checked here; gathered positions and packed sequences' rows
are bounds-checked by the op. So is a token that no sequence of `cu_seqlens` holds, which flash-attn leaves
unwritten.
"""

from __future__ import annotations

import torch

from ..ops.public_functions import apply_rotary


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] lanes of x; inplace=True writes the result into x and returns x.

    `max_seqlen` is accepted for the signature; the positions come from cu_seqlens alone."""
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [seqlen_ro, rotary_dim / 2] of one shape, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[-1]
    seqlen_ro = cos.shape[0]
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"x must be [batch, seqlen, nheads, headdim] without cu_seqlens, got {tuple(x.shape)}")
        batch, seqlen = x.shape[0], x.shape[1]
        if isinstance(seqlen_offsets, torch.Tensor):
            if seqlen_offsets.shape != (batch,):
                raise ValueError(f"seqlen_offsets must be an int or a [batch] tensor, got shape "
                                 f"{tuple(seqlen_offsets.shape)}")
            steps = torch.arange(seqlen, device=x.device, dtype=seqlen_offsets.dtype)
            positions = (seqlen_offsets[:, None] + steps)[..., None]  # [B, S, 1] against x's [B, S, H]
            out = apply_rotary(x, cos, sin, positions=positions, interleaved=interleaved,
                               rotary_dim=rotary_dim)
        else:
            if seqlen_offsets < 0 or seqlen_offsets + seqlen > seqlen_ro:
                raise ValueError(f"rows {seqlen_offsets}..{seqlen_offsets + seqlen - 1} of the tables are asked for, "
                                 f"the tables have {seqlen_ro} rows")
            rows = slice(seqlen_offsets, seqlen_offsets + seqlen)
            out = apply_rotary(x, cos[rows, None], sin[rows, None], interleaved=interleaved,
                               rotary_dim=rotary_dim)
    else:
        if x.dim() != 3:
            raise ValueError(f"x must be [total_seqlen, nheads, headdim] with cu_seqlens, got {tuple(x.shape)}")
        out = apply_rotary(x, cos, sin, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets,
                           interleaved=interleaved, rotary_dim=rotary_dim)
    if inplace:
        x[..., :rotary_dim].copy_(out[..., :rotary_dim])
        return x
    return out
