"""Registry of fused-op backends: which op a fused site becomes, per backend name.

Every backend op has the signature of `rope_fusion::rotary` / `rope_fusion::rotary_qk`, so the pass builds
one node whatever the backend. Backend modules (kernels/) register themselves on import; a backend that
cannot take a site says so through `supports`, and the pass falls back to the next one in `fallbacks`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """What a backend needs to decide whether it can take a site (all from fake tensors)."""

    device_type: str
    x_shape: tuple  # ints, None where the size is symbolic
    x_dtype: torch.dtype
    table_dtype: torch.dtype
    out_dtype: torch.dtype
    interleaved: bool
    rotary_dim: int
    full_tables: bool
    conjugate: bool
    paired: bool  # a q/k pair (rotary_qk) rather than one tensor


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    rotary: Any  # an OpOverload with rotary's signature
    rotary_qk: Any  # an OpOverload with rotary_qk's signature
    supports: Callable[[SiteSpec], bool]


_BACKENDS: dict[str, Backend] = {}

# For `auto`, per device type: the backends to try, best first (the order comes from BENCHMARKS.md).
AUTO_ORDER: dict[str, list[str]] = {
    "cpu": ["inductor"],
    "cuda": ["triton", "inductor"],
    "npu": ["npu", "inductor"],
}


def register_backend(backend: Backend) -> None:
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> Backend | None:
    _load_optional_backends()
    return _BACKENDS.get(name)


def available_backends() -> list[str]:
    _load_optional_backends()
    return sorted(_BACKENDS)


def choose_backend(requested: str, spec: SiteSpec) -> Backend:
    """The backend for one site: the requested one if it takes the site, else the next that does."""
    _load_optional_backends()
    if requested == "auto":
        order = AUTO_ORDER.get(spec.device_type, ["inductor"])
        if spec.device_type in ("cuda", "hip") and not _large(spec):
            order = ["inductor"]
    else:
        order = [requested]
    for name in order + ["inductor"]:
        b = _BACKENDS.get(name)
        if b is not None and b.supports(spec):
            return b
    return _BACKENDS["inductor"]


# On the H200 (BENCHMARKS.md) the Triton kernel, emitted as Inductor's own user-kernel node, beats the
# Inductor lowering for every spelling at every measured shape that moves tens of MB or more (1.02-1.07x the
# copy floor, partial NeoX at D=80 1.22x, against 1.12-2.3x for the lowering); on a decode step (1 MB) launch
# latency dominates and the lowering is faster (2.3-3.2x against 2.9-14.7x). Sizes that are not known at
# compile time count as small (the op call cannot be inlined).
TRITON_MIN_BYTES = 8 * 2**20


def _large(spec: SiteSpec) -> bool:
    if any(d is None for d in spec.x_shape):
        return False
    numel = 1
    for d in spec.x_shape:
        numel *= d
    elem = torch.empty((), dtype=spec.x_dtype).element_size()
    return numel * elem * 2 * (2 if spec.paired else 1) >= TRITON_MIN_BYTES


_loaded = False


def _load_optional_backends() -> None:
    """Import backend modules lazily: triton and torch_npu are optional extras."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    for mod in ("rope_fusion.kernels.triton_rotary", "rope_fusion.kernels.npu"):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass


def _always(spec: SiteSpec) -> bool:
    return True


register_backend(Backend("inductor", torch.ops.rope_fusion.rotary.default,
                         torch.ops.rope_fusion.rotary_qk.default, _always))
