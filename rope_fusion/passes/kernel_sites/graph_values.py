"""Checks on graph values that every recogniser of a rotary kernel makes: a size, stride or flag as the graph holds
it, proven for every value of its symbols or not at all. Nothing here adds a guard (`statically_known_true` only), so
a check that cannot be proven reads as "no", and the call is reported as a near miss with the reason that
`KernelMiss` carries, never specialised to today's sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx


class KernelMiss(Exception):
    """Raised inside an analysis with the reason a call cannot be expressed (reported as a near miss)."""


def value_of(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def tensor_of(a: Any, what: str) -> torch.Tensor:
    v = value_of(a)
    if not isinstance(v, torch.Tensor):
        raise KernelMiss(f"{what} has no tensor metadata in the graph")
    return v


def known(cond: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(cond, bool):
        return cond
    try:
        return bool(statically_known_true(cond))
    except Exception:
        return False


def eq(a: Any, b: Any) -> bool:
    a, b = value_of(a), value_of(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return known(a == b)
    return False


def may_eq(a: Any, b: Any) -> bool:
    """Not provably different (symbolic sizes that the op itself checks at run time)."""
    a, b = value_of(a), value_of(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return not known(a != b)
    return False


def ge(a: Any, b: Any) -> bool:
    a, b = value_of(a), value_of(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return known(a >= b)
    return False


def static_int(a: Any, what: str) -> int:
    v = value_of(a)
    if isinstance(v, bool):
        raise KernelMiss(f"{what} is a bool, expected an int")
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        c = v.node.maybe_as_int()
        if c is not None:
            return int(c)
        raise KernelMiss(f"{what} is symbolic ({v}); the fused op needs it static (mark that dim static)")
    raise KernelMiss(f"{what} is not an int ({v!r})")


def static_bool(a: Any, what: str) -> bool:
    v = value_of(a)
    if isinstance(v, bool):
        return v
    raise KernelMiss(f"{what} is not a constant bool ({v!r})")


def contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguous, provably (size-1 dims excepted), without adding guards on symbolic sizes."""
    expected: Any = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if not (known(size == 1) or known(stride == expected)):
            return False
        expected = expected * size
    return True


def contiguous_rows(t: torch.Tensor) -> bool:
    """2-D with row stride = row length and unit column stride (size-1 dims excepted)."""
    return t.dim() == 2 and contiguous(t)


def size_key(size: Any) -> Any:
    """An int, or the expression of a symbolic size (equal expressions: provably equal sizes)."""
    if isinstance(size, torch.SymInt):
        c = size.node.maybe_as_int()
        return int(c) if c is not None else ("sym", str(size.node.expr))
    return int(size)
