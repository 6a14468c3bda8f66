"""Emission: new nodes for each site or q/k pair, planned first and committed together, with an undo.

Planning a group inserts the nodes that compute its rotation (views of x and of the tables, the backend's
op or kernel, the reshapes back) without touching any existing use; a group whose planning fails is erased
and the others go on. Committing replaces the uses of every planned site at once. A `GraphTransaction`
snapshot taken before anything else restores the graph exactly (inputs of every node, node order, no new
node) when anything fails after that, so the failure policy holds whatever step raised: the graph is as it
was, or holds exactly the committed sites. Every new node gets a fake-tensor `val` (Inductor lowers from
it) and the stack trace of the node it replaces (depyf and the report show where the RoPE came from).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..fx_nodes import chain_back
from ..fx_sizes import as_int
from ..ops.backends import AUTO_ORDER, Refusal, SiteSpec, get_backend
from ..ops.schema import OP_NAMES, TENSOR_NAMES, RotaryCall, RotaryParams
from .analysis.gathers import gather_of, op_positions
from .analysis.grouping import arithmetic_dtype, launch_params
from .analysis.norms import NormPrologue, dies_with, norm_prologue
from .analysis.site import KernelTables, Site, TableRef
from .auto.auto_timing import AutoSite
from .auto.choosers import Choice
from .auto.site_costs import site_spec
from .folds import fold_planning
from .folds.fold_registry import Fold, Folded, FoldSite, folds
from .fx_util import CASTS, PASS_THROUGH

aten = torch.ops.aten
prims = torch.ops.prims

_EXACT_UPCASTS = {
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64), (torch.float32, torch.float64),
}


class GraphTransaction:
    """A snapshot of a graph's nodes, their order and their inputs, to restore after a failure."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.order = list(graph.nodes)
        self.known = set(self.order)
        self.inputs = {n: (n.args, n.kwargs) for n in self.order}

    def new_nodes(self, since: set | None = None) -> list:
        known = self.known if since is None else since
        return [n for n in self.graph.nodes if n not in known]

    def erase(self, nodes: list) -> None:
        """Erase new nodes, users first (nothing old may use them any more)."""
        pending = list(nodes)
        while pending:
            left = []
            for n in reversed(pending):
                if n.users:
                    left.append(n)
                else:
                    self.graph.erase_node(n)
            if len(left) == len(pending):
                raise RuntimeError(f"cannot erase {left[0]}: still used by {list(left[0].users)}")
            pending = left[::-1]

    def rollback(self) -> None:
        for n in self.order:
            args, kwargs = self.inputs[n]
            if n.args is not args or n.kwargs is not kwargs:
                n.args, n.kwargs = args, kwargs
        self.erase(self.new_nodes())
        if list(self.graph.nodes) != self.order:
            for prev, n in zip(self.order, self.order[1:]):
                if prev.next is not n:
                    prev.append(n)


class Emitter:
    """Creates nodes with fake values at the graph's insertion point."""

    # Views and sizes are emitted once per distinct argument list: the q/k pair and its tables would
    # otherwise repeat them, and each view of a complex table (view_as_real) is a fallback call that the
    # compiled code pays on every call.
    _SHARED = (aten.view_as_real.default, aten.reshape.default, aten.slice.Tensor, aten.unsqueeze.default,
               aten.sym_size.int)

    def __init__(self, graph: fx.Graph, requested: str | None = None):
        self.graph = graph
        self.fake_mode = _graph_fake_mode(graph)
        # the backend the pass was asked for: under "auto" a backend may refuse a site at emission (its emit
        # returns a Refusal) and what the choice names instead takes it; a backend asked for by name emits what it can
        self.requested = requested
        self._made: dict = {}
        # cat node -> the joined tensor as the last group that writes into it left it (passes/folds/joined_writes.py)
        self.joins: dict = {}

    def call(self, target: Any, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None) -> fx.Node:
        kwargs = kwargs or {}
        key = None
        if target in self._SHARED and not kwargs:
            try:
                key = (target, tuple(tuple(a) if isinstance(a, list) else a for a in args))
                hash(key)
            except TypeError:
                key = None
            made = self._made.get(key) if key is not None else None
            if made is not None and not made._erased and made.graph is self.graph:
                return made
        node = self.graph.call_function(target, tuple(args), kwargs)
        if key is not None:
            self._made[key] = node

        def val(a):
            if isinstance(a, fx.Node):
                return a.meta["val"]
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a

        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*val(list(args)), **val(kwargs))
        else:
            node.meta["val"] = target(*val(list(args)), **val(kwargs))
        if like is not None:
            copy_provenance(node, like)
        return node

    def size_args(self, base: fx.Node, dims: range, like: fx.Node) -> list:
        """Sizes of base's dims as ints or sym_size nodes (FX args cannot hold SymInts)."""
        shape = base.meta["val"].shape
        out = []
        for i in dims:
            c = as_int(shape[i])
            out.append(c if c is not None else self.call(aten.sym_size.int, (base, i), like=like))
        return out

    def flatten_tail(self, base: fx.Node, k: int, like: fx.Node) -> fx.Node:
        """base with its last k dims merged into one (k == 1: base itself; k == 0: a trailing 1 added)."""
        if k == 1:
            return base
        if k == 0:
            return self.call(aten.unsqueeze.default, (base, -1), like=like)
        shape = base.meta["val"].shape
        nd = len(shape)
        lead = self.size_args(base, range(nd - k), like)
        n = 1
        for s in shape[nd - k:]:
            n *= as_int(s)
        return self.call(aten.reshape.default, (base, lead + [n]), like=like)


def copy_provenance(node: fx.Node, like: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]


def _graph_fake_mode(graph: fx.Graph):
    mode = torch._guards.detect_fake_mode()  # Inductor's tracing context, when there is one
    if mode is not None:
        return mode
    for n in graph.nodes:  # else the first value that has one
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch._guards.detect_fake_mode([val])
    return None


# -- one group: x and table views, the backend's nodes, the result in the replaced node's shape ----------

def _source_view(em: Emitter, node: fx.Node, as_real: bool, like: fx.Node) -> fx.Node:
    return em.call(aten.view_as_real.default, (node,), like=like) if as_real else node


def table_view(em: Emitter, nodes: dict, t: TableRef, blocks: tuple, like: fx.Node,
               interleaved: bool = False, rotary_blocks: int = 1) -> fx.Node:
    """The table as the op reads it: a strided view of the source, unsqueezed once per head block of x; a
    table in pieces is their views broadcast to one shape and concatenated (a copy the size of the table)."""
    if t.pieces:
        views = [table_view(em, nodes, p, (), like) for p in t.pieces]
        shape = torch.broadcast_shapes(*(v.meta["val"].shape[:-1] for v in views))
        sizes = [as_int(d) for d in shape]
        if None in sizes:  # symbolic: the sizes as graph values of the pieces that have them
            sizes = [_dim_of(em, views, i - len(shape), like) for i in range(len(shape))]
        views = [v if tuple(v.meta["val"].shape[:-1]) == tuple(shape) else
                 em.call(aten.expand.default, (v, [*sizes, -1]), like=like) for v in views]
        view = em.call(aten.cat.default, (views, -1), like=like)
    else:
        view = em.flatten_tail(_source_view(em, nodes[t.name], t.as_real, like), t.k, like)
        n = as_int(view.meta["val"].shape[-1])
        if not (t.start == 0 and t.step == 1 and t.width == n):
            end = t.start + t.step * (t.width - 1) + 1
            view = em.call(aten.slice.Tensor, (view, -1, t.start, end, t.step), like=like)
    if t.partner:  # the entries of each pair swapped: a table-sized copy
        view = _swap_pairs(em, view, interleaved, rotary_blocks, like)
    for _ in blocks:  # the same table for every head of x
        view = em.call(aten.unsqueeze.default, (view, -2), like=like)
    return view


@dataclasses.dataclass
class AngleSource:
    """Tables that the graph computes as cos(angle) and sin(angle) of one tensor, then views (and casts) of
    both alike: the op can read the angle through the same views (angle_tables) and compute cos and sin per
    token itself, so the two tables are never written and read back (HiDream's rotation matrices, Llama's
    tables from positions x frequencies)."""

    angle: fx.Node
    views: list  # the view nodes from the cos node to the table, nearest the angle first


def angle_source(nodes: dict, cos: TableRef, sin: TableRef) -> AngleSource | None:
    if cos.pieces or sin.pieces or cos.partner or sin.partner or cos.as_real or sin.as_real:
        return None
    if (cos.k, cos.start, cos.step, cos.width) != (sin.k, sin.start, sin.step, sin.width):
        return None
    chains = [chain_back(nodes[t.name], _ANGLE_CARRIERS) for t in (cos, sin)]
    (c, s) = (ch[-1] for ch in chains)
    if c.target is not aten.cos.default or s.target is not aten.sin.default or c.args[0] is not s.args[0]:
        return None
    views = [[n for n in ch[:-1] if n.target not in CASTS] for ch in chains]
    if [(n.target, n.args[1:], n.kwargs) for n in views[0]] != [(n.target, n.args[1:], n.kwargs) for n in views[1]]:
        return None  # cos and sin reach the rotation through different views
    a = c.args[0]
    if not isinstance(a, fx.Node) or not a.meta["val"].is_floating_point() or a.meta["val"].is_complex():
        return None
    return AngleSource(a, list(reversed(views[0])))


def angle_view(em: Emitter, nodes: dict, src: AngleSource, t: TableRef, m: Site) -> fx.Node:
    """The angle through the tables' views, as the op reads it (one node for cos and sin)."""
    node = _replay(em, src.angle, src.views, m.node)  # views commute with the elementwise cos and sin
    ref = dataclasses.replace(t, name=node.name)
    return table_view(em, {**nodes, node.name: node}, ref, m.x.blocks, m.node, m.params.interleaved,
                      m.params.rotary_blocks)


# What lies between an angle's cos (or sin) and the table: the pass-through ops less the complex views (an angle is
# real) and less the copies other than casts, `_unsafe_view` and `squeeze.dims`, which `angle_source` does not
# replay on the angle (casts are dropped: the op computes cos and sin in its own dtype).
_ANGLE_CARRIERS = PASS_THROUGH - {aten.clone.default, aten.contiguous.default, aten._unsafe_view.default,
                                  aten.squeeze.dims, aten.view_as_real.default, aten.view_as_complex.default}


def _dim_of(em: Emitter, views: list, dim: int, like: fx.Node) -> Any:
    """Size `dim` (negative, counted before the lanes) of the broadcast of `views`: from a view where it is
    not 1."""
    for v in views:
        shape = v.meta["val"].shape
        if len(shape) - 1 >= -dim and not (isinstance(shape[dim - 1], int) and shape[dim - 1] == 1):
            return em.size_args(v, range(len(shape) + dim - 1, len(shape) + dim), like)[0]
    return 1


def _swap_pairs(em: Emitter, t: fx.Node, interleaved: bool, rotary_blocks: int, like: fx.Node) -> fx.Node:
    """reference.partner_lanes as graph nodes: entry a_j holds t[b_j] and b_j holds t[a_j]."""
    width = as_int(t.meta["val"].shape[-1])
    if interleaved:  # stack(t[1::2], t[0::2]) flattened, in ops every backend lowers (not aten.flip)
        lead = em.size_args(t, range(t.meta["val"].dim() - 1), like)
        odd, even = (em.call(aten.unsqueeze.default, (em.call(aten.slice.Tensor, (t, -1, s, width, 2), like=like),
                                                      -1), like=like) for s in (1, 0))
        pairs = em.call(aten.cat.default, ([odd, even], -1), like=like)
        return em.call(aten.reshape.default, (pairs, lead + [width]), like=like)
    w = width // rotary_blocks  # NeoX: the halves of each block swapped
    halves = [(b * w + s, b * w + e) for b in range(rotary_blocks) for s, e in ((w // 2, w), (0, w // 2))]
    return em.call(aten.cat.default, ([em.call(aten.slice.Tensor, (t, -1, s, e), like=like) for s, e in halves],
                                      -1), like=like)


def gathered_tables(em: Emitter, nodes: dict, m: Site, like: fx.Node) -> tuple | None:
    """(cos, sin, positions) as the op takes a gathered cache, or None: the cos and sin of `m` must be two
    lane windows of one gather of one cache by one positions tensor."""
    cos_ref, sin_ref = m.tables.cos, m.tables.sin
    if cos_ref.pieces or sin_ref.pieces:
        return None
    got = [gather_of(nodes[t.name], t) for t in (cos_ref, sin_ref)]
    if None in got or not got[0].same_rows(got[1]):
        return None
    cache, pos = got[0].cache, op_positions(em, got[0], like)
    views = []
    for g, t in zip(got, (cos_ref, sin_ref)):
        start, step = g.start, g.step
        end = start + step * (t.width - 1) + 1
        views.append(em.call(aten.slice.Tensor, (cache, -1, start, end, step), like=like))
    source = nodes[cos_ref.name]  # the table view's leading dims, plus one per head block: positions' shape
    shape = source.meta["val"].shape
    lead = [as_int(d) for d in shape[: len(shape) - cos_ref.k]] + [1] * len(m.x.blocks)
    if sum(d != 1 for d in lead) == 1:  # [T] -> [T, 1]: sizes from positions, not from the table it replaces
        lead = [-1 if d != 1 else 1 for d in lead]
    else:
        lead = em.size_args(source, range(len(shape) - cos_ref.k), like) + [1] * len(m.x.blocks)
    positions = em.call(aten.reshape.default, (pos, lead), like=like)
    return views[0], views[1], positions


def x_input(em: Emitter, nodes: dict, m: Site, source: fx.Node | None = None) -> fx.Node:
    """x as the op reads it: [..., head_dim], heads of a flattened [.., H*D] split out as blocks (`source`:
    a tensor of x's shape to read instead, the raw x of a folded norm)."""
    x = nodes[m.x.name] if source is None else source
    # an exact upcast of x changes nothing: the fused op computes in fp32 (fp64 when the subgraph did)
    if (not m.x.as_real and x.target is prims.convert_element_type.default and isinstance(x.args[0], fx.Node)
            and (x.args[0].meta["val"].dtype, x.meta["val"].dtype) in _EXACT_UPCASTS):
        x = x.args[0]
    flat = em.flatten_tail(_source_view(em, x, m.x.as_real, m.node), m.x.k, m.node)
    if not m.x.blocks:
        return flat
    nd = len(flat.meta["val"].shape)
    sizes = em.size_args(flat, range(nd - 1), m.node) + list(m.x.blocks) + [m.x.head_dim]
    return em.call(aten.reshape.default, (flat, sizes), like=m.node)


def unflatten(em: Emitter, out: fx.Node, m: Site) -> fx.Node:
    shape = m.node.meta["val"].shape
    if tuple(out.meta["val"].shape) == tuple(shape):
        return out
    lead_len = len(shape) - m.value_k
    sizes = em.size_args(out, range(lead_len), m.node) + [as_int(s) for s in shape[lead_len:]]
    return em.call(aten.reshape.default, (out, sizes), like=m.node)


@dataclasses.dataclass
class PlannedGroup:
    group: tuple  # the sites, in order
    xs: list  # per match, x as the op reads it
    finals: list  # per match, the node that replaces it
    op_name: str
    choice: Choice  # the backend that emitted the group, how it was chosen, and why not the one asked for
    cos: fx.Node
    sin: fx.Node
    anchor: fx.Node
    params: RotaryParams  # what the op was called with: the sites' own, and a folded norm or angle tables
    norm: str = ""  # what happened to a QK-norm before the rotation
    replaced: list | None = None  # per match, the node whose uses `finals` take (the site's, or a consumer of it)
    fold: str = ""  # the report's fold line: what the node folded, or why the folds that applied did not
    folded: Fold | None = None  # the fold that emitted the group

    @property
    def backend(self) -> str:
        return self.choice.backend.name

    @property
    def fallback(self) -> str:
        """Why the backend asked for did not take the site ("" when it did)."""
        return self.choice.fallback


def fold_norms(group: tuple, nodes: dict, depends_on: Callable) -> tuple[list | None, str]:
    """The norm prologue of every site of a group when all can fold it, else (None, why not or "")."""
    if any(not m.arithmetic for m in group) or any(m.x.name not in nodes for m in group):
        return None, ""
    found = [norm_prologue(nodes[m.x.name], m.x.head_dim, m.x.blocks, m.x.k) for m in group]
    if all(f is None for f in found):
        return None, ""
    if group[0].x.as_real:
        return None, "x is rotated as complex numbers; the op's norm reads real lanes"
    reasons = [f for f in found if isinstance(f, str)]
    if reasons:  # each tensor's own reason where they differ (q's norm spans other lanes than k's in GQA)
        if len(set(reasons)) == 1:
            return None, reasons[0]
        names = TENSOR_NAMES[len(group)]
        return None, "; ".join(f"{n}: {f}" for n, f in zip(names, found) if isinstance(f, str))
    if any(f is None for f in found) or len({(f.kind, f.eps) for f in found}) > 1:
        return None, "q and k are normed differently"
    if not all(dies_with(f, m.node, depends_on) for f, m in zip(found, group)):
        return None, "the norm's values are used elsewhere too (kept in the graph; folding would read x twice)"
    return found, ""


def raw_x(em: Emitter, norm: NormPrologue, like: fx.Node) -> fx.Node:
    """The norm's input with the layout ops between the norm and the rotation applied to it."""
    return _replay(em, norm.raw, norm.views, like)


def _replay(em: Emitter, x: fx.Node, views, like: fx.Node) -> fx.Node:
    """`views` (single-input layout ops, in order) applied to x instead of their own input."""
    for view in views:
        x = em.call(view.target, (x, *view.args[1:]), dict(view.kwargs), like=like)
    return x


def norm_weight(em: Emitter, norm: NormPrologue, m: Site) -> fx.Node | None:
    """The weight as the op reads it: [D] for a norm per head, [H, D] for one across the heads, its lanes
    permuted as the layout between the norm and the rotation permutes the normed lanes (norms.norm_prologue)."""
    w = norm.weight
    if w is None:
        return None
    permuted = norm.weight_perm != tuple(range(len(norm.weight_perm)))
    if not permuted and norm.kind == "rms":
        return w
    if permuted:
        w = em.call(aten.reshape.default, (w, list(norm.weight_split)), like=m.node)
        w = em.call(aten.permute.default, (w, list(norm.weight_perm)), like=m.node)
    return em.call(aten.reshape.default, (w, list(norm.weight_shape)), like=m.node)


def plan_group(em: Emitter, group: tuple, nodes: dict, anchor: fx.Node, choose: Callable[[SiteSpec], Choice],
               depends_on: Callable) -> PlannedGroup:
    """New nodes for one site or q/k pair, inserted before `anchor`; no existing use changes. The folds are asked
    first (passes/folds/fold_planning.py), so that `choose` sees the site as it would run; then the chosen backend's
    first fold that holds emits the group, else the backend itself (or what the choice names where it refuses)."""
    m0 = group[0]
    _check_inputs_precede(group, nodes, depends_on)
    norms, norm_note = fold_norms(group, nodes, depends_on)
    with em.graph.inserting_before(anchor):
        site = fold_site(em, group, nodes, norms, depends_on)
        call = site.call
        found = fold_planning.search(em, site, lambda fold: _may_take(em, call, fold))
        spec = site_spec(call.xs, call.cos, call.sin, call.params, m0, call.positions, found.reads_pieces)
        spec = dataclasses.replace(spec, cost=found.costed(spec.cost), measure=AutoSite(group, call, **found.timed()))
        choice = choose(spec)
        taken = fold_planning.after_choice(em, site, choice.backend, found)
        if isinstance(taken, tuple):
            fold, plan = taken
            folded = fold.emit(em, site, plan)
        else:
            fold = None
            folded, choice = _emit_plain(em, site, choice, taken)
    op_name = f"rope_fusion.{OP_NAMES[len(group)]}"
    norm = folded.norm or (f"{call.params.norm} folded" if norms is not None else
                           (f"left in the graph: {norm_note}" if norm_note else ""))
    return PlannedGroup(group, site.inputs, folded.finals, op_name, choice, call.cos, call.sin, anchor,
                        folded.params or call.params, norm, folded.replaced, folded.line, fold)


def fold_site(em: Emitter, group: tuple, nodes: dict, norms: list | None, depends_on: Callable) -> FoldSite:
    """The op's call on graph nodes for a group: x (its norm's input where the norm folds), the tables as the op
    reads them (gathered, the angles, or strided views) and the dtype it computes in."""
    m0 = group[0]
    if norms is not None:
        xs = inputs = [x_input(em, nodes, m, raw_x(em, norm, m.node)) for m, norm in zip(group, norms)]
        weights = [norm_weight(em, norm, m) for m, norm in zip(group, norms)]
    else:
        xs = inputs = [x_input(em, nodes, m) for m in group]
        weights = None
    positions = cu_seqlens = seqlen_offsets = None
    # (cos, sin, positions), or with packed sequences (cos, sin, None, cu_seqlens, seqlen_offsets)
    if isinstance(m0.tables, KernelTables):
        gathered = m0.tables.emit(em, m0, nodes)
    else:
        gathered = gathered_tables(em, nodes, m0, m0.node)
    if gathered is not None:
        cos, sin, positions, *packed = gathered
        cu_seqlens, seqlen_offsets = packed or (None, None)
    params = launch_params(group)
    # the dtype the graph computes the rotation in; under a folded norm the op cannot round as the graph's
    # norm does (plain compile's does not either) and keeps fp64 wherever the subgraph has it (`wide`):
    # in fp32 it was then less accurate than eager at times, which the contract does not allow
    computes = _group_arithmetic_dtype(group, nodes, depends_on) if norms is None else None
    wide = m0.wide if computes is None else computes == torch.float64
    fp64_math = wide and params.out_dtype in (torch.float32, torch.float64)
    if gathered is None:
        angles = angle_source(nodes, m0.tables.cos, m0.tables.sin)
        if angles is not None and angles.angle.meta["val"].dtype == torch.float64 and not fp64_math:
            angles = None  # an fp32 op would round fp64 angles first: it reads the tables the graph casts
        if angles is not None:  # one view of the angles serves as both
            params = params.replace(angle_tables=True)
            cos = sin = angle_view(em, nodes, angles, m0.tables.cos, m0)
        else:
            cos, sin = (table_view(em, nodes, t, m0.x.blocks, m0.node, params.interleaved, params.rotary_blocks)
                        for t in (m0.tables.cos, m0.tables.sin))
    if norms is not None:
        params = params.replace(norm=norms[0].kind, norm_eps=norms[0].eps)
    if fp64_math:
        dts = {x.meta["val"].dtype for x in xs} | {cos.meta["val"].dtype, sin.meta["val"].dtype}
        if torch.float64 not in dts:  # the subgraph computed in fp64: so does the op
            xs = [em.call(prims.convert_element_type.default, (x, torch.float64), like=m0.node) for x in xs]
    elif computes is not None and computes != torch.float64:
        # fp64 data that the graph computes on in fp32 or narrower: the op takes it as fp32, the cast the
        # graph makes (one rounding), so that its math is fp32 as well and the result is eager's
        xs, cos, sin = ([_narrowed(em, t, m0.node) for t in xs], _narrowed(em, cos, m0.node),
                        _narrowed(em, sin, m0.node) if sin is not cos else None)
        sin = cos if sin is None else sin
    call = RotaryCall(xs, cos, sin, params, positions, weights, cu_seqlens, seqlen_offsets)
    return FoldSite(group, xs, inputs, call, norms, depends_on, em.requested or "auto")


def _emit_plain(em: Emitter, site: FoldSite, choice: Choice, refusals: list) -> tuple[Folded, Choice]:
    """The chosen backend's own nodes (or, where it refuses the site, those of what the choice names instead:
    under `auto` the lowering, never a slower opaque call); the fold line says why the folds that applied did not."""
    outs = choice.backend.emit(em, site.call, site.like)
    if isinstance(outs, Refusal):
        choice = choice.refused(outs)
        outs = choice.backend.emit(em, site.call, site.like)
    finals = [unflatten(em, o, m) for o, m in zip(outs, site.group)]
    return Folded(finals, [m.node for m in site.group], "; ".join(r.line() for r in refusals)), choice


def _may_take(em: Emitter, call: RotaryCall, fold: Fold) -> bool:
    """Whether a backend that takes `fold` may take a site on this device: the one asked for, or under `auto` one
    of the device's candidates."""
    device_type = call.xs[0].meta["val"].device.type
    names = AUTO_ORDER.get(device_type, ["inductor"]) if em.requested in (None, "auto") else [em.requested]
    return any(b is not None and fold.name in b.folds for b in map(get_backend, names))


def _group_arithmetic_dtype(group: tuple, nodes: dict, depends_on: Callable) -> torch.dtype | None:
    """The dtype a group's rotations compute in (grouping pairs only sites that agree; a rotary kernel's site has
    none of its own), None if unknown."""
    found = {arithmetic_dtype(m, nodes, depends_on) for m in group} - {None}
    return found.pop() if len(found) == 1 else None


def _narrowed(em: Emitter, t: fx.Node, like: fx.Node) -> fx.Node:
    """t cast to fp32 where it is fp64, else t."""
    if t.meta["val"].dtype != torch.float64:
        return t
    return em.call(prims.convert_element_type.default, (t, torch.float32), like=like)


def anchor_of(group: tuple, nodes: dict, order: dict) -> fx.Node:
    """Where a group's nodes go: before its own node, or right after the last input of any member when that
    comes later (a pair; or a table that the graph computes after the rotation too, `c * 2` returned beside
    it, which the lookup of computed tables may name). Users of a replaced node that came earlier are moved
    after it by `finish`."""
    m0 = group[0]
    inputs = [nodes[m.x.name] for m in group] + m0.tables.tensors(nodes)
    inputs += [t for m in group for t in m.tables.row_inputs]
    last = max(inputs, key=lambda n: order[n])
    if len(group) == 1 and order[last] < order[m0.node]:
        return m0.node
    return last.next


def _check_inputs_precede(group: tuple, nodes: dict, depends_on: Callable) -> None:
    """No table node of the group is computed from one of the rotations it replaces (a lookup by values can
    name a node that reads the result, `c * 2 + 0 * out`): the op would read its own output."""
    tables = group[0].tables.tensors(nodes) + [t for m in group for t in m.tables.row_inputs]
    for t in tables:
        for m in group:
            if depends_on(t, m.node):
                raise ValueError(f"the table {t.name} is computed from the rotation {m.node.name} it would replace")


def erase_between(graph: fx.Graph, start: fx.Node, end: fx.Node) -> None:
    """Erase the nodes a failed group inserted between `start` and `end` (users first)."""
    new = []
    n = start.next
    while n is not end:
        new.append(n)
        n = n.next
    for n in reversed(new):
        for u in list(n.users):  # only the group's own nodes can use them
            if u not in new:
                raise RuntimeError(f"{n} is used outside its group by {u}")
        graph.erase_node(n)


def commit(planned: list[PlannedGroup]) -> None:
    """Replace the uses of every planned site."""
    for p in planned:
        for old, new in zip(p.replaced or [m.node for m in p.group], p.finals):
            old.replace_all_uses_with(new)


def finish_folds(em: Emitter) -> None:
    """After `commit`: each fold finishes the graph (the joined write replaces every cat the groups wrote into)."""
    for fold in folds():
        if fold.finish is not None:
            fold.finish(em)


def finish(graph: fx.Graph, planned: list[PlannedGroup], order: dict) -> None:
    """Restore topological order where a group's nodes were placed after users of a site it replaces, or a fold
    that took a group reorders the graph (the joined write: a group may write into what a group placed after it
    wrote, and the pieces are scattered before the cat)."""
    reordered = any(p.folded is not None and p.folded.reorders for p in planned)
    moved = reordered or any(order.get(u, 1 << 62) < order.get(p.anchor, 1 << 62) for p in planned for f in p.finals
                          for u in f.users)
    if moved:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
