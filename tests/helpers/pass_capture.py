"""The pass in front of the kernel-site capture (tests/helpers/kernel_sites.py): the same function compiled
plainly and with `RopeFusionPass`, so a test compares what the kernels compute with what the fused op computes, and
reads the graph the pass left."""

from __future__ import annotations

import torch

import rope_fusion
from examples.vllm_omni_block import cpu_triton_tracing
from rope_fusion.passes.kernel_sites import kernel_scan as kscan
from tests.helpers.kernel_sites import Capture, capture_backend, compile_capture, ulps_close

LAUNCH = "target=torch.ops.higher_order.triton_kernel_wrapper_functional"  # a launch in a graph's text


class PassCapture(Capture):
    """RopeFusionPass, then what the capture records: the graph the compiled function runs, and the kernel sites
    left in it."""

    def __init__(self, **pass_kw):
        super().__init__()
        self.p = rope_fusion.RopeFusionPass(**pass_kw)
        self.before, self.site_order = "", []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before = str(graph)
        self.site_order = [s.node.name for s in kscan.find_kernel_sites(graph)[0]]
        self.p(graph)
        super().__call__(graph)

    def pairs(self) -> list:
        """The sites of each fused launch, as indices of the kernel sites in graph order."""
        rep = self.p.report
        return sorted(sorted(self.site_order.index(rep.sites[i].node) for i in k.sites) for k in rep.kernels)


def compile_fused(fn, *args, ttir: bool = True, v2: bool = True, dynamic: bool = False):
    """`compile_capture` with RopeFusionPass in front of the capture: (outputs, PassCapture)."""
    import torch._functorch.config as fconfig

    torch._dynamo.reset()
    cap = PassCapture()
    with cpu_triton_tracing(ttir), torch._inductor.config.patch(enable_auto_functionalized_v2=v2), \
            fconfig.patch(enable_autograd_cache=False), torch.no_grad():
        out = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=capture_backend(cap))(*args)
    return out, cap


def clones(args):
    """Fresh copies of the tensor arguments, so the plain and the fused run each update their own in place."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def plain_and_fused(fn, *args, dynamic_dims: dict | None = None, **kw):
    """Run fn compiled plainly and with the pass on clones of args: (plain outs, plain args, fused outs, fused args,
    the PassCapture). The args come back as the compiled function left them (in-place updates). `dynamic_dims`:
    {arg index: dims} to mark dynamic on the clones."""
    pa, fa = clones(args), clones(args)
    for i, dims in (dynamic_dims or {}).items():
        for t in (pa[i], fa[i]):
            torch._dynamo.mark_dynamic(t, dims)
    plain, _ = compile_capture(fn, *pa, **kw)
    fused, cap = compile_fused(fn, *fa, **kw)
    return plain, pa, fused, fa, cap


def assert_same(fused, plain) -> None:
    for f, p in zip(fused, plain):
        if isinstance(p, torch.Tensor) and p.is_floating_point():
            assert f.dtype == p.dtype and f.shape == p.shape
            ulps_close(f, p)
        elif isinstance(p, torch.Tensor):
            assert torch.equal(f, p)




def fused_call(cap: PassCapture) -> torch.fx.Node:
    (node,) = [n for n in cap.gm.graph.nodes if n.op == "call_function" and "rope_fusion" in str(n.target)]
    return node
