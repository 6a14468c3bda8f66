"""`RopeFusionPass`: the Inductor post-grad custom pass.

One call walks the graph through four steps: find the rotations (analysis/sites.py), group q with k
(analysis/grouping.py), plan and commit the fused nodes (emission.py), and cache host tables (host_tables.py). The
failure policy (docs/design.md section 5) holds at every step: the graph is snapshotted first; a failure while planning
one group leaves that group unfused, any other failure restores the snapshot, and the report and the log line
say which happened.

The pass object is what Inductor's FX graph cache and vLLM's config hash see, so its `uuid()` covers the
package's source files and the options, and it pickles and deep-copies as a plain object (the report is
per instance, and a copy starts with an empty one).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import time
from typing import Any

import torch.fx as fx

from ..fx_sizes import hint_reads
from ..ops import device_registry
from ..ops.backends import BACKEND_NAMES, LeftToInductor, SiteSpec
from . import emission, fusion_check
from .analysis.grouping import pair_up
from .analysis.padded_sums import merge_padded_sums
from .analysis.provenance import dtype_name, named_values, role, rotation_source, source_line, tensor_name
from .analysis.sites import find_sites
from .analysis.symbolic_sizes import ReadsSymbolicSize, check_group, check_none_needed, hold_symbolic, site_roots
from .auto import auto_budget, auto_timing
from .auto.choosers import AUTO_CHOOSER, Choice, Chooser, GraphFacts
from .auto.site_costs import graph_host_bound
from .cache_ledger import LEDGER, take_in_cache_replays
from .emission import Emitter, GraphTransaction
from .kernel_sites.kernel_scan import claim_kernel_sites
from .pass_identity import PassBase, source_hash
from .report import FROM_CACHE, GraphError, GraphRecord, Kernel, Miss, Report, Site, fused_text, plain_params

log = logging.getLogger("rope_fusion")


# -- the pass ----------------------------------------------------------------------------------------------

class RopeFusionPass(PassBase):
    """Find every RoPE it can prove in a post-grad graph and replace it (or each q/k pair) with one fused op."""

    def __init__(self, backend: str = "auto", fuse_qk: bool = True, cache_host_tables: bool = True,
                 cuda_graphs: bool | None = None, measure: bool | str = "auto", verify: bool | None = None,
                 chooser: Chooser = AUTO_CHOOSER) -> None:
        if isinstance(backend, (fx.Graph, fx.GraphModule)):  # the class was configured where an instance goes
            raise TypeError(_misconfigured(backend, "the class RopeFusionPass"))
        if not isinstance(backend, str) or backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
        for name, value in (("fuse_qk", fuse_qk), ("cache_host_tables", cache_host_tables)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if not (isinstance(measure, bool) or measure == "auto"):
            raise TypeError(f'measure must be "auto", True or False, got {measure!r}')
        for name, value in (("cuda_graphs", cuda_graphs), ("verify", verify)):
            if not isinstance(value, (bool, type(None))):
                raise ValueError(f"{name} must be None, True or False, got {value!r}")
        self.backend = backend
        self.fuse_qk = fuse_qk
        self.cache_host_tables = cache_host_tables  # ops/host_tables.py
        # Whether the compiled graph is replayed in CUDA graphs, which changes what a launch costs `auto`
        # (ops/cost_model.py): None reads it from the compile (`replayed_in_cuda_graphs`).
        self.cuda_graphs = cuda_graphs
        # `auto` times its choices on the compile's GPU (passes/auto/auto_timing.py): "auto" where the factor table
        # cannot call the choice (passes/auto/auto_budget.py), True at every site, False never (the table decides)
        self.measure = measure
        # every fused group evaluated eagerly against the code it replaces before it is committed
        # (passes/fusion_check.py); None reads ROPE_FUSION_VERIFY
        self.verify = verify
        # how a site's backend is picked (passes/auto/choosers.py): the backend asked for or `auto`, unless a pass for
        # another compile stack names its own
        self.chooser = chooser
        self.report = Report(refresh=take_in_cache_replays)
        self._logged: set = set()

    # -- CustomGraphPass -------------------------------------------------------------------------
    def __call__(self, graph: fx.Graph, is_inference: bool | None = None, *, config: Any = None) -> None:
        """`config`: the compiler's config where one called the pass (npugraph_ex, TorchAir), which its chooser
        may read; Inductor passes none."""
        if not isinstance(graph, fx.Graph):
            raise TypeError(_misconfigured(graph, "a RopeFusionPass"))
        if auto_timing.measuring():  # a candidate's standalone compile inside this pass: plain Inductor
            return
        if self.measure == "auto":  # every graph of the compile earns its allowance, a rotation in it or not
            auto_budget.allowance(graph)
        take_in_cache_replays()  # graphs a cache served before this one come first in the report
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
            self._run(graph, index, record, config)
        finally:
            if collecting:
                gc.enable()
            record.seconds = time.perf_counter() - start
        try:  # the records travel with the compiled graph into Inductor's caches (CacheLedger)
            LEDGER.recorded(self.tag, self.report.graph_payload(index))
        except Exception as e:  # a report detail, never a reason to fail the compile
            log.debug("rope_fusion graph %d: records not stored for the compile cache: %s: %s", index,
                      type(e).__name__, e)

    def take_replay(self, payload: str) -> None:
        """A compile cache served a graph that this pass fused (or left alone) in an earlier compile: called by the
        cache ledger (cache_ledger.py), which alone knows which pass a replay belongs to."""
        try:
            record = self.report.add_cached_graph(payload)
        except Exception as e:  # records of another version of the package, or damaged: the graph still runs
            log.debug("rope_fusion: records from the compile cache not read: %s: %s", type(e).__name__, e)
            return
        self._log_graph(record)

    def _log_graph(self, record: GraphRecord) -> None:
        """The one INFO line per graph, the same whether the pass ran on it or a compile cache served it."""
        outcome = {"partly fused after an error": "; some sites left unfused after an error",
                   "unchanged after an error": "; left unchanged after an internal error"}.get(record.outcome, "")
        log.info("rope_fusion graph %d (%s): %s%s%s", record.index, record.kind,
                 fused_text(record.sites, record.kernels, record.misses), outcome,
                 FROM_CACHE if record.from_cache else "")

    def replayed_in_cuda_graphs(self) -> bool:
        """The `cuda_graphs` option, else whether Inductor will record this compile in CUDA graphs
        (`mode="reduce-overhead"` sets `triton.cudagraphs`); a user who captures the compiled call in a graph
        of their own passes cuda_graphs=True."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        from torch._inductor import config

        return bool(config.triton.cudagraphs)

    def _run(self, graph: fx.Graph, index: int, record: GraphRecord, config: Any = None) -> None:
        mark = self._mark()
        tx = GraphTransaction(graph)
        try:
            with hint_reads():  # the analysis reads symbolic sizes without guarding (fx_sizes)
                planned = self._fuse(graph, index, config)
        except Exception as e:  # the failure policy: never break a compile
            try:
                tx.rollback()
                outcome = "graph unchanged"
            except Exception as undo:  # cannot happen unless FX itself misbehaves; say so
                outcome = f"graph NOT restored ({type(undo).__name__}: {undo})"
            self._truncate(mark)
            self.report.errors.append(GraphError(index, f"{type(e).__name__}: {e}", outcome))
            record.outcome = "unchanged after an error"
            self.log_once(("error", type(e).__name__), logging.WARNING,
                           "rope_fusion graph %d: %s after an internal error: %s: %s", index, outcome,
                           type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            return
        self._cache_tables(graph, index, planned)
        self._run_epilogues(graph, index, planned, mark["kernels"])
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
        self._log_graph(record)

    def _fuse(self, graph: fx.Graph, index: int, config: Any = None) -> list:
        merge_padded_sums(graph)  # a rotation's backward padded with zero rows becomes one node (padded_sums.py)
        matches, misses, acc = find_sites(graph)
        kernel_sites, kernel_misses = claim_kernel_sites(graph)
        if kernel_sites:
            matches = sorted(matches + kernel_sites, key=lambda m: acc.order[m.node])
        named = {n.name: n for n in graph.nodes} if misses or kernel_misses else {}
        for node, reason in misses + kernel_misses:
            self.report.misses.append(Miss(index, node.name, str(reason), source_line(node), tensor_name(node),
                                           named_values(str(reason), named)))
        if not matches:
            return []
        facts = GraphFacts(self._host_bound(graph), config)
        nodes, order = acc.interp.nodes, acc.order
        # never a guard: a site whose proof read a symbolic size is left
        matches, held = hold_symbolic(matches, nodes, acc.interp.values)
        for m, why in held:
            self.report.misses.append(Miss(index, m.node.name, why, rotation_source(m.node)))
        groups = pair_up(matches, acc) if self.fuse_qk else [(m,) for m in matches]
        em = Emitter(graph, requested=self.backend)
        known = set(graph.nodes) if fusion_check.enabled(self.verify) else None  # what the pass did not emit
        planned = []
        for group in groups:
            anchor = emission.anchor_of(group, nodes, order)
            start = anchor.prev  # a group's nodes all go between start and anchor
            joins = dict(em.joins)
            try:
                p = emission.plan_group(em, group, nodes, anchor, lambda spec: self._choose(spec, facts),
                                        acc.depends_on)
                check_group(group, nodes, acc.interp.values)  # never a guard: what planning read is checked too
                if known is not None:
                    fusion_check.verify_group(p, known, f"graph {index}: the fused {p.op_name} of {group[0].node}")
                planned.append(p)
            except LeftToInductor as e:  # the model's own code is faster here, or the fused form disagreed with it
                emission.erase_between(graph, start, anchor)
                em.joins.clear()
                em.joins.update(joins)  # a refused group's writes into a join are not there
                reason = (str(e) if isinstance(e, (fusion_check.FusionDisagreed, ReadsSymbolicSize))
                          else f"left to Inductor: {e}")
                for m in group:
                    self.report.misses.append(Miss(index, m.node.name, reason, rotation_source(m.node),
                                                   tensor_name(m.node)))
            except Exception as e:  # this group stays as it was; the others still fuse
                emission.erase_between(graph, start, anchor)
                self.report.errors.append(GraphError(index, f"{group[0].node.name}: {type(e).__name__}: {e}",
                                                     "site left unfused"))
                self.log_once(("site", type(e).__name__), logging.WARNING,
                               "rope_fusion graph %d: a site was left unfused after an internal error: %s: %s",
                               index, type(e).__name__, e)
        emission.commit(planned)
        emission.finish_folds(em)
        check_none_needed([n for p in planned for m in p.group for n in site_roots(m, nodes)], acc.interp.values)
        emission.finish(graph, planned, order)
        for p in planned:
            self._record(index, p)
        return planned

    def _host_bound(self, graph: fx.Graph) -> bool:
        """Whether a compiled call of the graph waits on the host (only graphs with sites to cost: the scan of the
        graph's inputs is not paid by the others)."""
        try:
            return not self.replayed_in_cuda_graphs() and graph_host_bound(graph)
        except Exception:  # an input to the cost model, never a reason to fail: the GPU's costs then
            return False

    def _choose(self, spec: SiteSpec, facts: GraphFacts) -> Choice:
        """One site's backend, by the pass's chooser."""
        return self.chooser.choose(self, spec, facts)

    def _record(self, index: int, p: emission.PlannedGroup) -> None:
        """The report's records of a planned group: its sites with the parameters the op was called with."""
        kernel = len(self.report.kernels)
        ids = []
        for i, (m, x) in enumerate(zip(p.group, p.xs)):
            params = plain_params(p.params.of_tensor(i))  # each tensor's own (offset_q_only: k from lane 0)
            ids.append(len(self.report.sites))
            val = m.node.meta["val"]
            self.report.sites.append(Site(
                graph=index, node=m.node.name, head_dim=m.x.head_dim, x_dtype=dtype_name(x.meta["val"].dtype),
                table_dtype=dtype_name(p.cos.meta["val"].dtype), shape=tuple(str(s) for s in val.shape),
                source=rotation_source(m.node), params=params, kernel=kernel, role=role(m.node), origin=m.origin,
                graph_kind=self.report.graph_records[index].kind, norm=p.norm))
        self.report.kernels.append(Kernel(index, p.op_name, p.backend, ids, p.fallback, p.choice.why, p.fold))

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
            self.log_once(("host", type(e).__name__), logging.WARNING,
                           "rope_fusion graph %d: host tables left as they were after an internal error: %s: %s",
                           index, type(e).__name__, e)
            return
        self.report.host_tables += [f"{index}:{name}" for name in names]

    def _run_epilogues(self, graph: fx.Graph, index: int, planned: list, first_kernel: int) -> None:
        """The folds that act on what the fused nodes feed (passes/folds/fold_registry.py `epilogues`), each in its own
        transaction: a failure keeps the sites fused and the graph around them as it was. Each outcome is its
        fused node's kernel's fold line, or a near miss where no fused node feeds the place."""
        if not planned:
            return
        from .folds.fold_registry import epilogues, fused_node

        kernels = {fused_node(p): first_kernel + i for i, p in enumerate(planned)}  # before a fold erases them
        kernels.pop(None, None)
        for fold in epilogues():
            tx = GraphTransaction(graph)
            try:
                outcomes = fold.epilogue(graph, self.backend)
            except Exception as e:
                tx.rollback()
                self.report.errors.append(GraphError(index, f"{fold.name} fold: {type(e).__name__}: {e}",
                                                     "left as it was; the sites are fused"))
                self.log_once((fold.name, type(e).__name__), logging.WARNING,
                               "rope_fusion graph %d: %s fold left after an internal error: %s: %s", index,
                               fold.name, type(e).__name__, e)
                continue
            for o in outcomes:
                kernel = kernels.get(o.fused)
                if kernel is None:
                    self.report.misses.append(Miss(index, o.where, o.line, o.source, o.subject))
                elif o.op_name is not None:
                    self.report.kernels[kernel].fold, self.report.kernels[kernel].op = o.line, o.op_name
                elif not self.report.kernels[kernel].fold:  # a group fold's own refusal says more
                    self.report.kernels[kernel].fold = o.line

    def _mark(self) -> dict:
        return {f: len(getattr(self.report, f)) for f in ("sites", "kernels", "misses", "host_tables")}

    def _truncate(self, mark: dict) -> None:
        for f, n in mark.items():
            del getattr(self.report, f)[n:]

    def log_once(self, key: Any, level: int, msg: str, *args: Any, **kw: Any) -> None:
        """Log a message once per key for this pass: a problem met at every graph of a model (a backend that
        cannot take its sites, say) is said once, not once a graph; the report holds each occurrence."""
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args, **kw)

    def uuid(self) -> Any:
        """The package sources and the options, never the instance: the FX graph cache key, which a new
        process must compute alike. Inductor asks for it at the start of every compile the pass takes part in,
        which is how a cache hit's records find this instance (CacheLedger)."""
        try:
            LEDGER.asked(self)
        except Exception as e:  # the report of a warm run may then miss graphs; the key is unaffected
            log.debug("rope_fusion: compile-cache records not tracked: %s: %s", type(e).__name__, e)
        return self._options_key() + self._decisions_key()

    def _decisions_key(self) -> str:
        """Whether `auto` measures, and the calibrated tables it could read (their content hash), never the
        decisions file: a measuring compile writes every decision it compiled by, so its graph is the graph a
        later compile reading that file would build, and serving it is what lets a process's second start hit
        the cache as plain compile's does. A compile that does not measure reads no decisions."""
        if self.backend != "auto" or not self.chooser.reads_decisions:
            return ""
        from .auto.auto_decisions import fingerprint

        on, _ = auto_timing.enabled(self.measure)
        return f"-m{int(on)}-d{fingerprint()}"

    def _options_key(self) -> str:
        graphs = "" if self.cuda_graphs is None else f"-g{int(self.cuda_graphs)}"  # None: in Inductor's key
        chooser = "" if self.chooser is AUTO_CHOOSER else f"-{self.chooser.name}"
        # the devices whose kernels are emitted as their own nodes, where a benchmark or a test changed them
        nodes = "" if device_registry.NODE_DEVICES == ("cuda",) else f"-n{'.'.join(device_registry.NODE_DEVICES)}"
        return (f"rope_fusion-{source_hash()[:32]}-{self.backend}{chooser}-{int(self.fuse_qk)}"
                f"-{int(self.cache_host_tables)}{graphs}{nodes}{_MEASURE_KEYS[self.measure]}"
                f"{'-verify' if fusion_check.enabled(self.verify) else ''}")

    @property
    def tag(self) -> str:
        """The options' short hash that names this pass's records in the compile caches."""
        return hashlib.sha256(self._options_key().encode()).hexdigest()[:16]

    # -- copying and pickling: options travel, the report does not --------------------------------
    def __getstate__(self) -> dict:
        state = {"backend": self.backend, "fuse_qk": self.fuse_qk, "cache_host_tables": self.cache_host_tables,
                 "cuda_graphs": self.cuda_graphs, "measure": self.measure, "verify": self.verify}
        return state if self.chooser is AUTO_CHOOSER else {**state, "chooser": self.chooser}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend!r}, fuse_qk={self.fuse_qk}, "
                f"cache_host_tables={self.cache_host_tables}, cuda_graphs={self.cuda_graphs}, measure={self.measure}, "
                f"verify={self.verify})")


# the measure policy in the options key: "auto" and False as before this policy had a third value
_MEASURE_KEYS = {"auto": "", True: "-measure-all", False: "-nomeasure"}


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


def _misconfigured(got: Any, what: str) -> str:
    """What to do instead, when the pass (or its class) was given to torch.compile as something it is not."""
    ways = ['torch.compile(f, options={"post_grad_custom_post_pass": rope_fusion.RopeFusionPass()})',
            "rope_fusion.install() before torch.compile(f)",
            'torch.compile(f, backend=rope_fusion.backend("inductor"))']
    if isinstance(got, fx.GraphModule):  # Dynamo calls a backend with (GraphModule, example inputs)
        problem = f"{what} was given as a torch.compile backend; it is an Inductor post-grad pass"
    else:  # Inductor calls the configured pass with the graph: the class was configured, not an instance
        problem = f"{what} was called with {type(got).__name__}: configure an instance, RopeFusionPass(), not the class"
    return f"{problem}. Use {', or '.join(ways)}"


__all__ = ["RopeFusionPass", "source_hash", "log"]
