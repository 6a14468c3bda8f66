"""q/k grouping: rotations that read the same tables with the same options share one launch.

Almost every model rotates q and k with two calls on the same tables; their head counts may differ (GQA).
Two rotations pair when their options agree (or differ only in that q has a pass-through head and k rotates its
whole head, DeepSeek's MLA: `launch_order`), their tables are provably the same numbers as the op reads
them, and neither's inputs depend on the other's result (one launch needs all inputs first). Sequence
parallel models (4 calls over 2 tables) and cross-attention (q and k with different tables) pair only
where the tables agree, never by position. A rotary kernel's site and a native one pair when the native tables
are views that read, over either x, the very rows the kernel reads (`kernel_and_native`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ...fx_sizes import as_int, same_dim
from ...ops.schema import RotaryParams
from ..fx_util import PASS_THROUGH, SPLITS
from .gathers import gather_of
from .matcher import Acceptor
from .site import KernelTables, Site, TableRef


def fake_mode_of(val: Any):
    """The fake mode a node's value lives in (a null context when there is none)."""
    mode = torch._guards.detect_fake_mode([val])
    return mode if mode is not None else contextlib.nullcontext()


def _table_val(node: fx.Node, t: TableRef, blocks: tuple = ()) -> torch.Tensor:
    """The fake table view the op would read (`emission.table_view` on fake tensors; call in the fake mode)."""
    view = node.meta["val"]
    view = torch.view_as_real(view) if t.as_real else view
    if t.k != 1:
        view = view.reshape(*view.shape[: view.dim() - t.k], -1)
    view = view[..., t.start: t.start + t.step * (t.width - 1) + 1: t.step]
    for _ in blocks:
        view = view.unsqueeze(-2)
    return view


def table_view_geometry(node: fx.Node, t: TableRef, blocks: tuple = ()):
    """(identity, sizes) of the table view the op would read, from fake tensors; None if unknown. The
    identity is the storage, offset, dtype and every dim's (size, stride) as the op broadcasts the view
    against x, right-aligned: leading size-1 dims dropped (broadcasting adds them), other size-1 dims kept
    at their place with stride 0 (`freqs.unsqueeze(2)` and `freqs[:, :, None]` are one table). Two views
    equal under it read the same table entry at every position of any x they broadcast against; a view
    whose sequence dim sits at another place (`cos.unsqueeze(1)` for a [B, S, H, D] q against `cos` for a
    [B, H, S, D] k) reads another entry there, whatever storage both share."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        with fake_mode_of(node.meta["val"]):
            view = _table_val(node, t, blocks)
        sizes = tuple(as_int(d) for d in view.shape)
        strides = tuple(as_int(d) for d in view.stride())
        if None in sizes or None in strides:
            return None
        dims = [(n, 0 if n == 1 else st) for n, st in zip(sizes, strides)]
        while len(dims) > 1 and dims[0][0] == 1:
            dims.pop(0)
        key = (StorageWeakRef(view.untyped_storage()).cdata, as_int(view.storage_offset()), view.dtype,
               tuple(dims))
        return key, sizes
    except Exception:  # a view fake tensors cannot build: not provably the same table
        return None


aten = torch.ops.aten

# Ops that move, copy or cast numbers without arithmetic: the dtype a rotation computes in is that of the
# other ops between x and the result (a final `.double()`, a cat into an fp64 buffer, compute nothing).
_NO_ARITHMETIC = PASS_THROUGH | SPLITS | {  # and the ops of several inputs, or none, that only place numbers
    aten.squeeze.default, aten.cat.default, aten.split_with_sizes.default, aten.slice_scatter.default,
    aten.select_scatter.default, aten.copy.default, aten.empty.memory_format, aten.empty_like.default,
    aten.empty_strided.default, aten.full.default, aten.full_like.default, aten.zeros.default,
    aten.zeros_like.default, aten.resolve_conj.default,
}


def arithmetic_dtype(m: Site, nodes: dict, depends_on: Callable) -> torch.dtype | None:
    """The widest real dtype the graph computes m's rotation in: over the ops between x and the replaced
    node that compute (products, sums; not casts, views or copies), complex ones by their real part. None
    for a site that builds its own tables (a rotary kernel's) or where no such op is found.

    The op computes in fp64 when an input is fp64 (docs/design.md section 2); where the graph reads fp64
    data but computes in fp32 (`(x.float() * c.float() + ...).double()`), plain compile matches eager
    exactly and the op must compute in fp32 too, and fp64 angles whose cos and sin the graph casts to
    fp16 must not reach an fp32 op as angles (`emission.plan_group`)."""
    if not m.arithmetic or m.x.name not in nodes:
        return None
    x = nodes[m.x.name]
    stack, seen, widest = [m.node], set(), None
    while stack:
        n = stack.pop()
        if n in seen or n is x:
            continue
        seen.add(n)
        if n.op != "call_function" or not depends_on(n, x):
            continue  # tables and what they are computed from: not the rotation's arithmetic
        val = n.meta.get("val")
        if n.target not in _NO_ARITHMETIC and isinstance(val, torch.Tensor) and (
                val.dtype.is_floating_point or val.dtype.is_complex):
            dt = val.dtype.to_real() if val.dtype.is_complex else val.dtype
            widest = dt if widest is None else torch.promote_types(widest, dt)
        stack.extend(n.all_input_nodes)
    return widest


def _lead(m: Site) -> tuple:
    """The dims of m's x as the op reads it that a table broadcasts over (the heads of a flat x as blocks)."""
    val = m.node.meta["val"]
    return tuple(val.shape[: val.dim() - m.value_k]) + tuple(m.x.blocks)


def broadcast_geometry(view: torch.Tensor, lead: tuple) -> tuple | None:
    """(storage, offset, dtype, sizes, strides) of a fake table view broadcast over x's leading dims `lead` as the
    op broadcasts it (right-aligned), size-1 dims with stride 0: two views with one geometry read the same table
    element at every position of x. None when a size is symbolic or the view does not broadcast."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        view = view.expand(*lead, view.shape[-1])
        sizes = tuple(as_int(d) for d in view.shape)
        strides = tuple(as_int(d) for d in view.stride())
        if None in sizes or None in strides:
            return None
        strides = tuple(0 if n == 1 else st for n, st in zip(sizes, strides))
        return (StorageWeakRef(view.untyped_storage()).cdata, as_int(view.storage_offset()), view.dtype, sizes,
                strides)
    except Exception:
        return None


class _Pairing:
    def __init__(self, acc: Acceptor):
        self.acc = acc
        self.nodes = acc.interp.nodes
        self.structure = acc.interp.structure

    def same_table(self, a: TableRef, ablocks: tuple, b: TableRef, bblocks: tuple, mb: Site) -> bool:
        """One table for both: the same recipe on structurally equal nodes, read with the same number of
        head blocks; or views of one storage that read the same numbers as the op shapes them
        (`freqs.unsqueeze(2)` against `freqs[:, :, None]`) and broadcast against both x."""
        st, nodes = self.structure, self.nodes
        if a.pieces or b.pieces:  # tables in pieces: the same pieces, each the same table
            return len(a.pieces) == len(b.pieces) and a.partner == b.partner and all(
                self.same_table(pa, ablocks, pb, bblocks, mb) for pa, pb in zip(a.pieces, b.pieces))
        if (st.id(nodes[a.name]), *a.key[1:], len(ablocks)) == (st.id(nodes[b.name]), *b.key[1:], len(bblocks)):
            return True
        if a.partner or b.partner:  # a swapped copy is no view: only the same recipe is provably the same
            return False
        ga, gb = gather_of(nodes[a.name], a), gather_of(nodes[b.name], b)
        if ga is not None and gb is not None:  # rows of one cache by one positions tensor, as the op reads them
            rank_a = nodes[a.name].meta["val"].dim() - a.k + len(ablocks)  # the rank of the op's positions
            rank_b = nodes[b.name].meta["val"].dim() - b.k + len(bblocks)
            if (st.id(ga.cache), st.id(ga.positions), ga.wraps, ga.start, ga.step, a.width, rank_a) == (
                    st.id(gb.cache), st.id(gb.positions), gb.wraps, gb.start, gb.step, b.width, rank_b):
                return True
        va = table_view_geometry(nodes[a.name], a, ablocks)
        vb = table_view_geometry(nodes[b.name], b, bblocks)
        return va is not None and vb is not None and va[0] == vb[0] and self.fits(va[1], mb)

    @staticmethod
    def fits(view_sizes: tuple, m: Site) -> bool:
        """The table as emitted for the first site (unsqueezed for its blocks) broadcasts against m's x."""
        shape = view_sizes[:-1]
        lead = _lead(m)
        if len(shape) > len(lead):
            return False
        return all(a == 1 or same_dim(a, b) for a, b in zip(reversed(shape), reversed(lead)))

    def same_tables(self, a: Site, b: Site) -> bool:
        """Whether the op reads the same numbers as tables for a and for b, asked of their table sources: two
        kernels' records are equal; a kernel's rows known at compile time against native views of them; the graph's
        own tables table by table."""
        ka, kb = isinstance(a.tables, KernelTables), isinstance(b.tables, KernelTables)
        if ka and kb:
            return a.tables == b.tables
        if ka or kb:
            return self.kernel_and_native(*((a, b) if ka else (b, a)))
        return (self.same_table(a.tables.cos, a.x.blocks, b.tables.cos, b.x.blocks, b)
                and self.same_table(a.tables.sin, a.x.blocks, b.tables.sin, b.x.blocks, b))

    def kernel_and_native(self, k: Site, n: Site) -> bool:
        """A rotary kernel's site k and a native site n read the same numbers: only where k's rows are known at
        compile time (`KernelTables.fixed_rows`: a flash-attn launch with an int offset reads rows [o, o+S) of its
        cos/sin nodes) against native tables that are views of the same storage which, broadcast over either x,
        address the same element at every position (storage, offset, strides; the group reads either site's
        tables, so both broadcasts are checked). Tensor offsets, vLLM's cache by positions, swapped (partner)
        tables, copies and symbolic sizes stay unpaired."""
        cos, sin = n.tables.cos, n.tables.sin
        if cos.partner or sin.partner or cos.pieces or sin.pieces:
            return False
        with fake_mode_of(k.node.meta["val"]):
            fixed = k.tables.fixed_rows(k)
            if fixed is None:
                return False
            for kv, t in zip(fixed, (cos, sin)):
                try:
                    nv = _table_val(self.nodes[t.name], t, n.x.blocks)
                except Exception:  # a view fake tensors cannot build: not provably the same table
                    return False
                for lead in (_lead(k), _lead(n)):
                    g = broadcast_geometry(kv, lead)
                    if g is None or g != broadcast_geometry(nv, lead):
                        return False
        return True

    def same_projection_input(self, group: list, b: Site) -> bool:
        """Every x of `group` and b's x are projections (matmuls) of one activation, or all are inputs of
        the graph (nothing to wait for)."""
        inputs = {_projection_input(self.nodes[m.x.name]) for m in (*group, b)}
        return len(inputs) == 1 and None not in inputs

    def can_pair(self, a: Site, b: Site) -> bool:
        if b.node is a.node or a.x.name == b.x.name or launch_order((a, b)) is None or a.wide != b.wide:
            return False
        dts = {arithmetic_dtype(m, self.nodes, self.acc.depends_on) for m in (a, b)} - {None}
        if len(dts) > 1:  # one launch computes in one dtype (a rotary kernel's site has none of its own)
            return False
        if not self.same_tables(a, b):
            return False
        inputs = [self.nodes[a.x.name], self.nodes[b.x.name], *a.tables.tensors(self.nodes), *a.tables.row_inputs,
                  *b.tables.row_inputs]
        # one launch for both is possible unless an input of one needs the other's result
        return not any(self.acc.depends_on(i, r.node) for i in inputs for r in (a, b))


def launch_order(group: Sequence[Site]) -> tuple[Site, ...] | None:
    """The sites of a group in the order of the op's tensors, or None when one call cannot rotate them all: equal
    parameters and head dims (in graph order); or one site whose rotated lanes start after a pass-through head
    (rotary_offset o) and sites that rotate their whole head, of rotary_dim lanes, from lane 0 with parameters
    otherwise equal (DeepSeek's q, cat(q_nope, rope(q_pe)), and its shared k_pe): that site first, as q, and the
    call takes `offset_q_only` (`launch_params`)."""
    m0 = group[0]
    if all(m.params == m0.params and m.x.head_dim == m0.x.head_dim for m in group[1:]):
        return tuple(group)
    heads = [m for m in group if m.params.rotary_offset]
    if len(heads) != 1:
        return None
    q = heads[0]
    whole = q.params.replace(rotary_offset=0)
    rest = [m for m in group if m is not q]
    if all(m.params == whole and m.x.head_dim == whole.rotary_dim for m in rest):
        return (q, *rest)
    return None


def launch_params(group: Sequence[Site]) -> RotaryParams:
    """The parameters of a group's op call (`launch_order`'s order): the sites' own, with `offset_q_only` where
    q's pass-through head is q's alone."""
    p = group[0].params
    return p if all(m.params == p for m in group[1:]) else p.replace(offset_q_only=True)


_MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1, torch.ops.aten.bmm.default: 0,
            torch.ops.aten.baddbmm.default: 1}


GRAPH_INPUT = "graph input"


def _projection_input(x: fx.Node) -> Any:
    """The activation x is a projection of: back from x through ops of one tensor input (views, casts, a
    scale) to a matmul, then back through that input's ops of one tensor input; GRAPH_INPUT when x is (a view
    of) an input of the graph, there from the start; None otherwise."""
    node = _back_through_single_inputs(x)
    if node.op == "placeholder":
        return GRAPH_INPUT
    if node.op != "call_function" or node.target not in _MATMULS:
        return None
    return _back_through_single_inputs(node.args[_MATMULS[node.target]])


def _back_through_single_inputs(node: fx.Node) -> fx.Node:
    """Back from node while it is an op of one tensor input (a view, a cast, a scale), stopping at a matmul."""
    while node.op == "call_function" and node.target not in _MATMULS:
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(tensors) != 1:
            break
        node = tensors[0]
    return node


# The most rotated tensors one launch takes: q, k and v (CLVP rotates all three by the same tables).
MAX_GROUP = 3


def pair_up(matches: list[Site], acc: Acceptor) -> list[tuple[Site, ...]]:
    """Group matches (in graph order) into groups of up to MAX_GROUP that share one launch, first come first
    grouped: each later member pairs with every earlier one. A third member must be projected from the same
    activation as the pair (CLVP's q, k and v of one attention), or all three be graph inputs, not merely
    share their tables (q of another independent block, as in Wan VACE, would delay this pair's launch to
    where that block computes it)."""
    pairing = _Pairing(acc)
    groups: list[tuple[Site, ...]] = []
    used: set = set()
    for i, a in enumerate(matches):
        if i in used:
            continue
        group = [a]
        for j in range(i + 1, len(matches)):
            if len(group) == MAX_GROUP:
                break
            b = matches[j]
            if len(group) == 2 and not pairing.same_projection_input(group, b):
                continue
            if j not in used and all(pairing.can_pair(g, b) for g in group) and launch_order((*group, b)):
                used.add(j)
                group.append(b)
        groups.append(launch_order(group))
    return groups
