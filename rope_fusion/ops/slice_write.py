"""The rotation written into a slice of a larger tensor: `rope_fusion::rotary_slice_` and its q/k, q/k/v arities.

CogVideoX rotates only the video rows of q and k, `q[:, :, text:] = rope(q[:, :, text:])`, which the post-grad
graph spells `slice_scatter(q, rope(slice(q)), 2, text, end)`. A fused op that returns the rotated slice leaves
that scatter behind: an opaque kernel writes the slice, and the scatter copies it into q once more (the 5B-shape
model ran at 0.984x with the kernel forced). These ops instead rotate each tensor's slice in place: tensor i
reads and writes `bases[i].narrow(slice_dims[i], slice_starts[i], slice_ends[i] - slice_starts[i])` and leaves
every other row as it was. They declare that mutation (`Tensor(a!)`), so the pass emits them as
`auto_functionalized` and Inductor's reinplacing decides: the base itself where nothing reads it afterwards, a
clone of it otherwise (docs/design.md section 2, "Writes into a slice").

Every other argument is the rotary op's own (`schema.op_schema`), with the same meaning for the slice as for x:
the implementations build the `RotaryCall` of the slices and run the reference or the device kernel on it.

`rope_fusion::rotary*_into_` write the rotation of tensors of their own into such slices: `out` is a join built
after the rotation (`cat([rope(q_img), q_txt], 2)`, HunyuanVideo's and Qwen-Image's joint attention), and tensor i's
rotation goes to `outs[i].narrow(...)` where the cat would have copied it (passes/folds/joined_writes.py). x and its
slice must not share memory unless x is that slice: such a call is computed apart first, then copied in.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import call_replay
from .device_registry import DeviceRegistry
from .op_definition import reference_only
from .op_families import define_family
from .optional_backends import load_backends
from .overlap import overlap_reason
from .packed import unpacked
from .plan_cache import PlanCache
from .public_functions import tensor_geometry
from .reference import reference_outputs
from .schema import OP_NAMES, TENSOR_NAMES, RotaryCall, check_call, op_schema

log = logging.getLogger("rope_fusion")

# the keyword arguments that say where each tensor's rotated slice lies
SLICE_ARGS = ("slice_dims", "slice_starts", "slice_ends")

# one device's rotation of a call's xs written into views (the slice op's views are its xs): impl(call, views) ->
# True when done, else the reference runs
InPlace = Callable[[RotaryCall, list], bool]
# a call's geometry planned once: planner(call, views=None) -> runner(xs, cos, sin, positions, weights, views=None)
# that writes the rotation of every later call's xs of that geometry into its views (None: the xs in place), or
# None (the call goes to the kernel's `InPlace` as it comes)
InPlacePlanner = Callable[[RotaryCall], Callable | None]
IN_PLACE_KERNELS = DeviceRegistry("in-place rotary")
"""Device type -> its in-place kernel (the Triton kernel registers for CUDA, kernels/triton_slice.py): its `impl` an
`InPlace`, its `plan` (optional) an `InPlacePlanner` of repeated calls."""

_PLANS = PlanCache("slice.runners")  # a call's geometry on its slices (`_plan_key`) -> the device's runner
_REPLAYS = IN_PLACE_KERNELS.plan_cache("slice.replays")  # (op, call key) -> `_replay` of a checked key, or False


def slice_schema(arity: int) -> str:
    """The rotary schema of an arity with its tensors declared written (one alias set each), no result, and the
    slices' bounds: `(Tensor(a!) q, Tensor(b!) k, Tensor cos, ..., *, <params>, int[] slice_dims, SymInt[]
    slice_starts, SymInt[] slice_ends) -> ()`."""
    schema = op_schema(arity)
    for i, name in enumerate(TENSOR_NAMES[arity]):
        schema = re.sub(rf"\bTensor {name}\b", f"Tensor({'abc'[i]}!) {name}", schema, count=1)
    head, _ = schema.rsplit(") ->", 1)
    return f"{head}, int[] slice_dims, SymInt[] slice_starts, SymInt[] slice_ends) -> ()"


def into_schema(arity: int) -> str:
    """The rotary schema of an arity after one written output per tensor, no result, and the slices' bounds:
    `(Tensor(a!) q_out, Tensor(b!) k_out, Tensor q, Tensor k, Tensor cos, ..., *, <params>, int[] slice_dims,
    SymInt[] slice_starts, SymInt[] slice_ends) -> ()`."""
    outs = ", ".join(f"Tensor({'abc'[i]}!) {n}_out" for i, n in enumerate(TENSOR_NAMES[arity]))
    head, _ = op_schema(arity).rsplit(") ->", 1)
    return f"({outs}, {head[1:]}, int[] slice_dims, SymInt[] slice_starts, SymInt[] slice_ends) -> ()"


def split_kwargs(kw: dict) -> tuple[dict, tuple]:
    """The rotary op's keywords and the slices' (dims, starts, ends)."""
    kw = dict(kw)
    bounds = tuple(list(kw.pop(n)) for n in SLICE_ARGS)
    return kw, bounds


def slice_views(bases: Sequence[torch.Tensor], bounds: tuple) -> list:
    dims, starts, ends = bounds
    if not (len(dims) == len(starts) == len(ends) == len(bases)):
        raise ValueError(f"one slice per tensor: {len(bases)} tensors, slice_dims {list(dims)}, slice_starts "
                         f"{list(starts)}, slice_ends {list(ends)}")
    views = []
    for name, b, d, s, e in zip(TENSOR_NAMES[len(bases)], bases, dims, starts, ends):
        if b.dim() < 2 or not -b.dim() <= d < b.dim() or d % b.dim() == b.dim() - 1:
            raise ValueError(f"slice_dims entry {d} for {name} of shape {tuple(b.shape)}: the slice runs along a "
                             "dim before the lanes")
        d = d % b.dim()
        size = b.shape[d]
        if all(isinstance(v, int) for v in (s, e, size)):
            if not 0 <= s <= e <= size:
                raise ValueError(f"slice [{s}, {e}) of {name} along dim {d} (size {size}) is out of range")
            views.append(b.narrow(d, s, e - s))
        else:
            views.append(_symbolic_rows(name, b, d, s, e))
    return views


def _symbolic_rows(name: str, b: torch.Tensor, d: int, s, e) -> torch.Tensor:
    """Rows [s, e) of a fake tensor along d, with symbolic bounds, as a view that adds no guard: the pass emits
    the op only for bounds it proved in range without one (passes/folds/slice_writes.py), a bound known out of range
    still raises, and the eager op checks the ints of every call."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_or

    if statically_known_true(sym_or(s < 0, e < s, e > b.shape[d])):
        raise ValueError(f"slice [{s}, {e}) of {name} along dim {d} (size {b.shape[d]}) is out of range")
    shape = [*b.shape[:d], e - s, *b.shape[d + 1:]]
    return b.as_strided(shape, b.stride(), b.storage_offset() + s * b.stride(d))


def _call(arity: int, args: tuple, kw: dict) -> tuple[RotaryCall, list]:
    """The call on the slices (checked like the rotary op's own) and the views it writes."""
    kw, bounds = split_kwargs(kw)
    bases = list(args[:arity])
    views = slice_views(bases, bounds)
    call = RotaryCall.parse([*views, *args[arity:]], kw, arity)
    _check(call, bases)
    return call, views


def _check(call: RotaryCall, bases: list) -> None:
    check_call(call)
    for name, b in zip(TENSOR_NAMES[len(bases)], bases):
        if b.dtype != call.params.out_dtype:
            raise ValueError(f"{name} is {b.dtype}: a rotation written into it has out_dtype {b.dtype}, got "
                             f"{call.params.out_dtype}")


def _check_written(views: list) -> None:
    """A written slice whose elements share memory (expanded, overlapping rows) cannot be rotated row by row in
    place: a row written first would be read again, rotated, by the next. Checked on real tensors, once per
    geometry (the plan cache keys on the strides); the pass refuses such bases before it emits the op."""
    for name, v in zip(TENSOR_NAMES[len(views)], views):
        why = overlap_reason(v)
        if why is not None:
            raise ValueError(f"the slice of {name} written in place has {why}; pass a tensor whose elements do not "
                             "share memory")


def _fake(arity: int) -> Callable[..., None]:
    def fake(*args: Any, **kw: Any) -> None:
        _call(arity, args, kw)
    return fake


def _into_call(arity: int, args: tuple, kw: dict) -> tuple[RotaryCall, list]:
    """The call on the sources (checked like the rotary op's own) and the slices of the outputs it writes, each
    of its source's shape."""
    kw, bounds = split_kwargs(kw)
    outs = list(args[:arity])
    views = slice_views(outs, bounds)
    call = RotaryCall.parse(list(args[arity:]), kw, arity)
    _check(call, outs)
    for name, x, v in zip(TENSOR_NAMES[arity], call.xs, views):
        if tuple(x.shape) != tuple(v.shape):
            raise ValueError(f"{name} of shape {tuple(x.shape)} is written into a slice of shape {tuple(v.shape)}")
    return call, views


def _into_fake(arity: int) -> Callable[..., None]:
    def fake(*args: Any, **kw: Any) -> None:
        _into_call(arity, args, kw)
    return fake


def _plan_key(arity: int, views: list, rest: tuple, kw: dict) -> tuple | None:
    """The geometry of a call on its slices: every tensor's (`public_functions.tensor_geometry`: shape, strides, dtype,
    device, alignment) and every keyword; None where one cannot be a key."""
    try:
        key = (arity, tuple(tensor_geometry(v) for v in views),
               tuple(None if t is None else tensor_geometry(t) for t in rest), tuple(kw.items()))
        hash(key)
    except (TypeError, RuntimeError):  # a tensor without storage, an unhashable keyword: nothing to cache
        return None
    return key


def _run_plan(runner: Callable, arity: int, xs: list, rest: tuple, views: list | None = None) -> None:
    """A planned call: the tables, positions and weights by their place in the schema (`schema.RotaryCall.parse`);
    the rotation of xs written into views (None: into xs themselves)."""
    weights = list(rest[3:3 + arity]) if len(rest) > 3 else None
    runner(xs, rest[0], rest[1], rest[2] if len(rest) > 2 else None, weights, views)


def _shares_memory(xs: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> bool:
    """Whether a source shares a storage with an output it is not exactly (the kernel reads each row before it
    writes that row only where x is the slice itself)."""
    ptrs = {v.untyped_storage().data_ptr() for v in views}
    return any(x.untyped_storage().data_ptr() in ptrs and not any(_same_view(x, v) for v in views) for x in xs)


def _same_view(x: torch.Tensor, v: torch.Tensor) -> bool:
    return (x.data_ptr() == v.data_ptr() and x.shape == v.shape and x.stride() == v.stride()
            and x.untyped_storage().data_ptr() == v.untyped_storage().data_ptr())


def _eager(arity: int, into: bool = False) -> Callable[..., None]:
    """The slice op's eager kernel (`into`: the into op's). Inductor's graph calls the op once per layer with one
    geometry: after the first call of a key is checked and planned, a call costs its key, its views and the launch
    (the checks and planning were about 250 us of host time a call on a 2-core host, the GPU's work 130 us at
    CogVideoX-5B's shape)."""
    name, parse = ("into", _into_call) if into else ("slice", _call)

    def run(*args: Any, **kw: Any) -> None:
        unplanned = _unreplayed((name, arity), args, kw)
        if unplanned is None:
            return
        key, replay, options, _ = unplanned
        call, views = parse(arity, args, kw)
        _check_written(views)
        if into and _shares_memory(call.xs, views):  # computed apart, then written: the rows may overlap
            for view, out in zip(views, reference_outputs(unpacked(call))):
                view.copy_(out)
            return
        rest = tuple(args[arity:])  # an into op's sources, then the tables; the slice op's tables
        runner = _runner(arity, call, views, rest, {**options, "into": True} if into else options,
                         views if into else None)
        if runner is None:
            _per_call(call, views)
            return
        if replay is None:
            _REPLAYS.put(key, _replay(runner, arity, args, kw, into))
        if into:
            _run_plan(runner, arity, list(rest[:arity]), rest[arity:], views)
        else:
            _run_plan(runner, arity, views, rest)
    return run


def _per_call(call: RotaryCall, views: list) -> None:
    """A call that is not planned: the device's kernel as it comes, else the reference (which reads x before any
    view is written)."""
    call = unpacked(call)
    kernel = IN_PLACE_KERNELS.get(views[0].device.type)
    if not reference_only() and kernel is not None and kernel.impl(call, views):
        return
    for view, out in zip(views, reference_outputs(call)):
        view.copy_(out)


def _unreplayed(op: tuple, args: tuple, kw: dict) -> tuple | None:
    """None where the call's key replayed it (`_replay`); else (its replay key, the key's replay: None where
    unplanned, False where its calls are not replayed; the rotary op's keywords, the slices' bounds). No key under
    `reference_kernels`, where the reference serves every call."""
    flat = None if reference_only() else call_replay.flatten(args, kw)
    key = None if flat is None else (op, flat[0])
    replay = _REPLAYS.get(key)
    if replay and replay(flat[1]):
        return None
    return (key, replay, *split_kwargs(kw))


def _runner(arity: int, call: RotaryCall, views: list, rest: tuple, kw: dict, into: list | None = None) -> Any:
    """The device's planned runner of the call's geometry on its slices (`_PLANS`: planned once per geometry, so
    slices of one shape at other bounds share it), or None where its calls go to the kernel as they come (packed
    sequences, a device without a planner, the reference)."""
    if reference_only() or call.cu_seqlens is not None:
        return None
    key = _plan_key(arity, views, rest, kw)
    runner = _PLANS.get(key)
    if runner is None:
        load_backends()  # the device's in-place kernel registers when its backend imports
        kernel = IN_PLACE_KERNELS.get(views[0].device.type)
        if key is None or kernel is None or kernel.plan is None:
            return None
        runner = _PLANS.put(key, kernel.plan(call, into) if into is not None else kernel.plan(call))
    return runner


def _replay(runner: Callable, arity: int, args: tuple, kw: dict, into: bool) -> Callable[[list], bool] | bool:
    """Every later call of a checked key, from its own tensors (`call_replay`): its slices cut at the key's bounds,
    its tables, positions and weights by their place in the schema, then the planned runner. An into call whose
    sources share memory with its slices returns False: it takes the op's own path. False where the tensors are
    not the call's own."""
    outputs = 2 * arity if into else arity  # the written tensors (and an into op's sources) come first
    rest = args[outputs:]
    has_weights = len(rest) > 3

    def tensors(a: tuple, _: dict) -> list:
        r = a[outputs:]
        return [*a[:outputs], r[0], r[1], r[2] if len(r) > 2 else None, *(r[3:3 + arity] if has_weights else ())]
    indices = call_replay.leaf_indices(args, kw, tensors) if len(rest) >= 2 else None
    if indices is None:
        return False
    cuts = [(d % b.dim(), s, e - s) for b, d, s, e in zip(args[:arity], *split_kwargs(kw)[1])]

    def replay(leaves: list) -> bool:
        t = call_replay.picked(leaves, indices)
        views = [t[i].narrow(d, s, n) for i, (d, s, n) in enumerate(cuts)]
        weights = t[outputs + 3:] if has_weights else None
        if not into:
            runner(views, t[outputs], t[outputs + 1], t[outputs + 2], weights, None)
            return True
        xs = t[arity:outputs]
        if _shares_memory(xs, views):
            return False
        runner(xs, t[outputs], t[outputs + 1], t[outputs + 2], weights, views)
        return True
    return replay


def _named(suffix: str) -> dict[int, str]:
    return {arity: name + suffix for arity, name in OP_NAMES.items()}


def warm_written(op: Any, values: dict) -> int:
    """Compile in the background the launches a call of a slice or into op will make (`DeviceKernel.warm`), from
    its arguments by name as fake values (the pass, as it emits the op): returns how many launches were handed to
    the warmup, 0 where the device's kernel warms nothing or the call is not planned once (packed sequences)."""
    arity = next((i + 1 for family in (SLICE_OPS, INTO_OPS) for i, o in enumerate(family) if o is op), None)
    if arity is None or reference_only():
        return 0
    arguments = op._schema.arguments
    args = tuple(values.get(a.name) for a in arguments if not a.kwarg_only)
    kw = {a.name: values[a.name] for a in arguments if a.kwarg_only and a.name in values}
    into = op in INTO_OPS
    try:
        call, views = (_into_call if into else _call)(arity, args, kw)
        kernel = IN_PLACE_KERNELS.get(views[0].device.type)
        if kernel is None or kernel.warm is None or call.cu_seqlens is not None:
            return 0
        return kernel.warm(call, views if into else None)
    except Exception as e:  # an optimisation of the first call, never a failure of the compile
        log.debug("rope_fusion: the %s op's launches were not warmed (%s); its first call compiles them", op, e)
        return 0


@dataclasses.dataclass
class WrittenCall:
    """A call of a slice or into op whose tensors are graph nodes with fake values, as the pass emits it: the
    tensors written (`bases`, each whole), the rotary call (its xs the into op's sources; the slice op's xs are the
    bases' slices, which a node reads from the bases), each written slice's (dim, start, end), and which op it is."""

    bases: list
    call: RotaryCall
    bounds: list
    into: bool

    def views(self, bases: Sequence[torch.Tensor]) -> list:
        """The slices of `bases` (values of the `bases` nodes) that the call writes."""
        return slice_views(bases, tuple(list(b) for b in zip(*self.bounds)))


def emit_node(graph: Any, fake_mode: Any, written: WrittenCall, like: Any) -> list | None:
    """The call as the device kernel's own node in a post-grad graph (`DeviceRegistry.emit_node`: on CUDA the Triton
    kernel's user-kernel node, handed each base whole and the offset of its slice); returns the written bases, or
    None where the pass emits the op. Launched from the compiled graph's code, the kernel compiles in Inductor's
    workers with the rest of the graph, where the op's launches compiled in the main process
    (kernels/triton_warmup.py) and each call paid the dispatcher's conversion of its 25-30 arguments."""
    device = written.bases[0].meta["val"].device.type
    return IN_PLACE_KERNELS.emit_node(device, graph, fake_mode, written, like)


def node_runner(call: RotaryCall, views: list | None = None) -> Callable | None:
    """How a compiled graph runs a slice call (`views` None: the call's xs are the slices, rotated in place) or an
    into call (the xs written into `views`) where the pass emits the device kernel's own node (`emit_node`): the
    kernel's planned runner of the call's geometry, `runner(xs, cos, sin, positions, weights, views)`, its launch
    with no dispatcher, for `auto` to time the fold as it runs; None where the device has no node (the op is
    emitted, and called through the dispatcher) or the call is not planned once."""
    plan = IN_PLACE_KERNELS.node_planner(call.xs[0].device.type)
    if plan is None or call.cu_seqlens is not None:
        return None
    return plan(call, views) if views is not None else plan(call)


SLICE_OPS = define_family(_named("_slice_"), slice_schema, _eager, _fake)  # by arity - 1: rotary_slice_, ...
INTO_OPS = define_family(_named("_into_"), into_schema, functools.partial(_eager, into=True),
                         _into_fake)  # by arity - 1: rotary_into_, rotary_qk_into_, ...
