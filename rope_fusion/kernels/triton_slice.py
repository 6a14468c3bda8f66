"""The Triton kernel writing rotations into slices: the CUDA implementation of `rope_fusion::rotary_slice_`, which
rotates a slice in place, and `rope_fusion::rotary_into_`, which writes the rotation of another tensor into one,
with their arities (ops/slice_write.py).

The kernel takes an output pointer and strides per tensor, so the slice of the base is its own output: each
program loads a row tile (a head block, or a token's held heads) before it stores that tile, and no two programs
share a row, so reading x from the memory it writes is safe, and the rows outside the slice are never touched.
Where the plan is not one the kernel runs in a single pass over each row (a norm applied before the launch, more
token dims than the kernel merges, a de-interleaved output, lanes that are not contiguous) the rotation is computed
into fresh buffers and copied into the slice: correct, one copy more. Into another tensor's slice the same plans
run with the source as x and the slice as the output.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..ops.plan_cache import PlanCache
from ..ops.public_functions import tensor_geometry
from ..ops.schema import RotaryCall
from ..ops.slice_write import IN_PLACE_KERNELS, WrittenCall
from . import triton_launch
from .triton_plan import KERNEL_FIELDS, Tables, is_true, make_launches, per_lane

log = logging.getLogger("rope_fusion")

_PLANS = PlanCache("slice.kernel_runners")  # a call's geometry -> its `plan_in_place` runner (planned once)


def rotate_in_place(call: RotaryCall, views: list) -> bool:
    """Write the rotation of the call's xs into `views` (the xs themselves for the slice op: in place); False where
    the kernel cannot serve the call (the reference then runs). The calls the op's own plan cache does not keep
    come here (packed sequences, whose positions are derived per call, and keys that do not hash): their plans are
    kept here by geometry."""
    xs = call.xs
    if any(t.device.type != "cuda" for t in (*xs, *views, call.cos, call.sin)) and not triton_launch.INTERPRETED:
        return False
    if call.params.unhandled(KERNEL_FIELDS):
        return False
    if call.norm_weights:  # the kernel reads a weight's lanes with unit stride
        call = dataclasses.replace(call, norm_weights=[
            w if w is None or is_true(w.stride(-1) == 1) else w.contiguous() for w in call.norm_weights])
    try:
        key = (tuple(None if t is None else tensor_geometry(t) for t in (*xs, *views, call.cos, call.sin,
                                                                     call.positions, *(call.norm_weights or ()))),
               call.params)
        hash(key)
    except (TypeError, RuntimeError):  # symbolic sizes: plan every time
        key = None
    runner = _PLANS.get(key) if key is not None else None
    if runner is None:
        runner = _PLANS.put(key, plan_in_place(call, views))
    if runner is None:  # not one pass over each row: into fresh buffers, then copied into the slices
        outs = triton_launch.launch(list(xs), call.cos, call.sin, call.params, call.positions, call.norm_weights)
        for view, out in zip(views, outs):
            view.copy_(out)
        return True
    runner(xs, call.cos, call.sin, call.positions, call.norm_weights, views)
    return True


class _InPlaceLaunches(triton_launch.DirectLaunches):
    """The direct path's replayed launches (`triton_launch.DirectLaunches`: the compiled kernel through torch's
    static launcher after its first use is checked) with the given views as outputs (None: each x its own output,
    the slice rotated in place). Launches planned in place (`in_place`) may leave the lanes outside the rotation
    unread and unwritten, so they take no views."""

    _views: list | None = None
    in_place = False

    def __call__(self, xs: list, cos: torch.Tensor, sin: torch.Tensor, positions: Any, weights: Any,
                 views: list | None = None) -> list:
        if self.in_place and views is not None:
            raise ValueError("launches planned to rotate their xs in place were given other outputs")
        self._views = list(xs) if views is None else list(views)
        try:
            return super().__call__(xs, cos, sin, positions, weights)
        finally:
            self._views = None

    def _outputs(self, xs: list) -> list:
        return self._views

    @staticmethod
    def _checked(runner: Any, args: tuple, sides: list, outs: list, grid: tuple, meta: dict) -> Any:
        """The compiled launcher where it writes what the JIT launcher writes: the JIT launcher's result first, into
        fresh buffers from x as it is, then the launcher in place; on a failure or a difference, the JIT result.
        The fresh buffers take the views' strides (the plan's scalars hold them): `empty_like` of a slice that is
        not dense would be contiguous, and the launch would write past it. They start as the views' values, which a
        launch in place leaves in the lanes outside the rotation."""
        mine = {i: torch.empty_strided(outs[i].shape, outs[i].stride(), dtype=outs[i].dtype,
                                       device=outs[i].device).copy_(outs[i]) for i in sides}
        triton_launch.rotary_kernel[grid](*args[:3], *(mine[i] for i in sides), *args[6:], **meta)
        try:
            runner(*args)
        except Exception as e:  # a launcher API of another Triton version: the JIT launcher stays
            log.info("rope_fusion: Triton's compiled-kernel launcher failed (%s); the JIT launcher stays", e)
            runner = None
        if runner is not None and all(torch.equal(outs[i].view(torch.uint8), m.view(torch.uint8))
                                      for i, m in mine.items()):
            return runner
        if runner is not None:
            log.warning("rope_fusion: Triton's compiled-kernel launcher wrote other values than its JIT launcher; "
                        "the JIT launcher stays")
        for i, m in mine.items():
            outs[i].copy_(m)
        return None


def plan_in_place(call: RotaryCall, views: list | None = None) -> Any:
    """The runner of a geometry that the kernel writes into `views` (None: the call's xs, in place) in one pass
    over each row (`rotate_in_place`'s rule), its launches planned once for every later call of that geometry;
    None for any other (the call then goes to `rotate_in_place` each time). In place, the lanes outside the
    rotation are not moved where no norm rescales them (`triton_plan.row_lanes`)."""
    xs, params = call.xs, call.params
    in_place = views is None
    views = xs if views is None else views
    if any(t.device.type != "cuda" for t in (*xs, *views, call.cos, call.sin)) and not triton_launch.INTERPRETED:
        return None
    if params.unhandled(KERNEL_FIELDS) or params.deinterleave or _is_empty(views):
        return None
    weights = list(call.norm_weights) if call.norm_weights else [None] * len(views)
    if not all(is_true(t.stride(-1) == 1) for t in (*xs, *views)) or any(
            w is not None and not (per_lane(w, v) and is_true(w.stride(-1) == 1)) for w, v in zip(weights, views)):
        return None
    launches = make_launches(list(xs), list(views), Tables(call.cos, call.sin, call.positions, weights), params,
                             in_place=in_place)
    if not isinstance(launches, list):
        return None
    runner = _InPlaceLaunches(launches, params.out_dtype, triton_launch.row_checks(call.positions))
    runner.in_place = in_place
    return runner


def warm_in_place(call: RotaryCall, views: list | None = None) -> int:
    """The launches `plan_in_place` plans for a call given as fake values, compiled in the background
    (`triton_warmup`); returns how many."""
    runner = plan_in_place(call, views)
    if runner is None:
        return 0
    outs = call.xs if views is None else views
    return runner.warm(call.xs, outs, call.cos, call.sin, call.positions, call.norm_weights)


def launch_at_offsets(runner: _InPlaceLaunches, xs: list, bases: list, views: list, cos: torch.Tensor,
                      sin: torch.Tensor, positions: Any, weights: Any) -> None:
    """The planned launches of `runner` (`plan_in_place` of the call on its slices) with each output passed as its
    base whole and the slice's offset in it (the kernel's qo_off, ko_off, vo_off), through `kernel_for` (traced:
    the user-kernel node). A base, not a view of it, is what Inductor's reinplacing writes in place: a node that
    writes a view of a fresh buffer is left as a clone of the view and a `slice_scatter` back (two copies)."""
    pos = positions if positions is not None else cos  # unused pointers stand in for absent tensors, as `launch`'s
    weights = weights or [None] * len(xs)
    kernel = triton_launch.kernel_for(xs)
    for sides, grid, scalars, meta, *_ in runner.entries:
        tensors = runner._tensors(sides, xs, bases, cos, sin, pos, weights)
        offsets = {f"{s}o_off": views[i].storage_offset() - bases[i].storage_offset() for s, i in zip("qkv", sides)}
        kernel[grid](*tensors, *scalars, **{**meta, **offsets})


def emit_node(graph: Any, fake_mode: Any, written: WrittenCall, like: Any) -> list | None:
    """A slice or into call on graph nodes (`WrittenCall`) as Inductor's own user-kernel node, inserted at the
    graph's insertion point: `launch_at_offsets` traced on the fake values, each base whole and its slice's offset
    a kernel argument, so that Inductor's reinplacing writes each base in place (a fresh join, a base nothing reads
    afterwards) and its workers compile the kernel with the rest of the graph. Returns the written bases; None
    where a size, stride or bound is symbolic, the call is not one pass over each row (`plan_in_place`), or the
    launch is not one node per planned launch (the pass then emits the op)."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation

    from .triton_graph import replay_traced, trace_host

    call, n = written.call, len(written.bases)
    if call.cu_seqlens is not None or not all(isinstance(v, int) for b in written.bounds for v in b):
        return None
    tables = [call.cos, call.sin, call.positions, *(call.norm_weights or [None] * n)]
    sources = [*written.bases, *(call.xs if written.into else ()), *tables]
    slots = [i for i, t in enumerate(sources) if t is not None]
    inputs = [sources[i] for i in slots]
    vals = [node.meta["val"] for node in inputs]
    if not all(isinstance(s, int) for v in vals for s in (*v.shape, *v.stride(), v.storage_offset())):
        return None
    launches = []

    def host(*args: Any) -> tuple:
        full = [None] * len(sources)
        for slot, a in zip(slots, args):
            full[slot] = a
        bases = full[:n]
        views = written.views(bases)
        xs = full[n:2 * n] if written.into else views
        cos, sin, positions, *weights = full[2 * n:] if written.into else full[n:]
        rot = dataclasses.replace(call, xs=xs, cos=cos, sin=sin, positions=positions,
                                  norm_weights=weights if call.norm_weights is not None else None)
        runner = plan_in_place(rot, views if written.into else None)
        if runner is None:
            raise _NotPlanned
        launches.extend(runner.entries)
        launch_at_offsets(runner, xs, bases, views, cos, sin, positions, rot.norm_weights)
        return tuple(bases)

    try:
        gm = trace_host(host, vals, fake_mode)
    except _NotPlanned:
        return None
    if sum(node.target is triton_kernel_wrapper_mutation for node in gm.graph.nodes) != len(launches):
        return None
    return replay_traced(graph, fake_mode, gm, inputs, like)


class _NotPlanned(Exception):
    """`plan_in_place` declined the traced call: not one pass over each row (a norm applied first, more token dims
    than the kernel merges, lanes with a stride), which the op serves through fresh buffers and a copy."""


def _is_empty(views: list) -> bool:
    return any(is_true(v.numel() == 0) for v in views)


def _serve(call: RotaryCall, views: list) -> bool:
    if _is_empty(views):
        return True
    return rotate_in_place(call, views)


IN_PLACE_KERNELS.register("cuda", _serve, plan=plan_in_place, warm=warm_in_place, node=emit_node)
