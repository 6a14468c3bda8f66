"""Graphs of fake CUDA tensors run through the pass and through Inductor's own post-grad passes, with no GPU: how
the tests check what the pass emits for CUDA (the kernel's user-kernel nodes) and what Inductor makes of it.

CPU-only torch traces fake CUDA tensors but cannot run them: make_fx cannot index them with None (spell the
broadcast with unsqueeze), and Inductor's reinplacing of a `slice_scatter` copies them, which it cannot either.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch.fx as fx


def pass_graph(fn: Any, args: list, backend: str = "triton") -> tuple[Any, fx.GraphModule]:
    """fn's post-grad graph as Inductor's decompositions trace it on `args`, after the pass (no errors): (pass, gm)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    import rope_fusion

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    p = rope_fusion.RopeFusionPass(backend=backend)
    p(gm.graph)
    assert not p.report.errors, p.report.table()
    return p, gm


def inductor_reinplaced(gm: fx.GraphModule, fake_mode: Any) -> fx.GraphModule:
    """gm after Inductor's reinplacing and its decomposition of the functional user-kernel nodes into mutations (a
    clone where a written buffer could not be written in place), as Inductor runs them after the custom pass."""
    from torch._inductor.fx_passes.post_grad import decompose_triton_kernel_wrapper_functional
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V

    takes_gm = "gm" in inspect.signature(FakeTensorUpdater).parameters  # torch 2.13 takes the module, 2.11 the graph
    with V.set_fake_mode(fake_mode), fake_mode:  # active: CPU-only torch cannot copy fake CUDA tensors outside it
        reinplace_inplaceable_ops(FakeTensorUpdater(gm if takes_gm else gm.graph), gm.graph)
        decompose_triton_kernel_wrapper_functional(gm.graph)
    return gm


def written_by_kernel(mp: pytest.MonkeyPatch, node: fx.Node, fake_mode: Any) -> list[str]:
    """The arguments Inductor finds a user-kernel node's kernel writes, from its TTIR (`get_mutated_tensors`).
    Triton builds the TTIR for a target, which needs a GPU driver: a stand-in driver names an sm_90 target, set as
    `set_active` sets it and put back by `mp` (`reset_active` would build the default one, which raises without a
    GPU); nothing is compiled beyond the TTIR, and nothing runs."""
    import triton
    from torch._higher_order_ops.triton_kernel_wrap import get_mutated_tensors
    from triton.backends.compiler import GPUTarget

    class TargetOnly:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    kwargs = {k: v.meta["val"] if isinstance(v, fx.Node) else v for k, v in node.kwargs["kwargs"].items()}
    mp.setattr(triton.runtime.driver, "_active", TargetOnly())
    with fake_mode:
        return sorted(get_mutated_tensors(node.kwargs["kernel_idx"], node.kwargs["constant_args_idx"], kwargs, {}))
