"""diffusers' `models.embeddings.apply_rotary_emb` on the fused op.

diffusers passes two table layouts. `use_real=True`: `(cos, sin)`, each `[S, D]` with one entry per lane (the op's
`full_tables`), the pairs interleaved (`use_real_unbind_dim=-1`: Flux, CogVideoX, HunyuanDiT) or NeoX halves
(`-2`: Stable Audio, OmniGen, CogView4, Cosmos). `use_real=False`: complex `freqs_cis` (Lumina); its real and
imaginary parts are strided views that the op reads as half tables of interleaved pairs, without a copy.
"""

from __future__ import annotations

import torch

from ..ops.public_functions import apply_rotary
from .arguments import caller_names


@caller_names(cos="freqs_cis", sin="freqs_cis")
def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                     use_real: bool = True, use_real_unbind_dim: int = -1, sequence_dim: int = 2) -> torch.Tensor:
    """Rotate x ([B, H, S, D] for sequence_dim=2, [B, S, H, D] for 1) as diffusers' function does.

    The result has x's dtype; the math is fp32 (fp64 for fp64 inputs), rounded once, as diffusers' `x.float()`
    math is. With use_real=False, freqs_cis is unsqueezed at dim 2 as upstream does (x [B, S, H, D],
    freqs_cis [B, S, D/2]) and sequence_dim is ignored, as upstream ignores it."""
    if use_real:
        cos, sin = freqs_cis
        if sequence_dim == 2:
            cos, sin = cos[None, None, :, :], sin[None, None, :, :]
        elif sequence_dim == 1:
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        else:
            raise ValueError(f"`sequence_dim={sequence_dim}` but should be 1 or 2.")
        cos, sin = cos.to(x.device), sin.to(x.device)
        if use_real_unbind_dim not in (-1, -2):
            raise ValueError(f"`use_real_unbind_dim={use_real_unbind_dim}` but should be -1 or -2.")
        return apply_rotary(x, cos, sin, full_tables=True, interleaved=use_real_unbind_dim == -1,
                            rotary_dim=x.shape[-1])
    if not torch.is_complex(freqs_cis):
        raise ValueError(f"use_real=False takes complex freqs_cis, got {freqs_cis.dtype}")
    freqs = freqs_cis.unsqueeze(2)
    return apply_rotary(x, freqs.real, freqs.imag, interleaved=True, rotary_dim=x.shape[-1])
