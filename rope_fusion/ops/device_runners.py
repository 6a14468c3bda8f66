"""What runs an eager call of the rotary ops on each device type: the kernels backends register, and the runner a
call geometry gets from them.

A backend registers one `DeviceKernel` per device type (`register_device_kernel`): its `impl` serves the op's
dispatcher key for that device, and its optional `plan` the public functions' direct path, which asks
`device_runner` once per call geometry and keeps the answer in a `runner_cache`. A device without a kernel (the
CPU) runs the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .op_definition import LIBRARY, OPS, Impl, eager_kernel
from .packed import eager_op, packed_positions, unpacked
from .plan_cache import PlanCache
from .reference import reference_outputs
from .schema import RotaryCall, RotaryParams

log = logging.getLogger("rope_fusion")

# plan(call) -> run(xs, cos, sin, positions, norm_weights[, cu_seqlens, seqlen_offsets]) -> outputs: the work of
# one call geometry done once (a Triton launch's grid and arguments), reused by every later call of that geometry;
# None: use `impl` per call. A kernel that takes packed sequences gets their cu_seqlens and offsets, any other
# the positions they derive.
Runner = Callable[..., list]
Planner = Callable[[RotaryCall], "Runner | None"]


class DeviceKernel:
    """What serves eager calls on one device type: `impl` behind the op's dispatcher key for that device, and
    `plan` (optional) for the public functions' direct path; `takes_packed`: both take packed sequences as they
    come (cu_seqlens), else their derived positions."""

    def __init__(self, impl: Impl, plan: Planner | None = None, takes_packed: bool = False) -> None:
        self.impl, self.plan, self.takes_packed = impl, plan, takes_packed


DEVICE_KERNELS: dict[str, DeviceKernel] = {}
"""Device type -> its kernel; a device without one (the CPU) runs the reference."""

_RUNNER_CACHES: list[PlanCache] = []


def runner_cache(name: str) -> PlanCache:
    """A plan cache whose entries hold runners of `device_runner`: `register_device_kernel` empties it, so no
    planned geometry keeps running the kernel that served its first call after a device's kernel changes."""
    cache = PlanCache(name)
    _RUNNER_CACHES.append(cache)
    return cache


def register_device_kernel(device_type: str, impl: Impl, plan: Planner | None = None,
                           takes_packed: bool = False) -> None:
    """Serve eager calls of every arity's op on one device type with `impl` (None from it: reference), and the
    public functions' direct calls on that device with `plan` (or `impl` per call). With `takes_packed`, both
    are given packed sequences' cu_seqlens as they are; else the positions they derive."""
    for arity, op in enumerate(OPS, start=1):
        torch.library.register_kernel(op._schema.name, device_type, eager_kernel(impl, arity, takes_packed),
                                      lib=LIBRARY)
    DEVICE_KERNELS[device_type] = DeviceKernel(impl, plan, takes_packed)
    for cache in _RUNNER_CACHES:
        cache.clear()


def _per_call(impl: Impl | None, params: RotaryParams) -> Runner:
    def run(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, positions: Any, weights: Any,
            cu_seqlens: Any = None, seqlen_offsets: Any = None) -> list:
        call = RotaryCall(list(xs), cos, sin, params, positions, weights, cu_seqlens, seqlen_offsets)
        outs = impl(call) if impl is not None else None
        return outs if outs is not None else reference_outputs(call)
    return run


def _deriving(run: Runner) -> Runner:
    """A runner of positions given packed sequences: each call's positions derived from its cu_seqlens (ATen ops,
    up to nine small kernels eagerly: ops/packed.py)."""
    def packed_run(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, positions: Any, weights: Any,
                   cu_seqlens: Any = None, seqlen_offsets: Any = None) -> list:
        if cu_seqlens is not None:
            x = xs[0]
            positions = packed_positions(eager_op, cu_seqlens, seqlen_offsets, x.shape[0], x.dim(), x.device)
        return run(xs, cos, sin, positions, weights)
    return packed_run


_NO_KERNEL_LOGGED: set = set()


def device_runner(call: RotaryCall) -> Runner:
    """How a validated call geometry runs eagerly on its device: the device's planned launch, its kernel per call,
    or the reference (the CPU; a GPU whose kernel module did not import says so once). Packed sequences reach a
    kernel that takes them as they are (the Triton kernel searches cu_seqlens itself); any other is planned as
    `packed.unpacked(call)` and each run given the positions that call's cu_seqlens derive."""
    device = call.xs[0].device.type
    kernel = DEVICE_KERNELS.get(device)
    if kernel is None:
        if device != "cpu" and device not in _NO_KERNEL_LOGGED:
            _NO_KERNEL_LOGGED.add(device)
            from .optional_backends import OPTIONAL_BACKENDS

            log.info("rope_fusion: no kernel serves %s tensors (optional backends %s did not register one); eager "
                     "calls run the reference", device, sorted(OPTIONAL_BACKENDS))
        return _per_call(None, call.params)  # the reference derives packed positions itself
    if call.cu_seqlens is not None and not kernel.takes_packed:
        return _deriving(device_runner(unpacked(call)))
    run = kernel.plan(call) if kernel.plan is not None else None
    return run if run is not None else _per_call(kernel.impl, call.params)
