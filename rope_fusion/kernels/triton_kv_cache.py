"""The Triton kernel writing the KV cache in the launch that rotates q and k: the CUDA implementation of
`rope_fusion::rotary_qk_kv_cache` and `rotary_qk_mla_cache` (ops/kv_cache.py).

The kernel's KV_CACHE form (kernels/triton_kernel.py) is an epilogue of its q/k launch: each program rotates its
token's q rows into q's output as usual, stores k's rotated rows into the rows of the token's cache slot instead of
an output (quantised to FP8 where the cache is), and copies v's rows into the v cache's slot; v's head blocks are
work items after q's and k's, shared out over the token's programs like theirs. So one launch moves what the unfused
pair moves less k's write and read between the two (and one launch's latency, most of a decode step's cost).

A call's geometry is checked and planned once (`plan_cache_launch`): later calls of it cost their key, q's output and
the launch through the kernel's JIT launcher. Where the kernel does not take a call (a layout that is not a stride
per axis, a norm its loop cannot apply, lanes with a stride, ...) `launch_cache` returns None, the reason is logged
once, and the reference runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from ..ops.kv_cache import FP8_CACHE_DTYPES, CacheCall, cache_geometry
from ..ops.kv_cache_op import CACHE_KERNELS
from ..ops.plan_cache import PlanCache
from ..ops.public_functions import tensor_geometry
from . import triton_launch
from .triton_plan import (
    INT32_MAX,
    KERNEL_FIELDS,
    TILE_ELEMENTS,
    Tables,
    is_true,
    launch_args,
    norm_fits,
    per_lane,
    plan_launch,
)

log = logging.getLogger("rope_fusion")


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class CacheLaunch:
    """One launch of the KV_CACHE form: grid, the scalar arguments, the constexprs with the cache's fixed scalars
    (strides, sizes) and the compile options; the call's tensors are passed per call."""

    grid: tuple
    scalars: tuple
    meta: dict
    checks: dict
    out_dtype: torch.dtype


def _lanes_contiguous(t: torch.Tensor | None) -> bool:
    return t is None or t.shape[-1] <= 1 or is_true(t.stride(-1) == 1)


def _v_tile(heads: int, dim: int) -> tuple[int, int]:
    """(lanes a v row pads to, v heads a block): a tile of up to TILE_ELEMENTS, as the rotation's own blocks."""
    pad = _next_power_of_2(dim)
    return pad, max(1, min(_next_power_of_2(heads), TILE_ELEMENTS // pad))


def why_not(cc: CacheCall) -> str | None:
    """Why the kernel cannot write this call in one launch, or None."""
    call, params = cc.call, cc.call.params
    if params.unhandled(KERNEL_FIELDS):
        return f"the kernel does not take {', '.join(params.unhandled(KERNEL_FIELDS))}"
    if cc.layout.strides(cc.k_cache) is None:
        return f"the {cc.layout.name} layout is not a stride per axis"
    weights = call.norm_weights or [None, None]
    tensors = (cc.q, cc.k, cc.v, cc.k_cache, cc.v_cache, cc.v_norm_weight, *weights)
    if not all(_lanes_contiguous(t) for t in tensors):
        return "a tensor's lanes are not contiguous"
    if params.norm != "none" and any(w is not None and not per_lane(w, x) for w, x in zip(weights, call.xs)):
        return "the norm weight varies over more than the heads and lanes"
    if params.offset_q_only and params.norm != "none":
        return "q's pass-through head under a norm takes a launch per tensor"
    if any(is_true(t.numel() == 0) for t in (cc.q, cc.k, cc.v)):
        return "an empty tensor"
    return None


def plan_cache_launch(cc: CacheCall) -> CacheLaunch | str:
    """The one launch of a call, or why the kernel cannot make it."""
    reason = why_not(cc)
    if reason is not None:
        return reason
    call, params = cc.call, cc.call.params
    q, k, v = cc.q, cc.k, cc.v
    weights = list(call.norm_weights or [None, None])
    q_out = torch.empty(q.shape, dtype=params.out_dtype, device=q.device)
    tables = Tables(call.cos, call.sin, call.positions, weights, call.cu_seqlens, call.seqlen_offsets)
    p = plan_launch([q, k], [q_out, k], tables)
    if p is None or not (p.head == 1 or p.head is None and q.shape[1] == k.shape[1] == 1):
        return "the tables vary over the heads: the kernel's tokens would not be x's first dim"
    if not norm_fits(p, [q, k], weights, params):
        return "the norm's rows are not the rows the kernel loops over"
    v_pad, block_v = _v_tile(v.shape[1], v.shape[2])
    grid, scalars, meta = launch_args(p, [q, k], [q_out, k], tables, [0, 1], params,
                                      copy_blocks=-(-v.shape[1] // block_v))
    meta.update(_cache_meta(cc, v_pad, block_v))
    if not meta["HEAD_I64"] and -(-k.shape[1] // meta["BLOCK_H"]) * meta["BLOCK_H"] * abs(
            meta["kc_stride_head"]) > INT32_MAX:
        meta["HEAD_I64"] = True  # k's head offsets in the cache need 64 bits
    return CacheLaunch(grid, scalars, meta, triton_launch.row_checks(cc.slot_mapping), params.out_dtype)


def _cache_meta(cc: CacheCall, v_pad: int, block_v: int) -> dict:
    """The KV_CACHE form's constexprs and the scalars a geometry fixes: the caches' strides and sizes."""
    blocks, block_size, _, _ = cache_geometry(cc, cc.k_cache, cc.k)
    kb, ks, kh, _ = cc.layout.strides(cc.k_cache)
    vb, vs, vh, _ = cc.layout.strides(cc.v_cache)
    w = cc.v_norm_weight
    return dict(KV_CACHE=True, n_slots=cc.slot_mapping.shape[0], block_size=block_size, kv_capacity=blocks * block_size,
                kc_stride_block=kb, kc_stride_slot=ks, kc_stride_head=kh, vc_stride_block=vb, vc_stride_slot=vs,
                vc_stride_head=vh, vsrc_stride_token=cc.v.stride(0), vsrc_stride_head=cc.v.stride(1),
                vsrc_heads=cc.v.shape[1], wvn_stride_head=0 if w is None else w.expand(cc.v.shape[1:]).stride(0),
                KC_FP8=cc.k_cache.dtype in FP8_CACHE_DTYPES, VC_FP8=cc.v_cache.dtype in FP8_CACHE_DTYPES,
                V_DIM=cc.v.shape[2], V_PAD=v_pad, BLOCK_V=block_v, V_NORM=w is not None, V_W=w is not None)


# the KV_CACHE form's tensor parameters, passed per call (after the constexprs)
CACHE_POINTERS = ("slot_ptr", "kc_ptr", "vc_ptr", "vsrc_ptr", "k_scale_ptr", "v_scale_ptr", "wvn_ptr")


def cache_tensors(cc: CacheCall) -> dict:
    """The call's tensors of the KV_CACHE form, by parameter (an unused one stands in as the slot mapping)."""
    s = cc.slot_mapping
    fp8 = (cc.k_cache.dtype in FP8_CACHE_DTYPES, cc.v_cache.dtype in FP8_CACHE_DTYPES)
    scales = [sc if sc is not None else _ONE.get(s.device) for sc, on in zip((cc.k_scale, cc.v_scale), fp8)]
    return dict(slot_ptr=s, kc_ptr=cc.k_cache, vc_ptr=cc.v_cache, vsrc_ptr=cc.v,
                k_scale_ptr=scales[0] if fp8[0] else s, v_scale_ptr=scales[1] if fp8[1] else s,
                wvn_ptr=cc.v_norm_weight if cc.v_norm_weight is not None else s)


class _Ones(dict):
    """A float32 1.0 per device: the scale of an FP8 cache given none."""

    def get(self, device: torch.device) -> torch.Tensor:  # type: ignore[override]
        one = super().get(device)
        if one is None:
            one = self[device] = torch.ones(1, dtype=torch.float32, device=device)
        return one


_ONE = _Ones()


def launch_planned(plan: CacheLaunch, cc: CacheCall, kernel: Any = None) -> torch.Tensor:
    """Run a planned launch on a call of its geometry: q's output allocated, the caches written."""
    call = cc.call
    q, k = cc.q, cc.k
    q_out = torch.empty_like(q, dtype=plan.out_dtype, memory_format=torch.contiguous_format)
    cos = call.cos
    pos = call.positions if call.positions is not None else call.cu_seqlens if call.cu_seqlens is not None else cos
    weights = call.norm_weights or [None, None]
    ws = [w if w is not None else cos for w in (*weights, weights[1])]
    packed = {"off_ptr": call.seqlen_offsets} if call.cu_seqlens is not None else {}
    fn = kernel if kernel is not None else triton_launch.rotary_kernel  # read per call: the tests interpret it
    fn[plan.grid](q, k, k, q_out, k, k, cos, call.sin, pos, *ws, *plan.scalars,
                  **{**plan.meta, **packed, **cache_tensors(cc)}, **plan.checks)
    return q_out


_PLANS = PlanCache("kv_cache.launches")  # a call's geometry -> its CacheLaunch, or why the kernel does not take it
_LOGGED: set = set()


def _key(cc: CacheCall) -> tuple | None:
    call = cc.call
    tensors = (*call.xs, cc.v, call.cos, call.sin, call.positions, *(call.norm_weights or ()), call.cu_seqlens,
               call.seqlen_offsets, cc.k_cache, cc.v_cache, cc.slot_mapping, cc.k_scale, cc.v_scale, cc.v_norm_weight)
    try:
        key = (tuple(None if t is None else tensor_geometry(t) for t in tensors), call.params, cc.layout.name)
        hash(key)
    except (TypeError, RuntimeError):  # a tensor without storage, symbolic sizes
        return None
    return key


def _planned(cc: CacheCall) -> CacheLaunch | str | None:
    """The call geometry's launch, planned once (`_PLANS`), or why the kernel does not take it; None where the tensors
    are not on a device the kernel serves (CUDA/ROCm, any device under the interpreter)."""
    tensors = (cc.q, cc.k, cc.v, cc.call.cos, cc.call.sin, cc.k_cache, cc.v_cache, cc.slot_mapping)
    if not triton_launch.INTERPRETED and any(t.device.type != "cuda" for t in tensors):
        return None
    key = _key(cc)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _PLANS.put(key, plan_cache_launch(cc))
    return plan


def launch_cache(cc: CacheCall) -> torch.Tensor | None:
    """q rotated, the caches written; None where the kernel does not take the call (the reference then runs; the
    reason is logged once per kind)."""
    plan = _planned(cc)
    if isinstance(plan, str):
        if plan not in _LOGGED:
            _LOGGED.add(plan)
            log.warning("rope_fusion: the KV-cache kernel does not take this call (%s); the reference runs it (logged "
                        "once)", plan)
        return None
    return launch_planned(plan, cc) if plan is not None else None


def plan_runner(cc: CacheCall) -> Any:
    """The runner of every later call of cc's key (the op keys its calls itself: `ops/kv_cache_op.py`): its planned
    launch, or None where the kernel does not take the geometry (`launch_cache` then says why, once) or the
    tensors are on another device."""
    plan = _planned(cc)
    return functools.partial(launch_planned, plan) if isinstance(plan, CacheLaunch) else None


CACHE_KERNELS.register("cuda", launch_cache, plan=plan_runner)
