"""`rms_norm_rope_qk`: the QK-norm followed by RoPE that attention code writes by hand, as one fused call.

Projects write `q = rope(rms_norm(q, q_weight, eps), cos, sin)` and the same for k (Qwen3, Flux, Wan). The op
applies the norm in fp32 before rotating, in one read and one write of q and k (its `norm` option): per head
over D lanes, or across heads over H * D lanes (Wan / Flux.2 norm q and k over the whole inner dim).
"""

from __future__ import annotations

from typing import Any

import torch

from .ops.public_functions import apply_rotary_qk


def _across_heads_weight(w: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A norm weight over the inner dim, [H * D] as model code holds it, viewed [H, D] against x [..., H, D]."""
    if w is None or x.dim() < 2 or w.dim() != 1 or w.shape[0] == x.shape[-1]:
        return w
    if w.shape[0] != x.shape[-2] * x.shape[-1]:
        raise ValueError(f"a norm weight across heads of shape {tuple(w.shape)} does not match the H * D = "
                         f"{x.shape[-2]} * {x.shape[-1]} lanes of a tensor of shape {tuple(x.shape)}")
    return w.view(x.shape[-2], x.shape[-1])


def rms_norm_rope_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor, *, per_head: bool = True,
                     interleaved: bool = False, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm q and k (times their weights, which may be None), then rotate them by cos and sin.

    q [..., H, D], k [..., HK, D]. per_head=True normalises each head over its D lanes (weights [D]);
    per_head=False normalises each token over all its heads (weights [H * D] or [H, D]). The other keywords are
    `rope_fusion.apply_rotary_qk`'s (positions, full_tables, rotary_dim, rotary_offset, conjugate, out_dtype, ...),
    checked as it checks them; eps is its `norm_eps`, and errors name it so.
    """
    if not isinstance(per_head, bool):  # "no" would be truthy: a norm per head where one across heads was meant
        raise TypeError(f"per_head must be True or False, got {per_head!r}")
    for name in ("norm", "norm_eps", "q_norm_weight", "k_norm_weight", "norm_weight"):
        if name in options:
            raise TypeError(f"rms_norm_rope_qk sets {name} itself; pass the norm's arguments positionally")
    if not per_head:
        q_weight, k_weight = _across_heads_weight(q_weight, q), _across_heads_weight(k_weight, k)
    return apply_rotary_qk(q, k, cos, sin, norm="rms" if per_head else "rms_across_heads", norm_eps=eps,
                           q_norm_weight=q_weight, k_norm_weight=k_weight, interleaved=interleaved,
                           **options)
