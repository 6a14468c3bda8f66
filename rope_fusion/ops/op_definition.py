"""The `rope_fusion::rotary`, `rotary_qk` and `rotary_qkv` operators, and the way every variant is defined.

Fused nodes are ordinary torch.library ops in any FX graph: a fake implementation (shape propagation under
torch.compile), an eager implementation (the reference, or a device kernel that a backend registers in
`device_runners.ROTARY_KERNELS`, which is torch.library's `register_kernel`), an autograd formula
(op_autograd.py) and, for the two main ops, an Inductor lowering (lowering.py). A backend that needs an op
Inductor must not lower (the NPU bridge, the Triton kernel behind a symbolic-size site) defines its own variant
with `define_rotary_ops(suffix, impl)`: same schema, fake and autograd formula, its own eager implementation,
defined as every op family is (`op_families.define_family`).
Every signature comes from `schema.RotaryParams` and `schema.optional_tensor_names`; implementations take a
`schema.RotaryCall`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import call_replay
from .op_autograd import register_rotary_autograd
from .op_families import LIBRARY, define_family
from .optional_backends import load_backends
from .packed import unpacked
from .plan_cache import PlanCache
from .reference import reference_outputs
from .schema import OP_NAMES, RotaryCall, check_call, op_schema

# impl(call) -> list of outputs, or None to use the reference
Impl = Callable[[RotaryCall], "list | None"]


def _result(outs: Sequence[torch.Tensor]) -> Any:
    return outs[0] if len(outs) == 1 else tuple(outs)


def _fake(arity: int) -> Callable[..., Any]:
    def fake(*args: Any, **kw: Any) -> Any:
        call = RotaryCall.parse(args, kw, arity)
        check_call(call)
        return _result([x.new_empty(x.shape, dtype=call.params.out_dtype) for x in call.xs])
    return fake


_REFERENCE = threading.local()


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Inside (this thread), every eager call of the package's ops runs the reference, whatever kernel its device
    has: the pass's self-check evaluates a fused form on the CPU by the op's semantics (passes/fusion_check.py),
    where a device kernel can only be a stand-in (the tests' interpreted Triton kernel, 1 s a call)."""
    depth = getattr(_REFERENCE, "depth", 0)
    _REFERENCE.depth = depth + 1
    try:
        yield
    finally:
        _REFERENCE.depth = depth


def reference_only() -> bool:
    """Whether eager calls run the reference now (`reference_kernels`)."""
    return getattr(_REFERENCE, "depth", 0) > 0


_CHECKED = PlanCache("rotary.checked")  # (arity, `call_replay.flatten`'s key) of the op calls that passed the checks


def eager_kernel(impl: Impl | None, arity: int, takes_packed: bool = False) -> Callable[..., Any]:
    """The dispatcher kernel of an arity's op around `impl`: the op's checks, the optional backends loaded, the
    reference where `impl` declines or `reference_kernels` is on. A call's key is checked once (the checks were
    about half of a call's 180 us of host time through the dispatcher on a 2-core CPU). One wrapper for the op's
    default kernel (`define_rotary_ops`) and each device's (`device_runners.ROTARY_KERNELS`), so every device
    checks and falls back alike. `takes_packed`: impl is given packed sequences' cu_seqlens, else their positions."""
    def run(*args: Any, **kw: Any) -> Any:
        call = RotaryCall.parse(args, kw, arity)
        flat = call_replay.flatten(args, kw)
        key = None if flat is None else (arity, flat[0])
        if key is None or key not in _CHECKED:  # what the checks read is in the key: once per key
            check_call(call)  # a direct call deserves the ValueError, not a kernel's failure
            _CHECKED.put(key, True)
        load_backends()  # a compiled graph may run the op before any eager call imported the device kernels
        if not takes_packed:
            call = unpacked(call)  # packed sequences: the implementation takes their positions
        outs = impl(call) if impl is not None and not reference_only() else None
        return _result(outs if outs is not None else reference_outputs(call))
    return run


def define_rotary_ops(suffix: str = "", impl: Impl | None = None, takes_packed: bool = False) -> tuple:
    """Define `rope_fusion::rotary{suffix}`, `rotary_qk{suffix}` and `rotary_qkv{suffix}` (one tensor; q and k;
    q, k and v that share tables, in one call) and return their default overloads, indexed by arity - 1.
    `takes_packed`: impl takes packed sequences' cu_seqlens as they are, else their derived positions."""
    return define_family({arity: base + suffix for arity, base in OP_NAMES.items()}, op_schema,
                         lambda arity: eager_kernel(impl, arity, takes_packed), _fake,
                         functools.partial(register_rotary_autograd, lib=LIBRARY))


OPS = define_rotary_ops()  # by arity - 1
ROTARY, ROTARY_QK, ROTARY_QKV = OPS
