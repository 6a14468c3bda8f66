"""Which nodes of a graph to replace: the largest rotations, and the near misses to report.

The lane interpreter gives every node a lane value; the acceptor decides which compute a RoPE. A rotation
is replaced at the last node that still has rotary form (through the final cast, the attention layout), so
that the whole subgraph dies; RoPE-looking values that fail are reported once each, at the outermost value
of their own computation, with the most specific reason.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import lane_rules  # noqa: F401  (registers the transfer rules)
from .lanes import LaneInterpreter, LaneValue
from .matcher import Acceptor, Match, looks_like_rotation

aten = torch.ops.aten


def find_sites(graph: fx.Graph) -> tuple[list[Match], list[tuple[fx.Node, str]], Acceptor]:
    """(rotations to replace in graph order, near misses as (node, reason), the acceptor with its caches)."""
    interp = LaneInterpreter(graph)
    interp.run()
    acc = Acceptor(interp)
    accepted: dict = {}
    rejected: dict = {}
    screened: dict = {}  # id of a lane list -> looks like a rotation: views and casts of a value share its lanes
    for node, v in interp.values.items():
        if not isinstance(v, LaneValue):
            continue
        verdict = screened.get(id(v.entries))
        if verdict is None:
            verdict = screened[id(v.entries)] = looks_like_rotation(v)
        if not verdict:
            continue
        r = acc.accept(node, v)
        if isinstance(r, Match):
            accepted[node] = r
        else:
            rejected[node] = r
    _keep_rotated_tails(accepted)
    last = {node for node in accepted if any(u not in accepted for u in node.users) or not node.users}
    # A rotation read twice, once as is and once through a view (`q * 2` and `q.expand(...)` for a matmul),
    # is replaced where it is computed: the view then reads the fused result instead of rotating again.
    chosen = [accepted[n] for n in last
              if not any(accepted[a].x_name == accepted[n].x_name for a in _derived_from(n, last, accepted))]
    chosen = _needed(chosen, acc)
    chosen.sort(key=lambda m: acc.order[m.node])
    return chosen, near_misses(acc, accepted, rejected), acc


def _keep_rotated_tails(accepted: dict) -> None:
    """Where the graph holds a rotated tail and then the whole head, choose the site.

    A `cat` of the pass-through head and the rotated tail (transformers' DeepSeek: cat(q_nope, rope(q_pe))) is
    a fresh tensor: replaced there, the op writes the head too (its rotary_offset) and the cat's copy of both
    parts dies. Written into an existing tensor instead (vLLM's MLA: `q[..., nope:] = rope(q_pe)`, a
    slice_scatter that Inductor does in place), only the tail is new: the tail stays the site (and can share
    one launch with k), since the whole head would read and write every lane again."""
    dropped = set()
    for node, m in accepted.items():  # graph order: a view of a dropped head is dropped too
        if not m.offset:
            continue
        inputs = [a for a in node.all_input_nodes if a in accepted]
        if any(a in dropped for a in inputs) or (node.target is not aten.cat.default
                                                 and any(not accepted[a].offset for a in inputs)):
            dropped.add(node)
    for node in dropped:
        del accepted[node]


def _needed(chosen: list[Match], acc: Acceptor) -> list[Match]:
    """Drop rotations whose every use dies with a larger rotation that is replaced too (the 8 rotated lanes
    of a partial rotary's backward, scattered into the 16-lane gradient that is itself a rotation with a
    pass-through tail): replacing them would only leave dead work and a misleading report."""
    if len(chosen) < 2:
        return chosen
    replaced = {m.node for m in chosen}
    reaches: set = set()  # nodes whose value reaches the graph output other than through a replaced node
    for n in sorted(acc.order, key=acc.order.get, reverse=True):
        if any(u.op == "output" or (u not in replaced and u in reaches) for u in n.users):
            reaches.add(n)
    return [m for m in chosen if any(u.op == "output" or (u not in replaced and u in reaches)
                                     for u in m.node.users)]


def _derived_from(node: fx.Node, last: set, accepted: dict) -> list:
    """The nodes of `last` that `node` is computed from through rotations only."""
    stack, seen, found = [a for a in node.all_input_nodes if a in accepted], set(), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in last:
            found.append(n)
        else:
            stack.extend(a for a in n.all_input_nodes if a in accepted)
    return found


def near_misses(acc: Acceptor, accepted: dict, rejected: dict) -> list[tuple[fx.Node, str]]:
    """One record per rotation-like computation that did not fuse.

    A rejected value that a fused rotation reads is part of it (`q * cos` inside `q * cos + rot(q) * sin`),
    and one that reads a fused rotation is built on it (`rope(q) + bias`): neither is a miss of its own. Of
    the rest, each chain of rejected values (a half-written `out[..., 0::2] = ...`, the full write, a view of
    it) is reported once, by the value whose check got furthest (the most specific reason), the outermost
    of those."""
    remaining = [n for n in rejected
                 if not any(acc.depends_on(a, n) or acc.depends_on(n, a) for a in accepted)]
    keep = set(remaining)
    out = []
    for node in remaining:
        if any(u in keep for u in node.users):
            continue
        chain = [n for n in remaining if n is node or acc.depends_on(node, n)]
        best = max(chain, key=lambda n: (getattr(rejected[n], "stage", 0), acc.order[n]))
        out.append((best, rejected[best]))
    return out
