"""`auto` that measures: time each choice of a site on the compile's own device, at compile time.

The factor table (ops/cost_model.py) was fitted on one H200 and is wrong at some sites even there (the Qwen2.5-VL
vision site, LTX-Video's norm fold; issue 31), and on any other GPU in unknown ways. So under `auto`, on a CUDA
compile whose site sizes are all static, each candidate that can take the site is compiled and timed on random
tensors of the site's own shapes, strides and dtypes:

- "left": the site's own region as plain Inductor compiles it: the nodes from the outputs the op would replace
  back to what is in memory anyway (graph inputs, constants, matmul and convolution outputs, ops that are not
  ATen's), so the QK-norm and the table math that Inductor fuses into the rotation are in it;
- "inductor": the same inputs, the nodes that compute the op's inputs, and the op, lowered by Inductor;
- "triton": those input nodes compiled by Inductor, then the Triton kernel's direct launch (the op's eager CUDA
  path: the same kernel and plan as the user-kernel node of the graph).

Each runs the way the compiled graph will: replayed in a CUDA graph when the pass's `replayed_in_cuda_graphs()`,
else called in a timed loop with its launches (host time included, one synchronize at the end). A fused candidate
is taken only when it is faster than "left" by `MARGIN` (2%): below that the timings cannot tell them apart, and
leaving a site is never slower than plain torch.compile. Decisions are cached on disk by site signature
(passes/auto_decisions.py), so a warm compile times nothing.

Measuring is never a reason to fail a compile: any exception, symbolic sizes, fake or meta tensors without a
device to time on, a region too large to extract, `RopeFusionPass(measure=False)` or `ROPE_FUSION_MEASURE=0` fall
back to the factor table (a calibrated one where `rope-fusion calibrate` wrote it), and the report says why.

The standalone compiles run Inductor inside the pass: this pass is off in them (the config's post-grad pass is
cleared and `measuring()` makes any instance a no-op), and the FX graph and AOTAutograd caches are off, so they
neither recurse nor show in the compile's cache counters. Tests steer the timings with `TIMER` and run the path on
the CPU by adding "cpu" to `_MEASURE_DEVICE_TYPES`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import operator
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from . import auto_decisions
from .auto_decisions import Decision

log = logging.getLogger("rope_fusion")

MARGIN = 0.02  # a fused candidate must take at most (1 - MARGIN) of "left"'s time
MAX_REGION_NODES = 256  # a region larger than this is not extracted (the table decides)
TARGET_SECONDS = 2e-3  # each timed repeat runs about this long
REPEATS = 5  # the median of this many repeats is a candidate's time
ENV = "ROPE_FUSION_MEASURE"  # "0" turns measuring off

# Device types whose compiles measure. CUDA only by default (CPU and NPU compiles keep their fixed choice);
# tests add "cpu" so that extraction, standalone compiles and timing really run.
_MEASURE_DEVICE_TYPES: tuple = ("cuda",)

# timer(candidate, run) -> seconds per call of `run`; None: `default_timer`. Tests replace it to steer choices.
TIMER: Callable[[str, Callable[[], Any]], float] | None = None

STATS: collections.Counter = collections.Counter()  # "timed" signatures, "cached" hits, "table" fallbacks

_STATE = threading.local()

aten = torch.ops.aten
# Producers whose output is in memory whatever consumes it: where a region starts.
_MATERIALISED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                 aten.convolution.default, aten._scaled_mm.default, aten._int_mm.default}


def measuring() -> bool:
    """Whether this thread is compiling a candidate: the pass must do nothing there."""
    return getattr(_STATE, "depth", 0) > 0


class NotMeasured(Exception):
    """Why a site could not be measured: the factor table decides, and the report says this."""


@dataclasses.dataclass
class AutoSite:
    """A site as measuring needs it (passes/emission.py `plan_group` builds it before choosing): the group's
    matches (their nodes are the outputs the op replaces) and the op's call on graph nodes."""

    group: tuple
    call: Any  # RotaryCall whose tensors are nodes of the graph

    @property
    def outputs(self) -> list:
        return [m.node for m in self.group]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What measuring says about a site: `choice` None lets the table decide; `how` is "measured", "cached" or
    "table"; `why` is what the report prints."""

    choice: str | None
    how: str
    why: str


def enabled(option: bool) -> tuple[bool, str]:
    """Whether to measure, and why not."""
    if not option:
        return False, "measuring off (RopeFusionPass(measure=False))"
    if os.environ.get(ENV, "1").strip() == "0":
        return False, f"measuring off ({ENV}=0)"
    return True, ""


def measured_device(device_type: str) -> bool:
    return device_type in _MEASURE_DEVICE_TYPES


# -- extracting the site's region and the candidates' inputs ---------------------------------------------

def _starts_region(n: fx.Node) -> bool:
    """Whether n is in memory whatever reads it: an input of the extracted region, not part of it."""
    if n.op != "call_function":
        return True
    target = n.target
    if target is operator.getitem:
        return _starts_region(n.args[0])
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return True
    if target in _MATERIALISED or target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return True
    return False


def _static(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return all(type(d) is int for d in (*val.shape, *val.stride())) and type(val.storage_offset()) is int
    return not isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def region(outputs: list) -> tuple[list, list]:
    """(body, inputs): the nodes computing `outputs` from what is in memory anyway, in topological order, and
    those inputs in the order first met. Raises NotMeasured for a region too large or with symbolic sizes."""
    body: list = []
    inputs: list = []
    state: dict = {}
    for out in outputs:
        stack = [(out, False)]
        while stack:
            n, done = stack.pop()
            if done:
                body.append(n)
                continue
            if n in state:
                continue
            if not _static(n.meta.get("val")):
                raise NotMeasured(f"{n.name} has a symbolic size")
            if _starts_region(n):
                state[n] = "input"
                inputs.append(n)
                continue
            state[n] = "body"
            if len(state) > MAX_REGION_NODES:
                raise NotMeasured(f"the site's region is over {MAX_REGION_NODES} nodes")
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.all_input_nodes) if a not in state)
    return body, inputs


def _copy(body: list, inputs: list) -> tuple[fx.Graph, dict]:
    """A new graph with a placeholder per input and a copy of every body node (meta, fake values included)."""
    g = fx.Graph()
    env: dict = {}
    for i, n in enumerate(inputs):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = n.meta.get("val")
        env[n] = p
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    return g, env


def canonical(g: fx.Graph) -> str:
    """The graph's computation with nodes numbered by position (not by name), the inputs' geometry included:
    the same region in every layer of a model reads alike."""
    index: dict = {}
    lines = []

    def arg(a: Any) -> Any:
        return f"%{index[a]}" if isinstance(a, fx.Node) else a

    for i, n in enumerate(g.nodes):
        index[n] = i
        val = n.meta.get("val")
        geometry = ""
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            geometry = f"{tuple(val.shape)}/{tuple(val.stride())}+{val.storage_offset()}/{val.dtype}/{val.device.type}"
        lines.append(f"{n.op} {getattr(n.target, '__name__', n.target) if n.op != 'placeholder' else ''} "
                     f"{fx.node.map_aggregate(n.args, arg)} {fx.node.map_aggregate(n.kwargs, arg)} {geometry}")
    return "\n".join(lines)


def _real(val: torch.Tensor, int_bound: int) -> torch.Tensor:
    """A real tensor with val's shape, strides, offset and dtype on its device, filled at random (integers:
    0, 1, ... below int_bound, valid rows for a gathered table)."""
    extent = val.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()) if s > 0)
    if any(s == 0 for s in val.shape):
        extent = val.storage_offset() + 1
    base = torch.empty(extent, dtype=val.dtype, device=val.device)
    if val.dtype.is_floating_point or val.dtype.is_complex:
        base.normal_()
    elif val.dtype == torch.bool:
        base.zero_()
    else:
        base.copy_(torch.arange(extent, device=val.device) % max(1, int_bound))
    return base.as_strided(tuple(val.shape), tuple(val.stride()), val.storage_offset())


@contextlib.contextmanager
def _standalone():
    """Real tensors and Inductor compiles inside the pass: no fake mode, no outer tracing context, this pass
    off, no compile caches, no Inductor CUDA graphs (the timer records its own)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        with unset_fake_temporarily(), torch._guards.tracing(None), torch.no_grad(), \
                torch._inductor.config.patch({"post_grad_custom_post_pass": None, "fx_graph_cache": False,
                                              "triton.cudagraphs": False}), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        _STATE.depth -= 1


def _compile(g: fx.Graph, args: list) -> Callable[[], Any]:
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(fx.GraphModule({}, g), list(args))
    return lambda: compiled(*args)


# -- the candidates ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Built:
    """The graphs the candidates compile (on fake values) and the signature they share."""

    left: fx.Graph
    left_inputs: list
    upstream: fx.Graph  # computes the op's tensor arguments from their inputs
    upstream_inputs: list
    call_slots: list  # per RotaryCall tensor slot: index into upstream's outputs, or None
    signature: str


_SLOTS = ("xs", "cos", "sin", "positions", "norm_weights")


def _call_tensors(call: Any) -> list:
    ws = call.norm_weights or []
    return [*call.xs, call.cos, call.sin, call.positions, *ws]


def build(site: AutoSite, cuda_graphs: bool) -> _Built:
    for o in site.outputs:
        if _starts_region(o):  # a rotary kernel already in the graph: no region of its own to time
            raise NotMeasured(f"{o.name} is a rotary kernel already in the graph, not arithmetic")
    body, inputs = region(site.outputs)
    left, env = _copy(body, inputs)
    left.output(tuple(env[o] for o in site.outputs))
    tensors = [t for t in _call_tensors(site.call) if t is not None]
    ubody, uinputs = region(list(dict.fromkeys(tensors)))
    upstream, uenv = _copy(ubody, uinputs)
    outs = list(dict.fromkeys(tensors))
    upstream.output(tuple(uenv[t] for t in outs))
    slots = [outs.index(t) if t is not None else None for t in _call_tensors(site.call)]
    params = site.call.params
    text = "\n".join([f"params {params}", f"arity {len(site.call.xs)} weights {site.call.norm_weights is not None}",
                      f"slots {slots}", f"cuda_graphs {int(cuda_graphs)}", "left:", canonical(left),
                      "upstream:", canonical(upstream)])
    return _Built(left, inputs, upstream, uinputs, slots, hashlib.sha256(text.encode()).hexdigest()[:32])


def _runner(name: str, built: _Built, site: AutoSite, real: dict) -> Callable[[], Any] | None:
    """The compiled candidate as a no-argument call, None where the candidate cannot take the site."""
    from ..ops.library import OPS, device_runner
    from ..ops.schema import RotaryCall

    if name == "left":
        return _compile(built.left, [real[n] for n in built.left_inputs])
    arity = len(site.call.xs)
    has_weights = site.call.norm_weights is not None

    def call_of(outs: list) -> RotaryCall:
        vals = [outs[i] if i is not None else None for i in built.call_slots]
        return RotaryCall(vals[:arity], vals[arity], vals[arity + 1], site.call.params, vals[arity + 2],
                          vals[arity + 3:] if has_weights else None)

    if name == "inductor":
        # the op after the same input nodes, lowered by Inductor: one graph, as in the fused compile
        return _compile(_with_op(built, site, OPS), [real[n] for n in built.upstream_inputs])
    if name == "triton":
        up = _compile(built.upstream, [real[n] for n in built.upstream_inputs])
        first = call_of(list(up()))
        run = device_runner(first)

        def triton_run() -> Any:
            c = call_of(list(up()))
            return run(c.xs, c.cos, c.sin, c.positions, c.norm_weights)
        return triton_run
    raise NotMeasured(f"no way to time the candidate {name!r}")


def _with_op(built: _Built, site: AutoSite, ops: tuple) -> fx.Graph:
    """upstream's nodes, then the op of the call's arity on its outputs."""
    g = fx.Graph()
    env: dict = {}
    for n in built.upstream.nodes:
        if n.op == "output":
            outs = [env[a] for a in n.args[0]]
            break
        env[n] = g.node_copy(n, lambda a: env[a])
    vals = [outs[i] if i is not None else None for i in built.call_slots]
    arity = len(site.call.xs)
    tensors = [*vals[:arity], vals[arity], vals[arity + 1], vals[arity + 2], *vals[arity + 3:]]
    while tensors and tensors[-1] is None:
        tensors.pop()
    node = g.call_function(ops[arity - 1], tuple(tensors), site.call.params.kwargs())
    g.output(node)
    return g


def default_timer(cuda_graphs: bool) -> Callable[[str, Callable[[], Any]], float]:
    """Seconds per call: CUDA-graph replay when the compiled graph will be replayed, else a timed loop of calls
    (launches and host time included, synchronized once per repeat); the median of `REPEATS`."""
    def timer(name: str, run: Callable[[], Any]) -> float:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        for _ in range(3):
            run()
        if cuda:
            torch.cuda.synchronize()
        if cuda and cuda_graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            step = graph.replay
        else:
            step = run

        def once(n: int) -> float:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            if cuda:
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n

        first = once(1)
        n = max(3, min(2000, int(TARGET_SECONDS / max(first, 1e-7))))
        return statistics.median(once(n) for _ in range(REPEATS))
    return timer


def _inputs(built: _Built, site: AutoSite) -> dict:
    bound = 1
    if site.call.positions is not None:  # gathered tables: positions below the cache's rows
        bound = int(site.call.cos.meta["val"].shape[0])
    real = {}
    for n in dict.fromkeys([*built.left_inputs, *built.upstream_inputs]):
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise NotMeasured(f"the region's input {n.name} is not a tensor")
        if val.device.type == "meta":
            raise NotMeasured("meta tensors: no device to time on")
        real[n] = _real(val, bound)
    return real


def measure(site: AutoSite, candidates: list[str], cuda_graphs: bool, built: _Built | None = None) -> Decision:
    """Compile and time every candidate; the decision by `MARGIN`. Raises on any failure (the caller falls back)."""
    built = built or build(site, cuda_graphs)
    timer = TIMER or default_timer(cuda_graphs)
    timings: dict = {}
    device = site.call.xs[0].meta["val"].device
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with _standalone(), on_device:
        real = _inputs(built, site)
        for name in ["left", *candidates]:
            run = _runner(name, built, site, real)
            if run is not None:
                timings[name] = timer(name, run) * 1e6
    if "left" not in timings or len(timings) < 2:
        raise NotMeasured("no fused candidate could be timed")
    return Decision(pick(timings), timings, MARGIN)


def pick(timings: dict) -> str:
    """The fastest fused candidate where it takes at most (1 - MARGIN) of "left"'s time, else "left"."""
    best = min((k for k in timings if k != "left"), key=timings.get)
    return best if timings[best] <= (1 - MARGIN) * timings["left"] else "left"


def device_available(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu"


def decide(site: AutoSite, device: torch.device, candidates: list[str], cuda_graphs: bool) -> Outcome:
    """Measured (or cached) choice for one site; Outcome(None, "table", why) where it cannot be measured."""
    try:
        if not device_available(device.type):
            raise NotMeasured(f"no {device.type} device here to time on (fake tensors)")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise NotMeasured("compiled inside a CUDA graph capture")
        built = build(site, cuda_graphs)
        key = auto_decisions.decision_key(device, built.signature)
        cached = auto_decisions.DECISIONS.get(key)
        if cached is not None:
            STATS["cached"] += 1
            return Outcome(cached.choice, "cached", _text("cached", cached))
        decision = measure(site, candidates, cuda_graphs, built)
        STATS["timed"] += 1
        try:
            auto_decisions.DECISIONS.put(key, decision)
        except OSError as e:  # a read-only cache dir: measured again next time, the choice stands
            log.warning("rope_fusion: measured decision not cached: %s", e)
        return Outcome(decision.choice, "measured", _text("measured", decision))
    except Exception as e:  # never a reason to fail the compile: the table decides
        STATS["table"] += 1
        why = str(e) if isinstance(e, NotMeasured) else f"timing failed: {type(e).__name__}: {e}"
        log.debug("rope_fusion: site not measured (%s)", why)
        return Outcome(None, "table", why)


def _text(how: str, d: Decision) -> str:
    rule = f"a fused choice must beat left by {d.margin:.0%}"
    return f"{how} {d.describe()}, chose {d.choice} ({rule})"


__all__ = ["AutoSite", "MARGIN", "NotMeasured", "Outcome", "STATS", "TIMER", "decide", "default_timer", "enabled",
           "measure", "measured_device", "measuring", "pick", "region"]
