"""The joined-write fold's record: a rotation joined after it, written into its rows of the join by the fused node
(passes/folds/joined_writes.py finds and emits it, and once every group is committed replaces each cat by what the
groups wrote). `auto` times it as it runs: the into op writing into the join's buffer, through the dispatcher
(`auto_timing.joined_write_runner`), against the rotations Inductor writes into that buffer itself."""

from __future__ import annotations

from typing import Any

from ..emission import unflatten
from .fold_registry import Fold, Folded, FoldSite, NotFolded, register_fold
from .joined_writes import emit_joined_write, finish_joins, group_joined_writes

NAME = "joined write"


def _find(site: FoldSite) -> list | NotFolded | None:
    found = group_joined_writes(site.group, site.xs)
    return NotFolded(NAME, found) if isinstance(found, str) else found


def _emit(em: Any, site: FoldSite, writes: list) -> Folded:
    rows, updates = emit_joined_write(em, em.joins, site.call, writes, site.like)
    finals = [unflatten(em, r, m) for r, m in zip(rows, site.group)]  # a member's own tensor: x's shape
    em.joins.update(updates)  # later groups write into what this one wrote
    return Folded(finals, [m.node for m in site.group], "joined write: " + ", ".join(w.describe() for w in writes))


def _finish(em: Any) -> None:
    """Every cat the groups wrote into replaced by what they wrote, with the pieces none wrote."""
    if em.joins:
        finish_joins(em, em.joins)


def _runner(built: Any, site: Any, real: dict) -> Any:
    from ..auto.auto_timing import joined_write_runner

    return joined_write_runner(built, site, [real[n] for n in built.upstream_inputs])


# a group may write into what a group placed after it wrote, and the pieces are scattered before the cat: the
# graph is sorted again afterwards
JOINED_WRITE = Fold(NAME, _find, _emit, runner=_runner, timed_as=lambda writes: {"joined": writes}, finish=_finish,
                    reorders=True)
register_fold(JOINED_WRITE)
