"""examples/show_rewrites.py prints the graphs of docs/design.md's "What the pass does to a graph": each rewrite's
graph after the pass calls the fused op and holds none of the data movement the rewrite takes over, which the graph
before it held; the compiled example keeps the numbers contract against an fp64 evaluation on fresh random inputs,
and a KV-cache write leaves the layer's cache as vLLM's own path writes it. The script runs its examples as the
tests do (the Triton kernel interpreted on the CPU where a fold needs it, vLLM's layer with a stand-in attention
impl), through its own code, so what the doc shows is what this checks.
"""

from __future__ import annotations

import pytest
import torch

from examples import show_rewrites as sr
from tests.helpers.numerics import as_tuple, check_numerics


def _nonempty(values) -> tuple:
    """The outputs that hold numbers (vLLM's cache update returns an empty tensor, a dependency only)."""
    return tuple(t for t in as_tuple(values) if t.numel())


@pytest.mark.parametrize("rewrite", sr.REWRITES, ids=lambda r: r.name)
def test_the_after_graph_calls_the_fused_op_and_lacks_what_it_folds(rewrite):
    try:
        shown = sr.run(rewrite)
    except sr.Missing as e:
        pytest.skip(str(e))
    assert sr.calls(shown.after, rewrite.fused) == 1, "\n".join(map(sr.node_line, shown.after))
    for name in rewrite.removed:
        assert sr.calls(shown.before, name), f"{name} not in the example's graph before the pass"
        assert not sr.calls(shown.after, name), "\n".join(map(sr.node_line, shown.after))
    case = shown.case
    with case.context():
        written = case.written.clone() if case.written is not None else None
        check_numerics(lambda *a: _nonempty(case.fn(*a)), case.args, _nonempty(shown.out), context=str(shown.kernels))
        if written is not None:  # vLLM's path writes the cache again, eagerly
            case.written.zero_()
            case.fn(*case.args)
            torch.testing.assert_close(written, case.written)
            assert written.any()


def test_the_script_prints_every_rewrite_it_can_run(capsys):
    """`--changed` (what the doc pastes): one section per rewrite, each with its fused op, or a line saying what it
    needs; nothing else fails."""
    assert sr.main(["--changed", "qk", "slice_write"]) == 0
    text = capsys.readouterr().out
    for rewrite in sr.REWRITES[:2]:
        section = text.split(f"### {rewrite.name}:", 1)[1].split("###", 1)[0]
        assert "skipped" in section or rewrite.fused in section, section
    assert all(len(line) <= 120 for line in text.splitlines()), max(text.splitlines(), key=len)
