"""torch_npu's RoPE ops as nodes of an ATen graph, for the compilers on Ascend that run no Inductor.

npugraph_ex and TorchAir compile the functional ATen graphs that AOTAutograd hands them; TorchAir's graph mode
(GE, `mode="max-autotune"`) lowers each node through a converter, and it has converters for torch_npu's ops
(`npu_rotary_mul`, `npu_apply_rotary_pos_emb`) but none for `rope_fusion::*`. So where `rope_fusion.fx_pass` runs
on an NPU graph, a site becomes those ops in the graph, not the bridge op of kernels/npu.py that picks them when
it runs. The case analysis is the bridge's (kernels/npu.py: `apply_layout`, `rotary_mul_layout`, the documented
layouts, dtypes, head dims and sizes), made on the fake values of the graph before any node is created:

- under TorchAir's graph mode (GE) only, q and k of one launch, NeoX ('half'), fully rotated, head dim 64 or
  128, one dtype throughout: `npu_apply_rotary_pos_emb(q, k, cos, sin, layout, "half")` with layout BSND (4-D)
  or TND (3-D). GE's converter lists BSH/BSND/SBND/BNSD and no TND, so a [T, N, D] pair is passed as BSND
  [1, T, N, D] (the same memory). The op writes q and k in place: it gets fresh contiguous copies, and tables
  expanded to its [B, S, 1, D] / [T, 1, D] form. Its schema declares no alias, yet it returns its inputs; a graph
  that runs node by node (npugraph_ex, aclgraph, vllm-ascend's fusion pass manager) goes through AOTAutograd's
  first-call check of custom ops, which rejects such an op (torch 2.13: an error where
  `error_on_custom_op_aliasing` is set, as it is when `CI` is, a deprecation warning otherwise). GE converts the
  node and never dispatches it, so only GE takes it; elsewhere q and k are one `npu_rotary_mul` each.
- otherwise one `npu_rotary_mul(x, r1, r2, mode)` per tensor, mode 'half' or 'interleave', on x padded to 4-D with
  views and tables of full width (half tables duplicated, `[c, c]` or `c0 c0 c1 c1 ...`: a table-sized copy),
  where `rotary_mul_layout` finds a documented BNSD/BSND/SBND layout for x and the table; a partial rotation
  rotates the head slice and concatenates the tail, a pass-through head is concatenated in front, conjugate
  negates sin, cache rows picked by positions are gathered first (packed sequences: by the positions that
  ops/packed.py's ATen ops derive from cu_seqlens, emitted before them), angle tables take cos and sin (fp32) first.
- anything else (a folded norm, de-interleaved output, NeoX within blocks, symbolic sizes, x of more than 4 dims,
  a table broadcast the docs do not list, dtypes outside fp16/bf16/fp32) raises `NotTaken` with the reason, before
  any node is made; the caller decides what the site becomes (kept as the rope_fusion op, or left unfused).

The ops are looked up in `kernels.npu.OP_NAMESPACE`, as the bridge does, so tests check the graph against
stand-in ops of the real schemas. This is verified against the documented semantics with stand-ins, not on
Ascend hardware.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from ..fx_sizes import as_int
from ..ops import packed
from ..ops.schema import RotaryCall
from . import npu

aten = torch.ops.aten
prims = torch.ops.prims


class NotTaken(Exception):
    """The documented constraints of torch_npu's ops exclude this site (the message says which)."""


def _ops():
    ns = getattr(torch.ops, npu.OP_NAMESPACE)
    try:
        return ns.npu_rotary_mul.default, ns.npu_apply_rotary_pos_emb.default
    except AttributeError as e:
        raise NotTaken(f"torch_npu's RoPE ops are not registered (torch.ops.{npu.OP_NAMESPACE}): {e}") from None


def op_targets() -> tuple:
    """The torch_npu ops this module emits, where they are registered (none otherwise)."""
    try:
        return _ops()
    except NotTaken:
        return ()


def _static(shape) -> tuple | None:
    sizes = tuple(as_int(d) for d in shape)
    return None if None in sizes else sizes


def _plan(call: RotaryCall, fake_mode, ge: bool) -> tuple:
    """Which op takes the call: ("apply", layout) or ("rotary_mul", None); raises NotTaken."""
    p = call.params
    unknown = p.unhandled(npu.BRIDGE_FIELDS)  # the same parameters as the bridge: each handled or refused below
    if unknown:
        raise NotTaken(f"the parameter(s) {unknown}: not mapped onto the NPU ops")
    if p.norm != "none":
        raise NotTaken("a folded QK-norm: the NPU ops rotate x as it is")
    if p.deinterleave:
        raise NotTaken("the NPU ops cannot write a de-interleaved (NeoX-ordered) result of interleaved pairs")
    if p.rotary_blocks > 1:
        raise NotTaken("the NPU ops pair NeoX lanes across the whole rotary dim, not within blocks")
    vals = [x.meta["val"] for x in call.xs]
    cos, sin = call.cos.meta["val"], call.sin.meta["val"]
    rows = call.positions.meta["val"].shape if call.positions is not None else \
        packed.positions_shape(vals[0]) if call.cu_seqlens is not None else None
    if any(_static(v.shape) is None for v in (*vals, cos, sin)) or (rows is not None and _static(rows) is None):
        raise NotTaken("symbolic sizes: the NPU ops' layout rules need concrete sizes")
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        if rows is not None:
            cos, sin = (t.new_empty((*rows, t.shape[-1])) for t in (cos, sin))
        if p.angle_tables:
            cos = sin = cos.new_empty(cos.shape, dtype=torch.float32)
        xs = [v[..., p.of_tensor(i).rotary_offset:] for i, v in enumerate(vals)]
    if cos.dtype != sin.dtype:
        raise NotTaken(f"cos is {cos.dtype} and sin {sin.dtype}: the NPU ops take one table dtype")
    kw = dict(interleaved=p.interleaved, rotary_dim=p.rotary_dim, full_tables=p.full_tables, out_dtype=p.out_dtype)
    if len(xs) == 2 and ge:  # only GE: see the module docstring on the op's aliasing
        layout = npu.apply_layout(*xs, cos, sin, **kw)
        if layout is not None:
            return "apply", layout
    for x in xs:
        if x.dim() > 4:
            raise NotTaken(f"x {tuple(x.shape)} has more than 4 dims (npu_rotary_mul takes 4-D x)")
        cd = npu.compute_dtype(x, cos)
        if cd is None:
            raise NotTaken(f"dtypes {x.dtype} and {cos.dtype}: the NPU ops take fp16, bf16 and fp32")
        t_shape = (*cos.shape[:-1], p.rotary_dim)
        x_shape = (*x.shape[:-1], p.rotary_dim)
        if len(t_shape) > 4:
            raise NotTaken(f"tables {tuple(cos.shape)} have more than 4 dims")
        x4, t4 = (1,) * (4 - len(x_shape)) + x_shape, (1,) * (4 - len(t_shape)) + t_shape
        if npu.rotary_mul_layout(x4, t4, p.interleaved) is None:
            mode = "interleave" if p.interleaved else "half"
            raise NotTaken(f"npu_rotary_mul documents no layout for x {x4} with tables {t4} in mode '{mode}'")
    return "rotary_mul", None


def emit(em, call: RotaryCall, like: fx.Node, ge: bool = False) -> list:
    """Nodes that compute the call with torch_npu's ops, inserted at the emitter's point; raises NotTaken (before
    creating any node) where the documented constraints exclude the site. `ge`: TorchAir's GE graph mode."""
    rotary_mul, apply = _ops()
    kind, layout = _plan(call, em.fake_mode, ge)
    p = call.params
    c = lambda target, *args, **kwargs: em.call(target, args, kwargs, like=like)

    cos, sin = call.cos, call.sin
    positions = call.positions
    if call.cu_seqlens is not None:
        positions = packed.graph_positions(em, call.xs[0], call.cu_seqlens, call.seqlen_offsets, like)
    if positions is not None:  # the cache rows as the graph's own indexing gathers them
        cos, sin = (c(aten.index.Tensor, t, [positions]) for t in (cos, sin))
    if p.angle_tables:  # the tables are cos and sin of one angle tensor, computed in fp32
        angle = c(prims.convert_element_type.default, cos, torch.float32)
        cos, sin = c(aten.cos.default, angle), c(aten.sin.default, angle)
    if not p.full_tables:
        cos, sin = (_full_width(c, t, p.interleaved) for t in (cos, sin))
    if p.conjugate:
        sin = c(aten.neg.default, sin)

    offs = [p.of_tensor(i).rotary_offset for i in range(len(call.xs))]  # offset_q_only: q's alone
    xs = [c(aten.slice.Tensor, x, -1, off) if off else x for x, off in zip(call.xs, offs)]
    if kind == "apply":
        outs = _apply(c, apply, xs, cos, sin, layout, ge)
    else:
        outs = [_rotary_mul(c, rotary_mul, x, cos, sin, p) for x in xs]
    outs = [_cast(c, o, p.out_dtype) for o in outs]
    return [c(aten.cat.default, [_cast(c, c(aten.slice.Tensor, x, -1, 0, off), p.out_dtype), o], -1) if off else o
            for x, o, off in zip(call.xs, outs, offs)]


def _cast(c, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    return node if node.meta["val"].dtype == dtype else c(prims.convert_element_type.default, node, dtype)


def _full_width(c, t: fx.Node, interleaved: bool) -> fx.Node:
    """One entry per lane: `[c, c]` for NeoX, `c0 c0 c1 c1 ...` interleaved (kernels.npu.full_width as nodes)."""
    if not interleaved:
        return c(aten.cat.default, [t, t], -1)
    shape = list(t.meta["val"].shape)
    pairs = c(aten.expand.default, c(aten.unsqueeze.default, t, -1), [*shape, 2])
    return c(aten.reshape.default, pairs, [*shape[:-1], 2 * shape[-1]])


def _contiguous(c, t: fx.Node) -> fx.Node:
    return t if t.meta["val"].is_contiguous() else c(aten.clone.default, t, memory_format=torch.contiguous_format)


def _rotary_mul(c, op, x: fx.Node, cos: fx.Node, sin: fx.Node, p) -> fx.Node:
    """npu_rotary_mul on the rotated lanes of x (4-D views, one compute dtype), the tail put back after."""
    xv = x.meta["val"]
    head = xv.shape[-1]
    xr = c(aten.slice.Tensor, x, -1, 0, p.rotary_dim) if p.rotary_dim < head else x
    cd = npu.compute_dtype(xv, cos.meta["val"])
    x4 = _contiguous(c, _cast(c, _padded(c, xr, 4), cd))
    c4, s4 = (_cast(c, _padded(c, t, 4), cd) for t in (cos, sin))
    rot = c(op, x4, c4, s4, "interleave" if p.interleaved else "half")
    rot = c(aten.reshape.default, rot, list(xr.meta["val"].shape))
    if p.rotary_dim < head:
        tail = c(aten.slice.Tensor, x, -1, p.rotary_dim)
        rot = c(aten.cat.default, [_cast(c, rot, p.out_dtype), _cast(c, tail, p.out_dtype)], -1)
    return rot


def _apply(c, op, xs: list, cos: fx.Node, sin: fx.Node, layout: str, ge: bool) -> list:
    """npu_apply_rotary_pos_emb on fresh copies of q and k, tables expanded to its form."""
    q, k = xs
    if layout == "TND" and ge:  # GE's converter has no TND: the same memory as BSND [1, T, N, D]
        q, k, cos, sin = (c(aten.unsqueeze.default, t, 0) for t in (q, k, *(_padded(c, t, 3) for t in (cos, sin))))
        layout = "BSND"
    qv = q.meta["val"]
    d = qv.shape[-1]
    table_shape = [*qv.shape[:2], 1, d] if layout == "BSND" else [qv.shape[0], 1, d]
    cos, sin = (c(aten.clone.default, c(aten.expand.default, _padded(c, t, len(table_shape)), table_shape),
                  memory_format=torch.contiguous_format) for t in (cos, sin))
    q, k = (c(aten.clone.default, t, memory_format=torch.contiguous_format) for t in (q, k))
    both = c(op, q, k, cos, sin, layout, "half")
    outs = [c(operator.getitem, both, i) for i in range(2)]
    if qv.dim() != xs[0].meta["val"].dim():  # back from the BSND view of a TND pair
        outs = [c(aten.squeeze.dim, o, 0) for o in outs]
    return outs


def _padded(c, t: fx.Node, ndim: int) -> fx.Node:
    for _ in range(ndim - t.meta["val"].dim()):
        t = c(aten.unsqueeze.default, t, 0)
    return t


__all__ = ["NotTaken", "emit", "op_targets"]
