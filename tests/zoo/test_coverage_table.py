"""COVERAGE.md's rendering: every reason whole (a cut reason misleads), and a legend for every column."""

from __future__ import annotations

from rope_fusion.passes.report import Report, Site
from tests.zoo import coverage

REASON = ("lanes 0 and 1 apply a general 2x2 matrix of table entries to each pair (no minus sign in the graph): a "
          "table that arrives as a tensor cannot be proven to hold [[cos, -sin], [sin, cos]]; only tables built "
          "from cos and sin in the graph fuse")
NORM = "left in the graph: the norm spans 16 lanes, neither one head (8) nor all heads of the token"


def _row(**over) -> dict:
    row = {"model": "m", "category": "should", "variant": "float32 graph", "expected": 6, "compiled": 6, "fused": 0,
           "kernels": 0, "expected_kernels": 3, "qk": 0, "graphs": 21, "err": 2e-7, "err_eager": 3e-7,
           "status": "left alone (should)", "misses": [(REASON, "x.py:1")], "norm": "-"}
    row.update(over)
    return row


def _report(*norms: str) -> Report:
    """A report whose sites kept their norms for these reasons (the records the pass writes)."""
    params = dict(interleaved=False, rotary_dim=8, full_tables=False, conjugate=False, out_dtype="float32")
    site = dict(graph=0, node="n", head_dim=8, x_dtype="float32", table_dtype="float32", shape=(1, 4, 2, 8),
                source="x.py:1", params=params)
    return Report(sites=[Site(**site, norm=n) for n in norms])


def test_reasons_are_whole_in_markdown_and_text():
    norm = coverage._norms(_report(NORM, NORM))
    assert norm == "kept: " + NORM.removeprefix("left in the graph: ")
    rows = [_row(norm=norm), _row(model="k", status="ok", misses=[], category="must")]
    for markdown in (True, False):
        table = coverage.format_table(rows, markdown=markdown)
        assert REASON in table and norm in table, table


def test_a_pipe_in_a_reason_keeps_the_markdown_row_intact():
    table = coverage.format_table([_row(misses=[("a | b", "x.py:1")])], markdown=True)
    row = table.splitlines()[-1]
    assert "a \\| b" in row and row.count(" | ") == len(coverage.COLUMNS) - 1, row


def test_the_legend_defines_every_column():
    header = coverage.markdown_header("2.13.0")
    head = coverage.format_table([_row()], markdown=True).splitlines()[0]
    for name, meaning in coverage.COLUMNS:
        assert f"- **{name}**: {meaning}." in header and f" {name} |" in head
