"""Per-call host-to-device copies of RoPE tables, replaced by a cached copy (ops/host_tables.py says why).

Only copies that feed the tables of a fused site are touched, and only when what is copied is a graph
input or constant living on the host: such a tensor is the model's own table (or what it is built from),
and the cached op gives the same values for as long as that tensor is unchanged. Copies of anything
computed inside the graph stay as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ops import host_tables  # noqa: F401  (defines the op)
from .analysis.grouping import fake_mode_of

aten = torch.ops.aten
prims = torch.ops.prims


def _copied_device(node: fx.Node) -> torch.device | None:
    """The target device if `node` only moves a tensor to another device (no dtype or layout change)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is prims.device_put.default:
        dev = node.args[1] if len(node.args) > 1 else node.kwargs.get("device")
    elif node.target is aten._to_copy.default:
        kw = node.kwargs
        src = node.args[0].meta.get("val")
        if src is None or kw.get("dtype") not in (None, src.dtype) or kw.get("layout") not in (None, torch.strided):
            return None
        if kw.get("memory_format") not in (None, torch.preserve_format):
            return None
        dev = kw.get("device")
    else:
        return None
    return torch.device(dev) if dev is not None else None


def _is_host_input(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return node.op in ("placeholder", "get_attr") and isinstance(val, torch.Tensor) and val.device.type == "cpu"


def cache_host_tables(graph: fx.Graph, tables: list) -> list[str]:
    """Replace the host-to-device copies of graph inputs that the given table nodes depend on; returns the
    names of the inputs whose copies are now cached."""
    seen: set = set()
    stack = [t for t in tables if isinstance(t, fx.Node)]
    copies = []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        dev = _copied_device(n)
        if dev is not None and dev.type != "cpu" and _is_host_input(n.args[0]):
            copies.append((n, dev))
            continue
        stack.extend(n.all_input_nodes)
    cached = []
    op = torch.ops.rope_fusion.host_table_to_device.default
    for n, dev in copies:
        src = n.args[0]
        old = n.meta.get("val")
        with graph.inserting_before(n):
            new = graph.call_function(op, (src, dev))
        new.meta.update(n.meta)
        with fake_mode_of(src.meta["val"]):
            fake = op(src.meta["val"], dev)
        if old is not None and (tuple(fake.shape) != tuple(old.shape) or fake.stride() != old.stride()
                                or fake.dtype != old.dtype):
            graph.erase_node(new)  # the copy's layout differs from what the graph expects: leave it
            continue
        new.meta["val"] = fake
        n.replace_all_uses_with(new)  # the old copy is dead now; the pass's dead-code elimination drops it
        cached.append(src.name)
    return cached

