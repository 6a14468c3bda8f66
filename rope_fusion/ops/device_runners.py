"""What runs an eager call of the rotary ops on each device type: the kernels backends register, and the runner a
call geometry gets from them.

A backend registers one `DeviceKernel` per device type (`ROTARY_KERNELS.register`): its `impl` serves the op's
dispatcher key for that device, and its optional `plan` the public functions' direct path, which asks
`device_runner` once per call geometry and keeps the answer in the registry's plan cache (emptied by every
registration). A device without a kernel (the CPU) runs the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .device_registry import DeviceKernel, DeviceRegistry
from .op_definition import OPS, Impl, eager_kernel
from .op_families import LIBRARY
from .packed import eager_op, packed_positions, unpacked
from .reference import reference_outputs
from .schema import RotaryCall, RotaryParams

log = logging.getLogger("rope_fusion")

# plan(call) -> run(xs, cos, sin, positions, norm_weights[, cu_seqlens, seqlen_offsets]) -> outputs: the work of
# one call geometry done once (a Triton launch's grid and arguments), reused by every later call of that geometry;
# None: use `impl` per call. A kernel that takes packed sequences gets their cu_seqlens and offsets, any other
# the positions they derive.
Runner = Callable[..., list]
Planner = Callable[[RotaryCall], "Runner | None"]


def _serve_dispatcher(device_type: str, kernel: DeviceKernel) -> None:
    """Every arity's op on `device_type`, through the dispatcher, runs `kernel.impl` (None from it: reference)."""
    for arity, op in enumerate(OPS, start=1):
        torch.library.register_kernel(op._schema.name, device_type,
                                      eager_kernel(kernel.impl, arity, kernel.takes_packed), lib=LIBRARY)


ROTARY_KERNELS = DeviceRegistry("rotary", on_register=_serve_dispatcher)
"""Device type -> the kernel of the rotary ops' eager calls there: `impl(call)` (`op_definition.Impl`), `plan(call)`
(a `Planner`) and `takes_packed`; a device without one (the CPU) runs the reference."""


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
    kernel = ROTARY_KERNELS.kernels.get(device)
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
