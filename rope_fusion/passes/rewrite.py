"""Rewriting a post-grad graph: pick the largest rotations, pair q with k, emit fused nodes, report.

Every new node gets a fake-tensor `val` (Inductor lowers from it) and the stack trace of the node it
replaces (depyf and the report show where the RoPE came from).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..ops import backends as B
from . import lanes as L
from .matcher import Acceptor, Match, TableRef, dtype_name, looks_like_rotation, rotation_source, source_line
from .report import GraphError, Kernel, Miss, Report, Site

aten = torch.ops.aten
prims = torch.ops.prims

_EXACT_UPCASTS = {
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64), (torch.float32, torch.float64),
}


def find_matches(graph: fx.Graph) -> tuple[list[Match], list[tuple[fx.Node, str]], Acceptor]:
    """The rotations to replace (largest first in graph order) and the near misses."""
    interp = L.LaneInterpreter(graph)
    interp.run()
    acc = Acceptor(interp)
    accepted: dict = {}
    rejected: dict = {}
    for node, v in interp.values.items():
        if not isinstance(v, L.LaneValue) or not looks_like_rotation(v):
            continue
        r = acc.accept(node, v)
        if isinstance(r, Match):
            accepted[node] = r
        else:
            rejected[node] = r
    # A rotation after a pass-through head is emitted as cat(head, rotary(tail)); where the graph already
    # holds the rotated tail (DeepSeek's cat(q_nope, rope(q_pe))), that smaller node is the better site:
    # the cat stays either way, and the tail can share one launch with k.
    for node in [n for n, m in accepted.items() if m.offset and any(a in accepted for a in n.all_input_nodes)]:
        del accepted[node]
    chosen = [m for node, m in accepted.items()
              if any(u not in accepted for u in node.users) or not node.users]
    interesting = set(accepted) | set(rejected)
    misses = []
    for node, reason in rejected.items():
        if any(u in interesting for u in node.users):
            continue  # only the largest rotation-looking value is a near miss
        if any(acc.depends_on(a, node) or acc.depends_on(node, a) for a in accepted):
            continue  # part of, or built on, a fused rotation
        misses.append((node, reason))
    chosen.sort(key=lambda m: acc.order[m.node])
    return chosen, misses, acc


class _Emitter:
    """Creates nodes with fake values, before a given node."""

    # Views and sizes are emitted once per distinct argument list: the q/k pair and its tables would
    # otherwise repeat them, and each view of a complex table (view_as_real) is a fallback call that the
    # compiled code pays on every call.
    _SHARED = (aten.view_as_real.default, aten.reshape.default, aten.slice.Tensor, aten.unsqueeze.default,
               aten.sym_size.int)

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        vals = [n.meta.get("val") for n in graph.nodes]
        self.fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        self._made: dict = {}

    def call(self, target, args, kwargs=None, like: fx.Node | None = None) -> fx.Node:
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
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        return node

    def size_args(self, base: fx.Node, dims: range, like) -> list:
        """Sizes of base's dims as ints or sym_size nodes (FX args cannot hold SymInts)."""
        shape = base.meta["val"].shape
        out = []
        for i in dims:
            s = shape[i]
            c = L.as_int(s)
            out.append(c if c is not None else self.call(aten.sym_size.int, (base, i), like=like))
        return out

    def flatten_tail(self, base: fx.Node, k: int, like) -> fx.Node:
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
            n *= L.as_int(s)
        return self.call(aten.reshape.default, (base, lead + [n]), like=like)


def _source_base(em: _Emitter, node: fx.Node, as_real: bool, like) -> fx.Node:
    return em.call(aten.view_as_real.default, (node,), like=like) if as_real else node


def _table_view(em: _Emitter, nodes: dict, t: TableRef, blocks: tuple, like) -> fx.Node:
    base = _source_base(em, nodes[t.name], t.as_real, like)
    view = em.flatten_tail(base, t.k, like)
    n = L.as_int(view.meta["val"].shape[-1])
    if not (t.start == 0 and t.step == 1 and t.width == n):
        end = t.start + t.step * (t.width - 1) + 1
        view = em.call(aten.slice.Tensor, (view, -1, t.start, end, t.step), like=like)
    for _ in blocks:  # the same table for every head of x
        view = em.call(aten.unsqueeze.default, (view, -2), like=like)
    return view


def _x_input(em: _Emitter, nodes: dict, m: Match, like) -> fx.Node:
    x = nodes[m.x_name]
    # an exact upcast of x changes nothing: the fused op computes in fp32 (fp64 when the subgraph did)
    if (not m.x_as_real and x.target is prims.convert_element_type.default
            and isinstance(x.args[0], fx.Node)
            and (x.args[0].meta["val"].dtype, x.meta["val"].dtype) in _EXACT_UPCASTS):
        x = x.args[0]
    base = _source_base(em, x, m.x_as_real, like)
    flat = em.flatten_tail(base, m.x_k, like)
    if not m.blocks:
        return flat
    nd = len(flat.meta["val"].shape)
    sizes = em.size_args(flat, range(nd - 1), like) + list(m.blocks) + [m.head_dim]
    return em.call(aten.reshape.default, (flat, sizes), like=like)


def _unflatten(em: _Emitter, out: fx.Node, target: fx.Node, k: int, like) -> fx.Node:
    if tuple(out.meta["val"].shape) == tuple(target.meta["val"].shape):
        return out
    shape = target.meta["val"].shape
    nd = len(shape)
    lead_len = nd - k
    sizes = em.size_args(out, range(lead_len), like) + [L.as_int(s) for s in shape[nd - k:]]
    return em.call(aten.reshape.default, (out, sizes), like=like)


@dataclasses.dataclass
class _Site:
    match: Match
    x: fx.Node | None = None
    cos: fx.Node | None = None
    sin: fx.Node | None = None


def _params(m: Match, out_dtype) -> dict:
    return dict(interleaved=m.interleaved, rotary_dim=m.rotary_dim, full_tables=m.full_tables,
                conjugate=m.conjugate, out_dtype=out_dtype)


def _out_dtype(m: Match) -> torch.dtype:
    return m.node.meta["val"].dtype


def _spec(m: Match, nodes: dict, paired: bool) -> B.SiteSpec:
    xv = nodes[m.x_name].meta["val"]
    tv = nodes[m.cos.name].meta["val"]
    shape = tuple(L.as_int(d) for d in xv.shape)  # None for a symbolic dim
    table_dtype = tv.dtype
    if table_dtype.is_complex:  # the op reads the real view (view_as_real) of complex freqs
        from torch._prims_common import corresponding_real_dtype

        table_dtype = corresponding_real_dtype(table_dtype)
    return B.SiteSpec(xv.device.type, shape, xv.dtype, table_dtype, _out_dtype(m), m.interleaved,
                      m.rotary_dim, m.full_tables, m.conjugate, paired)


def _fake_mode_of(val):
    import contextlib

    mode = torch._guards.detect_fake_mode([val])
    return mode if mode is not None else contextlib.nullcontext()


def _op_view(node: fx.Node, t: TableRef, blocks: tuple = ()):
    """(identity, sizes) of the table view the op would read, from fake tensors; None if unknown. The
    identity is the storage, offset, dtype and the (size, stride) of every dim but broadcast (size-1) ones:
    views of one storage equal under it read the same numbers wherever they broadcast."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        val = node.meta["val"]
        with _fake_mode_of(val):
            view = torch.view_as_real(val) if t.as_real else val
            if t.k != 1:
                view = view.reshape(*view.shape[: view.dim() - t.k], -1)
            view = view[..., t.start: t.start + t.step * (t.width - 1) + 1: t.step]
            for _ in blocks:
                view = view.unsqueeze(-2)
        sizes = tuple(L.as_int(d) for d in view.shape)
        strides = tuple(L.as_int(d) for d in view.stride())
        if None in sizes or None in strides:
            return None
        dims = tuple((n, st) for i, (n, st) in enumerate(zip(sizes, strides)) if n != 1 or i == len(sizes) - 1)
        key = (StorageWeakRef(view.untyped_storage()).cdata, L.as_int(view.storage_offset()), view.dtype, dims)
        return key, sizes
    except Exception:
        return None


def _pair_up(matches: list[Match], acc: Acceptor, nodes: dict, st: L.Structure) -> list[tuple[Match, ...]]:
    """Group matches that share tables and options into (q, k) pairs where the graph order allows."""

    def same_table(a: TableRef, ablocks: tuple, b: TableRef, bblocks: tuple, mb: Match) -> bool:
        """One table for both: the same recipe on structurally equal nodes, read with the same number of
        head blocks; or views of one storage that read the same numbers as the op shapes them
        (`freqs.unsqueeze(2)` against `freqs[:, :, None]`) and broadcast against both x."""
        if (st.id(nodes[a.name]), a.k, a.as_real, a.start, a.step, a.width, len(ablocks)) == (
                st.id(nodes[b.name]), b.k, b.as_real, b.start, b.step, b.width, len(bblocks)):
            return True
        va, vb = _op_view(nodes[a.name], a, ablocks), _op_view(nodes[b.name], b, bblocks)
        return va is not None and vb is not None and va[0] == vb[0] and fits(a, ablocks, mb)

    def fits(t: TableRef, blocks: tuple, m: Match) -> bool:
        """The table as emitted for the first site (unsqueezed for its blocks) broadcasts against m's x."""
        view = _op_view(nodes[t.name], t, blocks)
        if view is None:
            return False
        shape = view[1][:-1]
        val = m.node.meta["val"]
        lead = tuple(val.shape[: val.dim() - m.value_k]) + tuple(m.blocks)
        if len(shape) > len(lead):
            return False
        return all(a == 1 or L.same_dim(a, b) for a, b in zip(reversed(shape), reversed(lead)))

    groups: list[tuple[Match, ...]] = []
    used = set()
    for i, a in enumerate(matches):
        if i in used:
            continue
        partner = None
        for j in range(i + 1, len(matches)):
            b = matches[j]
            if j in used or b.node is a.node:
                continue
            if (a.interleaved, a.rotary_dim, a.full_tables, a.conjugate, a.head_dim, a.wide, a.offset) != (
                    b.interleaved, b.rotary_dim, b.full_tables, b.conjugate, b.head_dim, b.wide, b.offset):
                continue
            if not (same_table(a.cos, a.blocks, b.cos, b.blocks, b) and same_table(a.sin, a.blocks, b.sin, b.blocks, b)):
                continue
            if _out_dtype(a) != _out_dtype(b) or a.x_name == b.x_name:
                continue
            inputs = [nodes[a.x_name], nodes[b.x_name], nodes[a.cos.name], nodes[a.sin.name]]
            # one launch for both is possible unless an input of one needs the other's result
            if any(acc.depends_on(i, r.node) for i in inputs for r in (a, b)):
                continue
            partner = j
            break
        if partner is None:
            groups.append((a,))
        else:
            used.add(partner)
            groups.append((a, matches[partner]))
    return groups


def _emit_kernel(em: _Emitter, be: B.Backend, xs, cos, sin, params, like) -> list | None:
    """The Triton backend's kernel as Inductor's own user-kernel node (launched from generated code);
    None where that is not possible here (symbolic sizes), and the op call is emitted instead."""
    if be.name != "triton" or em.fake_mode is None:
        return None
    try:
        from ..kernels.triton_graph import emit_triton
    except ImportError:
        return None
    return emit_triton(em.graph, em.fake_mode, xs, cos, sin, params, like)


def _emit_group(em: _Emitter, graph: fx.Graph, anchor: fx.Node, group: tuple, nodes: dict,
                be: B.Backend) -> tuple[list, str, fx.Node]:
    """New nodes for one site or q/k pair, before `anchor`: (nodes replacing each match, op name, the cos
    and sin views)."""
    with graph.inserting_before(anchor):
        xs = [_x_input(em, nodes, m, m.node) for m in group]
        m0 = group[0]
        cos = _table_view(em, nodes, m0.cos, m0.blocks, m0.node)
        sin = _table_view(em, nodes, m0.sin, m0.blocks, m0.node)
        if m0.wide and _out_dtype(m0) in (torch.float32, torch.float64):
            dts = {x.meta["val"].dtype for x in xs} | {cos.meta["val"].dtype, sin.meta["val"].dtype}
            if torch.float64 not in dts:
                xs = [em.call(prims.convert_element_type.default, (x, torch.float64), like=m0.node)
                      for x in xs]
        params = _params(m0, _out_dtype(m0))
        heads = []
        if m0.offset:  # rotate the lanes after the pass-through head, then put the head back in front
            P, n = m0.offset, m0.head_dim
            heads = [em.call(prims.convert_element_type.default,
                             (em.call(aten.slice.Tensor, (x, -1, 0, P), like=m0.node), _out_dtype(m0)),
                             like=m0.node) for x in xs]
            xs = [em.call(aten.slice.Tensor, (x, -1, P, n), like=m0.node) for x in xs]
        outs = _emit_kernel(em, be, xs, cos, sin, params, m0.node)
        if outs is not None:
            op_name = "rope_fusion.rotary_qk" if len(group) == 2 else "rope_fusion.rotary"
        elif len(group) == 1:
            outs = [em.call(be.rotary, (xs[0], cos, sin), params, like=m0.node)]
            op_name = "rope_fusion.rotary"
        else:
            pair = em.call(be.rotary_qk, (xs[0], xs[1], cos, sin), params, like=m0.node)
            outs = [em.call(operator.getitem, (pair, i), like=m.node) for i, m in enumerate(group)]
            op_name = "rope_fusion.rotary_qk"
        if heads:
            outs = [em.call(aten.cat.default, ([h, o], -1), like=m0.node) for h, o in zip(heads, outs)]
        finals = [_unflatten(em, o, m.node, m.value_k, m.node) for o, m in zip(outs, group)]
    return finals, op_name, cos, sin


def fuse_graph(graph: fx.Graph, report: Report, graph_index: int, backend: str = "auto",
               fuse_qk: bool = True, cache_host_tables: bool = True) -> None:
    matches, misses, acc = find_matches(graph)
    interp = acc.I
    nodes = interp.nodes
    for node, reason in misses:
        report.misses.append(Miss(graph_index, node.name, reason, source_line(node)))
    if not matches:
        return
    order = acc.order
    groups = _pair_up(matches, acc, nodes, interp.structure) if fuse_qk else [(m,) for m in matches]
    em = _Emitter(graph)
    tables: list = []
    for group in groups:
        if len(group) == 1:
            anchor = group[0].node
        else:  # after the last input of either; users that came earlier are moved by the sort below
            m0 = group[0]
            inputs = [nodes[m.x_name] for m in group] + [nodes[m0.cos.name], nodes[m0.sin.name]]
            anchor = max(inputs, key=lambda n: order[n]).next
        spec = _spec(group[0], nodes, len(group) == 2)
        be = B.choose_backend(backend, spec)
        known = set(graph.nodes)
        try:
            finals, op_name, cos, sin = _emit_group(em, graph, anchor, group, nodes, be)
        except Exception as e:  # this site stays as it was; the others still fuse
            for n in reversed([n for n in graph.nodes if n not in known]):
                graph.erase_node(n)
            report.errors.append(GraphError(graph_index, f"{group[0].node.name}: {type(e).__name__}: {e}"))
            continue
        kernel_index = len(report.kernels)
        site_ids = []
        for role, (m, new) in zip(("q", "k") if len(group) == 2 else ("x",), zip(group, finals)):
            m.node.replace_all_uses_with(new)
            xv = nodes[m.x_name].meta["val"]
            site_ids.append(len(report.sites))
            report.sites.append(Site(
                graph=graph_index, node=m.node.name, style="interleaved" if m.interleaved else "neox",
                rotary_dim=m.rotary_dim, head_dim=m.head_dim, table_form="full" if m.full_tables else "half",
                conjugate=m.conjugate, x_dtype=dtype_name(xv.dtype),
                table_dtype=dtype_name(cos.meta["val"].dtype), out_dtype=dtype_name(_out_dtype(m)),
                shape=tuple(str(s) for s in m.node.meta["val"].shape), source=rotation_source(m.node),
                kernel=kernel_index, role=role))
        report.kernels.append(Kernel(graph_index, op_name, be.name, site_ids))
        tables += [cos, sin]
    if cache_host_tables and tables:
        from .host_tables import cache_host_tables as cache

        report.host_tables += [f"{graph_index}:{name}" for name in cache(graph, tables)]
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)
    graph.eliminate_dead_code()
    graph.lint()
