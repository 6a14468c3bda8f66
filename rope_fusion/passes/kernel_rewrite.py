"""Rotary kernels already in the graph as sites of the fused op (flash-attn's rotary_kernel, vLLM's rotary ops).

`find_kernel_matches(graph)` turns each `KernelSite` that kernel_sites.py recognises into a `Match` that grouping and
emission take like any other site: x and the options, the node to replace (the kernel's result), and a `tables`
builder that emits the op's table arguments in the graph when the site's group is planned:

- flash-attn, int offset o: rows [o, o+S) of the [seqlen_ro, R/2] tables (`aten.slice` on dim 0; the checks
  guarantee o + S <= seqlen_ro), `unsqueeze(-2)` over the heads: [S, 1, R/2] against x [B, S, H, D].
- flash-attn, tensor offsets [B]: positions = clamp(offsets[:, None] + iota(S), 0, seqlen_ro) as [B, S, 1], into
  the tables padded with one row (cos=1, sin=0) at index seqlen_ro: a row the kernel would read past the table
  rotates by the identity, as its masked load (other=1.0 / 0.0) does. (A negative offset is undefined behaviour in
  the kernel, which reads before the table; here it reads row 0.)
- flash-attn varlen (x [T, H, D], cu_seqlens [B + 1]): the op's packed form. An int offset o: the tables from row
  o on and the op's `cu_seqlens` (flash-attn's host check o + max_seqlen <= seqlen_ro, verified, keeps every row
  of a sequence within max_seqlen in the table). Offsets [B]: the positions that the op would derive
  (ops/packed.py's ATen ops, emitted here), clamped into the tables padded with the identity row, as above.
- vLLM `_C.rotary_embedding` / flashinfer: cos = cache[:, :R/2], sin = cache[:, R/2:] (views) and positions
  unsqueezed to [T, 1] ([B, S, 1] for [B, S] positions), so that cos[positions] broadcasts over the heads of x as the
  op reads it; a flat [T, H*D] x is split into heads by the Match's `blocks`.

`table_key` says which sites read the same numbers: two flash-attn launches on the same cos and sin nodes with the
same offset (int value or offsets node) and the same sequence length; two vLLM sites with the same cache and
positions (the q and k of one op always do). Only sites of one key share a `rotary_qk` launch; a site whose
positions/offsets tensor is read through `Match.table_inputs`, so a pair is placed after it too. A flash-attn site
with an int offset also pairs with a native (aten) rotation whose tables are views reading the same rows of the same
cos and sin (`fixed_row_tables`, compared in grouping.py): a kernel call for q and torch ops for k, one launch.

What happens to the kernel: the pass replaces every use of the result node (`getitem(launch, "OUT")`,
`getitem(auto_functionalized, i)`) and then runs dead-code elimination; neither `triton_kernel_wrapper_functional`
nor `auto_functionalized` is impure for torch.fx (is_impure: a HOP is impure only through a registered effect, an
auto_functionalized op only when the op is in _side_effectful_functions), so the launch and the op call die with
their last getitem. In-place forms are functional at this point: writing the result back into a graph input is
`aten.copy_(input, result)`, a use of the result, which then reads the fused value. When torch's TTIR analysis could
not run, it assumes every input of a launch is mutated: the launch also returns `getitem(launch, "X"/"COS"/...)`,
which later launches read and which are copied back into graph inputs; those would keep the kernel alive. The
kernel stores only through OUT (verified from its source), so each such getitem equals the launch's input; for a
launch that became a Match their uses are rewired to that input here (value-preserving, inside the pass's
transaction), and the copy back becomes `copy_(input, input)`, which Inductor drops.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..ops import packed
from .flash_attn_sites import FlashAttnKernel, identify_launch, see_through, triton_wrappers
from .kernel_scan import find_kernel_sites
from .kernel_sites import KernelSite, eq, known
from .matcher import Match, TableRef

aten = torch.ops.aten
prims = torch.ops.prims

FLASH_ATTN = "flash_attn.rotary_kernel"
FLAT_LAYOUTS = ("t(hd)", "bs(hd)")  # x holds the heads flattened into its last dim


def find_kernel_matches(graph: fx.Graph) -> tuple[list[Match], list[tuple[fx.Node, str]]]:
    """(matches, near misses): a Match per rotated tensor of a recognised rotary kernel/op, in graph order, and the
    calls that look like one but cannot be expressed, with the reason. The one edit made here: uses of a matched
    launch's non-OUT outputs are rewired to its inputs, which hold the same values (module docstring); the pass
    calls this inside its transaction, so a failure later restores them too."""
    sites, misses = find_kernel_sites(graph)
    matches = []
    for site in sites:
        try:
            matches.append(kernel_match(site))
        except _NotConvertible as e:
            misses.append((site.node, str(e)))
    for m in matches:
        if m.origin == FLASH_ATTN:
            _bypass_unmutated_outputs(m.node.args[0])
    return matches, misses


class _NotConvertible(Exception):
    """A recognised site that the fused op cannot take after all (the reason is reported as a near miss)."""


def kernel_match(site: KernelSite) -> Match:
    """The Match of one kernel site (tables built by `tables(emitter)` when its group is planned)."""
    x = site.x.meta["val"]
    r, half = site.rotary_dim, site.rotary_dim // 2
    if site.layout in FLAT_LAYOUTS:
        heads = x.shape[-1] // site.head_dim
        if not isinstance(heads, int):
            raise _NotConvertible(f"x's hidden size {x.shape[-1]} is symbolic; the heads cannot be split out")
        blocks: tuple = (heads,)
    else:
        blocks = ()
    if site.kind == FLASH_ATTN:
        cos = TableRef(site.cos.name, 1, False, 0, 1, half)
        sin = TableRef(site.sin.name, 1, False, 0, 1, half)
        tables, key = _flash_attn_tables(site), _flash_attn_key(site)
        extra = (site.seqlen_offset, site.cu_seqlens)
    else:
        cache = site.cos_sin_cache.name
        cos = TableRef(cache, 1, False, 0, 1, half)
        sin = TableRef(cache, 1, False, half, 1, half)
        tables, key = _cache_tables(site), _cache_key(site)
        extra = (site.positions,)
    return Match(node=site.node, value_k=1, blocks=blocks, x_name=site.x.name, x_k=1, x_as_real=False,
                 head_dim=site.head_dim, rotary_dim=r, interleaved=site.interleaved, full_tables=False,
                 conjugate=site.conjugate, cos=cos, sin=sin, wide=False, offset=site.rotary_offset, tables=tables,
                 table_key=key, table_inputs=tuple(e for e in extra if isinstance(e, fx.Node)), origin=site.kind)


# -- keys --------------------------------------------------------------------------------------------------------

def _size_key(size: Any) -> Any:
    """An int, or the expression of a symbolic size (equal expressions: provably equal sizes)."""
    if isinstance(size, torch.SymInt):
        c = size.node.maybe_as_int()
        return int(c) if c is not None else ("sym", str(size.node.expr))
    return int(size)


def _flash_attn_key(site: KernelSite) -> tuple:
    off = site.seqlen_offset
    off_key = ("tensor", off) if isinstance(off, fx.Node) else ("int", int(off))
    if site.cu_seqlens is not None:  # packed: the rows are those of the sequences of one cu_seqlens
        return (FLASH_ATTN, site.cos, site.sin, off_key, _size_key(site.x.meta["val"].shape[0]), "thd",
                site.cu_seqlens)
    return (FLASH_ATTN, site.cos, site.sin, off_key, _size_key(site.x.meta["val"].shape[1]), "bshd", None)


def fixed_row_tables(m: Match) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tables a flash-attn site with an int offset o reads, as fake views of its cos and sin nodes in the op's
    shape: `cos[o:o+S].unsqueeze(-2)` ([S, 1, R/2] against x [B, S, H, D]), what `_flash_attn_tables` emits. None
    for other sites (tensor offsets, packed sequences, vLLM's cache by positions): their rows depend on run-time
    values. Grouping
    compares these views with a native site's table views (storage, offset, strides) to pair the two; call it in
    the graph's fake mode."""
    key = m.table_key
    if not (isinstance(key, tuple) and key and key[0] == FLASH_ATTN and key[3][0] == "int" and key[6] is None):
        return None
    cos, sin, off = key[1], key[2], key[3][1]
    seqlen = m.node.meta["val"].shape[1]
    return cos.meta["val"][off: off + seqlen].unsqueeze(-2), sin.meta["val"][off: off + seqlen].unsqueeze(-2)


def _cache_key(site: KernelSite) -> tuple:
    return ("vllm.cos_sin_cache", site.cos_sin_cache, site.positions, site.positions.meta["val"].dim() + 1)


# -- tables ------------------------------------------------------------------------------------------------------

Tables = Callable[[Any], tuple]


def _flash_attn_tables(site: KernelSite) -> Tables:
    if site.cu_seqlens is not None:
        return _varlen_tables(site)

    def tables(em) -> tuple:
        like = site.node
        seqlen = em.size_args(site.x, range(1, 2), like)[0]
        rows = site.cos.meta["val"].shape[0]
        off = site.seqlen_offset
        if not isinstance(off, fx.Node):  # rows [off, off + S) of the tables, the same for every batch and head
            out = []
            for t in (site.cos, site.sin):
                if not (off == 0 and eq(seqlen, rows)):
                    end = seqlen if off == 0 else off + seqlen if isinstance(seqlen, int) else \
                        em.call(operator.add, (seqlen, off), like=like)
                    t = em.call(aten.slice.Tensor, (t, 0, off, end), like=like)
                out.append(em.call(aten.unsqueeze.default, (t, -2), like=like))
            return out[0], out[1], None
        # per-batch offsets: positions into the tables padded with the kernel's identity row at index seqlen_ro
        device = site.x.meta["val"].device
        steps = em.call(prims.iota.default, (seqlen,), {"start": 0, "step": 1, "dtype": torch.int64, "device": device,
                                                        "requires_grad": False}, like=like)
        pos = em.call(aten.add.Tensor, (em.call(aten.unsqueeze.default, (off, -1), like=like), steps), like=like)
        limit = rows if isinstance(rows, int) else em.size_args(site.cos, range(1), like)[0]
        pos = em.call(aten.clamp_max.default, (em.call(aten.clamp_min.default, (pos, 0), like=like), limit), like=like)
        pos = em.call(aten.unsqueeze.default, (pos, -1), like=like)  # [B, S, 1]: over the heads of x [B, S, H, D]
        _check_before(off, pos)
        cos = em.call(aten.constant_pad_nd.default, (site.cos, [0, 0, 0, 1], 1.0), like=like)
        sin = em.call(aten.constant_pad_nd.default, (site.sin, [0, 0, 0, 1], 0.0), like=like)
        return cos, sin, pos
    return tables


def _varlen_tables(site: KernelSite) -> Tables:
    """(cos, sin, None, cu_seqlens, None) for an int offset: the op derives the rows; (padded cos, padded sin,
    positions) for offsets [B]: the op's rows, clamped into the identity row at index seqlen_ro."""
    def tables(em) -> tuple:
        like = site.node
        off = site.seqlen_offset
        if not isinstance(off, fx.Node):
            cos, sin = site.cos, site.sin
            if off:
                rows = site.cos.meta["val"].shape[0]
                end = rows if isinstance(rows, int) else em.size_args(site.cos, range(1), like)[0]
                cos, sin = (em.call(aten.slice.Tensor, (t, 0, off, end), like=like) for t in (cos, sin))
            return cos, sin, None, site.cu_seqlens, None
        pos = packed.graph_positions(em, site.x, site.cu_seqlens, off, like)  # [T, 1] over x's [T, H]
        _check_before(off, pos)
        _check_before(site.cu_seqlens, pos)
        rows = site.cos.meta["val"].shape[0]
        limit = rows if isinstance(rows, int) else em.size_args(site.cos, range(1), like)[0]
        pos = em.call(aten.clamp_max.default, (em.call(aten.clamp_min.default, (pos, 0), like=like), limit), like=like)
        cos = em.call(aten.constant_pad_nd.default, (site.cos, [0, 0, 0, 1], 1.0), like=like)
        sin = em.call(aten.constant_pad_nd.default, (site.sin, [0, 0, 0, 1], 0.0), like=like)
        return cos, sin, pos
    return tables


def _cache_tables(site: KernelSite) -> Tables:
    def tables(em) -> tuple:
        like = site.node
        cache, r = site.cos_sin_cache, site.rotary_dim
        cos = em.call(aten.slice.Tensor, (cache, 1, 0, r // 2), like=like)
        sin = em.call(aten.slice.Tensor, (cache, 1, r // 2, r), like=like)
        pos = em.call(aten.unsqueeze.default, (site.positions, -1), like=like)  # [T, 1] / [B, S, 1]
        _check_before(site.positions, pos)
        return cos, sin, pos
    return tables


def _check_before(node: fx.Node, new: fx.Node) -> None:
    """The op's nodes go where emission placed the group, after every node it reads (Match.table_inputs); a
    guard: should that ever not hold, the group stays unfused with this reason."""
    n = new.prev
    while n.op != "root":
        if n is node:
            return
        n = n.prev
    raise RuntimeError(f"{node.name} (positions into the rotary tables) is computed after the place of the fused "
                       f"launch (after its x's and tables)")


# -- the fallback form of a launch -------------------------------------------------------------------------------

def _bypass_unmutated_outputs(launch: fx.Node) -> None:
    """Rewire getitem(launch, name != "OUT") to the launch's input `name` (see the module docstring)."""
    functional, _ = triton_wrappers()
    if not (isinstance(launch, fx.Node) and launch.target is functional):
        return
    if not isinstance(identify_launch(launch), FlashAttnKernel):
        return
    inputs = launch.kwargs["kwargs"]
    out_input = see_through(inputs.get("OUT"))
    for user in list(launch.users):
        name = user.args[1] if user.target is operator.getitem else None
        if not isinstance(name, str) or name == "OUT":
            continue
        source = see_through(inputs.get(name))
        if not isinstance(source, fx.Node) or source is out_input or not _same_layout(source, user):
            continue
        user.replace_all_uses_with(source)


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    return (va.dtype == vb.dtype and va.dim() == vb.dim()
            and all(known(x == y) for x, y in zip((*va.shape, *va.stride()), (*vb.shape, *vb.stride()))))


__all__ = ["find_kernel_matches", "kernel_match", "fixed_row_tables", "FLASH_ATTN", "FLAT_LAYOUTS"]
