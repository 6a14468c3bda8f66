"""Run a callback right after a module of another package is imported, without importing it.

`import rope_fusion` must stay light (no vLLM, no Inductor), yet two things have to happen the moment a heavy
module arrives: `rope_fusion.vllm_pass` becomes an instance of vLLM's `InductorPass` when vLLM imports it
(docs/design.md section 6), and the op's Inductor lowering is registered when Inductor's lowering table exists,
so that every graph Inductor lowers, whoever compiles it, finds the lowering. Both are one record here: a module
name and the callbacks that follow its import. One `sys.meta_path` finder serves them all; it finds nothing
itself and, for a watched name only, wraps the loader that the other finders return. A module imported before
its callback was registered gets the callback at once.

A callback that raises is logged (WARNING on the `rope_fusion` logger) and never fails the import it follows:
the module belongs to someone else.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

# vLLM's module that defines `InductorPass`; vLLM imports it before it reads its compilation config.
VLLM_PASS_MODULE = "vllm.compilation.passes.inductor_pass"
# Inductor's lowering table: every lowering registers there, and Inductor imports it before it lowers a graph.
INDUCTOR_LOWERING_MODULE = "torch._inductor.lowering"

log = logging.getLogger("rope_fusion")

_callbacks: dict[str, list[Callable[[types.ModuleType], None]]] = {}


def after_import(name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """Call `callback(module)` once module `name` has been executed: now if it is imported already, else right
    after whoever imports it first has run it."""
    module = sys.modules.get(name)
    if module is not None:
        _run(callback, module)
        return
    _callbacks.setdefault(name, []).append(callback)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _run(callback: Callable[[types.ModuleType], None], module: types.ModuleType) -> None:
    try:
        callback(module)
    except Exception as e:  # the import belongs to another package: never fail it
        log.warning("rope_fusion: %s after importing %s failed: %s: %s", getattr(callback, "__qualname__", callback),
                    module.__name__, type(e).__name__, e)


def _imported(module: types.ModuleType) -> None:
    for callback in _callbacks.pop(module.__name__, []):
        _run(callback, module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for a watched name, wraps the real loader so that the callbacks run after it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _NotifyingLoader(spec.loader)
                return spec
        return None


class _NotifyingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        _imported(module)

    def __getattr__(self, name: str) -> Any:  # resource readers, get_source, ... of the real loader
        return getattr(self.inner, name)


__all__ = ["INDUCTOR_LOWERING_MODULE", "VLLM_PASS_MODULE", "after_import"]
