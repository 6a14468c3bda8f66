"""The cache ops as torch.library operators, `rope_fusion::rotary_qk_kv_cache` and `rotary_qk_mla_cache`, and their
dispatch (ops/kv_cache.py has their meaning).

They mutate their caches (`Tensor(a!)`): traced, they are `auto_functionalized`, and Inductor writes the caches in
place. Eagerly a kernel registered for the tensors' device serves a call (`CACHE_KERNELS`: the Triton
kernel's KV-cache epilogue on CUDA, kernels/triton_kv_cache.py; torch_npu's fused ops on Ascend,
kernels/npu_kv_cache.py), and the reference (ops/kv_cache_reference.py) wherever none does or the kernel declines the
call. They are not differentiable: a cache write is inference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import call_replay
from .device_registry import DeviceRegistry
from .kv_cache import JOINT_SCHEMA, SEPARATE_SCHEMA, CacheCall, check, parse_joint, parse_separate
from .kv_cache_reference import reference
from .op_families import LIBRARY, define_family
from .optional_backends import load_backends
from .plan_cache import PlanCache

# impl(cc) -> q rotated ([T, Hq, Dq]) after writing the caches, or None where the kernel does not take the call (the
# reference then runs)
Impl = Callable[[CacheCall], "torch.Tensor | None"]
CACHE_KERNELS = DeviceRegistry("KV-cache")
"""Device type -> the cache ops' kernel there: its `impl` an `Impl`, its `plan` (optional) `plan(cc)` -> the runner
(`runner(cc)` -> q rotated, the caches written) of every later call of cc's key, or None (its calls go to `impl`)."""


def run(cc: CacheCall) -> torch.Tensor:
    """A checked call on its device: the device's kernel, else the reference; q rotated in the caller's shape."""
    load_backends()  # the device's kernel registers when its backend imports
    kernel = CACHE_KERNELS.kernels.get(cc.q.device.type)
    out = kernel.impl(cc) if kernel is not None else None
    if out is None:
        out = reference(cc)
    return out.view(cc.q_shape)


Parse = Callable[[Sequence[Any], dict], CacheCall]
_CHECKED = PlanCache("kv_cache.checked")  # (parser, call key) of the calls that passed `check`: True
_RUNNERS = CACHE_KERNELS.plan_cache("kv_cache.runners")  # (parser, call key) -> the device's planned runner, or False


def _eager(parse: Parse) -> Callable[..., torch.Tensor]:
    """The op's eager kernel. Inductor's graph calls it once per layer with one geometry, and the checks and the
    launch's planning cost more host time than the launch: a call's key (`call_replay.flatten`: every tensor's
    geometry and every other argument) is checked once, and the device kernel's runner planned for it once
    (`DeviceKernel.plan`, the Triton kernel's launch), so a later call of the key costs its key, its parse and its
    launch."""
    def run_op(*args: Any, **kw: Any) -> torch.Tensor:
        flat = call_replay.flatten(args, kw)
        key = None if flat is None else (parse.__name__, flat[0])
        cc = parse(args, kw)
        runner = _RUNNERS.get(key)  # False: the key's calls go to the kernel as they come
        if runner:
            return runner(cc).view(cc.q_shape)
        if key is None or key not in _CHECKED:
            check(cc)
            _CHECKED.put(key, True)
        if runner is None and key is not None:
            runner = _RUNNERS.put(key, planned_runner(cc) or False)
            if runner:
                return runner(cc).view(cc.q_shape)
        return run(cc)
    return run_op


def planned_runner(cc: CacheCall) -> Callable[[CacheCall], torch.Tensor] | None:
    """The device kernel's runner of every later call of cc's geometry, for a caller that keys and checks its calls
    itself (the op's eager kernel, the public function); None where the device has no planner or its kernel does
    not take the geometry (`run` then serves each call)."""
    load_backends()  # the device's kernel registers when its backend imports
    kernel = CACHE_KERNELS.kernels.get(cc.q.device.type)
    return kernel.plan(cc) if kernel is not None and kernel.plan is not None else None


def _fake(parse: Parse) -> Callable[..., torch.Tensor]:
    def fake(*args: Any, **kw: Any) -> torch.Tensor:
        cc = parse(args, kw)
        check(cc)
        return cc.q.new_empty(cc.q_shape, dtype=cc.call.params.out_dtype)
    return fake


def _not_differentiable(name: str, eager: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The op's Autograd kernel: a call that would record a gradient raises, where torch's fallback for an op with no
    autograd formula (a mutating op may not have one) would warn at the backward and give no gradient, a silently
    wrong one; any other call goes on below autograd. A call of plain tensors with no dispatch mode or transform
    active runs `eager`, the kernel the dispatcher would reach below autograd, directly: dispatching again
    converts the op's 30-odd arguments to and from the dispatcher's once more (about 20 us of a call's host time
    on a 2-core CPU)."""
    op = getattr(torch.ops.rope_fusion, name).default

    def run_op(*args: Any, **kw: Any) -> torch.Tensor:
        tensors = [a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise RuntimeError(f"rope_fusion::{name} is not differentiable: it writes a KV cache, which is inference. "
                               "Call it under torch.no_grad() or torch.inference_mode(), or rotate with "
                               "rope_fusion.apply_rotary_qk where a gradient is needed")
        if (not torch._C._len_torch_dispatch_stack() and not torch._C._are_functorch_transforms_active()
                and all(type(t) is torch.Tensor and not torch._is_functional_tensor(t) for t in tensors)):
            return eager(*args, **kw)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kw)
    return run_op


def _refuse_autograd(qualname: str, parse: Parse) -> None:
    name = qualname.split("::", 1)[1]
    LIBRARY.impl(name, _not_differentiable(name, _eager(parse)), "Autograd")


_SCHEMAS = {parse_separate: SEPARATE_SCHEMA, parse_joint: JOINT_SCHEMA}
KV_CACHE_OP, MLA_CACHE_OP = define_family({parse_separate: "rotary_qk_kv_cache", parse_joint: "rotary_qk_mla_cache"},
                                          _SCHEMAS.__getitem__, _eager, _fake, _refuse_autograd)
