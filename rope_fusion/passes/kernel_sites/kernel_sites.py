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

This module holds the checks on graph values that every kind uses (sizes may be symbolic: a check passes only when
it holds for every value of the symbols, and adds no guard), `kernel_site_of` (a kind's rotated tensor as a
`Site`), and the registry that each kind's module adds its recogniser to with `@kernel_site(kind)`. kernel_scan.py
imports those modules and walks the graph. Nothing here imports a kind's module.
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

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)
LOOKS_ROTARY = re.compile(r"rotary|(?<!p)rope", re.I)  # apply_rope, mrope, rotary_kernel, RoPE; not "property"


class KernelMiss(Exception):
    """Raised inside an analysis with the reason a call cannot be expressed (reported as a near miss)."""


# small helpers on graph values

def value_of(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def tensor_of(a: Any, what: str) -> torch.Tensor:
    v = value_of(a)
    if not isinstance(v, torch.Tensor):
        raise KernelMiss(f"{what} has no tensor metadata in the graph")
    return v


def known(cond: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(cond, bool):
        return cond
    try:
        return bool(statically_known_true(cond))
    except Exception:
        return False


def eq(a: Any, b: Any) -> bool:
    a, b = value_of(a), value_of(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return known(a == b)
    return False


def may_eq(a: Any, b: Any) -> bool:
    """Not provably different (symbolic sizes that the op itself checks at run time)."""
    a, b = value_of(a), value_of(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return not known(a != b)
    return False


def ge(a: Any, b: Any) -> bool:
    a, b = value_of(a), value_of(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return known(a >= b)
    return False


def static_int(a: Any, what: str) -> int:
    v = value_of(a)
    if isinstance(v, bool):
        raise KernelMiss(f"{what} is a bool, expected an int")
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        c = v.node.maybe_as_int()
        if c is not None:
            return int(c)
        raise KernelMiss(f"{what} is symbolic ({v}); the fused op needs it static (mark that dim static)")
    raise KernelMiss(f"{what} is not an int ({v!r})")


def static_bool(a: Any, what: str) -> bool:
    v = value_of(a)
    if isinstance(v, bool):
        return v
    raise KernelMiss(f"{what} is not a constant bool ({v!r})")


def contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguous, provably (size-1 dims excepted), without adding guards on symbolic sizes."""
    expected: Any = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if not (known(size == 1) or known(stride == expected)):
            return False
        expected = expected * size
    return True


def contiguous_rows(t: torch.Tensor) -> bool:
    """2-D with row stride = row length and unit column stride (size-1 dims excepted)."""
    return t.dim() == 2 and contiguous(t)


def getitems(node: torch.fx.Node, key: Any) -> list[torch.fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == key]


def is_call(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def size_key(size: Any) -> Any:
    """An int, or the expression of a symbolic size (equal expressions: provably equal sizes)."""
    if isinstance(size, torch.SymInt):
        c = size.node.maybe_as_int()
        return int(c) if c is not None else ("sym", str(size.node.expr))
    return int(size)


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
