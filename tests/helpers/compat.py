"""Shared checks of the compat tests: what op parameters a drop-in calls, and what the pass emits for the helper
it replaces."""

from __future__ import annotations

import pytest
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


class KernelLaunches:
    """The Triton rotary kernel, interpreted, behind a recorder: each direct launch's q, k and v (what the kernel
    reads: a drop-in that copies its input first shows the copy here) and their outputs (what it writes)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.reads: list = []
        self.writes: list = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.reads.append(args[:3])
            self.writes.append(args[3:6])
            return self.kernel[grid](*args, **kw)
        return launch

    @property
    def count(self) -> int:
        return len(self.reads)


# what the drop-ins run on CPU tensors: the `triton_on_cpu` fixture's settings for `kernel_on_cpu`
ON_CPU = pytest.mark.triton_on_cpu(serves=("eager", "slice_write", "cat", "cat_planner", "join"), wrap=KernelLaunches)


@pytest.fixture
def kernel_on_cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """CPU tensors served as CUDA tensors are: the op's direct path, the in-place form (ops/slice_write.py), the
    cat ops (ops/cat_rotary.py) and the joins (ops/joins.py) plan the Triton kernels, which run interpreted and
    recorded (`KernelLaunches`; the join kernel's as the `joins` attribute), through the `triton_on_cpu` fixture
    (tests/conftest.py) with the settings `ON_CPU` gives the test.
    The drop-ins' plans are dropped before and after, so none planned for another device serves a call here, nor
    one planned here a call after."""
    from rope_fusion.compat.direct import clear_plans
    request.applymarker(ON_CPU)
    kernels = request.getfixturevalue("triton_on_cpu")
    launches = kernels.rotary
    launches.joins = kernels.join  # the join kernel's launches: (a, b, out) read
    clear_plans()
    yield launches
    clear_plans()
