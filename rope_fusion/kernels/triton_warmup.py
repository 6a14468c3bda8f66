"""Compiling the Triton kernel's launches of a compiled graph's opaque ops while Inductor still compiles the graph.

The pass emits most rotations as Inductor's user-kernel node, which Inductor compiles in its worker processes with
its own kernels. The folds' ops (a rotation written into a joined or sliced tensor, `rotary*_into_` and
`rotary*_slice_`; a rotation read from a cat's pieces, `rotary*_cat`) stay opaque calls: their launches are planned
and JIT-compiled in the compiled graph's first call, in the main process, one after another. Qwen-Image's four
joined writes cost its cold compile 2.7 s that way on the H100 (1.41x plain compile), where one specialisation
compiles in 0.4-1.8 s on a 2-core CPU for sm_90.

Here the pass hands each such call's launches, planned on its fake values, to threads that compile them with
Triton's public `JITFunction.warmup` while Inductor builds the rest of the graph (Triton releases the interpreter
lock while LLVM translates and while ptxas runs, and compiles each specialisation in its own MLIR context). A
warmed launch is in the kernel's own cache when the graph first calls the op, which then only loads it. A tensor
goes to `warmup` as its dtype and whether its address is 16-byte aligned (the fake tensor's storage offset in
bytes, its base taken to be aligned as the caching allocator's blocks are): what Triton specialises a pointer on.
Where the real call differs (a base the allocator did not align), its launch compiles in the first call as before.

The first call of an op's JIT launch waits for the warmups still running (`wait`), so that a specialisation is not
compiled twice at once. A warmup that fails is logged and dropped: the call compiles its own launch.
`ROPE_FUSION_PRECOMPILE=0` turns the warmups off.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger("rope_fusion")

_WORKERS = 4  # specialisations compiled at once: Qwen-Image's four joined writes in one round
_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pending: list[concurrent.futures.Future] = []


def enabled(kernel: Any, device: torch.device) -> bool:
    """Whether a kernel's launches on `device` are warmed: on unless ROPE_FUSION_PRECOMPILE=0, for CUDA devices,
    for a kernel Triton compiles (not one its interpreter runs)."""
    if os.environ.get("ROPE_FUSION_PRECOMPILE", "1") == "0" or device.type != "cuda" or not torch.cuda.is_available():
        return False
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction)


class AlignedMock:
    """A tensor argument as Triton's specialisation reads it: its dtype, and an address that is 16-byte aligned
    exactly where the tensor's would be (Triton's own `MockTensor` is always aligned)."""

    __slots__ = ("dtype", "_address")

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._address = (int(t.storage_offset()) * t.element_size()) % 16

    def data_ptr(self) -> int:
        return self._address

    @staticmethod
    def ptr_range() -> int:
        return 0  # within 32-bit offsets, as Triton's MockTensor says of itself


def mocked(value: Any) -> Any:
    """A launch argument with every tensor as `AlignedMock` (lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return AlignedMock(value)
    if isinstance(value, (list, tuple)):
        return type(value)(mocked(v) for v in value)
    return value


def concrete(args: Iterable[Any]) -> bool:
    """Whether every size-like value of a launch is an int: a launch planned on symbolic sizes is not warmed."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not all(isinstance(s, int) for s in (*a.shape, *a.stride(), a.storage_offset())):
                return False
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
    return True


def warm(kernel: Any, grid: tuple, args: tuple, kwargs: dict, device: torch.device) -> bool:
    """Compile `kernel[grid](*args, **kwargs)` in a background thread, launching nothing; False where it is not
    warmed (turned off, not a CUDA device, symbolic sizes)."""
    if not enabled(kernel, device) or not concrete((*args, *kwargs.values(), *grid)):
        return False
    _submit(kernel, tuple(grid), mocked(tuple(args)), {k: mocked(v) for k, v in kwargs.items()}, device)
    return True


def _submit(kernel: Any, grid: tuple, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Hand one launch, its tensors mocked, to the warmup threads, compiled for `device` (the caller's current
    CUDA device where it names no index: a thread starts on device 0)."""
    index = device.index if device.index is not None else torch.cuda.current_device()

    def compile_launch() -> None:
        with torch.cuda.device(index):
            kernel.warmup(*args, grid=grid, **kwargs)

    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="rope_fusion_warmup")
        _pending.append(_pool.submit(compile_launch))


def wait() -> None:
    """Wait for every warmup still running (a failed one is logged at debug level and dropped). Costs one list
    check where none runs: the ops call it before each launch through the JIT launcher."""
    if not _pending:
        return
    with _lock:
        futures, _pending[:] = list(_pending), []
    for f in futures:
        try:
            f.result()
        except Exception as e:  # the call compiles its own launch
            log.debug("rope_fusion: a warmup of the Triton kernel failed (%s); its first call compiles it", e)


def pending() -> int:
    """Warmups submitted and not yet waited for."""
    return len(_pending)


__all__ = ["AlignedMock", "concrete", "enabled", "mocked", "pending", "wait", "warm"]
