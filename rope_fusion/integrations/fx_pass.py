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

A graph in another form than AOTAutograd's (in-place writes, undecomposed `stack`, a pre-dispatch graph's composite
ops) is analysed in its functional, decomposed form (passes/analysis/aten_form.py), which replaces it where a site
fused. `fx_pass` is no Dynamo backend: given to torch.compile as one, it raises what to use instead.

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

from ..ops.backends import Backend, LeftToInductor, Refusal, SiteSpec, emit_op_call, load_backends
from ..ops.op_definition import OPS
from ..passes.analysis import aten_form
from ..passes.analysis.provenance import source_line
from ..passes.auto.choosers import Choice, Chooser, GraphFacts
from ..passes.report import Miss
from ..passes.rope_pass import RopeFusionPass

log = logging.getLogger("rope_fusion")

NPU_DEVICE_TYPES = ("npu",)
"""Device types whose graphs get torch_npu's ops (tests add "cpu" to check the emission with stand-in ops)."""

_LEFT = "left to Inductor: "  # how RopeFusionPass words a site that `_choose` leaves alone


class LeftInGraph(LeftToInductor):
    """A site left as the model wrote it because the compiler after this pass could not run the fused op."""

    PREFIX = "left in the graph: "


NOT_A_BACKEND = (
    "rope_fusion.fx_pass was given to torch.compile as its backend: it is a pass over the ATen graphs that "
    "AOTAutograd produces (npugraph_ex's and TorchAir's custom-pass slot) and returns nothing to run. Use "
    "torch.compile(f, backend=rope_fusion.backend(\"eager\")) (AOTAutograd, then fx_pass, then \"eager\", "
    "\"aot_eager\", \"cudagraphs\", \"inductor\" or a backend callable), or "
    "torch.compile(f, options=rope_fusion.inductor_options()) with Inductor")


def dynamo_graph(graph: fx.Graph) -> bool:
    """Whether `graph` is Dynamo's own graph (torch-level calls, handed to a backend), not an ATen graph: its
    inputs carry Dynamo's `grapharg`, and its values `example_value` where ATen graphs carry `val`."""
    nodes = list(graph.nodes)
    if any("grapharg" in n.meta for n in nodes if n.op == "placeholder"):
        return True
    return any("example_value" in n.meta for n in nodes) and not any("val" in n.meta for n in nodes)


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
        super().__init__(backend="auto", fuse_qk=fuse_qk, cache_host_tables=cache_host_tables, chooser=FX_CHOOSER)
        self._unread: tuple | None = None  # (aten_form.Finding, error) of a graph not brought into the rules' form

    def __call__(self, gm: fx.GraphModule | fx.Graph, example_inputs: Any = None, config: Any = None, *,
                 is_inference: bool | None = None) -> None:
        graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
        if isinstance(graph, fx.Graph) and dynamo_graph(graph):
            raise TypeError(NOT_A_BACKEND)
        load_backends()  # the op's device kernels (Triton on CUDA) register when their module imports
        misses = len(self.report.misses)
        work, traced = self._readable(graph, example_inputs)
        try:
            super().__call__(work, is_inference=is_inference, config=config)
        finally:
            self._unread = None
        for m in self.report.misses[misses:]:
            if m.reason.startswith(_LEFT + LeftInGraph.PREFIX):
                m.reason = m.reason[len(_LEFT):]
        if self.report.graph_records[-1].sites:
            if traced is not None:
                aten_form.adopt(graph, traced)  # the fused normal form takes the original's place
            reshape_views_after(graph, [n for n in graph.nodes if n.target in self._emitted_ops()])
        if isinstance(gm, fx.GraphModule):
            gm.recompile()

    def _readable(self, graph: fx.Graph, example_inputs: Any) -> tuple:
        """(the graph to analyse, the traced normal form or None): `graph` itself where it is in the form the lane
        rules read, else its functional, decomposed form (passes/analysis/aten_form.py). Where that cannot be traced, a
        graph that writes in place is not analysed at all (its writes are unseen: a fused rotation could read a
        value from before one), and one that only keeps an undecomposed op is analysed as it is; either way a near
        miss says why (`_fuse`)."""
        finding = aten_form.examine(graph)
        if not finding:
            return graph, None
        try:
            traced = aten_form.normal_form(graph, example_inputs)
        except Exception as e:
            self._unread = (finding, f"{type(e).__name__}: {e}")
            return graph, None
        return traced.graph, traced

    def _fuse(self, graph: fx.Graph, index: int, config: Any = None) -> list:
        """The analysis, after a near miss for a graph that could not be brought into the form it reads."""
        if self._unread is None:
            return super()._fuse(graph, index, config)
        finding, error = self._unread
        node = finding.mutation or finding.undecomposed or finding.foreign_value
        left = ("not analysed: its writes would be unseen" if finding.mutation is not None else
                "analysed as it is")
        self.report.misses.append(Miss(index, node.name, f"the graph {finding.describe()}, and tracing it functional "
                                       f"and decomposed failed ({error}): {left}", source_line(node)))
        return [] if finding.mutation is not None else super()._fuse(graph, index, config)

    @staticmethod
    def _emitted_ops() -> set:
        from ..kernels import npu_graph

        return {*OPS, *npu_graph.op_targets()}

    def uuid(self) -> Any:
        return f"{super().uuid()}-fx{int(self.npu_ops)}"

    def __getstate__(self) -> dict:
        return {"fuse_qk": self.fuse_qk, "cache_host_tables": self.cache_host_tables, "npu_ops": self.npu_ops}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(fuse_qk={self.fuse_qk}, cache_host_tables={self.cache_host_tables}, "
                f"npu_ops={self.npu_ops})")


# The rope_fusion op as such: its eager kernel runs (Triton on CUDA, the NPU bridge, the reference on the CPU).
_OP = Backend("op", lambda spec: None, lambda em, call, like: emit_op_call(OPS, em, call, like))


def _npu_ops(ge: bool) -> Backend:
    """torch_npu's ops as graph nodes (kernels/npu_graph.py). A site they cannot take is refused (the rope_fusion op
    takes it), except under TorchAir's graph mode, which converts torch_npu's ops but not ours: there it is left."""

    def emit(em: Any, call: Any, like: fx.Node) -> list | Refusal:
        from ..kernels import npu_graph

        try:
            return npu_graph.emit(em, call, like, ge=ge)
        except npu_graph.NotTaken as e:
            if ge:
                raise LeftInGraph(f"{LeftInGraph.PREFIX}TorchAir's graph mode converts torch_npu's ops but not "
                                  f"rope_fusion's, and {e}") from None
            return Refusal(str(e))
    return Backend("npu", lambda spec: None, emit)


def _fx_choose(p: Any, spec: SiteSpec, facts: GraphFacts) -> Choice:
    """A fixed choice, no cost model (nothing here compiles the model's own code into fused kernels): torch_npu's ops
    on an NPU graph (where `npu_ops`), else the rope_fusion op."""
    if p.npu_ops and spec.device_type in NPU_DEVICE_TYPES:
        return Choice(_npu_ops(ge_mode(facts.config)), "rule", instead=_OP,
                      instead_words="the rope_fusion op (its eager kernel)")
    return Choice(_OP, "rule")


FX_CHOOSER = Chooser("fx", _fx_choose, reads_decisions=False)
"""What a site becomes outside Inductor: neither measured nor read from `auto`'s decisions on disk."""

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

__all__ = ["FX_CHOOSER", "FxPass", "LeftInGraph", "NOT_A_BACKEND", "NPU_DEVICE_TYPES", "dynamo_graph", "fx_pass",
           "ge_mode", "reshape_views_after"]
