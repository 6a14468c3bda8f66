"""vLLM's in-place rotary ops as sites of the fused op: `_C.rotary_embedding` and the flashinfer op.

See kernel_sites.py for what every kind shares; this module identifies the ops, checks each call and says which
rows of the cache they read (`CacheTables`).

1. vLLM's CUDA op `torch.ops._C.rotary_embedding` (kind "vllm._C.rotary_embedding"), in place on query and key,
seen as `auto_functionalized` (vLLM's default: it sets enable_auto_functionalized_v2=False in
vllm/config/compilation.py) or `auto_functionalized_v2`.
Identification: the op's qualified name is `{VLLM_C_NAMESPACE}::rotary_embedding` (VLLM_C_NAMESPACE = "_C";
tests set it to a namespace holding a stand-in, the real extension only loads with a CUDA torch) and its schema
is, argument by argument, one of
  rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache,
                   bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()      (vLLM 0.33, read from
  the schema string in vllm/_C_stable_libtorch.abi3.so and vllm/_custom_ops.py `rotary_embedding`), or the same
  without rope_dim_offset/inverse (older vLLM).
Semantics (csrc/pos_encoding_kernels.cu of vLLM, the kernel of that schema; vllm/model_executor/layers/
rotary_embedding/base.py `RotaryEmbedding.forward_static` is the same math in PyTorch): R = cos_sin_cache.size(1)
([max_pos, R], cos half then sin half, read contiguously), for token t with p = positions.flatten()[t]:
cos = cache[p, :R/2], sin = cache[p, R/2:]; NeoX pairs (j, j+R/2) when is_neox else (2j, 2j+1), within lanes
[rope_dim_offset, rope_dim_offset+R) of every head of query and of key (key may be None); sin negated when
inverse; fp32 math, cast to query's dtype; other lanes untouched. The kernel addresses element (t, h, d) at
t*stride_token + h*head_stride + d, with stride_token = x.stride(positions.dim()-1), head_stride =
query.stride(-2) when query has a head dim, else head_size, and THE SAME head_stride for key; positions are
read as contiguous int64. Verified before a site is claimed: R even, 0 < R <= head_size, rope_dim_offset + R <=
head_size (the op's rotary_offset); cache 2-D contiguous, fp16/bf16/fp32; query and key
fp16/bf16/fp32; positions int64 contiguous, 1-D with x [T, H*D] (layout "t(hd)") or [T, H, D] ("thd"), or 2-D
[B, S] with x [B, S, H*D] ("bs(hd)") or
[B, S, H, D] ("bshd"); x's token dims not provably different from positions' (the op checks them, so a
symbolic token count is fine); the address formula above equals x's real layout (last stride
1, head stride as the kernel assumes, batch stride S*token stride); the hidden size a multiple of head_size;
query's head count a multiple of key's (the op raises otherwise).
Sites: one per rotated tensor, node = the `getitem` of the auto_functionalized node that is the tensor after
the op, x = the tensor before it; both sites of one op read one `CacheTables`. auto_functionalized_v2 returns the
mutated BASES: a site is claimed when query/key is its own base (or a full contiguous reshape of it, then x is
the base); a query/key that is a slice of a larger base (vLLM's qkv.split) has no node of its own -> reported.

2. vLLM's flashinfer op `torch.ops.vllm.flashinfer_rotary_embedding` (kind "vllm.flashinfer_rotary_embedding"),
registered in vllm/model_executor/layers/rotary_embedding/common.py with `direct_register_custom_op`,
mutates_args=["query", "key"], schema inferred from the Python signature:
  (Tensor positions, Tensor(a1!) query, Tensor(a2!) key, SymInt head_size, Tensor cos_sin_cache, bool is_neox)
Identification: `{VLLM_NAMESPACE}::flashinfer_rotary_embedding` (VLLM_NAMESPACE = "vllm") and that schema.
Semantics: `flashinfer.rope.apply_rope_with_cos_sin_cache_inplace` (its documentation and flashinfer/rope.py):
query/key viewed as (nnz, -1, head_size), positions (nnz), cache (max_seq_len, R) float32 (anything else
raises), cos first half, sin second half, NeoX when is_neox else interleaved, the first R lanes of each head
rotated in place, the rest untouched, fp32 math; its kernels take fp16/bf16 query/key. Verified: cache float32,
2-D contiguous; R even, 0 < R <= head_size; query/key fp16/bf16, [T, H*D] or [T, H, D]; positions 1-D integer.

The op's tables for a site (`CacheTables.emit`): cos = cache[:, :R/2], sin = cache[:, R/2:] (views) and positions
unsqueezed to [T, 1] ([B, S, 1] for [B, S] positions), so that cos[positions] broadcasts over the heads of x as the
op reads it; a flat [T, H*D] x is split into heads by the site's x blocks. Sites with the same cache and positions
read the same numbers (the q and k of one op always do).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ..analysis.site import KernelTables, Site
from .graph_values import (
    KernelMiss,
    contiguous,
    contiguous_rows,
    eq,
    known,
    may_eq,
    static_bool,
    static_int,
    tensor_of,
    value_of,
)
from .kernel_sites import FLOATS, HALVES, LOOKS_ROTARY, check_before, getitems, kernel_site, kernel_site_of

aten = torch.ops.aten

FLAT_LAYOUTS = ("t(hd)", "bs(hd)")  # x holds the heads flattened into its last dim
VLLM_C_NAMESPACE = "_C"
VLLM_NAMESPACE = "vllm"


# ------------------------------------------------------------------------------------------------------------
# vLLM's in-place ops


def _schema_sig(schema: Any) -> tuple:
    def one(a):
        write = bool(a.alias_info is not None and a.alias_info.is_write)
        ty = str(a.type).replace("SymInt", "int")
        return (a.name, ty, write, a.default_value)
    return tuple(one(a) for a in schema.arguments), tuple(str(r.type) for r in schema.returns)


_C_SCHEMAS = tuple(_schema_sig(torch._C.parse_schema(s)) for s in (
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
    "bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
    "bool is_neox) -> ()",
))
_FLASHINFER_SCHEMAS = (_schema_sig(torch._C.parse_schema(
    "flashinfer_rotary_embedding(Tensor positions, Tensor(a1!) query, Tensor(a2!) key, SymInt head_size, "
    "Tensor cos_sin_cache, bool is_neox) -> ()")),)


def vllm_kind(op: Any) -> tuple[str | None, str | None]:
    """(kind, None) for a recognised op; (None, reason) for a rotary-looking op that is not; (None, None) else."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None, None
    name = schema.name
    known = {f"{VLLM_C_NAMESPACE}::rotary_embedding": ("vllm._C.rotary_embedding", _C_SCHEMAS),
             f"{VLLM_NAMESPACE}::flashinfer_rotary_embedding": ("vllm.flashinfer_rotary_embedding",
                                                                _FLASHINFER_SCHEMAS)}
    if name in known:
        kind, schemas = known[name]
        if _schema_sig(schema) not in schemas:
            return None, f"{name} has an unknown schema {schema}"
        return kind, None
    if name.split("::")[0] not in ("rope_fusion", "aten", "prims") and LOOKS_ROTARY.search(name.split("::")[-1]):
        return None, (f"op {name} is not a recognised rotary op (known: {VLLM_C_NAMESPACE}::rotary_embedding, "
                      f"{VLLM_NAMESPACE}::flashinfer_rotary_embedding)")
    return None, None


def _result_offset(op: Any) -> int:
    n = len(op._schema.returns)
    return n if n > 1 else 1


def _vllm_layout(kind: str, x: torch.Tensor, pos: torch.Tensor, head_size: int, head_stride: Any, what: str) -> str:
    """The layout name, after checking that the op's addressing equals x's real layout."""
    def unit_last():
        return known(x.shape[-1] == 1) or known(x.stride(-1) == 1)

    if kind == "vllm.flashinfer_rotary_embedding":
        # flashinfer views query/key as (nnz, -1, head_size): logical order, any viewable layout
        if pos.dim() != 1 or not may_eq(x.shape[0], pos.shape[0]):
            raise KernelMiss(f"{what} {tuple(x.shape)} / positions {tuple(pos.shape)}: expected [T, ...] and [T]")
        if x.dim() == 2 and known(x.shape[1] % head_size == 0):
            return "t(hd)"
        if x.dim() == 3 and eq(x.shape[2], head_size):
            return "thd"
        raise KernelMiss(f"{what} shape {tuple(x.shape)} is not [T, H*{head_size}] or [T, H, {head_size}]")

    if not unit_last():
        raise KernelMiss(f"{what}'s last dim is not contiguous (stride {x.stride(-1)}); the kernel assumes it is")
    lead = pos.dim()
    if lead not in (1, 2):
        raise KernelMiss(f"positions has {pos.dim()} dims; the op takes [T] or [B, S]")
    # the op checks these sizes itself (and raises when they differ): unequal only when provably so
    if x.dim() <= lead or not all(may_eq(a, c) for a, c in zip(x.shape[:lead], pos.shape)):
        raise KernelMiss(f"{what} {tuple(x.shape)} and positions {tuple(pos.shape)} disagree on the token dims")
    if lead == 2 and not (known(x.shape[0] == 1) or known(x.stride(0) == x.shape[1] * x.stride(1))):
        raise KernelMiss(f"{what}: batch stride {x.stride(0)} is not S*token stride; the kernel indexes tokens flat")
    if x.dim() == lead + 1:  # flat heads: the kernel uses head_stride for this tensor's heads
        if not known(x.shape[-1] % head_size == 0):
            raise KernelMiss(f"{what}'s hidden size {x.shape[-1]} is not a multiple of head_size {head_size}")
        if not eq(head_stride, head_size):
            raise KernelMiss(f"{what} is flat but the op's head stride (from query) is {value_of(head_stride)}, not "
                             f"head_size {head_size}")
        return "t(hd)" if lead == 1 else "bs(hd)"
    if x.dim() == lead + 2:
        if not eq(x.shape[-1], head_size):
            raise KernelMiss(f"{what}'s last dim {x.shape[-1]} is not head_size {head_size}")
        if not (known(x.shape[-2] == 1) or eq(x.stride(-2), head_stride)):
            raise KernelMiss(f"{what}'s head stride {x.stride(-2)} differs from the one the op uses "
                             f"({value_of(head_stride)}, taken from query)")
        return "thd" if lead == 1 else "bshd"
    raise KernelMiss(f"{what} has {x.dim()} dims with {lead}-D positions: not a layout the op addresses as documented")


def _v2_tensor(node: torch.fx.Node, arg: str, off: int) -> tuple[torch.fx.Node, int, torch.Tensor] | None:
    """(x node, result getitem index, the op's view of x) for mutable arg `arg` of an auto_functionalized_v2 node."""
    kw = node.kwargs
    idx = kw.get(f"_{arg}_base_index")
    if idx is None:
        return None
    bases = kw["_all_bases"]
    base = bases[idx]
    bv = tensor_of(base, f"{arg}'s base")
    if f"_{arg}_slice_dim" in kw:
        raise KernelMiss(f"auto_functionalized_v2: {arg} is a slice of a larger tensor (e.g. qkv.split); the rotated "
                         f"{arg} is no node of its own (vLLM compiles with enable_auto_functionalized_v2=False, "
                         f"where it is)")
    if f"_{arg}_storage_offset" in kw:
        size, stride, offset = kw[f"_{arg}_size"], kw[f"_{arg}_stride"], kw[f"_{arg}_storage_offset"]
        static = all(isinstance(value_of(e), int) for e in (*size, *stride))
        view = torch.empty_strided(tuple(value_of(e) for e in size), tuple(value_of(e) for e in stride),
                                   device="meta", dtype=bv.dtype) if static else None
        numel = 1
        for e in size:
            numel = numel * value_of(e)
        if view is None or not (eq(offset, 0) and contiguous(bv) and contiguous(view)
                                and eq(numel, bv.numel())):
            raise KernelMiss(f"auto_functionalized_v2: {arg} is a strided view of its base that is not a full "
                             f"contiguous reshape; the rotated {arg} is no node of its own")
        return base, off + idx, view
    return base, off + idx, bv


def _argument_reader(node: torch.fx.Node, op: Any) -> Callable[[str], Any]:
    """The op's arguments by name as the call passes them, at the schema's defaults where it does not; the older
    schema, without rope_dim_offset and inverse, reads as the newer one at its defaults."""
    kw = node.kwargs
    schema_names = [a.name for a in op._schema.arguments]
    defaults = {a.name: a.default_value for a in op._schema.arguments}

    def arg(name: str) -> Any:
        if name in kw:
            return kw[name]
        if name not in schema_names:  # the older schema has no rope_dim_offset/inverse
            return {"rope_dim_offset": 0, "inverse": False}[name]
        if defaults[name] is not None:
            return defaults[name]
        raise KernelMiss(f"argument {name} missing")

    return arg


def _rotary_dim(cache: torch.Tensor, head_size: int, rotary_offset: int) -> int:
    """R, the cache's width: a contiguous [max_pos, R] cache whose rotated lanes lie within the head."""
    if cache.dim() != 2 or not contiguous_rows(cache):
        raise KernelMiss(f"cos_sin_cache shape {tuple(cache.shape)} strides {tuple(cache.stride())}: expected a "
                         f"contiguous [max_pos, rotary_dim] table")
    r = static_int(cache.shape[1], "cos_sin_cache's width (rotary_dim)")
    if r <= 0 or r % 2 or r > head_size:
        raise KernelMiss(f"rotary_dim={r} (cos_sin_cache width) must be even and in (0, head_size={head_size}]")
    if rotary_offset < 0 or rotary_offset + r > head_size:
        raise KernelMiss(f"rope_dim_offset={rotary_offset} with rotary_dim={r}: the rotated lanes pass the end of "
                         f"the head (head_size={head_size})")
    return r


def _x_dtypes(kind: str, cache: torch.Tensor, pos: torch.Tensor) -> tuple:
    """The dtypes of query and key the op computes exactly, once the cache and positions are ones it takes (the
    two ops dispatch different dtypes)."""
    if kind == "vllm.flashinfer_rotary_embedding":
        if cache.dtype != torch.float32:
            raise KernelMiss(f"cos_sin_cache is {cache.dtype}; flashinfer requires float32 (it raises otherwise)")
        if pos.dim() != 1 or pos.dtype not in (torch.int32, torch.int64):
            raise KernelMiss(f"positions {pos.dtype} {tuple(pos.shape)}: expected a 1-D int32/int64 tensor")
        return HALVES
    if cache.dtype not in FLOATS:
        raise KernelMiss(f"cos_sin_cache dtype {cache.dtype} is not dispatched by the op (fp16/bf16/fp32)")
    if pos.dtype != torch.int64:
        raise KernelMiss(f"positions dtype {pos.dtype}: the op reads int64 positions")
    if not contiguous(pos):
        raise KernelMiss("positions is not contiguous; the op reads it as a flat array")
    return FLOATS


def _rotated_tensors(node: torch.fx.Node, op: Any, v2: bool) -> list:
    """(arg name, x node, getitem index, the op's view) of each tensor the op rotates, query first; the two
    functionalized forms hold them differently."""
    kw = node.kwargs
    off = _result_offset(op)
    mutable = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    tensors = []
    for i, name in enumerate(mutable):
        if v2:
            got = _v2_tensor(node, name, off)
            if got is None:
                continue
            tensors.append((name, *got))
        else:
            xn = kw.get(name)
            if xn is None:
                continue
            tensors.append((name, xn, off + i, tensor_of(xn, name)))
    if not tensors or tensors[0][0] != "query":
        raise KernelMiss("query missing")
    if len(tensors) == 2 and tensors[0][1] is tensors[1][1]:
        raise KernelMiss("query and key are the same tensor (it would be rotated twice)")
    return tensors


def vllm_sites(node: torch.fx.Node, kind: str, op: Any, v2: bool) -> list[Site]:
    """The sites of one call of a vLLM rotary op (one per rotated tensor whose result is read), or KernelMiss
    naming the check (the module docstring lists them) that the call fails, so a near miss says what to change."""
    arg = _argument_reader(node, op)
    head_size = static_int(arg("head_size"), "head_size")
    is_neox = static_bool(arg("is_neox"), "is_neox")
    rotary_offset = static_int(arg("rope_dim_offset"), "rope_dim_offset")  # vLLM's name for the op's
    inverse = static_bool(arg("inverse"), "inverse")
    pos_node, cache_node = arg("positions"), arg("cos_sin_cache")
    pos, cache = tensor_of(pos_node, "positions"), tensor_of(cache_node, "cos_sin_cache")
    r = _rotary_dim(cache, head_size, rotary_offset)
    x_dtypes = _x_dtypes(kind, cache, pos)
    tensors = _rotated_tensors(node, op, v2)

    q_view = tensors[0][3]
    lead = pos.dim()
    if kind == "vllm._C.rotary_embedding" and len(tensors) == 2:
        hq, hk = (functools.reduce(operator.mul, t[3].shape[lead:], 1) // head_size for t in tensors)
        if not (known(hk > 0) and known(hq % hk == 0)):
            raise KernelMiss(f"query has {hq} heads and key {hk}: the op requires a multiple (it raises otherwise)")
    head_stride = q_view.stride(-2) if q_view.dim() == lead + 2 else head_size
    sites = []
    tables = CacheTables(cache_node, pos_node, kind)
    for name, xn, idx, view in tensors:
        if view.dtype not in x_dtypes:
            raise KernelMiss(f"{name} dtype {view.dtype} is not one the op computes exactly here ({x_dtypes})")
        layout = _vllm_layout(kind, view, pos, head_size, head_stride, name)
        xv = tensor_of(xn, name)
        if xv is not view:  # v2 reshape: describe the base, which holds the same elements in the same order
            layout = _base_layout(xv, pos, head_size, name)
        res = getitems(node, idx)
        if not res:
            continue
        if len(res) > 1:
            raise KernelMiss(f"several getitem(..., {idx}) nodes")
        sites.append(kernel_site_of(res[0], xn, head_size, tables, interleaved=not is_neox, rotary_dim=r,
                                    conjugate=inverse, rotary_offset=rotary_offset,
                                    flat_heads=layout in FLAT_LAYOUTS))
    return sites


def _base_layout(xv: torch.Tensor, pos: torch.Tensor, head_size: int, name: str) -> str:
    lead = pos.dim()
    if xv.dim() < lead or not all(may_eq(a, c) for a, c in zip(xv.shape[:lead], pos.shape)):
        raise KernelMiss(f"{name}'s base {tuple(xv.shape)} does not start with the token dims {tuple(pos.shape)}")
    if xv.dim() == lead + 1 and known(xv.shape[-1] % head_size == 0):
        return "t(hd)" if lead == 1 else "bs(hd)"
    if xv.dim() == lead + 2 and eq(xv.shape[-1], head_size):
        return "thd" if lead == 1 else "bshd"
    raise KernelMiss(f"{name}'s base {tuple(xv.shape)} has no layout the fused op knows")


@kernel_site("vllm.rotary_ops")
def recognise_vllm_op(node: torch.fx.Node) -> list[Site] | None:
    """vLLM's in-place rotary ops under auto_functionalized(_v2): their sites. Called outside it, or any other
    rotary-looking op (e.g. vllm::xpu_apply_rotary_emb): KernelMiss with the reason, never claimed."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    t = node.target
    if t is auto_functionalized or t is auto_functionalized_v2:
        op = node.args[0] if node.args else None
        kind, reason = vllm_kind(op)
        if reason:
            raise KernelMiss(reason)
        if kind is None:
            return None
        return vllm_sites(node, kind, op, t is auto_functionalized_v2)
    if isinstance(t, torch._ops.OpOverload):
        kind, reason = vllm_kind(t)
        if kind is not None:
            raise KernelMiss(f"{t} called in place outside auto_functionalized (not a functional post-grad graph)")
        if reason:
            raise KernelMiss(reason)
    return None


@dataclasses.dataclass(frozen=True)
class CacheTables(KernelTables):
    """Rows `positions` of a [max_pos, R] cos_sin_cache, cos half then sin half (`kind`: which op reads them; two
    ops reading the same rows of one cache read the same numbers)."""

    cache: torch.fx.Node
    positions: torch.fx.Node
    kind: str = dataclasses.field(compare=False)

    def tensors(self, nodes: dict) -> list[torch.fx.Node]:
        return [self.cache]

    @property
    def row_inputs(self) -> tuple:
        return (self.positions,)

    def emit(self, em: Any, site: Site, nodes: dict) -> tuple:
        like, r = site.node, site.params.rotary_dim
        cos = em.call(aten.slice.Tensor, (self.cache, 1, 0, r // 2), like=like)
        sin = em.call(aten.slice.Tensor, (self.cache, 1, r // 2, r), like=like)
        pos = em.call(aten.unsqueeze.default, (self.positions, -1), like=like)  # [T, 1] / [B, S, 1]
        check_before(self.positions, pos)
        return cos, sin, pos
