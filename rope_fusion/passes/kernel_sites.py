"""Opaque rotary kernels and ops in post-grad graphs, described in the fused op's terms (recognition only).

`kernel_scan.find_kernel_sites(graph)` returns one `KernelSite` per rotated tensor that an opaque rotary kernel
or op computes, and, separately, the calls that look like such kernels/ops but cannot be expressed exactly, each
with a reason. Nothing here edits the graph. The fused op's semantics are `rope_fusion.ops.reference.rotary_reference`:
pairs (a_j, b_j), NeoX (j, j+R/2) or interleaved (2j, 2j+1), out[a] = x[a]C - x[b]S, out[b] = x[b]C + x[a]S,
S negated when conjugate, out[d] = x[d] for d >= R; with half-width tables (full_tables=False) C = cos[j];
math in fp32. Every site maps onto that with full_tables=False.

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

This module holds `KernelSite`, the checks on graph values that every kind uses (sizes may be symbolic: a check
passes only when it holds for every value of the symbols, and adds no guard), and the registry that each kind's
module adds its recogniser to with `@kernel_site(kind)`. kernel_scan.py imports those modules and walks the
graph; kernel_rewrite.py turns the sites into sites of the fused op. Nothing here imports a kind's module.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)
LOOKS_ROTARY = re.compile(r"rotary|(?<!p)rope", re.I)  # apply_rope, mrope, rotary_kernel, RoPE; not "property"


@dataclasses.dataclass(frozen=True)
class KernelSite:
    """One rotated tensor computed by an opaque rotary kernel/op node, in the fused op's terms.

    Tables, per kind (full_tables=False for all): flash-attn: `cos`/`sin` [seqlen_ro, R/2], row s + seqlen_offset
    for sequence position s (see `flash_attn_sites.flash_attn_tables`); vLLM ops: `cos_sin_cache`[positions] split
    into the cos half [..., :R/2] and the sin half [..., R/2:], one row per token, broadcast over heads. The
    result's dtype is `node.meta["val"].dtype`.
    """
    kind: str  # "flash_attn.rotary_kernel" | "vllm._C.rotary_embedding" | "vllm.flashinfer_rotary_embedding"
    node: torch.fx.Node       # the node whose value is the rotated tensor (uses of it get replaced)
    x: torch.fx.Node          # the tensor the kernel rotates, as the graph holds it
    # "bshd" (x [B,S,H,D]), "thd" (x [T,H,D]), "t(hd)" (flat [T, H*D], head_dim = head_size),
    # "bs(hd)" (flat [B, S, H*D], vLLM's _C op with [B, S] positions)
    layout: str
    head_dim: int
    rotary_dim: int
    interleaved: bool
    conjugate: bool
    cos: torch.fx.Node | None            # flash-attn: [seqlen_ro, rotary_dim/2]
    sin: torch.fx.Node | None
    seqlen_offset: int | torch.fx.Node   # flash-attn SEQLEN_OFFSETS: int, or a [B] int tensor node; 0 for vLLM ops
    cu_seqlens: torch.fx.Node | None     # varlen (never claimed today: varlen launches are reported)
    max_seqlen: int | None
    cos_sin_cache: torch.fx.Node | None  # vLLM ops: [max_pos, rotary_dim] cos half then sin half
    positions: torch.fx.Node | None      # vLLM ops: [T] (or [B,S]) token positions into the cache
    # sites produced by ONE node (vLLM's in-place q+k op) share a group id; else unique
    group: int
    tail_from_x: bool                    # lanes >= rotary_dim of the result equal x's (verified from the graph)
    rotary_offset: int = 0               # vLLM's rope_dim_offset: lanes [offset, offset + R) rotate, the rest copied


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


# the registry of recognisers

Recognise = Callable[[torch.fx.Node, Callable[[], int]], "list[KernelSite] | None"]


@dataclasses.dataclass(frozen=True)
class KernelRecogniser:
    """One kind of rotary kernel or op already in the graph. `recognise(node, new_group)` returns None when the
    node is not this kind, its sites (possibly none: a result nobody uses) when it is, and raises KernelMiss
    with the reason when the node is this kind (or looks like it) but cannot be expressed exactly. `new_group()`
    hands out the group id that the sites of one node share."""

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
