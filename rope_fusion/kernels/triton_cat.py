"""The Triton kernel reading a joined x from its pieces: the CUDA implementation of `rope_fusion::rotary_cat` and
`rotary_qk_cat` (ops/cat_rotary.py).

The kernel's CAT form (kernels/triton_kernel.py) takes per tensor a second pointer with strides of its own, a
second norm weight, and the index along the join's dim from which a token's rows are the second piece's: each
program rotates one token, so it picks its piece once and reads only that piece's rows, and the output is written
joined. The planner keeps the join's dim a token dim of its own (`plan_launch`'s cat), so a token's index there is
known in every program. `why_not` says where a call is not one the kernel serves; the pass asks it on the graph's
fake values before it folds a cat, so the eager fallback (the reference) is only a direct call's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..ops.cat_rotary import CatCall, register_cat_kernel
from . import triton_launch
from .triton_plan import KERNEL_FIELDS, Tables, heads_fit_int32, is_true, launch_args, norm_fits, per_lane, plan_launch

_PLANS: dict = {}  # the pieces' geometry, tables and params -> the planned launch (the plan once, not per call)


@dataclasses.dataclass
class CatLaunch:
    """One launch of the CAT form: grid, scalar arguments, compile-time constants with the CAT scalars."""

    grid: tuple
    scalars: tuple
    meta: dict


def _lanes_contiguous(t: torch.Tensor) -> bool:
    return t.shape[-1] <= 1 or is_true(t.stride(-1) == 1)


def plan_cat(cat: CatCall, outs: list) -> CatLaunch | str:
    """The one launch of a call (pieces with lane-contiguous rows, as `launch_cat` passes them), or why the kernel
    cannot take it."""
    call, params = cat.call, cat.call.params
    n = len(cat.firsts)
    if params.unhandled(KERNEL_FIELDS):
        return f"the kernel does not take {', '.join(params.unhandled(KERNEL_FIELDS))}"
    if len(set(cat.dims)) != 1:
        return f"q and k join along different dims {cat.dims}"
    splits = {x.shape[cat.dims[0]] for x in cat.firsts}
    if len(splits) != 1 or not isinstance(next(iter(splits)), int):
        return "the first pieces of q and k differ in length along the join (one split a launch)"
    weights = list(call.norm_weights) if call.norm_weights else [None] * n
    seconds_w = list(cat.second_weights)
    if params.norm != "none" and any(w is not None and not per_lane(w, o) for w, o in zip(weights, outs)):
        return "the norm weight varies over more than the heads and lanes"
    if any(w is not None and w2 is not None and w.stride() != w2.stride() for w, w2 in zip(weights, seconds_w)):
        return "the pieces' norm weights have different strides"
    tables = Tables(call.cos, call.sin, call.positions, weights)
    p = plan_launch(cat.firsts, outs, tables, cat=(cat.dims[0], cat.seconds))
    if p is None:
        return "the join's dim is not a token dim of the launch (it is the heads dim, or the tokens do not merge)"
    if not norm_fits(p, outs, weights, params):
        return "the norm's rows are not the rows the kernel loops over"
    grid, scalars, meta = launch_args(p, cat.firsts, outs, tables, list(range(n)), params)
    if meta["TOKS"] != 1:
        return "a tensor of one head takes several tokens a program, and the pieces one token a program"
    if not meta["HEAD_I64"] and not heads_fit_int32(dataclasses.replace(p, x_strides=p.cat_strides,
                                                                         o_strides=p.cat_strides),
                                                    meta["BLOCK_H"], (0, 0, 0)):
        return "a second piece's head offsets need 64 bits where the first's fit 32"
    strides = p.cat_strides + [p.cat_strides[-1]] * (2 - n)  # an absent k repeats q's (unused)
    axes = ("t0", "t1", "t2", "head")
    meta = dict(meta, CAT=True, CAT_SLOT=p.cat_slot, cat_split=next(iter(splits)),
                **{f"{s}2_stride_{a}": v for s, st in zip("qk", strides) for a, v in zip(axes, st)})
    return CatLaunch(grid, scalars, meta)


def why_not(cat: CatCall) -> str | None:
    """None where the kernel takes the call (fake tensors will do: the pass asks before it folds), else why not."""
    if any(not _lanes_contiguous(t) for t in (*cat.firsts, *cat.seconds)):
        return "a piece's lanes are not contiguous"
    if any(is_true(t.numel() == 0) for t in (*cat.firsts, *cat.seconds)):
        return "a piece is empty"
    outs = [x.new_empty(cat.joined_shape(i), dtype=cat.call.params.out_dtype) for i, x in enumerate(cat.firsts)]
    planned = plan_cat(cat, outs)
    return planned if isinstance(planned, str) else None


def launch_cat(cat: CatCall) -> list | None:
    """The rotated joined tensors of a call on CUDA/ROCm tensors (any device under the interpreter), or None where
    the kernel does not serve it (the reference then runs)."""
    call = cat.call
    tensors = (*cat.firsts, *cat.seconds, call.cos, call.sin)
    if any(t.device.type != "cuda" for t in tensors) and not triton_launch.INTERPRETED:
        return None
    n = len(cat.firsts)
    firsts = [x if _lanes_contiguous(x) else x.contiguous() for x in cat.firsts]
    seconds = [y if _lanes_contiguous(y) else y.contiguous() for y in cat.seconds]
    weights = [w if w is None or _lanes_contiguous(w) else w.contiguous()
               for w in (call.norm_weights or [None] * n)]
    seconds_w = [w if w is None or _lanes_contiguous(w) else w.contiguous() for w in cat.second_weights]
    cat = CatCall(dataclasses.replace(call, xs=firsts, norm_weights=weights), seconds, seconds_w, cat.dims)
    if any(t.numel() == 0 for t in (*firsts, *seconds)):
        return None
    outs = [torch.empty(cat.joined_shape(i), dtype=call.params.out_dtype, device=x.device)
            for i, x in enumerate(firsts)]
    geo = [(tuple(t.shape), t.stride(), t.dtype) for t in (*firsts, *seconds, *(w for w in seconds_w if w is not None))]
    key = (tuple(geo), tuple(cat.dims), Tables(call.cos, call.sin, call.positions, weights).key(), call.params)
    planned = _PLANS.get(key)
    if planned is None:
        planned = plan_cat(cat, outs)
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = planned
    if isinstance(planned, str):
        return None
    kernel = triton_launch.rotary_kernel  # read per call: the tests interpret the module's kernel
    pos = call.positions if call.positions is not None else call.cos  # unused pointers stand in for absent ones
    sides = [min(i, n - 1) for i in range(3)]
    ws = [weights[i] if weights[i] is not None else call.cos for i in sides]
    ws2 = [seconds_w[i] if seconds_w[i] is not None else call.cos for i in sides[:2]]
    kernel[planned.grid](*(firsts[i] for i in sides), *(outs[i] for i in sides), call.cos, call.sin, pos, *ws,
                         *planned.scalars, **{**planned.meta, "q2_ptr": seconds[0], "k2_ptr": seconds[sides[1]],
                                              "wq2_ptr": ws2[0], "wk2_ptr": ws2[1]},
                         **triton_launch.row_checks(call.positions))
    return outs


def _serve(cat: CatCall) -> Any:
    return launch_cat(cat)


register_cat_kernel("cuda", _serve, why_not)
