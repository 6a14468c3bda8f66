"""`Site`: one rotation the pass may replace with the fused op, from its detection to its report.

A site says what the op is called with, in the op's own terms: the node whose value it replaces, the view of x
the op reads (`XView`), the op's parameters as they are (`ops/schema.RotaryParams`, the schema's names), and where
the tables come from (`tables`). That is one of two kinds of record:
- `GraphTables`: the graph's own tables, views of graph nodes (`TableRef`), as the matcher proves them from RoPE
  arithmetic (sites.py);
- a `KernelTables` subclass: the tables that a rotary kernel already in the graph builds from its own inputs (a
  flash-attn launch's cos and sin with its row offsets, a vLLM op's cos_sin_cache by positions), one keyed record
  per kind, defined beside its recogniser (kernel_sites/flash_attn_sites.py, kernel_sites/vllm_op_sites.py). Equal
  records read the same numbers; the record emits the op's table arguments when the site's group is planned.

Grouping pairs sites whose parameters are equal and whose tables are the same numbers; emission passes `params` to
the backend, adding what it decides itself (a folded norm, angle tables); the report's record is made from the
params the op was called with (report.py). docs/design.md ("the data path") maps the records through the pass.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import torch.fx as fx

from ...ops.schema import RotaryParams

# What `Site.origin` says of a site found in RoPE arithmetic (a kernel's site names its kind instead).
ARITHMETIC = "arithmetic"


@dataclasses.dataclass(frozen=True)
class TableRef:
    """A table as the op reads it: node (as_real when complex), last k dims flattened, then a strided slice;
    with `partner`, the two entries of every pair swapped (the backward of a rotation reads the sin entry of
    the partner lane: d out[b] / d x[a] = S[b]). With `pieces`, the table is those tables broadcast to one
    shape and concatenated along the lanes (a head dim rotated per axis, each block by its own tables); the
    other fields then describe the first piece."""

    name: str
    k: int
    as_real: bool
    start: int
    step: int
    width: int
    partner: bool = False
    pieces: tuple = ()

    @property
    def key(self) -> tuple:
        return (self.name, self.k, self.as_real, self.start, self.step, self.width, self.partner,
                tuple(p.key for p in self.pieces))

    @property
    def parts(self) -> tuple:
        """The single-source tables this one reads: its pieces, or itself."""
        return self.pieces or (self,)


@dataclasses.dataclass(frozen=True)
class GraphTables:
    """The graph's own cos and sin, as views of its nodes."""

    cos: TableRef
    sin: TableRef

    origin = ARITHMETIC
    row_inputs = ()  # the rows are the tables' own: no positions to wait for

    def tensors(self, nodes: dict) -> list[fx.Node]:
        """The nodes the op's tables are views of."""
        return [nodes[p.name] for t in (self.cos, self.sin) for p in t.parts]


class KernelTables(abc.ABC):
    """The tables that a rotary kernel already in the graph builds, as a frozen dataclass per kind whose fields
    are the graph values they come from: two sites whose records are equal read the same numbers (and may share a
    launch). A subclass names its `kind` (the registered recogniser's, `kernel_sites.kernel_site`) and says how
    to emit the op's table arguments."""

    kind: str

    @property
    def origin(self) -> str:
        return self.kind

    @abc.abstractmethod
    def tensors(self, nodes: dict) -> list[fx.Node]:
        """The graph's tensors the tables are read from (the op's group is placed after them)."""

    @property
    def row_inputs(self) -> tuple:
        """The nodes that say which rows are read (offsets, positions, sequence starts), besides `tensors`."""
        return ()

    @abc.abstractmethod
    def emit(self, em: Any, site: Site) -> tuple:
        """(cos, sin, positions), or with packed sequences (cos, sin, None, cu_seqlens, seqlen_offsets): the op's
        table arguments as new nodes of `em`'s graph."""

    def fixed_rows(self, site: Site) -> tuple | None:
        """The tables as fake views of graph values in the op's shape when the rows read are known at compile
        time (then a native site whose tables are views of the same numbers can share the launch), else None."""
        return None

    def claimed(self, site: Site) -> None:  # noqa: B027  (a hook: most kinds leave the graph as it is)
        """The site is the pass's now: an edit that keeps the kernel from staying alive once its result is
        replaced (nothing by default)."""


@dataclasses.dataclass(frozen=True)
class XView:
    """x as the op reads it: node `name` (viewed as real pairs when `as_real`), its last k dims flattened into the
    lanes, then split into `blocks` (grid dims outside the rotated lanes, the heads of a [B, S, H*D] x) and
    head_dim lanes."""

    name: str
    head_dim: int
    k: int = 1
    as_real: bool = False
    blocks: tuple = ()


@dataclasses.dataclass
class Site:
    """One rotated tensor, as the fused op takes it."""

    node: fx.Node  # the node whose value is the rotation (its uses get the op's result)
    value_k: int  # grid dims of the replaced value: the op's output is unflattened to them
    x: XView
    params: RotaryParams
    tables: GraphTables | KernelTables
    wide: bool = False  # the replaced subgraph computed in fp64

    @property
    def origin(self) -> str:
        """What is replaced: RoPE arithmetic, or the kind of rotary kernel already in the graph."""
        return self.tables.origin

    @property
    def arithmetic(self) -> bool:
        """Whether the graph computes the rotation in its own ops (the norm before it can fold, its dtype is the
        ops'); a kernel's site has none of its own."""
        return isinstance(self.tables, GraphTables)


__all__ = ["ARITHMETIC", "GraphTables", "KernelTables", "Site", "TableRef", "XView"]
