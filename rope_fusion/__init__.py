"""rope_fusion: recognise rotary position embeddings in compiled graphs and replace them with one fused op.

An Inductor post-grad pass proves which subgraphs compute a RoPE rotation and replaces q and k with one fused
node; its report says what fused, what was left alone and why:

    import rope_fusion, torch
    p = rope_fusion.RopeFusionPass()
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": p})
    compiled(*inputs)
    print(p.report.table())       # also one INFO line per graph on the "rope_fusion" logger

`rope_fusion.install()` runs the pass in every later torch.compile of the process instead.

Importing the package defines the `rope_fusion::*` ops and loads nothing heavy: no Dynamo, no Inductor, no
Triton, no vLLM, no depyf. A command line tool or a script that only calls the op should not wait for a
compiler it does not use, and vLLM must not be imported behind its back (it changes process settings). The
public names below load their modules on first use (`RopeFusionPass` brings Inductor, the pass's base class);
the op's Inductor lowering registers when Inductor loads (ops/__init__.py), and `vllm_pass` becomes vLLM's type
when vLLM loads (import_hooks.py).
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from . import import_hooks, ops  # noqa: F401  (ops: defines the rope_fusion::* ops)
from .ops import apply_rotary, apply_rotary_qk, apply_rotary_qk_kv_cache, apply_rotary_qkv, clear_caches

# Public names defined in modules that load on first use: name -> module (relative to this package).
_LAZY_NAMES = {
    "RopeFusionPass": ".passes.rope_pass",
    "Report": ".passes.report",
    "inductor_options": ".integrations.installation",
    "install": ".integrations.installation",
    "installed": ".integrations.installation",
    "uninstall": ".integrations.installation",
    "backend": ".integrations.dynamo_backend",
    "fx_pass": ".integrations.fx_pass",
    "FxPass": ".integrations.fx_pass",
    "debug": ".integrations.depyf_debug",
    "vllm_pass": ".integrations.vllm",
    "rms_norm_rope_qk": ".norm_rope",
}
# Subpackages and modules reachable as attributes of the package, imported on first use.
_LAZY_MODULES = ("cli", "compat", "integrations", "kernels", "norm_rope", "passes")


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # read once; `vllm_pass` is rebound below when vLLM arrives
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_LAZY_MODULES))


def _bind_vllm_pass(module: types.ModuleType) -> None:
    """vLLM's InductorPass module was imported: `rope_fusion.vllm_pass` becomes an instance of it, in the package's
    own namespace, since vLLM's string form reads `__import__("rope_fusion").__dict__["vllm_pass"]`."""
    from .integrations.vllm import rebind

    globals()["vllm_pass"] = rebind(module)


import_hooks.after_import(import_hooks.VLLM_PASS_MODULE, _bind_vllm_pass)


def _version() -> str:
    """The installed distribution's version; a source tree that was never installed reads its pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rope_fusion")
    except PackageNotFoundError:
        import os
        import re

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        try:
            with open(path) as f:
                found = re.search(r'(?m)^version\s*=\s*"([^"]+)"', f.read())
        except OSError:
            found = None
        return found.group(1) if found else "0+unknown"


__version__ = _version()

__all__ = ["RopeFusionPass", "Report", "apply_rotary", "apply_rotary_qk", "apply_rotary_qkv", "rms_norm_rope_qk",
           "apply_rotary_qk_kv_cache", "clear_caches", "compat", "inductor_options", "install", "installed",
           "uninstall", "vllm_pass", "debug", "fx_pass", "FxPass", "backend", "__version__"]
