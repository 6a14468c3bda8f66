"""The KV-cache fold: a fused q/k rotation whose k feeds vLLM's `vllm::unified_kv_cache_update(k, v, layer_name)`
becomes one `rope_fusion::rotary_qk_into_layer_cache` (ops/layer_cache_op.py), which rotates and writes the layer's
cache in one launch where its attention backend has a cache record, and runs vLLM's own path where not.

It runs after the pass has emitted its sites, on the `rope_fusion::rotary_qk` nodes it emitted (any spelling the
pass proves: vLLM's RotaryEmbedding, its `_C.rotary_embedding` op, a model's own arithmetic), so it needs nothing
from the matcher. A backend that emits a node of its own (the Triton kernel's user-kernel node, which Inductor
launches from its generated code) would hide the op from it: such a backend takes this fold by name, and a q/k
pair whose k feeds a cache update and that the token bound folds is then emitted as the op call (`_find`,
`_emit`), which the epilogue replaces.

A cache update is folded where its k is the rotation's k output (through views that keep its shape), v is a
`[tokens, heads, head_dim]` tensor defined before the update, and the layer name is a constant or a graph input of
vLLM's `LayerName` type. The attention backend, the cache's layout and dtype are the forward context's, known only
at run time: the op decides there (ops/layer_caches.py). `auto` folds by a token bound
(passes/folds/kv_cache_fold_auto.py). `fold_kv_cache_writes` is the entry point; each outcome is one `KvFold`. The fold
is the registry's record `KV_CACHE_WRITE` (passes/folds/fold_registry.py): its epilogue runs after every group is
committed, and the pass reports its outcomes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any

import torch
from torch import fx

from ...ops.op_definition import OPS
from ...ops.schema import optional_tensor_names
from ..analysis.provenance import source_line
from .fold_registry import (
    VIEW_OPS,
    Fold,
    Folded,
    FoldOutcome,
    FoldSite,
    NotFolded,
    producer,
    register_fold,
    strip_views,
)
from .kv_cache_fold_auto import decide

_ARITY = 4 + len(optional_tensor_names(2))  # q, k, cos, sin and the optional tensors of rotary_qk


@dataclasses.dataclass
class KvFold:
    """One cache update next to a fused rotation: folded (`node`: the new op) or not, and why."""

    rotation: Any  # the node behind the update's k (a fused rotary_qk node, erased when folded)
    update: str  # the cache update's node name
    layer: str  # the layer name, or the graph input that holds it
    folded: bool
    why: str
    node: fx.Node | None = None


def cache_update_op() -> Any:
    """vLLM's cache-update op where vLLM registered it, else None (vLLM is never imported here)."""
    namespace = getattr(torch.ops, "vllm", None)
    packet = getattr(namespace, "unified_kv_cache_update", None) if namespace is not None else None
    return getattr(packet, "default", None) if packet is not None else None


def _source_rotation(node: Any) -> tuple[fx.Node, fx.Node] | None:
    """(the rotary_qk node, its k getitem) where `node` is that k output or a view of it, else None."""
    got = strip_views(node)
    if not (isinstance(got, fx.Node) and got.target is operator.getitem and got.args[1] == 1):
        return None
    op = got.args[0]
    return (op, got) if isinstance(op, fx.Node) and op.target is OPS[1] else None


def _rotation_of(k_arg: Any) -> tuple[fx.Node, fx.Node] | None:
    """`_source_rotation` where `k_arg` has the rotation's shape (the op takes k as the rotation read it)."""
    found = _source_rotation(k_arg)
    if found is None or tuple(k_arg.meta["val"].shape) != tuple(found[1].meta["val"].shape):
        return None
    return found


def _layer_type(layer: Any) -> str | None:
    """The schema type of the layer-name argument: `str`, or the opaque type vLLM hoists it as."""
    value = layer.meta.get("val") if isinstance(layer, fx.Node) else layer
    value = getattr(value, "real_obj", value)  # a graph input of an opaque type: its FakeScriptObject's object
    if isinstance(value, str):
        return "str"
    from torch._library.opaque_object import get_opaque_type_name, is_opaque_type

    return get_opaque_type_name(type(value)) if value is not None and is_opaque_type(type(value)) else None


def _needs_k(k_get: fx.Node, update: fx.Node) -> bool:
    """Whether anything but the update (directly or through views only it reads) reads k rotated."""
    def only_update(n: fx.Node) -> bool:
        return n is update or (n.target in VIEW_OPS and all(only_update(u) for u in n.users))
    return not all(only_update(u) for u in k_get.users)


def _why_not(update: fx.Node, order: dict) -> str | tuple:
    """Why this update is not folded, or (rotation, k getitem, v, layer type)."""
    k_arg, v, layer = update.args[:3]
    found = _rotation_of(k_arg)
    if found is None:
        return "k is not the k output of a rotation the pass fused"
    if not isinstance(v, fx.Node) or v.meta["val"].dim() != 3:
        return "v is not a [tokens, heads, head_dim] tensor"
    layer_type = _layer_type(layer)
    if layer_type is None:
        return f"the layer name {layer!r} is neither a str nor vLLM's LayerName"
    if isinstance(layer, fx.Node) and order[layer] > order[found[0]] and layer.op != "placeholder":
        return "the layer name is computed after the rotation"
    return (*found, v, layer_type)


def _fold(graph: fx.Graph, update: fx.Node, rotation: fx.Node, k_get: fx.Node, v: fx.Node, layer_type: str) -> fx.Node:
    """The op in place of the rotation and the update; returns the new node."""
    from ...ops.layer_cache_op import layer_cache_op

    op = layer_cache_op(layer_type)
    args = list(rotation.args) + [None] * (_ARITY - len(rotation.args))
    need_k = _needs_k(k_get, update)
    with graph.inserting_before(rotation):
        node = graph.call_function(op, (args[0], args[1], v, *args[2:]),
                                   {**rotation.kwargs, "layer_name": update.args[2], "need_k": need_k})
        outs = [graph.call_function(operator.getitem, (node, i)) for i in range(3)]
    node.meta.update({key: rotation.meta[key] for key in ("stack_trace", "source_fn_stack") if key in rotation.meta})
    node.meta["val"] = _fake_val(op, node)
    for i, o in enumerate(outs):
        o.meta["val"] = node.meta["val"][i]
    update.replace_all_uses_with(outs[2])
    graph.erase_node(update)
    for user in list(rotation.users):
        user.replace_all_uses_with(outs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(rotation)
    return node


def _fake_val(op: Any, node: fx.Node) -> tuple:
    """The new node's fake results, from the op's fake kernel on the arguments' fake values."""
    def val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a
    args = fx.node.map_arg(node.args, val)
    kwargs = fx.node.map_arg(node.kwargs, val)
    fake_mode = torch._guards.detect_fake_mode([a for a in args if isinstance(a, torch.Tensor)])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return op(*args, **kwargs)


def fold_kv_cache_writes(graph: fx.Graph, backend: str) -> list[KvFold]:
    """Fold every cache update the pass's fused rotations feed, as `backend` ("auto": by the token bound) decides;
    one `KvFold` per cache update whose k comes from a fused rotation, and per other update with why not."""
    update_op = cache_update_op()
    if update_op is None:
        return []
    updates = [n for n in graph.nodes if n.op == "call_function" and n.target is update_op]
    if not updates:
        return []
    order = {n: i for i, n in enumerate(graph.nodes)}
    outcomes = []
    for update in updates:
        found = _why_not(update, order)
        layer = str(update.args[2].name if isinstance(update.args[2], fx.Node) else update.args[2])
        if isinstance(found, str):
            outcomes.append(KvFold(producer(update.args[0]), update.name, layer, False, found))
            continue
        rotation, k_get, v, layer_type = found
        fold, why = decide(backend, rotation.args[0].meta["val"].shape[0])
        outcome = KvFold(rotation, update.name, layer, fold, why)
        if fold:
            outcome.node = _fold(graph, update, rotation, k_get, v, layer_type)
        outcomes.append(outcome)
    if any(o.folded for o in outcomes):
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
    return outcomes


def _epilogue(graph: fx.Graph, backend: str) -> list[FoldOutcome]:
    """The fold's outcomes as the registry reports them: a folded update names the new op."""
    updates = {n.name: n for n in graph.nodes}
    outcomes = []
    for o in fold_kv_cache_writes(graph, backend):
        line = f"kv-cache write of {o.layer}: " + ("folded" if o.folded else "not folded") + f" ({o.why})"
        where = updates.get(o.update)
        outcomes.append(FoldOutcome(o.rotation, o.update, o.layer, line,
                                    "rope_fusion.rotary_qk_into_layer_cache" if o.folded else None,
                                    source_line(where) if where is not None else ""))
    return outcomes


def _cache_update_of(k: fx.Node) -> fx.Node | None:
    """The cache update whose k is `k` or a view of it, where vLLM registered the op."""
    update_op = cache_update_op()
    if update_op is None:
        return None
    frontier = [k]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target is update_op and user.args[0] is node:
                return user
            if user.target in VIEW_OPS:
                frontier.append(user)
    return None


def _find(site: FoldSite) -> Any:
    """A q/k pair whose k feeds a cache update: the update, where the token bound folds it (else why not)."""
    if len(site.group) != 2:
        return None
    update = _cache_update_of(site.group[1].node)
    if update is None:
        return None
    fold, why = decide(site.requested, site.xs[0].meta["val"].shape[0])
    return update if fold else NotFolded(NAME, why)


def _emit(em: Any, site: FoldSite, update: fx.Node) -> Folded:
    """The pair as the op call (not the backend's own node), which the epilogue folds with the update; the
    kernel's fold line is the epilogue's."""
    from ...ops.backends import emit_op_call
    from ..emission import unflatten

    outs = emit_op_call(OPS, em, site.call, site.like)
    return Folded([unflatten(em, o, m) for o, m in zip(outs, site.group)], [m.node for m in site.group], "")


NAME = "kv-cache write"
KV_CACHE_WRITE = Fold(NAME, _find, _emit, epilogue=_epilogue)
register_fold(KV_CACHE_WRITE)
