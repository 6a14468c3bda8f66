"""Rotary kernels already in the graph as sites of the fused op (issue: flash-attn and vLLM rotary ops).

`find_kernel_matches(graph)` turns the `KernelSite`s that kernel_sites.py recognises into `Match`es that the
grouping and emission of the pass take like any other site: x, the options, the node to replace, and a
`tables` builder that gives the op's tables (and positions) for the site.
"""

from __future__ import annotations

import torch.fx as fx


def find_kernel_matches(graph: fx.Graph) -> tuple[list, list]:
    """(matches, near misses) for the rotary kernels and ops in `graph`; empty until the conversion exists."""
    return [], []
