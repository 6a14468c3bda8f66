"""What serves an op family's eager calls on each device type: one `DeviceRegistry` per family, holding a
`DeviceKernel` record per device type that a backend registers when it imports.

A device without a record (the CPU, a GPU whose backend did not import) runs the family's reference. A family
reads its registry where its calls decide how to run (once per call geometry, or per call where the op has no
plan cache), so the record a backend registered last serves every later decision; the plan caches a registry
hands out (`plan_cache`) are emptied on every registration, so no planned geometry keeps running the kernel that
served its first call.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from .plan_cache import PlanCache

log = logging.getLogger("rope_fusion")

# devices whose kernels' own nodes Inductor launches from a compiled graph's code (its user-kernel nodes compile for
# GPUs): elsewhere a device kernel serves the op's calls (the tests serve the CPU with the interpreted kernel).
# Read per emission (`emits_nodes`): a benchmark empties it to time the op a node replaces.
NODE_DEVICES = ("cuda",)


def emits_nodes(device_type: str) -> bool:
    """Whether the pass emits a family's `DeviceKernel.node` for calls on this device type (`NODE_DEVICES`)."""
    return device_type in NODE_DEVICES


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceKernel:
    """One device type's kernel for a family: `impl` serves a call as it comes (None from it, or no `impl`: the
    reference); `check` says beforehand why the kernel would not take a call (None: it would; no `check`: it takes
    every call), for a pass that emits a fused form only where a kernel serves it; `plan` plans a call geometry
    once into a runner of every later call of it (None from it: `impl` per call); `warm` compiles, in the
    background, what a call geometry given as fake values will launch, so that a compiled graph's first call of an
    opaque op finds its kernels compiled (kernels/triton_warmup.py; it returns how many launches it warmed);
    `takes_packed`: packed sequences reach the kernel as they come (cu_seqlens), else their derived positions;
    `node` emits a call on graph nodes as the backend's own node in a post-grad graph (Inductor's user-kernel
    node: the compiled graph launches the kernel from its generated code, not the op through the dispatcher),
    or returns None where it cannot (the pass then emits the op). What each callable takes and returns is the
    family's (its module says)."""

    impl: Callable[..., Any] | None
    check: Callable[..., str | None] | None = None
    plan: Callable[..., Any] | None = None
    takes_packed: bool = False
    warm: Callable[..., int] | None = None
    node: Callable[..., Any] | None = None


class DeviceRegistry:
    """A family's device type -> `DeviceKernel`. `kernels` is the table itself: the family's hot paths read it
    directly (one dict lookup, as a plain table), and the test suite serves one device's record on another by
    setting an entry. `on_register(device_type, kernel)` runs before a record is stored (a family whose ops
    dispatch to the device's kernel registers it with torch.library there). `required`: the parts every record
    of the family has, so that its hot paths call them without asking (the join family's kernels only plan)."""

    __slots__ = ("family", "kernels", "required", "_on_register", "_caches")

    def __init__(self, family: str, on_register: Callable[[str, DeviceKernel], None] | None = None,
                 required: tuple[str, ...] = ("impl",)) -> None:
        self.family, self.required = family, required
        self.kernels: dict[str, DeviceKernel] = {}
        self._on_register = on_register
        self._caches: list[PlanCache] = []

    def register(self, device_type: str, impl: Callable[..., Any] | None = None, *,
                 check: Callable[..., str | None] | None = None, plan: Callable[..., Any] | None = None,
                 takes_packed: bool = False, warm: Callable[..., int] | None = None,
                 node: Callable[..., Any] | None = None) -> DeviceKernel:
        """Serve the family's calls on `device_type` with this kernel (`DeviceKernel` says what each part does),
        in place of any registered before, and empty the registry's plan caches."""
        kernel = DeviceKernel(impl, check, plan, takes_packed, warm, node)
        missing = [part for part in self.required if getattr(kernel, part) is None]
        if missing:
            raise ValueError(f"a {self.family} kernel for {device_type} needs {' and '.join(missing)}: the "
                             f"{self.family} ops call it on every device that has a kernel")
        if self._on_register is not None:
            self._on_register(device_type, kernel)
        self.kernels[device_type] = kernel
        for cache in self._caches:
            cache.clear()
        return kernel

    def get(self, device_type: str) -> DeviceKernel | None:
        """The kernel registered for `device_type`, or None (the family's reference serves it)."""
        return self.kernels.get(device_type)

    def node_planner(self, device_type: str) -> Callable[..., Any] | None:
        """The device kernel's planner (`DeviceKernel.plan`) where the pass emits the device's own node for the
        family's calls (`emits_nodes`, a record with a node), for `auto` to time a call as the node runs it: its
        planned launch, no dispatcher; None where the pass emits the op (or the reference kernels are in force)."""
        from .op_definition import reference_only

        kernel = self.kernels.get(device_type)
        if kernel is None or kernel.node is None or reference_only() or not emits_nodes(device_type):
            return None
        return kernel.plan

    def emit_node(self, device_type: str, graph: Any, fake_mode: Any, call: Any, like: Any) -> Any:
        """A call of the family whose tensors are graph nodes (`call`: what the family's `DeviceKernel.node` takes)
        as the device kernel's own node in a post-grad graph, inserted at the graph's insertion point; None where
        the pass emits the op instead: no fake mode, the reference kernels in force, a device that `emits_nodes`
        does not name or whose record has no node, or a node that declines. Never a failure of the compile: an
        error is logged and the op is emitted."""
        from .op_definition import reference_only
        from .optional_backends import load_backends

        if fake_mode is None or reference_only() or not emits_nodes(device_type):
            return None
        load_backends()  # the device's kernel registers when its backend imports
        kernel = self.kernels.get(device_type)
        if kernel is None or kernel.node is None:
            return None
        try:
            return kernel.node(graph, fake_mode, call, like)
        except Exception as e:
            log.info("rope_fusion: the %s kernel's node was not emitted (%s: %s); the op is", self.family,
                     type(e).__name__, e)
            return None

    def plan_cache(self, name: str) -> PlanCache:
        """A plan cache (`plan_cache.PlanCache`, registered as `name`) whose entries hold what this registry's
        kernels planned: every `register` empties it."""
        cache = PlanCache(name)
        self._caches.append(cache)
        return cache

    def __repr__(self) -> str:
        return f"DeviceRegistry({self.family!r}, devices={sorted(self.kernels)})"
