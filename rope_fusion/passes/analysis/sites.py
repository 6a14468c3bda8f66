"""Which nodes of a graph to replace: the largest rotations, and the near misses to report.

The lane interpreter gives every node a lane value; the acceptor decides which compute a RoPE. A rotation
is replaced at the last node that still has rotary form (through the final cast, the attention layout), so
that the whole subgraph dies; RoPE-looking values that fail are reported once each, at the outermost value
of their own computation, with the most specific reason.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from . import lane_rules  # noqa: F401  (registers the transfer rules)
from .lanes import LaneInterpreter, LaneValue
from .matcher import SCAN_LANES, Acceptor, looks_like_rotation
from .site import Site

aten = torch.ops.aten


def find_sites(graph: fx.Graph) -> tuple[list[Site], list[tuple[fx.Node, str]], Acceptor]:
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
        if isinstance(r, Site):
            accepted[node] = r
        else:
            rejected[node] = r
    for node, why in interp.unfollowed.items():  # rotation-like values the interpreter could not analyse
        rejected.setdefault(node, why)
    proved = dict(accepted)  # every accepted value, before the choice of sites: what the proofs cover
    _keep_rotated_tails(accepted)
    last = {node for node in accepted if any(u not in accepted for u in node.users) or not node.users}
    # A rotation read twice, once as is and once through a view (`q * 2` and `q.expand(...)` for a matmul),
    # is replaced where it is computed: the view then reads the fused result instead of rotating again.
    chosen = [accepted[n] for n in last
              if not any(accepted[a].x.name == accepted[n].x.name for a in _derived_from(n, last, accepted))]
    chosen = _needed(chosen, acc)
    chosen.sort(key=lambda m: acc.order[m.node])
    return chosen, near_misses(acc, proved, rejected), acc


def _keep_rotated_tails(accepted: dict) -> None:
    """Where the graph holds a rotated tail and then the whole head, choose the site.

    A `cat` of the pass-through head and the rotated tail (transformers' DeepSeek: cat(q_nope, rope(q_pe))) is
    a fresh tensor: replaced there, the op writes the head too (its rotary_offset) and the cat's copy of both
    parts dies. Written into an existing tensor instead (vLLM's MLA: `q[..., nope:] = rope(q_pe)`, a
    slice_scatter that Inductor does in place), only the tail is new: the tail stays the site (and can share
    one launch with k), since the whole head would read and write every lane again."""
    dropped = set()
    for node, m in accepted.items():  # graph order: a view of a dropped head is dropped too
        if not m.params.rotary_offset:
            continue
        inputs = [a for a in node.all_input_nodes if a in accepted]
        if any(a in dropped for a in inputs) or (node.target is not aten.cat.default
                                                 and any(not accepted[a].params.rotary_offset for a in inputs)):
            dropped.add(node)
    for node in dropped:
        del accepted[node]


def _needed(chosen: list[Site], acc: Acceptor) -> list[Site]:
    """Drop rotations whose every use dies with a larger rotation that is replaced too (the 8 rotated lanes
    of a partial rotary's backward, scattered into the 16-lane gradient that is itself a rotation with a
    pass-through tail): replacing them would only leave dead work and a misleading report."""
    if len(chosen) < 2:
        return chosen
    replaced = {m.node for m in chosen}
    reaches: set = set()  # nodes whose value reaches the graph output (or an effect) other than through a replaced node
    for n in sorted(acc.order, key=acc.order.get, reverse=True):
        if any(_sink(u) or (u not in replaced and u in reaches) for u in n.users):
            reaches.add(n)
    return [m for m in chosen if any(_sink(u) or (u not in replaced and u in reaches) for u in m.node.users)]


def _sink(node: fx.Node) -> bool:
    """Where a value leaves the graph: its output, or an op with an effect, such as the `copy_` that writes a
    rotation back into a graph input (`q[:, :, t:] = rope(q[:, :, t:])` on an input q), whose graph may return
    nothing at all."""
    return node.op == "output" or (node.op == "call_function" and node.is_impure())


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

    A rejected value is dropped only where its lanes are those of a fused rotation: inside the rotation's proof
    (`q * cos` inside `q * cos + rot(q) * sin`, the half-written `out[..., 0::2] = ...` before the full write),
    or computed from the rotation's result through lane rules (Llama 4's L2 norm after the rotation; DeepSeek's
    rotated k_pe copied into each head of k): such a value looks like a rotation only because it holds the
    fused one. A value that depends on a fused rotation, or feeds one, through a projection or attention is
    not: a wrong rotation in one layer of a residual stack reads the layers before it and feeds those after
    it, and is reported (dropping every rejected value that depended on or fed an accepted one hid every
    miss of a model where anything else fused). Of the rest, each chain of rejected values computed one from
    another through lane rules (a half write, the full write, a view of it) is reported once, by the value
    whose check got furthest (the most specific reason), the outermost of those; two layers are two chains."""
    if not rejected:
        return []
    interp = acc.interp
    held = _inside_proofs(interp, accepted, rejected) | _built_on(interp, accepted, rejected)
    remaining = [n for n in rejected if n not in held and _pairs_lanes(interp.values.get(n))]
    below = _rejected_below(interp, set(remaining))
    inner = set().union(*below.values())  # rejected values that another is computed from
    out, reported = [], set()
    for node in remaining:
        if node in inner:
            continue  # not the outermost of its chain
        chain = [node, *below[node]]
        best = max(chain, key=lambda n: (getattr(rejected[n], "stage", 0), acc.order[n]))
        if best not in reported:
            reported.add(best)
            out.append((best, rejected[best]))
    return out


def _pairs_lanes(v) -> bool:
    """Whether some lane adds two products that each read one lane of one tensor, two lanes less than a row of
    the value apart (x[d]*C and x[p]*S, as a RoPE's lanes do, within a head); True for a value without lanes.
    A row is the last grid dim, or the last two where the last is a pair (interleaved, complex), measured in the
    source's lanes: a row of the value steps through a source by the distance between what two neighbouring
    lanes of the row read of it (`_source_step`), 1 for a value laid out as its source. With the lane axis
    transposed (`x.unflatten(-1, (8, 16)).transpose(-1, -2)`, rotated over the 8) a row steps by 16 source
    lanes and a pair is 64 apart: measured in the value's lanes, the screen took a rotation for none, and a
    rejected one was never reported.

    The screen that sends values to the acceptor is coarser, and linear by design (`looks_like_rotation`); it
    also passes values that are no rotation and no RoPE written wrong, which must not read as near misses
    (they did in CLVP, Wan and LTX once misses were no longer hidden by any fused rotation in the graph): a
    gated unit of one projection, `h * gelu(g)` of its two halves, whose decomposed GELU sums products that
    each read both h[d] and g[d]; and a DiT's modulation, `norm(x) * (1 + scale) + shift` with scale and shift
    chunks of one tensor (`table + embedding` per chunk), whose products read chunks a row or more apart (their
    rows step by one lane of the source, as they are laid out). Run on rejected values only, with at most
    `PRODUCTS` products a lane."""
    if not isinstance(v, LaneValue):
        return True
    grid = v.grid
    width = (grid[-1] if grid[-1] > 2 else math.prod(grid[-2:])) if grid else 1
    lanes = v.entries[:SCAN_LANES]
    for i, e in enumerate(lanes):
        reads = _product_reads(e)
        for j, first in enumerate(reads):
            for second in reads[j + 1:]:
                for src, lane in first.items():
                    other = second.get(src)
                    if other is not None and 0 < abs(lane - other) < width * _source_step(lanes, i, width, src):
                        return True
    return False


def _product_reads(e) -> list:
    """Per product of a lane (at most `PRODUCTS`): source -> the one lane of it the product reads (sources
    read once in that product)."""
    reads = []
    for mono in e or ():
        if len(mono) < 2:
            continue
        count: dict = {}
        for atom in mono:
            count[atom[:3]] = count.get(atom[:3], 0) + 1
        reads.append({atom[:3]: atom[3] for atom in mono if count[atom[:3]] == 1})
        if len(reads) == PRODUCTS:
            break
    return reads


def _source_step(lanes: list, i: int, width: int, src: tuple) -> int:
    """How many lanes of `src` one lane of the value's row steps: the least nonzero distance between a lane of
    src that lane i reads and one that its neighbour in the row reads (1 where they read none apart)."""
    j = i + 1 if (i + 1) % width and i + 1 < len(lanes) else i - 1
    if j < 0 or j // width != i // width:
        return 1
    mine = {atom[3] for mono in lanes[i] or () for atom in mono if atom[:3] == src}
    theirs = {atom[3] for mono in lanes[j] or () for atom in mono if atom[:3] == src}
    return min((abs(a - b) for a in mine for b in theirs if a != b), default=1)


PRODUCTS = 16  # products of a lane that `_pairs_lanes` compares pairwise (a RoPE lane has two)


def _computed(interp: LaneInterpreter, node: fx.Node) -> bool:
    """Whether a transfer rule computed the node's lanes (its value is a function of other nodes' lanes)."""
    return node in interp.values


def _inside_proofs(interp: LaneInterpreter, accepted: dict, rejected: dict) -> set:
    """The rejected values that an accepted rotation is computed from through lane rules, strictly between its
    operands (x, the tables: sources, or a computed x) and itself. A rejected x is an operand, not a part: a
    wrong rotation whose result a right one rotates again is still reported."""
    inside: set = set()
    for node, m in accepted.items():
        if all(u in accepted and accepted[u].x.name == m.x.name for u in node.users) and node.users:
            continue  # its users' proofs cover its own (a view or cast of it is accepted with the same x)
        seen, stack = {node}, [node]
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a in seen or a.name == m.x.name or not _computed(interp, a):
                    continue
                seen.add(a)
                if a in rejected:
                    inside.add(a)
                stack.append(a)
    return inside


def _built_on(interp: LaneInterpreter, accepted: dict, rejected: dict) -> set:
    """The rejected values computed from an accepted rotation through lane rules only (no source between)."""
    on: set = set()  # computed nodes that hold an accepted rotation's lanes
    for node in interp.order:  # graph order: inputs first
        if _computed(interp, node) and any(a in accepted or a in on for a in node.all_input_nodes):
            on.add(node)
    return {n for n in rejected if n in on}


def _rejected_below(interp: LaneInterpreter, rejected: set) -> dict:
    """For each rejected node, the rejected nodes it is computed from through lane rules only (no source
    between them), in one walk over the graph in order. Sets are shared, never changed: most computed nodes
    have none below them, and a view has its input's."""
    below: dict = {}
    none: frozenset = frozenset()
    for node in interp.order:  # graph order: inputs first
        if not _computed(interp, node):
            continue
        found = none
        for a in node.all_input_nodes:
            add = below.get(a, none)
            if a in rejected:
                add = add | {a}
            if add and add is not found:
                found = add if not found else found | add
        below[node] = found
    return {n: below.get(n, none) for n in rejected}
