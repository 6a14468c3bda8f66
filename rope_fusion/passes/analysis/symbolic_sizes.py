"""Sites whose proof read a symbolic size as a constant are left as they were, never guarded (docs/design.md 5).

The lane algebra enumerates a rotation's lanes, so it reads the head dim (and whatever sizes index lanes: a split's
chunk, a slice's bounds along the lanes) as ints; under dynamic shapes those reads take the size's example value
(fx_sizes.HintReads). The fused op then holds for that value only. Guarding it made Dynamo compile again for every
other value (3 graphs for 3 head dims where plain compile makes one) and failed the compile outright where the user
had marked the dim dynamic (`torch._dynamo.mark_dynamic`: ConstraintViolationError). Such a site is now a near
miss that names the size and where it comes from, and the graph compiles as plain compile compiles it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from ...fx_sizes import hint_reads_needed_by
from ...ops.backends import LeftToInductor


def site_roots(m, nodes: dict) -> list:
    """A site's nodes whose sizes its proof and its fused form depend on: the node it replaces, x, its tables and
    the rows a kernel site reads."""
    roots = [m.node, nodes[m.x.name], *m.tables.tensors(nodes), *m.tables.row_inputs]
    return [n for n in roots if isinstance(n, fx.Node)]


def _name(source) -> str:
    name = source.name  # a property in torch 2.13, a method before
    return name if isinstance(name, str) else name()


def _dims_of(size: torch.SymInt, x: fx.Node) -> list:
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return []
    return [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr == size.node.expr]


def _where(size: torch.SymInt, x: fx.Node) -> str:
    """The size as the user can find it: x's dim it is, and the inputs' dims Dynamo made its symbols from."""
    expr = size.node.expr
    parts = []
    dims = _dims_of(size, x)
    if dims:
        parts.append(("the head dim" if dims[-1] == x.meta["val"].dim() - 1 else f"dim {dims[-1]}") + " of x")
    env = size.node.shape_env
    symbols = expr.free_symbols
    # the inputs' dims of these symbols, and of the symbols Dynamo replaced by them (dims it found equal)
    named = [sym for sym in env.var_to_sources
             if sym in symbols or getattr(env.replacements.get(sym), "free_symbols", set()) & symbols]
    sources = sorted({_name(src) for sym in named for src in env.var_to_sources[sym]})
    if sources:
        parts.append("from " + ", ".join(sources[:4]))
    return f"{expr} = {size.node.hint} here" + (f" ({'; '.join(parts)})" if parts else "")


def symbolic_reason(m, nodes: dict, computed: dict) -> str | None:
    """Why a site is left under dynamic shapes (a size its proof read at its example value), or None. `computed`:
    the lane interpreter's values, by node (a node a rule computed is followed to its inputs)."""
    needed = hint_reads_needed_by(site_roots(m, nodes), lambda n: n in computed)
    if not needed:
        return None
    x = nodes[m.x.name]
    size = next((s for s in needed if _dims_of(s, x)), needed[0])  # x's own dim where one was read
    return (f"it reads a symbolic size as a constant: {_where(size, x)}. Fused, it would hold for that value only "
            "and need a guard (a recompile for every other value; an error for a dim marked dynamic), so it is "
            "left as plain compile has it; a static size fuses")


def hold_symbolic(matches: list, nodes: dict, computed: dict) -> tuple[list, list]:
    """(the sites to fuse, [(site, reason)] for the sites left because they read a symbolic size)."""
    kept, held = [], []
    for m in matches:
        why = symbolic_reason(m, nodes, computed)
        if why is None:
            kept.append(m)
        else:
            held.append((m, why))
    return kept, held


class ReadsSymbolicSize(LeftToInductor):
    """A group whose planning read a symbolic size its sites depend on (a table's lane window cut at `s - 4`, say,
    read as a constant offset): the group is left as plain compile has it, a near miss with `symbolic_reason`'s
    text, and the other groups still fuse."""


def check_group(group: Iterable, nodes: dict, computed: dict) -> None:
    """Raise ReadsSymbolicSize where a planned group's sites depend on a size read at its hint, by the matcher or
    while the group was planned (its tables' windows, a fold's offsets), which `hold_symbolic` could not see."""
    for m in group:
        why = symbolic_reason(m, nodes, computed)
        if why is not None:
            raise ReadsSymbolicSize(why)


def check_none_needed(roots: Iterable[fx.Node], computed: dict) -> None:
    """Raise where a fused node depends on a size read at its hint after the sites were chosen (grouping or
    emission read one): the failure policy then restores the graph rather than leave a fused form that holds
    for one value without a guard."""
    needed = hint_reads_needed_by(roots, lambda n: n in computed)
    if needed:
        raise RuntimeError(f"a fused site depends on the symbolic size {needed[0].node.expr} read at its hint")
