"""vllm-omni's per-model RoPE helpers on the fused op (the ones its RFC "Unify Rotary Position Embedding
Implementations Across Models" lists; docs/compat.md maps the rest).

- `apply_rotary_emb_wan(hidden_states, freqs_cos, freqs_sin)` (Wan 2.2): x [B, S, H, D], full-width tables
  repeated per pair; upstream reads cos from the even lanes and sin from the odd ones, and so does this: the
  op takes the strided views `freqs_cos[..., 0::2]` / `freqs_sin[..., 1::2]` as half tables of interleaved pairs.
- `apply_rotary_emb_helios(hidden_states, freqs_cis)` (Helios, diffusers' `apply_rotary_emb_transposed`):
  freqs_cis holds the full-width cos, then the full-width sin, on its last dim; otherwise Wan's pairing.
- `apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1)` (Qwen-Image): diffusers' function
  for x [B, S, H, D]: real tables broadcast as [1, 1, S, D]; complex freqs_cis unsqueezed at dim 1.
- `apply_rotary_emb_torch(x, cos, sin, interleaved=False)` (the shared `diffusion/layers/rope.py`, flash-attn's
  layout): x [B, S, H, D], half tables [S, R/2] or [B, S, R/2], the lanes past R pass through.
- `fused_qk_norm_rope` and `fused_joint_qkv_norm_rope` (the QK-norm + RoPE ops its models call by hand, with a
  packed `[cos | sin]` table): compat/qk_norm_rope.py, re-exported here.
"""

from __future__ import annotations

import torch

from ..ops.public_functions import apply_rotary
from .arguments import caller_names
from .diffusers import apply_rotary_emb as _diffusers_apply_rotary_emb
from .qk_norm_rope import fused_joint_qkv_norm_rope, fused_qk_norm_rope  # noqa: F401  (vllm-omni's own names)


@caller_names(x="hidden_states", cos="freqs_cos", sin="freqs_sin")
def apply_rotary_emb_wan(hidden_states: torch.Tensor, freqs_cos: torch.Tensor,
                         freqs_sin: torch.Tensor) -> torch.Tensor:
    return apply_rotary(hidden_states, freqs_cos[..., 0::2], freqs_sin[..., 1::2], interleaved=True,
                        rotary_dim=hidden_states.shape[-1])


@caller_names(x="hidden_states", cos="freqs_cis", sin="freqs_cis")
def apply_rotary_emb_helios(hidden_states: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    cos, sin = freqs_cis.unsqueeze(-2).chunk(2, dim=-1)
    return apply_rotary_emb_wan(hidden_states, cos, sin)


@caller_names(cos="freqs_cis", sin="freqs_cis")
def apply_rotary_emb_qwen(x: torch.Tensor, freqs_cis: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                          use_real: bool = True, use_real_unbind_dim: int = -1) -> torch.Tensor:
    if use_real:
        return _diffusers_apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=use_real_unbind_dim,
                                           sequence_dim=2)
    if not torch.is_complex(freqs_cis):
        raise ValueError(f"use_real=False takes complex freqs_cis, got {freqs_cis.dtype}")
    freqs = freqs_cis.unsqueeze(1)
    return apply_rotary(x, freqs.real, freqs.imag, interleaved=True, rotary_dim=x.shape[-1])


@caller_names(cos="cos", sin="sin")
def apply_rotary_emb_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleaved: bool = False) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    return apply_rotary(x, cos.unsqueeze(-2), sin.unsqueeze(-2), interleaved=interleaved,
                        rotary_dim=rotary_dim)
