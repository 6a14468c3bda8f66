"""What `auto` times after a site: the consumers Inductor fuses into the code that computes the rotation.

A site timed alone ends at the rotation. In the model, plain compile writes the rotation where its readers want it:
the views and casts after it, a `cat` that joins it with other tokens, and above all the layout that attention's
kernel needs (Inductor lays SDPA's q, k and v out as its kernel demands, `sdpa_constraint`, realising the rotation's
pointwise code directly in that layout). A fused op's result is a buffer of its own: where its layout, or a join
after it, is not what the reader takes, the model pays a copy that the isolated timing never saw. LTX-Video showed
it: its norm over the [.., 2048] row and the rotation, timed alone, measured the lowering at 48.8 us against plain
compile's 63.2, yet the model ran 0.958x plain under CUDA graphs, where plain compile had fused the norm and
rotation into the copy feeding attention (`..._fused_rms_norm__scaled_dot_product_cudnn_attention__to_copy...`).

So the timed region follows the site's outputs forward through what plain compile fuses with them (`FUSED`: views,
layout changes, casts, copies, elementwise math, `cat`) up to what reads them from memory, and where that is an
attention kernel, its q, k and v go to `attention_layout`, an op that does nothing but takes its inputs with the
layout constraint Inductor gives that attention kernel (torch's own, looked up, not restated). Every candidate
ends the same way: "left" is the whole region compiled once; the lowering is the op followed by the consumers in
one graph, where Inductor fuses them as it would in the model; the kernel's result feeds the consumers compiled
after it, as the opaque node's result does in the model. The attention itself is not timed: it costs every
candidate the same.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from .auto_region import NotMeasured, copy_region, region, starts_region

log = logging.getLogger("rope_fusion")
aten = torch.ops.aten
prims = torch.ops.prims

MAX_CONSUMERS = 48  # consumer nodes followed past a site's outputs at most (beyond: where the walk stops)

# Attention kernels whose q, k and v Inductor lays out as the kernel needs (their own layout constraint).
_ATTENTION_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_fused_attention_overrideable")
ATTENTION = tuple(getattr(aten, n).default for n in _ATTENTION_NAMES if hasattr(aten, n))

# Besides elementwise math (torch.Tag.pointwise) and views: what plain compile computes in the same kernel as the
# value it reads.
FUSED = {aten.cat.default, aten.clone.default, aten._to_copy.default, prims.convert_element_type.default,
         aten.expand.default, aten.permute.default, aten.transpose.int, aten._unsafe_view.default,
         aten.reshape.default, aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
         aten.alias.default}


def _fuses(n: fx.Node) -> bool:
    """Whether plain compile computes n in the kernel that computes what it reads."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    if starts_region(n):
        return False
    t = n.target
    return t in FUSED or getattr(t, "is_view", False) or torch.Tag.pointwise in getattr(t, "tags", ())


@dataclasses.dataclass
class Consumers:
    """What a site's candidates return: `ends`, the values read by something plain compile does not fuse with the
    rotation (the site's outputs themselves where nothing fuses after them), and the attention kernels whose q, k
    and v the candidates lay out for them. `fused` is the consumer nodes between."""

    outputs: list
    ends: list
    attention: list
    fused: list

    @property
    def trivial(self) -> bool:
        return not self.fused and not self.attention

    @property
    def needed(self) -> list:
        """The values the candidates compute: the ends, then every attention kernel's q, k and v."""
        qkv = [a for att in self.attention for a in att.args[:3] if isinstance(a, fx.Node)]
        return list(dict.fromkeys([*self.ends, *qkv]))


def consumers(outputs: list, through_cat: bool = True) -> Consumers:
    """Follow the site's outputs forward through what plain compile fuses with them, in graph order (not through a
    `cat` where `through_cat` is false)."""
    fused: dict = {}
    attention: dict = {}
    ends: dict = {}
    stack = list(outputs)
    while stack:
        v = stack.pop()
        for u in v.users:
            if u in fused:
                continue
            if u.op == "call_function" and u.target in ATTENTION and any(a is v for a in u.args[:3]):
                attention[u] = None
            elif _fuses(u) and len(fused) < MAX_CONSUMERS and (through_cat or u.target is not aten.cat.default):
                fused[u] = None
                stack.append(u)
            else:
                ends[v] = None
    order = {n: i for i, n in enumerate(outputs[0].graph.nodes)} if outputs else {}
    return Consumers(list(outputs), sorted(ends, key=order.__getitem__), sorted(attention, key=order.__getitem__),
                     sorted(fused, key=order.__getitem__))


@dataclasses.dataclass
class Downstream:
    """A site's consumers as the candidates run them: `graph` computes what the candidates return from the site's
    outputs (its first placeholders, in order) and `inputs`, the other values it reads (in memory anyway)."""

    cons: Consumers
    graph: fx.Graph
    inputs: list

    @property
    def needed(self) -> list:
        return self.cons.needed

    def returns(self, g: fx.Graph, env: dict) -> tuple:
        """What a graph holding the whole region (`env`: the original nodes to g's) returns."""
        return _returns(self.cons, g, env)

    def attach(self, g: fx.Graph, results: list) -> tuple:
        """Copy the consumers into g after the op whose `results` (x's shape) stand for the site's outputs, viewed
        in their shapes as the emission views them; the other inputs become placeholders of g after its own (the
        caller passes them last). Returns what g returns."""
        values = [g.call_function(aten.reshape.default, (r, list(o.meta["val"].shape)))
                  for r, o in zip(results, self.cons.outputs)]
        places = [n for n in self.graph.nodes if n.op == "placeholder"]
        env = dict(zip(places, values))
        first = next(n for n in g.nodes if n.op != "placeholder")
        with g.inserting_before(first):
            for p in places[len(values):]:
                env[p] = g.placeholder(f"down_{p.name}")
                env[p].meta["val"] = p.meta.get("val")
        for n in self.graph.nodes:
            if n.op == "output":
                return tuple(env[a] for a in n.args[0])
            if n.op != "placeholder":
                env[n] = g.node_copy(n, lambda a: env[a])
        raise AssertionError("a graph without an output")

    def shaped(self, values: list) -> list:
        """The op's results (x's shape) in the shapes of the site's outputs, as the emission views them."""
        return [v.reshape(tuple(o.meta["val"].shape)) for v, o in zip(values, self.cons.outputs)]


def downstream(site: Any, through_cat: bool) -> Downstream | None:
    """The consumers after `site`'s outputs (an auto_timing.AutoSite), None where nothing fuses after them."""
    cons = consumers(site.outputs, through_cat)
    if cons.trivial:
        return None
    body, inputs = region(cons.needed, stop=frozenset(cons.outputs))
    inputs = [*cons.outputs, *(i for i in inputs if i not in cons.outputs)]
    g, env = copy_region(body, inputs)
    g.output(_returns(cons, g, env))
    return Downstream(cons, g, inputs[len(cons.outputs):])


def _returns(cons: Consumers, g: fx.Graph, env: dict) -> tuple:
    """The ends, and each attention kernel's q, k and v laid out for it (`env`: the original nodes to g's)."""
    return (*(env[e] for e in cons.ends), *add_layouts(g, env, cons))


# -- attention_layout: the attention kernel's input layout, without the attention ----------------------------

@torch.library.custom_op("rope_fusion::attention_layout", mutates_args=())
def attention_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Nothing: the inputs arrive laid out as the attention kernel takes them (the layout constraint registered
    for this op in Inductor, `register_attention_layout`), and that is all a timing needs of them."""
    return q.new_empty(0)


@attention_layout.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(0)


_REGISTERED: dict = {}


def register_attention_layout(target: Any) -> Any:
    """The op that lays its inputs out as Inductor lays out `target`'s q, k and v: `attention_layout`, lowered as a
    fallback under `target`'s own layout constraint. The attention kernels share one (`sdpa_constraint`); one that
    had another would not be timed this way. Raises NotMeasured where this torch's Inductor has no such lookup."""
    op = torch.ops.rope_fusion.attention_layout.default
    try:
        from torch._inductor import lowering
    except ImportError as e:
        raise NotMeasured(f"attention's layout not reproducible here ({e})") from e
    lookup = getattr(lowering, "maybe_layout_constraints", None)
    constraint = lookup(target) if lookup is not None else None
    if constraint is None:
        raise NotMeasured(f"Inductor has no layout constraint for {target} to time the attention's layout with")
    if "constraint" not in _REGISTERED:
        lowering.make_fallback(op, constraint, warn=False)
        _REGISTERED["constraint"] = constraint
    elif _REGISTERED["constraint"] is not constraint:
        raise NotMeasured(f"{target}'s layout constraint differs from the other attention kernels'")
    return op


def add_layouts(g: fx.Graph, env: dict, cons: Consumers) -> list:
    """Append one `attention_layout` per attention kernel to g (env maps the original nodes to g's); their
    results, for g's output. Where this torch's Inductor cannot give the attention's layout constraint, q, k and v
    are returned as they are (in the layouts the graph records for them), logged once."""
    outs = []
    for att in cons.attention:
        qkv = tuple(env[a] for a in att.args[:3])
        try:
            outs.append(g.call_function(register_attention_layout(att.target), qkv))
        except NotMeasured as e:
            if str(e) not in _REGISTERED.setdefault("logged", set()):
                _REGISTERED["logged"].add(str(e))
                log.info("rope_fusion: %s; attention's inputs are timed as the graph lays them out", e)
            outs.extend(qkv)
    return outs


__all__ = ["ATTENTION", "Consumers", "Downstream", "FUSED", "MAX_CONSUMERS", "add_layouts", "attention_layout",
           "consumers", "downstream", "register_attention_layout"]
