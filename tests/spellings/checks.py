"""Assertions on a pass's report against a spelling's `Expect`, and on the graph the pass left, checked
independently of the report."""

from __future__ import annotations

import torch

from rope_fusion.ops.schema import OP_NAMES

from .case import Expect

OP_ARITY = {f"rope_fusion.{name}": arity for arity, name in OP_NAMES.items()}


def dtype_name_matches(name: str, dtype: torch.dtype) -> bool:
    return name in (str(dtype), str(dtype).replace("torch.", ""))


def _ok(value, accepted) -> bool:
    return value in accepted if isinstance(accepted, tuple) else value == accepted


SPELLING_FILES = ("catalogue.py", "variations.py")


def check_report(p, e: Expect, out_dtypes=(), check_source: bool = True) -> None:
    """Exact site and kernel counts, and what each site must say, with the report in every message."""
    r = p.report
    t = r.table()
    assert not r.errors, f"internal errors:\n{t}"
    assert len(r.sites) == e.sites, f"expected {e.sites} sites, got {len(r.sites)}:\n{t}"
    assert len(r.kernels) == e.kernels, f"expected {e.kernels} kernels, got {len(r.kernels)}:\n{t}"
    for k in r.kernels:
        assert k.op == e.op, f"kernel op {k.op!r}, expected {e.op!r}:\n{t}"
        assert len(k.sites) == OP_ARITY[e.op], f"kernel {k}:\n{t}"
    for s in r.sites:
        assert s.style == e.style, f"style {s.style!r}, expected {e.style!r}:\n{t}"
        assert _ok(s.rotary_dim, e.rotary_dim), f"rotary_dim {s.rotary_dim}, expected {e.rotary_dim}:\n{t}"
        if e.head_dim is not None:
            assert _ok(s.head_dim, e.head_dim), f"head_dim {s.head_dim}, expected {e.head_dim}:\n{t}"
        assert s.table_form == e.table_form, f"table_form {s.table_form!r}, expected {e.table_form!r}:\n{t}"
        assert bool(s.conjugate) == e.conjugate, f"conjugate {s.conjugate}, expected {e.conjugate}:\n{t}"
        if out_dtypes:
            assert any(dtype_name_matches(s.out_dtype, d) for d in out_dtypes), \
                f"out_dtype {s.out_dtype}, expected one of {out_dtypes}:\n{t}"
        assert 0 <= s.kernel < len(r.kernels), f"site without kernel:\n{t}"
    if check_source:
        for s in r.sites:
            assert any(f in s.source for f in SPELLING_FILES), \
                f"site source {s.source!r} does not point into the spelling (tests/spellings):\n{t}"


def check_graph(p, e: Expect) -> None:
    """What the pass left in the post-grad graph, by tests/zoo/harness.py's analysis (not the pass's report):
    RoPE arithmetic before it, exactly `e.kernels` rope_fusion nodes and no table x activation product or
    negation of an activation after it."""
    cap = p.capture
    t = p.report.table()
    assert cap.products_before, f"the independent analysis found no RoPE products before the pass:\n{t}"
    assert cap.rope_ops == e.kernels, f"{cap.rope_ops} rope_fusion nodes in the graph, expected {e.kernels}:\n{t}"
    if e.kernels == 0:  # a known gap: the RoPE is left as it was
        assert cap.products_after, f"nothing fused, yet no RoPE products are left:\n{t}"
        return
    assert cap.products_after == [], f"table x activation products left: {cap.products_after}\n{t}"
    assert cap.negations_after == [], f"negations of activations left: {cap.negations_after}\n{t}"
