"""What the pass did, in records that a person (depyf dump, `rope-fusion explain`) can read.

The report accumulates over every graph the pass sees. Counts are per compiled graph, not per run: a graph
that Dynamo compiles once and runs for several layers (a block after a graph break) reports its sites once.
A graph served from Inductor's FX graph cache never reaches the pass; the pass leaves counters in the
cached artifact (Inductor replays them on a hit), and `cached` reads them, so a warm cache reports
"reused from the FX graph cache: N sites" instead of nothing. Records are plain dataclasses of strings and
numbers so that they pickle and print without the graph they came from.
"""

from __future__ import annotations

import dataclasses

# Table forms as the report names them: one entry per rotated pair, or one per lane.
PER_PAIR, PER_LANE = "per-pair", "per-lane"


@dataclasses.dataclass
class Site:
    """One rotated tensor (a q/k pair is two sites)."""

    graph: int  # index of the graph in this report
    node: str  # name of the replaced node in the post-grad graph
    style: str  # "neox" or "interleaved"
    rotary_dim: int
    head_dim: int
    table_form: str  # PER_PAIR or PER_LANE
    conjugate: bool
    x_dtype: str
    table_dtype: str
    out_dtype: str
    shape: tuple
    source: str  # "file:line" of the model code, from the node's stack trace
    kernel: int = -1  # index into Report.kernels
    role: str = "x"  # "q" or "k" when the model source names it so, else "x"
    origin: str = "arithmetic"  # what was replaced: RoPE arithmetic, or a rotary kernel already in the graph
    graph_kind: str = ""  # "inference", "forward" or "backward" (GraphRecord.kind)
    norm: str = ""  # the QK-norm before the rotation: "rms folded", or why it stayed in the graph
    blocks: int = 1  # NeoX pairs within this many equal blocks of the rotated lanes (a head dim rotated per axis)
    offset: int = 0  # the first rotated lane (lanes before it pass through: DeepSeek's rope after its nope lanes)
    angles: bool = False  # the op reads the angles that the graph took cos and sin of, and computes both itself

    def rotated_lanes(self) -> str:
        """The rotary dim, or the rotated lane range when a pass-through head precedes it: "64" or "128:192"."""
        return f"{self.offset}:{self.offset + self.rotary_dim}" if self.offset else str(self.rotary_dim)

    def style_label(self) -> str:
        """The pairing as a person reads it: "neox x3 blocks conjugate"."""
        return self.style + (f" x{self.blocks} blocks" if self.blocks > 1 else "") + \
            (" conjugate" if self.conjugate else "")


@dataclasses.dataclass
class Kernel:
    """One fused node emitted into the graph."""

    graph: int
    op: str  # e.g. "rope_fusion.rotary_qk"
    backend: str
    sites: list  # indices into Report.sites
    fallback: str = ""  # why the backend that was asked for did not take the site


@dataclasses.dataclass
class Miss:
    """RoPE-looking arithmetic that was left alone, and why."""

    graph: int
    node: str
    reason: str
    source: str


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


@dataclasses.dataclass
class CacheReuse:
    """Graphs served from Inductor's FX graph cache since the report started: the pass did not run on them,
    their cached code is what it produced when they were first compiled."""

    graphs: int = 0
    sites: int = 0
    kernels: int = 0


@dataclasses.dataclass
class Report:
    sites: list = dataclasses.field(default_factory=list)
    kernels: list = dataclasses.field(default_factory=list)
    misses: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    host_tables: list = dataclasses.field(default_factory=list)  # "graph:input" copied once, not per call
    graph_records: list = dataclasses.field(default_factory=list)
    graphs: int = 0
    cache_counter: object = dataclasses.field(default=None, repr=False, compare=False)  # set by the pass

    def clear(self) -> None:
        for records in (self.sites, self.kernels, self.misses, self.errors, self.host_tables, self.graph_records):
            records.clear()
        self.graphs = 0
        if self.cache_counter is not None:
            self.cache_counter.rebase()

    @property
    def seconds(self) -> float:
        """The pass's own time over every graph it saw: what it adds to the compile, Inductor's work on the
        fused nodes (a Triton kernel's compile) aside."""
        return sum(g.seconds for g in self.graph_records)

    @property
    def cached(self) -> CacheReuse:
        return self.cache_counter.reused() if self.cache_counter is not None else CacheReuse()

    def summary(self) -> str:
        text = f"fused {len(self.sites)} sites in {len(self.kernels)} kernels, {len(self.misses)} near misses"
        c = self.cached
        if c.graphs:
            text += (f"; reused from the FX graph cache: {c.sites} sites in {c.kernels} kernels "
                     f"({c.graphs} graphs the pass did not need to see again)")
        return text

    def table(self) -> str:
        """A plain-text table of sites, kernels and misses (rich renders the same rows in the CLI)."""
        lines = [self.summary() + " (counted per compiled graph; a graph run for several layers counts once)"]
        for i, s in enumerate(self.sites):
            k = self.kernels[s.kernel] if 0 <= s.kernel < len(self.kernels) else None
            style = s.style_label()
            lines.append(
                f"  site {i:3d} {s.role:1s} {style:21s} R={s.rotated_lanes():<4s} D={s.head_dim:<4d} "
                f"{'[backward] ' if s.graph_kind == 'backward' else ''}"
                f"tables {s.table_form} {s.table_dtype}{' angles' if s.angles else ''}, x {s.x_dtype} -> {s.out_dtype} "
                f"{k.op if k else '?'}[{k.backend if k else '?'}]{' norm ' + s.norm if s.norm else ''} at {s.source}"
            )
        for k in self.kernels:
            if k.fallback:
                lines.append(f"  kernel {k.op}[{k.backend}] fell back: {k.fallback}")
        for m in self.misses:
            lines.append(f"  miss {m.node}: {m.reason} at {m.source}")
        if self.host_tables:
            lines.append(f"  host tables copied to the device once: {', '.join(self.host_tables)}")
        for e in self.errors:
            lines.append(f"  error in graph {e.graph} ({e.outcome}): {e.error}")
        return "\n".join(lines)
