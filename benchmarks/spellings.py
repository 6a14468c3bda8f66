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


# ---------------------------------------------------------------------------------------------------------
# Forms of the newer rows of benchmarks.kernels: a QK-norm before the rotation, the Flux [B,H,S,D] site,
# vLLM's forward_native with its gathered cos|sin cache, written as the libraries write them.

def diffusers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """diffusers.models.normalization.RMSNorm: fp32 statistics, x * rsqrt in fp32, cast to the weight's dtype."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return x.to(weight.dtype) * weight


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers Qwen3RMSNorm / LlamaRMSNorm, and vLLM's RMSNorm.forward_native: fp32, cast back, x weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def flux_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """diffusers `apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1, sequence_dim=...)`:
    full-width interleaved fp32 tables [S, D], the products in fp32 (Flux, HunyuanVideo, CogVideoX)."""
    if sequence_dim == 2:
        cos, sin = cos[None, None, :, :], sin[None, None, :, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def flux_tables(S: int, D: int, device) -> tuple:
    """get_1d_rotary_pos_embed(use_real=True, repeat_interleave_real=True): fp32 [S, D] cos and sin."""
    a = _angles(S, D // 2, device).repeat_interleave(2, -1)
    return a.cos().float(), a.sin().float()


def flux_site_bhsd(q, k, cos, sin):
    """The Flux attention site in [B, H, S, D] (sequence_dim=2)."""
    return flux_rotary(q, cos, sin, 2), flux_rotary(k, cos, sin, 2)


def flux_site_bshd(q, k, cos, sin):
    """The same in [B, S, H, D] (diffusers >= 0.35 processors, sequence_dim=1)."""
    return flux_rotary(q, cos, sin, 1), flux_rotary(k, cos, sin, 1)


def rms_flux_rotary(q, k, wq, wk, cos, sin):
    """Per-head diffusers RMSNorm of q and k ([B, S, H, D]), then Flux's interleaved apply_rotary_emb."""
    return flux_site_bshd(diffusers_rms_norm(q, wq), diffusers_rms_norm(k, wk), cos, sin)


def rms_hf_neox(q, k, wq, wk, cos, sin):
    """Per-head transformers RMSNorm (Qwen3's q_norm/k_norm), then rotate_half NeoX with bf16 tables."""
    return hf_neox(hf_rms_norm(q, wq), hf_rms_norm(k, wk), cos, sin)


def wan_rms_across_heads(q, k, wq, wk, freqs_cos, freqs_sin):
    """diffusers Wan: torch.nn.RMSNorm over all heads ([B, S, H*D], weight [H*D]), unflatten to heads, then
    Wan's strided-slice RoPE (I1). The head dim comes from the tables."""
    D = freqs_cos.shape[-1]
    q = torch.nn.functional.rms_norm(q, (q.shape[-1],), wq, 1e-6).unflatten(2, (-1, D))
    k = torch.nn.functional.rms_norm(k, (k.shape[-1],), wk, 1e-6).unflatten(2, (-1, D))
    return wan(q, k, freqs_cos, freqs_sin)


def vllm_cos_sin_cache(max_pos: int, rotary_dim: int, base: float, device, dtype=torch.bfloat16) -> torch.Tensor:
    """vLLM RotaryEmbedding._compute_cos_sin_cache: [max_pos, rotary_dim] = cat(cos, sin), in the model dtype."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def vllm_apply_rotary(x, cos, sin, is_neox_style):
    """vLLM ApplyRotaryEmb.forward_static (the _apply_rotary_emb_torch of older versions)."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def vllm_forward_native(positions, query, key, cos_sin_cache, head_size: int, rotary_dim: int,
                        is_neox_style: bool):
    """vLLM RotaryEmbedding.forward_native: the cache rows gathered by positions, flat [T, H*D] q and k, the
    rotated head of each head cat with its pass-through tail."""
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    query_shape = query.shape
    query = query.view(num_tokens, -1, head_size)
    query_rot = vllm_apply_rotary(query[..., :rotary_dim], cos, sin, is_neox_style)
    query = torch.cat((query_rot, query[..., rotary_dim:]), dim=-1).reshape(query_shape)
    key_shape = key.shape
    key = key.view(num_tokens, -1, head_size)
    key_rot = vllm_apply_rotary(key[..., :rotary_dim], cos, sin, is_neox_style)
    key = torch.cat((key_rot, key[..., rotary_dim:]), dim=-1).reshape(key_shape)
    return query, key


def vllm_mrope_forward_native(positions, query, key, cos_sin_cache, head_size: int, rotary_dim: int,
                              is_neox_style: bool, mrope_section: tuple):
    """vLLM MRotaryEmbedding.forward_native with [3, T] positions (Qwen2-VL's chunked layout): the cache rows of
    the T, H and W position streams gathered, pair j's table taken from the stream whose section holds j, then the
    rotation of RotaryEmbedding.forward_native."""
    num_tokens = positions.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat([m[i] for i, m in enumerate(cos.split(list(mrope_section), dim=-1))], dim=-1)
    sin = torch.cat([m[i] for i, m in enumerate(sin.split(list(mrope_section), dim=-1))], dim=-1)
    query_shape = query.shape
    query = query.view(num_tokens, -1, head_size)
    query_rot = vllm_apply_rotary(query[..., :rotary_dim], cos, sin, is_neox_style)
    query = torch.cat((query_rot, query[..., rotary_dim:]), dim=-1).reshape(query_shape)
    key_shape = key.shape
    key = key.view(num_tokens, -1, head_size)
    key_rot = vllm_apply_rotary(key[..., :rotary_dim], cos, sin, is_neox_style)
    key = torch.cat((key_rot, key[..., rotary_dim:]), dim=-1).reshape(key_shape)
    return query, key


def vllm_mrope(head_size: int, rotary_dim: int, is_neox_style: bool, mrope_section: tuple) -> Callable:
    """(positions [3, T], q, k, cos_sin_cache) -> (q, k): one vLLM MRotaryEmbedding layer's forward_native."""
    def forward(positions, query, key, cos_sin_cache):
        return vllm_mrope_forward_native(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style,
                                         mrope_section)

    forward.__name__ = f"vllm_mrope_{rotary_dim}of{head_size}_{'_'.join(map(str, mrope_section))}"
    return forward


def vllm_rope(head_size: int, rotary_dim: int, is_neox_style: bool) -> Callable:
    """(positions, q, k, cos_sin_cache) -> (q, k): one vLLM RotaryEmbedding layer's forward_native."""
    def forward(positions, query, key, cos_sin_cache):
        return vllm_forward_native(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style)

    forward.__name__ = f"vllm_rope_{'neox' if is_neox_style else 'gptj'}_{rotary_dim}of{head_size}"
    return forward


def vllm_qwen3_rope(head_size: int) -> Callable:
    """vLLM Qwen3Attention: per-head RMSNorm of the flat q and k (q_norm/k_norm on a per-head view), then the
    rotary layer's forward_native (NeoX, full rotary)."""
    rope = vllm_rope(head_size, head_size, True)

    def forward(positions, q, k, wq, wk, cos_sin_cache):
        q_by_head = hf_rms_norm(q.view(*q.shape[:-1], q.shape[-1] // head_size, head_size), wq)
        k_by_head = hf_rms_norm(k.view(*k.shape[:-1], k.shape[-1] // head_size, head_size), wk)
        return rope(positions, q_by_head.view(q.shape), k_by_head.view(k.shape), cos_sin_cache)

    return forward


# ---------------------------------------------------------------------------------------------------------
# Coverage forms (catalogue rows M8-M11, tests/spellings/catalogue.py), at their models' shapes in
# benchmarks.kernels' "coverage" group.

def deepseek_v3_mla(q, k_pe, cos, sin):
    """transformers DeepSeek-V3 MLA with `apply_rotary_pos_emb_interleave` (M8): q [B, H, S, 192] split into
    q_nope (128) and q_pe (64), q_pe and the single-head k_pe [B, 1, S, 64] de-interleaved (view, transpose,
    reshape) then rotate_half NeoX with full [B, S, 64] tables (unsqueeze(1)), q put back together by cat."""
    rope_dim = k_pe.shape[-1]
    q_nope, q_pe = q[..., : q.shape[-1] - rope_dim], q[..., q.shape[-1] - rope_dim:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    b, h, s, d = q_pe.shape
    q_pe = q_pe.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k_pe.shape
    k_pe = k_pe.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    q_embed = (q_pe * cos) + (_rotate_half(q_pe) * sin)
    k_embed = (k_pe * cos) + (_rotate_half(k_pe) * sin)
    return torch.cat((q_nope, q_embed), dim=-1), k_embed


def hidream_rope_matrices(ang: torch.Tensor) -> torch.Tensor:
    """diffusers HiDream `rope`: [..., D/2] angles -> [..., D/2, 2, 2] rotation matrices, in the graph."""
    m = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], dim=-1)
    return m.view(*m.shape[:-1], 2, 2)


def hidream(xq, xk, ang):
    """diffusers HiDream `apply_rope` (M9): [B, S, H, D] q and k times the 2x2 matrices built from fp32 angles
    [B, S, D/2] (a heads dim added), `.float()` math, `type_as`."""
    freqs_cis = hidream_rope_matrices(ang)[:, :, None]
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def clvp_qkv(q, k, v, cos, sin):
    """transformers CLVP attention (M10): q, k and v [B, H, S, D] split at the rotary width (the tables' width),
    all three rotated by one table pair (`apply_rotary_pos_emb(query_rot, key_rot, value_rot, ...)`, NeoX
    rotate_half), each cat with its pass-through tail."""
    r = cos.shape[-1]
    q_rot, q_pass = q[..., :r], q[..., r:]
    k_rot, k_pass = k[..., :r], k[..., r:]
    v_rot, v_pass = v[..., :r], v[..., r:]
    q_rot = (q_rot * cos) + (_rotate_half(q_rot) * sin)
    k_rot = (k_rot * cos) + (_rotate_half(k_rot) * sin)
    v_rot = (v_rot * cos) + (_rotate_half(v_rot) * sin)
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1), torch.cat((v_rot, v_pass), dim=-1)


def clvp_projected(head_dim: int) -> Callable:
    """(h, wq, wk, wv, cos, sin) -> (q, k, v): CLVP's attention from its input on, q, k and v projected from
    one activation h [B, T, E] (`_shape(proj(h))`: view to heads, transpose to [B, H, T, D]), then `clvp_qkv`.
    The grouping of the pass takes a third rotated tensor into the pair's launch only when all three are
    projections of one activation, so this is the form in which q, k and v can share one launch."""
    def forward(h, wq, wk, wv, cos, sin):
        def shape(x):
            return x.view(x.shape[0], x.shape[1], -1, head_dim).transpose(1, 2)

        return clvp_qkv(shape(h @ wq), shape(h @ wk), shape(h @ wv), cos, sin)

    forward.__name__ = f"clvp_projected_{head_dim}"
    return forward


def allegro_rotary(x, caches, positions):
    """diffusers `apply_rotary_emb_allegro` (M11): x [B, H, N, D] chunked in three (t, h, w), each block
    rotate_half NeoX by its own cos/sin cache rows gathered with F.embedding(positions[i]), `.float()` math,
    `.to(dtype)`, cat."""
    def apply_1d_rope(tokens, pos, cos, sin):
        cos = torch.nn.functional.embedding(pos, cos)[:, None, :, :]
        sin = torch.nn.functional.embedding(pos, sin)[:, None, :, :]
        x1, x2 = tokens[..., : tokens.shape[-1] // 2], tokens[..., tokens.shape[-1] // 2:]
        tokens_rotated = torch.cat((-x2, x1), dim=-1)
        return (tokens.float() * cos + tokens_rotated.float() * sin).to(tokens.dtype)

    (t_cos, t_sin), (h_cos, h_sin), (w_cos, w_sin) = caches
    t, h, w = x.chunk(3, dim=-1)
    t = apply_1d_rope(t, positions[0], t_cos, t_sin)
    h = apply_1d_rope(h, positions[1], h_cos, h_sin)
    w = apply_1d_rope(w, positions[2], w_cos, w_sin)
    return torch.cat([t, h, w], dim=-1)


def allegro(q, k, t_cos, t_sin, h_cos, h_sin, w_cos, w_sin, positions):
    """Allegro's attention: q and k through `apply_rotary_emb_allegro` with the same caches and positions."""
    caches = ((t_cos, t_sin), (h_cos, h_sin), (w_cos, w_sin))
    return allegro_rotary(q, caches, positions), allegro_rotary(k, caches, positions)


def allegro_caches(sizes: tuple, dim: int, device) -> list:
    """get_3d_rotary_pos_embed_allegro: per axis (t, h, w) get_1d_rotary_pos_embed(use_real=True,
    repeat_interleave_real=False): fp32 [size, dim] NeoX cos and sin over the axis' grid."""
    out = []
    for n in sizes:
        a = _angles(n, dim // 2, device)
        a = torch.cat((a, a), -1)
        out += [a.cos().float(), a.sin().float()]
    return out


def allegro_positions(B: int, T: int, H: int, W: int, device) -> torch.Tensor:
    """Allegro's positions: the (t, h, w) grid index of every token, int64 [3, B, T*H*W]."""
    t, h, w = torch.meshgrid(*(torch.arange(n, device=device) for n in (T, H, W)), indexing="ij")
    return torch.stack([g.reshape(1, -1).expand(B, -1) for g in (t, h, w)])


def vjepa2_rotate_queries_or_keys(x, pos):
    """transformers V-JEPA 2 `rotate_queries_or_keys`: omega in x's dtype, the table computed from positions in
    the graph and repeat()ed over the interleaved pairs (unflatten, unbind, stack((-y2, y1)), flatten)."""
    B, num_heads, N, D = x.size()
    omega = torch.arange(D // 2, dtype=x.dtype, device=x.device)
    omega /= D / 2.0
    omega = 1.0 / 10000**omega
    freq = pos.unsqueeze(-1) * omega
    emb_sin = freq.sin()
    emb_cos = freq.cos()
    emb_sin = emb_sin.repeat(1, 1, 1, 2)
    emb_cos = emb_cos.repeat(1, 1, 1, 2)
    y = x.unflatten(-1, (-1, 2))
    y1, y2 = y.unbind(dim=-1)
    y = torch.stack((-y2, y1), dim=-1)
    y = y.flatten(-2)
    return (x * emb_cos) + (y * emb_sin)


def vjepa2_rotary(qk, pos_d, pos_h, pos_w):
    """V-JEPA 2 `apply_rotary_embeddings`: d, h and w blocks of 2*((D//3)//2) lanes each, the rest passed
    through, cat."""
    block = 2 * ((qk.shape[-1] // 3) // 2)
    parts = [vjepa2_rotate_queries_or_keys(qk[..., i * block:(i + 1) * block], p)
             for i, p in enumerate((pos_d, pos_h, pos_w))]
    if 3 * block < qk.shape[-1]:
        parts.append(qk[..., 3 * block:])
    return torch.cat(parts, dim=-1)


def vjepa2(q, k, pos_d, pos_h, pos_w):
    return vjepa2_rotary(q, pos_d, pos_h, pos_w), vjepa2_rotary(k, pos_d, pos_h, pos_w)


def vjepa2_positions(N: int, grid: int, device, dtype=torch.float32) -> tuple:
    """V-JEPA 2 `get_position_ids` without masks: frame, row and column of each token, [1, 1, N] each."""
    ids = torch.arange(N, device=device)
    per_frame = grid * grid
    d = ids // per_frame
    h = (ids - per_frame * d) // grid
    w = ids - per_frame * d - grid * h
    return tuple(p.to(dtype).view(1, 1, N) for p in (d, h, w))


# -- M12: CogVideoX, the rotation written back into the video rows of q and k ----------------------------

def cogvideox_slice_write(text_len: int) -> Callable:
    """(q, k, cos, sin) -> (q, k): diffusers CogVideoXAttnProcessor2_0's RoPE (M12), `query[:, :, text:] =
    apply_rotary_emb(query[:, :, text:], image_rotary_emb)` and the same for key: q and k [B, H, text + video, D],
    full-width interleaved fp32 tables [video, D] (`flux_rotary`, sequence_dim=2), the text rows untouched.
    It writes into its arguments, as the processor writes into its q and k."""
    def forward(q, k, cos, sin):
        q[:, :, text_len:] = flux_rotary(q[:, :, text_len:], cos, sin, 2)
        k[:, :, text_len:] = flux_rotary(k[:, :, text_len:], cos, sin, 2)
        return q, k

    forward.__name__ = f"cogvideox_slice_write_{text_len}"
    return forward


def cogvideox_norm_slice_write(text_len: int, heads: int, eps: float = 1e-6) -> Callable:
    """(q, k, wq, bq, wk, bk, cos, sin) -> (q, k): the same from the projections on, as the processor runs it:
    q and k [B, text + video, H*D] viewed to heads and transposed to [B, H, S, D], `attn.norm_q` / `norm_k`
    (nn.LayerNorm(D, eps=1e-6), affine: CogVideoX's qk_norm="layer_norm"), then the slice writes into the
    norm's fresh output."""
    write = cogvideox_slice_write(text_len)

    def forward(q, k, wq, bq, wk, bk, cos, sin):
        B, S, E = q.shape
        D = E // heads
        q = q.view(B, -1, heads, D).transpose(1, 2)
        k = k.view(B, -1, heads, D).transpose(1, 2)
        q = torch.nn.functional.layer_norm(q, (D,), wq, bq, eps)
        k = torch.nn.functional.layer_norm(k, (D,), wk, bk, eps)
        return write(q, k, cos, sin)

    forward.__name__ = f"cogvideox_norm_slice_write_{text_len}"
    return forward


# -- M13: Flux's joint attention, text and image q and k normed apart, joined, then rotated ---------------------

def flux_joint(q, k, eq, ek, wq, wk, weq, wek, cos, sin):
    """(image q, k, text q, k [B, S, H, D], their four RMSNorm weights [D], cos, sin [text + image, D]) -> (q, k):
    diffusers FluxAttnProcessor's double-stream block: `norm_q` / `norm_k` on the image stream, `norm_added_q` /
    `norm_added_k` on the text stream (diffusers RMSNorm, each its own weight), `cat([text, image], dim=1)`, then
    `apply_rotary_emb(.., sequence_dim=1)` (`flux_rotary`)."""
    q = torch.cat([diffusers_rms_norm(eq, weq), diffusers_rms_norm(q, wq)], dim=1)
    k = torch.cat([diffusers_rms_norm(ek, wek), diffusers_rms_norm(k, wk)], dim=1)
    return flux_rotary(q, cos, sin, 1), flux_rotary(k, cos, sin, 1)


# -- M14: HunyuanVideo's dual-stream attention, the image stream rotated, the text stream joined after it ----------

def hunyuan_joined(q, k, eq, ek, wq, wk, weq, wek, cos, sin):
    """(image q, k, text q, k [B, H, S, D], their four RMSNorm weights [D], cos, sin [image, D]) -> (q, k):
    diffusers HunyuanVideoAttnProcessor2_0's dual-stream block: `norm_q` / `norm_k` then `apply_rotary_emb(..,
    sequence_dim=2)` on the image stream, `norm_added_q` / `norm_added_k` on the text stream, joined after the
    rotation, `cat([image, text], dim=2)`."""
    q = torch.cat([flux_rotary(diffusers_rms_norm(q, wq), cos, sin, 2), diffusers_rms_norm(eq, weq)], dim=2)
    k = torch.cat([flux_rotary(diffusers_rms_norm(k, wk), cos, sin, 2), diffusers_rms_norm(ek, wek)], dim=2)
    return q, k
