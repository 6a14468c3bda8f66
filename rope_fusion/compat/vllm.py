"""vLLM's rotary embedding on the fused op: `_C.rotary_embedding` (in place) and MRoPE.

vLLM keeps one `cos_sin_cache` [max_position, rot_dim]: the cos half, then the sin half, each one entry per pair.
Its two halves are views that the op gathers by `positions` (the op's cache form), so nothing is copied. q and k
are flat [T, H * D] or [T, H, D]; a cache narrower than the head (rot_dim < head_size) rotates the first rot_dim
lanes of each head (partial rotary).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ops import library
from .arguments import caller_names


def _heads(t: torch.Tensor, num_tokens: int, head_size: int) -> torch.Tensor:
    """[T, H * D] or [T, H, D] as [T, H, D] (a view where the strides allow, as vLLM's `view`)."""
    if t.numel() % (num_tokens * head_size):
        raise ValueError(f"a tensor of shape {tuple(t.shape)} does not split into {num_tokens} tokens of heads of "
                         f"{head_size}")
    return t.reshape(num_tokens, -1, head_size)


def _rotate(query: torch.Tensor, key: torch.Tensor | None, head_size: int, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor | None, is_neox: bool) -> tuple:
    num_tokens = cos.shape[0] if positions is None else positions.shape[0]
    rot = dict(interleaved=not is_neox, rotary_dim=2 * cos.shape[-1])
    table = (cos[:, None], sin[:, None]) if positions is None else (cos, sin)
    pos = None if positions is None else positions[:, None]
    q = _heads(query, num_tokens, head_size)
    if key is None:
        return library.apply_rotary(q, *table, positions=pos, **rot), None
    return library.apply_rotary_qk(q, _heads(key, num_tokens, head_size), *table, positions=pos, **rot)


@caller_names(x="query", q="query", k="key", cos="cos_sin_cache", sin="cos_sin_cache")
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """vLLM's `_C.rotary_embedding`: rotates query and key in place; key may be None (cross-layer KV sharing).

    In place means the op's result is copied back into query and key (one extra write of each), as the op is
    functional; a caller that can take new tensors uses `mrope_rotary_embedding` with 1-D positions instead.

    positions: [T] (or [B, S], flattened as vLLM does); query [T, H * D] or [T, H, D]; cos_sin_cache
    [max_position, rot_dim] with rot_dim <= head_size."""
    positions = positions.flatten()
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] % 2 or cos_sin_cache.shape[-1] > head_size:
        raise ValueError(f"cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= head_size="
                         f"{head_size}, got {tuple(cos_sin_cache.shape)}")
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    q_out, k_out = _rotate(query, key, head_size, cos, sin, positions, is_neox)
    query.copy_(q_out.view(query.shape))
    if key is not None:
        key.copy_(k_out.view(key.shape))


def _mrope_tables(cache: torch.Tensor, positions: torch.Tensor, mrope_section: Sequence[int],
                  interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token tables of MRoPE: pair j reads the row of the position stream (T, H or W) that owns it.

    Chunked layout (Qwen2-VL): the first mrope_section[0] pairs read stream 0, the next mrope_section[1] stream
    1, the rest stream 2. Interleaved layout (Qwen3-VL): pair j reads stream j % 3 while that stream has pairs
    left (j < 3 * mrope_section[1] for H, 3 * mrope_section[2] for W), stream 0 otherwise."""
    half = cache.shape[-1] // 2
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to rot_dim / 2 = {half}")
    lanes = torch.arange(half, device=cache.device)
    if interleaved:
        stream = torch.zeros(half, dtype=torch.long, device=cache.device)
        stream = torch.where((lanes % 3 == 1) & (lanes < 3 * mrope_section[1]), 1, stream)
        stream = torch.where((lanes % 3 == 2) & (lanes < 3 * mrope_section[2]), 2, stream)
    else:
        stream = torch.repeat_interleave(torch.arange(len(mrope_section), device=cache.device),
                                         torch.tensor(list(mrope_section), device=cache.device))
    rows = positions[stream]  # [half, T]: the position each pair reads
    cos = cache[:, :half][rows.T, lanes]  # [T, half]
    sin = cache[:, half:][rows.T, lanes]
    return cos, sin


@caller_names(x="query", q="query", k="key", cos="cos_sin_cache", sin="cos_sin_cache")
def mrope_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                           cos_sin_cache: torch.Tensor, is_neox: bool, mrope_section: Sequence[int] | None = None,
                           mrope_interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `MRotaryEmbedding.forward_native`: returns the rotated (query, key) in their input shapes.

    positions [T]: plain RoPE; [3, T]: the T/H/W position streams, pairs assigned to streams by mrope_section."""
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] % 2 or cos_sin_cache.shape[-1] > head_size:
        raise ValueError(f"cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= head_size="
                         f"{head_size}, got {tuple(cos_sin_cache.shape)}")
    if positions.dim() == 1:
        cos, sin = cos_sin_cache.chunk(2, dim=-1)
        q, k = _rotate(query, key, head_size, cos, sin, positions, is_neox)
    elif positions.dim() == 2 and positions.shape[0] == 3:
        if not mrope_section:
            raise ValueError("positions of shape [3, T] need mrope_section")
        cos, sin = _mrope_tables(cos_sin_cache, positions, mrope_section, mrope_interleaved)
        q, k = _rotate(query, key, head_size, cos, sin, None, is_neox)
    else:
        raise ValueError(f"positions must be [T] or [3, T], got {tuple(positions.shape)}")
    return q.reshape(query.shape), k.reshape(key.shape)
