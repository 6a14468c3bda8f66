"""The site's own region, as `auto` times it "left" (passes/auto/auto_timing.py): the nodes that compute the outputs the
op would replace, back to what is in memory whatever reads it (graph inputs and constants, matmul and convolution
outputs, ops that are not ATen's or that mutate or draw random numbers). Everything between, the QK-norm and the
table math included, is what plain Inductor fuses into the rotation, so it is in the region; the same extraction
from the op's inputs gives what the fused candidates compute before the op.

A region is copied into a standalone graph (a placeholder per input, their fake values kept), and `canonical`
writes its computation with nodes numbered by position, so the same site in every layer of a model has one
signature.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

MAX_REGION_NODES = 256  # a region larger than this is not extracted (the table decides)

aten = torch.ops.aten
# Producers whose output is in memory whatever consumes it: where a region starts. Attention kernels too, forward
# and backward (a library call each): a backward graph's rotation reads the gradient that attention's backward
# wrote, and a region walked back through it took in the whole attention.
_ATTENTION_KERNELS = tuple(getattr(aten, f"{name}{suffix}").default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention", "_efficient_attention")
    for suffix in ("", "_forward", "_backward") if hasattr(aten, f"{name}{suffix}"))
_MATERIALISED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                 aten.convolution.default, aten._scaled_mm.default, aten._int_mm.default, *_ATTENTION_KERNELS}


class NotMeasured(Exception):
    """Why a site could not be measured: the factor table decides, and the report says this."""


def starts_region(n: fx.Node) -> bool:
    """Whether n is in memory whatever reads it: an input of the extracted region, not part of it."""
    if n.op != "call_function":
        return True
    target = n.target
    if target is operator.getitem:
        return starts_region(n.args[0])
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return True
    if target in _MATERIALISED or target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return True
    return False


def _static(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return all(type(d) is int for d in (*val.shape, *val.stride())) and type(val.storage_offset()) is int
    return not isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def walk_region(outputs: list, is_input: Callable[[fx.Node], bool], limit: int,
                too_large: Callable[[], Exception]) -> tuple[list, list]:
    """(body, inputs): the nodes computing `outputs` back to those `is_input` takes as given, the body in
    topological order and the inputs in the order first met; `too_large()` is raised past `limit` nodes met. The one
    walk behind every region (this module's, and fusion_check's, which keeps its own nodes in the body)."""
    body: list = []
    inputs: list = []
    seen: set = set()
    for out in outputs:
        stack = [(out, False)]
        while stack:
            n, done = stack.pop()
            if done:
                body.append(n)
                continue
            if n in seen:
                continue
            given = is_input(n)
            seen.add(n)
            if given:
                inputs.append(n)
                continue
            if len(seen) > limit:
                raise too_large()
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.all_input_nodes) if a not in seen)
    return body, inputs


def region(outputs: list, stop: frozenset = frozenset()) -> tuple[list, list]:
    """(body, inputs): the nodes computing `outputs` from what is in memory anyway (and from `stop`, taken as
    given), in topological order, and those inputs in the order first met. Raises NotMeasured for a region too
    large or with symbolic sizes."""

    def is_input(n: fx.Node) -> bool:
        if not _static(n.meta.get("val")):
            raise NotMeasured(f"{n.name} has a symbolic size")
        return n in stop or starts_region(n)

    return walk_region(outputs, is_input, MAX_REGION_NODES,
                       lambda: NotMeasured(f"the site's region is over {MAX_REGION_NODES} nodes"))


def copy_region(body: list, inputs: list) -> tuple[fx.Graph, dict]:
    """A new graph with a placeholder per input and a copy of every body node (meta, fake values included)."""
    g = fx.Graph()
    env: dict = {}
    for i, n in enumerate(inputs):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = n.meta.get("val")
        env[n] = p
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    return g, env


def canonical(g: fx.Graph) -> str:
    """The graph's computation with nodes numbered by position (not by name), the inputs' geometry included:
    the same region in every layer of a model reads alike."""
    index: dict = {}
    lines = []

    def arg(a: Any) -> Any:
        return f"%{index[a]}" if isinstance(a, fx.Node) else a

    for i, n in enumerate(g.nodes):
        index[n] = i
        val = n.meta.get("val")
        geometry = ""
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            geometry = f"{tuple(val.shape)}/{tuple(val.stride())}+{val.storage_offset()}/{val.dtype}/{val.device.type}"
        lines.append(f"{n.op} {getattr(n.target, '__name__', n.target) if n.op != 'placeholder' else ''} "
                     f"{fx.node.map_aggregate(n.args, arg)} {fx.node.map_aggregate(n.kwargs, arg)} {geometry}")
    return "\n".join(lines)


__all__ = ["MAX_REGION_NODES", "NotMeasured", "canonical", "copy_region", "region", "starts_region"]
