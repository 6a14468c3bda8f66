"""What a backend, and `auto`'s cost model (ops/cost_model.py), sees of a site before it is emitted.

The model's own RoPE code, and the op's lowering, are Inductor code: whatever computes x elementwise (a
QK-norm that could not be folded, a `cat` of text and image tokens after their norms, a cast) fuses into
them, so x is never written. The Triton kernel is a user-kernel node that Inductor cannot fuse into, so such
a producer writes x once more and the kernel reads it back: the site costs its x bytes again. x read from a
matmul, an input or anything else that is in memory anyway costs nothing extra.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from ...fx_nodes import chain_back
from ...fx_sizes import as_int
from ...ops.backends import SiteSpec
from ...ops.cost_model import HOST_BOUND_BYTES, SiteCost
from ...ops.schema import RotaryParams
from ..analysis.site import Site
from ..fx_util import COPIES, PASS_THROUGH, SPLITS

aten = torch.ops.aten

# Views that leave x where its producer wrote it: the pass-through ops less the copies (a copy is written, and is
# where the bytes are) and `squeeze.dims`, plus the views of several outputs and the other pure views.
_X_VIEWS = (PASS_THROUGH - COPIES - {aten.squeeze.dims}) | SPLITS | {
    aten.split_with_sizes.default, aten.as_strided.default, aten.unflatten.int}
# Views back to a table's base, whose users and kind (an input, or computed) the cost record takes: those of x less
# transposes, unsafe and complex views and the rarer views of x (split_with_sizes, as_strided, unflatten); a table
# behind one of them counts as its own base.
_TABLE_VIEWS = _X_VIEWS - {aten.transpose.int, aten._unsafe_view.default, aten.view_as_complex.default,
                           aten.split_with_sizes.default, aten.as_strided.default, aten.unflatten.int}
# Producers whose output is in memory whatever consumes it (Inductor calls a library kernel for them).
_MATERIALISED = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                 aten.convolution.default, aten._scaled_mm.default, aten._int_mm.default)


def _base(t: fx.Node, views: tuple) -> fx.Node:
    return chain_back(t, views)[-1]


def fused_producer(x: fx.Node) -> bool:
    """Whether x is computed by code Inductor would fuse into an elementwise consumer (an aten/prims op
    other than a matmul), so that reading it from an opaque kernel costs a write and a read of x."""
    base = _base(x, _X_VIEWS)
    if base.op != "call_function" or base.target in _MATERIALISED:
        return False
    target = base.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims")


def site_spec(xs: list, cos: fx.Node, sin: fx.Node, params: RotaryParams, m: Site,
              positions: fx.Node | None = None, joins_fold: bool = False) -> SiteSpec:
    """The site as the op reads it: x and the tables, with the cost record `auto` decides by. `joins_fold`: every x
    is a `cat` of pieces that the Triton kernel reads itself (passes/folds/cat_pieces.py), so the join is not written
    and read back before it (the kernel's estimate drops those bytes; plain compile and the lowering fuse the cat)."""
    xv = xs[0].meta["val"]
    spec = SiteSpec(device_type=xv.device.type, x_shapes=tuple(tuple(as_int(d) for d in x.meta["val"].shape)
                                                                for x in xs),
                    x_dtype=xv.dtype, table_dtype=cos.meta["val"].dtype, params=params)
    table_bytes = 0
    for t in dict.fromkeys((cos, sin)):  # angle tables: one tensor for both
        val = t.meta["val"]
        rows = tuple(positions.meta["val"].shape) if positions is not None else tuple(val.shape[:-1])
        numel = math.prod(as_int(d) or 1 for d in (*rows, val.shape[-1]))
        table_bytes += numel * val.element_size()
    bases = {_base(t, _TABLE_VIEWS) for t in (cos, sin)}
    computed = any(b.op not in ("placeholder", "get_attr") for b in bases) and positions is None
    style = "interleaved" if params.interleaved else "neox" if params.rotary_blocks == 1 else "neox-blocks"
    if m.x.as_real:
        style = "complex128" if xv.dtype == torch.float64 else "complex64"
    users = max(len(b.users) for b in bases)
    x_bytes = spec.bytes_moved()
    upstream = None
    if x_bytes is not None:
        upstream = sum(dataclasses.replace(spec, x_shapes=(shape,)).bytes_moved()
                       for x, shape in zip(xs, spec.x_shapes) if fused_producer(x) and not joins_fold)
    half, head = params.rotary_dim // 2, as_int(xv.shape[-1])
    passed = head - params.rotary_dim if head is not None else None  # pass-through lanes: the kernel's other tile
    # rows the kernel pads, or rotates in halves too narrow for full-width loads (partial NeoX of 32 of 64
    # lanes, CLVP: 1.12x its launch's floor where Inductor's own kernel took 1.05x)
    padded = half & (half - 1) != 0 or (passed is not None and passed & (passed - 1) != 0) or \
        (half < 32 and not params.interleaved and params.rotary_dim != head)
    cost = SiteCost(x_bytes=x_bytes, table_bytes=table_bytes, tables_computed=computed, table_users=users,
                    style=style, x_fused_upstream_bytes=upstream or 0, norm=params.norm, padded=padded,
                    gathered=positions is not None, tensors=len(xs))
    return dataclasses.replace(spec, cost=cost)


def graph_host_bound(graph: fx.Graph) -> bool:
    """Whether a compiled call of this graph waits on the host: every tensor it reads and returns is moved by
    the GPU in less time than a small call's host time (ops/cost_model.py). Sizes that are symbolic, or inputs
    whose size the graph does not record, count as large: then the GPU's time decides."""
    module = graph.owning_module
    values = []
    for n in graph.nodes:
        if n.op == "placeholder":
            values.append(n.meta.get("val"))
        elif n.op == "get_attr":  # a constant (a frozen weight) or a subgraph, which moves nothing itself
            value = n.meta.get("val")
            if value is None and module is not None:
                value = module
                for part in str(n.target).split("."):
                    value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                values.append(value)
        elif n.op == "output":
            values += [a.meta.get("val") for a in n.all_input_nodes]
    total = 0
    for v in values:
        if v is None:
            return False
        if isinstance(v, torch.Tensor):
            numel = as_int(v.numel())
            if numel is None:
                return False
            total += numel * v.element_size()
            if total >= HOST_BOUND_BYTES:
                return False
    return True
