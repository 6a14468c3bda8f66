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

A group whose rotations are written back into the slices their x is read from (CogVideoX, passes/folds/slice_writes.py)
is timed with its writes: "left" and "inductor" end with the `slice_scatter`s, which Inductor fuses into the
rotation, and with the `copy_` into a graph input that the graph writes them back to; "triton" is the fold the
emission makes of it, the in-place op `rope_fusion::rotary*_slice_` on the bases (on a clone of a base the graph
reads again, as Inductor's reinplacing does). Timed without the scatter it removes, the kernel was compared with a
rotation that plain compile writes into the base for free: `auto` left the CogVideoX-5B-shape rows, where the fold
takes 0.55x plain compile's GPU time.

Each runs the way the compiled graph will: replayed in a CUDA graph when the pass's `replayed_in_cuda_graphs()`,
else called in a timed loop with its launches (host time included, one synchronize at the end). A fused candidate
is taken only when it is faster than "left" by `MARGIN` (2%): below that the timings cannot tell them apart, and
leaving a site is never slower than plain torch.compile. Decisions are cached on disk by site signature
(passes/auto/auto_decisions.py), so a warm compile times nothing.

Each fused candidate's first outputs under the timer are compared with "left"'s on the same inputs
(passes/fusion_check.py): one that breaks the numbers contract is refused, its timing dropped, with a WARNING; where
no fused candidate is left to win, the site stays as the model wrote it, its near miss "the fused form disagreed
with the model's code on this device: ...". A decision with a refusal is not cached, so that every compile checks
and warns again.

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
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import fusion_check
from . import auto_budget, auto_consumers, auto_decisions
from .auto_clock import default_timer
from .auto_decisions import Decision
from .auto_region import NotMeasured, canonical, copy_region, region, starts_region

log = logging.getLogger("rope_fusion")
aten = torch.ops.aten

MARGIN = 0.02  # a fused candidate must take at most (1 - MARGIN) of "left"'s time
ENV = "ROPE_FUSION_MEASURE"  # "0" turns measuring off

# Device types whose compiles measure. CUDA only by default (CPU and NPU compiles keep their fixed choice);
# tests add "cpu" so that extraction, standalone compiles and timing really run.
_MEASURE_DEVICE_TYPES: tuple = ("cuda",)

# timer(candidate, run) -> seconds per call of `run`; None: auto_clock's `default_timer`. Tests replace it to steer
# choices.
TIMER: Callable[[str, Callable[[], Any]], float] | None = None

# "timed" signatures, "cached" hits, "table" fallbacks, "clear" sites the budget left unmeasured, "over allowance"
# signatures the compile's allowance could not pay for (auto_budget.py)
STATS: collections.Counter = collections.Counter()
# seconds spent measuring, by phase: "inputs", "compile <candidate>", "timing" (what a cold compile pays for `auto`)
SECONDS: collections.Counter = collections.Counter()

_STATE = threading.local()
_WARNED: set = set()  # kinds of timing failures logged as a warning (once each)

def measuring() -> bool:
    """Whether this thread is compiling a candidate: the pass must do nothing there."""
    return getattr(_STATE, "depth", 0) > 0


@dataclasses.dataclass
class AutoSite:
    """A site as measuring needs it (passes/emission.py `plan_group` builds it before choosing): the group's
    matches (their nodes are the outputs the op replaces) and the op's call on graph nodes."""

    group: tuple
    call: Any  # RotaryCall whose tensors are nodes of the graph
    writes: list | None = None  # per member its slice_writes.SliceWrite, where the group is a fold of them
    joins: Any = None  # fold_cat.JoinPlan: the cat op's call on the pieces, where x is a join the kernel reads
    joined: list | None = None  # per member its joined_writes.JoinedWrite, where the rotations are joined after it
    # the fold that claimed the group (passes/folds/fold_registry.py): a candidate whose backend takes it is timed by
    # the fold's runner, or as the plain kernel where it has none
    fold: Any = None

    @property
    def outputs(self) -> list:
        """The nodes whose values the candidates compute: the written bases (the scatters) of a fold, else the
        rotations."""
        if self.writes:
            return [w.scatter for w in self.writes]
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
    base_slots: list = dataclasses.field(default_factory=list)  # per slice write: its base in upstream's outputs
    pieces: fx.Graph | None = None  # computes the cat op's tensors (a join's pieces, their weights, the tables)
    pieces_inputs: list = dataclasses.field(default_factory=list)
    pieces_outputs: list = dataclasses.field(default_factory=list)  # the nodes pieces returns, in order
    down: Any = None  # auto_consumers.Downstream: what plain compile fuses after the site, timed with every candidate


_SLOTS = ("xs", "cos", "sin", "positions", "norm_weights")


def _call_tensors(call: Any) -> list:
    ws = call.norm_weights or []
    return [*call.xs, call.cos, call.sin, call.positions, *ws]


def build(site: AutoSite, cuda_graphs: bool) -> _Built:
    if site.call.cu_seqlens is not None or site.call.seqlen_offsets is not None:
        # the candidates below pass x, the tables, positions and weights; a packed call's rows come from its
        # sequence starts, which they would drop
        raise NotMeasured("packed sequences (cu_seqlens): not timed")
    for o in site.outputs:
        if starts_region(o):  # a rotary kernel already in the graph: no region of its own to time
            raise NotMeasured(f"{o.name} is a rotary kernel already in the graph, not arithmetic")
    # the consumers plain compile fuses after the site (passes/auto/auto_consumers.py); a fold times its own writes
    down = None if site.writes or site.joins else auto_consumers.downstream(site, through_cat=_cat_after(site))
    body, inputs = region(down.needed if down else site.outputs)
    left, env = copy_region(body, inputs)
    # a base that is a graph input the graph writes back: plain compile copies the scatter into it
    backs = [left.call_function(aten.copy_.default, (env[w.base], env[w.scatter])) for w in site.writes or []
             if _written_back(w)]
    left.output((down.returns(left, env) if down else tuple(env[o] for o in site.outputs)) + tuple(backs))
    writes = site.writes or []
    tensors = [t for t in _call_tensors(site.call) if t is not None] + [w.base for w in writes]
    ubody, uinputs = region(list(dict.fromkeys(tensors)))
    upstream, uenv = copy_region(ubody, uinputs)
    outs = list(dict.fromkeys(tensors))
    upstream.output(tuple(uenv[t] for t in outs))
    slots = [outs.index(t) if t is not None else None for t in _call_tensors(site.call)]
    base_slots = [outs.index(w.base) for w in writes]
    pieces, pinputs, pouts, joined = None, [], [], ""
    if site.joins is not None:  # the cat op reads the pieces: its tensors from what is in memory, not the join
        j, c = site.joins, site.call
        pouts = list(dict.fromkeys(t for t in (*j.firsts, *j.seconds, *(j.weights or ()), *j.second_weights, c.cos,
                                               c.sin, c.positions) if t is not None))
        pbody, pinputs = region(pouts)
        pieces, penv = copy_region(pbody, pinputs)
        pieces.output(tuple(penv[t] for t in pouts))
        joined = f"joins {j.params} dims {j.dims}\n{canonical(pieces)}"
    params = site.call.params
    text = "\n".join([f"params {params}", f"arity {len(site.call.xs)} weights {site.call.norm_weights is not None}",
                      f"slots {slots}", f"cuda_graphs {int(cuda_graphs)}",
                      f"writes {[(w.dim, w.start, w.end, _clones(w)) for w in writes]}",
                      f"joined {[(w.dim, w.start, w.end, _join_geometry(w)) for w in site.joined or []]}",
                      "left:", canonical(left),
                      "upstream:", canonical(upstream), joined])
    return _Built(left, inputs, upstream, uinputs, slots, hashlib.sha256(text.encode()).hexdigest()[:32],
                  base_slots, pieces, pinputs, pouts, down)


def _cat_after(site: AutoSite) -> bool:
    """Whether a `cat` after the rotation is a consumer to time: not where a fold claimed the group. The joined
    write's candidates are then the rotations alone ("left", the lowering: the kernel Inductor fuses into the
    join's buffer) against the into op writing into that buffer (`joined_write_runner`), the copies of the other
    pieces, the same in both, in neither."""
    return site.fold is None


def _written_back(write: Any) -> bool:
    """Whether the graph copies the written base into the tensor it was read from (`copy_(input, scatter)`: a
    function that writes its input, `q[:, :, t:] = rope(q[:, :, t:])` on a q it was given)."""
    return write.base.op == "placeholder" and any(
        u.target is aten.copy_.default and u.args[0] is write.base for u in write.scatter.users)


def _clones(write: Any) -> bool:
    """Whether Inductor writes a fold into a clone of its base: where the graph reads the base's old values again
    (a user other than the slices of it and the scatter), or the base is a graph input the graph does not write
    back (`copy_` of the scatter into it)."""
    base, scatter = write.base, write.scatter
    written_back = _written_back(write)
    if any(u is not scatter and u.target is not aten.slice.Tensor
           and not (written_back and u.target is aten.copy_.default and u.args[1] is scatter) for u in base.users):
        return True
    return base.op == "placeholder" and not written_back


def _runner(name: str, built: _Built, site: AutoSite, real: dict) -> Callable[[], Any] | None:
    """The compiled candidate as a no-argument call: "left", else the fold's runner where the candidate's backend
    takes the fold that claimed the site, else the backend's plain runner."""
    if name == "left":
        return _compile(built.left, [real[n] for n in built.left_inputs])
    from ...ops.backends import get_backend

    backend = get_backend(name)
    if site.fold is not None and site.fold.runner is not None and backend is not None \
            and site.fold.name in backend.folds:
        return site.fold.runner(built, site, real)
    plain = _PLAIN_RUNNERS.get(name)
    if plain is None:
        raise NotMeasured(f"no way to time the candidate {name!r}")
    return plain(built, site, real)


def _lowering_runner(built: _Built, site: AutoSite, real: dict) -> Callable[[], Any]:
    """The op after the same input nodes, lowered by Inductor: one graph, as in the fused compile."""
    from ...ops.op_definition import OPS

    down = [real[n] for n in built.down.inputs] if built.down else []
    return _compile(_with_op(built, site, OPS), [real[n] for n in built.upstream_inputs] + down)


def _device_kernel_runner(built: _Built, site: AutoSite, real: dict) -> Callable[[], Any]:
    """The op's device kernel (the Triton kernel on CUDA) launched directly after the nodes of its inputs, then the
    consumers after it."""
    from ...ops.schema import RotaryCall

    arity = len(site.call.xs)
    has_weights = site.call.norm_weights is not None

    def call_of(outs: list) -> RotaryCall:
        vals = [outs[i] if i is not None else None for i in built.call_slots]
        return RotaryCall(vals[:arity], vals[arity], vals[arity + 1], site.call.params, vals[arity + 2],
                          vals[arity + 3:] if has_weights else None)
    return _after(built, real, _kernel_runner(built, [real[n] for n in built.upstream_inputs], call_of))


# per backend, how its candidate runs where no fold of its takes the site
_PLAIN_RUNNERS: dict[str, Callable[[_Built, AutoSite, dict], Callable[[], Any]]] = {
    "inductor": _lowering_runner, "triton": _device_kernel_runner}


def _kernel_runner(built: _Built, args: list, call_of: Callable) -> Callable[[], Any]:
    """The kernel's direct launch after the nodes that compute its arguments (compiled unless they are views of
    the inputs)."""
    from ...ops.device_runners import device_runner

    fixed = _views_of_inputs(built.upstream, args)
    if fixed is not None:  # nothing to compute before the kernel: its arguments are views of the inputs
        c = call_of(fixed)
        run = device_runner(c)
        return lambda: run(c.xs, c.cos, c.sin, c.positions, c.norm_weights)
    up = _compile(built.upstream, args)
    run = device_runner(call_of(list(up())))

    def triton_run() -> Any:
        c = call_of(list(up()))
        return run(c.xs, c.cos, c.sin, c.positions, c.norm_weights)
    return triton_run


def _after(built: _Built, real: dict, run: Callable[[], Any]) -> Callable[[], Any]:
    """run, then the consumers plain compile fuses after the site, compiled on their own: Inductor cannot fuse
    them into the kernel's opaque node (passes/auto/auto_consumers.py)."""
    if built.down is None:
        return run
    from torch._inductor.compile_fx import compile_fx

    others = [real[n] for n in built.down.inputs]
    first = built.down.shaped(list(run()))
    consumers = compile_fx(fx.GraphModule({}, built.down.graph), [*first, *others])
    return lambda: consumers(*built.down.shaped(list(run())), *others)


def _planned_launch(call: Any, n: int, tensors: list, views: list, into: bool, direct: list) -> bool:
    """The slice or into call run as the kernel's own node runs it (`slice_write.node_runner`: its planned launch,
    no dispatcher), decided on the first call's real tensors and kept in `direct`; False where the pass emits the op
    instead (the caller then calls it). `tensors`: the call's own, in the op's order after the written ones (the
    into op's sources first), trailing Nones dropped."""
    from ...ops.schema import RotaryCall
    from ...ops.slice_write import node_runner

    rest = [*tensors, *[None] * (2 * n + 3)]  # the trailing Nones back: every slot below exists
    xs = rest[:n] if into else views
    cos, sin, positions = rest[n:n + 3] if into else rest[:3]
    weights = (rest[n + 3:2 * n + 3] if into else rest[3:3 + n]) if call.norm_weights is not None else None
    if not direct:
        planned = RotaryCall(list(xs), cos, sin, call.params, positions, weights)
        direct.append(node_runner(planned, list(views) if into else None))
    if direct[0] is None:
        return False
    direct[0](list(xs), cos, sin, positions, weights, list(views) if into else None)
    return True


def slice_write_runner(built: _Built, site: AutoSite, args: list) -> Callable[[], Any]:
    """The slice-write fold as the graph runs it: the upstream nodes, then the rotation of the bases' slices in
    place (a clone of a base that Inductor would clone): the kernel's planned launch where the pass emits its own
    node (`_planned_launch`), else the in-place op through the dispatcher, as Inductor's fallback kernel calls it.
    The bases are written on every call, so their values drift; nothing reads them but the next call."""
    from ...ops.slice_write import SLICE_OPS

    n = len(site.writes)
    op = SLICE_OPS[n - 1]
    names = [a.name for a in op._schema.arguments]
    clones = [_clones(w) for w in site.writes]
    bounds = {"slice_dims": [w.dim for w in site.writes], "slice_starts": [w.start for w in site.writes],
              "slice_ends": [w.end for w in site.writes]}
    up = _upstream(built.upstream, args)
    direct: list = []

    def fold_run() -> Any:
        outs = list(up())
        bases = [outs[i].clone() if c else outs[i] for i, c in zip(built.base_slots, clones)]
        rest = [outs[i] if i is not None else None for i in built.call_slots][n:]
        while rest and rest[-1] is None:
            rest.pop()
        views = [b.narrow(w.dim, w.start, w.end - w.start) for b, w in zip(bases, site.writes)]
        if _planned_launch(site.call, n, rest, views, False, direct):
            return bases
        kwargs = dict(zip(names, bases + rest))
        kwargs.update(site.call.params.kwargs(), **bounds)
        op(**kwargs)
        return bases
    return fold_run


def _join_geometry(write: Any) -> tuple:
    """(shape, strides, dtype) of the tensor a joined write writes into: the join's, or the member's own (a
    contiguous tensor of its shape in the op's out dtype, dtype None) where it is not joined."""
    if write.cat is None:
        return tuple(write.shape), None, None
    val = write.cat.meta["val"]
    return tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride()), val.dtype


def joined_write_runner(built: _Built, site: AutoSite, args: list) -> Callable[[], Any]:
    """The joined write as the graph runs it: the upstream nodes, then each rotation written into its rows of a new
    tensor of the join's shape and strides, which the graph allocates on every call: the kernel's planned launch
    where the pass emits its own node (`_planned_launch`), else the into op through the dispatcher (as Inductor's
    fallback kernel calls it). The rows are what it returns, the rotations' values."""
    from ...ops.slice_write import INTO_OPS

    joined = site.joined
    n = len(joined)
    op = INTO_OPS[n - 1]
    names = [a.name for a in op._schema.arguments]
    params = site.call.params
    geometry = [_join_geometry(w) for w in joined]
    bounds = {"slice_dims": [w.dim for w in joined], "slice_starts": [w.start for w in joined],
              "slice_ends": [w.end for w in joined]}
    up = _upstream(built.upstream, args)
    direct: list = []

    def into_run() -> Any:
        outs = list(up())
        device = outs[0].device
        bases = [torch.empty(shape, dtype=params.out_dtype, device=device) if strides is None else
                 torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype in geometry]
        rest = [outs[i] if i is not None else None for i in built.call_slots]
        while rest and rest[-1] is None:
            rest.pop()
        rows = [b if w.cat is None else b.narrow(w.dim, w.start, w.end - w.start) for b, w in zip(bases, joined)]
        if _planned_launch(site.call, n, rest, rows, True, direct):
            return rows
        kwargs = dict(zip(names, bases + rest))
        kwargs.update(params.kwargs(), **bounds)
        op(**kwargs)
        return rows
    return into_run


def cat_runner(built: _Built, site: AutoSite, args: list) -> Callable[[], Any]:
    """The cat fold as the graph runs it: the pieces' nodes (compiled by Inductor unless they are views of the
    inputs), then the kernel's launch on them where the pass emits the kernel's own node
    (`cat_rotary.node_runner`: the Triton kernel's user-kernel node, launched from the graph's code), else the cat
    op through the dispatcher, as Inductor's fallback kernel calls it."""
    from ...ops.cat_rotary import CAT_OPS, CatCall, node_runner
    from ...ops.schema import RotaryCall

    j, c = site.joins, site.call
    up = _upstream(built.pieces, args)
    index = {n: i for i, n in enumerate(built.pieces_outputs)}
    op = CAT_OPS[len(j.firsts) - 1]
    extra = {"second_pieces": j.seconds, "second_norm_weights": j.second_weights}
    direct: list = []  # [the node's runner, or None], decided on the first call's real tensors

    def joins_run() -> Any:
        outs = up()

        def val(t: Any) -> Any:
            return outs[index[t]] if isinstance(t, fx.Node) else t
        rot = RotaryCall([val(x) for x in j.firsts], val(c.cos), val(c.sin), j.params, val(c.positions),
                         [val(w) for w in j.weights] if j.weights else None)
        pieces = {k: [val(t) for t in v] for k, v in extra.items()}
        cat = CatCall(rot, pieces["second_pieces"], pieces["second_norm_weights"], list(j.dims))
        if not direct:
            direct.append(node_runner(cat))
        if direct[0] is not None:
            return direct[0](cat)
        return op(*rot.tensors(), **j.params.kwargs(), **pieces, cat_dims=list(j.dims))
    return joins_run


def _upstream(g: fx.Graph, args: list) -> Callable[[], Any]:
    """The graph's outputs as a call: its views of the inputs taken once where that is all it does, else the graph
    compiled by Inductor."""
    fixed = _views_of_inputs(g, args)
    return (lambda: fixed) if fixed is not None else _compile(g, args)


def _views_of_inputs(g: fx.Graph, args: list) -> list | None:
    """The graph's outputs, run eagerly once, where every node is a view and every output shares an input's
    storage (nothing the compiled graph would compute or copy); else None."""
    if not all(n.op in ("placeholder", "output") or getattr(n.target, "is_view", False) for n in g.nodes):
        return None
    outs = list(fx.GraphModule({}, g)(*args))
    storages = {a.untyped_storage().data_ptr() for a in args}
    if not all(o.untyped_storage().data_ptr() in storages for o in outs if isinstance(o, torch.Tensor)):
        return None
    return outs


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
    if site.writes:  # each rotation written into its base, which Inductor fuses into the op's lowering
        rotated = [node] if arity == 1 else [g.call_function(operator.getitem, (node, i)) for i in range(arity)]
        node = tuple(g.call_function(aten.slice_scatter.default, (outs[b], r, w.dim, w.start, w.end))
                     for b, r, w in zip(built.base_slots, rotated, site.writes))
        node += tuple(g.call_function(aten.copy_.default, (outs[b], sc))
                      for b, sc, w in zip(built.base_slots, node, site.writes) if _written_back(w))
    elif built.down is not None:  # the consumers after it, in the same graph: Inductor fuses them with the lowering
        node = built.down.attach(g, [node] if arity == 1 else
                                 [g.call_function(operator.getitem, (node, i)) for i in range(arity)])
    g.output(node)
    return g


def _inputs(built: _Built, site: AutoSite) -> dict:
    bound = 1
    if site.call.positions is not None:  # gathered tables: positions below the cache's rows
        bound = int(site.call.cos.meta["val"].shape[0])
    real = {}
    down = built.down.inputs if built.down else []
    for n in dict.fromkeys([*built.left_inputs, *built.upstream_inputs, *built.pieces_inputs, *down]):
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise NotMeasured(f"the region's input {n.name} is not a tensor")
        if val.device.type == "meta":
            raise NotMeasured("meta tensors: no device to time on")
        real[n] = _real(val, bound)
    return real


def measure(site: AutoSite, candidates: list[str], cuda_graphs: bool, built: _Built | None = None,
            policy: Any = "auto") -> Decision:
    """Compile and time every candidate; the decision by `MARGIN`. Raises on any failure (the caller falls back)."""
    built = built or build(site, cuda_graphs)
    device = site.call.xs[0].meta["val"].device
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    refusals: dict = {}  # candidates whose outputs broke the numbers contract against left's (fusion_check)
    with _standalone(), on_device:
        t0 = time.perf_counter()
        real = _inputs(built, site)
        check = fusion_check.CandidateCheck(built.left, [real[n] for n in built.left_inputs], len(site.outputs),
                                            list(real.values()))
        SECONDS["inputs"] += time.perf_counter() - t0
        runs = {}
        for name in ["left", *candidates]:
            t0 = time.perf_counter()
            run = _runner(name, built, site, real)
            SECONDS[f"compile {name}"] += time.perf_counter() - t0
            if run is not None:
                runs[name] = check.observed(name, run)
        # how long each is timed: passes/auto/auto_budget.py (a candidate's first call, its JIT, included)
        t0 = time.perf_counter()
        timings = auto_budget.time_runs(
            runs, lambda t: TIMER or default_timer(cuda_graphs, t.repeats, t.target_seconds), MARGIN, policy)
        SECONDS["timing"] += time.perf_counter() - t0
        for name in list(timings):  # "left" first: its outputs are the reference the others are judged by
            why = check.refusal(name)
            if why is not None:
                refusals[name] = why
                del timings[name]
    if "left" not in timings or (len(timings) < 2 and not refusals):
        raise NotMeasured("no fused candidate could be timed")
    decision = Decision(pick(timings) if len(timings) > 1 else "left", timings, MARGIN, refusals)
    if decision.choice == "left" and refusals:  # a refused candidate might have won: the site stays, and says why
        raise fusion_check.refused(refusals, f"measured {decision.describe()}")
    return decision


def pick(timings: dict) -> str:
    """The fastest fused candidate where it takes at most (1 - MARGIN) of "left"'s time, else "left"."""
    best = min((k for k in timings if k != "left"), key=timings.get)
    return best if timings[best] <= (1 - MARGIN) * timings["left"] else "left"


def device_available(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu"


def decide(site: AutoSite, device: torch.device, candidates: list[str], cuda_graphs: bool,
           policy: Any = "auto", allowance: auto_budget.Allowance | None = None) -> Outcome:
    """Measured (or cached) choice for one site; Outcome(None, "table", why) where it cannot be measured, and
    "left" where no decision is cached and the compile's `allowance` (None: no limit) cannot pay for measuring."""
    try:
        if not device_available(device.type):
            raise NotMeasured(f"no {device.type} device here to time on (fake tensors)")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise NotMeasured("compiled inside a CUDA graph capture")
        t0 = time.perf_counter()
        built = build(site, cuda_graphs)
        SECONDS["build"] += time.perf_counter() - t0
        key = auto_decisions.decision_key(device, built.signature)
        cached = auto_decisions.DECISIONS.get(key)
        if cached is not None:
            STATS["cached"] += 1
            return Outcome(cached.choice, "cached", _text("cached", cached))
        if allowance is not None and not allowance.affords(len(candidates)):
            STATS["over allowance"] += 1
            return Outcome("left", "table", allowance.refusal(len(candidates)))
        t0 = time.perf_counter()
        try:
            decision = measure(site, candidates, cuda_graphs, built, policy)
        finally:
            if allowance is not None:
                allowance.spend(time.perf_counter() - t0)
        STATS["timed"] += 1
        try:
            if not decision.refused:  # a refusal is checked (and warned of) again on every compile
                auto_decisions.DECISIONS.put(key, decision)
            else:
                STATS["not cached (refused)"] += 1
        except OSError as e:  # a read-only cache dir: measured again next time, the choice stands
            log.warning("rope_fusion: measured decision not cached: %s", e)
        return Outcome(decision.choice, "measured", _text("measured", decision))
    except fusion_check.FusionDisagreed:  # every fused form that could win computes other numbers: not fused
        raise
    except Exception as e:  # never a reason to fail the compile: the table decides
        STATS["table"] += 1
        why = str(e) if isinstance(e, NotMeasured) else f"timing failed: {type(e).__name__}: {e}"
        if isinstance(e, NotMeasured) or type(e).__name__ in _WARNED:
            log.debug("rope_fusion: site not measured (%s)", why)
        else:  # unexpected: once per kind, so a GPU run shows it without the report
            _WARNED.add(type(e).__name__)
            log.warning("rope_fusion: auto could not time a site, the factor table decides (%s)", why,
                        exc_info=log.isEnabledFor(logging.DEBUG))
        return Outcome(None, "table", why)


def _text(how: str, d: Decision) -> str:
    rule = f"a fused choice must beat left by {d.margin:.0%}"
    refused = "".join(f"; refused {name}: {why}" for name, why in d.refused.items())
    return f"{how} {d.describe()}, chose {d.choice} ({rule}){refused}"


__all__ = ["AutoSite", "MARGIN", "NotMeasured", "Outcome", "SECONDS", "STATS", "TIMER", "cat_runner", "decide",
           "enabled", "measure", "measured_device", "measuring", "pick", "region", "slice_write_runner"]
