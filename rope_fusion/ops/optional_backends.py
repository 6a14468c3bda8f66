"""Which optional backend modules exist and how they are loaded: a leaf that imports neither the op library nor
the backend registry, so both can use it at import time without importing each other.

Triton and torch_npu are optional extras: each backend module registers its `Backend` record and its device
kernels when it is imported, which `load_backends()` does once, on the first use that may need one (a compile,
an eager call of the op). A missing toolkit (ImportError) leaves that backend out.
"""

from __future__ import annotations

import importlib

# Optional backends: name -> module that registers it (imported on first use).
OPTIONAL_BACKENDS = {"triton": "rope_fusion.kernels.triton_rotary", "npu": "rope_fusion.kernels.npu"}

_loaded = False


def load_backends() -> None:
    """Import the optional backend modules once; a missing toolkit (ImportError) leaves that backend out."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in OPTIONAL_BACKENDS.values():
        try:
            importlib.import_module(module)
        except ImportError:
            pass


__all__ = ["OPTIONAL_BACKENDS", "load_backends"]
