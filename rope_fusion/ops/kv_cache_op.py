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

from .device_registry import DeviceRegistry
from .kv_cache import JOINT_SCHEMA, SEPARATE_SCHEMA, CacheCall, check, parse_joint, parse_separate
from .kv_cache_reference import reference
from .op_families import LIBRARY, define_family
from .optional_backends import load_backends
from .plan_cache import PlanCache
from .public_functions import tensor_geometry

# impl(cc) -> q rotated ([T, Hq, Dq]) after writing the caches, or None where the kernel does not take the call (the
# reference then runs)
Impl = Callable[[CacheCall], "torch.Tensor | None"]
CACHE_KERNELS = DeviceRegistry("KV-cache")
"""Device type -> the cache ops' kernel there, its `impl` an `Impl`."""


def run(cc: CacheCall) -> torch.Tensor:
    """A checked call on its device: the device's kernel, else the reference; q rotated in the caller's shape."""
    load_backends()  # the device's kernel registers when its backend imports
    kernel = CACHE_KERNELS.kernels.get(cc.q.device.type)
    out = kernel.impl(cc) if kernel is not None else None
    if out is None:
        out = reference(cc)
    return out.view(cc.q_shape)


Parse = Callable[[Sequence[Any], dict], CacheCall]
_CHECKED = PlanCache("kv_cache.checked")  # (parser, geometry) of the calls that passed `check`: True


def geometry_key(args: Sequence[Any], kw: dict) -> tuple | None:
    """What `check` depends on: every tensor's geometry (`public_functions.tensor_geometry`: shape, strides, dtype,
    device, alignment) and every other argument; None where one cannot be a key."""
    def part(a: Any) -> Any:
        return tensor_geometry(a) if isinstance(a, torch.Tensor) else a
    try:
        key = (tuple(part(a) for a in args), tuple((k, part(v)) for k, v in kw.items()))
        hash(key)
    except (TypeError, RuntimeError):  # a tensor without storage (fake tensors), an unhashable argument
        return None
    return key


def checked(parse: Parse, args: Sequence[Any], kw: dict) -> CacheCall:
    """The parsed call, checked once per geometry: Inductor's graph calls the op once per layer with one geometry,
    and the checks cost more host time than the launch."""
    cc = parse(args, kw)
    key = geometry_key(args, kw)
    if key is not None:
        key = (parse.__name__, key)
    if key is None or key not in _CHECKED:
        check(cc)
        _CHECKED.put(key, True)
    return cc


def _eager(parse: Parse) -> Callable[..., torch.Tensor]:
    def run_op(*args: Any, **kw: Any) -> torch.Tensor:
        return run(checked(parse, args, kw))
    return run_op


def _fake(parse: Parse) -> Callable[..., torch.Tensor]:
    def fake(*args: Any, **kw: Any) -> torch.Tensor:
        cc = parse(args, kw)
        check(cc)
        return cc.q.new_empty(cc.q_shape, dtype=cc.call.params.out_dtype)
    return fake


def _not_differentiable(name: str) -> Callable[..., torch.Tensor]:
    """The op's Autograd kernel: a call that would record a gradient raises, where torch's fallback for an op with no
    autograd formula (a mutating op may not have one) would warn at the backward and give no gradient, a silently
    wrong one; any other call goes on below autograd."""
    def run_op(*args: Any, **kw: Any) -> torch.Tensor:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kw.values())):
            raise RuntimeError(f"rope_fusion::{name} is not differentiable: it writes a KV cache, which is inference. "
                               "Call it under torch.no_grad() or torch.inference_mode(), or rotate with "
                               "rope_fusion.apply_rotary_qk where a gradient is needed")
        with torch._C._AutoDispatchBelowAutograd():
            return getattr(torch.ops.rope_fusion, name).default(*args, **kw)
    return run_op


def _refuse_autograd(qualname: str, _: Parse) -> None:
    name = qualname.split("::", 1)[1]
    LIBRARY.impl(name, _not_differentiable(name), "Autograd")


_SCHEMAS = {parse_separate: SEPARATE_SCHEMA, parse_joint: JOINT_SCHEMA}
KV_CACHE_OP, MLA_CACHE_OP = define_family({parse_separate: "rotary_qk_kv_cache", parse_joint: "rotary_qk_mla_cache"},
                                          _SCHEMAS.__getitem__, _eager, _fake, _refuse_autograd)
