"""Backends of the fused op: one registry, one plug-in record per backend.

A backend is complete in its `Backend` record: which sites it takes (`supports`, with the reason when
not) and how a site becomes graph nodes (`emit`). The Inductor backend lives here; the optional ones
(kernels/triton_rotary.py, kernels/npu.py) register themselves when their module is imported, which
`load_backends()` (ops/optional_backends.py, re-exported here) does lazily because Triton and torch_npu are
optional extras. Backend names come from this module only: `BACKEND_NAMES` is what the pass, the CLI and the
docs accept.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch

from .cost_model import SiteCost, cheapest
from .op_definition import OPS
from .optional_backends import OPTIONAL_BACKENDS, load_backends
from .schema import RotaryCall, RotaryParams

BACKEND_NAMES = ("auto", "inductor", *OPTIONAL_BACKENDS)

# For `auto`, per device type: the backends to try, best first (the order comes from BENCHMARKS.md).
AUTO_ORDER: dict[str, list[str]] = {
    "cpu": ["inductor"],
    "cuda": ["triton", "inductor"],
    "npu": ["npu", "inductor"],
}


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """What a backend needs to decide whether it can take a site (all from fake tensors)."""

    device_type: str
    x_shapes: tuple  # per rotated tensor: its shape, ints and None where a size is symbolic
    x_dtype: torch.dtype
    table_dtype: torch.dtype  # the real dtype of the table view the op reads
    params: RotaryParams
    cost: SiteCost | None = None  # what `auto`'s cost model needs (ops/cost_model.py)
    # the site as graph nodes, for `auto` to time its choices (passes/auto/auto_timing.py `AutoSite`); not compared
    measure: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def arity(self) -> int:
        return len(self.x_shapes)

    @property
    def head_dim(self) -> int | None:
        return self.x_shapes[0][-1] if self.x_shapes and self.x_shapes[0] else None

    def bytes_moved(self) -> int | None:
        """Bytes read and written for x (the copy floor of the site), None when a size is symbolic."""
        total = 0
        in_size = torch.empty((), dtype=self.x_dtype).element_size()
        out_size = torch.empty((), dtype=self.params.out_dtype).element_size()
        for shape in self.x_shapes:
            if any(d is None for d in shape):
                return None
            numel = 1
            for d in shape:
                numel *= d
            total += numel * (in_size + out_size)
        return total


@dataclasses.dataclass(frozen=True)
class Refusal:
    """What a backend's `emit` returns for a site it cannot emit well (under `auto` only): the pass's chooser names
    what takes the site instead, and the report says why with this reason."""

    reason: str


# emit(emitter, call, like) -> output nodes, one per x, or a Refusal; `call` is a RotaryCall whose tensors are graph
# nodes. The emitter (passes/emission.py) creates nodes with fake values: `emitter.call(target, args, kwargs, like=)`;
# `emitter.requested` is the backend the pass was asked for.
Emit = Callable[[Any, RotaryCall, Any], "list | Refusal"]


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    supports: Callable[[SiteSpec], str | None]  # None when the backend takes the site, else the reason
    emit: Emit
    # the folds (passes/folds/fold_registry.py, by name) whose data movement this backend's node takes over: those
    # Inductor cannot fuse with an opaque node, where the lowering fuses them already
    folds: tuple[str, ...] = ()


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    if backend.name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend.name!r}: add it to BACKEND_NAMES / OPTIONAL_BACKENDS")
    _BACKENDS[backend.name] = backend


def emit_op_call(ops: tuple, emitter: Any, call: RotaryCall, like: Any) -> list:
    """One call of a variant's op of the call's arity (`ops`: `rotary*`, `rotary_qk*`, `rotary_qkv*`): the
    emission of every backend that is an op."""
    n = len(call.xs)
    node = emitter.call(ops[n - 1], call.tensors(), call.params.kwargs(), like=like)
    if n == 1:
        return [node]
    return [emitter.call(operator.getitem, (node, i), like=like) for i in range(n)]


def get_backend(name: str) -> Backend | None:
    load_backends()
    return _BACKENDS.get(name)


def available_backends() -> list[str]:
    load_backends()
    return sorted(_BACKENDS)


class LeftToInductor(Exception):
    """`auto`'s cost model estimates that the model's own code, compiled by Inductor, is faster here."""


def choose_backend(requested: str, spec: SiteSpec,
                   decision: tuple[str, str] | None = None) -> tuple[Backend, list[str]]:
    """The backend for one site and, when it is not the one asked for, why each better one was passed over
    (`auto` passing over a backend for its own rule is not a fallback and gives no reasons). Under `auto` on
    a GPU the cost model decides, unless `decision` ((choice, why): what `auto` measured on the device,
    passes/auto/auto_timing.py) is given; either may raise LeftToInductor: the site is better not fused."""
    load_backends()
    if requested == "auto":
        order = AUTO_ORDER.get(spec.device_type, ["inductor"])
        if decision is None and spec.device_type == "cuda" and spec.cost is not None:
            decision = cheapest(spec.cost)
        if decision is not None:
            best, why = decision
            if best == "left":
                raise LeftToInductor(why)
            order = [best]
    else:
        order = [requested]
    reasons = []
    for name in [*order, "inductor"]:
        backend = _BACKENDS.get(name)
        if backend is None:
            reasons.append(f"{name}: not available (module {OPTIONAL_BACKENDS.get(name)} did not import)")
            continue
        why = backend.supports(spec)
        if why is None:
            return backend, ([] if requested == "auto" else reasons)
        reasons.append(f"{name}: {why}")
    return _BACKENDS["inductor"], reasons


def _inductor_supports(spec: SiteSpec) -> str | None:
    return None


def _inductor_emit(emitter: Any, call: RotaryCall, like: Any) -> list:
    return emit_op_call(OPS, emitter, call, like)


register_backend(Backend("inductor", _inductor_supports, _inductor_emit))
