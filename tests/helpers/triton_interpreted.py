"""A Triton kernel as TRITON_INTERPRET=1 builds it, for CPU runs in a process that imported it compiled.

`triton.jit` decides at decoration time whether a function is interpreted, and the kernel modules are imported
compiled (the graph tests trace them on fake tensors, which an interpreted kernel cannot do). The tests run an
interpreted copy of the kernel instead. A kernel that calls `@triton.jit` helpers (Triton inlines them when it
compiles) needs interpreted helpers too: an interpreted kernel calling a compiled helper raises "Cannot call
@triton.jit'd outside of the scope of a kernel". `interpreted` rebuilds the kernel and every `@triton.jit` function
of its module over one copy of the module's namespace, each an `InterpretedFunction`, so the kernel's calls find
interpreted helpers while the module itself stays as imported. Triton's own library functions (`tl.sum`) are
patched where the tests need them (tests/helpers/interpreted_rotary.poisoned_outputs).
"""

from __future__ import annotations

import functools
import types
from typing import Any

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def interpreted(kernel: Any) -> InterpretedFunction:
    """The interpreted form of a `@triton.jit` kernel (the kernel itself when it is interpreted already)."""
    if isinstance(kernel, InterpretedFunction):
        return kernel
    return _interpreted(kernel)


@functools.cache
def _interpreted(kernel: JITFunction) -> InterpretedFunction:
    fn = kernel.fn
    helpers = [v for v in fn.__globals__.values() if isinstance(v, JITFunction) and v is not kernel]
    if not helpers:  # a kernel of one function: its module's namespace as it is
        return InterpretedFunction(fn)
    namespace = dict(fn.__globals__)
    for name, value in list(namespace.items()):
        if isinstance(value, JITFunction):
            namespace[name] = InterpretedFunction(_rebound(value.fn, namespace))
    own = namespace.get(fn.__name__)  # the kernel as its module names it, rebuilt above
    return own if isinstance(own, InterpretedFunction) else InterpretedFunction(_rebound(fn, namespace))


def _rebound(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    """fn with its global names looked up in namespace (its code, defaults and source lines unchanged)."""
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__annotations__ = fn.__annotations__
    new.__module__ = fn.__module__
    new.__qualname__ = fn.__qualname__
    return new
