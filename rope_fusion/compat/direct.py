"""The direct path of the drop-ins whose upstream signature is fixed: a call geometry checked and planned once.

A drop-in that model code calls in every attention layer pays its host time on every call, and below a few
thousand tokens that host time is the call's cost (vllm-omni keeps its fused QK-norm + RoPE behind a token gate
for that reason). The public functions (`rope_fusion.apply_rotary_qk`) key their plans on every option as the
caller spelled it; a drop-in with a fixed signature knows its options and keys on its own arguments, checks the
upstream contract only on a geometry's first call, and replays that geometry's runner afterwards. What a check
reads (shapes, strides, dtypes, devices, the scalars) is all in the key, so a later call of the same key passes the
same checks.

Only eager calls of plain tensors with no autograd to record take this path: under tracing, a dispatch mode or a
functorch transform, or with a tensor that requires grad, `call_key` returns None and the drop-in calls the op
through the public functions, so tracers and autograd see `rope_fusion::*` as they do for any other call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ops.plan_cache import PlanCache

_TENSOR = torch.Tensor


def call_key(tensors: Sequence[torch.Tensor | None], scalars: tuple) -> tuple | None:
    """The plan key of an eager call: each tensor's geometry (shape, strides, dtype, device, its data pointer modulo
    16: Triton specialises a launch on 16-byte alignment, also of a view a runner makes at a fixed offset) and the
    call's other arguments; None where the call must go through the op (tracing, a dispatch mode or transform, a
    subclass, autograd to record) or an argument cannot be a key."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._are_functorch_transforms_active():
        return None
    grad = torch.is_grad_enabled()
    key: list = [scalars]
    append = key.append
    try:
        for t in tensors:
            if t is None:
                append(None)
            elif t.__class__ is not _TENSOR or grad and t.requires_grad:
                return None
            else:  # the pointer's residue, not only whether it is 16-byte aligned: a runner's views at fixed offsets
                append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16))  # then align as they did
        out = tuple(key)
        hash(out)
    except (TypeError, RuntimeError):  # an unhashable scalar, a tensor without storage: nothing to cache
        return None
    return out


class Plans(PlanCache):
    """A drop-in's runners by call key (`plan_cache.PlanCache`: bounded, least recently used evicted), listed in
    `ALL_PLANS` too, so that `clear_plans` drops the drop-ins' alone."""

    __slots__ = ()

    def __init__(self, name: str) -> None:
        super().__init__(f"compat.{name}")
        ALL_PLANS.append(self)


ALL_PLANS: list[Plans] = []


def clear_plans() -> None:
    """Forget every drop-in's planned runners (they hold the device kernel that served their first call)."""
    for plans in ALL_PLANS:
        plans.clear()
