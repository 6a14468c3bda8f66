"""Hugging Face transformers' `apply_rotary_pos_emb` helpers on the fused op.

HF passes full-width tables, `cos = cat(freqs, freqs)` of shape [B, S, W], and unsqueezes them at
`unsqueeze_dim` to broadcast against q and k. The forms found across the installed transformers' models:

- `apply_rotary_pos_emb`: the Llama form (about 175 models), NeoX pairs over W lanes. When W is less than the
  head dim the first W lanes rotate and the rest pass through, as the partial-rotary models (Phi, StableLM,
  Persimmon, GPT-NeoX) do by splitting q before the call.
- `apply_rotary_pos_emb_glm`: GLM / GLM-4's form: interleaved pairs over the first W lanes, the per-pair angle in
  the first half of each table (`cos[..., :W/2].repeat_interleave(2)`).
- `apply_rotary_pos_emb_interleave`: DeepSeek-V3's: interleaved pairs of x written in NeoX order (the op's
  `deinterleave`), the per-pair angle in the first half of each table.
- `apply_rotary_pos_emb_gptj`: GPT-J / CodeGen's `apply_rotary_pos_emb(tensor, sin, cos)` with `rotate_every_two`:
  half tables [B, S, R/2] against x [B, S, H, R] (sin before cos, as upstream).

Older transformers took `position_ids` after sin (unused since the tables arrive gathered); it is accepted and
ignored, as upstream ignores it. The result's dtype is the promotion of q's and cos's, as upstream's
`q * cos` gives.
"""

from __future__ import annotations

import torch

from ..ops.public_functions import apply_rotary, apply_rotary_qk
from .arguments import caller_names


def _tables(cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)


def _out_dtype(q: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, cos.dtype)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         position_ids: torch.Tensor | None = None,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The Llama form: `q * cos + rotate_half(q) * sin` (and k), full-width NeoX tables; tables narrower than the
    head rotate its first cos.shape[-1] lanes (partial rotary)."""
    cos, sin = _tables(cos, sin, unsqueeze_dim)
    return apply_rotary_qk(q, k, cos, sin, full_tables=True, rotary_dim=cos.shape[-1],
                           out_dtype=_out_dtype(q, cos))


@caller_names(cos="cos", sin="sin")
def apply_rotary_pos_emb_glm(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM's form: interleaved pairs over the first cos.shape[-1] lanes, the rest passes through."""
    cos, sin = _tables(cos, sin, unsqueeze_dim)
    width = cos.shape[-1]
    return apply_rotary_qk(q, k, cos[..., : width // 2], sin[..., : width // 2], interleaved=True,
                           rotary_dim=width, out_dtype=_out_dtype(q, cos))


@caller_names(cos="cos", sin="sin")
def apply_rotary_pos_emb_interleave(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                    position_ids: torch.Tensor | None = None,
                                    unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's form: interleaved pairs (2j, 2j + 1) rotated and written as out[j], out[j + D/2]."""
    cos, sin = _tables(cos, sin, unsqueeze_dim)
    width = cos.shape[-1]
    return apply_rotary_qk(q, k, cos[..., : width // 2], sin[..., : width // 2], interleaved=True,
                           deinterleave=True, rotary_dim=width, out_dtype=_out_dtype(q, cos))


@caller_names(x="tensor", cos="cos", sin="sin")
def apply_rotary_pos_emb_gptj(tensor: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """GPT-J / CodeGen: x [B, S, H, R] by half tables [B, S, R/2] (sin first), interleaved pairs."""
    cos_, sin_ = cos[:, :, None, :], sin[:, :, None, :]
    return apply_rotary(tensor, cos_, sin_, interleaved=True, rotary_dim=2 * cos.shape[-1],
                        out_dtype=_out_dtype(tensor, cos))
