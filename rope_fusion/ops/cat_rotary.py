"""The rotation of a joined tensor read from its pieces: `rope_fusion::rotary_cat` and `rotary_qk_cat`.

Flux and Flux.2 norm the text and the image q (and k) apart, each with its own RMSNorm weight, join them along the
sequence dim and rotate the joined tensor: `rope(cat([norm_t(q_txt), norm_i(q_img)], 1))`. The rotary op takes the
joined tensor, so an opaque kernel leaves the `cat` in the graph (a read and a write of q and k beside the
rotation) and with it the norms, which cannot fold through it. These ops take the pieces instead: tensor i's x is
`cat([xs[i], second_pieces[i]], cat_dims[i])`, its first piece normalised with the rotary op's own
`{q,k}_norm_weight`, its second with `second_norm_weights[i]` (each piece its own rows of the one `norm`), then
rotated as the rotary op rotates x. Two pieces: every model that joins q so joins text and image; a kernel that
reads a piece per program needs each piece's pointer and strides as arguments of its own (docs/design.md 4.4).

Every other argument is the rotary op's (`schema.op_schema`); the result is the rotary op's on the joined x. The
CUDA implementation is the Triton kernel's (kernels/triton_cat.py); elsewhere, and where the kernel cannot plan a
call, the reference: the pieces normalised in the math dtype, joined, then the reference rotation.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from . import call_replay
from .device_registry import DeviceRegistry
from .op_definition import reference_only
from .op_families import define_family
from .optional_backends import load_backends
from .plan_cache import PlanCache
from .reference import rms_norm, rotary_reference
from .schema import OP_NAMES, TENSOR_NAMES, RotaryCall, check_call, math_dtype, op_schema

log = logging.getLogger("rope_fusion")

# the keyword arguments that give each tensor's second piece and where it joins the first
CAT_ARGS = ("second_pieces", "second_norm_weights", "cat_dims")
ARITIES = (1, 2)  # x alone, q and k (the joint attention's pair); the kernel's second pieces are q2 and k2


class CatCall:
    """A call of a cat op: the rotary call of the first pieces (with the op's own tables and parameters), and per
    tensor its second piece, that piece's norm weight and the dim along which the two join."""

    def __init__(self, call: RotaryCall, seconds: list, second_weights: list, dims: list) -> None:
        self.call, self.seconds, self.second_weights, self.dims = call, seconds, second_weights, dims

    @property
    def firsts(self) -> list:
        return self.call.xs

    def sources(self) -> list:
        """The call's tensors in the order a planned runner takes them: the first pieces, the second pieces, cos,
        sin, positions, the first pieces' norm weights and the second pieces' (None for an absent one)."""
        call, n = self.call, len(self.seconds)
        return [*call.xs, *self.seconds, call.cos, call.sin, call.positions, *(call.norm_weights or [None] * n),
                *self.second_weights]

    def with_sources(self, sources: list) -> CatCall:
        """This call with its tensors replaced by `sources`, in `sources()`' order (a traced or later call of the
        same geometry)."""
        call, n = self.call, len(self.seconds)
        weights = sources[2 * n + 3:3 * n + 3] if call.norm_weights is not None else None
        rot = dataclasses.replace(call, xs=sources[:n], cos=sources[2 * n], sin=sources[2 * n + 1],
                                  positions=sources[2 * n + 2], norm_weights=weights)
        return CatCall(rot, sources[n:2 * n], sources[3 * n + 3:4 * n + 3], self.dims)

    def joined_shape(self, i: int) -> tuple:
        shape = list(self.firsts[i].shape)
        shape[self.dims[i]] += self.seconds[i].shape[self.dims[i]]
        return tuple(shape)


def cat_schema(arity: int) -> str:
    """The rotary schema of an arity with each tensor's second piece, its norm weight and the join's dim."""
    head, out = op_schema(arity).rsplit(") ->", 1)
    return f"{head}, Tensor[] second_pieces, Tensor?[] second_norm_weights, int[] cat_dims) ->{out}"


def parse(arity: int, args: tuple, kw: dict) -> CatCall:
    """The call's parts, checked: pieces that join, and the rotary op's own checks on the joined tensors."""
    kw = dict(kw)
    seconds, weights, dims = (list(kw.pop(n)) for n in CAT_ARGS)
    call = RotaryCall.parse(args, kw, arity)
    names = TENSOR_NAMES[arity]
    if not len(seconds) == len(weights) == len(dims) == arity:
        raise ValueError(f"one second piece, norm weight and cat dim per tensor ({arity}): got {len(seconds)} "
                         f"pieces, {len(weights)} weights, cat_dims {dims}")
    if call.cu_seqlens is not None:
        raise ValueError("packed sequences (cu_seqlens) and joined pieces do not combine: pass the joined tensor")
    joined_dims = []
    for i, (name, x, y, d) in enumerate(zip(names, call.xs, seconds, dims)):
        nd = x.dim()
        if not -nd <= d < nd - 1:
            raise ValueError(f"cat_dims entry {d} for {name} of shape {tuple(x.shape)}: the pieces join along a dim "
                             "before the lanes")
        joined_dims.append(d % nd)
        if y.dim() != nd or y.dtype != x.dtype or y.device != x.device or any(
                x.shape[k] != y.shape[k] for k in range(nd) if k != d % nd):
            raise ValueError(f"the second piece of {name} ({tuple(y.shape)}, {y.dtype}, {y.device}) does not join "
                             f"{name} ({tuple(x.shape)}, {x.dtype}, {x.device}) along dim {d % nd}")
        w = weights[i]
        if (w is None) != (call.weight(i) is None) or w is not None and w.shape != call.weight(i).shape:
            raise ValueError(f"{name}'s pieces take norm weights of one shape, or none: "
                             f"{_shape(call.weight(i))} and {_shape(w)}")
    cat = CatCall(call, seconds, weights, joined_dims)
    # the rotary op's own checks, on the joined tensors (one element each, expanded: no copy of the data)
    joined = [x.new_empty((1,) * x.dim()).expand(cat.joined_shape(i)) for i, x in enumerate(call.xs)]
    check_call(RotaryCall(joined, call.cos, call.sin, call.params, call.positions, call.norm_weights))
    return cat


def _shape(t: Any) -> Any:
    return None if t is None else tuple(t.shape)


def reference(cat: CatCall) -> list:
    """The pieces normalised apart in the math dtype, joined, and rotated by the reference (one rounding)."""
    call, params, outs = cat.call, cat.call.params, []
    for i, (x, y) in enumerate(zip(cat.firsts, cat.seconds)):
        p = params.of_tensor(i)
        cd = math_dtype([x], call.cos, call.sin, p.out_dtype)
        pieces = [x.to(cd), y.to(cd)]
        if p.norm != "none":
            weights = (call.weight(i), cat.second_weights[i])
            pieces = [rms_norm(t, p.norm, p.norm_eps, w) for t, w in zip(pieces, weights)]
        joined = torch.cat(pieces, dim=cat.dims[i])
        outs.append(rotary_reference(joined, call.cos, call.sin, positions=call.positions,
                                     **p.replace(norm="none").kwargs()).contiguous())
    return outs


# impl(cat) -> outputs, or None (the reference runs)
Impl = Callable[[CatCall], "list | None"]
# why_not(cat) -> None where the kernel takes the call (fake tensors will do), else why not
Check = Callable[[CatCall], "str | None"]
# planner(cat) -> the runner of every later call of cat's geometry (runner(cat) -> outputs), or None where the kernel
# does not take the geometry: for callers that key their calls themselves (the joint drop-in)
Planner = Callable[[CatCall], "Impl | None"]
CAT_KERNELS = DeviceRegistry("cat")
"""Device type -> the cat ops' kernel there (the Triton kernel registers for CUDA, kernels/triton_cat.py): its
`impl` an `Impl`, its `check` a `Check` (the pass folds a cat only for the calls it takes), its `plan` a `Planner`
(`device_runner`)."""


def device_runner(cat: CatCall) -> Impl:
    """How every later call of cat's geometry runs on its device: the device's planned runner, where the device's
    kernel takes the geometry, else its kernel per call or the reference (each returns the outputs)."""
    load_backends()
    kernel = CAT_KERNELS.get(cat.firsts[0].device.type)
    run = kernel.plan(cat) if kernel is not None and kernel.plan is not None else None
    if run is not None:
        return run
    impl = kernel.impl if kernel is not None else None

    def per_call(cat: CatCall) -> list:
        outs = impl(cat) if impl is not None else None
        return outs if outs is not None else reference(cat)
    return per_call


def why_not(cat: CatCall) -> str | None:
    """None where the device kernel of the call's tensors takes it, else why not (no kernel for the device)."""
    load_backends()
    device = cat.firsts[0].device.type
    kernel = CAT_KERNELS.get(device)
    if kernel is None:
        return f"no kernel reads joined pieces on {device}"
    return kernel.check(cat) if kernel.check is not None else None


def warm(op: Any, args: tuple, kw: dict) -> int:
    """Compile in the background the launch a call of a cat op will make (`DeviceKernel.warm`), from its
    arguments as fake values (the pass, as it emits the op); returns how many launches were handed to the warmup."""
    arity = next((i + 1 for i, o in enumerate(CAT_OPS) if o is op), None)
    if arity is None or reference_only():
        return 0
    try:
        cat = parse(arity, args, kw)
        kernel = CAT_KERNELS.get(cat.firsts[0].device.type)
        return kernel.warm(cat) if kernel is not None and kernel.warm is not None else 0
    except Exception as e:  # an optimisation of the first call, never a failure of the compile
        log.debug("rope_fusion: the cat op's launch was not warmed (%s); its first call compiles it", e)
        return 0


def emit_node(graph: Any, fake_mode: Any, cat: CatCall, like: Any) -> list | None:
    """The call, whose tensors are graph nodes, as the device kernel's own node in a post-grad graph
    (`DeviceRegistry.emit_node`: on CUDA the Triton kernel's user-kernel node), or None where the pass emits the
    op."""
    return CAT_KERNELS.emit_node(cat.firsts[0].meta["val"].device.type, graph, fake_mode, cat, like)


def node_runner(cat: CatCall) -> Impl | None:
    """How a compiled graph runs a call of cat's geometry where the pass emits the device kernel's own node
    (`emit_node`): the kernel's planned runner (its launch, no dispatcher), for `auto` to time the fold as it
    runs; None where the device has no node (the op is emitted, and called through the dispatcher) or the
    geometry no planned runner."""
    plan = CAT_KERNELS.node_planner(cat.firsts[0].device.type)
    return plan(cat) if plan is not None else None


def _result(outs: list) -> Any:
    return outs[0] if len(outs) == 1 else tuple(outs)


def _fake(arity: int) -> Callable[..., Any]:
    def fake(*args: Any, **kw: Any) -> Any:
        cat = parse(arity, args, kw)
        return _result([x.new_empty(cat.joined_shape(i), dtype=cat.call.params.out_dtype)
                        for i, x in enumerate(cat.firsts)])
    return fake


_CHECKED = PlanCache("cat.checked")  # the calls (`call_replay.flatten`'s key) that passed `parse`'s checks: True
_REPLAYS = CAT_KERNELS.plan_cache("cat.replays")  # (arity, call key) -> the runner fed from the call, or False


def _parsed(arity: int, args: tuple, kw: dict, key: tuple | None) -> CatCall:
    """`parse`, whose checks run once per call key: a later call of a checked key takes its parts as they are (the
    checks of the joined tensors were half of a call's host time on the H200's host, about 50 us)."""
    if key is None or key not in _CHECKED:
        cat = parse(arity, args, kw)
        _CHECKED.put(key, True)
        return cat
    return _parts(arity, args, kw)


def _parts(arity: int, args: tuple, kw: dict) -> CatCall:
    """The call's parts, unchecked."""
    kw = dict(kw)
    seconds, weights, dims = (list(kw.pop(n)) for n in CAT_ARGS)
    call = RotaryCall.parse(args, kw, arity)
    return CatCall(call, seconds, weights, [d % x.dim() for d, x in zip(dims, call.xs)])


class Replay:
    """A checked key's calls, run from their own tensors: the call's tensors at `indices` (`call_replay`), in
    `CatCall.sources` order, handed to the device's planned `runner` (its `run_sources`)."""

    __slots__ = ("runner", "indices")

    def __init__(self, runner: Any, indices: list) -> None:
        self.runner, self.indices = runner, indices

    def __call__(self, leaves: list) -> list:
        return self.runner.run_sources(call_replay.picked(leaves, self.indices))


def _replay(arity: int, args: tuple, kw: dict, cat: CatCall, kernel: Any) -> Replay | None:
    """The runner of every later call of this call's key, fed from its arguments: the device kernel's planned runner
    where it replays the geometry from a call's tensors (`DeviceKernel.plan`, a runner with `run_sources`), else
    None."""
    runner = kernel.plan(cat) if kernel.plan is not None else None
    if getattr(runner, "run_sources", None) is None:
        return None
    indices = call_replay.leaf_indices(args, kw, lambda a, k: _parts(arity, a, k).sources())
    return Replay(runner, indices) if indices is not None else None


def _eager(arity: int) -> Callable[..., Any]:
    kernels = CAT_KERNELS.kernels  # the table itself: a call costs the one lookup of a plain dict

    def run(*args: Any, **kw: Any) -> Any:
        flat = call_replay.flatten(args, kw)
        key = None if flat is None else (arity, flat[0])
        replay = _REPLAYS.get(key)  # False: the key's calls go to the kernel as they come
        if replay and not reference_only():
            return _result(replay(flat[1]))
        cat = _parsed(arity, args, kw, key)
        load_backends()  # the device's kernel registers when its backend imports
        kernel = None if reference_only() else kernels.get(cat.firsts[0].device.type)
        if replay is None and kernel is not None and key is not None:
            replay = _REPLAYS.put(key, _replay(arity, args, kw, cat, kernel) or False)
            if replay:
                return _result(replay(flat[1]))
        outs = kernel.impl(cat) if kernel is not None else None
        return _result(outs if outs is not None else reference(cat))
    return run


CAT_OPS = define_family({arity: f"{OP_NAMES[arity]}_cat" for arity in ARITIES}, cat_schema, _eager, _fake)
"""By arity - 1: rotary_cat, rotary_qk_cat."""
