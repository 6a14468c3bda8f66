"""diffusers' rotation and RMSNorm as its attention processors spell them, for tests that compile model-shaped code:
one copy, so that every test of a fold compiles the same spelling."""

from __future__ import annotations

import torch


def rope_heads_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb (use_real, unbind -1) on [B, H, S, D]."""
    cos, sin = cos[None, None], sin[None, None]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope_tokens_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb (use_real, unbind -1, sequence_dim 1) on [B, S, H, D]."""
    cos, sin = cos[None, :, None], sin[None, :, None]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm: fp32 statistics, the weight applied in x's dtype."""
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype) * w
