"""Reading the sizes of an FX graph's values: concrete, symbolic, or symbolic read at a hint without a guard.

Sizes in a post-grad graph are ints or SymInts (dynamic shapes); these helpers say when a size is
concrete, read a symbolic one at its example value when the caller needs an int, and compare sizes without
adding guards.

Reading a symbolic size as an int is a decision that holds for one value only. A guard on it would make Dynamo
compile again for every other value (one graph per text length for `q[:, :, t:] = rope(q[:, :, t:])`, against
plain compile's one), and fail the compile of a dim the user marked dynamic. So inside `hint_reads()` a symbolic
size is read at its hint without a guard and remembered; a site whose proof may depend on such a read
(`HintReads.needed_by`) is left as it was (passes/analysis/symbolic_sizes.py), and the pass never guards. A graph it
leaves alone, or fuses where nothing symbolic was read, compiles exactly as often as without it. A
data-dependent size (`nonzero`, `.item()`) has no hint: it reads as not concrete, and whatever needed it is not
provable.

The graph passes and the kernels' graph-side code (which plans launches on the same fake sizes) both read
sizes so; this module sits below both packages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int, is_concrete_int, statically_known_true

from .fx_nodes import upstream


class SymbolicSizeError(ValueError):
    """A size that has to be a concrete int is symbolic (raised by `concrete_ints`)."""


class HintReads:
    """The symbolic sizes read at their hints, without a guard, while a graph is analysed.

    A size read with `specialize` fixes its symbols (`assumed`) for the rest of the analysis, as a guard on it
    would have done: any size made of assumed symbols then reads as an int too (a table's `s // 2` lanes once x's
    `s` lanes were read), and every such read is remembered. A read made while the lane interpreter computes one
    node's lanes (`reading_for`) is that node's; any other read (the matcher's, grouping's) belongs to no node
    and counts for every site that shares a symbol with it (`needed_by`)."""

    def __init__(self):
        self.reads: dict = {}  # the size's expression -> the SymInt read
        self.assumed: set = set()  # symbols fixed at their hints by a read with `specialize`
        self.by_node: dict = {}  # node -> the expressions read while its lanes were computed
        self.loose: set = set()  # the expressions read outside any node's lanes
        self.context: list = []  # the nodes whose lanes are being computed now (innermost last)

    def _remember(self, size: torch.SymInt) -> None:
        expr = size.node.expr
        self.reads.setdefault(expr, size)
        if self.context:
            self.by_node.setdefault(self.context[-1], set()).add(expr)
        else:
            self.loose.add(expr)

    def read(self, size: torch.SymInt) -> int | None:
        """The example value of a symbolic size, remembered; None for a size without one (data-dependent)."""
        node = size.node
        if not node.has_hint():
            return None
        self._remember(size)
        self.assumed |= node.expr.free_symbols
        return int(node.hint)

    def value(self, size: torch.SymInt) -> int | None:
        """The example value of a size made of assumed symbols only (remembered), else None."""
        node = size.node
        if not (self.assumed and node.expr.free_symbols <= self.assumed) or not node.has_hint():
            return None
        self._remember(size)
        return int(node.hint)

    def needed_by(self, roots: Iterable[fx.Node], lanes_of: Callable[[fx.Node], bool]) -> list:
        """The sizes read at their hints that a site's proof may depend on: those read for the lanes of its roots
        (the node it replaces, x, its tables) and of every node whose lanes they were computed from (`lanes_of`:
        whether a node's lanes were computed by a rule, whose inputs are then followed; a source's are its own),
        and those read outside any node whose symbols are sizes of the roots or of what they are computed from
        (on the safe side: a read of the matcher counts for every site that shares a symbol with it)."""
        if not self.reads:  # static shapes: nothing was read, so no walk of the roots' upstream
            return []
        roots = list(roots)
        exprs: set = set()
        for n in upstream(roots, lanes_of):
            exprs |= self.by_node.get(n, set())
        if self.loose:
            symbols = _symbols_upstream(roots)
            exprs |= {e for e in self.loose if e.free_symbols & symbols}
        return [size for expr, size in self.reads.items() if expr in exprs]


_READS: list = []  # the HintReads of the analysis running now (innermost last)


@contextlib.contextmanager
def hint_reads() -> Iterator[HintReads]:
    """Inside, `as_int(size, specialize=True)` reads a symbolic size at its hint without guarding on it."""
    record = HintReads()
    _READS.append(record)
    try:
        yield record
    finally:
        _READS.remove(record)


@contextlib.contextmanager
def reading_for(node: fx.Node) -> Iterator[None]:
    """The sizes read inside are read for `node`'s lanes (`HintReads.needed_by` follows them to its sites)."""
    if not _READS:
        yield
        return
    context = _READS[-1].context
    context.append(node)
    try:
        yield
    finally:
        context.pop()


def hint_reads_needed_by(roots: Iterable[fx.Node], lanes_of: Callable[[fx.Node], bool]) -> list:
    """`HintReads.needed_by(roots, lanes_of)` of the analysis running now (none outside `hint_reads()`)."""
    return _READS[-1].needed_by(roots, lanes_of) if _READS else []


def _symbols_upstream(roots: Iterable[fx.Node]) -> set:
    """The free symbols of the sizes (and SymInt values) of `roots` and every node they are computed from."""
    symbols: set = set()
    for node in upstream(roots):
        val = node.meta.get("val")
        for v in val if isinstance(val, (list, tuple)) else (val,):
            sizes = (*v.shape, *v.stride()) if isinstance(v, torch.Tensor) else (v,)
            for d in sizes:
                if isinstance(d, torch.SymInt):
                    symbols |= d.node.expr.free_symbols
    return symbols


def as_int(size: Any, specialize: bool = False) -> int | None:
    """`size` as an int when it is concrete, else None. With `specialize`, a symbolic size is read at its
    hint instead: for sizes that index lanes, which the pass needs to enumerate. Inside `hint_reads()` that read
    installs no guard (a site that depends on it is left unfused); outside, it guards. A data-dependent size has
    no hint and stays None."""
    if isinstance(size, int):
        return size
    try:
        if is_concrete_int(size):
            return int(size)
        if not isinstance(size, torch.SymInt):
            return None
        if _READS:
            return _READS[-1].read(size) if specialize else _READS[-1].value(size)
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
        if statically_known_true(a == b):
            return True
    except Exception:
        return False
    if _READS:  # sizes fixed by the analysis's own reads compare at their values (and are remembered)
        va, vb = as_int(a), as_int(b)
        return va is not None and va == vb
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
