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


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """CPU tensors served as CUDA tensors are: the op's direct path, the in-place form (ops/slice_write.py), the
    cat ops (ops/cat_rotary.py) and the joins (ops/joins.py) plan the Triton kernels, which run interpreted and
    recorded (`KernelLaunches`; the join kernel's as the `joins` attribute).
    The drop-ins' plans are dropped before and after, so none planned for another device serves a call here, nor
    one planned here a call after."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    from triton_interpreted import interpreted

    import rope_fusion.kernels.triton_join as tj
    import rope_fusion.kernels.triton_kernel as tk
    import rope_fusion.kernels.triton_launch as launching
    import rope_fusion.kernels.triton_rotary  # noqa: F401  (registers the CUDA kernels)
    from rope_fusion.compat.direct import clear_plans
    from rope_fusion.ops import cat_rotary, joins, library, slice_write

    launches = KernelLaunches(interpreted(tk.rotary_kernel))
    launches.joins = KernelLaunches(interpreted(tj.join_kernel))  # the join kernel's launches: (a, b, out) read
    monkeypatch.setattr(launching, "rotary_kernel", launches)
    monkeypatch.setattr(tj, "join_kernel", launches.joins)
    monkeypatch.setattr(launching, "INTERPRETED", True)
    monkeypatch.setitem(library.DEVICE_KERNELS, "cpu", library.DEVICE_KERNELS["cuda"])
    rope_fusion.clear_caches()
    for registry in (slice_write.IN_PLACE, slice_write.PLANNERS, cat_rotary.DEVICE_IMPLS, cat_rotary.DEVICE_CHECKS,
                     cat_rotary.DEVICE_PLANNERS, joins.JOIN_PLANNERS):
        monkeypatch.setitem(registry, "cpu", registry["cuda"])
    if not isinstance(triton.language.sum, InterpretedFunction):  # a norm's reduction runs interpreted too
        monkeypatch.setattr(triton.language, "sum", InterpretedFunction(triton.language.sum.fn))
    clear_plans()
    yield launches
    clear_plans()
