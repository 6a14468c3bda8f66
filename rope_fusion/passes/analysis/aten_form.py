"""The graph form the lane rules read, for ATen graphs that reach `fx_pass` in another form.

The lane rules are written for the graphs Inductor hands its post-grad passes: functional (every value computed
once, never written in place) and decomposed by Inductor's table. AOTAutograd hands its compilers such graphs, but
a graph can reach `fx_pass` otherwise: `make_fx` without functionalization or decompositions, a pre-dispatch
graph, a compiler whose decomposition table is narrower than Inductor's. Two things then go wrong:

- an in-place op (`fill_`, `copy_` into a view, `mul_`): the analysis reads every node as a value computed once, so
  it does not see the write, and a rotation of the written tensor was fused as a rotation of what it held before
  (5.4 off on `y = x.clone(); y[..., :4] = 0; rope(y)`);
- an op whose decomposed form the rules read but not its own (`stack`, a `cat` of unsqueezed tensors; the
  composite ops of a pre-dispatch graph, `chunk`, `flatten`, `type_as`): the value is opaque, and Wan's
  `unbind` ... `stack` rotation was reported as a pairing that it is not, or not at all.

Such a graph is traced again by torch's own machinery (`make_fx` over `torch.func.functionalize`, with the
decompositions of `DECOMPOSED_FIRST` and of every composite op): the same computation, functional, in the form the
rules read. Only the ops that need it are decomposed; ops with kernels of their own (a norm, a matmul, an NPU op)
stay whole, so the graph a compiler gets back is not slower. `fx_pass` analyses that form and takes it in place of
the original only where it fused something (`adopt`); elsewhere the original graph is left as it was.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .lanes import RULES

aten = torch.ops.aten

# Ops the lane rules read in decomposed form only: each is one that Inductor's decomposition table decomposes
# before its post-grad passes (the form the rules are written for), into ops that have lane rules
# (tests/passes/test_aten_form.py checks every record). Ops that Inductor keeps whole (`repeat`) stay whole here
# too: its graphs hold them, and the rules read them as Inductor's graphs do. The views with copies (`view_copy`,
# ...) come from a graph functionalized with its views removed.
DECOMPOSED_FIRST = frozenset({
    aten.stack.default, aten.t.default, aten.rsub.Tensor,
    aten.new_zeros.default, aten.new_empty.default, aten.new_full.default, aten.new_ones.default,
    aten.ones.default, aten.ones_like.default, aten.fill.Scalar, aten.fill.Tensor, aten.zero.default,
    aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default,
    aten.view_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dim, aten.permute_copy.default,
    aten.transpose_copy.int, aten.expand_copy.default, aten.unbind_copy.int, aten.alias_copy.default,
    aten.split_with_sizes_copy.default, aten.narrow_copy.default,
})


def decomposition_of(op: Any) -> Any:
    """Inductor's decomposition of `op` (None where it keeps the op whole)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table().get(op)


@dataclasses.dataclass
class Finding:
    """Why a graph is not in the form the rules read: the first node that writes in place, the first node whose op
    the rules read only decomposed, the first node whose example value is of another fake mode (each may be None)."""

    mutation: fx.Node | None = None
    undecomposed: fx.Node | None = None
    # a node whose example value belongs to another fake mode than the graph's first one (`make_fx` in its "real"
    # mode gives each value a mode of its own, and nodes the pass adds can then not be traced against them)
    foreign_value: fx.Node | None = None

    def __bool__(self) -> bool:
        return any(n is not None for n in (self.mutation, self.undecomposed, self.foreign_value))

    def describe(self) -> str:
        parts = []
        if self.foreign_value is not None:
            parts.append(f"carries example values of several fake modes (node {self.foreign_value.name})")
        if self.mutation is not None:
            parts.append(f"writes in place ({_op(self.mutation)}, node {self.mutation.name})")
        if self.undecomposed is not None:
            parts.append(f"keeps {_op(self.undecomposed)} (node {self.undecomposed.name}), which the lane rules read "
                         "only decomposed")
        return " and ".join(parts)


def _op(node: fx.Node) -> str:
    name = getattr(node.target, "name", None)
    return f"aten.{name().split('::')[-1]}" if callable(name) else str(node.target)


def _writes_in_place(node: fx.Node, order: dict) -> bool:
    """An op with a mutable schema, except the write of a graph input at its end that AOTAutograd's functional
    graphs hold for a mutated input (`copy_(primals_1, ...)`, read by nothing after it)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return "mutation" in getattr(node.target, "__name__", "")  # triton_kernel_wrapper_mutation
    if not schema.is_mutable:
        return False
    if node.target is aten.copy_.default and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder":
        return any(order[u] > order[node] for u in node.args[0].users if u is not node)
    return True


def _undecomposed(node: fx.Node) -> bool:
    if node.target in RULES:
        return False
    if node.target in DECOMPOSED_FIRST:
        return True
    name = getattr(node.target, "name", None)
    return isinstance(node.target, torch._ops.OpOverload) and callable(name) and \
        torch._C._dispatch_has_kernel_for_dispatch_key(name(), "CompositeImplicitAutograd")


def examine(graph: fx.Graph) -> Finding:
    """Whether `graph` needs `normal_form` before the analysis, and which node says so."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = Finding()
    mode = None
    for node in graph.nodes:
        val_mode = getattr(node.meta.get("val"), "fake_mode", None)
        if val_mode is not None and found.foreign_value is None:
            mode = mode or val_mode
            if val_mode is not mode:
                found.foreign_value = node
        if node.op != "call_function":
            continue
        if found.mutation is None and _writes_in_place(node, order):
            found.mutation = node
        if found.undecomposed is None and _undecomposed(node):
            found.undecomposed = node
    return found


def normal_form(graph: fx.Graph, example_inputs: Sequence[Any] | None = None) -> fx.GraphModule:
    """`graph` traced again, functional and decomposed (module docstring), as a new GraphModule whose placeholders
    keep the original names (AOTAutograd's `tangents_*` say a graph is a backward). Raises where it cannot be."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = [n.meta.get("val") for n in placeholders]
    if any(v is None for v in inputs):
        if example_inputs is None or len(example_inputs) != len(placeholders):
            raise ValueError("the graph's inputs carry no example values")
        inputs = list(example_inputs)
    modes = {id(v.fake_mode): v.fake_mode for v in inputs if isinstance(v, FakeTensor)}
    if len(modes) == 1 and all(isinstance(v, FakeTensor) or not isinstance(v, torch.Tensor) for v in inputs):
        fake_mode = next(iter(modes.values()))
    else:  # real tensors, or fake ones of several modes (static shapes): values of one new mode
        fake_mode = FakeTensorMode()
        inputs = [_in_mode(fake_mode, v) for v in inputs]
    module = fx.GraphModule(graph.owning_module or torch.nn.Module(), _copy(graph))
    table = {n.target: decomposition_of(n.target) for n in graph.nodes
             if n.op == "call_function" and n.target in DECOMPOSED_FIRST}
    run = torch.func.functionalize(fx.Interpreter(module).run, remove="mutations")
    with fake_mode, fx_traceback.preserve_node_meta(), torch.no_grad():
        traced = make_fx(run, decomposition_table={k: v for k, v in table.items() if v is not None})(*inputs)
    traced_inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(traced_inputs) != len(placeholders):
        raise ValueError("the traced graph takes other inputs")
    for new, old in zip(traced_inputs, placeholders):
        new._rename(old.name)
    # functionalization regenerates views of written tensors that nothing reads (the half-written `out[..., 0::2]`
    # of a slice assignment): dead, and rotation-like values the analysis would report as near misses
    traced.graph.eliminate_dead_code()
    return traced


def _in_mode(fake_mode: Any, value: Any) -> Any:
    """A tensor's like in `fake_mode`: its shape, strides, dtype and device (sizes must be concrete)."""
    if not isinstance(value, torch.Tensor):
        return value
    if any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride())):
        raise ValueError("example values of several fake modes with symbolic sizes")
    with fake_mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


def _copy(graph: fx.Graph) -> fx.Graph:
    out = fx.Graph()
    result = out.graph_copy(graph, {})
    out.output(result)
    return out


def adopt(graph: fx.Graph, traced: fx.GraphModule) -> None:
    """Replace the contents of `graph` by `traced`'s (its nodes in order, its constants), keeping `graph`'s own
    placeholders: the caller's graph object, and the module that owns it, now hold the fused normal form. The new
    nodes go in before the old ones are erased, so a failure leaves `graph` as it was."""
    owner = graph.owning_module
    constants = [n for n in traced.graph.nodes if n.op == "get_attr"]
    if constants and owner is None:
        raise ValueError("the traced graph holds constants and no module owns the graph")
    old = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    output = next(n for n in graph.nodes if n.op == "output")
    env = dict(zip((n for n in traced.graph.nodes if n.op == "placeholder"),
                   (n for n in graph.nodes if n.op == "placeholder")))
    known = set(graph.nodes)
    try:
        with graph.inserting_before(output):
            fresh = (f"_rope_fusion_constant{i}" for i in itertools.count())
            for node in constants:
                name = next(n for n in fresh if not hasattr(owner, n))
                setattr(owner, name, _fetch(traced, node.target))
                env[node] = graph.get_attr(name)
                env[node].meta = dict(node.meta)
            result = graph.graph_copy(traced.graph, env)
    except Exception:
        for node in reversed([n for n in graph.nodes if n not in known]):
            graph.erase_node(node)
        raise
    output.args = (result,)
    for node in reversed(old):
        graph.erase_node(node)


def _fetch(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


__all__ = ["DECOMPOSED_FIRST", "Finding", "adopt", "decomposition_of", "examine", "normal_form"]
