"""What the pass did, in records that a person (depyf dump, `rope-fusion explain`) can read.

The report accumulates over every graph the pass sees; `graphs` counts them. Records are plain
dataclasses of strings and numbers so that they pickle and print without the graph they came from.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Site:
    """One rotated tensor (a q/k pair is two sites)."""

    graph: int  # index of the graph in this report
    node: str  # name of the replaced node in the post-grad graph
    style: str  # "neox" or "interleaved"
    rotary_dim: int
    head_dim: int
    table_form: str  # "half" (one entry per pair) or "full" (one entry per lane)
    conjugate: bool
    x_dtype: str
    table_dtype: str
    out_dtype: str
    shape: tuple
    source: str  # "file:line" of the model code, from the node's stack trace
    kernel: int = -1  # index into Report.kernels
    role: str = "x"  # "q", "k" or "x"


@dataclasses.dataclass
class Kernel:
    """One fused node emitted into the graph."""

    graph: int
    op: str  # e.g. "rope_fusion.rotary_qk"
    backend: str
    sites: list  # indices into Report.sites


@dataclasses.dataclass
class Miss:
    """RoPE-looking arithmetic that was left alone, and why."""

    graph: int
    node: str
    reason: str
    source: str


@dataclasses.dataclass
class GraphError:
    """An internal error that left one graph unchanged (the failure policy, DESIGN.md section 5)."""

    graph: int
    error: str


@dataclasses.dataclass
class Report:
    sites: list = dataclasses.field(default_factory=list)
    kernels: list = dataclasses.field(default_factory=list)
    misses: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    host_tables: list = dataclasses.field(default_factory=list)  # "graph:input" copied once, not per call
    graphs: int = 0

    def clear(self) -> None:
        self.sites.clear()
        self.kernels.clear()
        self.misses.clear()
        self.errors.clear()
        self.host_tables.clear()
        self.graphs = 0

    def summary(self) -> str:
        return (f"fused {len(self.sites)} sites in {len(self.kernels)} kernels, "
                f"{len(self.misses)} near misses")

    def table(self) -> str:
        """A plain-text table of sites, kernels and misses (rich renders the same rows in the CLI)."""
        lines = [self.summary()]
        for i, s in enumerate(self.sites):
            k = self.kernels[s.kernel] if 0 <= s.kernel < len(self.kernels) else None
            lines.append(
                f"  site {i:3d} {s.role:1s} {s.style:11s} R={s.rotary_dim:<4d} D={s.head_dim:<4d} "
                f"{s.table_form:4s} {s.x_dtype}->{s.out_dtype} tables {s.table_dtype} "
                f"{k.op if k else '?'}[{k.backend if k else '?'}] at {s.source}"
            )
        for m in self.misses:
            lines.append(f"  miss {m.node}: {m.reason} at {m.source}")
        if self.host_tables:
            lines.append(f"  host tables copied to the device once: {', '.join(self.host_tables)}")
        for e in self.errors:
            lines.append(f"  error in graph {e.graph}: {e.error}")
        return "\n".join(lines)
