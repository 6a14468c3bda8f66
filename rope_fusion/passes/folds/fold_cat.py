"""The cat fold's record: a joined x read from its pieces by the fused node, the joined rotation written once
(passes/folds/cat_pieces.py finds and emits it). The cat op's call is planned before the choice where a backend that
takes it may be chosen, so that `auto` times it as it would run (the pieces' norm proofs are not paid elsewhere)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from ...ops.cat_rotary import why_not as cat_why_not
from ...ops.schema import RotaryCall
from ..emission import Emitter, norm_weight, raw_x, unflatten
from .cat_pieces import cat_call, describe, emit_cat, group_joins, piece_norms
from .fold_registry import Fold, Folded, FoldSite, NotFolded, register_fold

NAME = "cat"


@dataclasses.dataclass
class JoinPlan:
    """The cat op's call on a group's pieces, as graph nodes: per member its two pieces and, with a norm folded,
    their weights; the op's parameters, the joins' dims, the report's fold line and what happened to the pieces'
    norms. Planned before the backend is chosen (`auto` times it), emitted after."""

    firsts: list
    seconds: list
    weights: list | None
    second_weights: list
    params: Any
    dims: list
    fold: str
    norm: str


def _find(site: FoldSite) -> list | NotFolded | None:
    """Every member's join (a norm before the rotation folds into the op instead: no join is read then)."""
    if site.norms is not None:
        return None
    joins = group_joins(site.group, site.xs, site.inputs, site.depends_on)
    return NotFolded(NAME, joins) if isinstance(joins, str) else joins


def _plan(em: Emitter, site: FoldSite, joins: list) -> JoinPlan | NotFolded:
    """The cat op's call on the pieces of every member's join, each piece's norm folded where all fold (and the
    kernel takes them: else they stay in the graph), or why the kernel takes no call of these pieces. The nodes of
    a plan not emitted are dead: the pass removes them."""
    group, call = site.group, site.call
    dims = [j.dim for j in joins]
    plain = ([j.first for j in joins], [j.second for j in joins], None, [None] * len(joins), call.params)
    tries = []
    found = piece_norms(group, joins, site.depends_on)
    if found.norms is not None:
        pairs = list(zip(group, found.norms))
        kind, eps = found.norms[0][0].kind, found.norms[0][0].eps
        tries.append(([raw_x(em, f[0], m.node) for m, f in pairs], [raw_x(em, f[1], m.node) for m, f in pairs],
                      [norm_weight(em, f[0], m) for m, f in pairs], [norm_weight(em, f[1], m) for m, f in pairs],
                      call.params.replace(norm=kind, norm_eps=eps)))
    tries.append(plain)
    why = ""
    for firsts, seconds, weights, second_weights, params in tries:
        c = dataclasses.replace(call, params=params)
        reason = cat_why_not(cat_call(c, firsts, seconds, weights, second_weights, dims))
        if reason is None:
            if params.norm != "none":
                norm = f"{params.norm} folded"
            elif why or found.why:
                norm = f"left in the graph: {why or found.why}"
            else:
                norm = ""
            return JoinPlan(firsts, seconds, weights, second_weights, params, dims, describe(joins), norm)
        why = why or f"the kernel does not take the pieces' norms ({reason})"
        last = reason
    return NotFolded(NAME, last)


def _emit(em: Emitter, site: FoldSite, plan: JoinPlan) -> Folded:
    """The planned cat op's call: the pieces read, the joined rotation written once."""
    c: RotaryCall = dataclasses.replace(site.call, params=plan.params)
    like: fx.Node = site.like
    outs = emit_cat(em, c, plan.firsts, plan.seconds, plan.weights, plan.second_weights, plan.dims, like)
    finals = [unflatten(em, o, m) for o, m in zip(outs, site.group)]
    return Folded(finals, [m.node for m in site.group], plan.fold, plan.params, plan.norm)


def _runner(built: Any, site: Any, real: dict) -> Any:
    from ..auto.auto_timing import cat_runner

    return cat_runner(built, site, [real[n] for n in built.pieces_inputs])


def _costed_as(plan: JoinPlan) -> dict:
    """The pieces' norms as the cost record's norm where they fold into the kernel: the model's code and the lowering
    compute them too (Inductor fuses norm, cat and rotation into one kernel a tensor), so every choice carries them.
    Costed as the site's own call, without them, Flux's joint pair (interleaved) looked like a plain rotation: the
    kernel at about 0.7 of left's estimate, undecided, and left unmeasured under the compile's allowance. The H200
    measured that pair (M13) at 1.27-1.35x the floor with the pieces' norms folded, against plain compile's 3.37x and
    the lowering's 2.01x: the table's norm factors (1.12, 2.9 and 1.9x) are the measured ones' order."""
    return {"norm": plan.params.norm} if plan.params.norm != "none" else {}


CAT = Fold(NAME, _find, _emit, prepare=_plan, runner=_runner, timed_as=lambda plan: {"joins": plan},
           reads_pieces=True, costed_as=_costed_as)
register_fold(CAT)
