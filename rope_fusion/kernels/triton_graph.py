"""Emit the Triton rotary kernel into a post-grad graph as Inductor's own user-kernel node.

Our pass runs after AOT tracing, so a plain call of `rope_fusion::rotary_qk_triton` stays an opaque op
(Inductor's fallback kernel) whose every call pays the Python
dispatcher and host planning (~0.1 ms on the H200, BENCHMARKS.md). Here the host side (`launch`) is traced
with make_fx on the node's fake values, and each traced `triton_kernel_wrapper_mutation` is turned into the
functional `triton_kernel_wrapper_functional` that Inductor's later post-grad passes expect: Inductor then
reinplaces it into the fresh output buffers and launches the kernel from its generated code.

The node records its inputs' fake values as `eager_input_vals`: the launch was planned for exactly those
strides (they are constants of the call), and only with eager values does Inductor require exact strides
of a user kernel's inputs; without them it keeps just their stride order, free to hand the kernel a
re-laid-out copy (a dense copy of a strided view, say) whose strides the kernel would misread.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._higher_order_ops.triton_kernel_wrap import (
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)

from ..ops.schema import RotaryCall
from .triton_rotary import launch

_OUT_ARGS = ("qo_ptr", "ko_ptr")


def _concrete(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*t.shape, *t.stride()))


def emit_triton(graph: fx.Graph, fake_mode: Any, call: RotaryCall, like: fx.Node) -> list | None:
    """Nodes computing the rotated xs (inserted at the graph's current insertion point), or None when the
    site has symbolic sizes (the caller then emits the op call)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    xs = call.xs
    inputs = [t for t in call.tensors() if t is not None]
    slots = [i for i, t in enumerate(call.tensors()) if t is not None]  # where each input goes in the call
    vals = [a.meta["val"] for a in inputs]
    if not all(_concrete(v) for v in vals):
        return None
    n = len(xs)

    def fn(*args):
        full = [None] * len(call.tensors())
        for slot, a in zip(slots, args):
            full[slot] = a
        c = RotaryCall.parse(full, call.params.kwargs(), n)
        return tuple(launch(c.xs, c.cos, c.sin, c.params, c.positions, c.norm_weights))

    with fake_mode, enable_python_dispatcher():
        gm = make_fx(fn, tracing_mode="real")(*vals)

    env: dict = {}
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    for p, a in zip(placeholders, inputs):
        env[p] = a

    def arg(a):
        return env[a] if isinstance(a, fx.Node) else a

    def val(a):
        if isinstance(a, fx.Node):
            return a.meta["val"]
        if isinstance(a, dict):
            return {k: val(v) for k, v in a.items()}
        if isinstance(a, (list, tuple)):
            return type(a)(val(v) for v in a)
        return a

    outs = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outs = [env[o] for o in node.args[0]]
            break
        if node.op != "call_function":
            return None
        if node.target is triton_kernel_wrapper_mutation:
            kw = dict(node.kwargs)
            kwargs = {k: arg(v) for k, v in kw["kwargs"].items()}
            written = []
            for name in _OUT_ARGS:
                buf = kwargs.get(name)
                if isinstance(buf, fx.Node) and buf not in [kwargs[w] for w in written]:
                    written.append(name)
            fkw = dict(kernel_idx=kw["kernel_idx"], constant_args_idx=kw["constant_args_idx"], grid=kw["grid"],
                       tma_descriptor_metadata=kw["tma_descriptor_metadata"], kwargs=kwargs,
                       tensors_to_clone=written)
            func = graph.call_function(triton_kernel_wrapper_functional, (), fkw)
            with fake_mode:
                func.meta["val"] = triton_kernel_wrapper_functional(**val(fkw))
            # The strides traced into the launch are constants of the kernel call, so Inductor must hand it
            # tensors with exactly these strides; with no eager values it only keeps their stride order.
            func.meta["eager_input_vals"] = ((), fx.node.map_arg(func.kwargs, lambda a: a.meta["val"]))
            _copy_meta(func, like)
            # later reads of a written buffer read the kernel's result instead
            old = {n2: name for n2, name in ((node.kwargs["kwargs"][w], w) for w in written)}
            for src, name in old.items():
                got = graph.call_function(operator.getitem, (func, name))
                got.meta["val"] = func.meta["val"][name]
                _copy_meta(got, like)
                env[src] = got
            continue
        new = graph.node_copy(node, arg)
        _copy_meta(new, like)
        env[node] = new
    return outs


def _copy_meta(node: fx.Node, like: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
