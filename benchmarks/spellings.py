"""RoPE spellings as models write them (catalogue.md), as plain PyTorch functions for the benchmarks.

Each spelling rotates q and k ([B,S,H,D], head counts may differ) and comes with its own tables, built the
way the model builds them, plus the arguments the fused op gets for the same rotation (`fused`): what the
pass would emit, so the Triton kernel can also be timed directly, independent of the matcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Spelling:
    code: str  # catalogue row
    name: str
    make_tables: Callable[[int, int, int, torch.device], tuple]  # (B, S, D, device) -> tables
    apply: Callable[..., tuple]  # (q, k, *tables) -> (q_out, k_out)
    fused: Callable[..., tuple]  # (*tables) -> (cos, sin, op kwargs without out_dtype)
    neox_full_tables: bool = False  # Liger takes these (cos, sin as [1,S,D] full NeoX tables)


def _angles(S: int, n: int, device) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(n, device=device, dtype=torch.float64) / n))
    return torch.arange(S, device=device, dtype=torch.float64)[:, None] * inv  # [S, n]


# -- I1: diffusers Wan: unflatten/unbind, empty_like + strided slice assignment, full-il fp32 tables ------
def _wan_tables(B, S, D, device):
    a = _angles(S, D // 2, device).repeat_interleave(2, -1).float()
    return a.cos().view(1, S, 1, D), a.sin().view(1, S, 1, D)


def _wan_one(x, freqs_cos, freqs_sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def wan(q, k, freqs_cos, freqs_sin):
    return _wan_one(q, freqs_cos, freqs_sin), _wan_one(k, freqs_cos, freqs_sin)


def _wan_fused(freqs_cos, freqs_sin):
    return freqs_cos[..., 0::2], freqs_sin[..., 1::2], dict(interleaved=True, full_tables=False)


# -- I2: diffusers Helios: one packed fp32 [B,S,2D] tensor, cos then sin, chunked inside ------------------
def _helios_tables(B, S, D, device):
    c, s = _wan_tables(B, S, D, device)
    return (torch.cat((c, s), -1).view(1, S, 2 * D).expand(B, S, 2 * D).contiguous(),)


def _helios_one(x, freqs):
    cos, sin = freqs.unsqueeze(-2).chunk(2, dim=-1)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
    return out.type_as(x)


def helios(q, k, freqs):
    return _helios_one(q, freqs), _helios_one(k, freqs)


def _helios_fused(freqs):
    cos, sin = freqs.unsqueeze(-2).chunk(2, dim=-1)
    return cos[..., 0::2], sin[..., 1::2], dict(interleaved=True, full_tables=False)


# -- I3: vllm-omni Wan2.2: unbind, stack + flatten, half bf16 tables --------------------------------------
def _half_tables(B, S, D, device, dtype=torch.bfloat16):
    a = _angles(S, D // 2, device)
    return a.cos().to(dtype).view(1, S, 1, D // 2), a.sin().to(dtype).view(1, S, 1, D // 2)


def _stack_one(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


def stack_flatten(q, k, cos, sin):
    return _stack_one(q, cos, sin), _stack_one(k, cos, sin)


def _half_il_fused(cos, sin):
    return cos, sin, dict(interleaved=True, full_tables=False)


# -- N1: transformers Llama: rotate_half by cat, full NeoX tables cast to x dtype --------------------------
def _neox_tables(B, S, D, device):
    a = _angles(S, D // 2, device)
    a = torch.cat((a, a), -1).float()
    return a.cos().view(1, S, 1, D), a.sin().view(1, S, 1, D)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_neox(q, k, cos, sin):
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _neox_fused(cos, sin):
    return cos, sin, dict(interleaved=False, full_tables=True)


# -- N3: GPT-NeoX / Phi partial rotary: rotate the first half of the head dim, cat the pass-through tail ----
def _partial_tables(B, S, D, device):
    return _neox_tables(B, S, D // 2, device)


def partial_neox(q, k, cos, sin):
    r = cos.shape[-1]
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)

    def one(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)

    return one(q), one(k)


# -- C2 / C1: view_as_complex times complex freqs (Qwen-Image complex64, Wan original complex128) ----------
def _complex_tables(B, S, D, device, dtype):
    a = _angles(S, D // 2, device)
    return (torch.polar(torch.ones_like(a), a).to(dtype).view(1, S, 1, D // 2),)


def _complex_one(x, freqs, real_dtype):
    xc = torch.view_as_complex(x.to(real_dtype).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


def complex64(q, k, freqs):
    return _complex_one(q, freqs, torch.float32), _complex_one(k, freqs, torch.float32)


def complex128(q, k, freqs):
    return _complex_one(q, freqs, torch.float64), _complex_one(k, freqs, torch.float64)


def _complex_fused(freqs):
    ri = torch.view_as_real(freqs)
    return ri[..., 0], ri[..., 1], dict(interleaved=True, full_tables=False)


SPELLINGS: dict[str, Spelling] = {s.code: s for s in [
    Spelling("I1", "wan strided-slice", _wan_tables, wan, _wan_fused),
    Spelling("I2", "helios packed", _helios_tables, helios, _helios_fused),
    Spelling("I3", "stack+flatten", _half_tables, stack_flatten, _half_il_fused),
    Spelling("N1", "hf neox cat", _neox_tables, hf_neox, _neox_fused, neox_full_tables=True),
    Spelling("N3", "partial neox", _partial_tables, partial_neox, _neox_fused),
    Spelling("C2", "complex64", lambda B, S, D, dev: _complex_tables(B, S, D, dev, torch.complex64),
             complex64, _complex_fused),
    Spelling("C1", "complex128", lambda B, S, D, dev: _complex_tables(B, S, D, dev, torch.complex128),
             complex128, _complex_fused),
]}


def fused_call(spelling: Spelling, q: torch.Tensor, k: torch.Tensor, tables: tuple, op) -> tuple:
    """Call a rotary_qk-signature op with the arguments the pass would give it for this spelling."""
    cos, sin, kw = spelling.fused(*tables)
    rotary_dim = cos.shape[-1] * (1 if kw["full_tables"] else 2)
    return op(q, k, cos, sin, rotary_dim=rotary_dim, conjugate=False, out_dtype=q.dtype, **kw)
