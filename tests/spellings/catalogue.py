"""One spelling per "must" row of catalogue.md (I1-I8, N1-N8, C1-C3, M1-M7, M12) and per "should" row that
fuses (M8-M11), written from the row's description (not copied from the model code)."""

from __future__ import annotations

import torch

from .case import (
    ONE,
    QK,
    QKV,
    R_PARTIAL,
    B,
    Case,
    D,
    Expect,
    H,
    S,
    angles,
    complex_freqs,
    full_il_tables,
    full_neox_tables,
    half_tables,
    noncontig_bhsd,
    rnd,
    rope,
    up,
)

bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
R = R_PARTIAL
TXT = 3  # text tokens left unrotated (M6, N5)


def promote(*ts):
    dt = ts[0].dtype
    for t in ts[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def rms(x):
    """RMSNorm over the last dim without weight (the neighbour that precedes RoPE in Wan)."""
    xf = up(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------- I1
def wan_rope(x, freqs_cos, freqs_sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def i1_wan(q, k, freqs_cos, freqs_sin):
    q = rms(q).unflatten(2, (H, -1))
    k = rms(k).unflatten(2, (H, -1))
    return wan_rope(q, freqs_cos, freqs_sin), wan_rope(k, freqs_cos, freqs_sin)


def i1_make(dt):
    return (rnd(B, S, H * D, dtype=dt), rnd(B, S, H * D, dtype=dt), *full_il_tables(1, S, 1, D))


def i1_ref(q, k, fc, fs):
    f = lambda x: rope(rms(x).unflatten(2, (H, -1)), fc[..., 0::2], fs[..., 1::2], interleaved=True, full=False)
    return f(q), f(k)


# ---------------------------------------------------------------------------------------------- I2
def i2_helios(x, freqs):
    cos, sin = freqs.unsqueeze(-2).chunk(2, dim=-1)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
    return out.type_as(x)


def i2_make(dt):
    c, s = full_il_tables(S, B, D)
    packed = torch.cat([c, s], -1).transpose(0, 1)  # [B,S,2D], per batch, not contiguous
    return rnd(B, S, H, D, dtype=dt), packed


def i2_ref(x, freqs):
    c, s = freqs[..., :D].unsqueeze(-2), freqs[..., D:].unsqueeze(-2)
    return rope(x, c[..., 0::2], s[..., 1::2], interleaved=True, full=False)


# ---------------------------------------------------------------------------------------------- I3
def omni_wan_rope(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
    return out.to(x.dtype)


def i3_omni(q, k, cos, sin):
    return omni_wan_rope(q, cos, sin), omni_wan_rope(k, cos, sin)


def i3_make(dt):
    return (rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *half_tables(1, S, 1, D // 2, dtype=dt))


def i3_ref(q, k, c, s):
    return tuple(rope(x, c, s, interleaved=True, full=False) for x in (q, k))


def i3_packed(x, freqs):
    cos, sin = freqs.unsqueeze(-2).chunk(2, dim=-1)  # packed half [B,S,D] -> [B,S,1,D/2] each
    return omni_wan_rope(x, cos, sin)


def i3p_make(dt):
    c, s = half_tables(B, S, D // 2)
    return rnd(B, S, H, D, dtype=dt), torch.cat([c, s], -1)


def i3p_ref(x, freqs):
    return rope(x, freqs[..., : D // 2].unsqueeze(-2), freqs[..., D // 2:].unsqueeze(-2), interleaved=True,
                full=False)


# ---------------------------------------------------------------------------------------------- I4
def flux_rope(x, cos, sin):
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rot = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (up(x) * cos + up(x_rot) * sin).to(x.dtype)


def i4_flux_bhsd(q, k, cos, sin):
    cos, sin = cos[None, None], sin[None, None]  # [S,D] -> [1,1,S,D]
    return flux_rope(q, cos, sin), flux_rope(k, cos, sin)


def i4_make_bhsd(dt):
    return noncontig_bhsd(B, H, S, D, dt), noncontig_bhsd(B, H, S, D, dt), *full_il_tables(S, D)


def i4_ref_bhsd(q, k, c, s):
    return tuple(rope(x, c, s, interleaved=True, full=True) for x in (q, k))


def i4_flux_bshd(x, cos, sin):
    return flux_rope(x, cos[None, :, None, :], sin[None, :, None, :])


def i4_make_bshd(dt):
    return rnd(B, S, H, D, dtype=dt), *full_il_tables(S, D)


def i4_ref_bshd(x, c, s):
    return rope(x, c.unsqueeze(-2), s.unsqueeze(-2), interleaved=True, full=True)


# ---------------------------------------------------------------------------------------------- I5
def i5_flash(x, cos, sin):
    ro = cos.shape[-1] * 2
    # einops repeat(cos, "... d -> ... 1 (d 2)")
    cos = cos[..., None, :, None].expand(*cos.shape[:-1], 1, cos.shape[-1], 2).reshape(*cos.shape[:-1], 1, ro)
    sin = sin[..., None, :, None].expand(*sin.shape[:-1], 1, sin.shape[-1], 2).reshape(*sin.shape[:-1], 1, ro)
    xr = x[..., :ro]
    rot = torch.stack((-xr[..., 1::2], xr[..., ::2]), dim=-1).flatten(-2)
    return torch.cat([xr * cos + rot * sin, x[..., ro:]], dim=-1)


def i5_make(dt):
    return rnd(B, S, H, D, dtype=dt), *half_tables(S, R // 2, dtype=dt)


def i5_ref(x, c, s):
    return rope(x, c.unsqueeze(-2), s.unsqueeze(-2), interleaved=True, rotary_dim=R, full=False)


# ---------------------------------------------------------------------------------------------- I6
def gptj_apply(t, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (t * cos) + (rotate_every_two(t) * sin)


def i6_gptj(q, k, sin, cos):
    rd = sin.shape[-1] * 2
    q_rot, q_pass = q[:, :, :, :rd], q[:, :, :, rd:]
    k_rot, k_pass = k[:, :, :, :rd], k[:, :, :, rd:]
    q = torch.cat([gptj_apply(q_rot, sin, cos), q_pass], dim=-1)
    k = torch.cat([gptj_apply(k_rot, sin, cos), k_pass], dim=-1)
    return q, k


def i6_make(dt):
    c, s = half_tables(B, S, R // 2, dtype=dt)  # per batch (position ids)
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), s, c


def i6_ref(q, k, s, c):
    return tuple(rope(x, c[:, :, None], s[:, :, None], interleaved=True, rotary_dim=R, full=False)
                 for x in (q, k))


# ---------------------------------------------------------------------------------------------- I7
def i7_mammoth(x, cos, sin):
    xs = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = xs[..., 0], xs[..., 1]
    c = cos.view(*cos.shape[:-1], -1, 2)
    s = sin.view(*sin.shape[:-1], -1, 2)
    cos_1, cos_2 = c[..., 0], c[..., 1]
    sin_1, sin_2 = s[..., 0], s[..., 1]
    return torch.stack([x1 * cos_1 - x2 * sin_1, x1 * sin_2 + x2 * cos_2], -1).view(x.shape)


def i7_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_il_tables(1, S, 1, D)


def i7_ref(x, c, s):
    return rope(x, c, s, interleaved=True, full=True, out_dtype=promote(x, c))


# ---------------------------------------------------------------------------------------------- I8
def i8_ltx(x, cos, sin):
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
    x_rot = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (up(x) * cos + up(x_rot) * sin).to(x.dtype)


def i8_make(dt):
    return rnd(B, S, H * D, dtype=dt), *full_il_tables(B, S, H * D)  # every head its own frequencies


def i8_ref(x, c, s):
    return rope(x, c, s, interleaved=True, full=True)


# ---------------------------------------------------------------------------------------------- N1
def n1_llama(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def n1_make(dt):
    return noncontig_bhsd(B, H, S, D, dt), noncontig_bhsd(B, H, S, D, dt), *full_neox_tables(B, S, D, dtype=dt)


def n1_ref(q, k, c, s):
    return tuple(rope(x, c.unsqueeze(1), s.unsqueeze(1), interleaved=False, full=True) for x in (q, k))


# ---------------------------------------------------------------------------------------------- N2
T = 11  # packed tokens


def n2_qwen2vl(q, k, cos, sin):
    orig_q_dtype, orig_k_dtype = q.dtype, k.dtype
    q, k = up(q), up(k)
    cos, sin = up(cos.unsqueeze(-2)), up(sin.unsqueeze(-2))
    q_embed = (q * cos) + (rotate_half_chunk(q) * sin)
    k_embed = (k * cos) + (rotate_half_chunk(k) * sin)
    return q_embed.to(orig_q_dtype), k_embed.to(orig_k_dtype)


def n2_make(dt):
    return rnd(T, H, D, dtype=dt), rnd(T, H, D, dtype=dt), *full_neox_tables(T, D)


def n2_ref(q, k, c, s):
    return tuple(rope(x, c.unsqueeze(-2), s.unsqueeze(-2), interleaved=False, full=True) for x in (q, k))


# ---------------------------------------------------------------------------------------------- N3
def n3_neox_partial(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    q_rot, q_pass = q[..., :rd], q[..., rd:]
    k_rot, k_pass = k[..., :rd], k[..., rd:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def n3_make(dt):
    return noncontig_bhsd(B, H, S, D, dt), noncontig_bhsd(B, H, S, D, dt), *full_neox_tables(B, S, R, dtype=dt)


def n3_ref(q, k, c, s):
    return tuple(rope(x, c.unsqueeze(1), s.unsqueeze(1), interleaved=False, rotary_dim=R, full=True)
                 for x in (q, k))


# ---------------------------------------------------------------------------------------------- N4
def n4_stable_audio(x, cos, sin):
    rd = cos.shape[-1]
    xr, x_pass = x[..., :rd], x[..., rd:]
    a, b = xr.reshape(*xr.shape[:-1], 2, rd // 2).unbind(-2)
    rot = torch.cat([-b, a], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = (up(xr) * cos + up(rot) * sin).to(x.dtype)
    return torch.cat([out, x_pass], dim=-1)


def n4_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_neox_tables(S, R)


def n4_ref(x, c, s):
    return rope(x, c.unsqueeze(-2), s.unsqueeze(-2), interleaved=False, rotary_dim=R, full=True)


# ---------------------------------------------------------------------------------------------- N5
def glm_rope(x, cos, sin):
    x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
    x_rot = torch.cat([-x_imag, x_real], dim=-1)
    return (up(x) * cos + up(x_rot) * sin).to(x.dtype)


def n5_glm(x, cos, sin):
    x = x.clone()
    x[:, TXT:] = glm_rope(x[:, TXT:], cos[None, :, None, :], sin[None, :, None, :])
    return x


def n5_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_neox_tables(S - TXT, D)


def n5_ref(x, c, s):
    rot = rope(x[:, TXT:], c.unsqueeze(-2), s.unsqueeze(-2), interleaved=False, full=True)
    return torch.cat([x[:, :TXT], rot], 1)


# ---------------------------------------------------------------------------------------------- N6
def n6_ltx2_split(x, cos, sin):
    b, t, _ = x.shape
    h, r = cos.shape[1], cos.shape[-1]
    sx = x.reshape(b, t, h, 2, r).swapaxes(1, 2)  # [B,H,S,2,R/2]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = sx * cos
    out[..., :1, :].addcmul_(-sin, sx[..., 1:, :])
    out[..., 1:, :].addcmul_(sin, sx[..., :1, :])
    return out.swapaxes(1, 2).reshape(b, t, -1)


def n6_make(dt):
    return rnd(B, S, H * D, dtype=dt), *half_tables(B, H, S, D // 2)


def n6_ref(x, c, s):
    xh = x.unflatten(-1, (H, D))
    out = rope(xh, c.transpose(1, 2), s.transpose(1, 2), interleaved=False, full=False,
               out_dtype=promote(x, c))
    return out.flatten(2)


# ---------------------------------------------------------------------------------------------- N7
def n7_ernie(x, cos, sin):
    rd = cos.shape[-1] * 2
    cos = torch.repeat_interleave(cos, 2, dim=-1)[None, :, None, :]
    sin = torch.repeat_interleave(sin, 2, dim=-1)[None, :, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rot * sin, xp), dim=-1)


def n7_make(dt):
    return rnd(B, S, H, D, dtype=dt), *half_tables(S, R // 2, dtype=dt)


def n7_ref(x, c, s):
    cf, sf = (t.repeat_interleave(2, -1)[:, None] for t in (c, s))
    return rope(x, cf, sf, interleaved=False, rotary_dim=R, full=True)


# ---------------------------------------------------------------------------------------------- N8
N_MAGI, R_MAGI = 9, 3 * D // 4


def n8_magi(x, freqs):
    sin, cos = freqs.tensor_split(2, -1)  # [N, sin|cos], sin first
    rd = 2 * cos.shape[-1]
    cos = torch.cat([cos, cos], -1)[None, :, None, :]
    sin = torch.cat([sin, sin], -1)[None, :, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], -1)


def n8_make(dt):
    c, s = half_tables(N_MAGI, R_MAGI // 2)
    return rnd(1, N_MAGI, H, D, dtype=dt), torch.cat([s, c], -1)


def n8_ref(x, freqs):
    s, c = freqs[:, None, : R_MAGI // 2], freqs[:, None, R_MAGI // 2:]
    return rope(x, c, s, interleaved=False, rotary_dim=R_MAGI, full=False, out_dtype=promote(x, freqs))


# ---------------------------------------------------------------------------------------------- C1-C3
def c1_wan_complex(x, freqs):
    x_c = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs).flatten(3).type_as(x)


def c1_make(dt):
    return rnd(B, S, H, D, dtype=dt), complex_freqs(S, 1, D // 2, dtype=torch.complex128)


def complex_ref(x, freqs):
    return rope(x, freqs.real, freqs.imag, interleaved=True, full=False)


def qwen_complex(x, freqs):
    x_c = torch.view_as_complex(up(x).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs).flatten(3).type_as(x)


def c2_qwen_image(q, k, freqs):
    freqs = freqs.unsqueeze(1)  # [S,D/2] -> [S,1,D/2]
    return qwen_complex(q, freqs), qwen_complex(k, freqs)


def c2_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), complex_freqs(S, D // 2)


def c2_ref(q, k, freqs):
    return complex_ref(q, freqs[:, None]), complex_ref(k, freqs[:, None])


def c3_omni_qwen(q, k, freqs):
    cos = freqs.real.to(q.dtype)[None, :, None, :]
    sin = freqs.imag.to(q.dtype)[None, :, None, :]
    return omni_wan_rope(q, cos, sin), omni_wan_rope(k, cos, sin)


def c3_ref(q, k, freqs):
    c, s = freqs.real.to(q.dtype)[:, None], freqs.imag.to(q.dtype)[:, None]
    return tuple(rope(x, c, s, interleaved=True, full=False) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M1
def m1_glm_cohere(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]

    def one(x):
        xr, xp = up(x[..., :rd]), x[..., rd:]
        return torch.cat([((xr * cos) + (rotate_every_two(xr) * sin)).to(x.dtype), xp], dim=-1)

    return one(q), one(k)


def m1_make(dt):
    return noncontig_bhsd(B, H, S, D, dt), noncontig_bhsd(B, H, S, D, dt), *full_neox_tables(B, S, R)


def m1_ref(q, k, c, s):
    c, s = c[:, None, :, : R // 2], s[:, None, :, : R // 2]
    return tuple(rope(x, c, s, interleaved=True, rotary_dim=R, full=False) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M2
def gptoss_apply(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def m2_gptoss(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return gptoss_apply(q, cos, sin), gptoss_apply(k, cos, sin)


def m2_make(dt):
    return noncontig_bhsd(B, H, S, D, dt), noncontig_bhsd(B, H, S, D, dt), *half_tables(B, S, D // 2, dtype=dt)


def m2_ref(q, k, c, s):
    return tuple(rope(x, c[:, None], s[:, None], interleaved=False, full=False) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M3
def rotate_half_nanochat(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((x2, -x1), dim=-1)


def m3_nanochat(q, k, cos, sin):
    return (q * cos + rotate_half_nanochat(q) * sin), (k * cos + rotate_half_nanochat(k) * sin)


def m3_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *full_neox_tables(1, S, 1, D, dtype=dt)


def m3_ref(q, k, c, s):
    return tuple(rope(x, c, s, interleaved=False, full=True, conjugate=True) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M4
def m4_split_front(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]

    def one(x):
        x_rot, x_pass = torch.split(x, [rd, x.shape[-1] - rd], dim=-1)
        return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)

    return one(q), one(k)


def m4_front_make(dt):
    return noncontig_bhsd(B, H, S, D, dt), noncontig_bhsd(B, H, S, D, dt), *full_neox_tables(B, S, R, dtype=dt)


def m4_front_ref(q, k, c, s):
    return tuple(rope(x, c[:, None], s[:, None], interleaved=False, rotary_dim=R, full=True) for x in (q, k))


def m4_rope_at_end(q, k, cos, sin):
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]

    def one(x):
        x_nope, x_pe = x[..., :-rd], x[..., -rd:]
        return torch.cat([x_nope, x_pe * cos + rotate_half(x_pe) * sin], dim=-1)

    return one(q), one(k)


def m4_end_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *full_neox_tables(S, R, dtype=dt)


def m4_end_ref(q, k, c, s):
    return tuple(torch.cat([x[..., :-R], rope(x[..., -R:], c[:, None], s[:, None], interleaved=False, full=True)],
                           -1) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M5
def m5_conformer(x, cos, sin):
    x = x.transpose(0, 1)  # [S,B,H,D]
    rotated_begin = x[..., : x.shape[-1] // 2]
    rotated_end = x[..., x.shape[-1] // 2:]
    rotated = torch.cat((-rotated_end, rotated_begin), dim=-1)
    x = (x * cos) + (rotated * sin)
    return x.transpose(0, 1)


def m5_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_neox_tables(S, 1, 1, D, dtype=dt)


def m5_ref(x, c, s):
    return rope(x, c[:, 0], s[:, 0], interleaved=False, full=True)


# ---------------------------------------------------------------------------------------------- M6
def m6_hunyuan(q, k, cos, sin):
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    q = torch.cat([flux_rope(q[:, :-TXT], cos, sin), q[:, -TXT:]], dim=1)
    k = torch.cat([flux_rope(k[:, :-TXT], cos, sin), k[:, -TXT:]], dim=1)
    return q, k


def m6_hunyuan_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *full_il_tables(S - TXT, D)


def m6_hunyuan_ref(q, k, c, s):
    return tuple(torch.cat([rope(x[:, :-TXT], c[:, None], s[:, None], interleaved=True, full=True), x[:, -TXT:]],
                           1) for x in (q, k))


def m6_middle_segment(q, k, cos, sin):
    """RoPE on an image segment in the middle of a joint [text | image | text] sequence."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    a, b = TXT, S - TXT
    return tuple(torch.cat([x[:, :a], flux_rope(x[:, a:b], cos, sin), x[:, b:]], dim=1) for x in (q, k))


def m6_middle_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *full_il_tables(S - 2 * TXT, D)


def m6_middle_ref(q, k, c, s):
    a, b = TXT, S - TXT
    return tuple(torch.cat([x[:, :a], rope(x[:, a:b], c[:, None], s[:, None], interleaved=True, full=True),
                            x[:, b:]], 1) for x in (q, k))


def m6_cogvideox(x, cos, sin):
    x = x.clone()
    x[:, :, TXT:] = flux_rope(x[:, :, TXT:], cos[None, None], sin[None, None])
    return x


def m6_cog_make(dt):
    return noncontig_bhsd(B, H, S, D, dt), *full_il_tables(S - TXT, D)


def m6_cog_ref(x, c, s):
    return torch.cat([x[:, :, :TXT], rope(x[:, :, TXT:], c, s, interleaved=True, full=True)], 2)


# ---------------------------------------------------------------------------------------------- M7
def mochi_rope(x, freqs_cos, freqs_sin):
    x_even = up(x[..., 0::2])
    x_odd = up(x[..., 1::2])
    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
    return torch.stack([cos, sin], dim=-1).flatten(-2)


def m7_mochi(q, k, cos, sin):
    return mochi_rope(q, cos, sin), mochi_rope(k, cos, sin)


def m7_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *half_tables(S, H, D // 2)  # per head


def m7_ref(q, k, c, s):
    return tuple(rope(x, c, s, interleaved=True, full=False) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M8
def m8_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def m8_deepseek_v3(q, k, cos, sin):
    """transformers DeepSeek-V3 `apply_rotary_pos_emb_interleave`: de-interleave, then rotate_half."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return (q * cos) + (m8_rotate_half(q) * sin), (k * cos) + (m8_rotate_half(k) * sin)


def m8_make(dt):
    return rnd(B, H, S, D, dtype=dt), rnd(B, 1, S, D, dtype=dt), *full_neox_tables(B, S, D, dtype=dt)


def _deinterleaved(x):
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def m8_ref(q, k, c, s):
    return tuple(rope(_deinterleaved(x), c[:, None], s[:, None], interleaved=False, full=True) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M9
def _rope_matrices(ang):
    """diffusers HiDream `rope`: [..., D/2, 2, 2] rotation matrices built from cos and sin in the graph."""
    m = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], dim=-1)
    return m.view(*m.shape[:-1], 2, 2)


def m9_hidream(xq, xk, ang):
    freqs_cis = _rope_matrices(ang)[:, :, None]  # the table gains a heads dim
    xq_ = up(xq).reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = up(xk).reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def m9_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), angles(B, S, D // 2).float()


def m9_ref(q, k, a):
    c, s = a.cos()[:, :, None], a.sin()[:, :, None]
    return tuple(rope(x, c, s, interleaved=True, full=False) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M10
def _heads(h, w):
    return (h @ w).view(B, S, H, D).transpose(1, 2)


def m10_clvp(h, wq, wk, wv, cos, sin):
    """transformers CLVP: q, k and v projected from one activation and rotated by one table, partial NeoX
    (rotary_dim R of D), cat with the rest."""
    def one(x):
        rot, rest = x[..., :R], x[..., R:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
    return one(_heads(h, wq)), one(_heads(h, wk)), one(_heads(h, wv))


def m10_make(dt):
    return (rnd(B, S, H * D, dtype=dt), *(rnd(H * D, H * D, dtype=dt) / D for _ in range(3)),
            *full_neox_tables(B, 1, S, R, dtype=dt))


def m10_ref(h, wq, wk, wv, c, s):
    return tuple(rope(_heads(h, w), c, s, interleaved=False, rotary_dim=R, full=True) for w in (wq, wk, wv))


# ---------------------------------------------------------------------------------------------- M11
D3 = 24  # Allegro's head dim: three blocks of 8 (D is not a multiple of 3)
POS = 11  # rows of Allegro's per-axis caches


def m11_allegro(q, k, c_t, s_t, c_h, s_h, c_w, s_w, pos):
    """diffusers Allegro: x.chunk(3), each block rotate_half by its own cache gathered with F.embedding."""
    def one(x):
        out = []
        for part, p, c, s in zip(x.chunk(3, dim=-1), pos, (c_t, c_h, c_w), (s_t, s_h, s_w)):
            c, s = torch.nn.functional.embedding(p, c)[:, None], torch.nn.functional.embedding(p, s)[:, None]
            out.append((up(part) * c + up(rotate_half(part)) * s).to(part.dtype))
        return torch.cat(out, dim=-1)
    return one(q), one(k)


def m11_allegro_make(dt):
    caches = [t for _ in range(3) for t in full_neox_tables(POS, D3 // 3)]
    return rnd(B, H, S, D3, dtype=dt), rnd(B, H, S, D3, dtype=dt), *caches, torch.randint(0, POS, (3, B, S))


def m11_allegro_ref(q, k, c_t, s_t, c_h, s_h, c_w, s_w, pos):
    c = torch.cat([t[p] for t, p in zip((c_t, c_h, c_w), pos)], -1)[:, None]
    s = torch.cat([t[p] for t, p in zip((s_t, s_h, s_w), pos)], -1)[:, None]
    return tuple(rope(x, c, s, interleaved=False, full=True, blocks=3) for x in (q, k))


def _vjepa2_block(x, pos):
    """transformers V-JEPA 2 `rotate_queries_or_keys`: tables from positions in the graph, repeat()ed (not
    repeat_interleave()d) over interleaved pairs, so every lane has its own table entry."""
    d = x.shape[-1]
    omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=x.dtype) / (d / 2.0))
    freq = pos.unsqueeze(-1) * omega
    emb_sin, emb_cos = freq.sin().repeat(1, 1, 1, 2), freq.cos().repeat(1, 1, 1, 2)
    y1, y2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
    return x * emb_cos + torch.stack((-y2, y1), dim=-1).flatten(-2) * emb_sin


VJ = 2 * ((D // 3) // 2)  # V-JEPA 2's block width: three blocks of 4 of D = 16, the last 4 lanes pass through


def m11_vjepa2(q, k, pos_d, pos_h, pos_w):
    def one(x):
        blocks = [_vjepa2_block(x[..., i * VJ:(i + 1) * VJ], p) for i, p in enumerate((pos_d, pos_h, pos_w))]
        return torch.cat([*blocks, x[..., 3 * VJ:]], dim=-1)
    return one(q), one(k)


def m11_vjepa2_make(dt):
    return (rnd(B, H, S, D, dtype=dt), rnd(B, H, S, D, dtype=dt),
            *(torch.randint(0, 9, (B, 1, S)).to(torch.float32) for _ in range(3)))


def m11_vjepa2_ref(q, k, *pos):
    def table(fn):
        parts = []
        for p in pos:
            omega = 1.0 / 10000 ** (torch.arange(VJ // 2, dtype=q.dtype) / (VJ / 2.0))
            parts.append(fn(p.unsqueeze(-1) * omega).repeat(1, 1, 1, 2))
        return torch.cat(parts, -1)
    c, s = table(torch.cos), table(torch.sin)
    return tuple(rope(x, c, s, interleaved=True, rotary_dim=3 * VJ, full=True) for x in (q, k))


def m11_gemma4(q, k, cos, sin):
    """transformers Gemma 4 vision `apply_multidimensional_rope`: torch.split of x and of one cos/sin into
    equal blocks (one per position axis), rotate_half per block, cat; [B, S, H, D] with unsqueeze(2)."""
    def one(x):
        sizes = [D // 2, D // 2]
        parts = zip(torch.split(x, sizes, -1), torch.split(cos, sizes, -1), torch.split(sin, sizes, -1))
        return torch.cat([p * c.unsqueeze(2) + rotate_half(p) * s.unsqueeze(2) for p, c, s in parts], dim=-1)
    return one(q), one(k)


def m11_gemma4_make(dt):
    c_h, s_h = full_neox_tables(B, S, D // 2, dtype=dt)
    c_w, s_w = full_neox_tables(B, S, D // 2, dtype=dt)
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), torch.cat([c_h, c_w], -1), torch.cat([s_h, s_w], -1)


def m11_gemma4_ref(q, k, c, s):
    return tuple(rope(x, c[:, :, None], s[:, :, None], interleaved=False, full=True, blocks=2) for x in (q, k))


# ---------------------------------------------------------------------------------------------- M12
def m12_llama4(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(up(xq).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(up(xk).reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def m12_llama4_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), complex_freqs(B, S, D // 2)


def m12_llama4_ref(q, k, f):
    return complex_ref(q, f[:, :, None]), complex_ref(k, f[:, :, None])


def m12_lumina2(x, freqs_cis):
    x_rotated = torch.view_as_complex(up(x).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_rotated * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


def m12_lumina2_make(dt):
    return rnd(B, S, H, D, dtype=dt), complex_freqs(B, S, D // 2, dtype=torch.complex128)


def m12_lumina2_ref(x, f):
    return complex_ref(x, f[:, :, None])


def m12_deepseek_view(x, freqs_cis):
    x_c = torch.view_as_complex(up(x).view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs_cis.view(1, x.size(1), 1, x_c.size(-1))).flatten(3).type_as(x)


def m12_deepseek_make(dt):
    return rnd(B, S, H, D, dtype=dt), complex_freqs(S, D // 2)


def m12_deepseek_ref(x, f):
    return complex_ref(x, f[:, None])


# ---------------------------------------------------------------------------------------------- cases
def E(n, style, rd, table, *, head=None, conj=False):
    """n = 1: one tensor (op rotary); n = 2: a q/k pair sharing tables (op rotary_qk); n = 3: q, k, v (rotary_qkv)."""
    return Expect(sites=n, kernels=1, op={1: ONE, 2: QK, 3: QKV}[n], style=style, rotary_dim=rd,
                  head_dim=D if head is None else (None if head == "any" else head), table_form=table,
                  conjugate=conj)


IL, NX = "interleaved", "neox"
CASES = [
    Case("I1_wan", i1_wan, i1_make, i1_ref, E(2, IL, D, "per-pair"), (bf16, fp64)),
    Case("I2_helios_packed", i2_helios, i2_make, i2_ref, E(1, IL, D, "per-pair"), (bf16,)),
    Case("I3_omni_wan_stack", i3_omni, i3_make, i3_ref, E(2, IL, D, "per-pair"), (bf16,)),
    Case("I3_helios_packed_half", i3_packed, i3p_make, i3p_ref, E(1, IL, D, "per-pair"), (fp16,)),
    Case("I4_flux_bhsd_qk", i4_flux_bhsd, i4_make_bhsd, i4_ref_bhsd, E(2, IL, D, "per-lane"), (bf16,)),
    Case("I4_flux_bshd", i4_flux_bshd, i4_make_bshd, i4_ref_bshd, E(1, IL, D, "per-lane"), (fp16,)),
    Case("I5_flash_attn_partial", i5_flash, i5_make, i5_ref, E(1, IL, R, "per-pair"), (fp16,)),
    Case("I6_gptj_partial", i6_gptj, i6_make, i6_ref, E(2, IL, R, "per-pair"), (bf16,)),
    Case("I7_mammoth_per_lane", i7_mammoth, i7_make, i7_ref, E(1, IL, D, "per-lane"), (fp32,)),
    Case("I8_ltx_flat_heads", i8_ltx, i8_make, i8_ref, E(1, IL, (D, H * D), "per-lane", head=(D, H * D)), (bf16,)),
    Case("N1_llama", n1_llama, n1_make, n1_ref, E(2, NX, D, "per-lane"), (bf16, fp16, fp64)),
    Case("N2_qwen2vl_vision", n2_qwen2vl, n2_make, n2_ref, E(2, NX, D, "per-lane"), (fp16,)),
    Case("N3_neox_partial", n3_neox_partial, n3_make, n3_ref, E(2, NX, R, "per-lane"), (bf16,)),
    Case("N4_stable_audio", n4_stable_audio, n4_make, n4_ref, E(1, NX, R, "per-lane"), (bf16,)),
    Case("N5_glm_seq_slice", n5_glm, n5_make, n5_ref, E(1, NX, D, "per-lane"), (fp16,)),
    Case("N6_ltx2_split_addcmul", n6_ltx2_split, n6_make, n6_ref, E(1, NX, D, "per-pair"), (fp32,)),
    Case("N7_ernie_hybrid", n7_ernie, n7_make, n7_ref, E(1, NX, R, "per-lane"), (bf16,)),
    Case("N8_magi_packed_sin_first", n8_magi, n8_make, n8_ref, E(1, NX, R_MAGI, "per-pair"), (fp32,)),
    Case("C1_wan_complex128", c1_wan_complex, c1_make, complex_ref, E(1, IL, D, "per-pair"), (bf16, fp32)),
    Case("C2_qwen_image_complex64", c2_qwen_image, c2_make, c2_ref, E(2, IL, D, "per-pair"), (bf16, fp32, fp64)),
    Case("C3_omni_qwen_real_imag", c3_omni_qwen, c2_make, c3_ref, E(2, IL, D, "per-pair"), (fp16,)),
    Case("M1_glm_cohere_il_rotate_half", m1_glm_cohere, m1_make, m1_ref, E(2, IL, R, "per-pair"), (bf16,)),
    Case("M2_gptoss_half_tables", m2_gptoss, m2_make, m2_ref, E(2, NX, D, "per-pair"), (bf16, fp32)),
    Case("M3_nanochat_conjugate", m3_nanochat, m3_make, m3_ref, E(2, NX, D, "per-lane", conj=True), (fp16,)),
    Case("M4_split_front", m4_split_front, m4_front_make, m4_front_ref, E(2, NX, R, "per-lane"), (fp32,)),
    Case("M4_rope_at_end", m4_rope_at_end, m4_end_make, m4_end_ref, E(2, NX, R, "per-lane", head="any"), (bf16,)),
    Case("M5_conformer_sbhd", m5_conformer, m5_make, m5_ref, E(1, NX, D, "per-lane"), (fp32,)),
    Case("M6_hunyuan_seq_cat", m6_hunyuan, m6_hunyuan_make, m6_hunyuan_ref, E(2, IL, D, "per-lane"), (bf16,)),
    Case("M6_cogvideox_seq_assign", m6_cogvideox, m6_cog_make, m6_cog_ref, E(1, IL, D, "per-lane"), (fp16,)),
    Case("M6_middle_segment", m6_middle_segment, m6_middle_make, m6_middle_ref, E(2, IL, D, "per-lane"), (bf16,)),
    Case("M7_mochi_per_head", m7_mochi, m7_make, m7_ref, E(2, IL, D, "per-pair"), (bf16,)),
    Case("M8_deepseek_v3_deinterleave", m8_deepseek_v3, m8_make, m8_ref, E(2, "deinterleave", D, "per-lane"),
         (bf16, fp32)),
    Case("M9_hidream_rotation_matrices", m9_hidream, m9_make, m9_ref, E(2, IL, D, "per-pair"), (bf16, fp32)),
    Case("M10_clvp_qkv", m10_clvp, m10_make, m10_ref, E(3, NX, R, "per-lane"), (fp32, bf16)),
    Case("M11_allegro_3_blocks", m11_allegro, m11_allegro_make, m11_allegro_ref,
         E(2, NX, D3, "per-lane", head=D3), (bf16, fp32)),
    Case("M11_vjepa2_blocks_tail", m11_vjepa2, m11_vjepa2_make, m11_vjepa2_ref, E(2, IL, 3 * VJ, "per-lane"),
         (fp32,)),
    Case("M11_gemma4_split_blocks", m11_gemma4, m11_gemma4_make, m11_gemma4_ref, E(2, NX, D, "per-lane"),
         (bf16, fp32)),
    Case("M12_llama4_complex64_qk", m12_llama4, m12_llama4_make, m12_llama4_ref, E(2, IL, D, "per-pair"), (bf16,)),
    Case("M12_lumina2_complex128", m12_lumina2, m12_lumina2_make, m12_lumina2_ref, E(1, IL, D, "per-pair"), (bf16,)),
    Case("M12_deepseek_view", m12_deepseek_view, m12_deepseek_make, m12_deepseek_ref, E(1, IL, D, "per-pair"),
         (fp32,)),
]
