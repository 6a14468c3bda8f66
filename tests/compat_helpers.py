"""Shared checks of the compat tests: what op parameters a drop-in calls, and what the pass emits for the helper
it replaces."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from rope_fusion.passes.report import PER_LANE


def dropin_calls(fn, *args) -> list:
    """The kwargs of every rope_fusion op the drop-in calls, from an FX trace of it."""
    gm = make_fx(fn)(*args)
    return [dict(n.kwargs) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("rope_fusion.")]


def site_params(site) -> dict:
    """The op parameters a pass site stands for, in the op's keyword names."""
    return {"interleaved": site.style == "interleaved", "rotary_dim": site.rotary_dim,
            "full_tables": site.table_form == PER_LANE, "conjugate": site.conjugate,
            "rotary_blocks": site.rotary_blocks, "rotary_offset": site.rotary_offset}


def assert_pass_matches_dropin(report, calls: list, n_sites: int, context: str = "") -> None:
    """The pass fused the upstream helper into n_sites sites whose parameters are those the drop-in passes.

    The table form is left out where the pass read a full-width table as per-pair (it may prove the halves
    equal); pairing, rotary dim, conjugation, blocks and offset must agree."""
    assert not report.errors, context
    assert len(report.sites) == n_sites, context
    (call,) = {tuple(sorted((k, c.get(k, d)) for k, d in
                            (("interleaved", False), ("rotary_dim", None), ("conjugate", False),
                             ("rotary_blocks", 1), ("rotary_offset", 0)))) for c in calls}
    want = dict(call)
    for s in report.sites:
        got = site_params(s)
        got.pop("full_tables")
        assert got == want, f"pass {got} vs drop-in {want}\n{context}"


def fresh(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)
