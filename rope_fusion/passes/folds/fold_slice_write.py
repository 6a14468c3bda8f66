"""The slice-write fold's record: a rotation written back into the slice its x is read from, rotated in place by
the fused node (passes/folds/slice_writes.py finds and emits it; `auto` times the in-place op on the bases)."""

from __future__ import annotations

from typing import Any

import torch

from .fold_registry import Fold, Folded, FoldSite, NotFolded, register_fold
from .slice_writes import emit_slice_write, group_writes

aten = torch.ops.aten

NAME = "slice write"


def _find(site: FoldSite) -> list | NotFolded | None:
    """Every member's write, or why not where a member's result does flow into a scatter (a write the fold could
    have taken); elsewhere the fold does not apply."""
    found = group_writes(site.group, site.xs)
    if not isinstance(found, str):
        return found
    return NotFolded(NAME, found) if writes_back(site.group) else None


def writes_back(group: tuple) -> bool:
    """Whether a member's result flows into a slice_scatter (through a copy)."""
    for m in group:
        for u in m.node.users:
            if u.target is aten.slice_scatter.default or u.target is aten.copy.default and any(
                    w.target is aten.slice_scatter.default for w in u.users):
                return True
    return False


def _emit(em: Any, site: FoldSite, writes: list) -> Folded:
    finals = emit_slice_write(em, site.call, writes, site.like)
    return Folded(finals, [w.scatter for w in writes], "slice write: " + ", ".join(w.describe() for w in writes))


def _runner(built: Any, site: Any, real: dict) -> Any:
    from ..auto.auto_timing import slice_write_runner

    return slice_write_runner(built, site, [real[n] for n in built.upstream_inputs])


SLICE_WRITE = Fold(NAME, _find, _emit, runner=_runner, timed_as=lambda writes: {"writes": writes})
register_fold(SLICE_WRITE)
