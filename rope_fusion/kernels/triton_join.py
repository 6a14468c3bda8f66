"""The Triton copy kernel that joins two tensors along a dim (ops/joins.py's CUDA planner), reading each piece's rows
where they lie.

Each piece is viewed as `[outer, rows, width]`: the dims before the join merged into one, the join's dim, and the
dims after it merged into one run of `width` contiguous elements (a token's heads and lanes). A program copies a
block of one joined row from the piece that holds it, as vector loads and stores of contiguous lanes; ATen's cat of
strided pieces computes an index per element instead. Pieces whose trailing dims are not one contiguous run, or
whose leading dims do not merge, are left to `torch.cat`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # an optional backend: the registry tolerates this
    raise ImportError(f"rope_fusion.kernels.triton_join needs triton: {e}") from e

from ..ops.joins import JOIN_KERNELS, Join
from . import triton_launch

JOIN_BLOCK = 1024  # elements a program copies: 2 KB of bf16, one 16-byte vector a thread with 4 warps
JOIN_WARPS = 4


@triton.jit
def join_kernel(a_ptr, b_ptr, out_ptr, rows, split, width, a_stride_outer, a_stride_row, b_stride_outer,
                b_stride_row, BLOCK: tl.constexpr):
    """Joined row r = (outer o, row s) of `[outer, rows, width]`: a's row s for s < split, else b's row s - split;
    grid = (outer * rows, blocks of a row)."""
    r = tl.program_id(0).to(tl.int64)
    o = r // rows
    s = r % rows
    src = tl.where(s < split, a_ptr + o * a_stride_outer + s * a_stride_row,
                   b_ptr + o * b_stride_outer + (s - split) * b_stride_row)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < width
    tl.store(out_ptr + r * width + cols, tl.load(src + cols, mask=m), mask=m)


def _merged(sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, int] | None:
    """(size, stride) of dims that walk memory as one dim (size-1 dims ignored), or None."""
    size, stride = 1, 0
    for n, st in reversed(list(zip(sizes, strides))):
        if n == 1:
            continue
        if size > 1 and st != stride * size:
            return None
        if size == 1:
            stride = st
        size *= n
    return size, stride


def _geometry(t: torch.Tensor, dim: int) -> tuple[int, int, int, int] | None:
    """(outer stride, row stride, outer size, width) of t viewed as `[outer, rows, width]`, or None where its
    trailing dims are not one contiguous run or its leading dims do not merge."""
    trail = _merged(t.shape[dim + 1:], t.stride()[dim + 1:])
    lead = _merged(t.shape[:dim], t.stride()[:dim])
    if trail is None or lead is None or trail[0] > 1 and trail[1] != 1:
        return None
    return lead[1], t.stride(dim), lead[0], trail[0]


def plan_join(first: torch.Tensor, second: torch.Tensor, dim: int) -> Join | None:
    """The runner joining pieces of this geometry along dim into a new contiguous tensor, or None where the kernel
    does not take them (another device, dtypes or shapes that do not join, strides as `_geometry` says)."""
    if first.device.type != "cuda" and not triton_launch.INTERPRETED or first.device != second.device:
        return None
    dim = dim % max(first.dim(), 1)
    if first.dtype != second.dtype or first.dim() != second.dim() or first.dim() == 0 or any(
            a != b for i, (a, b) in enumerate(zip(first.shape, second.shape)) if i != dim):
        return None
    ga, gb = _geometry(first, dim), _geometry(second, dim)
    if ga is None or gb is None or first.numel() == 0 or second.numel() == 0:
        return None
    split, shape = first.shape[dim], list(first.shape)
    shape[dim] += second.shape[dim]
    outer, width = ga[2], ga[3]
    block = min(JOIN_BLOCK, triton.next_power_of_2(width))
    grid = (outer * shape[dim], triton.cdiv(width, block))
    warps = max(1, min(JOIN_WARPS, block // 256))
    scalars = (shape[dim], split, width, ga[0], ga[1], gb[0], gb[1])

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
        kernel: Any = join_kernel  # read per call: the tests interpret the module's kernel
        kernel[grid](a, b, out, *scalars, BLOCK=block, num_warps=warps)
        return out
    return run


JOIN_KERNELS.register("cuda", plan=plan_join)
