"""Ascend NPU bridge: the fused rotary op as torch_npu's own RoPE kernels.

`rope_fusion::rotary_npu`, `rotary_qk_npu` and `rotary_qkv_npu` are variants of `rotary` / `rotary_qk` /
`rotary_qkv` (one schema, ops/schema.py; semantics in docs/design.md section 2); the pass emits them for sites
on an NPU device
(`AUTO_ORDER["npu"]`). Inductor does not lower them, so they run as these calls. They call

- `torch.ops.npu.npu_rotary_mul(x, r1, r2, rotary_mode)`: out = x*r1 + rotate(x)*r2, rotate = cat(-x2, x1)
  for 'half' (NeoX pairs) or interleaved stack(-x_odd, x_even) for 'interleave'; 4-D x, tables of the full
  width (one entry per lane) that broadcast against x. A q/k pair is two calls, q/k/v three.
- `torch.ops.npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout, rotary_mode)`: q and k in one call, for
  the cases its documentation allows: layout BSND (4-D) or TND (3-D), rotary_mode 'half', head dim 64 or
  128 and fully rotated, q, k, tables and output of one dtype, inference (it has no backward: it is only
  reached through these ops, which the pass emits into post-grad graphs, after autograd). It writes q and k
  in place, so it gets fresh copies.

How a site maps onto them:
- tables get the full width the NPU ops expect: half tables (one entry per pair) are duplicated along the
  lane dim, `[c, c]` for 'half' and `c0 c0 c1 c1 ...` for 'interleave' (a copy of the table only, never of
  anything the size of x); leading dims are padded with views (`t[None, ...]`), never expanded over heads.
- partial rotary (rotary_dim < head dim): the head slice is rotated and the tail is concatenated unchanged.
- conjugate (rotation by minus the angle): sin is negated.
- dtypes: the op computes in the inputs' dtype; when x and tables differ (bf16 x, fp32 tables) both go to
  the promoted dtype, and the result is cast once to out_dtype.
- a case the documented layout constraints exclude (x of more than 4 dims, table broadcast patterns the op
  does not list, B or N >= 1000, head dim >= 896, ...) runs the reference composite (plain aten ops, which
  run on the NPU too): correct, unfused.

torch_npu cannot be imported without the CANN runtime, so nothing here imports it: the ops are looked up in
the namespace `OP_NAMESPACE` ("npu", where torch_npu registers them) when called. Tests set it to a
namespace of stand-in ops with the same schemas and the documented semantics and check the bridge on CPU.
This path is verified against the documented semantics of the torch_npu ops, not on Ascend hardware.
"""

from __future__ import annotations

import collections
import logging

import torch

from ..ops.backends import Backend, SiteSpec, emit_op_call, register_backend
from ..ops.op_definition import define_rotary_ops
from ..ops.reference import gather_rows, rms_norm, rotary_reference
from ..ops.schema import ROTATION_FIELDS, RotaryCall

log = logging.getLogger("rope_fusion")

OP_NAMESPACE = "npu"
"""Where `npu_rotary_mul` / `npu_apply_rotary_pos_emb` are looked up (torch.ops.<namespace>.<op>)."""

NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
APPLY_HEAD_DIMS = (64, 128)  # npu_apply_rotary_pos_emb's documented head dims
MAX_HEAD_DIM = 896  # npu_rotary_mul: D < 896 and even
MAX_BN = 1000  # npu_rotary_mul: B, N < 1000 ('half'), B * N < 1000 ('interleave')

# Dims of B, N, S in a 4-D x, per layout, in the order tried.
_LAYOUTS = {"BSND": (0, 2, 1), "BNSD": (0, 1, 2), "SBND": (1, 2, 0)}
# Which of B, N, S a table may carry (the others must be 1), from npu_rotary_mul's constraints:
# 'half': 11SD / B1SD / BNSD for BNSD x (likewise 1S1D / BS1D / BSND, S11D / SB1D / SBND); 'interleave': S only.
_TABLE_DIMS = {False: ({"S"}, {"B", "S"}, {"B", "N", "S"}), True: ({"S"},)}

stats: collections.Counter = collections.Counter()
"""How many calls took each path: 'rotary_mul', 'apply_rotary_pos_emb', 'reference' (for tests and debugging)."""


def _ops():
    return getattr(torch.ops, OP_NAMESPACE)


def full_width(t: torch.Tensor, rotary_dim: int, interleaved: bool, full_tables: bool) -> torch.Tensor:
    """The table with one entry per lane (width rotary_dim), as npu_rotary_mul reads it."""
    if full_tables:
        return t
    half = t.shape[-1]
    if interleaved:  # c0 c0 c1 c1 ...
        return t.unsqueeze(-1).expand(*t.shape, 2).reshape(*t.shape[:-1], 2 * half)
    return t.unsqueeze(-2).expand(*t.shape[:-1], 2, half).reshape(*t.shape[:-1], 2 * half)  # [c, c]


def _pad(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A view of t with leading dims of size 1 up to ndim dims."""
    return t[(None,) * (ndim - t.dim())] if t.dim() < ndim else t


def rotary_mul_layout(x_shape: tuple, t_shape: tuple, interleaved: bool) -> str | None:
    """The layout under which npu_rotary_mul documents support for a 4-D x and table, or None."""
    if len(x_shape) != 4 or len(t_shape) != 4:
        return None
    d = x_shape[-1]
    if d % 2 or d >= MAX_HEAD_DIM or t_shape[-1] != d:
        return None
    for name, (b, n, s) in _LAYOUTS.items():
        dims = tuple(zip("BNS", (b, n, s)))
        if not any(all(t_shape[i] == (x_shape[i] if letter in allowed else 1) for letter, i in dims)
                   for allowed in _TABLE_DIMS[interleaved]):
            continue
        bb, nn, ss = x_shape[b], x_shape[n], x_shape[s]
        if interleaved and bb * nn >= MAX_BN:
            continue
        if not interleaved and (bb >= MAX_BN or nn >= MAX_BN):
            continue
        if name == "BNSD" and bb * nn > 8 * ss:  # documented as unsupported for BNSD
            continue
        return name
    return None


def compute_dtype(x: torch.Tensor, t: torch.Tensor) -> torch.dtype | None:
    """The dtype npu_rotary_mul computes x and table t in (their promotion), or None where the NPU ops take no
    such dtype; the eager bridge and the graph form (npu_graph.py) both cast to it."""
    cd = x.dtype if x.dtype == t.dtype else torch.promote_types(x.dtype, t.dtype)
    return cd if cd in NPU_DTYPES else None


def rotary_via_rotary_mul(x, cos, sin, *, interleaved, rotary_dim, full_tables, conjugate, out_dtype):
    """One tensor through npu_rotary_mul; None when the documented constraints exclude the case."""
    if x.dim() > 4:
        return None
    cd = compute_dtype(x, cos)
    if cd is None or sin.dtype != cos.dtype:
        return None
    xr = x[..., :rotary_dim] if rotary_dim < x.shape[-1] else x
    c = full_width(cos, rotary_dim, interleaved, full_tables)
    s = full_width(sin, rotary_dim, interleaved, full_tables)
    if conjugate:
        s = -s
    x4, c4, s4 = _pad(xr, 4), _pad(c, 4), _pad(s, 4)
    if c4.dim() != 4 or rotary_mul_layout(tuple(x4.shape), tuple(c4.shape), interleaved) is None:
        return None
    x4 = x4.to(cd).contiguous()
    c4, s4 = c4.to(cd), s4.to(cd)
    mode = "interleave" if interleaved else "half"
    rot = _ops().npu_rotary_mul(x4, c4, s4, mode)
    stats["rotary_mul"] += 1
    rot = rot.reshape(xr.shape).to(out_dtype)
    if rotary_dim < x.shape[-1]:
        rot = torch.cat((rot, x[..., rotary_dim:].to(out_dtype)), dim=-1)
    return rot


def apply_layout(q, k, cos, sin, *, interleaved, rotary_dim, full_tables, out_dtype) -> str | None:
    """'BSND' or 'TND' where npu_apply_rotary_pos_emb's documented constraints hold, else None."""
    if interleaved or rotary_dim != q.shape[-1] or q.shape[-1] not in APPLY_HEAD_DIMS:
        return None
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype == out_dtype) or q.dtype not in NPU_DTYPES:
        return None
    if q.dim() != k.dim() or q.shape[-1] != k.shape[-1]:
        return None
    t_shape = tuple(_pad(cos, q.dim()).shape[:-1])
    if len(t_shape) != q.dim() - 1:
        return None
    if q.dim() == 4:  # BSND: tables [B|1, S|1, 1, D]
        if q.shape[:2] != k.shape[:2] or t_shape[2] != 1:
            return None
        return "BSND"
    if q.dim() == 3:  # TND: tables [T|1, 1, D]
        if q.shape[0] != k.shape[0] or t_shape[1] != 1:
            return None
        return "TND"
    return None


def rotary_qk_via_apply(q, k, cos, sin, *, layout, full_tables, conjugate):
    """q and k through npu_apply_rotary_pos_emb (in place on fresh copies)."""
    d = q.shape[-1]
    c = full_width(cos, d, False, full_tables)
    s = full_width(sin, d, False, full_tables)
    if conjugate:
        s = -s
    c, s = _pad(c, q.dim()), _pad(s, q.dim())
    table_shape = (*q.shape[:2], 1, d) if layout == "BSND" else (q.shape[0], 1, d)
    c = c.expand(table_shape).contiguous()
    s = s.expand(table_shape).contiguous()
    qo = q.clone(memory_format=torch.contiguous_format)
    ko = k.clone(memory_format=torch.contiguous_format)
    qo, ko = _ops().npu_apply_rotary_pos_emb(qo, ko, c, s, layout, "half")
    stats["apply_rotary_pos_emb"] += 1
    return qo, ko


# -- the ops the pass emits ------------------------------------------------------------------------------

# The parameters `_impl` handles: the rotation's, and the transforms it applies around the ops or refuses.
BRIDGE_FIELDS = (*ROTATION_FIELDS, "norm", "norm_eps", "deinterleave", "rotary_blocks", "rotary_offset",
                 "angle_tables", "offset_q_only")


def _impl(call: RotaryCall) -> list | None:
    """q and k through one npu_apply_rotary_pos_emb where allowed, else npu_rotary_mul per tensor; None (the
    reference) for a tensor whose case the documented constraints exclude. Cache rows picked by positions
    are gathered first and a norm prologue runs first (the NPU ops take plain tables and x); a pass-through
    head is split off and put back (the NPU ops rotate from lane 0; with offset_q_only, q's alone)."""
    xs, cos, sin, params = call.xs, call.cos, call.sin, call.params
    unknown = params.unhandled(BRIDGE_FIELDS)
    if unknown:  # a parameter this bridge does not know: the reference serves, nothing is dropped
        _fallback(f"the parameter(s) {unknown}", "the torch_npu bridge does not handle them")
        return None
    if params.deinterleave or params.rotary_blocks > 1:  # pairs the NPU ops do not know: the reference serves
        _fallback("a de-interleaved (NeoX-ordered) result of interleaved pairs" if params.deinterleave else
                  "NeoX pairs within rotary_blocks", "no torch_npu RoPE op has this pairing")
        return None
    if call.positions is not None:  # checked: a position outside [0, rows) raises, as the other backends do
        cos, sin = gather_rows(cos, call.positions), gather_rows(sin, call.positions)
    if params.angle_tables:  # the NPU ops take tables: computed here, in fp32
        cos, sin = cos.float().cos(), sin.float().sin()
        params = params.replace(angle_tables=False)
    if params.norm != "none":
        xs = [rms_norm(x.float(), params.norm, params.norm_eps, call.weight(i)).to(x.dtype)
              for i, x in enumerate(xs)]
    offs = [params.of_tensor(i).rotary_offset for i in range(len(xs))]
    if any(offs):
        heads = [x[..., :off].to(params.out_dtype) for x, off in zip(xs, offs)]
        outs = _rotated(RotaryCall([x[..., off:] for x, off in zip(xs, offs)], cos, sin,
                                   params.replace(rotary_offset=0, offset_q_only=False)))
        return [torch.cat((h, o), -1) if off else o for h, o, off in zip(heads, outs, offs)]
    return _rotated(RotaryCall(xs, cos, sin, params))


def _rotated(call: RotaryCall) -> list:
    """The rotation of a call without positions, norm or pass-through head, through the NPU ops."""
    xs, cos, sin, params = call.xs, call.cos, call.sin, call.params
    kw = params.rotation_kwargs()  # `_impl` took the norm, the head, the gather and angle tables off
    if len(xs) == 2:
        layout = apply_layout(*xs, cos, sin, interleaved=params.interleaved, rotary_dim=params.rotary_dim,
                              full_tables=params.full_tables, out_dtype=params.out_dtype)
        if layout is not None:
            return list(rotary_qk_via_apply(*xs, cos, sin, layout=layout, full_tables=params.full_tables,
                                            conjugate=params.conjugate))
    outs = [rotary_via_rotary_mul(x, cos, sin, **kw) for x in xs]
    if any(o is None for o in outs):
        stats["reference"] += sum(o is None for o in outs)
        x = next(x for o, x in zip(outs, xs) if o is None)
        _fallback("this layout or dtype", f"x {tuple(x.shape)} {x.dtype}, tables {tuple(cos.shape)} {cos.dtype}: "
                  "npu_rotary_mul documents 4-D x, fp16/bf16/fp32, D even < 896, B and N < 1000 and its table "
                  "broadcasts")
        outs = [o if o is not None else rotary_reference(x, cos, sin, **kw).contiguous() for o, x in zip(outs, xs)]
    return outs


_LOGGED: set = set()


def _fallback(what: str, why: str) -> None:
    """One log line per kind of case that torch_npu's ops cannot take (the reference runs it, correct, unfused)."""
    if what not in _LOGGED:
        _LOGGED.add(what)
        log.warning("rope_fusion: torch_npu's RoPE ops cannot take %s (%s); the reference runs it (logged once)",
                    what, why)


NPU_OPS = define_rotary_ops("_npu", _impl)  # by arity - 1
ROTARY_NPU, ROTARY_QK_NPU, ROTARY_QKV_NPU = NPU_OPS


def supports(spec: SiteSpec) -> str | None:
    """Sites on an NPU device in fp16/bf16/fp32 with x of at most 4 dims (others fall back to inductor)."""
    if spec.device_type != "npu":
        return f"runs on Ascend NPU devices, the site is on {spec.device_type}"
    dtypes = (spec.x_dtype, spec.table_dtype, spec.params.out_dtype)
    if not all(d in NPU_DTYPES for d in dtypes):
        return f"dtypes {dtypes} not among {NPU_DTYPES}"
    if any(len(s) > 4 for s in spec.x_shapes):
        return "x has more than 4 dims"
    if spec.params.deinterleave:
        return "the NPU ops cannot write a de-interleaved (NeoX-ordered) result of interleaved pairs"
    if spec.params.rotary_blocks > 1:
        return "the NPU ops pair NeoX lanes across the whole rotary dim, not within blocks"
    return None


register_backend(Backend("npu", supports, lambda em, call, like: emit_op_call(NPU_OPS, em, call, like)))
if torch._C._get_privateuse1_backend_name() == "npu":  # torch_npu is loaded: serve direct calls of the op too
    from ..ops.device_runners import ROTARY_KERNELS

    ROTARY_KERNELS.register("npu", _impl)

from . import npu_kv_cache  # noqa: E402,F401  (the KV-cache op's torch_npu ops register with the backend)

__all__ = ["BRIDGE_FIELDS", "OP_NAMESPACE", "NPU_OPS", "ROTARY_NPU", "ROTARY_QK_NPU", "ROTARY_QKV_NPU", "supports",
           "full_width", "rotary_mul_layout", "apply_layout", "stats"]
