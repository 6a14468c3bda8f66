"""The Triton kernel reading a joined x from its pieces: the CUDA implementation of `rope_fusion::rotary_cat` and
`rotary_qk_cat` (ops/cat_rotary.py).

The kernel's CAT form (kernels/triton_kernel.py) takes per tensor a second pointer with strides of its own, a
second norm weight, and the index along the join's dim from which a token's rows are the second piece's: each
program rotates one token, so it picks its piece once and reads only that piece's rows, and the output is written
joined. The planner keeps the join's dim a token dim of its own (`plan_launch`'s cat), so a token's index there is
known in every program. `why_not` says where a call is not one the kernel serves; the pass asks it on the graph's
fake values before it folds a cat, so the eager fallback (the reference) is only a direct call's.

A call geometry is planned once into a `_CatRunner` (`plan_runner`, which the op's eager kernel asks once per call
key and then feeds from each call's own tensors: ops/cat_rotary.py; `launch_cat` for a caller with a parsed call):
its later calls cost their outputs and the replayed launch (the compiled kernel through torch's static launcher on
the GPU, every tensor of the call passed per call), where the JIT launcher binds and specialises some 90 arguments
in Python on every call. A compiled graph does not call the op: the pass emits the launch as Inductor's own
user-kernel node (`emit_node`), as it emits the main op's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..ops.cat_rotary import CAT_KERNELS, CatCall
from ..ops.plan_cache import PlanCache
from ..ops.public_functions import tensor_geometry
from . import triton_launch, triton_warmup
from .triton_plan import KERNEL_FIELDS, Tables, heads_fit_int32, is_true, launch_args, norm_fits, per_lane, plan_launch

log = logging.getLogger("rope_fusion")

_PLANS = PlanCache("cat.launches")  # `_launch`'s calls: the pieces' geometry, tables and params -> the planned launch


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
    the kernel does not serve it (the reference then runs). A call geometry (`_runner_key`) is checked and planned
    once: a later call of it costs its key, its outputs' allocation and the replayed launch (`_CatRunner`)."""
    key = _runner_key(cat)
    try:
        runner = _RUNNERS.get(key) if key is not None else None
    except TypeError:  # a value of the parameters that does not hash
        key = runner = None
    if runner is None:
        if not _on_kernel_devices(cat):  # not kept: the interpreter (the tests) may come and go
            return None
        if key is None:  # symbolic sizes, or a tensor without storage: planned on every call
            return _launch(cat)
        runner = _RUNNERS.put(key, _plan_runner(cat))
    if runner.__class__ is _CatRunner:
        if runner.host_only and not triton_launch.INTERPRETED:
            return None
        return runner(cat)
    if runner is _GENERAL:
        return _launch(cat) if _on_kernel_devices(cat) else None
    return None  # why the kernel does not take this geometry


_RUNNERS = PlanCache("cat.runners")  # a call's geometry -> its `_CatRunner`, `_GENERAL`, or why not (a str)
_GENERAL = object()  # a geometry whose pieces are copied first (lanes with a stride): `_launch` on every call
_CAT_POINTERS = ("q2_ptr", "k2_ptr", "wq2_ptr", "wk2_ptr")  # the joined form's tensors, after the constexprs


def _runner_key(cat: CatCall) -> tuple | None:
    """Every tensor's geometry (`public_functions.tensor_geometry`: shape, strides, dtype, device, 16-byte
    alignment, what the plan and Triton's specialisation read), the join's dims and the parameters; None where one
    cannot be a key."""
    call = cat.call
    try:
        key = (tuple(tensor_geometry(t) for t in call.xs), tuple(tensor_geometry(t) for t in cat.seconds),
               tensor_geometry(call.cos), tensor_geometry(call.sin),
               None if call.positions is None else tensor_geometry(call.positions),
               None if call.norm_weights is None else tuple(None if w is None else tensor_geometry(w)
                                                             for w in call.norm_weights),
               tuple(None if w is None else tensor_geometry(w) for w in cat.second_weights),
               None if call.cu_seqlens is None else tensor_geometry(call.cu_seqlens),
               None if call.seqlen_offsets is None else tensor_geometry(call.seqlen_offsets),
               tuple(cat.dims), call.params)
    except (TypeError, RuntimeError):  # a tensor without storage (fake tensors)
        return None
    return key  # hashed by the lookup (symbolic sizes raise there)


def _on_kernel_devices(cat: CatCall) -> bool:
    call = cat.call
    tensors = (*cat.firsts, *cat.seconds, call.cos, call.sin)
    return triton_launch.INTERPRETED or all(t.device.type == "cuda" for t in tensors)


def _plan_runner(cat: CatCall) -> Any:
    """The runner of a call's geometry, `_GENERAL` where its pieces are copied first, or why the kernel does not
    take it (`launch_cat`'s refusals: an empty piece, `plan_cat`'s reasons)."""
    call, n = cat.call, len(cat.firsts)
    weights = list(call.norm_weights or [None] * n)
    if not all(_lanes_contiguous(t) for t in (*cat.firsts, *cat.seconds, *weights, *cat.second_weights)
               if t is not None):
        return _GENERAL
    if any(t.numel() == 0 for t in (*cat.firsts, *cat.seconds)):
        return "a piece is empty"
    outs = [torch.empty(cat.joined_shape(i), dtype=call.params.out_dtype, device=x.device)
            for i, x in enumerate(cat.firsts)]
    planned = plan_cat(cat, outs)
    if isinstance(planned, str):
        return planned
    return _CatRunner(cat, planned)


def _launch(cat: CatCall) -> list | None:
    """A call planned as it comes (its pieces made lane-contiguous first where they are not); the launch through
    the kernel's JIT launcher."""
    call = cat.call
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
        planned = _PLANS.put(key, plan_cat(cat, outs))
    if isinstance(planned, str):
        return None
    kernel = triton_launch.kernel_for(firsts)  # wrap_triton's op while traced (`emit_node`)
    checks = triton_launch.row_checks(call.positions) if kernel is triton_launch.rotary_kernel else {}
    pos = call.positions if call.positions is not None else call.cos  # unused pointers stand in for absent ones
    sides = [min(i, n - 1) for i in range(3)]
    ws = [weights[i] if weights[i] is not None else call.cos for i in sides]
    ws2 = [seconds_w[i] if seconds_w[i] is not None else call.cos for i in sides[:2]]
    kernel[planned.grid](*(firsts[i] for i in sides), *(outs[i] for i in sides), call.cos, call.sin, pos, *ws,
                         *planned.scalars, **{**planned.meta, "q2_ptr": seconds[0], "k2_ptr": seconds[sides[1]],
                                              "wq2_ptr": ws2[0], "wk2_ptr": ws2[1]}, **checks)
    return outs


class _CatRunner:
    """The launch of one call geometry (lane-contiguous pieces, planned by `plan_cat`), replayed for every later
    call of it. The call's 16 tensors, in the kernel's order (q, k, v, their outputs, cos, sin, positions, the
    three weights, then the joined form's q2, k2 and their weights, which follow the constexprs), are picked from
    the call by indices fixed at planning: absent ones stand in as cos, as `_launch` passes them.

    The first launch goes through the kernel's JIT launcher, which returns the compiled kernel; later ones call it
    with every kernel parameter positionally in the kernel's order, the call's tensors put in their slots on every
    call, the plan's scalars and constexprs fixed (the key fixes them, and every value Triton specialises on):
    through torch's static launcher (the call's tensors as data pointers) where it takes the kernel, else the
    compiled kernel's own launcher. Nothing of a call but its geometry is kept: q2's pointer is a parameter after
    the constexprs, which `triton_launch._compiled_runner` would fix as a constant. The replay's first use is
    checked once against the JIT launcher's result, bit for bit and outside CUDA graph capture; a difference, a
    failure or a launcher API this code does not know keeps the JIT launcher (one log line). The interpreter's
    launch returns no compiled kernel: there the JIT launcher stays."""

    def __init__(self, cat: CatCall, planned: CatLaunch) -> None:
        call, n = cat.call, len(cat.firsts)
        self.grid, self.scalars, self.meta = planned.grid, planned.scalars, planned.meta
        self.checks = triton_launch.row_checks(call.positions)  # compile options of the JIT launch
        self.shapes = [cat.joined_shape(i) for i in range(n)]
        self.dtype = call.params.out_dtype
        self.device = cat.firsts[0].device
        self.host_only = any(t.device.type != "cuda" for t in (*cat.firsts, *cat.seconds, call.cos, call.sin))
        self.n_sources = 4 * n + 3
        weights = list(call.norm_weights or [None] * n)
        # the call's tensors as `CatCall.sources` lists them (firsts, seconds, cos, sin, positions, weights, second
        # weights), then the outputs
        cos, w0, w20, out0 = 2 * n, 2 * n + 3, 3 * n + 3, 4 * n + 3
        sides = [min(i, n - 1) for i in range(3)]
        self.picks = (*sides, *(out0 + i for i in sides), cos, cos + 1, cos + 2 if call.positions is not None else cos,
                      *(w0 + i if weights[i] is not None else cos for i in sides),
                      n, n + sides[1], *(w20 + i if cat.second_weights[i] is not None else cos for i in sides[:2]))
        self.kernel: Any = None  # the kernel whose compiled form `replay` launches
        self.replay: Any = None  # None: untried; False: the JIT launcher stays; else the replayed launch
        self.checked = False

    def __call__(self, cat: CatCall) -> list:
        return self.run_sources(cat.sources())

    def run_sources(self, sources: list) -> list:
        """The call whose tensors are `sources` (`CatCall.sources`' order, None for an absent one): its outputs."""
        dtype, device = self.dtype, self.device
        src = [*sources, *(torch.empty(shape, dtype=dtype, device=device) for shape in self.shapes)]
        tensors = [src[i] for i in self.picks]
        kernel = triton_launch.rotary_kernel  # read per call: the tests interpret the module's kernel
        if kernel is not self.kernel:  # a replay is of the kernel it was compiled from
            self.kernel, self.replay, self.checked = kernel, None, False
        outs = src[self.n_sources:]
        if self.checked:
            self.replay(tensors)
        elif self.replay and not triton_launch.stream_capturing():
            self.replay = self._checked(tensors, outs) or False
            self.checked = bool(self.replay)
        else:
            compiled = self._jit(tensors)
            if self.replay is None:
                self.replay = replay_launch(kernel, compiled, self.grid, self.scalars, self.meta,
                                            self.device) or False
        return outs

    def _jit_arguments(self, tensors: list) -> tuple[tuple, dict]:
        """The JIT launcher's arguments: the call's first 12 tensors and the plan's scalars positionally, the
        constexprs, the joined form's tensors and the compile options by name."""
        t = tensors
        return (*t[:12], *self.scalars), {**self.meta, **dict(zip(_CAT_POINTERS, t[12:])), **self.checks}

    def _jit(self, tensors: list) -> Any:
        triton_warmup.wait()  # a warmup of this launch may still be compiling it
        args, kwargs = self._jit_arguments(tensors)
        return self.kernel[self.grid](*args, **kwargs)

    def warm(self, cat: CatCall) -> int:
        """Compile this geometry's launch in the background from a call given as fake values (`triton_warmup`)."""
        outs = [cat.firsts[0].new_empty(shape, dtype=self.dtype) for shape in self.shapes]  # fake as the call is
        src = [*cat.sources(), *outs]
        args, kwargs = self._jit_arguments([src[i] for i in self.picks])
        return int(triton_warmup.warm(triton_launch.rotary_kernel, self.grid, args, kwargs, self.device))

    def _checked(self, tensors: list, outs: list) -> Any:
        """The replay where it writes what the JIT launcher writes (this call's result either way), else None."""
        n = len(outs)
        sides = [min(i, n - 1) for i in range(3)]
        mine = [torch.empty_like(o) for o in outs]
        try:
            self.replay(tensors)
        except Exception as e:  # a launcher API of another Triton version: the JIT launcher stays
            log.info("rope_fusion: the cat kernel's compiled launcher failed (%s); the JIT launcher stays", e)
            self._jit(tensors)
            return None
        self._jit([*tensors[:3], *(mine[i] for i in sides), *tensors[6:]])
        if all(torch.equal(o.view(torch.uint8), m.view(torch.uint8)) for o, m in zip(outs, mine)):  # NaN too
            return self.replay
        log.warning("rope_fusion: the cat kernel's compiled launcher wrote other values than its JIT launcher; the "
                    "JIT launcher stays")
        for o, m in zip(outs, mine):
            o.copy_(m)
        return None


def replay_layout(names: Any, n_scalars: int, meta: dict) -> tuple[list, list] | None:
    """(every kernel parameter's value in the kernel's order, the 16 tensors' slots among them, in `_CatRunner`'s
    order), the tensors' slots None in the values; None where the plan does not name every parameter after the
    positional ones (meta also holds num_warps, a launch option) or the kernel's parameters are not the ones
    expected."""
    names = list(names)
    head = 12 + n_scalars  # the tensors, then the plan's scalars, positionally
    tail = names[head:]
    if set(meta) - set(tail) != {"num_warps"} or not set(tail) <= set(meta) or not set(_CAT_POINTERS) <= set(tail):
        return None
    slots = [*range(12), *(names.index(p) for p in _CAT_POINTERS)]
    values = [None] * len(names)
    for i, name in enumerate(tail, head):
        values[i] = meta[name]
    for i in slots[12:]:
        values[i] = None
    return values, slots


def replay_launch(kernel: Any, compiled: Any, grid: tuple, scalars: tuple, meta: dict,
                  device: torch.device | None = None) -> Any:
    """The replayed launch of a plan on `device`: run(tensors) launches the compiled kernel with the call's 16
    tensors in their slots (`replay_layout`) and the plan's other values; None where the JIT launch returned no
    compiled kernel (the interpreter) or its parameters are not the ones expected."""
    from triton.compiler import CompiledKernel

    names = getattr(kernel, "arg_names", None)
    if not isinstance(compiled, CompiledKernel) or names is None:
        return None
    layout = replay_layout(names, len(scalars), meta)
    if layout is None:
        return None
    values, slots = layout
    values[12:12 + len(scalars)] = scalars
    return _static_replay(compiled, grid, values, slots, device) or _triton_replay(compiled, grid, values, slots)


def _triton_replay(compiled: Any, grid: tuple, values: list, slots: list) -> Any:
    """`compiled[grid]` with every kernel parameter, the call's tensors in their slots."""
    launcher = compiled[(*grid, 1, 1)[:3]]  # it reads three grid dims (the JIT launcher pads them)

    def run(tensors: list) -> None:
        args = list(values)
        for i, t in zip(slots, tensors):
            args[i] = t
        launcher(*args)
    return run


def _static_replay(compiled: Any, grid: tuple, values: list, slots: list, device: torch.device | None) -> Any:
    """The compiled kernel through torch's static launcher (`triton_launch.static_kernel`): its runtime parameters
    (`triton_launch.static_arguments` over every kernel parameter) in order, each of the call's tensors as its data
    pointer in its slot, the scalars fixed; None where the runtime pointers are not exactly the 16 tensors' slots
    (every tensor of the call must reach the kernel per call), the static launcher does not take the kernel, or
    the tensors are not on the current device (where it would load the cubin and launch, as the JIT launcher
    does)."""
    if not torch.cuda.is_available() or device is None or device.type != "cuda" \
            or device.index not in (None, torch.cuda.current_device()):
        return None
    found = triton_launch.static_arguments(compiled, len(values))
    if found is None:
        return None
    keep, pointers = found
    if sorted(pointers) != sorted(slots):
        return None
    kernel = triton_launch.static_kernel(compiled, keep)
    if kernel is None:
        return None
    gx, gy, gz = (*grid, 1, 1)[:3]
    launch = kernel.run
    stream_of = torch._C._cuda_getCurrentRawStream
    index = torch.cuda.current_device()  # where static_kernel loaded the cubin (the plan's key fixes the device)
    fixed = [values[i] for i in keep]
    at = [keep.index(i) for i in slots]  # each tensor's place among the runtime arguments

    def run(tensors: list) -> None:
        args = list(fixed)
        for i, t in zip(at, tensors):
            args[i] = t.data_ptr()
        launch(gx, gy, gz, stream_of(index), *args)
    return run


def _serve(cat: CatCall) -> Any:
    return launch_cat(cat)


def plan_runner(cat: CatCall) -> Any:
    """The replayed launch of cat's geometry (`_CatRunner`) for a caller that keys its calls itself, so that a call
    skips `launch_cat`'s key (about a third of the joint drop-in's host time); None where the geometry is not
    replayed as planned (pieces copied first, a geometry the kernel does not take, another device)."""
    if not _on_kernel_devices(cat):
        return None
    runner = _plan_runner(cat)
    if runner.__class__ is not _CatRunner or runner.host_only and not triton_launch.INTERPRETED:
        return None
    return runner


def warm_cat(cat: CatCall) -> int:
    """The launch `plan_runner` plans for a call given as fake values, compiled in the background
    (`triton_warmup`); 0 where the geometry is not replayed as planned."""
    runner = plan_runner(cat)
    return runner.warm(cat) if runner is not None else 0


def emit_node(graph: Any, fake_mode: Any, cat: CatCall, like: Any) -> list | None:
    """The cat op's call on graph nodes (`cat`'s tensors are nodes with fake values) as Inductor's own user-kernel
    node, inserted at the graph's insertion point: `_launch` traced on the fake values (its output buffers and the
    CAT launch), so that the compiled graph launches the kernel from its generated code as it does the main op's,
    without the dispatcher's conversion of the op's 25-odd arguments and the op's host path on every call. None
    where a size is symbolic or the launch is not one node (the pass then emits the op)."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation

    from .triton_graph import replay_traced, trace_host

    sources = cat.sources()
    slots = [i for i, t in enumerate(sources) if t is not None]
    inputs = [sources[i] for i in slots]
    vals = [n.meta["val"] for n in inputs]
    if not all(isinstance(s, int) for v in vals for s in (*v.shape, *v.stride(), v.storage_offset())):
        return None
    def host(*args: Any) -> tuple:
        full = [None] * len(sources)
        for slot, a in zip(slots, args):
            full[slot] = a
        outs = _launch(cat.with_sources(full))
        if outs is None:
            raise _NotPlanned
        return tuple(outs)

    try:
        gm = trace_host(host, vals, fake_mode)
    except _NotPlanned:
        return None
    if sum(node.target is triton_kernel_wrapper_mutation for node in gm.graph.nodes) != 1:
        return None
    return replay_traced(graph, fake_mode, gm, inputs, like)


class _NotPlanned(Exception):
    """`_launch` declined the traced call (the pass asked `why_not` first, so only a geometry it could not see)."""


CAT_KERNELS.register("cuda", _serve, check=why_not, plan=plan_runner, warm=warm_cat, node=emit_node)
