"""Folds: data movement next to a rotation that a backend's fused node takes over, one record each, in one order.

An opaque node (the Triton kernel's) cannot be fused by Inductor with what reads or writes around it: a rotation
written back into a slice, a joined x read from its pieces, a rotation joined after it. The op's lowering fuses
those already, so only the backends that name a fold in their `Backend.folds` (ops/backends.py) take it. Each fold
is complete in its `Fold` record: how it finds its plan for a group (`find`, and `prepare` where the plan emits
nodes that `auto` times before the choice), how it emits the group (`emit`), how `auto` times it (`runner`, or None:
timed as the plain kernel, which the report names), how it finishes the graph once every group is committed
(`finish`, `reorders`) and how it reads in the report (`name`, and the line its `emit` returns).

A fold may also act on what the fused nodes feed once every group is committed (`epilogue`: the KV-cache write
of vLLM's layers, passes/folds/kv_cache_fold.py, whose `find` and `emit` only make sure its pair is emitted as the
op call the epilogue reads). The epilogue reads the graph the pass left, in a transaction of its own, so a failure
keeps the sites fused. Its outcomes (`FoldOutcome`) become the fold line of the fused node they name, or a near
miss where no fused node feeds the place.

Planning (passes/emission.py `plan_group`) asks the folds in registry order: before the backend is chosen, the
first fold whose plan holds claims the group (`auto` times that fold); after the choice, the first of the chosen
backend's folds whose plan holds emits it. A fold whose plan looks at the site's consumers (a node after the site)
returns those nodes in `Folded.replaced`: their uses take the fold's results.

Adding a fold: a module in this folder that builds its `Fold` and calls `register_fold` at import, one import line in
`_load` below (the order is the registry's: an earlier fold claims a group first), and the fold's name in the
`folds` of each backend that takes it.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

# the built-in folds, in the registry's order (each module registers its record when imported)
# views that keep a tensor's elements: what a fold reads through to find the node a value comes from
VIEW_OPS = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
            torch.ops.aten.alias.default)
_BUILTIN = ("fold_slice_write", "fold_cat", "fold_joined_write", "kv_cache_fold")


@dataclasses.dataclass
class FoldSite:
    """A group as the folds see it, once the op's call is planned: the sites, x as the op reads it (`xs`) and
    before any cast (`inputs`), the call on graph nodes, the folded norms (None where none folds), and the graph's
    `depends_on`."""

    group: tuple
    xs: list
    inputs: list
    call: Any  # RotaryCall whose tensors are graph nodes
    norms: list | None
    depends_on: Callable
    requested: str = "auto"  # the backend the pass was asked for (a fold's decision may depend on it)

    @property
    def like(self) -> Any:
        """The node whose provenance new nodes take: the first site's."""
        return self.group[0].node


@dataclasses.dataclass(frozen=True)
class NotFolded:
    """Why a fold that applies to a group does not take it: the report's fold line says so."""

    fold: str
    why: str

    def line(self) -> str:
        return f"{self.fold} not folded: {self.why}"


@dataclasses.dataclass
class Folded:
    """A fold's emission: per site the node that replaces it (`finals`) and the node whose uses they take
    (`replaced`: the site, or a consumer after it), the report's fold line, and the op's parameters and the norm's
    fate where the fold decided them (None and "": the call's own)."""

    finals: list
    replaced: list
    line: str
    params: Any = None
    norm: str = ""


@dataclasses.dataclass(frozen=True)
class FoldOutcome:
    """What an epilogue fold did at one place of the graph: the fused node whose result it read (its kernel's fold
    line, where it folded or no group fold wrote one; None or a node the pass did not emit: a near miss at `where`),
    the node it looked at (`where`) and what it acts on (`subject`), its line, the op now in the fused node's place
    where it folded, and the source line of `where`."""

    fused: Any
    where: str
    subject: str
    line: str
    op_name: str | None = None
    source: str = ""  # the model's source line of `where`


@dataclasses.dataclass(frozen=True)
class Fold:
    """One fold. `find(site)` is pure analysis: its plan, a NotFolded, or None where the fold does not apply.
    `prepare(em, site, found)` (optional) turns a found plan into graph nodes before the choice, where a backend that
    takes the fold may be chosen, so that `auto` times it as it would run. `timed_as(plan)` gives the fields of
    `auto_timing.AutoSite` its timed region needs; `runner(built, site, real)` is its candidate's compiled call
    (None: `auto` times the plain kernel, and the report says so). `finish(em)` runs once all groups are committed;
    `reorders`: the graph needs a stable topological sort after the fold. `reads_pieces`: the kernel reads x's
    pieces itself, so the cost model drops the join's write and read (ops/cost_model.py). `costed_as(plan)`: the
    fields of the site's cost record (`SiteCost`) that the fold's plan changes for every choice, where it sees work
    the site's own call does not (a norm of the pieces that the model's code and the lowering compute too, which
    the kernel folds). `epilogue(graph, backend)`:
    a fold that acts after every group is committed instead (no `find`, `emit`), returning its `FoldOutcome`s."""

    name: str
    find: Callable[[FoldSite], Any] | None = None
    emit: Callable[[Any, FoldSite, Any], Folded] | None = None
    prepare: Callable[[Any, FoldSite, Any], Any] | None = None
    runner: Callable[[Any, Any, dict], Callable[[], Any]] | None = None
    timed_as: Callable[[Any], dict] = lambda plan: {}
    finish: Callable[[Any], None] | None = None
    reorders: bool = False
    reads_pieces: bool = False
    costed_as: Callable[[Any], dict] = lambda plan: {}
    epilogue: Callable[[Any, str], list[FoldOutcome]] | None = None


_FOLDS: list[Fold] = []
_LOADED = False


def register_fold(fold: Fold) -> None:
    """Add a fold at the end of the registry (a fold of the same name is replaced where it stands)."""
    for i, f in enumerate(_FOLDS):
        if f.name == fold.name:
            _FOLDS[i] = fold
            return
    _FOLDS.append(fold)


def unregister_fold(name: str) -> None:
    _FOLDS[:] = [f for f in _FOLDS if f.name != name]


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for module in _BUILTIN:
            importlib.import_module(f"{__package__}.{module}")


def folds() -> tuple[Fold, ...]:
    """The registered folds that claim groups, in order."""
    _load()
    return tuple(f for f in _FOLDS if f.find is not None)


def epilogues() -> tuple[Fold, ...]:
    """The registered folds that act after every group is committed, in order."""
    _load()
    return tuple(f for f in _FOLDS if f.epilogue is not None)


def taken_by(backend: Any) -> tuple[Fold, ...]:
    """The folds a backend's node takes, in the registry's order."""
    return tuple(f for f in folds() if f.name in backend.folds)


def strip_views(node: Any) -> Any:
    """`node` read back through the views that keep its elements (`VIEW_OPS`)."""
    while isinstance(node, fx.Node) and node.target in VIEW_OPS:
        node = node.args[0]
    return node


def producer(node: Any) -> Any:
    """The node behind `node` through views and one getitem: the multi-output node whose result it is."""
    got = strip_views(node)
    return got.args[0] if isinstance(got, fx.Node) and got.target is operator.getitem else got


def fused_node(planned: Any) -> Any:
    """The fused op node behind a planned group's results (passes/emission.py `PlannedGroup`): what an epilogue's
    `FoldOutcome.fused` names. Views of a getitem of one multi-output node are read through; None where the
    results do not come from one node."""
    sources = set()
    for final in planned.finals:
        got = strip_views(final)
        if not (isinstance(got, fx.Node) and got.target is operator.getitem):
            return None
        sources.add(got.args[0])
    return sources.pop() if len(sources) == 1 else None


__all__ = ["VIEW_OPS", "Fold", "FoldOutcome", "FoldSite", "Folded", "NotFolded", "epilogues", "folds", "fused_node",
           "producer", "register_fold", "strip_views", "taken_by", "unregister_fold"]
