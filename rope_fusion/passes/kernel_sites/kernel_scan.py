"""The walk over a post-grad graph for rotary kernels and ops already in it (kernel_sites.py says what they share).

Importing this module imports every recogniser module, which registers itself with `@kernel_site`; the walk asks
each registered recogniser about each call, in registration order, and the first that claims a call decides it.
A new kind is one more module in `RECOGNISER_MODULES`, with its recogniser and its `KernelTables` record.

What happens to a kernel whose sites are fused: the pass replaces every use of the result node
(`getitem(launch, "OUT")`, `getitem(auto_functionalized, i)`) and then runs dead-code elimination; neither
`triton_kernel_wrapper_functional` nor `auto_functionalized` is impure for torch.fx (is_impure: a HOP is impure
only through a registered effect, an auto_functionalized op only when the op is in _side_effectful_functions), so
the launch and the op call die with their last getitem. In-place forms are functional at this point: writing the
result back into a graph input is `aten.copy_(input, result)`, a use of the result, which then reads the fused
value. What else would keep a kernel alive is the kind's to undo (`KernelTables.claimed`).
"""

from __future__ import annotations

import torch.fx

from ..analysis.site import Site
from . import flash_attn_sites, vllm_op_sites
from .kernel_sites import RECOGNISERS, KernelMiss

RECOGNISER_MODULES = (flash_attn_sites, vllm_op_sites)  # each registers its recognisers when imported


def find_kernel_sites(graph: torch.fx.Graph) -> tuple[list[Site], list[tuple[torch.fx.Node, str]]]:
    """(sites, misses): every rotated tensor of a recognised rotary kernel/op in graph order, and every call that
    looks like one (by kernel/op name) but cannot be expressed exactly, with the reason. The graph is not
    modified."""
    sites: list[Site] = []
    misses: list[tuple[torch.fx.Node, str]] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for rec in RECOGNISERS:
            try:
                found = rec.recognise(node)
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


def claim_kernel_sites(graph: torch.fx.Graph) -> tuple[list[Site], list[tuple[torch.fx.Node, str]]]:
    """`find_kernel_sites`, and each site's kind makes the edit that lets its kernel die once the site's result is
    replaced (values unchanged; the pass calls this inside its transaction, so a failure later restores it too)."""
    sites, misses = find_kernel_sites(graph)
    for site in sites:
        site.tables.claimed(site)
    return sites, misses
