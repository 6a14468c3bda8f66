"""The walk over a post-grad graph for rotary kernels and ops already in it (kernel_sites.py says what a site is).

Importing this module imports every recogniser module, which registers itself with `@kernel_site`; the walk asks
each registered recogniser about each call, in registration order, and the first that claims a call decides it.
A new kind is one more module in `_RECOGNISER_MODULES`.
"""

from __future__ import annotations

import itertools

import torch.fx

from . import flash_attn_sites, vllm_op_sites  # noqa: F401  (each registers its recognisers)
from .kernel_sites import RECOGNISERS, KernelMiss, KernelSite

_RECOGNISER_MODULES = (flash_attn_sites, vllm_op_sites)


def find_kernel_sites(graph: torch.fx.Graph) -> tuple[list[KernelSite], list[tuple[torch.fx.Node, str]]]:
    """(sites, misses): every rotated tensor of a recognised rotary kernel/op, and every call that looks like
    one (by kernel/op name) but cannot be expressed exactly, with the reason. The graph is not modified."""
    sites: list[KernelSite] = []
    misses: list[tuple[torch.fx.Node, str]] = []
    groups = itertools.count()

    def new_group() -> int:
        return next(groups)

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for rec in RECOGNISERS:
            try:
                found = rec.recognise(node, new_group)
            except KernelMiss as e:
                misses.append((node, str(e)))
                break
            except Exception as e:  # a graph the recogniser does not understand: leave it alone, say why
                misses.append((node, f"could not analyse this call ({type(e).__name__}: {e}); left alone"))
                break
            if found is not None:
                sites.extend(found)
                break
    return sites, misses
