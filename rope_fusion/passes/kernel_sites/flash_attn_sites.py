"""flash-attn's Triton `rotary_kernel` launches as sites of the fused op (kind "flash_attn.rotary_kernel").

See kernel_sites.py for what every kind shares; this module identifies the kernel, checks each launch and says
which rows of its tables it reads (`FlashAttnTables`).

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

Varlen (IS_VARLEN, CU_SEQLENS [B + 1]): X and OUT are packed [T, H, D]; the program of sequence b covers rows
s < min(cu_seqlens[b + 1] - cu_seqlens[b], grid rows) of the tokens from cu_seqlens[b] on, with `seqlen` the
caller's max_seqlen, and reads table row s + offset as above. A site is then the op's packed form (cu_seqlens,
docs/design.md section 2): the same rows, on the contract flash-attn's wrapper states (every sequence at most
max_seqlen long, cu_seqlens covering the T tokens). Where a caller breaks it the kernel leaves tokens unwritten
(garbage in `empty_like`); the op rotates a longer sequence's tokens too, and raises for a token outside every
sequence.

What is verified from the graph before a site is claimed: X and OUT are 4-D of one shape (varlen: 3-D, and the
kernel's varlen addressing is in its source, `varlen_markers`; CU_SEQLENS a contiguous int32/int64 [B + 1]) and
the stride arguments are their real strides (size-1 dims excepted; a varlen launch's batch strides are never
read); seqlen (and nheads) equal X's (varlen: seqlen is max_seqlen); the grid
covers exactly the programs the kernel needs (axes from the source; unmasked axes equal, masked ones at least);
BLOCK_K (v1) a power of two >= R; R even, 0 < R <= D; COS and SIN are [seqlen_ro, R/2] with row stride R/2
and seqlen_ro equals their row count; an int offset satisfies 0 <= offset and offset + S <= seqlen_ro (so no
row falls off the table); a tensor offset is a contiguous int32/int64 [B] tensor; dtypes fp16/bf16/fp32 (an
fp64 input would make the fused op compute in fp64, the kernel computes in fp32); and when R < D, OUT's lanes
>= R hold x's: OUT is X itself (inplace=True), or OUT is `slice_scatter(buf, slice(X, -1, R, >=D), -1, R, >=D)`
(optionally through `aten.copy`), which is what the wrapper's `output[..., rotary_dim:].copy_(x[...,
rotary_dim:])` becomes. Obligation left to the emitter: with a TENSOR offset the graph cannot show the
offsets' values; rows p >= seqlen_ro rotate by the identity (cos=1, sin=0) -- pad the tables with such a row
and clamp p to reproduce it (`FlashAttnTables.emit` emits exactly that, and `flash_attn_tables` below is the same
in plain torch, for the tests); a negative offset makes the kernel read before the table (undefined
behaviour; the emitted positions are clamped at 0). Inputs of a later launch that are `getitem(earlier_launch, name)`
with name != "OUT" (torch's all-inputs-mutated fallback when its TTIR analysis cannot run) are seen through:
the kernel stores only through OUT, which is checked in its source. The site's output dtype is OUT's
(`site.node.meta["val"].dtype`).

Not expressible (reported): a varlen kernel whose source lacks the verified varlen addressing; in-place
`triton_kernel_wrapper_mutation` (no result node; custom post-grad passes see the functional form); autotuned
launches (several grids); anything the checks above reject.

The op's tables for a site (`FlashAttnTables.emit`, when its group is planned):
- int offset o: rows [o, o+S) of the [seqlen_ro, R/2] tables (`aten.slice` on dim 0; the checks guarantee
  o + S <= seqlen_ro), `unsqueeze(-2)` over the heads: [S, 1, R/2] against x [B, S, H, D].
- tensor offsets [B]: positions = clamp(offsets[:, None] + iota(S), 0, seqlen_ro) as [B, S, 1], into the tables
  padded with one row (cos=1, sin=0) at index seqlen_ro: a row the kernel would read past the table rotates by the
  identity, as its masked load (other=1.0 / 0.0) does. (A negative offset is undefined behaviour in the kernel,
  which reads before the table; here it reads row 0.)
- varlen (x [T, H, D], cu_seqlens [B + 1]): the op's packed form. An int offset o: the tables from row o on and
  the op's `cu_seqlens` (flash-attn's host check o + max_seqlen <= seqlen_ro, verified, keeps every row of a
  sequence within max_seqlen in the table). Offsets [B]: the positions that the op would derive (ops/packed.py's
  ATen ops, emitted here), clamped into the tables padded with the identity row, as above.
Two launches read the same numbers when they read the same cos and sin nodes with the same offset (int value or
offsets node), the same sequence length and the same cu_seqlens (the record's equality). A launch with an int
offset also pairs with a native (aten) rotation whose tables are views reading the same rows of the same cos and
sin (`FlashAttnTables.fixed_rows`, compared in grouping.py): a kernel call for q and torch ops for k, one launch.

When torch's TTIR analysis could not run, it assumes every input of a launch is mutated: the launch also returns
`getitem(launch, "X"/"COS"/...)`, which later launches read and which are copied back into graph inputs; those
would keep the kernel alive once its OUT is replaced. The kernel stores only through OUT (verified from its
source), so each such getitem equals the launch's input; for a launch that became a site their uses are rewired
to that input (`FlashAttnTables.claimed`: value-preserving, inside the pass's transaction), and the copy back
becomes `copy_(input, input)`, which Inductor drops.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator
import re
import sys
from typing import Any

import torch
import torch.fx

from ...ops import packed
from ..analysis.site import KernelTables, Site
from .graph_values import (
    KernelMiss,
    contiguous,
    contiguous_rows,
    eq,
    ge,
    known,
    size_key,
    static_bool,
    static_int,
    tensor_of,
    value_of,
)
from .kernel_sites import FLOATS, LOOKS_ROTARY, check_before, getitems, is_call, kernel_site, kernel_site_of

aten = torch.ops.aten
prims = torch.ops.prims

FLASH_ATTN = "flash_attn.rotary_kernel"
FLASH_ATTN_MODULES = ("flash_attn.ops.triton.rotary", "vllm.vllm_flash_attn.ops.triton.rotary")


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
    varlen_markers: tuple = ()  # and, for a varlen launch, these: the rows and the x/OUT addressing of a sequence


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
        ("start_idx=tl.load(CU_SEQLENS+pid_batch)", "seqlen=tl.load(CU_SEQLENS+pid_batch+1)-start_idx",
         "X=X+start_idx*stride_x_seqlen+pid_head*stride_x_nheads",
         "OUT=OUT+start_idx*stride_out_seqlen+pid_head*stride_out_nheads", "ifpid_m*BLOCK_M>=seqlen:return"),
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
        ("start_idx=tl.load(CU_SEQLENS+pid_batch)", "seqlen=tl.load(CU_SEQLENS+pid_batch+1)-start_idx",
         "X=X+start_idx*stride_x_seqlen", "OUT=OUT+start_idx*stride_out_seqlen"),
    ),
)


@dataclasses.dataclass(frozen=True)
class FlashAttnKernel:
    variant: _FaVariant
    axes: dict  # "m" | "head" | "batch" -> grid axis


def unwrap_jit(kernel: Any):
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
def _identify_jit(jit: Any) -> FlashAttnKernel | str | None:
    """FlashAttnKernel when `jit` is a verified flash-attn rotary_kernel; a reason when it is rotary-looking but not
    verified; None when it has nothing to do with rotary embeddings."""
    fn = getattr(jit, "fn", None)
    module, name = getattr(fn, "__module__", ""), getattr(fn, "__name__", "")
    label = f"{module}.{name}"
    looks = bool(LOOKS_ROTARY.search(name)) or module in FLASH_ATTN_MODULES
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
    return FlashAttnKernel(variant, axes)


def identify_launch(node: torch.fx.Node) -> FlashAttnKernel | str | None:
    kernel = _kernel_of(node)
    if kernel is None:
        return None
    jit = unwrap_jit(kernel)
    if jit is None:
        return None
    try:
        return _identify_jit(jit)
    except TypeError:  # unhashable kernel object
        return _identify_jit.__wrapped__(jit)


def triton_wrappers():
    from torch._higher_order_ops.triton_kernel_wrap import (
        triton_kernel_wrapper_functional,
        triton_kernel_wrapper_mutation,
    )
    return triton_kernel_wrapper_functional, triton_kernel_wrapper_mutation


def see_through(a: Any) -> Any:
    """getitem(launch of a verified rotary_kernel, name != "OUT") is that launch's input `name` (the kernel stores
    only through OUT); applied repeatedly."""
    functional, _ = triton_wrappers()
    for _ in range(64):
        if not (is_call(a, operator.getitem) and is_call(a.args[0], functional) and isinstance(a.args[1], str)
                and a.args[1] != "OUT"):
            return a
        launch = a.args[0]
        if not isinstance(identify_launch(launch), FlashAttnKernel):
            return a
        inner = launch.kwargs["kwargs"].get(a.args[1])
        if not isinstance(inner, torch.fx.Node):
            return a
        a = inner
    return a


# ------------------------------------------------------------------------------------------------------------
# flash-attn rotary_kernel: arguments -> Site

def _last_dim(d: Any, ndim: int) -> bool:
    return isinstance(d, int) and d in (ndim - 1, -1)


def _tail_slice_of(src: Any, x: torch.fx.Node, r: int, d: int, ndim: int) -> bool:
    """src is x[..., r:] (aten.slice on the last dim, start r, end >= d, step 1)."""
    if not is_call(src, torch.ops.aten.slice.Tensor):
        return False
    a = list(src.args) + [None] * (5 - len(src.args))
    base, dim, start, end, step = a[:5]
    dim = 0 if dim is None else dim
    step = 1 if step is None else step
    return (see_through(base) is x and _last_dim(dim, ndim) and start == r and step == 1
            and (end is None or (isinstance(end, int) and end >= d)))


def _tail_is_x(out: torch.fx.Node, x: torch.fx.Node, r: int, d: int, ndim: int) -> bool:
    """OUT's lanes >= r hold x's: OUT = slice_scatter(buf, x[..., r:], -1, r, >=d) (maybe via aten.copy)."""
    if not is_call(out, torch.ops.aten.slice_scatter.default):
        return False
    a = list(out.args) + [None] * (6 - len(out.args))
    _buf, src, dim, start, end, step = a[:6]
    dim = 0 if dim is None else dim
    step = 1 if step is None else step
    if not (_last_dim(dim, ndim) and start == r and step == 1 and (end is None or (isinstance(end, int) and end >= d))):
        return False
    if is_call(src, torch.ops.aten.copy.default):
        dst_v, src_v = value_of(src.args[0]), value_of(src.args[1])
        if not (isinstance(dst_v, torch.Tensor) and isinstance(src_v, torch.Tensor)
                and tuple(dst_v.shape) == tuple(src_v.shape)):
            return False
        src = src.args[1]
    return _tail_slice_of(src, x, r, d, ndim)


def _check_strides(args: dict, prefix: str, t: torch.Tensor, what: str, varlen: bool = False) -> None:
    """The stride arguments are t's real strides; a varlen launch's t is [T, H, D], and the kernel never reads its
    batch strides."""
    dims = ("seqlen", "nheads", "headdim") if varlen else ("batch", "seqlen", "nheads", "headdim")
    for i, dim in enumerate(dims):
        if known(t.shape[i] == 1):
            continue
        if not eq(args[f"stride_{prefix}_{dim}"], t.stride(i)):
            raise KernelMiss(f"stride_{prefix}_{dim}={value_of(args[f'stride_{prefix}_{dim}'])} is not {what}'s real "
                             f"stride {t.stride(i)} (shape {tuple(t.shape)}, strides {tuple(t.stride())})")


def _cdiv(a: Any, b: int) -> Any:
    return (a + b - 1) // b


@dataclasses.dataclass(frozen=True)
class _Operands:
    """A launch's tensor operands, seen through earlier verified launches (`see_through`): the nodes a site
    reads, and their fake values, which every later check reads."""

    x_node: torch.fx.Node
    out_node: torch.fx.Node
    cos_node: torch.fx.Node
    sin_node: torch.fx.Node
    x: torch.Tensor
    out: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def _launch_args(node: torch.fx.Node, v: _FaVariant) -> dict:
    """The launch's arguments by name: constants live in the side table, tensors and SymInts in the node; an
    autotuned launch passes some through its configs, which the graph does not show."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    consts = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
    args = {**consts, **node.kwargs["kwargs"]}
    missing = [n for n in v.arg_names if n not in args]
    if missing:
        raise KernelMiss(f"arguments {missing} missing from the launch (autotuned configs are not supported)")
    return args


def _is_varlen(node: torch.fx.Node, v: _FaVariant, args: dict) -> bool:
    """IS_VARLEN, agreeing with CU_SEQLENS; a varlen launch is claimed only where the kernel's source holds the
    varlen addressing that was verified (the signature alone does not fix it)."""
    varlen = static_bool(args["IS_VARLEN"], "IS_VARLEN")
    if varlen != (args["CU_SEQLENS"] is not None):
        raise KernelMiss(f"IS_VARLEN={varlen} with CU_SEQLENS {'absent' if varlen else 'given'}")
    if varlen:
        src = re.sub(r"\s+", "", getattr(unwrap_jit(_kernel_of(node)), "src", "") or "")
        missing = [m for m in v.varlen_markers if m not in src]
        if missing or not v.varlen_markers:
            raise KernelMiss(f"IS_VARLEN: the kernel's varlen addressing differs from the verified one (lacks "
                             f"{missing[0] if missing else 'its markers'!r})")
    return varlen


def _operands(args: dict, varlen: bool) -> _Operands:
    """X, OUT, COS and SIN as tensor nodes, X and OUT of one [B, S, H, D] (varlen: [T, H, D]) shape, all in a
    dtype the kernel's fp32 math matches exactly."""
    nodes = {nm: see_through(args[nm]) for nm in ("X", "OUT", "COS", "SIN")}
    for nm, nd in nodes.items():
        if not isinstance(nd, torch.fx.Node):
            raise KernelMiss(f"{nm} is not a tensor node ({nd!r})")
    vals = {nm: tensor_of(nd, nm) for nm, nd in nodes.items()}
    x, out = vals["X"], vals["OUT"]
    if x.dim() != (3 if varlen else 4) or tuple(out.shape) != tuple(x.shape):
        want = "[T, H, D] (varlen)" if varlen else "[B, S, H, D]"
        raise KernelMiss(f"X {tuple(x.shape)} / OUT {tuple(out.shape)}: expected both {want} of one shape")
    for nm, t in vals.items():
        if t.dtype not in FLOATS:
            raise KernelMiss(f"{nm} has dtype {t.dtype}; the kernel computes in fp32 and the fused op is exact only "
                             f"for fp16/bf16/fp32 inputs")
    return _Operands(nodes["X"], nodes["OUT"], nodes["COS"], nodes["SIN"], x, out, vals["COS"], vals["SIN"])


def _batch_dims(args: dict, x: torch.Tensor, varlen: bool) -> tuple:
    """(cu_seqlens node or None, B, S, H, D). A varlen x is [T, H, D]: the batch is cu_seqlens' [B + 1] and S is
    max_seqlen, the rows a program covers."""
    if not varlen:
        return (None, *x.shape)
    cu_node = see_through(args["CU_SEQLENS"])
    cu = tensor_of(cu_node, "CU_SEQLENS")
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or not contiguous(cu):
        raise KernelMiss(f"CU_SEQLENS {cu.dtype} {tuple(cu.shape)}: expected a contiguous int32/int64 [B + 1]")
    h, d = x.shape[1:]
    return cu_node, cu.shape[0] - 1, static_int(args["seqlen"], "max_seqlen"), h, d


def _rotary_dim(args: dict, v: _FaVariant, h: Any, head_dim: int) -> int:
    """R, which the two signatures pass differently (v1 also sizes its lane block by it, v2 its head block by
    nheads), checked to be a rotation the op can express."""
    if v.name == "v1":
        r = static_int(args["rotary_dim"], "rotary_dim")
        block_k = static_int(args["BLOCK_K"], "BLOCK_K")
        if block_k < r or block_k & (block_k - 1):
            raise KernelMiss(f"BLOCK_K={block_k} does not cover rotary_dim={r} (a power of two >= rotary_dim is "
                             f"needed)")
    else:
        r = static_int(args["ROTARY_DIM"], "ROTARY_DIM")
        if not eq(args["nheads"], h):
            raise KernelMiss(f"nheads={value_of(args['nheads'])} is not X's head count {h}")
    if r <= 0 or r % 2 or r > head_dim:
        raise KernelMiss(f"rotary_dim={r} must be even and in (0, head_dim={head_dim}]")
    return r


def _check_tables(args: dict, ops: _Operands, r: int) -> None:
    """COS and SIN are what the kernel reads: [seqlen_ro, R/2] with row stride R/2."""
    for nm, t in (("COS", ops.cos), ("SIN", ops.sin)):
        if t.dim() != 2 or not eq(t.shape[1] * 2, r) or not contiguous_rows(t):
            raise KernelMiss(f"{nm} shape {tuple(t.shape)} strides {tuple(t.stride())}: the kernel reads a contiguous "
                             f"[seqlen_ro, rotary_dim/2={r // 2}] table")
        if not eq(args["seqlen_ro"], t.shape[0]):
            raise KernelMiss(f"seqlen_ro={value_of(args['seqlen_ro'])} is not {nm}'s row count {t.shape[0]}")


def _check_grid(node: torch.fx.Node, fk: FlashAttnKernel, args: dict, b: Any, h: Any, x: torch.Tensor) -> None:
    """The grid launches every program the kernel needs and no unmasked extra one (axes read from the source)."""
    grid = node.kwargs["grid"]
    if not isinstance(grid, (list, tuple)) or len(grid) != 1 or len(grid[0]) != 3:
        raise KernelMiss(f"grid {grid!r}: expected one 3-D grid (autotuned launches are not supported)")
    g = grid[0]
    block_m = static_int(args["BLOCK_M"], "BLOCK_M")
    ok_m = ge(g[fk.axes["m"]], _cdiv(value_of(args["seqlen"]), block_m))
    ok_b = eq(g[fk.axes["batch"]], b)
    if fk.variant.name == "v1":
        ok_h = eq(g[fk.axes["head"]], h)
    else:
        ok_h = ge(g[fk.axes["head"]], _cdiv(h, static_int(args["BLOCK_H"], "BLOCK_H")))
    if not (ok_m and ok_b and ok_h):
        raise KernelMiss(f"grid {tuple(value_of(e) for e in g)} does not match the launch (axes {fk.axes}, "
                         f"X {tuple(x.shape)}, BLOCK_M={block_m})")


def _seqlen_offset(args: dict, b: Any, s: Any, cos: torch.Tensor) -> int | torch.fx.Node:
    """Where the positions into the tables start: a contiguous [B] tensor's node, or an int that keeps every row
    within the table (the graph can show an int's rows, not a tensor's: those the emitter pads for)."""
    if static_bool(args["IS_SEQLEN_OFFSETS_TENSOR"], "IS_SEQLEN_OFFSETS_TENSOR"):
        off_node = see_through(args["SEQLEN_OFFSETS"])
        off = tensor_of(off_node, "SEQLEN_OFFSETS")
        if off.dtype not in (torch.int32, torch.int64) or off.dim() != 1 or not eq(off.shape[0], b):
            raise KernelMiss(f"SEQLEN_OFFSETS {off.dtype} {tuple(off.shape)}: expected an int32/int64 [B={b}] tensor")
        if not (known(off.shape[0] == 1) or known(off.stride(0) == 1)):
            raise KernelMiss("SEQLEN_OFFSETS is not contiguous")
        return off_node
    raw = args["SEQLEN_OFFSETS"]
    if isinstance(value_of(raw), torch.Tensor):
        raise KernelMiss("SEQLEN_OFFSETS is a tensor but IS_SEQLEN_OFFSETS_TENSOR is False")
    off_i = static_int(raw, "int SEQLEN_OFFSETS")
    if off_i < 0 or not known(off_i + s <= cos.shape[0]):
        raise KernelMiss(f"int SEQLEN_OFFSETS={off_i} with seqlen {s} reaches past seqlen_ro={cos.shape[0]} rows "
                         f"(the kernel would use cos=1, sin=0 there) or is negative")
    return off_i


def flash_attn_site(node: torch.fx.Node, fk: FlashAttnKernel) -> Site | None:
    """The site of one launch, or None when its result is unused; KernelMiss names the first check (the module
    docstring lists them) that the launch fails, so a near miss says what to change."""
    args = _launch_args(node, fk.variant)
    varlen = _is_varlen(node, fk.variant, args)
    outs = getitems(node, "OUT")
    if not outs:
        return None  # result unused: nothing to replace
    if len(outs) > 1:
        raise KernelMiss("several getitem(..., 'OUT') nodes for one launch")
    ops = _operands(args, varlen)
    cu_node, b, s, h, d = _batch_dims(args, ops.x, varlen)
    head_dim = static_int(d, "X's head dim")
    r = _rotary_dim(args, fk.variant, h, head_dim)
    if not varlen and not eq(args["seqlen"], s):
        raise KernelMiss(f"seqlen={value_of(args['seqlen'])} is not X's sequence length {s}")
    _check_strides(args, "x", ops.x, "X", varlen)
    _check_strides(args, "out", ops.out, "OUT", varlen)
    _check_tables(args, ops, r)
    _check_grid(node, fk, args, b, h, ops.x)
    seqlen_offset = _seqlen_offset(args, b, s, ops.cos)
    ndim = ops.x.dim()
    if r < head_dim and ops.out_node is not ops.x_node and not _tail_is_x(ops.out_node, ops.x_node, r, head_dim, ndim):
        raise KernelMiss(f"the output buffer's lanes >= rotary_dim={r} are not x's (expected inplace=True or the "
                         f"wrapper's output[..., rotary_dim:].copy_(x[..., rotary_dim:]))")
    seqlen = size_key(ops.x.shape[0 if varlen else 1])
    tables = FlashAttnTables(ops.cos_node, ops.sin_node, seqlen_offset, cu_node, seqlen)
    return kernel_site_of(outs[0], ops.x_node, head_dim, tables, rotary_dim=r,
                          interleaved=static_bool(args["INTERLEAVED"], "INTERLEAVED"),
                          conjugate=static_bool(args["CONJUGATE"], "CONJUGATE"))


@kernel_site(FLASH_ATTN)
def recognise_flash_attn(node: torch.fx.Node) -> list[Site] | None:
    """A launch of flash-attn's rotary_kernel (functional form): its site, or KernelMiss with the reason."""
    functional, mutation = triton_wrappers()
    if node.target is not functional and node.target is not mutation:
        return None
    fk = identify_launch(node)
    if fk is None:
        return None
    if isinstance(fk, str):
        raise KernelMiss(fk)
    if node.target is mutation:
        raise KernelMiss("in-place triton_kernel_wrapper_mutation launch of flash-attn rotary_kernel: it has no "
                         "result node to replace (post-grad custom passes see the functional form)")
    site = flash_attn_site(node, fk)
    if site is None:
        return []
    kept = next((k for k in KEPT_LAUNCHES if k.keeps(site)), None)
    if kept is not None:
        raise KernelMiss(f"flash-attn's own launch kept: {kept.why}")
    return [site]


@dataclasses.dataclass(frozen=True)
class KeptLaunches:
    """Launches of flash-attn's kernel that stay as they are because its two launches (q, then k) measured faster
    than the one fused launch that would replace them. A launch is kept when it rotates whole rows of exactly
    `lanes` lanes in the `interleaved` form over at least `min_tokens` tokens (a static count: a symbolic one, as
    vLLM compiles, runs decode too, where one launch for q and k beats two)."""

    lanes: int
    interleaved: bool
    min_tokens: int
    why: str

    def keeps(self, site: Site) -> bool:
        val = site.node.meta["val"]
        tokens = 1
        for d in val.shape[:-2]:
            if not isinstance(d, int):
                return False
            tokens *= d
        return (site.params.interleaved is self.interleaved and site.params.rotary_dim == self.lanes
                and val.shape[-1] == self.lanes and tokens >= self.min_tokens)


# Measured on the H200 (torch 2.11, triton 3.6; benchmarks.vllm_omni, CUDA-graph replay, x the q+k clone floor),
# vLLM 0.33's copy of flash-attn's kernel, two launches, against the merged launch: 4608 tokens x 24/24 heads x 128
# interleaved 2.32 against 1.04, 32760 x 40/40 x 128 2.51 against 1.02. An earlier run with another copy of the
# kernel file measured 1.068 and 1.031 for its launches, the merged launch then 1.104 and 1.049; the planner's warps
# for whole 128-lane rows since (kernels/triton_plan.py) brought it under both. So no launch is kept today; a
# KeptLaunches record here keeps the launches it describes where a GPU measures them faster.
KEPT_LAUNCHES: tuple = ()


@dataclasses.dataclass(frozen=True)
class FlashAttnTables(KernelTables):
    """The rows of a launch's [seqlen_ro, R/2] cos and sin: from `seqlen_offset` (an int, or a [B] tensor node) on,
    over `rows` sequence positions (x's S, or its T tokens packed by `cu_seqlens`; an int or a symbolic size's
    expression)."""

    cos: torch.fx.Node
    sin: torch.fx.Node
    seqlen_offset: int | torch.fx.Node
    cu_seqlens: torch.fx.Node | None
    rows: Any
    kind = FLASH_ATTN

    def tensors(self, nodes: dict) -> list[torch.fx.Node]:
        return [self.cos, self.sin]

    @property
    def row_inputs(self) -> tuple:
        return tuple(n for n in (self.seqlen_offset, self.cu_seqlens) if isinstance(n, torch.fx.Node))

    def fixed_rows(self, site: Site) -> tuple | None:
        """`cos[o:o+S].unsqueeze(-2)` and sin's ([S, 1, R/2] against x [B, S, H, D]), what `emit` emits, for an
        int offset o without packed sequences; call it in the graph's fake mode."""
        if isinstance(self.seqlen_offset, torch.fx.Node) or self.cu_seqlens is not None:
            return None
        off, seqlen = self.seqlen_offset, site.node.meta["val"].shape[1]
        return tuple(t.meta["val"][off: off + seqlen].unsqueeze(-2) for t in (self.cos, self.sin))

    def emit(self, em: Any, site: Site, nodes: dict) -> tuple:
        if self.cu_seqlens is not None:
            return self._packed(em, site, nodes[site.x.name])
        like, x = site.node, nodes[site.x.name]
        seqlen = em.size_args(x, range(1, 2), like)[0]
        rows = self.cos.meta["val"].shape[0]
        off = self.seqlen_offset
        if not isinstance(off, torch.fx.Node):  # rows [off, off + S) of the tables, the same for every batch and head
            out = []
            for t in (self.cos, self.sin):
                if not (off == 0 and eq(seqlen, rows)):
                    end = seqlen if off == 0 else off + seqlen if isinstance(seqlen, int) else \
                        em.call(operator.add, (seqlen, off), like=like)
                    t = em.call(aten.slice.Tensor, (t, 0, off, end), like=like)
                out.append(em.call(aten.unsqueeze.default, (t, -2), like=like))
            return out[0], out[1], None
        # per-batch offsets: positions into the tables padded with the kernel's identity row at index seqlen_ro
        steps = em.call(prims.iota.default, (seqlen,), {"start": 0, "step": 1, "dtype": torch.int64,
                                                        "device": x.meta["val"].device, "requires_grad": False},
                        like=like)
        pos = em.call(aten.add.Tensor, (em.call(aten.unsqueeze.default, (off, -1), like=like), steps), like=like)
        pos = em.call(aten.unsqueeze.default, (self._clamped(em, pos, like), -1), like=like)  # [B, S, 1] over H
        check_before(off, pos)
        return (*self._padded(em, like), pos)

    def _packed(self, em: Any, site: Site, x: torch.fx.Node) -> tuple:
        """(cos, sin, None, cu_seqlens, None) for an int offset: the op derives the rows; (padded cos, padded sin,
        positions) for offsets [B]: the op's rows, clamped into the identity row at index seqlen_ro."""
        like, off = site.node, self.seqlen_offset
        if not isinstance(off, torch.fx.Node):
            cos, sin = self.cos, self.sin
            if off:
                rows = self.cos.meta["val"].shape[0]
                end = rows if isinstance(rows, int) else em.size_args(self.cos, range(1), like)[0]
                cos, sin = (em.call(aten.slice.Tensor, (t, 0, off, end), like=like) for t in (cos, sin))
            return cos, sin, None, self.cu_seqlens, None
        pos = packed.graph_positions(em, x, self.cu_seqlens, off, like)  # [T, 1] over x's [T, H]
        check_before(off, pos)
        check_before(self.cu_seqlens, pos)
        return (*self._padded(em, like), self._clamped(em, pos, like))

    def _clamped(self, em: Any, pos: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
        """Positions clamped into [0, seqlen_ro]: row seqlen_ro is the identity row of `_padded`."""
        rows = self.cos.meta["val"].shape[0]
        limit = rows if isinstance(rows, int) else em.size_args(self.cos, range(1), like)[0]
        return em.call(aten.clamp_max.default, (em.call(aten.clamp_min.default, (pos, 0), like=like), limit),
                       like=like)

    def _padded(self, em: Any, like: torch.fx.Node) -> tuple:
        """The tables with the kernel's out-of-table row (cos=1, sin=0) appended."""
        return (em.call(aten.constant_pad_nd.default, (self.cos, [0, 0, 0, 1], 1.0), like=like),
                em.call(aten.constant_pad_nd.default, (self.sin, [0, 0, 0, 1], 0.0), like=like))

    def claimed(self, site: Site) -> None:
        """Rewire getitem(launch, name != "OUT") to the launch's input `name` (the module docstring says why)."""
        launch = site.node.args[0]
        functional, _ = triton_wrappers()
        if not (isinstance(launch, torch.fx.Node) and launch.target is functional):
            return
        if not isinstance(identify_launch(launch), FlashAttnKernel):
            return
        inputs = launch.kwargs["kwargs"]
        out_input = see_through(inputs.get("OUT"))
        for user in list(launch.users):
            name = user.args[1] if user.target is operator.getitem else None
            if not isinstance(name, str) or name == "OUT":
                continue
            source = see_through(inputs.get(name))
            if not isinstance(source, torch.fx.Node) or source is out_input or not _same_layout(source, user):
                continue
            user.replace_all_uses_with(source)


def _same_layout(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    return (va.dtype == vb.dtype and va.dim() == vb.dim()
            and all(known(x == y) for x, y in zip((*va.shape, *va.stride()), (*vb.shape, *vb.stride()))))


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
