"""vLLM's vision-tower rotary on the fused op, reading q and k where they lie: `ApplyRotaryEmb`, its
`forward_static` as `apply_rotary_emb`, and `apply_rotary_emb_qk` for q and k held apart.

vLLM runs multimodal encoders eagerly by default (`compile_mm_encoder=False`), so a compile pass never sees the
vision tower's RoPE. `Qwen2_5_VisionAttention.forward` (Qwen2.5-VL, Qwen3-VL, Qwen3-Omni's towers share it) splits
the fused qkv projection into views, rearranges q and k to one `[2 * b, s, heads, head_dim]` view, makes it
contiguous and rotates the copy with `ApplyRotaryEmb` (flash-attn's Triton kernel on CUDA): q and k are read and
written twice. The op reads any strides, so these drop-ins take the view as it comes: one launch that reads q and
k from the projection's output and writes the rotated pair once. In the tower, drop `.contiguous()` and replace
the module:

    self.apply_rotary_emb = rope_fusion.compat.vllm_vision.ApplyRotaryEmb(enforce_enable=True)
    qk_rotated = self.apply_rotary_emb(qk_reshaped, rotary_pos_emb_cos, rotary_pos_emb_sin)  # a view: no copy

`ApplyRotaryEmb(x, cos, sin)` takes x `[seq, heads, head_dim]` or `[batch, seq, heads, head_dim]` (any strides;
lanes with a stride of their own are copied first) and flash-attn's half tables cos, sin `[seq_ro, rotary_dim / 2]`
with `seq_ro >= seq` (the first seq rows are read, as flash-attn's kernel reads them) and `rotary_dim <= head_dim`
(the lanes past it pass through, as flash-attn's kernel leaves them; vLLM's torch form takes whole rotations only).
NeoX pairs by default (`is_neox_style`), else interleaved. The result is a new contiguous tensor in x's dtype; the
math is fp32 (fp64 for fp64 inputs) whether or not `enable_fp32_compute` asks for it, rounded once, where vLLM's
torch form without that flag computes in x's dtype: within the numerics contract (docs/design.md section 2) of
either.
"""

from __future__ import annotations

import torch

from ..ops import library


def _tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The tables as views `[seq, 1, rotary_dim / 2]` that broadcast over the heads, and rotary_dim; ValueError
    for tables that do not fit x."""
    if x.dim() not in (3, 4):
        raise ValueError(f"x must be [seq, heads, head_dim] or [batch, seq, heads, head_dim], got {tuple(x.shape)}")
    seq, head_dim = x.shape[-3], x.shape[-1]
    if cos.dim() != 2 or tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"cos and sin must be [seq, rotary_dim / 2] of one shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[-1]
    if cos.shape[0] < seq or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos and sin of shape {tuple(cos.shape)} do not cover x {tuple(x.shape)}: they need at "
                         f"least {seq} rows and 1 to {head_dim // 2} entries a row")
    if cos.shape[0] != seq:
        cos, sin = cos[:seq], sin[:seq]
    return cos.unsqueeze(-2), sin.unsqueeze(-2), rotary_dim


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True,
                     enable_fp32_compute: bool = False) -> torch.Tensor:
    """`ApplyRotaryEmb.forward_static(x, cos, sin, is_neox_style, enable_fp32_compute)`: x rotated by the half
    tables, read where it lies (the module docstring has the contract). `enable_fp32_compute` is accepted for the
    signature: the math is fp32 either way."""
    c, s, rotary_dim = _tables(x, cos, sin)
    return library.apply_rotary(x, c, s, interleaved=not is_neox_style, rotary_dim=rotary_dim, out_dtype=x.dtype)


def apply_rotary_emb_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the same half tables in one launch, each read where it lies: the tower's
    `q, k, v = qkv.unbind(dim=2)` views, with no rearrange and no copy (head counts may differ)."""
    c, s, rotary_dim = _tables(q, cos, sin)
    if k.dim() not in (3, 4) or k.shape[-3] != q.shape[-3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share their seq and head_dim")
    return library.apply_rotary_qk(q, k, c, s, interleaved=not is_neox_style, rotary_dim=rotary_dim,
                                   out_dtype=q.dtype)


class ApplyRotaryEmb(torch.nn.Module):
    """vLLM's `ApplyRotaryEmb` custom op (model_executor/layers/rotary_embedding/common.py) as a module of the
    same constructor and call: `ApplyRotaryEmb(enforce_enable=False, is_neox_style=True,
    enable_fp32_compute=False)(x, cos, sin)`. `enforce_enable` is vLLM's switch between its custom and its torch
    form; there is one form here, so it is accepted and kept for the signature."""

    def __init__(self, enforce_enable: bool = False, is_neox_style: bool = True,
                 enable_fp32_compute: bool = False) -> None:
        super().__init__()
        self.enforce_enable = enforce_enable
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary_emb(x, cos, sin, self.is_neox_style, self.enable_fp32_compute)

    forward_static = staticmethod(apply_rotary_emb)

    def extra_repr(self) -> str:
        return f"is_neox_style={self.is_neox_style}, enable_fp32_compute={self.enable_fp32_compute}"


__all__ = ["ApplyRotaryEmb", "apply_rotary_emb", "apply_rotary_emb_qk"]
