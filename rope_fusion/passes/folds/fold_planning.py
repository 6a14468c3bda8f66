"""Asking the registered folds (passes/folds/fold_registry.py) about one group: before the backend is chosen, and after.

Before the choice every fold is asked in order until one's plan holds: that fold claims the group, and `auto` times
it as it would run (`AutoSite.fold`). A fold that must emit nodes to be timed (`prepare`) does so only where a
backend that takes it may be chosen; else its found plan waits for the choice. After the choice the chosen backend's
folds are asked in order, and the first whose plan holds emits the group; where none does, the ones that applied and
refused are the report's fold line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .fold_registry import Fold, FoldSite, NotFolded, folds, taken_by


@dataclasses.dataclass(frozen=True)
class _Unprepared:
    """A fold's found plan, not yet turned into nodes (no backend that takes it could be chosen before)."""

    found: Any


@dataclasses.dataclass
class FoldSearch:
    """What the folds said of one group before the choice: per fold name its outcome (a plan, a NotFolded, None, or
    a found plan not yet prepared), the fold that claimed the group with its plan, and whether a found plan has the
    kernel read x's pieces (the cost model's `joins_fold`)."""

    outcomes: dict
    claimed: Fold | None = None
    plan: Any = None
    reads_pieces: bool = False

    def timed(self) -> dict:
        """The fields of `auto_timing.AutoSite` that time the claiming fold as it would run."""
        if self.claimed is None:
            return {}
        return {"fold": self.claimed, **self.claimed.timed_as(self.plan)}

    def costed(self, cost: Any) -> Any:
        """The site's cost record as the claiming fold's plan sees it (`Fold.costed_as`); `cost` where none claims
        the group or the record is absent."""
        if self.claimed is None or cost is None:
            return cost
        changes = self.claimed.costed_as(self.plan)
        return dataclasses.replace(cost, **changes) if changes else cost


def _holds(outcome: Any) -> bool:
    return outcome is not None and not isinstance(outcome, (NotFolded, _Unprepared))


def _ask(em: Any, site: FoldSite, fold: Fold, may_take: bool) -> Any:
    found = fold.find(site)
    if not _holds(found) or fold.prepare is None:
        return found
    return fold.prepare(em, site, found) if may_take else _Unprepared(found)


def search(em: Any, site: FoldSite, may_take: Callable[[Fold], bool]) -> FoldSearch:
    """The folds in order until one's plan holds (it claims the group)."""
    result = FoldSearch({})
    for fold in folds():
        outcome = _ask(em, site, fold, may_take(fold))
        result.outcomes[fold.name] = outcome
        result.reads_pieces |= fold.reads_pieces and (_holds(outcome) or isinstance(outcome, _Unprepared))
        if _holds(outcome):
            result.claimed, result.plan = fold, outcome
            break
    return result


def after_choice(em: Any, site: FoldSite, backend: Any, found: FoldSearch) -> tuple[Fold, Any] | list[NotFolded]:
    """The first of the backend's folds whose plan holds, with its plan; else why each that applied did not."""
    refusals = []
    for fold in taken_by(backend):
        outcome = found.outcomes.get(fold.name, _Unprepared(None))
        if isinstance(outcome, _Unprepared):
            outcome = _ask(em, site, fold, True) if outcome.found is None else fold.prepare(em, site, outcome.found)
        if _holds(outcome):
            return fold, outcome
        if isinstance(outcome, NotFolded):
            refusals.append(outcome)
    return refusals


__all__ = ["FoldSearch", "after_choice", "search"]
