"""`rope_fusion.fx_pass`: the pass on ATen FX graphs that no Inductor compiles.

npugraph_ex, TorchAir, the Dynamo backends `aot_eager` and `cudagraphs` and `rope_fusion.backend()` compile the
functional ATen graphs that AOTAutograd hands a backend (the forward and the backward of a training step, or an
inference graph). `FxPass` runs the analysis, grouping, failure policy and report of `RopeFusionPass` on them
(it is one, with another choice of what a site becomes) and takes the custom-pass signature of npugraph_ex and
TorchAir, `fn(gm, example_inputs, config) -> None`, rewriting `gm` in place:

    torch.compile(m, backend="npugraph_ex", options={"post_grad_custom_pre_pass": rope_fusion.fx_pass})
    config = torchair.CompilerConfig(); config.post_grad_custom_pre_pass = rope_fusion.fx_pass

What a site becomes, since no Inductor lowers or costs it here:
- on an NPU graph, torch_npu's own ops as graph nodes (kernels/npu_graph.py), within their documented layouts;
  a site they cannot take keeps the `rope_fusion` op (its eager kernel on the NPU is the bridge of
  kernels/npu.py, which runs the reference where the ops do not apply), with the reason in the report, except
  under TorchAir's graph mode (GE, `config.mode == "max-autotune"`), which has converters for torch_npu's ops
  and none for ours: there such a site is left as the model wrote it, with the reason;
- elsewhere the `rope_fusion` op, which runs its eager kernel: the Triton kernel on CUDA (registered as the op's
  CUDA kernel), the reference on the CPU. There is no cost model: the model's own code runs here as one kernel
  per ATen op, not as the fused kernels Inductor would generate, so there is nothing for a site to be left to.

`rope_fusion.fx_pass` is one shared instance whose `report` fills with every graph it rewrites; `FxPass(...)`
makes another with its own report. As with the Inductor pass, a copy or an unpickled pass keeps the options and
starts with an empty report. In npugraph_ex and TorchAir the pre-pass slot runs before their own FX passes
(no-op removal, their pattern-fusion replacements, view-to-reshape); the post-pass slot after them, on views
already turned into reshapes. npugraph_ex also registers a RoPE replacement of its own among Inductor's joint-graph
patterns (`q * cos + rotate_half(q) * sin` with full tables, one tensor, to `npu_rotary_mul`), which runs before
either slot: a site it took reaches this pass as an `npu_rotary_mul` node, which it leaves as it is.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.fx as fx

from ..ops.backends import Backend, LeftToInductor, SiteSpec, emit_op_call, load_backends
from ..ops.library import OPS
from .rope_pass import RopeFusionPass

log = logging.getLogger("rope_fusion")

NPU_DEVICE_TYPES = ("npu",)
"""Device types whose graphs get torch_npu's ops (tests add "cpu" to check the emission with stand-in ops)."""

_LEFT = "left to Inductor: "  # how RopeFusionPass words a site that `_choose` leaves alone


class LeftInGraph(LeftToInductor):
    """A site left as the model wrote it because the compiler after this pass could not run the fused op."""

    PREFIX = "left in the graph: "


def ge_mode(config: Any) -> bool:
    """Whether `config` is a TorchAir CompilerConfig in graph mode (GE: every node through a converter)."""
    mode = getattr(config, "mode", None)
    return getattr(mode, "value", mode) == "max-autotune"


class FxPass(RopeFusionPass):
    """The pass for ATen graphs outside Inductor: `fx_pass(gm, example_inputs=None, config=None)`.

    `gm` is a GraphModule (recompiled after the rewrite) or an fx.Graph; `example_inputs` is not needed (the
    graph's nodes carry their fake values); `config` is the compiler's CompilerConfig, read only to tell
    TorchAir's graph mode. Options as RopeFusionPass's: `fuse_qk` (q and k in one launch where they share
    tables), `cache_host_tables`, `npu_ops` (emit torch_npu's ops on NPU graphs; False keeps the rope_fusion op).
    """

    def __init__(self, fuse_qk: bool = True, cache_host_tables: bool = True, npu_ops: bool = True) -> None:
        self.npu_ops = bool(npu_ops)
        super().__init__(backend="auto", fuse_qk=fuse_qk, cache_host_tables=cache_host_tables)
        self._ge = False
        self._chosen: dict = {}  # the replaced node of a group -> (backend name, why not the NPU ops)

    def __call__(self, gm: fx.GraphModule | fx.Graph, example_inputs: Any = None, config: Any = None, *,
                 is_inference: bool | None = None) -> None:
        graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
        self._ge = ge_mode(config)
        self._chosen.clear()
        load_backends()  # the op's device kernels (Triton on CUDA) register when their module imports
        misses = len(self.report.misses)
        super().__call__(graph, is_inference=is_inference)
        for m in self.report.misses[misses:]:
            if m.reason.startswith(_LEFT + LeftInGraph.PREFIX):
                m.reason = m.reason[len(_LEFT):]
        if self.report.graph_records[-1].sites:
            reshape_views_after(graph, [n for n in graph.nodes if n.target in self._emitted_ops()])
        if isinstance(gm, fx.GraphModule):
            gm.recompile()

    @staticmethod
    def _emitted_ops() -> set:
        from ..kernels import npu_graph

        return {*OPS, *npu_graph.op_targets()}

    # -- what a site becomes -----------------------------------------------------------------------------
    def _choose(self, spec: SiteSpec):
        if self.npu_ops and spec.device_type in NPU_DEVICE_TYPES:
            return Backend("npu", lambda s: None, self._emit_npu), ""
        return _OP, ""

    def _emit_npu(self, em, call, like: fx.Node) -> list:
        from ..kernels import npu_graph

        try:
            outs = npu_graph.emit(em, call, like, ge=self._ge)
        except npu_graph.NotTaken as e:
            if self._ge:
                raise LeftInGraph(f"{LeftInGraph.PREFIX}TorchAir's graph mode converts torch_npu's ops but not "
                                  f"rope_fusion's, and {e}") from None
            self._chosen[like] = (_OP.name, f"npu: {e}; the rope_fusion op (its eager kernel) instead")
            return emit_op_call(OPS, em, call, like)
        self._chosen[like] = ("npu", "")
        return outs

    def _backend_of(self, p) -> tuple[str, str]:
        """What `_choose` emitted: torch_npu's ops, or the rope_fusion op with why not them."""
        return self._chosen.get(p.group[0].node) or super()._backend_of(p)

    def uuid(self) -> Any:
        return f"{super().uuid()}-fx{int(self.npu_ops)}"

    def _decisions_key(self) -> str:
        """Its choice is fixed (`_choose`): neither measured nor read from `auto`'s decisions on disk."""
        return ""

    def __getstate__(self) -> dict:
        return {"fuse_qk": self.fuse_qk, "cache_host_tables": self.cache_host_tables, "npu_ops": self.npu_ops}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(fuse_qk={self.fuse_qk}, cache_host_tables={self.cache_host_tables}, "
                f"npu_ops={self.npu_ops})")


# The rope_fusion op as such: its eager kernel runs (Triton on CUDA, the NPU bridge, the reference on the CPU).
_OP = Backend("op", lambda spec: None, lambda em, call, like: emit_op_call(OPS, em, call, like))

def reshape_views_after(graph: fx.Graph, fused: list) -> int:
    """`view` of a value computed from a fused result becomes `reshape`; returns how many changed.

    The fused op returns contiguous tensors, where the arithmetic it replaced kept the layout of its input (a
    transposed q stays transposed), and a `view` later in the graph was traced on that layout: run as written
    it fails where the new layout is not viewable (Llama's `attn_output.transpose(1, 2)...view(...)` after
    attention on a rotated q). Inductor turns every view into a reshape before its post-grad passes (and so does
    TorchAir); a graph that runs op by op needs it downstream of the fused nodes only. A reshape is the view
    where the layout allows one, else one copy; values there are new tensors, never aliases of the graph's
    inputs, so no aliasing the graph's caller sees changes."""
    import torch

    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    seen, stack, changed = set(), list(fused), 0
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            stack.append(u)
            if u.op == "call_function" and u.target in views:
                u.target = torch.ops.aten.reshape.default
                changed += 1
    return changed


fx_pass = FxPass()
"""The shared instance: `rope_fusion.fx_pass(gm, example_inputs, config)`; `rope_fusion.fx_pass.report`."""

__all__ = ["FxPass", "LeftInGraph", "NPU_DEVICE_TYPES", "fx_pass", "ge_mode", "reshape_views_after"]
