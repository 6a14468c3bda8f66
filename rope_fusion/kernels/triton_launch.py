"""Launching the Triton rotary kernel: the host side of a call, eager or traced.

`launch` plans a call (kernels/triton_plan.py), caches the plan by geometry and launches the kernel: through its
own JIT launcher eagerly, through `wrap_triton` when traced (torch.compile, make_fx: kernels/triton_graph.py turns
that trace into Inductor's user-kernel node). `plan_eager` serves the public functions' direct path: a call
geometry planned once, its launches replayed (`DirectLaunches`). `launch_call` is the op's kernel
(`rope_fusion::rotary_triton` and its arities, and the CUDA device kernel of the public functions).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.library import wrap_triton

from ..ops.packed import eager_op, packed_positions
from ..ops.plan_cache import PlanCache
from ..ops.reference import gather_rows
from ..ops.schema import RotaryCall, RotaryParams
from . import triton_warmup
from .triton_kernel import rotary_kernel
from .triton_plan import KERNEL_FIELDS, NORM_FIRST, Tables, is_true, launch_args, make_launches, per_lane, plan_launch

log = logging.getLogger("rope_fusion")


def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(rotary_kernel, InterpretedFunction)


INTERPRETED = _interpreted()  # TRITON_INTERPRET=1: the kernel runs on CPU tensors (tests)


def launch_call(call: RotaryCall) -> list | None:
    """The op's kernel: the rotated xs of a call on CUDA/ROCm tensors (any device under the interpreter), else
    None (the reference serves other devices)."""
    if any(t.device.type != "cuda" for t in (*call.xs, call.cos, call.sin)) and not INTERPRETED:
        return None
    if call.params.unhandled(KERNEL_FIELDS):  # a parameter the kernel does not take: the reference
        return None
    # packed sequences as they are: the kernel finds each token's sequence, no positions are derived for it
    return launch(call.xs, call.cos, call.sin, call.params, call.positions, call.norm_weights,
                  cu_seqlens=call.cu_seqlens, seqlen_offsets=call.seqlen_offsets)


def _prepare(x: torch.Tensor) -> torch.Tensor:
    """The kernel reads lanes with unit stride; anything else is made contiguous first."""
    if x.shape[-1] > 1 and not is_true(x.stride(-1) == 1):
        return x.contiguous()
    return x


_LAUNCH_CACHE = PlanCache("rotary.launches")  # geometry key -> launches: a repeated call's host side, a few us


def launch(xs: list, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams, positions: Any = None,
           weights: Sequence | None = None, *, cu_seqlens: Any = None, seqlen_offsets: Any = None,
           kernel: Any = None, block_h: int | None = None, num_warps: int | None = None, nsplit: int | None = None,
           neox_row: bool | None = None, stream: bool | None = None, held: bool | None = None,
           row_tail: bool | None = None) -> list:
    """Rotate 1-3 tensors sharing tables; one launch when their geometry allows it, else one each.
    With positions, the tables are rows of a cache read per token (`cos[positions]`); with cu_seqlens (and
    seqlen_offsets), x packs sequences and the kernel finds each token's row itself (ops/packed.py's contract);
    with a norm in params, each x is RMS-normalised (and scaled by its weight, one per x, which may vary over heads
    and lanes only) in the same pass. The tuning options override the rules below (the benchmarks' sweeps use
    them)."""
    if cu_seqlens is not None and positions is not None:
        raise ValueError("pass positions or cu_seqlens, not both")
    weights = list(weights) if weights is not None else [None] * len(xs)
    tiles = dict(block_h=block_h, num_warps=num_warps, nsplit=nsplit, neox_row=neox_row, stream=stream, held=held,
                 row_tail=row_tail)
    tuning = dict(kernel=kernel, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets, **tiles)
    if params.norm != "none" and any(w is not None and not per_lane(w, x) for w, x in zip(weights, xs)):
        return _normed_first(xs, cos, sin, params, positions, weights, tuning)
    xs = [_prepare(x) for x in xs]
    weights = [w if w is None or is_true(w.stride(-1) == 1) else w.contiguous() for w in weights]
    outs = [torch.empty(x.shape, dtype=params.out_dtype, device=x.device) for x in xs]
    fn = kernel if kernel is not None else kernel_for(xs)
    opts = (params, tuple(tiles.items()))
    tables = Tables(cos, sin, positions, weights, cu_seqlens, seqlen_offsets)
    try:
        key = (tuple((tuple(x.shape), x.stride(), x.dtype) for x in xs), tables.key(), opts)
        hash(key)
    except TypeError:  # symbolic sizes: plan every time
        key = None
    launches = _LAUNCH_CACHE.get(key) if key is not None else None
    if launches is None:
        launches = make_launches(xs, outs, tables, params, **tiles)
        _LAUNCH_CACHE.put(key, launches)
    if launches is NORM_FIRST:
        return _normed_first(xs, cos, sin, params, positions, weights, tuning)
    if launches is not None:
        # unused pointers stand in for absent tensors; packed sequences' starts take the positions' place
        pos = positions if positions is not None else cu_seqlens if cu_seqlens is not None else cos
        checks = row_checks(pos if tables.rows else None) if fn is rotary_kernel else {}
        packed = {"off_ptr": seqlen_offsets} if cu_seqlens is not None else {}  # a tensor of this call
        for group, grid, scalars, meta in launches:
            sides = [group[min(i, len(group) - 1)] for i in range(3)]  # q, k, v; absent sides repeat the last
            ws = [weights[i] if weights[i] is not None else cos for i in sides]
            fn[grid](*(xs[i] for i in sides), *(outs[i] for i in sides), cos, sin, pos, *ws, *scalars,
                     **{**meta, **packed}, **checks)
        return outs
    # More than 3 token dims that do not merge: materialize x and tables (rare, correct), one launch each.
    if params.norm != "none":  # materialized tables no longer show which dim holds the heads
        return _normed_first(xs, cos, sin, params, positions, weights, tuning)
    if cu_seqlens is not None:  # here, and only here, the rows are derived as the op derives them
        positions = packed_positions(eager_op, cu_seqlens, seqlen_offsets, xs[0].shape[0], xs[0].dim(), xs[0].device)
    if positions is not None:  # checked: a position outside [0, rows) raises, as the kernel's assert does
        cos, sin = gather_rows(cos, positions), gather_rows(sin, positions)
    for i, x in enumerate(xs):
        if is_true(x.numel() == 0):
            continue
        x = x.contiguous()
        c = cos.expand(*x.shape[:-1], cos.shape[-1]).contiguous()
        s = sin.expand(*x.shape[:-1], sin.shape[-1]).contiguous()
        t = Tables(c, s, None, [weights[i]])
        p = plan_launch([x], [outs[i]], t)
        assert p is not None
        grid, scalars, meta = launch_args(p, [x], [outs[i]], t, [0], params.of_tensor(i), **tiles)
        w = weights[i] if weights[i] is not None else c
        fn[grid](x, x, x, outs[i], outs[i], outs[i], c, s, c, w, w, w, *scalars, **meta)
    return outs


def row_checks(positions: Any) -> dict:
    """The compile options of a direct launch (the kernel's own launcher, outside Inductor): with positions, the
    kernel's row assert compiled in, as Inductor compiles it into the node it launches (`debug`, from its
    `assert_indirect_indexing`, with Triton's integer-overflow asserts off as Inductor turns them off). Triton
    drops `tl.device_assert` from a kernel compiled without `debug`, which on the GPU let an eager call read past
    the cache where the same call in a compiled graph raised a device-side assert."""
    return {"debug": True, "sanitize_overflow": False} if positions is not None and not INTERPRETED else {}


def _tracing(xs: Sequence[torch.Tensor]) -> bool:
    """Whether a launch is being traced (torch.compile, make_fx, fake or functional tensors): then the kernel goes
    through `wrap_triton`, the higher-order op a tracer records. Eagerly the kernel's own launcher runs: the HOP,
    its pytree flattening and its dispatch cost about 1 ms of host time per q/k call on the H200's host."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return True
    return any(type(x) is not torch.Tensor or torch._is_functional_tensor(x) for x in xs)


def kernel_for(xs: Sequence[torch.Tensor]) -> Any:
    """The rotary kernel as a launch of `xs` calls it: `wrap_triton`'s higher-order op while traced (`_tracing`),
    which the pass turns into Inductor's user-kernel node (kernels/triton_graph.py), else the kernel itself. Read
    per call: the tests interpret the module's kernel."""
    return wrap_triton(rotary_kernel) if _tracing(xs) else rotary_kernel


LAUNCH_TENSORS = 12  # a launch's tensors: q, k, v, their outputs, cos, sin, the rows, three weights (`_tensors`)


class DirectLaunches:
    """The launches of one call geometry, planned once (`plan_eager`): each later call allocates its outputs and
    launches. The first launch of an entry goes through the kernel's JIT launcher (`rotary_kernel[grid]`), which
    returns the compiled kernel; later ones call that compiled kernel through torch's static launcher or Triton's
    own (`_compiled_runner`) with the same arguments, skipping the binding and specialization of 80-odd arguments
    (the call geometry, the key of this plan, fixes every value and pointer alignment Triton specializes on). Its
    first use is checked once against the JIT launcher's result, outside CUDA graph capture; a mismatch or a
    launcher API this code does not know keeps the JIT launcher. Packed sequences pass cu_seqlens where positions
    go; their per-sequence offsets, a tensor of each call, keep the JIT launcher (its compiled form would fix
    them)."""

    def __init__(self, launches: list, out_dtype: torch.dtype, checks: dict, offsets: bool = False) -> None:
        # the kernel takes three sides (q, k, v); absent sides repeat the last, as in `launch`
        self.entries = [[[group[min(i, len(group) - 1)] for i in range(3)], grid, scalars, meta, None, False]
                        for group, grid, scalars, meta in launches]
        self.out_dtype = out_dtype
        self.checks = checks  # `row_checks`: compile options of the JIT launch, not kernel arguments
        self.offsets = offsets
        if offsets:  # every launch through the JIT launcher, given this call's offsets
            for entry in self.entries:
                entry[4] = False

    def outputs(self, xs: Sequence[torch.Tensor]) -> list:
        """Contiguous outputs in x's shapes, as the plan was made for. `empty_like` costs the host about half of
        what `torch.empty(shape, dtype=, device=)` does (no shape or device to parse); the outputs of one call as
        views of one allocation cost more than two allocations on the H200's host (the views' dispatch)."""
        dtype, layout = self.out_dtype, torch.contiguous_format
        return [torch.empty_like(x, dtype=dtype, memory_format=layout) for x in xs]

    def _outputs(self, xs: Sequence[torch.Tensor]) -> list:
        """Where a call's launches write: new outputs here, the slices of the call in the in-place launches."""
        return self.outputs(xs)

    def pointer_launches(self) -> Any:
        """The plan's launches fed data pointers alone, `launch(x_ptrs, out_ptrs, cos_ptr, sin_ptr, pos_ptr,
        w_ptrs)` (a weight's pointer where the call has one, else any pointer: the kernel does not read it), once
        every launch is checked and runs through torch's static launcher; None before, and where one does not.
        A caller whose tables are views of one argument at offsets its key fixes (a packed `[cos | sin]` table)
        passes that argument's pointer plus the offsets, and makes no views: the two views of a packed table cost
        3.7 us a call on a 2-core CPU, as much as the call's two output allocations."""
        steps = []
        for sides, _, _, _, runner, checked in self.entries:
            go = getattr(runner, "from_pointers", None) if checked else None
            if go is None or go.count != LAUNCH_TENSORS:
                return None
            steps.append((sides, go))

        def launch(x_ptrs: Sequence[int], out_ptrs: Sequence[int], cos_ptr: int, sin_ptr: int, pos_ptr: int,
                   w_ptrs: Sequence[int]) -> None:
            for sides, go in steps:
                go(*[x_ptrs[i] for i in sides], *[out_ptrs[i] for i in sides], cos_ptr, sin_ptr, pos_ptr,
                   *[w_ptrs[i] for i in sides])
        return launch

    @staticmethod
    def _tensors(sides: list, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], cos: torch.Tensor,
                 sin: torch.Tensor, pos: torch.Tensor, weights: Sequence) -> tuple:
        """A launch's tensors in the kernel's order: its sides' xs and outputs, the tables, the rows, the weights
        (unused pointers stand in for absent tensors)."""
        ws = [weights[i] if weights[i] is not None else cos for i in sides]
        return (*(xs[i] for i in sides), *(outs[i] for i in sides), cos, sin, pos, *ws)

    def warm(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             positions: Any, weights: Any) -> int:
        """Compile this plan's launches in the background from fake values of a call (`triton_warmup`), writing
        into `outs`; returns how many were handed to the warmup threads."""
        pos = positions if positions is not None else cos
        weights = weights or [None] * len(xs)
        warmed = 0
        for sides, grid, scalars, meta, *_ in self.entries:
            args = (*self._tensors(sides, xs, outs, cos, sin, pos, weights), *scalars)
            warmed += triton_warmup.warm(rotary_kernel, grid, args, {**meta, **self.checks}, xs[0].device)
        return warmed

    def __call__(self, xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, positions: Any,
                 weights: Any, cu_seqlens: Any = None, seqlen_offsets: Any = None) -> list:
        outs = self._outputs(xs)
        # unused pointers stand in for absent tensors; cu_seqlens go where positions do
        pos = positions if positions is not None else cu_seqlens if cu_seqlens is not None else cos
        weights = weights or [None] * len(xs)
        for entry in self.entries:
            sides, grid, scalars, meta, runner, checked = entry  # runner: None untried, False unavailable
            tensors = self._tensors(sides, xs, outs, cos, sin, pos, weights)
            if checked and getattr(runner, "tensors_only", False):  # the plan's scalars are the runner's own
                runner(*tensors)
                continue
            args = (*tensors, *scalars)
            if checked:
                runner(*args)
            elif runner and not stream_capturing():
                runner = self._checked(runner, args, sides, outs, grid, {**meta, **self.checks})
                entry[4:] = (runner, True) if runner else (False, False)
            else:
                triton_warmup.wait()  # a warmup of this launch may still be compiling it
                call_meta = {**meta, "off_ptr": seqlen_offsets} if self.offsets else meta
                compiled = rotary_kernel[grid](*args, **call_meta, **self.checks)
                if runner is None:
                    entry[4] = _compiled_runner(compiled, grid, meta, len(args)) or False
        return outs

    @staticmethod
    def _checked(runner: Any, args: tuple, sides: list, outs: list, grid: tuple, meta: dict) -> Any:
        """The compiled launcher where it writes what the JIT launcher writes, else None (one log line)."""
        mine = {i: torch.empty_like(outs[i]) for i in sides}
        jit_args = (*args[:3], *(mine[i] for i in sides), *args[6:])
        try:
            runner(*args)
        except Exception as e:  # a launcher API of another Triton version: the JIT launcher stays
            log.info("rope_fusion: Triton's compiled-kernel launcher failed (%s); the JIT launcher stays", e)
            rotary_kernel[grid](*args, **meta)
            return None
        rotary_kernel[grid](*jit_args, **meta)
        if all(torch.equal(outs[i].view(torch.uint8), m.view(torch.uint8)) for i, m in mine.items()):  # NaN too
            return runner
        log.warning("rope_fusion: Triton's compiled-kernel launcher wrote other values than its JIT launcher; the "
                    "JIT launcher stays")
        for i, m in mine.items():
            outs[i].copy_(m)
        return None


def stream_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph: the first replay's check against the
    JIT launcher (which compares results) waits until a call outside capture."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _compiled_runner(compiled: Any, grid: tuple, meta: dict, n_args: int) -> Any:
    """A launcher of the compiled kernel for the n_args positional arguments of `DirectLaunches` (the kernel's
    parameters up to its first constexpr), the rest of its parameters taken from meta, or None where the JIT
    launch returned no compiled kernel (the interpreter) or the parameters are not the ones expected. Torch's
    static launcher (the C++ launcher Inductor uses for its own Triton kernels) where it takes this kernel, else
    the compiled kernel's own launcher."""
    from triton.compiler import CompiledKernel

    names = getattr(rotary_kernel, "arg_names", None)
    if not isinstance(compiled, CompiledKernel) or names is None:
        return None
    tail = names[n_args:]
    if not all(n in meta for n in tail) or len(tail) + 1 != len(meta):  # meta also holds num_warps
        return None
    constants = tuple(meta[n] for n in tail)
    return _static_runner(compiled, grid, n_args, constants) or _triton_runner(compiled, grid, constants)


def _triton_runner(compiled: Any, grid: tuple, constants: tuple) -> Any:
    """`compiled[grid]` with the constexpr arguments appended in the kernel's parameter order."""
    launcher = compiled[(*grid, 1, 1)[:3]]  # it reads three grid dims (the JIT launcher pads them)

    def run(*args: Any) -> None:
        launcher(*args, *constants)
    return run


def _static_launcher_class() -> Any:
    try:  # torch >= 2.12 names the module for Triton kernels on every device, earlier releases for CUDA
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
    except ImportError:
        try:
            from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
        except ImportError:
            return None
    return StaticallyLaunchedCudaKernel


def static_arguments(compiled: Any, n_args: int) -> tuple[list, list] | None:
    """The positions, among n_args arguments of the kernel in its parameter order, of the compiled kernel's runtime
    parameters (what its cubin takes: neither constexpr nor specialised to a constant by Triton), and which of
    them are pointers; None where one falls outside them or the compiled kernel does not say."""
    src = getattr(compiled, "src", None)
    signature = getattr(src, "signature", None)
    if not isinstance(signature, dict):
        return None
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if names is None:
        return None
    constants = {k[0] if isinstance(k, tuple) else names.index(k) if isinstance(k, str) else k
                 for k in getattr(src, "constants", {})}
    types = [signature.get(n, signature.get(i)) for i, n in enumerate(names)]
    keep = [i for i, ty in enumerate(types) if ty not in (None, "constexpr") and i not in constants]
    if not keep or keep[-1] >= n_args:
        return None
    return keep, [i for i in keep if str(types[i]).startswith("*")]


def static_kernel(compiled: Any, keep: list) -> Any:
    """Torch's static launcher for the compiled kernel (its cubin loaded where CUDA is), or None where torch has
    none or it does not take this kernel (launch hooks, scratch memory, clusters, another parameter count)."""
    cls = _static_launcher_class()
    if cls is None or torch.version.hip is not None or "cubin" not in getattr(compiled, "asm", {}):
        return None
    import os
    import tempfile
    directory = tempfile.mkdtemp(prefix="rope_fusion_cubin_")
    path = os.path.join(directory, f"{compiled.name}.cubin")
    try:
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        compiled._cubin_path = path  # where the static launcher reads the cubin from (Inductor sets it too)
        kernel = cls(compiled)
        if len(kernel.arg_tys) != len(keep):
            return None
        if torch.cuda.is_available():
            kernel.load_kernel(torch.cuda.current_device())
        return kernel
    except Exception as e:  # an API of another torch or Triton release, or a kernel it does not take
        log.info("rope_fusion: torch's static Triton launcher does not take this kernel (%s); Triton's stays", e)
        return None
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(directory)


def _static_runner(compiled: Any, grid: tuple, n_args: int, constants: tuple) -> Any:
    """The compiled kernel launched by torch's static launcher: its cubin loaded once, each call passing the grid,
    the current stream and the kernel's runtime arguments to one C++ call. Triton's own launcher binds the
    kernel's 80-odd arguments, constexprs included, in Python on every call. Only the tensors vary between calls of
    a plan (its key fixes every scalar), so the scalars are read once, and each tensor is passed as its data
    pointer, which the launcher would otherwise look up (a Python call) and check with the driver per pointer on
    every launch; the plan's key fixes each tensor's device. None where the static launcher does not take the
    kernel; the caller then keeps Triton's launcher."""
    found = static_arguments(compiled, n_args + len(constants))
    if found is None:
        return None
    keep, pointers = found
    if any(i >= n_args for i in pointers) or pointers != keep[:len(pointers)]:  # the layout this relies on
        return None
    kernel = static_kernel(compiled, keep)
    if kernel is None or not torch.cuda.is_available():
        return None
    gx, gy, gz = (*grid, 1, 1)[:3]
    launch = kernel.run
    stream_of = torch._C._cuda_getCurrentRawStream
    device = torch.cuda.current_device()
    rest = keep[len(pointers):]
    fixed: list = []  # the scalars, from the first call

    def run(*args: Any) -> None:
        if not fixed:  # the first call passes the plan's scalars after the tensors, later ones the tensors alone
            full = (*args, *constants)
            fixed.append(tuple(full[i] for i in rest))
        launch(gx, gy, gz, stream_of(device), *[args[i].data_ptr() for i in pointers], *fixed[0])

    def from_pointers(*ptrs: int) -> None:  # every tensor argument as its data pointer, in the kernel's order
        launch(gx, gy, gz, stream_of(device), *ptrs, *fixed[0])
    run.tensors_only = True
    if pointers == list(range(len(pointers))):  # the tensors lead the kernel's parameters, each a runtime pointer
        from_pointers.count = len(pointers)
        run.from_pointers = from_pointers
    return run


def plan_eager(call: RotaryCall) -> Any:
    """The direct path of the public functions on CUDA (its `plan` in `device_runners.ROTARY_KERNELS`): the launches
    of this call's geometry, planned once and reused by every call of that geometry. Geometries whose launch
    copies first (lanes with a stride, a norm applied before the rotation, dims that do not merge) call `launch`
    each time instead; other devices than CUDA: None (the reference), except under the interpreter. Packed
    sequences are planned as they come: the kernel searches cu_seqlens itself."""
    xs, cos, sin, params = call.xs, call.cos, call.sin, call.params
    if any(t.device.type != "cuda" for t in (*xs, cos, sin)) and not INTERPRETED or params.unhandled(KERNEL_FIELDS):
        return None
    weights = call.norm_weights or [None] * len(xs)
    plain = (all(not (x.shape[-1] > 1 and x.stride(-1) != 1) for x in xs)
             and all(w is None or (per_lane(w, x) and w.stride(-1) == 1) for w, x in zip(weights, xs)))
    if plain:
        outs = [torch.empty(x.shape, dtype=params.out_dtype, device=x.device) for x in xs]
        tables = Tables(cos, sin, call.positions, weights, call.cu_seqlens, call.seqlen_offsets)
        launches = make_launches(xs, outs, tables, params)
        if isinstance(launches, list):
            rows = call.positions if call.positions is not None else call.cu_seqlens
            return DirectLaunches(launches, params.out_dtype, row_checks(rows), call.seqlen_offsets is not None)

    def run(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, positions: Any, weights: Any,
            cu_seqlens: Any = None, seqlen_offsets: Any = None) -> list:
        return launch(list(xs), cos, sin, params, positions, weights, cu_seqlens=cu_seqlens,
                      seqlen_offsets=seqlen_offsets)
    return run


def _normed_first(xs: list, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams, positions: Any,
                  weights: list, tuning: dict) -> list:
    """A norm the kernel's loop cannot apply (a weight that varies over tokens, heads that are not the dim the
    kernel loops over): normalise first, then rotate. Correct, not fused; the pass never emits these."""
    from ..ops.reference import rms_norm

    xs = [rms_norm(x.float(), params.norm, params.norm_eps, w) for x, w in zip(xs, weights)]
    return launch(xs, cos, sin, params.replace(norm="none"), positions, None, **tuning)
