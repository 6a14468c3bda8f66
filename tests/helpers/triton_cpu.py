"""The Triton backend serving CPU tensors, as every CPU test and the zoo and fuzz runs set it up.

The kernel modules are imported compiled (the graph tests trace them on fake tensors, which an interpreted kernel
cannot do), so a CPU run swaps the interpreted kernels in (tests/helpers/triton_interpreted.py), says the launcher runs
interpreted, and interprets Triton's own `tl.sum` (a `@jit` function of its standard library, imported compiled)
for the norms. What the CPU then serves with the CUDA implementations is chosen by name from `SERVES`, because
each extra served kernel changes what the pass and the ops decide (a served cat op folds a cat that is otherwise
left).

`install` does it on a `pytest.MonkeyPatch`: the `triton_on_cpu` fixture (tests/conftest.py) passes its own, so
a test's later patches of the same names unwind in order; `triton_on_cpu` here is the context manager of the
zoo's and the fuzz suite's runs outside a test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

WHOLE = ("impl", "check", "plan", "warm")  # a `DeviceKernel`'s callables (its `takes_packed` goes with them)
# name -> (module, its `DeviceRegistry`, the parts of the "cuda" kernel that the "cpu" kernel takes; the rest None)
SERVES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "eager": ("rope_fusion.ops.device_runners", "ROTARY_KERNELS", WHOLE),  # the public functions' direct path
    "slice_write": ("rope_fusion.ops.slice_write", "IN_PLACE_KERNELS", WHOLE),  # rotations written into slices
    "cat": ("rope_fusion.ops.cat_rotary", "CAT_KERNELS", ("impl", "check", "warm")),  # the cat ops read the pieces
    "cat_planner": ("rope_fusion.ops.cat_rotary", "CAT_KERNELS", ("plan",)),  # the cat ops' eager plans
    "join": ("rope_fusion.ops.joins", "JOIN_KERNELS", WHOLE),  # the join kernel
    "kv_cache": ("rope_fusion.ops.kv_cache_op", "CACHE_KERNELS", WHOLE),  # the KV-cache op
}
EVERYTHING = tuple(SERVES)

_TRITON_LANGUAGE = ("triton.language", "triton.language.core", "triton.language.math", "triton.language.standard")


@dataclasses.dataclass
class TritonOnCpu:
    """What a CPU run launches: the rotary and the join kernel as installed (interpreted, wrapped where asked)."""

    rotary: Any
    join: Any


class CountingLaunches:
    """The kernel with its launches counted (`kernel[grid](...)` as the JIT launcher is called)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def counted(*args, **kwargs):
            self.launches += 1
            return run(*args, **kwargs)
        return counted


def install(mp: pytest.MonkeyPatch, serves: Iterable[str] = (), wrap: Callable[[Any], Any] | None = None
            ) -> TritonOnCpu:
    """Swap the interpreted kernels in on `mp` and serve `serves` (names of `SERVES`) on the CPU.

    `wrap` wraps each interpreted kernel (a recorder of its launches); the rotary kernel is left bare without
    one, since the launcher reads its `arg_names` to replay compiled launches."""
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction

    import rope_fusion.kernels.triton_join as tj
    import rope_fusion.kernels.triton_kernel as tk
    import rope_fusion.kernels.triton_launch as launching
    import rope_fusion.kernels.triton_rotary  # noqa: F401  (registers the CUDA implementations served here)
    from tests.helpers.triton_interpreted import interpreted

    unknown = sorted(set(serves) - set(SERVES))
    if unknown:
        raise ValueError(f"triton_on_cpu cannot serve {unknown}; it serves {sorted(SERVES)}")
    wrap = wrap or (lambda kernel: kernel)
    kernels = TritonOnCpu(wrap(interpreted(tk.rotary_kernel)), wrap(interpreted(tj.join_kernel)))
    mp.setattr(launching, "rotary_kernel", kernels.rotary)
    mp.setattr(tj, "join_kernel", kernels.join)
    mp.setattr(launching, "INTERPRETED", True)
    if not isinstance(triton.language.sum, InterpretedFunction):
        mp.setattr(triton.language, "sum", InterpretedFunction(triton.language.sum.fn))
    parts: dict[tuple[str, str], set] = {}
    for name in serves:
        module, registry, served = SERVES[name]
        parts.setdefault((module, registry), set()).update(served)
    for (module, registry), served in parts.items():
        table = getattr(importlib.import_module(module), registry).kernels
        unserved = {part: None for part in WHOLE if part not in served}
        mp.setitem(table, "cpu", dataclasses.replace(table["cuda"], **unserved))
    rope_fusion.clear_caches()  # no plan made for another device, or by another run, serves a call here
    return kernels


@contextlib.contextmanager
def triton_language_kept() -> Iterator[None]:
    """Triton's interpreter patches `triton.language`'s builtins while it runs a kernel, and some runs leave them
    patched; a compiled kernel analysed later (torch's TTIR analysis) then fails. This gives the modules, and
    the tensor class, back as they were."""
    saved = [(mod, dict(vars(mod))) for mod in map(sys.modules.get, _TRITON_LANGUAGE) if mod is not None]
    tensor = getattr(sys.modules.get("triton.language.core"), "tensor", None)
    if tensor is not None:
        saved.append((tensor, dict(vars(tensor))))
    try:
        yield
    finally:
        for obj, attrs in saved:
            for k, v in attrs.items():
                if vars(obj).get(k, v) is not v:
                    setattr(obj, k, v)


@contextlib.contextmanager
def triton_on_cpu(serves: Iterable[str], wrap: Callable[[Any], Any] | None = None
                  ) -> Iterator[TritonOnCpu]:
    """`install` for a run outside a test (the zoo's rows, the fuzz cases), undone on the way out together with
    whatever the interpreter left patched in `triton.language`."""
    with triton_language_kept(), pytest.MonkeyPatch.context() as mp:
        yield install(mp, serves, wrap)


def timed_as_nodes(mp: pytest.MonkeyPatch) -> None:
    """The CPU as a device whose slice and into calls the pass emits as the kernel's own node (CUDA's case), for
    `auto`'s timing: `NODE_DEVICES` names the CPU, and the CPU's in-place record (`install` with "slice_write")
    gets a node that declines. Inductor compiles user Triton kernels for GPUs only, so the stand-in keeps the
    compile emitting the op; the node itself is checked on fake CUDA tensors (tests/kernels/test_written_node.py).
    `auto` then times the fold as the node runs: the kernel's planned launch, not the op through the dispatcher."""
    from rope_fusion.ops import device_registry, slice_write

    table = slice_write.IN_PLACE_KERNELS.kernels
    mp.setitem(table, "cpu", dataclasses.replace(table["cpu"], node=lambda graph, fake_mode, written, like: None))
    mp.setattr(device_registry, "NODE_DEVICES", ("cpu",))
