"""The report as text: one line per site that a person reads at a glance, and the details on request.

A glance line says what a site is and where the model wrote it, and nothing else: the rotation (style, rotated
lanes, head dim), the dtypes, the table form, whether a QK-norm was folded, the kernel and the source line. It
stays under `LINE_LIMIT` characters: a long source path loses its left end first. The rest (why a norm stayed
in the graph, how `auto` chose, what data movement a kernel folded, the FX node a record came from, full paths)
is for `table(verbose=True)`: repeated on every q and k line it made lines of 600 characters (a norm's reason
for q and k, on both). Near misses read by the model's source line and the tensor it assigned; FX names
(`add_25`) say nothing to the person who wrote the model, so they are verbose only.

Paths read relative to what a person knows: the part after site-packages (`transformers/models/...`), the
current directory (their project), or the checkout this package lives in; anything else as it is.

The records are duck-typed (`report.Report` and its records): this module imports nothing of the package, so
that report.py can use it.
"""

from __future__ import annotations

import os
import re
from typing import Any

LINE_LIMIT = 160  # characters of a glance line, indentation included
# What marks the records of a graph that a compile cache served (the pass did not run on it in this process).
FROM_CACHE = " (from the compile cache)"
# Why one site line can stand for many runs, and how to see them: the pass cannot count runs without adding a
# host-side step to every call, which a compiled graph replayed in CUDA graphs would not even run.
RUNS_NOTE = ("counted per compiled graph, not per run: a graph that Dynamo reuses (a block run for every layer) is "
             "listed once;\n  a GPU profile of one call (torch.profiler) shows every run: the fused kernels' names "
             "hold 'rotary'")
DETAILS_HINT = "details (why a norm stayed, auto's choices, folds, FX nodes, full paths): table(verbose=True)"

_PLURALS = {"near miss": "near misses"}
_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def counted(n: int, noun: str) -> str:
    """A count and its noun, singular for one: "1 kernel", "2 sites", "0 near misses"."""
    return f"{n} {noun if n == 1 else _PLURALS.get(noun, noun + 's')}"


def fused_text(sites: int, kernels: int, misses: int) -> str:
    """What a graph (or a report) fused, as every line of the report says it."""
    return f"fused {counted(sites, 'site')} in {counted(kernels, 'kernel')}, {counted(misses, 'near miss')}"


def short_dtype(name: str) -> str:
    return _SHORT_DTYPES.get(name, name)


def short_path(source: str) -> str:
    """"file:line" relative to site-packages, the current directory or this package's checkout."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in source:
            return source.split(marker, 1)[1]
    for root in (os.getcwd(), _PACKAGE_ROOT):
        prefix = root.rstrip(os.sep) + os.sep
        if source.startswith(prefix):
            return source[len(prefix):]
    return source


def clipped(text: str, limit: int = LINE_LIMIT) -> str:
    """`text` cut to `limit` characters, the cut marked."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fit_path(path: str, room: int) -> str:
    """`path` within `room` characters: its middle folders go first ("diffusers/…/transformer_wan.py:114"),
    then its left end."""
    if len(path) <= room:
        return path
    parts = path.split(os.sep)
    for short in (os.sep.join((parts[0], "…", parts[-1])), "…" + os.sep + parts[-1]) if len(parts) > 2 else ():
        if len(short) <= room:
            return short
    return "…" + path[-max(room - 1, 12):]


def _with_path(head: str, path: str, limit: int = LINE_LIMIT) -> str:
    """`head` + " at " + path within `limit`, the path shortened first."""
    return clipped(f"{head} at {fit_path(path, limit - len(head) - len(' at '))}", limit)


def norm_glance(norm: str) -> str:
    """The site's norm in a few words: ", norm rms folded", ", norm stays" (why: verbose), or ""."""
    if not norm:
        return ""
    return f", norm {norm}" if norm.endswith("folded") else ", norm stays"


def kernel_label(kernel: Any) -> str:
    return f"{kernel.op.rsplit('.', 1)[-1]}[{kernel.backend}]" if kernel is not None else "?"


def site_line(i: int, s: Any, kernel: Any, verbose: bool = False) -> str:
    """One site, under LINE_LIMIT characters unless verbose (full path)."""
    tables = f"tables {s.table_form} {short_dtype(s.table_dtype)}{' angles' if s.angle_tables else ''}"
    head = (f"  site {i} {s.role} {s.style_label()} R={s.rotated_lanes()} D={s.head_dim} "
            f"{short_dtype(s.x_dtype)}->{short_dtype(s.out_dtype)}, {tables}{norm_glance(s.norm)}: "
            f"{kernel_label(kernel)}")
    if verbose:
        return f"{head} at {s.source}"
    return _with_path(head, short_path(s.source))


def with_names(text: str, names: dict) -> str:
    """`text` with each FX name of `names` replaced by its description."""
    if not names:
        return text
    return re.sub(r"\b[A-Za-z_][A-Za-z0-9_]*\b", lambda m: names.get(m.group(0), m.group(0)), text)


def miss_line(m: Any, verbose: bool = False) -> str:
    """One near miss: the tensor and where the model wrote it, then why (FX names only when verbose)."""
    tensor = m.tensor or "a value"
    if verbose:
        return f"  near miss {tensor} at {m.source}: {m.reason}"
    return clipped(f"  near miss {tensor} at {short_path(m.source)}: {with_names(m.reason, m.names)}")


def header(report: Any) -> list[str]:
    """The summary line, where a compile cache served graphs one line that says so, and the notes."""
    records = report.graph_records
    lines = [f"rope_fusion: {counted(report.graphs, 'compiled graph')}, "
             f"{fused_text(len(report.sites), len(report.kernels), len(report.misses))}"]
    cached = [g for g in records if g.from_cache]
    if cached:
        which = f"all {counted(len(records), 'compiled graph')}" if len(cached) == len(records) else \
            f"{len(cached)} of {len(records)} graphs ({', '.join(str(g.index) for g in cached)})"
        if len(records) == 1:
            which = "the compiled graph"
        them = "it" if len(cached) == 1 else "them"
        lines.append(clipped(f"  {which} came from the compile cache: the pass did not run on {them} here, and these "
                             f"are the records stored with {them}"))
    if report.graphs:
        lines.append(f"  {RUNS_NOTE}")
    return lines


def graph_heading(report: Any, graph: int) -> str:
    records = [r for r in report.graph_records if r.index == graph]
    if not records:  # records added by hand, without the graph's own record
        return f"graph {graph}:"
    r = records[0]
    return f"graph {graph} ({r.kind}{', from the compile cache' if r.from_cache else ''}):"


def graph_lines(report: Any, graph: int, verbose: bool) -> list[str]:
    """The records of one graph: sites, then kernels' notes, near misses and errors."""
    lines = []
    seen_norms: dict = {}  # (kernel, norm text) -> the first site that printed it
    for i, s in enumerate(report.sites):
        if s.graph != graph:
            continue
        k = report.kernels[s.kernel] if 0 <= s.kernel < len(report.kernels) else None
        lines.append(site_line(i, s, k, verbose))
        if verbose:
            lines.append(f"      node {s.node}, shape [{', '.join(map(str, s.shape))}], {s.origin}")
            if s.norm and not s.norm.endswith("folded"):
                first = seen_norms.setdefault((s.kernel, s.norm), i)
                lines.append(f"      norm: {s.norm}" if first == i else f"      norm: as site {first}")
    for j, k in enumerate(report.kernels):
        if k.graph != graph:
            continue
        if k.fallback:  # the backend asked for did not run here: worth a line even at a glance
            text = f"  kernel {j} {kernel_label(k)} (sites {', '.join(map(str, k.sites))}) fell back: {k.fallback}"
            lines.append(text if verbose else clipped(text))
        if verbose:
            lines += [f"  kernel {j} {kernel_label(k)} (sites {', '.join(map(str, k.sites))}) {what}: {note}"
                      for what, note in (("auto", k.choice), ("folds", k.fold)) if note]
    for m in report.misses:
        if m.graph == graph:
            lines.append(miss_line(m, verbose))
            if verbose:
                lines.append(f"      node {m.node}")
    for e in report.errors:
        if e.graph == graph:
            text = f"  error ({e.outcome}): {e.error}"
            lines.append(text if verbose else clipped(text))
    return lines


def table(report: Any, verbose: bool = False) -> str:
    """The whole report: the header, then each graph with records under its heading."""
    lines = header(report)
    if not verbose and (report.sites or report.misses):
        lines.append(f"  {DETAILS_HINT}")
    graphs = {r.index for r in report.graph_records}
    for records in (report.sites, report.kernels, report.misses, report.errors):
        graphs |= {r.graph for r in records}
    for graph in sorted(graphs):
        body = graph_lines(report, graph, verbose)
        if body:
            lines += [graph_heading(report, graph), *body]
    if report.host_tables:
        lines.append(clipped(f"host tables copied to the device once, not per call: {', '.join(report.host_tables)}")
                     if not verbose else
                     f"host tables copied to the device once, not per call: {', '.join(report.host_tables)}")
    return "\n".join(lines)


__all__ = ["DETAILS_HINT", "FROM_CACHE", "LINE_LIMIT", "RUNS_NOTE", "clipped", "counted", "fused_text",
           "graph_heading", "header", "kernel_label", "miss_line", "norm_glance", "short_dtype", "short_path",
           "site_line", "table"]
