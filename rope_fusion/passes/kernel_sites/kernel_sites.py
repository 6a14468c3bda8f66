"""Rotary kernels and ops already in post-grad graphs, as sites of the fused op: what every kind shares.

`kernel_scan.find_kernel_sites(graph)` returns one `site.Site` per rotated tensor that a recognised rotary kernel
or op computes, and, separately, the calls that look like such kernels/ops but cannot be expressed exactly, each
with a reason. The fused op's semantics are `rope_fusion.ops.reference.rotary_reference`: pairs (a_j, b_j), NeoX
(j, j+R/2) or interleaved (2j, 2j+1), out[a] = x[a]C - x[b]S, out[b] = x[b]C + x[a]S, S negated when conjugate,
out[d] = x[d] for d outside the rotated lanes; with half-width tables (full_tables=False) C = cos[j]; math in
fp32. Every kind maps onto that with full_tables=False, and builds its tables itself: a `site.KernelTables` record
of its own, which emits the op's table arguments when the site's group is planned.

What is recognised, each kind in its own module with its exact semantics and what is verified before a site is
claimed:
- flash_attn_sites.py: flash-attn's Triton `rotary_kernel` (kind "flash_attn.rotary_kernel"), from upstream
  flash-attn and vLLM's copy `vllm.vllm_flash_attn` (vLLM's ApplyRotaryEmb custom op, vllm-omni's RotaryEmbedding
  layers), one launch per rotated tensor, seen as `triton_kernel_wrapper_functional`;
- vllm_op_sites.py: vLLM's CUDA op `torch.ops._C.rotary_embedding` (kind "vllm._C.rotary_embedding") and its
  flashinfer op `torch.ops.vllm.flashinfer_rotary_embedding` (kind "vllm.flashinfer_rotary_embedding"), in place on
  query and key, seen as `auto_functionalized` / `auto_functionalized_v2`.
Anything else whose name says rotary/rope (another Triton kernel such as vLLM's `_packed_qk_rope_kernel`, custom
ops such as `vllm::rocm_aiter_triton_rotary_embedding`, `vllm::xpu_apply_rotary_emb`, `vllm::mrope`; not the
`rope_fusion`, `aten` and `prims` namespaces) is reported, never claimed: its semantics have not been checked here.

This module holds `kernel_site_of` (a kind's rotated tensor as a `Site`), the small graph helpers the kinds share,
and the registry that each kind's module adds its recogniser to with `@kernel_site(kind)`; graph_values.py holds
the checks on graph values (sizes may be symbolic: a check passes only when it holds for every value of the
symbols, and adds no guard). kernel_scan.py imports the kinds' modules and walks the graph. Nothing here imports a
kind's module.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ...ops.schema import RotaryParams
from ..analysis.site import KernelTables, Site, XView
from .graph_values import KernelMiss

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)
LOOKS_ROTARY = re.compile(r"rotary|(?<!p)rope", re.I)  # apply_rope, mrope, rotary_kernel, RoPE; not "property"


def getitems(node: torch.fx.Node, key: Any) -> list[torch.fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == key]


def is_call(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def check_before(node: torch.fx.Node, new: torch.fx.Node) -> None:
    """The op's nodes go where emission placed the group, after every node it reads (`KernelTables.row_inputs`);
    a guard: should that ever not hold, the group stays unfused with this reason."""
    n = new.prev
    while n.op != "root":
        if n is node:
            return
        n = n.prev
    raise RuntimeError(f"{node.name} (positions into the rotary tables) is computed after the place of the fused "
                       f"launch (after its x's and tables)")


def kernel_site_of(node: torch.fx.Node, x: torch.fx.Node, head_dim: int, tables: KernelTables, *,
                   interleaved: bool, rotary_dim: int, conjugate: bool, rotary_offset: int = 0,
                   flat_heads: bool = False) -> Site:
    """The site of one tensor that a kernel rotates: `node` is its result, `x` its input as the graph holds it
    (`flat_heads`: [..., H*D], the heads split out of the last dim as the op's blocks), the kernel's options in
    the op's terms, its result's dtype the op's out_dtype."""
    blocks: tuple = ()
    if flat_heads:
        heads = x.meta["val"].shape[-1] // head_dim
        if not isinstance(heads, int):
            raise KernelMiss(f"x's hidden size {x.meta['val'].shape[-1]} is symbolic; the heads cannot be split out")
        blocks = (heads,)
    params = RotaryParams(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=False, conjugate=conjugate,
                          out_dtype=node.meta["val"].dtype, rotary_offset=rotary_offset)
    return Site(node=node, value_k=1, x=XView(x.name, head_dim, blocks=blocks), params=params, tables=tables)


# the registry of recognisers

Recognise = Callable[[torch.fx.Node], "list[Site] | None"]


@dataclasses.dataclass(frozen=True)
class KernelRecogniser:
    """One kind of rotary kernel or op already in the graph. `recognise(node)` returns None when the node is not
    this kind, its sites (possibly none: a result nobody uses) when it is, and raises KernelMiss with the reason
    when the node is this kind (or looks like it) but cannot be expressed exactly."""

    kind: str
    recognise: Recognise


RECOGNISERS: list[KernelRecogniser] = []


def kernel_site(kind: str) -> Callable[[Recognise], Recognise]:
    """Register a recogniser, as `@lane_rule` registers a transfer rule: a new kind of rotary kernel in the graph
    is one module with one decorated function, which kernel_scan.py imports. Registration order is the order
    they are asked in."""
    def register(fn: Recognise) -> Recognise:
        if any(r.kind == kind for r in RECOGNISERS):
            raise ValueError(f"a recogniser for {kind!r} is registered already")
        RECOGNISERS.append(KernelRecogniser(kind, fn))
        return fn
    return register
