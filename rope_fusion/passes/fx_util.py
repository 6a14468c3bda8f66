"""FX node and shape helpers shared by the lane algebra, the matcher and the rewriter.

Sizes in a post-grad graph are ints or SymInts (dynamic shapes); these helpers say when a size is
concrete, fix a symbolic one at its hint when the caller needs an int (Inductor then guards on it), and
compare sizes without adding guards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int, is_concrete_int, statically_known_true

# dtype casts, as the post-grad graph spells them
CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


class SymbolicSizeError(ValueError):
    """A size that has to be a concrete int is symbolic (raised by `concrete_ints`)."""


def meta(node: Any) -> Any:
    """The fake value (`meta["val"]`) of an FX node: a FakeTensor, a SymInt, a list of them, or None for
    a node without one and for anything that is not a node (a constant argument)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def as_int(size: Any, specialize: bool = False) -> int | None:
    """`size` as an int when it is concrete, else None. With `specialize`, a symbolic size is fixed at
    its hint instead (guarding on it): for sizes that index lanes, which the pass needs to enumerate."""
    if isinstance(size, int):
        return size
    try:
        if is_concrete_int(size):
            return int(size)
        if specialize:
            return int(guard_int(size))
    except Exception:
        return None
    return None


def same_dim(a: Any, b: Any) -> bool:
    """True when two sizes are known to be equal (ints, or SymInts whose equality needs no new guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def concrete_ints(dims, specialize: bool = False) -> list[int]:
    """`as_int` of every size in `dims`; raises SymbolicSizeError when one of them is not concrete."""
    out = [as_int(d, specialize) for d in dims]
    if any(d is None for d in out):
        raise SymbolicSizeError("symbolic lane dims")
    return out


def norm_dim(dim: int, ndim: int) -> int:
    """A dim argument as a non-negative index into `ndim` dims (`-1` is `ndim - 1`)."""
    return dim + ndim if dim < 0 else dim


def chain_back(node: fx.Node, through) -> list:
    """`node` and the nodes it comes from through ops in `through` that pass their first input on (views,
    casts, copies), nearest first: the last one is where the values arise."""
    out = [node]
    while node.target in through and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        out.append(node)
    return out
