"""The self-check of every fusion: the fused form must compute what the model's code computes, on real numbers.

The pass proves that a subgraph is a rotation, and a backend turns the proof into a kernel, a lowering or a call
of another library's op. A proof is only as good as the code that acts on it: a kernel that flips a sign on one
device, a planner that gets a stride wrong, a vendor op whose semantics differ from its documentation. Users of
fused RoPE kernels keep meeting such bugs (wrong interleaved MRoPE under compile, a rotary custom op with wrong
values), and none of them fails a compile. So the fused form is evaluated against the model's own code:

- where `auto` times its candidates on the device (passes/auto/auto_timing.py), each fused candidate's outputs are
  compared with "left"'s, the site's region as plain Inductor compiles it, on the inputs the timing builds (the
  site's shapes, strides and dtypes): `CandidateCheck`. A candidate that disagrees is not timed;
- with `RopeFusionPass(verify=True)` or ROPE_FUSION_VERIFY=1 (the test suite sets it), every planned group is
  evaluated eagerly on random inputs of its geometry before it is committed: the replaced region as the graph
  has it, and the nodes the pass emitted in its place: `verify_group`. Nothing new is compiled. On a GPU the
  emitted nodes run as they will (the kernel's user-kernel node, the in-place slice op); on the CPU the op runs
  its reference whatever kernel is registered (`op_definition.reference_kernels`): the lowering that a CPU compile
  runs is Inductor's code of the same semantics, and the only other CPU kernel is the tests' interpreted Triton
  kernel, which costs a second a call and has tests of its own. What the CPU check proves is the emission: the
  views of x and the tables, the options, a folded norm, the writes into slices and joins.

Either way the judge is the numbers contract (docs/design.md section 2): against an fp64 evaluation of the
model's region (its floating dtypes widened to fp64), the fused result's relative error may exceed the model's
own by one rounding in the output dtype or in the narrowest dtype the region computes in, whichever is coarser
(the fuzz harness's rule), and no entry may be further off than the model's worst entry plus that rounding of the
largest entry. A fused form that fails it is refused: `FusionDisagreed`, a near miss "the fused form disagreed
with the model's code on this device: max err ...", and a WARNING. A check that cannot run (values the random
inputs make non-finite in the model's own code, an index the random positions take out of range, an op that has
no eager kernel here) refuses nothing and is counted in `STATS["skipped"]`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from ..ops.backends import LeftToInductor
from ..ops.op_definition import reference_kernels
from .auto.auto_region import starts_region, walk_region

log = logging.getLogger("rope_fusion")
aten = torch.ops.aten

ENV = "ROPE_FUSION_VERIFY"  # "1" checks every fused group eagerly (RopeFusionPass(verify=None) reads it)
MAX_NODES = 2048  # a region larger than this is not evaluated (skipped)
SEED = 0  # the random inputs are drawn from this seed: a compile decides the same way every time

# "checked" fused forms compared, "refused" of them, "skipped" checks that could not run; "seconds" spent
STATS: collections.Counter = collections.Counter()

PHRASE = "the fused form disagreed with the model's code on this device"


class FusionDisagreed(LeftToInductor):
    """The fused form of a site computed other numbers than the model's code: the site stays as the model wrote
    it. Its text is the near miss the report gives."""


def enabled(option: bool | None) -> bool:
    """Whether the pass verifies every group: the option, else the environment switch."""
    if option is not None:
        return option
    return os.environ.get(ENV, "0").strip() not in ("", "0")


# -- the contract ---------------------------------------------------------------------------------------------

def _real_view(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _eps(dtype: torch.dtype) -> float:
    if dtype.is_complex:
        dtype = _real_view(torch.empty((), dtype=dtype)).dtype
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def narrowest_eps(nodes: list) -> float:
    """One rounding in the narrowest floating dtype among the fake values of `nodes` (0.0 for none)."""
    found = [_eps(v.dtype) for n in nodes for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)]
    return max(found, default=0.0)


def disagreement(fused: list, left: list, ref: list | None, math_eps: float = 0.0) -> str | None:
    """Why `fused` breaks the numbers contract against `left` (the model's code) and `ref` (its fp64 evaluation;
    None: `left` is the reference and the bound is twice the rounding), or None where it holds or cannot be
    judged (the model's own result is not finite)."""
    for i, (f, lo) in enumerate(zip(fused, left)):
        if tuple(f.shape) != tuple(lo.shape):
            f = f.reshape(lo.shape)
        f64, l64 = (_real_view(t).to(torch.float64) for t in (f, lo))
        r64 = _real_view(ref[i]).to(torch.float64) if ref is not None else l64
        if not bool(torch.isfinite(l64).all()) or not bool(torch.isfinite(r64).all()):
            continue  # the model's own code is not finite on these inputs: nothing to judge by
        eps = max(_eps(lo.dtype), math_eps) * (1 if ref is not None else 2)
        scale = float(r64.abs().max()) if r64.numel() else 0.0
        norm = max(float(torch.linalg.vector_norm(r64)), 1e-300)
        err_f = float(torch.linalg.vector_norm(f64 - r64)) / norm
        err_l = float(torch.linalg.vector_norm(l64 - r64)) / norm
        worst_f = float((f64 - r64).abs().max()) if f64.numel() else 0.0
        worst_l = float((l64 - r64).abs().max()) if l64.numel() else 0.0
        if not (err_f <= err_l + eps) or not (worst_f <= worst_l + eps * scale):
            diff = float((f64 - l64).abs().max()) if f64.numel() else float("nan")
            return (f"{PHRASE}: max err {diff:.3g} against it (output {i}; rel. err {err_f:.3g} against fp64, the "
                    f"model's {err_l:.3g}, the contract's bound {err_l + eps:.3g})")
    return None


# -- eager evaluation --------------------------------------------------------------------------------------------

def _widen_dtype(a: Any) -> Any:
    if isinstance(a, torch.dtype):
        if a.is_complex:
            return torch.complex128
        if a.is_floating_point:
            return torch.float64
    return a


def widened(t: Any) -> Any:
    """A floating tensor in fp64 (complex in complex128) with t's layout over a widened copy of its storage, so
    that strided reads of it (as_strided, overlapping rows) read the same entries; anything else as it is."""
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
        return t
    wide = _widen_dtype(t.dtype)
    size = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (size,), (1,))
    return flat.to(wide).as_strided(t.shape, t.stride(), t.storage_offset())


def evaluate(body: list, env: dict, outputs: list, wide: bool = False) -> list:
    """The values of `outputs`: `body` (call_function nodes in topological order) run eagerly on `env` (their
    inputs' values). `wide`: every floating dtype the nodes name is fp64 (a view as another dtype excepted)."""
    env = dict(env)
    for n in body:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        if wide and n.target is not aten.view.dtype:
            args, kwargs = fx.node.map_aggregate((args, kwargs), _widen_dtype)
        env[n] = n.target(*args, **kwargs)
    return [env[o] for o in outputs]


def _flat(out: Any, kind: type) -> list:
    """The leaves of type `kind` in a (nested) list or tuple, in order: a region's tensors, or its output nodes."""
    if isinstance(out, kind):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o, kind)]
    return []


_STATE = threading.local()


def checking() -> bool:
    """Whether this thread is evaluating a fused form for the check now (a stand-in kernel that logs its calls
    can leave these out: they are the compile's, not the compiled graph's)."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def _real_numbers() -> Iterator[None]:
    """Real tensors inside the pass: no fake mode, no tracing context, no autograd."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        with unset_fake_temporarily(), torch._guards.tracing(None), torch.no_grad():
            yield
    finally:
        _STATE.depth -= 1


def _refuse(why: str, where: str) -> FusionDisagreed:
    STATS["refused"] += 1
    log.warning("rope_fusion: %s refused, left as the model wrote it: %s", where, why)
    return FusionDisagreed(why)


# -- `auto`'s candidates on the device -----------------------------------------------------------------------------

class CandidateCheck:
    """Compares `auto`'s fused candidates with "left" on the inputs `auto` times them on, by their first outputs
    under the timer: no candidate runs once more for the check.

    `left` is the site's region as a standalone graph, `inputs` its real input values, `n` the outputs that are the
    site's (a written-back graph input's `copy_` follows them), and `tensors` every real input of any candidate.
    Their storages are restored before each candidate's first call: a slice-write fold writes its bases in place,
    and "left" writes a written-back input, so the runs of the timing loop drift, but each first call starts from
    the same numbers."""

    def __init__(self, left: fx.Graph, inputs: list, n: int, tensors: list) -> None:
        start = time.perf_counter()
        self.left_graph, self.left_inputs, self.n = left, inputs, n
        self.saved = [(t, t.untyped_storage().clone()) for t in {id(t): t for t in tensors}.values()]
        self.first: dict = {}  # candidate -> its first call's outputs (the site's)
        self.ref: list | None = None
        self.math_eps = narrowest_eps(list(left.nodes))
        STATS["seconds"] += time.perf_counter() - start

    def _restore(self) -> None:
        for t, storage in self.saved:
            t.untyped_storage().copy_(storage)

    def observed(self, name: str, run: Callable[[], Any]) -> Callable[[], Any]:
        """`run` for the timer, its first call on the restored inputs and its outputs kept."""
        def first_call() -> Any:
            if name in self.first:
                return run()
            start = time.perf_counter()
            self._restore()
            STATS["seconds"] += time.perf_counter() - start
            out = run()
            start = time.perf_counter()
            self.first[name] = [t.clone() for t in _flat(out, torch.Tensor)[: self.n]]
            STATS["seconds"] += time.perf_counter() - start
            return out
        return first_call

    def refusal(self, name: str) -> str | None:
        """After the timer ran candidate `name`: None when it may be taken ("left" always; a candidate the timer
        never called, or whose outputs do not line up with left's, is not judged), else the near miss."""
        start = time.perf_counter()
        try:
            if name == "left":
                self.ref = self._reference()
                return None
            fused, left = self.first.get(name), self.first.get("left")
            try:
                if fused is None or left is None:
                    raise ValueError("the timer did not call it")
                why = disagreement(fused, left, self.ref, self.math_eps)
            except Exception as e:
                STATS["skipped"] += 1
                log.debug("rope_fusion: candidate %r not checked: %s: %s", name, type(e).__name__, e)
                return None
            STATS["checked"] += 1
            if why is not None:
                _refuse(why, f"auto's candidate {name!r}")
            return why
        finally:
            STATS["seconds"] += time.perf_counter() - start

    def _reference(self) -> list | None:
        """The fp64 evaluation of "left"'s region on the inputs as its first call read them, None where it cannot
        run (the bound is then looser)."""
        g = self.left_graph
        body = [n for n in g.nodes if n.op == "call_function"]
        (out,) = [n for n in g.nodes if n.op == "output"]
        try:
            self._restore()
            env = dict(zip([n for n in g.nodes if n.op == "placeholder"], map(widened, self.left_inputs)))
            return evaluate(body, env, _flat(out.args[0], fx.Node)[: self.n], wide=True)
        except Exception as e:  # an op without an fp64 kernel: the model's code is the reference
            log.debug("rope_fusion: no fp64 reference of a site's region: %s: %s", type(e).__name__, e)
            return None


def refused(refusals: dict, measured: str = "") -> FusionDisagreed:
    """The near miss of a site none of whose fused candidates may be taken: at least one disagreed."""
    name, why = next(iter(refusals.items()))
    return FusionDisagreed(f"{why} ({name}){'; ' + measured if measured else ''}")


# -- the pass's eager check of a planned group --------------------------------------------------------------------

def verify_group(planned: Any, known: set, where: str) -> None:
    """Evaluate a planned group eagerly on random inputs: the nodes it replaces, back to what is in memory anyway,
    and the nodes the pass emitted for them (every node not in `known`). Raises FusionDisagreed where they
    disagree; a check that cannot run refuses nothing."""
    if not all(m.arithmetic for m in planned.group):
        return  # a rotary kernel already in the graph: the model's code is that kernel, nothing to compare
    start = time.perf_counter()
    try:
        why = _group_disagreement(planned, known)
    finally:
        STATS["seconds"] += time.perf_counter() - start
    if why is not None:
        raise _refuse(why, where)


def _group_disagreement(planned: Any, known: set) -> str | None:
    replaced = list(planned.replaced or [m.node for m in planned.group])
    finals = list(planned.finals)
    try:
        left_body, left_inputs = _region(replaced, lambda n: False)
        fused_body, fused_inputs = _region(finals, lambda n: n not in known)
        inputs = list(dict.fromkeys(left_inputs + fused_inputs))
        on_cpu = all(f.meta["val"].device.type == "cpu" for f in finals)
        with _real_numbers():
            env = random_inputs(inputs, left_body + fused_body)
            left = evaluate(left_body, env, replaced)
            with reference_kernels() if on_cpu else contextlib.nullcontext():
                fused = evaluate(fused_body, env, finals)
            ref = evaluate(left_body, {n: widened(v) for n, v in env.items()}, replaced, wide=True)
            why = disagreement(fused, left, ref, narrowest_eps(left_body))
    except Exception as e:  # cannot run here: nothing is refused, and the count says so
        STATS["skipped"] += 1
        log.debug("rope_fusion: a fused group was not verified: %s: %s", type(e).__name__, e)
        return None
    STATS["checked"] += 1
    return why


def _region(outputs: list, always: Callable[[fx.Node], bool]) -> tuple[list, list]:
    """(body, inputs) computing `outputs`: back to what is in memory anyway (auto_region's rule), except the nodes
    `always` takes into the body (the pass's own)."""
    return walk_region(outputs, lambda n: n.op != "call_function" or (starts_region(n) and not always(n)),
                       MAX_NODES, lambda: ValueError(f"a region over {MAX_NODES} nodes"))


def _hint(s: Any) -> int:
    if isinstance(s, torch.SymInt):
        if not s.node.has_hint():
            raise ValueError("a data-dependent size")
        return int(s.node.hint)
    return int(s)


def random_inputs(inputs: list, body: list) -> dict:
    """Real values for a region's inputs: the module's own constants, sizes at their example values, tensors of
    the fake values' geometry at random (integers: 0, 1, ... below the rows they index, so positions are valid)."""
    gen: dict = {}
    owner = inputs[0].graph.owning_module if inputs else None
    env = {}
    for n in inputs:
        val = n.meta.get("val")
        if n.op == "get_attr" and owner is not None:
            const = getattr(owner, str(n.target), None)
            if isinstance(const, torch.Tensor) and not isinstance(const, torch._subclasses.FakeTensor):
                env[n] = const
                continue
        if isinstance(val, (torch.SymInt, int)):
            env[n] = _hint(val)
        elif isinstance(val, torch.Tensor):
            device = val.device
            if device not in gen:
                gen[device] = torch.Generator(device).manual_seed(SEED)
            env[n] = _random_like(val, _index_bound(n, body), gen[device])
        else:
            raise ValueError(f"the input {n.name} has no tensor or size value")
    return env


def _random_like(val: torch.Tensor, bound: int, gen: torch.Generator) -> torch.Tensor:
    shape, stride = [_hint(s) for s in val.shape], [_hint(s) for s in val.stride()]
    offset = _hint(val.storage_offset())
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    if any(s == 0 for s in shape):
        extent = offset + 1
    if val.dtype.is_floating_point or val.dtype.is_complex:
        base = torch.randn(extent, dtype=val.dtype, device=val.device, generator=gen)
    elif val.dtype == torch.bool:
        base = torch.zeros(extent, dtype=val.dtype, device=val.device)
    else:
        base = (torch.arange(extent, device=val.device) % max(1, bound)).to(val.dtype)
    return base.as_strided(shape, stride, offset)


# Ops that pass an index through unchanged in value (views, copies, casts): an index read through them is still
# bounded by the rows it picks.
_INDEX_CARRIERS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                   aten.squeeze.dim, aten.squeeze.dims, aten.expand.default, aten.slice.Tensor, aten.select.int,
                   aten.clone.default, aten.permute.default, aten.flatten.using_ints,
                   torch.ops.prims.convert_element_type.default, aten._to_copy.default}


def _index_bound(n: fx.Node, body: list) -> int:
    """The fewest rows that an integer input (or what carries it) indexes among the region's nodes: its values
    must stay below that (1 where it indexes nothing)."""
    inside = set(body)
    bounds = []
    stack, seen = [n], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in v.users:
            if u not in inside:
                continue
            if u.target in _INDEX_CARRIERS and u.args and u.args[0] is v:
                stack.append(u)
                continue
            bounds += _rows_indexed(u, v)
    return min(bounds, default=1)


def _rows_indexed(u: fx.Node, index: fx.Node) -> list:
    """The sizes of the dims that node `u` indexes with `index`."""
    def size(t: Any, dim: int) -> list:
        val = t.meta.get("val") if isinstance(t, fx.Node) else None
        return [_hint(val.shape[dim])] if isinstance(val, torch.Tensor) and val.dim() > dim >= -val.dim() else []

    a = u.args
    if u.target is aten.index.Tensor:
        return [s for i, t in enumerate(a[1]) if t is index for s in size(a[0], i)]
    if u.target in (aten.index_select.default, aten.gather.default) and len(a) > 2 and a[2] is index:
        return size(a[0], a[1])
    if u.target is aten.embedding.default and len(a) > 1 and a[1] is index:
        return size(a[0], 0)
    schema = getattr(u.target, "_schema", None)
    if schema is not None and getattr(u.target, "namespace", "") == "rope_fusion":
        named = {arg.name: v for arg, v in zip(schema.arguments, a)} | dict(u.kwargs)
        if named.get("positions") is index:
            return size(named.get("cos"), 0)
    return []


__all__ = ["CandidateCheck", "ENV", "FusionDisagreed", "PHRASE", "STATS", "checking", "disagreement", "enabled",
           "evaluate", "random_inputs", "refused", "verify_group", "widened"]
