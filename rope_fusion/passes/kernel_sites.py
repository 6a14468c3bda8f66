"""Opaque rotary kernels and ops in post-grad graphs, described in the fused op's terms (recognition only).

`find_kernel_sites(graph)` returns one `KernelSite` per rotated tensor that an opaque rotary kernel or op computes,
and, separately, the calls that look like such kernels/ops but cannot be expressed exactly, each with a reason.
Nothing here edits the graph. The fused op's semantics are `rope_fusion.ops.reference.rotary_reference`:
pairs (a_j, b_j), NeoX (j, j+R/2) or interleaved (2j, 2j+1), out[a] = x[a]C - x[b]S, out[b] = x[b]C + x[a]S,
S negated when conjugate, out[d] = x[d] for d >= R; with half-width tables (full_tables=False) C = cos[j];
math in fp32. Every site below maps onto that with full_tables=False.

1. flash-attn's Triton `rotary_kernel` (kind "flash_attn.rotary_kernel")
   Where it comes from: `flash_attn.ops.triton.rotary.apply_rotary` (upstream flash-attn; vLLM's ROCm path) and
   `vllm.vllm_flash_attn.ops.triton.rotary.apply_rotary` (vLLM's copy, reached through
   `vllm.vllm_flash_attn.layers.rotary.apply_rotary_emb`, e.g. by vLLM's `ApplyRotaryEmb` custom op
   `forward_cuda` in vllm/model_executor/layers/rotary_embedding/common.py and vllm-omni's RotaryEmbedding layers).
   Dynamo turns each launch into `triton_kernel_wrapper_mutation`, functionalization into
   `triton_kernel_wrapper_functional(kernel_idx, constant_args_idx, grid, tma_descriptor_metadata, kwargs,
   tensors_to_clone)` (torch/_higher_order_ops/triton_kernel_wrap.py); the rotated tensor is
   `operator.getitem(node, "OUT")`. Tensor (and symbolic) arguments are fx nodes in `kwargs`, the rest are in
   `kernel_side_table.get_constant_args(constant_args_idx)`.
   Identification, all of it required: the side-table kernel, unwrapped through `.fn` (Autotuner, Heuristics) to a
   `triton.runtime.jit.JITFunction`, whose Python function is `rotary_kernel` of module
   `flash_attn.ops.triton.rotary` or `vllm.vllm_flash_attn.ops.triton.rotary` (FLASH_ATTN_MODULES); whose
   parameter list and constexpr flags equal one of the two known signatures; whose source contains the statements
   that fix the math (rotation formulas, conjugation, the cos=1/sin=0 fill of out-of-table rows, the table
   addressing) and stores only through OUT; and whose `tl.program_id` axes are read from the source (versions with
   this one signature map grid axes differently):
     "v1": (OUT, X, COS, SIN, CU_SEQLENS, SEQLEN_OFFSETS, seqlen, rotary_dim, seqlen_ro, 8 strides,
            BLOCK_K, IS_SEQLEN_OFFSETS_TENSOR, IS_VARLEN, INTERLEAVED, CONJUGATE, BLOCK_M) -- vLLM 0.33's copy
            (vllm/vllm_flash_attn/ops/triton/rotary.py, read in the installed wheel; program ids m, head, batch)
            and flash-attn up to 2.7.x (program ids m, batch, head until April 2025, then m, head, batch);
     "v2": (..., seqlen, nheads, seqlen_ro, 8 strides, ROTARY_DIM, IS_SEQLEN_OFFSETS_TENSOR, IS_VARLEN,
            INTERLEAVED, CONJUGATE, BLOCK_H, BLOCK_M) -- flash-attn >= 2.8 (flash_attn/ops/triton/rotary.py of the
            flash_attn 2.8.3.post2 sdist; program ids head-block, m, batch; launched through wrap_triton).
   Semantics (from the kernel source): for x = X [B, S, H, D] (strides passed explicitly), R = rotary_dim,
   rows s < seqlen of every (batch, head) program: p = s + SEQLEN_OFFSETS (int) or s + SEQLEN_OFFSETS[b] (tensor);
   cos/sin row p of the [seqlen_ro, R/2] tables, read contiguously (row stride R/2), as cos=1, sin=0 when
   p >= seqlen_ro; math in fp32 (`.to(tl.float32)`), stored to OUT's dtype; lanes >= R of OUT are not written.
   What is verified from the graph before a site is claimed: not varlen; X and OUT are 4-D of one shape and the
   eight stride arguments are their real strides (size-1 dims excepted); seqlen (and nheads) equal X's; the grid
   covers exactly the programs the kernel needs (axes from the source; unmasked axes equal, masked ones at least);
   BLOCK_K (v1) a power of two >= R; R even, 0 < R <= D; COS and SIN are [seqlen_ro, R/2] with row stride R/2
   and seqlen_ro equals their row count; an int offset satisfies 0 <= offset and offset + S <= seqlen_ro (so no
   row falls off the table); a tensor offset is a contiguous int32/int64 [B] tensor; dtypes fp16/bf16/fp32 (an
   fp64 input would make the fused op compute in fp64, the kernel computes in fp32); and when R < D, OUT's lanes
   >= R hold x's: OUT is X itself (inplace=True), or OUT is `slice_scatter(buf, slice(X, -1, R, >=D), -1, R, >=D)`
   (optionally through `aten.copy`), which is what the wrapper's `output[..., rotary_dim:].copy_(x[...,
   rotary_dim:])` becomes. Obligation left to the emitter: with a TENSOR offset the graph cannot show the
   offsets' values; rows p >= seqlen_ro rotate by the identity (cos=1, sin=0) -- pad the tables with such a row
   and clamp p to reproduce it (`flash_attn_tables` below does exactly that); a negative offset makes the kernel
   read before the table (undefined behaviour). Inputs of a later launch that are `getitem(earlier_launch, name)`
   with name != "OUT" (torch's all-inputs-mutated fallback when its TTIR analysis cannot run) are seen through:
   the kernel stores only through OUT, which is checked in its source. The site's output dtype is OUT's
   (`site.node.meta["val"].dtype`).
   Not expressible (reported): IS_VARLEN / cu_seqlens (which rows the kernel writes, and at which positions,
   depends on the values of cu_seqlens and on max_seqlen at run time); in-place `triton_kernel_wrapper_mutation`
   (no result node; custom post-grad passes see the functional form); autotuned launches (several grids);
   anything the checks above reject.

2. vLLM's CUDA op `torch.ops._C.rotary_embedding` (kind "vllm._C.rotary_embedding"), in place on query and key,
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
   read as contiguous int64. Verified before a site is claimed: rope_dim_offset == 0 (other offsets rotate lanes
   the fused op cannot express); R even, 0 < R <= head_size; cache 2-D contiguous, fp16/bf16/fp32; query and key
   fp16/bf16/fp32; positions int64 contiguous, 1-D with x [T, H*D] (layout "t(hd)") or [T, H, D] ("thd"), or 2-D
   [B, S] with x [B, S, H*D] ("bs(hd)", not in the fused op's vocabulary above; kept for completeness) or
   [B, S, H, D] ("bshd"); x's token dims not provably different from positions' (the op checks them, so a
   symbolic token count is fine); the address formula above equals x's real layout (last stride
   1, head stride as the kernel assumes, batch stride S*token stride); the hidden size a multiple of head_size;
   query's head count a multiple of key's (the op raises otherwise).
   Sites: one per rotated tensor, node = the `getitem` of the auto_functionalized node that is the tensor after
   the op, x = the tensor before it; both sites of one op share `group`. auto_functionalized_v2 returns the
   mutated BASES: a site is claimed when query/key is its own base (or a full contiguous reshape of it, then x is
   the base); a query/key that is a slice of a larger base (vLLM's qkv.split) has no node of its own -> reported.

3. vLLM's flashinfer op `torch.ops.vllm.flashinfer_rotary_embedding` (kind "vllm.flashinfer_rotary_embedding"),
   registered in vllm/model_executor/layers/rotary_embedding/common.py with `direct_register_custom_op`,
   mutates_args=["query", "key"], schema inferred from the Python signature:
     (Tensor positions, Tensor(a1!) query, Tensor(a2!) key, SymInt head_size, Tensor cos_sin_cache, bool is_neox)
   Identification: `{VLLM_NAMESPACE}::flashinfer_rotary_embedding` (VLLM_NAMESPACE = "vllm") and that schema.
   Semantics: `flashinfer.rope.apply_rope_with_cos_sin_cache_inplace` (its documentation and flashinfer/rope.py):
   query/key viewed as (nnz, -1, head_size), positions (nnz), cache (max_seq_len, R) float32 (anything else
   raises), cos first half, sin second half, NeoX when is_neox else interleaved, the first R lanes of each head
   rotated in place, the rest untouched, fp32 math; its kernels take fp16/bf16 query/key. Verified: cache float32,
   2-D contiguous; R even, 0 < R <= head_size; query/key fp16/bf16, [T, H*D] or [T, H, D]; positions 1-D integer.

Anything else whose name says rotary/rope (another Triton kernel such as vLLM's `_packed_qk_rope_kernel`, custom
ops such as `vllm::rocm_aiter_triton_rotary_embedding`, `vllm::xpu_apply_rotary_emb`, `vllm::mrope`; not the
`rope_fusion`, `aten` and `prims` namespaces) is reported, never claimed: its semantics have not been checked here.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import operator
import re
import sys
from typing import Any

import torch
import torch.fx

VLLM_C_NAMESPACE = "_C"
VLLM_NAMESPACE = "vllm"
FLASH_ATTN_MODULES = ("flash_attn.ops.triton.rotary", "vllm.vllm_flash_attn.ops.triton.rotary")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_HALVES = (torch.float16, torch.bfloat16)
_LOOKS_ROTARY = re.compile(r"rotary|(?<!p)rope", re.I)  # apply_rope, mrope, rotary_kernel, RoPE; not "property"


@dataclasses.dataclass(frozen=True)
class KernelSite:
    """One rotated tensor computed by an opaque rotary kernel/op node, in the fused op's terms.

    Tables, per kind (full_tables=False for all): flash-attn: `cos`/`sin` [seqlen_ro, R/2], row s + seqlen_offset
    for sequence position s (see `flash_attn_tables`); vLLM ops: `cos_sin_cache`[positions] split into the cos half
    [..., :R/2] and the sin half [..., R/2:], one row per token, broadcast over heads. The result's dtype is
    `node.meta["val"].dtype`.
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


class _Miss(Exception):
    """Raised inside an analysis with the reason a call cannot be expressed."""


# ------------------------------------------------------------------------------------------------------------
# small helpers on graph values


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _tensor(a: Any, what: str) -> torch.Tensor:
    v = _val(a)
    if not isinstance(v, torch.Tensor):
        raise _Miss(f"{what} has no tensor metadata in the graph")
    return v


def _known(cond: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(cond, bool):
        return cond
    try:
        return bool(statically_known_true(cond))
    except Exception:
        return False


def _eq(a: Any, b: Any) -> bool:
    a, b = _val(a), _val(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return _known(a == b)
    return False


def _may_eq(a: Any, b: Any) -> bool:
    """Not provably different (symbolic sizes that the op itself checks at run time)."""
    a, b = _val(a), _val(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return not _known(a != b)
    return False


def _ge(a: Any, b: Any) -> bool:
    a, b = _val(a), _val(b)
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return _known(a >= b)
    return False


def _int(a: Any, what: str) -> int:
    v = _val(a)
    if isinstance(v, bool):
        raise _Miss(f"{what} is a bool, expected an int")
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        c = v.node.maybe_as_int()
        if c is not None:
            return int(c)
        raise _Miss(f"{what} is symbolic ({v}); the fused op needs it static (mark that dim static)")
    raise _Miss(f"{what} is not an int ({v!r})")


def _bool(a: Any, what: str) -> bool:
    v = _val(a)
    if isinstance(v, bool):
        return v
    raise _Miss(f"{what} is not a constant bool ({v!r})")


def _contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguous, provably (size-1 dims excepted), without adding guards on symbolic sizes."""
    expected: Any = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if not (_known(size == 1) or _known(stride == expected)):
            return False
        expected = expected * size
    return True


def _contiguous_rows(t: torch.Tensor) -> bool:
    """2-D with row stride = row length and unit column stride (size-1 dims excepted)."""
    return t.dim() == 2 and _contiguous(t)


def _getitems(node: torch.fx.Node, key: Any) -> list[torch.fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == key]


def _is_call(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


# ------------------------------------------------------------------------------------------------------------
# flash-attn rotary_kernel: identification

_STRIDES = ("stride_out_batch", "stride_out_seqlen", "stride_out_nheads", "stride_out_headdim",
            "stride_x_batch", "stride_x_seqlen", "stride_x_nheads", "stride_x_headdim")


@dataclasses.dataclass(frozen=True)
class _FaVariant:
    name: str
    arg_names: tuple
    constexprs: frozenset
    markers: tuple  # whitespace-free source fragments that must all appear


_FA_VARIANTS = (
    _FaVariant(
        "v1",
        ("OUT", "X", "COS", "SIN", "CU_SEQLENS", "SEQLEN_OFFSETS", "seqlen", "rotary_dim", "seqlen_ro", *_STRIDES,
         "BLOCK_K", "IS_SEQLEN_OFFSETS_TENSOR", "IS_VARLEN", "INTERLEAVED", "CONJUGATE", "BLOCK_M"),
        frozenset({"BLOCK_K", "IS_SEQLEN_OFFSETS_TENSOR", "IS_VARLEN", "INTERLEAVED", "CONJUGATE", "BLOCK_M"}),
        ("rotary_dim_half=rotary_dim//2",
         "rm_cs=rm+SEQLEN_OFFSETS", "rm_cs=rm+tl.load(SEQLEN_OFFSETS+pid_batch)",
         "COS=COS+(rm_cs[:,None]*rotary_dim_half+rk_half[None,:])",
         "cos=tl.load(COS,mask=(rm_cs[:,None]<seqlen_ro)&(rk_half[None,:]<rotary_dim_half),other=1.0)",
         "sin=tl.load(SIN,mask=(rm_cs[:,None]<seqlen_ro)&(rk_half[None,:]<rotary_dim_half),other=0.0)",
         "ifCONJUGATE:sin=-sin",
         "o0=x0*cos-x1*sin", "o1=x0*sin+x1*cos",
         "rk_swap=rk+((rk+1)%2)*2-1", "rk_repeat=tl.arange(0,BLOCK_K)//2",
         "COS=COS+(rm_cs[:,None]*rotary_dim_half+rk_repeat[None,:])",
         "out=tl.where(rk[None,:]%2==0,x0_cos-x1_sin,x0_cos+x1_sin)"),
    ),
    _FaVariant(
        "v2",
        ("OUT", "X", "COS", "SIN", "CU_SEQLENS", "SEQLEN_OFFSETS", "seqlen", "nheads", "seqlen_ro", *_STRIDES,
         "ROTARY_DIM", "IS_SEQLEN_OFFSETS_TENSOR", "IS_VARLEN", "INTERLEAVED", "CONJUGATE", "BLOCK_H", "BLOCK_M"),
        frozenset({"ROTARY_DIM", "IS_SEQLEN_OFFSETS_TENSOR", "IS_VARLEN", "INTERLEAVED", "CONJUGATE", "BLOCK_H",
                   "BLOCK_M"}),
        ("BLOCK_K:tl.constexpr=triton.next_power_of_2(ROTARY_DIM)", "ROTARY_DIM_HALF=ROTARY_DIM//2",
         "rm_cs=rm+SEQLEN_OFFSETS", "rm_cs=rm+tl.load(SEQLEN_OFFSETS+pid_batch)",
         "COS=COS+(rm_cs[:,None]*ROTARY_DIM_HALF+rk_half[None,:])",
         "mask_cs=(rm_cs[:,None]<seqlen_ro)&(rk_half[None,:]<ROTARY_DIM_HALF)",
         "cos=tl.load(COS,mask=mask_cs,other=1.0)", "sin=tl.load(SIN,mask=mask_cs,other=0.0)",
         "ifCONJUGATE:sin=-sin",
         "o0=x0*cos-x1*sin", "o1=x0*sin+x1*cos",
         "x0,x1=tl.split(tl.reshape(x,[BLOCK_H,BLOCK_M,BLOCK_K//2,2]))",
         "o=tl.reshape(tl.join(o0,o1),[BLOCK_H,BLOCK_M,BLOCK_K])",
         "mask=(rh[:,None,None]<nheads)&(rm[None,:,None]<seqlen)"),
    ),
)


@dataclasses.dataclass(frozen=True)
class _FaKernel:
    variant: _FaVariant
    axes: dict  # "m" | "head" | "batch" -> grid axis


def _unwrap_jit(kernel: Any):
    """The triton JITFunction under Autotuner/Heuristics wrappers (`.fn`), or None. Triton is not imported here:
    a kernel in the side table means triton.runtime.jit is loaded already."""
    jit_mod = sys.modules.get("triton.runtime.jit")
    jit_cls = getattr(jit_mod, "JITFunction", None)
    if jit_cls is None:
        return None
    k, seen = kernel, 0
    while not isinstance(k, jit_cls) and hasattr(k, "fn") and seen < 8:
        k, seen = k.fn, seen + 1
    return k if isinstance(k, jit_cls) else None


def _kernel_of(node: torch.fx.Node):
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        return kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    except Exception:
        return None


def _jit_label(jit: Any) -> str:
    fn = getattr(jit, "fn", None)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"


def _program_id_axes(src: str) -> dict:
    """{"m"/"head"/"batch": axis} from assignments `pid_X = tl.program_id(axis=N)` in the kernel source."""
    names = {"pid_m": "m", "pid_head": "head", "pid_batch": "batch"}
    axes: dict = {}
    for stmt in ast.walk(ast.parse(src)):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        name = stmt.targets[0].id
        call = stmt.value
        if name not in names or not isinstance(call, ast.Call):
            continue
        f = call.func
        if not (isinstance(f, ast.Attribute) and f.attr == "program_id"):
            continue
        arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "axis"), None)
        if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
            axes[names[name]] = arg.value
    return axes


def _stores_only_out(src: str) -> bool:
    """Every tl.store writes through a pointer expression rooted at the name OUT."""
    def root(e):
        while isinstance(e, ast.BinOp):
            e = e.left
        return e.id if isinstance(e, ast.Name) else None

    stores = [c for c in ast.walk(ast.parse(src)) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
              and c.func.attr == "store"]
    return bool(stores) and all(c.args and root(c.args[0]) == "OUT" for c in stores)


@functools.lru_cache(maxsize=64)
def _identify_jit(jit: Any) -> _FaKernel | str | None:
    """_FaKernel when `jit` is a verified flash-attn rotary_kernel; a reason when it is rotary-looking but not
    verified; None when it has nothing to do with rotary embeddings."""
    fn = getattr(jit, "fn", None)
    module, name = getattr(fn, "__module__", ""), getattr(fn, "__name__", "")
    label = f"{module}.{name}"
    looks = bool(_LOOKS_ROTARY.search(name)) or module in FLASH_ATTN_MODULES
    if not looks:
        return None
    if name != "rotary_kernel" or module not in FLASH_ATTN_MODULES:
        return (f"Triton kernel {label} is not a known rotary kernel; only `rotary_kernel` of "
                f"{' / '.join(FLASH_ATTN_MODULES)} is recognised")
    arg_names = tuple(getattr(jit, "arg_names", ()))
    params = getattr(jit, "params", ())
    constexprs = frozenset(p.name for p in params if getattr(p, "is_constexpr", False))
    variant = next((v for v in _FA_VARIANTS if v.arg_names == arg_names), None)
    if variant is None:
        return f"{label} has an unknown signature {arg_names}; known: " + "; ".join(
            f"{v.name} {v.arg_names}" for v in _FA_VARIANTS)
    if constexprs != variant.constexprs:
        return f"{label}: constexpr parameters {sorted(constexprs)} differ from {variant.name}'s"
    src = getattr(jit, "src", None)
    if not isinstance(src, str):
        return f"{label}: kernel source unavailable, its semantics cannot be checked"
    flat = re.sub(r"\s+", "", src)
    missing = [m for m in variant.markers if m not in flat]
    if missing:
        return f"{label} ({variant.name} signature): source differs from the verified kernel, e.g. lacks {missing[0]!r}"
    try:
        axes = _program_id_axes(src)
        stores_ok = _stores_only_out(src)
    except SyntaxError:
        return f"{label}: kernel source does not parse"
    if set(axes) != {"m", "head", "batch"} or sorted(axes.values()) != [0, 1, 2]:
        return f"{label}: cannot read the program_id axes from its source ({axes})"
    if not stores_ok:
        return f"{label}: stores through something other than OUT"
    return _FaKernel(variant, axes)


def _fa_kernel_of_node(node: torch.fx.Node) -> _FaKernel | str | None:
    kernel = _kernel_of(node)
    if kernel is None:
        return None
    jit = _unwrap_jit(kernel)
    if jit is None:
        return None
    try:
        return _identify_jit(jit)
    except TypeError:  # unhashable kernel object
        return _identify_jit.__wrapped__(jit)


def _triton_targets():
    from torch._higher_order_ops.triton_kernel_wrap import (
        triton_kernel_wrapper_functional,
        triton_kernel_wrapper_mutation,
    )
    return triton_kernel_wrapper_functional, triton_kernel_wrapper_mutation


def _see_through(a: Any) -> Any:
    """getitem(launch of a verified rotary_kernel, name != "OUT") is that launch's input `name` (the kernel stores
    only through OUT); applied repeatedly."""
    functional, _ = _triton_targets()
    for _ in range(64):
        if not (_is_call(a, operator.getitem) and _is_call(a.args[0], functional) and isinstance(a.args[1], str)
                and a.args[1] != "OUT"):
            return a
        launch = a.args[0]
        if not isinstance(_fa_kernel_of_node(launch), _FaKernel):
            return a
        inner = launch.kwargs["kwargs"].get(a.args[1])
        if not isinstance(inner, torch.fx.Node):
            return a
        a = inner
    return a


# ------------------------------------------------------------------------------------------------------------
# flash-attn rotary_kernel: arguments -> KernelSite

def _last_dim(d: Any, ndim: int) -> bool:
    return isinstance(d, int) and d in (ndim - 1, -1)


def _tail_slice_of(src: Any, x: torch.fx.Node, r: int, d: int, ndim: int) -> bool:
    """src is x[..., r:] (aten.slice on the last dim, start r, end >= d, step 1)."""
    if not _is_call(src, torch.ops.aten.slice.Tensor):
        return False
    a = list(src.args) + [None] * (5 - len(src.args))
    base, dim, start, end, step = a[:5]
    dim = 0 if dim is None else dim
    step = 1 if step is None else step
    return (_see_through(base) is x and _last_dim(dim, ndim) and start == r and step == 1
            and (end is None or (isinstance(end, int) and end >= d)))


def _tail_is_x(out: torch.fx.Node, x: torch.fx.Node, r: int, d: int, ndim: int) -> bool:
    """OUT's lanes >= r hold x's: OUT = slice_scatter(buf, x[..., r:], -1, r, >=d) (maybe via aten.copy)."""
    if not _is_call(out, torch.ops.aten.slice_scatter.default):
        return False
    a = list(out.args) + [None] * (6 - len(out.args))
    _buf, src, dim, start, end, step = a[:6]
    dim = 0 if dim is None else dim
    step = 1 if step is None else step
    if not (_last_dim(dim, ndim) and start == r and step == 1 and (end is None or (isinstance(end, int) and end >= d))):
        return False
    if _is_call(src, torch.ops.aten.copy.default):
        dst_v, src_v = _val(src.args[0]), _val(src.args[1])
        if not (isinstance(dst_v, torch.Tensor) and isinstance(src_v, torch.Tensor)
                and tuple(dst_v.shape) == tuple(src_v.shape)):
            return False
        src = src.args[1]
    return _tail_slice_of(src, x, r, d, ndim)


def _check_strides(args: dict, prefix: str, t: torch.Tensor, what: str) -> None:
    for i, dim in enumerate(("batch", "seqlen", "nheads", "headdim")):
        if _known(t.shape[i] == 1):
            continue
        if not _eq(args[f"stride_{prefix}_{dim}"], t.stride(i)):
            raise _Miss(f"stride_{prefix}_{dim}={_val(args[f'stride_{prefix}_{dim}'])} is not {what}'s real stride "
                        f"{t.stride(i)} (shape {tuple(t.shape)}, strides {tuple(t.stride())})")


def _cdiv(a: Any, b: int) -> Any:
    return (a + b - 1) // b


def _flash_attn_site(node: torch.fx.Node, fk: _FaKernel, group: int) -> KernelSite | None:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    v = fk.variant
    consts = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
    tensor_args = node.kwargs["kwargs"]
    args = {**consts, **tensor_args}
    missing = [n for n in v.arg_names if n not in args]
    if missing:
        raise _Miss(f"arguments {missing} missing from the launch (autotuned configs are not supported)")

    if args["CU_SEQLENS"] is not None or _bool(args["IS_VARLEN"], "IS_VARLEN"):
        raise _Miss("flash-attn rotary_kernel with IS_VARLEN: cu_seqlens and max_seqlen are not supported "
                    "(which rows are rotated, and at which positions, depends on their run-time values)")
    outs = _getitems(node, "OUT")
    if not outs:
        return None  # result unused: nothing to replace
    if len(outs) > 1:
        raise _Miss("several getitem(..., 'OUT') nodes for one launch")

    x_node, out_node = _see_through(args["X"]), _see_through(args["OUT"])
    cos_node, sin_node = _see_through(args["COS"]), _see_through(args["SIN"])
    for nm, nd in (("X", x_node), ("OUT", out_node), ("COS", cos_node), ("SIN", sin_node)):
        if not isinstance(nd, torch.fx.Node):
            raise _Miss(f"{nm} is not a tensor node ({nd!r})")
    x, out = _tensor(x_node, "X"), _tensor(out_node, "OUT")
    cos, sin = _tensor(cos_node, "COS"), _tensor(sin_node, "SIN")
    if x.dim() != 4 or tuple(out.shape) != tuple(x.shape):
        raise _Miss(f"X {tuple(x.shape)} / OUT {tuple(out.shape)}: expected both [B, S, H, D] of one shape")
    for nm, t in (("X", x), ("OUT", out), ("COS", cos), ("SIN", sin)):
        if t.dtype not in _FLOATS:
            raise _Miss(f"{nm} has dtype {t.dtype}; the kernel computes in fp32 and the fused op is exact only for "
                        f"fp16/bf16/fp32 inputs")
    b, s, h, d = x.shape
    head_dim = _int(d, "X's head dim")

    # rotary dim and block sizes
    if v.name == "v1":
        r = _int(args["rotary_dim"], "rotary_dim")
        block_k = _int(args["BLOCK_K"], "BLOCK_K")
        if block_k < r or block_k & (block_k - 1):
            raise _Miss(f"BLOCK_K={block_k} does not cover rotary_dim={r} (a power of two >= rotary_dim is needed)")
    else:
        r = _int(args["ROTARY_DIM"], "ROTARY_DIM")
        if not _eq(args["nheads"], h):
            raise _Miss(f"nheads={_val(args['nheads'])} is not X's head count {h}")
    if r <= 0 or r % 2 or r > head_dim:
        raise _Miss(f"rotary_dim={r} must be even and in (0, head_dim={head_dim}]")
    if not _eq(args["seqlen"], s):
        raise _Miss(f"seqlen={_val(args['seqlen'])} is not X's sequence length {s}")
    _check_strides(args, "x", x, "X")
    _check_strides(args, "out", out, "OUT")

    # tables: [seqlen_ro, R/2], read with row stride R/2
    for nm, t in (("COS", cos), ("SIN", sin)):
        if t.dim() != 2 or not _eq(t.shape[1] * 2, r) or not _contiguous_rows(t):
            raise _Miss(f"{nm} shape {tuple(t.shape)} strides {tuple(t.stride())}: the kernel reads a contiguous "
                        f"[seqlen_ro, rotary_dim/2={r // 2}] table")
        if not _eq(args["seqlen_ro"], t.shape[0]):
            raise _Miss(f"seqlen_ro={_val(args['seqlen_ro'])} is not {nm}'s row count {t.shape[0]}")

    # grid: every program the kernel needs, and no unmasked extra program
    grid = node.kwargs["grid"]
    if not isinstance(grid, (list, tuple)) or len(grid) != 1 or len(grid[0]) != 3:
        raise _Miss(f"grid {grid!r}: expected one 3-D grid (autotuned launches are not supported)")
    g = grid[0]
    block_m = _int(args["BLOCK_M"], "BLOCK_M")
    ok_m = _ge(g[fk.axes["m"]], _cdiv(_val(args["seqlen"]), block_m))
    ok_b = _eq(g[fk.axes["batch"]], b)
    if v.name == "v1":
        ok_h = _eq(g[fk.axes["head"]], h)
    else:
        ok_h = _ge(g[fk.axes["head"]], _cdiv(h, _int(args["BLOCK_H"], "BLOCK_H")))
    if not (ok_m and ok_b and ok_h):
        raise _Miss(f"grid {tuple(_val(e) for e in g)} does not match the launch (axes {fk.axes}, X {tuple(x.shape)}, "
                    f"BLOCK_M={block_m})")

    # positions into the tables
    if _bool(args["IS_SEQLEN_OFFSETS_TENSOR"], "IS_SEQLEN_OFFSETS_TENSOR"):
        off_node = _see_through(args["SEQLEN_OFFSETS"])
        off = _tensor(off_node, "SEQLEN_OFFSETS")
        if off.dtype not in (torch.int32, torch.int64) or off.dim() != 1 or not _eq(off.shape[0], b):
            raise _Miss(f"SEQLEN_OFFSETS {off.dtype} {tuple(off.shape)}: expected an int32/int64 [B={b}] tensor")
        if not (_known(off.shape[0] == 1) or _known(off.stride(0) == 1)):
            raise _Miss("SEQLEN_OFFSETS is not contiguous")
        seqlen_offset: int | torch.fx.Node = off_node
    else:
        raw = args["SEQLEN_OFFSETS"]
        if isinstance(_val(raw), torch.Tensor):
            raise _Miss("SEQLEN_OFFSETS is a tensor but IS_SEQLEN_OFFSETS_TENSOR is False")
        off_i = _int(raw, "int SEQLEN_OFFSETS")
        if off_i < 0 or not _known(off_i + s <= cos.shape[0]):
            raise _Miss(f"int SEQLEN_OFFSETS={off_i} with seqlen {s} reaches past seqlen_ro={cos.shape[0]} rows (the "
                        f"kernel would use cos=1, sin=0 there) or is negative")
        seqlen_offset = off_i

    # lanes >= R of the result
    if r < head_dim and out_node is not x_node and not _tail_is_x(out_node, x_node, r, head_dim, 4):
        raise _Miss(f"the output buffer's lanes >= rotary_dim={r} are not x's (expected inplace=True or the "
                    f"wrapper's output[..., rotary_dim:].copy_(x[..., rotary_dim:]))")

    return KernelSite(
        kind="flash_attn.rotary_kernel", node=outs[0], x=x_node, layout="bshd", head_dim=head_dim, rotary_dim=r,
        interleaved=_bool(args["INTERLEAVED"], "INTERLEAVED"), conjugate=_bool(args["CONJUGATE"], "CONJUGATE"),
        cos=cos_node, sin=sin_node, seqlen_offset=seqlen_offset, cu_seqlens=None, max_seqlen=None,
        cos_sin_cache=None, positions=None, group=group, tail_from_x=True)


def flash_attn_tables(cos: torch.Tensor, sin: torch.Tensor, seqlen: int, seqlen_offset: int | torch.Tensor):
    """The cos/sin rows a flash-attn rotary_kernel launch reads, shaped to broadcast against x [B, S, H, D]:
    ([B or 1, S, 1, R/2], same) with row p = s + offset (per batch for a tensor offset), and cos=1, sin=0 where
    p >= seqlen_ro (the kernel's masked load). Plain torch; usable eagerly or in a graph."""
    n = cos.shape[0]
    s = torch.arange(seqlen, device=cos.device)
    if isinstance(seqlen_offset, torch.Tensor):
        p = seqlen_offset.to(torch.long)[:, None] + s[None, :]
    else:
        p = (s + int(seqlen_offset))[None, :]
    inside = p < n
    pc = torch.where(inside, p, torch.zeros_like(p))
    c = torch.where(inside[..., None], cos[pc], torch.ones((), dtype=cos.dtype, device=cos.device))
    sn = torch.where(inside[..., None], sin[pc], torch.zeros((), dtype=sin.dtype, device=sin.device))
    return c[:, :, None, :], sn[:, :, None, :]


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


def _vllm_kind(op: Any) -> tuple[str | None, str | None]:
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
    if name.split("::")[0] not in ("rope_fusion", "aten", "prims") and _LOOKS_ROTARY.search(name.split("::")[-1]):
        return None, (f"op {name} is not a recognised rotary op (known: {VLLM_C_NAMESPACE}::rotary_embedding, "
                      f"{VLLM_NAMESPACE}::flashinfer_rotary_embedding)")
    return None, None


def _result_offset(op: Any) -> int:
    n = len(op._schema.returns)
    return n if n > 1 else 1


def _vllm_layout(kind: str, x: torch.Tensor, pos: torch.Tensor, head_size: int, head_stride: Any, what: str) -> str:
    """The layout name, after checking that the op's addressing equals x's real layout."""
    def unit_last():
        return _known(x.shape[-1] == 1) or _known(x.stride(-1) == 1)

    if kind == "vllm.flashinfer_rotary_embedding":
        # flashinfer views query/key as (nnz, -1, head_size): logical order, any viewable layout
        if pos.dim() != 1 or not _may_eq(x.shape[0], pos.shape[0]):
            raise _Miss(f"{what} {tuple(x.shape)} / positions {tuple(pos.shape)}: expected [T, ...] and [T]")
        if x.dim() == 2 and _known(x.shape[1] % head_size == 0):
            return "t(hd)"
        if x.dim() == 3 and _eq(x.shape[2], head_size):
            return "thd"
        raise _Miss(f"{what} shape {tuple(x.shape)} is not [T, H*{head_size}] or [T, H, {head_size}]")

    if not unit_last():
        raise _Miss(f"{what}'s last dim is not contiguous (stride {x.stride(-1)}); the kernel assumes it is")
    lead = pos.dim()
    if lead not in (1, 2):
        raise _Miss(f"positions has {pos.dim()} dims; the op takes [T] or [B, S]")
    # the op checks these sizes itself (and raises when they differ): unequal only when provably so
    if x.dim() <= lead or not all(_may_eq(a, c) for a, c in zip(x.shape[:lead], pos.shape)):
        raise _Miss(f"{what} {tuple(x.shape)} and positions {tuple(pos.shape)} disagree on the token dims")
    if lead == 2 and not (_known(x.shape[0] == 1) or _known(x.stride(0) == x.shape[1] * x.stride(1))):
        raise _Miss(f"{what}: batch stride {x.stride(0)} is not S*token stride; the kernel indexes tokens flat")
    if x.dim() == lead + 1:  # flat heads: the kernel uses head_stride for this tensor's heads
        if not _known(x.shape[-1] % head_size == 0):
            raise _Miss(f"{what}'s hidden size {x.shape[-1]} is not a multiple of head_size {head_size}")
        if not _eq(head_stride, head_size):
            raise _Miss(f"{what} is flat but the op's head stride (from query) is {_val(head_stride)}, not "
                        f"head_size {head_size}")
        return "t(hd)" if lead == 1 else "bs(hd)"
    if x.dim() == lead + 2:
        if not _eq(x.shape[-1], head_size):
            raise _Miss(f"{what}'s last dim {x.shape[-1]} is not head_size {head_size}")
        if not (_known(x.shape[-2] == 1) or _eq(x.stride(-2), head_stride)):
            raise _Miss(f"{what}'s head stride {x.stride(-2)} differs from the one the op uses ({_val(head_stride)}, "
                        f"taken from query)")
        return "thd" if lead == 1 else "bshd"
    raise _Miss(f"{what} has {x.dim()} dims with {lead}-D positions: not a layout the op addresses as documented")


def _v2_tensor(node: torch.fx.Node, arg: str, off: int) -> tuple[torch.fx.Node, int, torch.Tensor] | None:
    """(x node, result getitem index, the op's view of x) for mutable arg `arg` of an auto_functionalized_v2 node."""
    kw = node.kwargs
    idx = kw.get(f"_{arg}_base_index")
    if idx is None:
        return None
    bases = kw["_all_bases"]
    base = bases[idx]
    bv = _tensor(base, f"{arg}'s base")
    if f"_{arg}_slice_dim" in kw:
        raise _Miss(f"auto_functionalized_v2: {arg} is a slice of a larger tensor (e.g. qkv.split); the rotated "
                    f"{arg} is no node of its own (vLLM compiles with enable_auto_functionalized_v2=False, "
                    f"where it is)")
    if f"_{arg}_storage_offset" in kw:
        size, stride, offset = kw[f"_{arg}_size"], kw[f"_{arg}_stride"], kw[f"_{arg}_storage_offset"]
        view = torch.empty_strided(tuple(_val(e) for e in size), tuple(_val(e) for e in stride), device="meta",
                                   dtype=bv.dtype) if all(isinstance(_val(e), int) for e in (*size, *stride)) else None
        numel = 1
        for e in size:
            numel = numel * _val(e)
        if view is None or not (_eq(offset, 0) and _contiguous(bv) and _contiguous(view)
                                and _eq(numel, bv.numel())):
            raise _Miss(f"auto_functionalized_v2: {arg} is a strided view of its base that is not a full "
                        f"contiguous reshape; the rotated {arg} is no node of its own")
        return base, off + idx, view
    return base, off + idx, bv


def _vllm_sites(node: torch.fx.Node, kind: str, op: Any, v2: bool, group: int) -> list[KernelSite]:
    kw = node.kwargs
    schema_names = [a.name for a in op._schema.arguments]
    defaults = {a.name: a.default_value for a in op._schema.arguments}

    def arg(name):
        if name in kw:
            return kw[name]
        if name not in schema_names:  # the older schema has no rope_dim_offset/inverse
            return {"rope_dim_offset": 0, "inverse": False}[name]
        if defaults[name] is not None:
            return defaults[name]
        raise _Miss(f"argument {name} missing")

    head_size = _int(arg("head_size"), "head_size")
    is_neox = _bool(arg("is_neox"), "is_neox")
    rope_dim_offset = _int(arg("rope_dim_offset"), "rope_dim_offset")
    inverse = _bool(arg("inverse"), "inverse")
    if rope_dim_offset != 0:
        raise _Miss(f"rope_dim_offset={rope_dim_offset}: the op rotates lanes [{rope_dim_offset}, "
                    f"{rope_dim_offset}+rotary_dim) of each head; the fused op rotates the leading lanes")
    pos_node, cache_node = arg("positions"), arg("cos_sin_cache")
    pos, cache = _tensor(pos_node, "positions"), _tensor(cache_node, "cos_sin_cache")
    if cache.dim() != 2 or not _contiguous_rows(cache):
        raise _Miss(f"cos_sin_cache shape {tuple(cache.shape)} strides {tuple(cache.stride())}: expected a contiguous "
                    f"[max_pos, rotary_dim] table")
    r = _int(cache.shape[1], "cos_sin_cache's width (rotary_dim)")
    if r <= 0 or r % 2 or r > head_size:
        raise _Miss(f"rotary_dim={r} (cos_sin_cache width) must be even and in (0, head_size={head_size}]")
    if kind == "vllm.flashinfer_rotary_embedding":
        if cache.dtype != torch.float32:
            raise _Miss(f"cos_sin_cache is {cache.dtype}; flashinfer requires float32 (it raises otherwise)")
        if pos.dim() != 1 or pos.dtype not in (torch.int32, torch.int64):
            raise _Miss(f"positions {pos.dtype} {tuple(pos.shape)}: expected a 1-D int32/int64 tensor")
        x_dtypes = _HALVES
    else:
        if cache.dtype not in _FLOATS:
            raise _Miss(f"cos_sin_cache dtype {cache.dtype} is not dispatched by the op (fp16/bf16/fp32)")
        if pos.dtype != torch.int64:
            raise _Miss(f"positions dtype {pos.dtype}: the op reads int64 positions")
        if not _contiguous(pos):
            raise _Miss("positions is not contiguous; the op reads it as a flat array")
        x_dtypes = _FLOATS

    off = _result_offset(op)
    mutable = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    tensors = []  # (arg name, x node, getitem index, the op's view)
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
            tensors.append((name, xn, off + i, _tensor(xn, name)))
    if not tensors or tensors[0][0] != "query":
        raise _Miss("query missing")
    if len(tensors) == 2 and tensors[0][1] is tensors[1][1]:
        raise _Miss("query and key are the same tensor (it would be rotated twice)")

    q_view = tensors[0][3]
    lead = pos.dim()
    if kind == "vllm._C.rotary_embedding" and len(tensors) == 2:
        hq, hk = (functools.reduce(operator.mul, t[3].shape[lead:], 1) // head_size for t in tensors)
        if not (_known(hk > 0) and _known(hq % hk == 0)):
            raise _Miss(f"query has {hq} heads and key {hk}: the op requires a multiple (it raises otherwise)")
    head_stride = q_view.stride(-2) if q_view.dim() == lead + 2 else head_size
    sites = []
    for name, xn, idx, view in tensors:
        if view.dtype not in x_dtypes:
            raise _Miss(f"{name} dtype {view.dtype} is not one the op computes exactly here ({x_dtypes})")
        layout = _vllm_layout(kind, view, pos, head_size, head_stride, name)
        xv = _tensor(xn, name)
        if xv is not view:  # v2 reshape: describe the base, which holds the same elements in the same order
            layout = _base_layout(xv, pos, head_size, name)
        res = _getitems(node, idx)
        if not res:
            continue
        if len(res) > 1:
            raise _Miss(f"several getitem(..., {idx}) nodes")
        sites.append(KernelSite(
            kind=kind, node=res[0], x=xn, layout=layout, head_dim=head_size, rotary_dim=r,
            interleaved=not is_neox, conjugate=inverse, cos=None, sin=None, seqlen_offset=0, cu_seqlens=None,
            max_seqlen=None, cos_sin_cache=cache_node, positions=pos_node, group=group, tail_from_x=True))
    return sites


def _base_layout(xv: torch.Tensor, pos: torch.Tensor, head_size: int, name: str) -> str:
    lead = pos.dim()
    if xv.dim() < lead or not all(_may_eq(a, c) for a, c in zip(xv.shape[:lead], pos.shape)):
        raise _Miss(f"{name}'s base {tuple(xv.shape)} does not start with the token dims {tuple(pos.shape)}")
    if xv.dim() == lead + 1 and _known(xv.shape[-1] % head_size == 0):
        return "t(hd)" if lead == 1 else "bs(hd)"
    if xv.dim() == lead + 2 and _eq(xv.shape[-1], head_size):
        return "thd" if lead == 1 else "bshd"
    raise _Miss(f"{name}'s base {tuple(xv.shape)} has no layout the fused op knows")


# ------------------------------------------------------------------------------------------------------------
# the entry point


def find_kernel_sites(graph: torch.fx.Graph) -> tuple[list[KernelSite], list[tuple[torch.fx.Node, str]]]:
    """(sites, misses): every rotated tensor of a recognised opaque rotary kernel/op, and every call that looks like
    one (by kernel/op name) but cannot be expressed exactly, with the reason. The graph is not modified."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    functional, mutation = _triton_targets()
    sites: list[KernelSite] = []
    misses: list[tuple[torch.fx.Node, str]] = []
    groups = itertools.count()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        try:
            if t is functional or t is mutation:
                fk = _fa_kernel_of_node(node)
                if fk is None:
                    continue
                if isinstance(fk, str):
                    raise _Miss(fk)
                if t is mutation:
                    raise _Miss("in-place triton_kernel_wrapper_mutation launch of flash-attn rotary_kernel: it has no "
                                "result node to replace (post-grad custom passes see the functional form)")
                site = _flash_attn_site(node, fk, next(groups))
                if site is not None:
                    sites.append(site)
            elif t is auto_functionalized or t is auto_functionalized_v2:
                op = node.args[0] if node.args else None
                kind, reason = _vllm_kind(op)
                if reason:
                    raise _Miss(reason)
                if kind is not None:
                    sites.extend(_vllm_sites(node, kind, op, t is auto_functionalized_v2, next(groups)))
            elif isinstance(t, torch._ops.OpOverload):
                kind, reason = _vllm_kind(t)
                if kind is not None:
                    raise _Miss(f"{t} called in place outside auto_functionalized (not a functional post-grad graph)")
                if reason:  # a rotary-looking op that is not one of the above (e.g. vllm::xpu_apply_rotary_emb)
                    raise _Miss(reason)
        except _Miss as e:
            misses.append((node, str(e)))
        except Exception as e:  # a graph this module does not understand: leave it alone, say why, never crash
            misses.append((node, f"could not analyse this call ({type(e).__name__}: {e}); left alone"))
    return sites, misses
