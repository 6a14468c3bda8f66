"""Two tensors joined along a dim into a new contiguous one, on their device: a device's copy kernel that reads each
piece where it lies, registered per device type (the Triton kernel for CUDA, kernels/triton_join.py), else
`torch.cat`.

vllm-omni's joint QK-norm + RoPE returns v of its two streams joined beside the rotated q and k, and each stream's v
is a view of its chunked QKV projection. ATen's cat of pieces that are not contiguous copies them with its generic
strided kernel (an index computation per element, no vector loads): at Flux's double-stream geometry (512 + 4096
tokens, 24 x 128) the joint call measured 117 us of GPU time where reading and writing q, k and v once takes 45.5
(rope_fusion's launch of q and k is about 36 of it at this geometry, the cat op at 1.17x its floor). A planner
looks at a geometry once; the drop-in keeps its runner with the call's other plans.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .device_registry import DeviceRegistry
from .optional_backends import load_backends

Join = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# planner(first, second, dim) -> a runner joining every later pair of that geometry, or None where its kernel does
# not take the geometry
JoinPlanner = Callable[[torch.Tensor, torch.Tensor, int], "Join | None"]
JOIN_KERNELS = DeviceRegistry("join", required=("plan",))
"""Device type -> its join kernel, which only plans: its `plan` a `JoinPlanner` (None from it: `torch.cat`)."""


def plan_join(first: torch.Tensor, second: torch.Tensor, dim: int) -> Join:
    """The runner that joins tensors of first's and second's geometry along dim: the device's kernel where it takes
    them, else `torch.cat`."""
    load_backends()  # the device kernels register on import
    kernel = JOIN_KERNELS.get(first.device.type)
    run = kernel.plan(first, second, dim) if kernel is not None else None
    if run is not None:
        return run

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat((a, b), dim)
    return cat


__all__ = ["JOIN_KERNELS", "Join", "JoinPlanner", "plan_join"]
