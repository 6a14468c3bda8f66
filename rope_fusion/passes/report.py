"""What the pass did, in records that a person (depyf dump, `rope-fusion explain`) can read.

The report accumulates over every graph the pass sees. Counts are per compiled graph, not per run: a graph
that Dynamo compiles once and runs for several layers (a block after a graph break) reports its sites once.
A graph served from Inductor's FX graph cache never reaches the pass. So that the second run of a script
reads like the first, the pass stores each graph's records with its cached artifact (`graph_payload`, kept in
the counters that Inductor saves with a compile and replays on a hit), and a hit adds them back
(`add_cached_graph`), marked "(from the compile cache)". Records are plain dataclasses of strings and numbers
so that they pickle and print without the graph they came from.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from . import report_text
from .report_text import FROM_CACHE, counted, fused_text  # noqa: F401  (the report's words, one place)

# Table forms as the report names them: one entry per rotated pair, or one per lane.
PER_PAIR, PER_LANE = "per-pair", "per-lane"


@dataclasses.dataclass
class Site:
    """One rotated tensor (a q/k pair is two sites): where it is, what it reads, and `params`, the op's parameters it
    was fused with (ops/schema.RotaryParams, dtypes by name). Each parameter reads as an attribute of its own
    name (`s.rotary_dim`, `s.rotary_offset`, `s.angle_tables`), so a parameter added to the op reaches the report
    without a field here."""

    graph: int  # index of the graph in this report
    node: str  # name of the replaced node in the post-grad graph
    head_dim: int
    x_dtype: str
    table_dtype: str
    shape: tuple
    source: str  # "file:line" of the model code, from the node's stack trace
    params: dict  # RotaryParams' fields by name (`plain_params`)
    kernel: int = -1  # index into Report.kernels
    role: str = "x"  # "q" or "k" when the model source names it so, else "x"
    origin: str = "arithmetic"  # what was replaced: RoPE arithmetic, or a rotary kernel already in the graph
    graph_kind: str = ""  # "inference", "forward" or "backward" (GraphRecord.kind)
    norm: str = ""  # the QK-norm before the rotation: "rms folded", or why it stayed in the graph

    def __getattr__(self, name: str):
        params = self.__dict__.get("params")
        if params is None or name not in params:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return params[name]

    @property
    def style(self) -> str:
        """"neox", "interleaved" or "deinterleave" (interleaved pairs written in NeoX order)."""
        return "deinterleave" if self.deinterleave else "interleaved" if self.interleaved else "neox"

    @property
    def table_form(self) -> str:
        return PER_LANE if self.full_tables else PER_PAIR

    def rotated_lanes(self) -> str:
        """The rotary dim, or the rotated lane range when a pass-through head precedes it: "64" or "128:192"."""
        off = self.rotary_offset
        return f"{off}:{off + self.rotary_dim}" if off else str(self.rotary_dim)

    def style_label(self) -> str:
        """The pairing as a person reads it: "neox x3 blocks conjugate"."""
        return self.style + (f" x{self.rotary_blocks} blocks" if self.rotary_blocks > 1 else "") + \
            (" conjugate" if self.conjugate else "")


def plain_params(params: Any) -> dict:
    """A RotaryParams as the report keeps it: every field by name, plain values (a dtype by its name), so that the
    record prints, pickles and travels as JSON."""
    return {f.name: _plain(getattr(params, f.name)) for f in dataclasses.fields(params)}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else str(value).replace("torch.", "")


@dataclasses.dataclass
class Kernel:
    """One fused node emitted into the graph."""

    graph: int
    op: str  # e.g. "rope_fusion.rotary_qk"
    backend: str
    sites: list  # indices into Report.sites
    fallback: str = ""  # why the backend that was asked for did not take the site
    choice: str = ""  # how `auto` chose on a device it measures: "measured ...", "cached ..." or "table: ..."
    fold: str = ""  # data movement folded into the node ("slice write: q[dim 2, 226:4096], ..."), or why not


@dataclasses.dataclass
class Miss:
    """RoPE-looking arithmetic that was left alone, and why."""

    graph: int
    node: str  # the FX node (verbose only: a person knows the source line and the tensor)
    reason: str
    source: str
    tensor: str = ""  # what the model calls the value (the name it assigned), else its shape and dtype
    names: dict = dataclasses.field(default_factory=dict)  # FX names in `reason` -> a person's words for them

    def plain_reason(self) -> str:
        """The reason with the FX names it mentions said as a person can place them (`names`)."""
        return report_text.with_names(self.reason, self.names)


@dataclasses.dataclass
class GraphError:
    """An internal error and what it left: "graph unchanged" or "site left unfused" (the failure policy)."""

    graph: int
    error: str
    outcome: str = "graph unchanged"


@dataclasses.dataclass
class GraphRecord:
    """One post-grad graph the pass saw."""

    index: int
    kind: str  # "inference", "forward" (training) or "backward"
    outcome: str  # "fused", "nothing to fuse", "unchanged after an error", "partly fused after an error"
    sites: int = 0
    kernels: int = 0
    misses: int = 0
    seconds: float = 0.0  # the pass's own time on this graph (its share of the compile time)
    from_cache: bool = False  # served by a compile cache: the records are those of the compile that stored it


@dataclasses.dataclass
class CacheReuse:
    """Graphs served from a compile cache since the report started: the pass did not run on them, their cached
    code is what it produced when they were first compiled, and their records are in the report too."""

    graphs: int = 0
    sites: int = 0
    kernels: int = 0
    misses: int = 0


@dataclasses.dataclass
class Report:
    sites: list = dataclasses.field(default_factory=list)
    kernels: list = dataclasses.field(default_factory=list)
    misses: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    host_tables: list = dataclasses.field(default_factory=list)  # "graph:input" copied once, not per call
    graph_records: list = dataclasses.field(default_factory=list)
    graphs: int = 0
    # Called before the report is read (set by the pass): takes in what a cache hit replayed since.
    refresh: Callable[[], None] | None = dataclasses.field(default=None, repr=False, compare=False)

    def clear(self) -> None:
        self._refresh()  # what was replayed before the clear is cleared with the rest
        for records in (self.sites, self.kernels, self.misses, self.errors, self.host_tables, self.graph_records):
            records.clear()
        self.graphs = 0

    def _refresh(self) -> None:
        if self.refresh is not None:
            self.refresh()

    @property
    def seconds(self) -> float:
        """The pass's own time over every graph it saw: what it adds to the compile, Inductor's work on the
        fused nodes (a Triton kernel's compile) aside."""
        return sum(g.seconds for g in self.graph_records)

    @property
    def cached(self) -> CacheReuse:
        """What of the report a compile cache served."""
        self._refresh()
        graphs = [g for g in self.graph_records if g.from_cache]
        return CacheReuse(len(graphs), sum(g.sites for g in graphs), sum(g.kernels for g in graphs),
                          sum(g.misses for g in graphs))

    def from_cache(self, graph: int) -> bool:
        """Whether the graph of that index was served by a compile cache."""
        return 0 <= graph < len(self.graph_records) and self.graph_records[graph].from_cache

    def summary(self) -> str:
        """What fused first; then, where a compile cache served graphs, how much of it came from there."""
        c = self.cached
        text = fused_text(len(self.sites), len(self.kernels), len(self.misses))
        if c.graphs and c.graphs == len(self.graph_records):
            return text + FROM_CACHE
        if c.graphs:
            text += (f" ({counted(c.sites, 'site')} in {counted(c.kernels, 'kernel')} and "
                     f"{counted(c.misses, 'near miss')} of {counted(c.graphs, 'graph')} from the compile cache)")
        return text

    def table(self, verbose: bool = False) -> str:
        """The report as text (passes/report_text.py): a header, then per graph one line per site, near miss and
        error, each under 160 characters; `verbose=True` adds why a norm stayed, how `auto` chose, what a
        kernel folded, the FX nodes and full paths."""
        self._refresh()
        return report_text.table(self, verbose)

    # -- what travels with a cached graph ---------------------------------------------------------------
    def graph_payload(self, graph: int) -> str:
        """The records of one graph as compact JSON, its indices relative to the graph (graph numbers and the
        sites' and kernels' positions in this report mean nothing in the process that reads it back)."""
        rec = self.graph_records[graph]
        sites = [i for i, s in enumerate(self.sites) if s.graph == graph]
        kernels = [i for i, k in enumerate(self.kernels) if k.graph == graph]
        site_at, kernel_at = {i: n for n, i in enumerate(sites)}, {i: n for n, i in enumerate(kernels)}

        def plain(record, **changes) -> dict:
            d = dataclasses.asdict(record)
            d.pop("graph")
            d.update(changes)
            return d

        prefix = f"{graph}:"
        payload = {
            "kind": rec.kind, "outcome": rec.outcome,
            "sites": [plain(self.sites[i], kernel=kernel_at.get(self.sites[i].kernel, -1)) for i in sites],
            "kernels": [plain(self.kernels[i], sites=[site_at[j] for j in self.kernels[i].sites if j in site_at])
                        for i in kernels],
            "misses": [plain(m) for m in self.misses if m.graph == graph],
            "errors": [plain(e) for e in self.errors if e.graph == graph],
            "host_tables": [t[len(prefix):] for t in self.host_tables if t.startswith(prefix)],
        }
        return json.dumps(payload, separators=(",", ":"), sort_keys=True)

    def add_cached_graph(self, payload: str) -> GraphRecord:
        """Append the records of a graph that a compile cache served (the inverse of `graph_payload`)."""
        d = json.loads(payload)
        index, first_site, first_kernel = self.graphs, len(self.sites), len(self.kernels)
        sites = [Site(graph=index, **dict(s, shape=tuple(s["shape"]),
                                          kernel=s["kernel"] + first_kernel if s["kernel"] >= 0 else -1))
                 for s in d["sites"]]
        kernels = [Kernel(graph=index, **dict(k, sites=[j + first_site for j in k["sites"]])) for k in d["kernels"]]
        misses = [Miss(graph=index, **m) for m in d["misses"]]
        errors = [GraphError(graph=index, **e) for e in d["errors"]]
        record = GraphRecord(index, d["kind"], d["outcome"], len(sites), len(kernels), len(misses), from_cache=True)
        self.graphs += 1
        self.graph_records.append(record)
        self.sites += sites
        self.kernels += kernels
        self.misses += misses
        self.errors += errors
        self.host_tables += [f"{index}:{name}" for name in d["host_tables"]]
        return record
