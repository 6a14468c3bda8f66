"""`RopeFusionPass`: the Inductor post-grad custom pass.

One call walks the graph through four steps: find the rotations (sites.py), group q with k (grouping.py),
plan and commit the fused nodes (emission.py), and cache host tables (host_tables.py). The failure policy
(docs/design.md section 5) holds at every step: the graph is snapshotted first; a failure while planning one
group leaves that group unfused, any other failure restores the snapshot, and the report and the log line
say which happened.

The pass object is what Inductor's FX graph cache and vLLM's config hash see, so its `uuid()` covers the
package's source files and the options, and it pickles and deep-copies as a plain object (the report is
per instance, and a copy starts with an empty one).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import hashlib
import logging
import os
import time
from typing import Any

import torch.fx as fx

from ..ops.backends import BACKEND_NAMES, LeftToInductor, SiteSpec, choose_backend
from . import emission
from .emission import Emitter, GraphTransaction
from .fx_util import deferred_guards, guard_deferred_sizes
from .grouping import pair_up
from .kernel_rewrite import find_kernel_matches
from .provenance import dtype_name, role, rotation_source, source_line
from .report import PER_LANE, PER_PAIR, CacheReuse, GraphError, GraphRecord, Kernel, Miss, Report, Site
from .site_costs import graph_host_bound
from .sites import find_sites

try:  # torch passes `is_inference` to such passes (inference graph or training forward)
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PassBase
except ImportError:  # older torch
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase

log = logging.getLogger("rope_fusion")


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


# -- what a cache hit reuses -------------------------------------------------------------------------------

_LIVE: collections.Counter = collections.Counter()  # what passes recorded while running, per counter key


class CacheCounter:
    """Counts that the pass adds to Inductor's counters while it runs. Inductor stores the counter deltas of
    a compile in the FX graph cache entry and replays them on a hit, so the counters minus what passes
    recorded live is what cached graphs brought in."""

    FIELDS = ("graphs", "sites", "kernels")

    def __init__(self, uuid: str):
        tag = hashlib.sha256(uuid.encode()).hexdigest()[:16]
        self.keys = {f: f"rope_fusion_{f}:{tag}" for f in self.FIELDS}
        self.rebase()

    @staticmethod
    def _counters() -> collections.Counter:
        from torch._dynamo.utils import counters

        return counters["inductor"]

    def rebase(self) -> None:
        c = self._counters()
        self.base = {f: c[k] - _LIVE[k] for f, k in self.keys.items()}

    def add(self, **counts: int) -> None:
        c = self._counters()
        for f, n in counts.items():
            if n:
                c[self.keys[f]] += n
                _LIVE[self.keys[f]] += n

    def reused(self) -> CacheReuse:
        c = self._counters()
        return CacheReuse(**{f: max(0, c[k] - _LIVE[k] - self.base[f]) for f, k in self.keys.items()})


# -- the pass ----------------------------------------------------------------------------------------------

class RopeFusionPass(_PassBase):
    """Find every RoPE it can prove in a post-grad graph and replace it (or each q/k pair) with one fused op."""

    def __init__(self, backend: str = "auto", fuse_qk: bool = True, cache_host_tables: bool = True,
                 cuda_graphs: bool | None = None) -> None:
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
        if cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs must be None, True or False, got {cuda_graphs!r}")
        self.backend = backend
        self.fuse_qk = bool(fuse_qk)
        self.cache_host_tables = bool(cache_host_tables)  # ops/host_tables.py
        # Whether the compiled graph is replayed in CUDA graphs, which changes what a launch costs `auto`
        # (ops/cost_model.py): None reads it from the compile (`replayed_in_cuda_graphs`).
        self.cuda_graphs = cuda_graphs
        self._host_bound = False  # the graph being fused waits on the host (set per graph)
        self.report = Report()
        self.report.cache_counter = CacheCounter(self.uuid())
        self._logged: set = set()

    # -- CustomGraphPass -------------------------------------------------------------------------
    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        index = self.report.graphs
        self.report.graphs += 1
        record = GraphRecord(index, _graph_kind(graph, is_inference), "nothing to fuse")
        self.report.graph_records.append(record)
        start = time.perf_counter()
        # The lane analysis allocates hundreds of thousands of small dicts and tuples (the lanes of a wide
        # graph) and frees them by reference count; the cyclic collector's passes over the compiler's heap
        # were 60% of the pass's time on a real-size Flux graph (4.1 s, 1.7 s without). Paused, not skipped.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._run(graph, index, record)
        finally:
            if collecting:
                gc.enable()
            record.seconds = time.perf_counter() - start

    def replayed_in_cuda_graphs(self) -> bool:
        """The `cuda_graphs` option, else whether Inductor will record this compile in CUDA graphs
        (`mode="reduce-overhead"` sets `triton.cudagraphs`); a user who captures the compiled call in a graph
        of their own passes cuda_graphs=True."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        from torch._inductor import config

        return bool(config.triton.cudagraphs)

    def _run(self, graph: fx.Graph, index: int, record: GraphRecord) -> None:
        mark = self._mark()
        tx = GraphTransaction(graph)
        try:
            with deferred_guards():  # the analysis reads symbolic sizes without guarding (fx_util)
                planned = self._fuse(graph, index)
        except Exception as e:  # the failure policy: never break a compile
            try:
                tx.rollback()
                outcome = "graph unchanged"
            except Exception as undo:  # cannot happen unless FX itself misbehaves; say so
                outcome = f"graph NOT restored ({type(undo).__name__}: {undo})"
            self._truncate(mark)
            self.report.errors.append(GraphError(index, f"{type(e).__name__}: {e}", outcome))
            record.outcome = "unchanged after an error"
            self._log_once(("error", type(e).__name__), logging.WARNING,
                           "rope_fusion graph %d: %s after an internal error: %s: %s", index, outcome,
                           type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            return
        self._cache_tables(graph, index, planned)
        try:
            graph.eliminate_dead_code()
        except Exception:  # dead nodes are harmless; Inductor removes them too
            pass
        sites, kernels, misses = (len(getattr(self.report, f)) - mark[f] for f in ("sites", "kernels", "misses"))
        record.sites, record.kernels, record.misses = sites, kernels, misses
        if any(e.graph == index for e in self.report.errors):
            record.outcome = "partly fused after an error"
        elif sites:
            record.outcome = "fused"
        self.report.cache_counter.add(graphs=1, sites=sites, kernels=kernels)
        log.info("rope_fusion graph %d (%s): fused %d sites in %d kernels, %d near misses%s", index, record.kind,
                 sites, kernels, misses, "; some sites left unfused after an error" if
                 record.outcome.startswith("partly") else "")

    def _fuse(self, graph: fx.Graph, index: int) -> list:
        matches, misses, acc = find_sites(graph)
        kernel_matches, kernel_misses = find_kernel_matches(graph)
        if kernel_matches:
            matches = sorted(matches + kernel_matches, key=lambda m: acc.order[m.node])
        for node, reason in misses + kernel_misses:
            self.report.misses.append(Miss(index, node.name, reason, source_line(node)))
        if not matches:
            return []
        try:  # only graphs with sites to cost: the scan of the graph's inputs is not paid by the others
            self._host_bound = not self.replayed_in_cuda_graphs() and graph_host_bound(graph)
        except Exception:  # an input to the cost model, never a reason to fail: the GPU's costs then
            self._host_bound = False
        nodes, order = acc.interp.nodes, acc.order
        groups = pair_up(matches, acc) if self.fuse_qk else [(m,) for m in matches]
        em = Emitter(graph, requested=self.backend)
        planned = []
        for group in groups:
            anchor = emission.anchor_of(group, nodes, order)
            start = anchor.prev  # a group's nodes all go between start and anchor
            try:
                planned.append(emission.plan_group(em, group, nodes, anchor, self._choose, acc.depends_on))
            except LeftToInductor as e:  # the cost model: the model's own code is faster here
                emission.erase_between(graph, start, anchor)
                for m in group:
                    self.report.misses.append(Miss(index, m.node.name, f"left to Inductor: {e}",
                                                   rotation_source(m.node)))
            except Exception as e:  # this group stays as it was; the others still fuse
                emission.erase_between(graph, start, anchor)
                self.report.errors.append(GraphError(index, f"{group[0].node.name}: {type(e).__name__}: {e}",
                                                     "site left unfused"))
                self._log_once(("site", type(e).__name__), logging.WARNING,
                               "rope_fusion graph %d: a site was left unfused after an internal error: %s: %s",
                               index, type(e).__name__, e)
        emission.commit(planned)
        guard_deferred_sizes([n for p in planned for n in (*p.finals, *(m.node for m in p.group))])
        emission.finish(graph, planned, order)
        for p in planned:
            self._record(index, p, nodes)
        return planned

    def _choose(self, spec: SiteSpec):
        if spec.cost is not None:
            spec = dataclasses.replace(spec, cost=dataclasses.replace(spec.cost, host_bound=self._host_bound))
        backend, reasons = choose_backend(self.backend, spec)
        fallback = "; ".join(reasons)
        if fallback:
            self._log_once(("fallback", fallback), logging.WARNING,
                           "rope_fusion: backend %r did not take a site, using %r (%s)", self.backend,
                           backend.name, fallback)
        return backend, fallback

    def _record(self, index: int, p: emission.PlannedGroup, nodes: dict) -> None:
        kernel = len(self.report.kernels)
        ids = []
        for m, x in zip(p.group, p.xs):
            ids.append(len(self.report.sites))
            self.report.sites.append(Site(
                graph=index, node=m.node.name,
                style="deinterleave" if m.deinterleave else "interleaved" if m.interleaved else "neox",
                rotary_dim=m.rotary_dim, head_dim=m.head_dim, table_form=PER_LANE if m.full_tables else PER_PAIR,
                conjugate=m.conjugate, x_dtype=dtype_name(x.meta["val"].dtype),
                table_dtype=dtype_name(p.cos.meta["val"].dtype), out_dtype=dtype_name(m.node.meta["val"].dtype),
                shape=tuple(str(s) for s in m.node.meta["val"].shape), source=rotation_source(m.node),
                kernel=kernel, role=role(m.node), graph_kind=self.report.graph_records[index].kind,
                origin=m.origin, norm=p.norm, blocks=m.rotary_blocks, offset=m.offset, angles=p.angle_tables))
        self.report.kernels.append(Kernel(index, p.op_name, p.backend, ids, p.fallback))

    def _cache_tables(self, graph: fx.Graph, index: int, planned: list) -> None:
        """Host tables of fused sites: cached device copies (their own transaction: a failure keeps the sites)."""
        tables = list(dict.fromkeys(t for p in planned for t in (p.cos, p.sin)))  # angle tables: one node for both
        if not (self.cache_host_tables and tables):
            return
        from .host_tables import cache_host_tables

        tx = GraphTransaction(graph)
        try:
            names = cache_host_tables(graph, tables)
        except Exception as e:
            tx.rollback()
            self.report.errors.append(GraphError(index, f"host tables: {type(e).__name__}: {e}",
                                                 "host-table copies left as they were; the sites are fused"))
            self._log_once(("host", type(e).__name__), logging.WARNING,
                           "rope_fusion graph %d: host tables left as they were after an internal error: %s: %s",
                           index, type(e).__name__, e)
            return
        self.report.host_tables += [f"{index}:{name}" for name in names]

    def _mark(self) -> dict:
        return {f: len(getattr(self.report, f)) for f in ("sites", "kernels", "misses", "host_tables")}

    def _truncate(self, mark: dict) -> None:
        for f, n in mark.items():
            del getattr(self.report, f)[n:]

    def _log_once(self, key: Any, level: int, msg: str, *args: Any, **kw: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args, **kw)

    def uuid(self) -> Any:
        graphs = "" if self.cuda_graphs is None else f"-g{int(self.cuda_graphs)}"  # None: in Inductor's key
        return (f"rope_fusion-{source_hash()[:32]}-{self.backend}-{int(self.fuse_qk)}"
                f"-{int(self.cache_host_tables)}{graphs}")

    # -- copying and pickling: options travel, the report does not --------------------------------
    def __getstate__(self) -> dict:
        return {"backend": self.backend, "fuse_qk": self.fuse_qk, "cache_host_tables": self.cache_host_tables,
                "cuda_graphs": self.cuda_graphs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend!r}, fuse_qk={self.fuse_qk}, "
                f"cache_host_tables={self.cache_host_tables}, cuda_graphs={self.cuda_graphs})")


def _graph_kind(graph: fx.Graph, is_inference: bool | None) -> str:
    """AOTAutograd names the incoming gradients of a backward graph `tangents_N`."""
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        if n.name.startswith("tangents"):
            return "backward"
    if is_inference is None:
        return "forward or inference"
    return "inference" if is_inference else "forward"


__all__ = ["RopeFusionPass", "CacheCounter", "source_hash", "log"]
