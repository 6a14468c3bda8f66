"""FX node and shape helpers shared by the lane algebra, the matcher and the rewriter.

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
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int, is_concrete_int, statically_known_true

# dtype casts, as the post-grad graph spells them
CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)

_aten = torch.ops.aten
# The ops that pass their first input through: the result holds its numbers unchanged, as a view, a copy or a
# cast of it (`chain_back` follows them back to where the values arise). The one such set of the passes; each use
# that needs fewer or more says which and why where it is used.
PASS_THROUGH = frozenset({
    *CASTS, _aten.clone.default, _aten.contiguous.default, _aten.alias.default, _aten.view.default,
    _aten.reshape.default, _aten._unsafe_view.default, _aten.permute.default, _aten.transpose.int,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.expand.default, _aten.slice.Tensor,
    _aten.select.int, _aten.view_as_real.default, _aten.view_as_complex.default,
})
# The pass-through ops that write a new tensor (casts also round): what a view is not.
COPIES = frozenset({*CASTS, _aten.clone.default, _aten.contiguous.default})
# Views with several outputs, read through `getitem` (not first-input ops, so not in PASS_THROUGH).
SPLITS = frozenset({operator.getitem, _aten.split.Tensor, _aten.unbind.int})


class SymbolicSizeError(ValueError):
    """A size that has to be a concrete int is symbolic (raised by `concrete_ints`)."""


def meta(node: Any) -> Any:
    """The fake value (`meta["val"]`) of an FX node: a FakeTensor, a SymInt, a list of them, or None for
    a node without one and for anything that is not a node (a constant argument)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


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
        roots = list(roots)
        exprs: set = set()
        seen: set = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            exprs |= self.by_node.get(n, set())
            if lanes_of(n):
                stack.extend(n.all_input_nodes)
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
    seen: set = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
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


def chain_back(node: fx.Node, through) -> list:
    """`node` and the nodes it comes from through ops in `through` that pass their first input on (views,
    casts, copies), nearest first: the last one is where the values arise."""
    out = [node]
    while node.target in through and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        out.append(node)
    return out


def nearest_upstream(node: fx.Node, found: Callable[[fx.Node], bool], limit: int) -> fx.Node | None:
    """The nearest node at or before `node` (breadth first through every input) for which `found` holds, within
    `limit` nodes visited, else None: a bounded look back that keeps a wide graph cheap."""
    seen, queue, i = {node}, [node], 0
    while i < len(queue) and i < limit:
        n = queue[i]
        i += 1
        if found(n):
            return n
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                queue.append(a)
    return None
