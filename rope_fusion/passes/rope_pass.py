"""`RopeFusionPass`: the Inductor post-grad custom pass, and the ways to install it.

The pass object is what Inductor's FX graph cache and vLLM's config hash see, so its `uuid()` covers the
package's source files and the options, and it pickles and deep-copies as a plain object (the report is
per instance, and a copy starts with an empty one).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .report import GraphError, Report

log = logging.getLogger("rope_fusion")

BACKENDS = ("auto", "inductor", "triton", "npu")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Hash of every .py file of the package: any code change changes the pass's uuid."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


class RopeFusionPass(CustomGraphPass):
    """Find every RoPE in a post-grad graph and replace it (or each q/k pair) with one fused op."""

    def __init__(self, backend: str = "auto", fuse_qk: bool = True, cache_host_tables: bool = True) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.fuse_qk = bool(fuse_qk)
        self.cache_host_tables = bool(cache_host_tables)  # ops/host_tables.py
        self.report = Report()
        self._logged_error = False

    # -- CustomGraphPass -------------------------------------------------------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        from .rewrite import fuse_graph

        index = self.report.graphs
        self.report.graphs += 1
        n_sites, n_kernels, n_misses, n_host = (len(self.report.sites), len(self.report.kernels),
                                                len(self.report.misses), len(self.report.host_tables))
        try:
            fuse_graph(graph, self.report, index, backend=self.backend, fuse_qk=self.fuse_qk,
                       cache_host_tables=self.cache_host_tables)
        except Exception as e:  # the failure policy: never break a compile
            del self.report.sites[n_sites:], self.report.kernels[n_kernels:], self.report.misses[n_misses:]
            del self.report.host_tables[n_host:]
            self.report.errors.append(GraphError(index, f"{type(e).__name__}: {e}"))
            if not self._logged_error:
                self._logged_error = True
                log.warning("rope_fusion left a graph unchanged after an internal error: %s: %s",
                            type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            return
        log.info("rope_fusion graph %d: fused %d sites in %d kernels, %d near misses", index,
                 len(self.report.sites) - n_sites, len(self.report.kernels) - n_kernels,
                 len(self.report.misses) - n_misses)

    def uuid(self) -> Any:
        return (f"rope_fusion-{source_hash()[:32]}-{self.backend}-{int(self.fuse_qk)}"
                f"-{int(self.cache_host_tables)}")

    # -- copying and pickling: options travel, the report does not --------------------------------
    def __getstate__(self) -> dict:
        return {"backend": self.backend, "fuse_qk": self.fuse_qk, "cache_host_tables": self.cache_host_tables}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend!r}, fuse_qk={self.fuse_qk}, "
                f"cache_host_tables={self.cache_host_tables})")


def inductor_options(pass_: RopeFusionPass | None = None, **pass_kwargs: Any) -> dict:
    """Options for `torch.compile(m, options=...)` that run the pass (a new one unless given)."""
    return {"post_grad_custom_post_pass": pass_ if pass_ is not None else RopeFusionPass(**pass_kwargs)}


class _ChainedPass(CustomGraphPass):
    """Runs a pass that was already configured, then ours; keeps both uuids in its own."""

    def __init__(self, first: Any, second: RopeFusionPass) -> None:
        self.first = first
        self.second = second

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Any:
        first = self.first.uuid() if hasattr(self.first, "uuid") else repr(self.first)
        return ("chain", first, self.second.uuid())

    @property
    def report(self) -> Report:
        return self.second.report


_installed: list = []  # stack of (previous config value, installed pass)


def install(pass_: RopeFusionPass | None = None, **pass_kwargs: Any) -> RopeFusionPass:
    """Run the pass in every later torch.compile of this process (chained after any pass already set).

    Returns the installed pass, whose `report` fills as graphs compile. `uninstall()` undoes it.
    """
    import torch._inductor.config as cfg

    p = pass_ if pass_ is not None else RopeFusionPass(**pass_kwargs)
    previous = cfg.post_grad_custom_post_pass
    cfg.post_grad_custom_post_pass = p if previous is None else _ChainedPass(previous, p)
    _installed.append((previous, p))
    return p


def uninstall() -> None:
    """Restore the post-grad pass that was configured before the last `install()`."""
    import torch._inductor.config as cfg

    if not _installed:
        return
    previous, _ = _installed.pop()
    cfg.post_grad_custom_post_pass = previous
