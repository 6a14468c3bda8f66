"""vLLM's vision-tower rotary on the fused op, reading q and k where they lie: `ApplyRotaryEmb`, its
`forward_static` as `apply_rotary_emb`, and `apply_rotary_emb_qk` for q and k held apart.

vLLM runs multimodal encoders eagerly by default (`compile_mm_encoder=False`), so a compile pass never sees the
vision tower's RoPE. `Qwen2_5_VisionAttention.forward` (Qwen2.5-VL, Qwen3-VL, Qwen3-Omni's towers share it) splits
the fused qkv projection into views, rearranges q and k to one `[2 * b, s, heads, head_dim]` view, makes it
contiguous and rotates the copy with `ApplyRotaryEmb` (flash-attn's Triton kernel on CUDA): q and k are read and
written twice. The op reads any strides, so these drop-ins take the view as it comes: one launch that reads q and
k from the projection's output and writes the rotated pair once, q's rows and k's as the two tensors of the launch
(`sides`), so a program reads a token's table row once for both. In the tower, drop `.contiguous()` and replace
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

from collections.abc import Callable

import torch

from ..ops import slice_write
from ..ops.optional_backends import load_backends
from ..ops.public_functions import apply_rotary, apply_rotary_qk
from ..ops.schema import RotaryCall, RotaryParams, check_call
from .direct import Plans, call_key


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


def sides(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x `[batch, seq, heads, head_dim]` as the tensors of one launch, split along its batch dim (views): each of
    2 or 3 rows its own tensor, an even batch as two halves; else x whole.

    The tables broadcast over the batch, so one launch may take its rows as q, k (and v) of one call: a program
    rotates a token of each, reading that token's table row once. Taken whole, the batch is a token dim of the grid
    outside the sequence, and the tower's q and k `(two b)` view ran as every token of q, then every token of k:
    the table rows read twice from memory, each program half the rows (1.086-1.092x the copy floor at 32768 and
    49152 x 16 x 80, where q and k apart in one launch measured 1.022-1.030x)."""
    if x.dim() != 4 or x.shape[0] < 2:
        return (x,)
    if x.shape[0] <= 3:
        return x.unbind(0)
    if x.shape[0] % 2 == 0:
        return x.unflatten(0, (2, -1)).unbind(0)
    return (x,)


_PLANS = Plans("vllm_apply_rotary_emb")  # apply_rotary_emb's call geometries -> their runners


def _plan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams) -> Callable | None:
    """The runner of an eager call geometry on a device whose kernel writes into given outputs in one pass over
    each row (the `plan` of `slice_write.IN_PLACE_KERNELS`): x's `sides` in one launch, each written into its view
    of one result; None elsewhere (the call then goes through the op)."""
    load_backends()  # the device kernels register on import
    kernel = slice_write.IN_PLACE_KERNELS.get(x.device.type)
    planner = kernel.plan if kernel is not None else None
    if planner is None or x.numel() == 0:
        return None
    c, s, _ = _tables(x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    call = RotaryCall(list(sides(x)), c, s, params)
    check_call(call)
    runner = planner(call, list(sides(out)))
    if runner is None:
        return None

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, s, _ = _tables(x, cos, sin)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        runner(list(sides(x)), c, s, None, None, list(sides(out)))
        return out
    return run


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True,
                     enable_fp32_compute: bool = False) -> torch.Tensor:
    """`ApplyRotaryEmb.forward_static(x, cos, sin, is_neox_style, enable_fp32_compute)`: x rotated by the half
    tables, read where it lies (the module docstring has the contract). `enable_fp32_compute` is accepted for the
    signature: the math is fp32 either way. Eagerly on CUDA a call geometry is planned once: the rows of x's batch
    dim are the tensors of one launch (`sides`), written into one result."""
    key = call_key((x, cos, sin), (bool(is_neox_style),))
    run = _PLANS.get(key)
    if run is None:
        c, s, rotary_dim = _tables(x, cos, sin)
        params = RotaryParams(interleaved=not is_neox_style, rotary_dim=rotary_dim, full_tables=False,
                              conjugate=False, out_dtype=x.dtype)
        if key is None:  # traced, or autograd to record: the op
            return apply_rotary(x, c, s, **params.kwargs())
        run = _PLANS.put(key, _plan(x, cos, sin, params) or _through_op(params))
    return run(x, cos, sin)


def _through_op(params: RotaryParams) -> Callable:
    """The runner of a geometry no kernel here writes into given outputs (the CPU, lanes with a stride): the op."""
    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, s, _ = _tables(x, cos, sin)
        return apply_rotary(x, c, s, **params.kwargs())
    return run


def apply_rotary_emb_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the same half tables in one launch, each read where it lies: the tower's
    `q, k, v = qkv.unbind(dim=2)` views, with no rearrange and no copy (head counts may differ)."""
    c, s, rotary_dim = _tables(q, cos, sin)
    if k.dim() not in (3, 4) or k.shape[-3] != q.shape[-3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share their seq and head_dim")
    return apply_rotary_qk(q, k, c, s, interleaved=not is_neox_style, rotary_dim=rotary_dim,
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
