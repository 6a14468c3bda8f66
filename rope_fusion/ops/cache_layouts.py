"""The paged KV-cache layouts the cache op writes: one record per layout, looked up by the op's `kv_layout`.

A paged cache holds `num_blocks` blocks of `block_size` slots; slot s of the flat slot space is slot `s %
block_size` of block `s // block_size`, and each slot holds one token's heads. The layouts differ only in where a
(block, slot, head, lane) element lies:

- `NHD`: `[num_blocks, block_size, kv_heads, head_dim]`, vLLM's flash layout (FlashAttention, FlashInfer's NHD);
- `HND`: `[num_blocks, kv_heads, block_size, head_dim]`, FlashInfer's HND and the head-major pages of other
  backends;
- `NZ`: `[num_blocks, kv_heads * head_dim // run, block_size, run]`, Ascend's FRACTAL_NZ paged layout (`PA_NZ` of
  torch_npu's cache ops): a token's heads flattened, cut into runs of 32 bytes, run r of every slot of a block
  stored together.

A layout whose element addresses are a stride per axis (`strides`) is one a strided kernel writes directly; `NZ`
is not (its lanes are cut into runs), so the reference writes it, and the Ascend ops that take it. A new layout is
a new record here; the op, its checks and the reference read only these records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

NZ_BYTES = 32  # FRACTAL_NZ's run: 16 lanes of a 2-byte dtype, 32 of a 1-byte one


def nz_run(dtype: torch.dtype) -> int:
    """The lanes of one FRACTAL_NZ run of a cache of this dtype."""
    return max(1, NZ_BYTES // torch.empty((), dtype=dtype).element_size())


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """How one layout places a token's heads: its dims in words, the (num_blocks, block_size, heads, head_dim) of a
    cache given the head dim of what it holds, the element strides per (block, slot, head, lane) where they are one
    stride each, and the write of `values` `[n, heads, head_dim]` into the slots `(blocks[i], offsets[i])`."""

    name: str
    dims: str
    geometry: Callable[[torch.Tensor, int], tuple | str]  # (blocks, block_size, heads, head_dim), or why not
    strides: Callable[[torch.Tensor], tuple | None]
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _four_dims(cache: torch.Tensor, order: tuple) -> tuple | str:
    if cache.dim() != 4:
        return f"a 4-D cache, got shape {tuple(cache.shape)}"
    return tuple(cache.shape[i] for i in order)


def _nz_geometry(cache: torch.Tensor, head_dim: int) -> tuple | str:
    run = nz_run(cache.dtype)
    if cache.dim() != 4 or cache.shape[-1] != run:
        return f"a 4-D cache whose last dim is the {run}-lane run of {cache.dtype}, got shape {tuple(cache.shape)}"
    lanes = cache.shape[1] * run
    if lanes % head_dim:
        return f"{lanes} lanes a slot that do not split into heads of {head_dim}"
    return cache.shape[0], cache.shape[2], lanes // head_dim, head_dim


def _nz_write(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
    run = cache.shape[-1]
    cache.permute(0, 2, 1, 3)[blocks, offsets] = values.reshape(values.shape[0], -1, run)


LAYOUTS: dict[str, CacheLayout] = {}


def register_layout(layout: CacheLayout) -> None:
    LAYOUTS[layout.name] = layout


register_layout(CacheLayout(
    "NHD", "[num_blocks, block_size, kv_heads, head_dim]",
    lambda c, d: _four_dims(c, (0, 1, 2, 3)),
    lambda c: (c.stride(0), c.stride(1), c.stride(2), c.stride(3)),
    lambda c, b, o, v: c.__setitem__((b, o), v)))
register_layout(CacheLayout(
    "HND", "[num_blocks, kv_heads, block_size, head_dim]",
    lambda c, d: _four_dims(c, (0, 2, 1, 3)),
    lambda c: (c.stride(0), c.stride(2), c.stride(1), c.stride(3)),
    lambda c, b, o, v: c.transpose(1, 2).__setitem__((b, o), v)))
register_layout(CacheLayout(
    "NZ", "[num_blocks, kv_heads * head_dim // run, block_size, run] (run: 32 bytes of lanes)",
    _nz_geometry, lambda c: None, _nz_write))


def layout(name: str) -> CacheLayout:
    """The layout record of a `kv_layout` value; ValueError naming the known ones."""
    found = LAYOUTS.get(name)
    if found is None:
        raise ValueError(f"kv_layout={name!r}: expected one of {sorted(LAYOUTS)}")
    return found
