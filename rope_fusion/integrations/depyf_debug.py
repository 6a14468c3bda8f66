"""`rope_fusion.debug(dump_dir)`: depyf's dump, plus what the pass did to every graph it saw.

    with rope_fusion.debug("dump_dir") as session:
        compiled_model(*inputs)          # compiles happen inside the context

wraps `depyf.prepare_debug(dump_dir)` (depyf's decompiled bytecode, captured/forward graphs, Inductor
kernels) and, for every post-grad graph that a RopeFusionPass processes inside the context, writes:

    rope_fusion_graph_N_before.py   the post-grad graph before the pass (with the model source lines)
    rope_fusion_graph_N_after.py    the same graph after it (fused nodes are torch.ops.rope_fusion.*)
    rope_fusion_graph_N_report.txt  fused sites with their source file:line, kernels, near misses (reasons)

Every RopeFusionPass counts: one installed with `install()`, one given in `options=`, vLLM's `vllm_pass`.
When no pass is configured globally, the context installs one (chained like `install()`) and removes it at
exit, so a plain `torch.compile` inside it is fused and dumped. The FX graph and AOTAutograd caches are off
inside the context: a cache hit would skip the pass and leave nothing to show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ..passes.report import Report, fused_text
from ..passes.rope_pass import RopeFusionPass, log
from . import installation as installing

_lock = threading.Lock()
_active: list[DebugSession] = []  # innermost last; the patched __call__ dumps into _active[-1]
_original_call = None


@dataclasses.dataclass
class DumpedGraph:
    number: int
    before: str
    after: str
    report: str
    summary: str


@dataclasses.dataclass
class DebugSession:
    """What `rope_fusion.debug` yields: the dump folder, the pass it installed (or None) and the dumps."""

    dump_dir: str
    pass_: RopeFusionPass | None = None
    graphs: list = dataclasses.field(default_factory=list)
    _next: int = 0

    def next_number(self) -> int:
        with _lock:
            n = self._next
            self._next += 1
        return n


def graph_text(graph: torch.fx.Graph) -> str:
    """Readable Python for a post-grad graph, with `# File: ...:line` comments from the node stack traces."""
    gm = getattr(graph, "owning_module", None)
    if isinstance(gm, torch.fx.GraphModule) and gm.graph is graph:
        try:
            return gm.print_readable(print_output=False, include_stride=True, include_device=True)
        except Exception:
            pass
    try:
        return graph.python_code("self", verbose=True).src
    except Exception:
        return str(graph)


def format_report(report: Report, graph: int, title: str = "") -> str:
    """The records of one graph of `report` as text: sites, kernels, near misses, errors."""
    sites = [(i, s) for i, s in enumerate(report.sites) if s.graph == graph]
    kernels = [(i, k) for i, k in enumerate(report.kernels) if k.graph == graph]
    misses = [m for m in report.misses if m.graph == graph]
    errors = [e for e in report.errors if e.graph == graph]
    lines = [title] if title else []
    lines.append(fused_text(len(sites), len(kernels), len(misses)))
    lines.append("")
    lines.append(f"Sites ({len(sites)}):")
    for i, s in sites:
        k = report.kernels[s.kernel] if 0 <= s.kernel < len(report.kernels) else None
        kernel = f"kernel {s.kernel} {k.op}[{k.backend}]" if k else "kernel ?"
        style = s.style + (" conjugate" if s.conjugate else "")
        offset = f" rotary_offset={s.rotary_offset}" if s.rotary_offset else ""
        lines.append(f"  site {i}: {s.role} {style} rotary_dim={s.rotary_dim}{offset} head_dim={s.head_dim} "
                     f"tables={s.table_form} x={s.x_dtype} tables_dtype={s.table_dtype} out={s.out_dtype} "
                     f"shape=[{', '.join(map(str, s.shape))}] node={s.node} -> {kernel}")
        lines.append(f"      at {s.source}")
    lines.append("")
    lines.append(f"Kernels ({len(kernels)}):")
    for i, k in kernels:
        lines.append(f"  kernel {i}: {k.op} backend={k.backend} sites={list(k.sites)}"
                     + (f" (fell back: {k.fallback})" if k.fallback else ""))
    lines.append("")
    lines.append(f"Near misses ({len(misses)}):")
    for m in misses:
        lines.append(f"  {m.node}: {m.reason}")
        lines.append(f"      at {m.source}")
    host = [h.split(":", 1)[1] for h in report.host_tables if h.split(":", 1)[0] == str(graph)]
    if host:
        lines.append("")
        lines.append(f"Host tables copied to the device once, not per call: {', '.join(host)}")
    if errors:
        lines.append("")
        lines.append(f"Errors ({len(errors)}):")
        for e in errors:
            lines.append(f"  {e.error} ({e.outcome})")
    return "\n".join(lines) + "\n"


def _first_free_number(dump_dir: str) -> int:
    pat = re.compile(r"rope_fusion_graph_(\d+)_")
    numbers = [int(m.group(1)) for f in os.listdir(dump_dir) if (m := pat.match(f))]
    return max(numbers) + 1 if numbers else 0


def _dump_call(self: RopeFusionPass, graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
    """RopeFusionPass.__call__ while a debug context is open: run the pass between two snapshots."""
    session = _active[-1] if _active else None
    if session is None:
        return _original_call(self, graph, is_inference)
    try:
        before = graph_text(graph)
    except Exception as e:  # never break a compile for a dump
        before = f"# could not print the graph: {type(e).__name__}: {e}\n"
    index = self.report.graphs  # the pass numbers this graph so in its report
    _original_call(self, graph, is_inference)
    try:
        n = session.next_number()
        base = os.path.join(session.dump_dir, f"rope_fusion_graph_{n}")
        paths = (base + "_before.py", base + "_after.py", base + "_report.txt")
        title = (f"rope_fusion: post-grad graph {n} (graph {index} of {self!r}, uuid {self.uuid()})\n"
                 f"before: {os.path.basename(paths[0])}, after: {os.path.basename(paths[1])}")
        text = format_report(self.report, index, title)
        for path, content in zip(paths, (before, graph_text(graph), text)):
            with open(path, "w") as f:
                f.write(content)
        summary = next((ln for ln in text.splitlines() if ln.startswith("fused ")), "")
        session.graphs.append(DumpedGraph(n, *paths, summary=summary))
    except Exception as e:
        log.warning("rope_fusion.debug could not write its dump: %s: %s", type(e).__name__, e)


@contextlib.contextmanager
def debug(dump_dir: str, pass_: RopeFusionPass | None = None, *, clean_wild_fx_code: bool = True,
          log_bytecode: bool = False, **pass_kwargs: Any) -> Iterator[DebugSession]:
    """depyf.prepare_debug(dump_dir) plus the pass's before/after graphs and report per compiled graph.

    `pass_` (or a new `RopeFusionPass(**pass_kwargs)`) is installed for the duration unless a RopeFusionPass
    is already configured globally. Requires depyf (the `debug` extra: `pip install -e ".[debug]"` from a checkout).
    """
    try:
        import depyf
    except ImportError as e:
        raise ImportError("rope_fusion.debug needs depyf: pip install depyf") from e
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    global _original_call
    os.makedirs(dump_dir, exist_ok=True)
    session = DebugSession(os.path.abspath(dump_dir))
    session._next = _first_free_number(session.dump_dir)
    installed = False
    with depyf.prepare_debug(session.dump_dir, clean_wild_fx_code=clean_wild_fx_code,
                             log_bytecode=log_bytecode), \
            inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        with _lock:
            if not _active:
                _original_call = RopeFusionPass.__call__
                RopeFusionPass.__call__ = _dump_call
            _active.append(session)
        try:
            if not installing.has_rope_pass(inductor_config.post_grad_custom_post_pass):
                session.pass_ = installing.install(pass_, **pass_kwargs)
                installed = True
            yield session
        finally:
            if installed:
                installing.uninstall()
            with _lock:
                _active.remove(session)
                if not _active:
                    RopeFusionPass.__call__ = _original_call
                    _original_call = None


__all__ = ["debug", "DebugSession", "DumpedGraph", "format_report", "graph_text"]
