"""Variations of the catalogue spellings that must fuse as well (issue 2), plus a few of our own."""

from __future__ import annotations

import torch

from .case import (
    ONE,
    QK,
    B,
    Case,
    D,
    Expect,
    H,
    S,
    complex_freqs,
    full_il_tables,
    full_neox_tables,
    half_tables,
    noncontig_bhsd,
    rnd,
    rope,
    up,
)
from .catalogue import flux_rope, omni_wan_rope, rotate_every_two, rotate_half

bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
IL, NX = "interleaved", "neox"


def E(n, style, rd, table, *, kernels=1, conj=False, head=D):
    op = QK if n == 2 * kernels else ONE
    return Expect(sites=n, kernels=kernels, op=op, style=style, rotary_dim=rd, head_dim=head, table_form=table,
                  conjugate=conj)


# -- single-tensor NeoX with full-neox tables [1,S,1,D]
def x_neox_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_neox_tables(1, S, 1, D, dtype=dt)


def x_neox_ref(x, c, s):
    return rope(x, c, s, interleaved=False, full=True)


def cos_first(x, cos, sin):
    return cos * x + sin * rotate_half(x)


def sum_order_swapped(x, cos, sin):
    return rotate_half(x) * sin + x * cos


def neg_torch_neg(x, cos, sin):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((torch.neg(x2), x1), -1) * sin


def neg_zero_minus(x, cos, sin):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((0 - x2, x1), -1) * sin


def neg_mul_minus_one(x, cos, sin):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((x2 * -1, x1), -1) * sin


def addcmul(x, cos, sin):
    return torch.addcmul(x * cos, rotate_half(x), sin)


def roll_with_sign(x, cos, sin):
    """rotate_half as roll by D/2 times a sign vector: truly a rotation (may or may not be supported)."""
    sign = torch.cat([-torch.ones(D // 2, dtype=x.dtype), torch.ones(D // 2, dtype=x.dtype)])
    return x * cos + torch.roll(x, D // 2, dims=-1) * sign * sin


def negated_tables(x, cos, sin):
    """The rotation by the angle plus pi: both tables negated in the graph."""
    return x * (-cos) + rotate_half(x) * (-sin)


def negated_tables_ref(x, c, s):
    return rope(x, -c, -s, interleaved=False, full=True)


def roll_negative_shift(x, cos, sin):
    """rotate_half as a roll back by D/2 (the same swap on D lanes) times a sign vector."""
    sign = torch.cat([-torch.ones(D // 2, dtype=x.dtype), torch.ones(D // 2, dtype=x.dtype)])
    return x * cos + torch.roll(x, -(D // 2), -1) * sign * sin


# -- tables computed in the graph: cos(a + b), sin(a + b) from the tables of two angles
def angle_sum_tables(x, c_a, s_a, c_b, s_b):
    return x * (c_a * c_b - s_a * s_b) + rotate_half(x) * (s_a * c_b + c_a * s_b)


def angle_sum_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_neox_tables(1, S, 1, D, dtype=dt), *full_neox_tables(1, S, 1, D, dtype=dt)


def angle_sum_ref(x, c1, s1, c2, s2):
    return rope(x, c1 * c2 - s1 * s2, s1 * c2 + c1 * s2, interleaved=False, full=True)


# -- NeoX with half tables (gpt-oss form): subtraction as add of a negative
def x_half_make(dt):
    return rnd(B, S, H, D, dtype=dt), *half_tables(1, S, 1, D // 2, dtype=dt)


def x_half_neox_ref(x, c, s):
    return rope(x, c, s, interleaved=False, full=False)


def x_half_il_ref(x, c, s):
    return rope(x, c, s, interleaved=True, full=False)


def sub_as_add_neg(x, cos, sin):
    a, b = x.chunk(2, -1)
    return torch.cat((a * cos + (-b) * sin, b * cos + a * sin), -1)


def table_cat_neox(x, cos, sin):
    """half tables duplicated in the graph with cat(c, c), then the Llama form."""
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return x * cos + rotate_half(x) * sin


# -- interleaved, half tables
def select_lanes(x, cos, sin):
    xs = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = xs[..., 0], xs[..., 1]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).to(x.dtype)


def split_by_view(x, cos, sin):
    x1, x2 = x.view(*x.shape[:-1], D // 2, 2).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).view(x.shape)


def split_by_reshape(x, cos, sin):
    x1, x2 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).reshape(x.shape)


def table_stack_flatten(x, cos, sin):
    cos = torch.stack([cos, cos], -1).flatten(-2)
    sin = torch.stack([sin, sin], -1).flatten(-2)
    return x * cos + rotate_every_two(x) * sin


def _wan_variant(x, cos, sin, *, base, odd_first):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = {"empty": torch.empty_like, "clone": torch.clone, "zeros": torch.zeros_like}[base](x)
    if odd_first:
        out[..., 1::2] = x1 * sin + x2 * cos
        out[..., 0::2] = x1 * cos - x2 * sin
    else:
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def odd_lanes_first(x, cos, sin):
    return _wan_variant(x, cos, sin, base="empty", odd_first=True)


def scatter_base_clone(x, cos, sin):
    return _wan_variant(x, cos, sin, base="clone", odd_first=False)


def scatter_base_zeros(x, cos, sin):
    return _wan_variant(x, cos, sin, base="zeros", odd_first=False)


def wan_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_il_tables(1, S, 1, D)


def wan_ref(x, c, s):
    return rope(x, c[..., 0::2], s[..., 1::2], interleaved=True, full=False)


# -- layouts
def bhsd_transposed(x, cos, sin):
    return omni_wan_rope(x, cos[:, None, :, :], sin[:, None, :, :])


def bhsd_make(dt):
    return noncontig_bhsd(B, H, S, D, dt), *half_tables(B, S, D // 2, dtype=dt)


def bhsd_ref(x, c, s):
    return rope(x, c[:, None], s[:, None], interleaved=True, full=False)


HQ, HK = 6, 3


def gqa_llama(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def gqa_make(dt):
    return noncontig_bhsd(B, HQ, S, D, dt), noncontig_bhsd(B, HK, S, D, dt), *full_neox_tables(B, S, D, dtype=dt)


def gqa_ref(q, k, c, s):
    return tuple(rope(x, c[:, None], s[:, None], interleaved=False, full=True) for x in (q, k))


# -- conjugate rotations
def conj_interleaved(x, cos, sin):
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rot = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (up(x) * cos - up(x_rot) * sin).to(x.dtype)


def conj_il_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_il_tables(1, S, 1, D)


def conj_il_ref(x, c, s):
    return rope(x, c, s, interleaved=True, full=True, conjugate=True)


def conj_complex(x, freqs):
    x_c = torch.view_as_complex(up(x).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs.conj()).flatten(3).type_as(x)


def conj_complex_make(dt):
    return rnd(B, S, H, D, dtype=dt), complex_freqs(S, 1, D // 2)


def conj_complex_ref(x, f):
    return rope(x, f.real, f.imag, interleaved=True, full=False, conjugate=True)


# -- q/k pairing
def qk_different_tables(q, k, cq, sq, ck, sk):
    """LTX cross-attention: q and k rotated with different tables (two kernels, no wrong pairing)."""
    return flux_rope(q, cq, sq), flux_rope(k, ck, sk)


def qk_diff_make(dt):
    return (rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *full_il_tables(1, S, 1, D),
            *full_il_tables(1, S, 1, D))


def qk_diff_ref(q, k, cq, sq, ck, sk):
    return rope(q, cq, sq, interleaved=True, full=True), rope(k, ck, sk, interleaved=True, full=True)


TXT = 3


def four_calls_two_tables(q_img, k_img, q_txt, k_txt, c_img, s_img, c_txt, s_txt):
    """Qwen-Image with sequence parallelism: image and text tokens rotated with their own tables."""
    return (omni_wan_rope(q_img, c_img, s_img), omni_wan_rope(k_img, c_img, s_img),
            omni_wan_rope(q_txt, c_txt, s_txt), omni_wan_rope(k_txt, c_txt, s_txt))


def four_make(dt):
    return (rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), rnd(B, TXT, H, D, dtype=dt),
            rnd(B, TXT, H, D, dtype=dt), *half_tables(1, S, 1, D // 2, dtype=dt),
            *half_tables(1, TXT, 1, D // 2, dtype=dt))


def four_ref(qi, ki, qt, kt, ci, si, ct, st):
    return (rope(qi, ci, si, interleaved=True, full=False), rope(ki, ci, si, interleaved=True, full=False),
            rope(qt, ct, st, interleaved=True, full=False), rope(kt, ct, st, interleaved=True, full=False))


# -- vLLM's native form: cos_sin_cache gathered by positions, [T, H*D] layout, partial, GQA
T, RV, HKV = 11, 8, 1


def vllm_native(positions, query, key, cos_sin_cache):
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)

    def one(x):
        shape = x.shape
        x = x.view(positions.shape[0], -1, D)
        x_rot, x_pass = x[..., :RV], x[..., RV:]
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(x_rot, 2, dim=-1)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        return torch.cat((torch.cat((o1, o2), dim=-1), x_pass), dim=-1).reshape(shape)

    return one(query), one(key)


def vllm_make(dt):
    c, s = half_tables(32, RV // 2)
    return (torch.randint(0, 32, (T,)), rnd(T, H * D, dtype=dt), rnd(T, HKV * D, dtype=dt),
            torch.cat([c, s], -1))


def vllm_ref(pos, q, k, cache):
    cs = cache.to(torch.promote_types(cache.dtype, q.dtype))[pos].to(q.dtype)
    c, s = cs[:, None, : RV // 2], cs[:, None, RV // 2:]
    return tuple(rope(x.view(T, -1, D), c, s, interleaved=False, rotary_dim=RV, full=False).reshape(x.shape)
                 for x in (q, k))


CASES = [
    Case("V_operand_order_cos_first", cos_first, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane")),
    Case("V_sum_order_sin_first", sum_order_swapped, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane")),
    Case("V_neg_torch_neg", neg_torch_neg, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane")),
    Case("V_neg_zero_minus", neg_zero_minus, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane"), (fp16,)),
    Case("V_neg_mul_minus_one", neg_mul_minus_one, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane"), (fp32,)),
    Case("V_addcmul", addcmul, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane")),
    Case("V_sub_as_add_of_negative", sub_as_add_neg, x_half_make, x_half_neox_ref, E(1, NX, D, "per-pair")),
    Case("V_table_cat_cc_in_graph", table_cat_neox, x_half_make, x_half_neox_ref, E(1, NX, D, "per-pair"), (fp16,)),
    Case("V_select_lanes_vs_unbind", select_lanes, x_half_make, x_half_il_ref, E(1, IL, D, "per-pair")),
    Case("V_split_by_view", split_by_view, x_half_make, x_half_il_ref, E(1, IL, D, "per-pair"), (fp32,)),
    Case("V_split_by_reshape", split_by_reshape, x_half_make, x_half_il_ref, E(1, IL, D, "per-pair")),
    Case("V_table_stack_flatten_in_graph", table_stack_flatten, x_half_make, x_half_il_ref, E(1, IL, D, "per-pair")),
    Case("V_odd_lanes_written_first", odd_lanes_first, wan_make, wan_ref, E(1, IL, D, "per-pair")),
    Case("V_scatter_base_clone", scatter_base_clone, wan_make, wan_ref, E(1, IL, D, "per-pair")),
    Case("V_scatter_base_zeros_like", scatter_base_zeros, wan_make, wan_ref, E(1, IL, D, "per-pair"), (fp16,)),
    Case("V_x_bhsd_transposed", bhsd_transposed, bhsd_make, bhsd_ref, E(1, IL, D, "per-pair")),
    Case("V_gqa_different_head_counts", gqa_llama, gqa_make, gqa_ref, E(2, NX, D, "per-lane")),
    Case("V_conjugate_interleaved", conj_interleaved, conj_il_make, conj_il_ref, E(1, IL, D, "per-lane", conj=True)),
    Case("V_conjugate_complex", conj_complex, conj_complex_make, conj_complex_ref,
         E(1, IL, D, "per-pair", conj=True)),
    Case("V_qk_different_tables", qk_different_tables, qk_diff_make, qk_diff_ref, E(2, IL, D, "per-lane", kernels=2)),
    Case("V_four_calls_two_tables", four_calls_two_tables, four_make, four_ref, E(4, IL, D, "per-pair", kernels=2)),
    Case("V_vllm_native_gathered_cache", vllm_native, vllm_make, vllm_ref, E(2, NX, RV, "per-pair")),
    Case("V_negated_tables", negated_tables, x_neox_make, negated_tables_ref,
         E(1, NX, D, "per-lane", conj=True), (fp32,)),  # read as the inverse rotation by -cos and sin
    Case("V_roll_back_with_sign_vector", roll_negative_shift, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane")),
    Case("V_angle_sum_tables_in_graph", angle_sum_tables, angle_sum_make, angle_sum_ref, E(1, NX, D, "per-lane"),
         (fp32,)),
]

# May fuse (it is a rotation) or be left alone (roll is opaque to the lane algebra): both are correct, but a
# fusion must be the right one and the numbers must hold.
OPTIONAL = [
    Case("V_roll_with_sign_vector", roll_with_sign, x_neox_make, x_neox_ref, E(1, NX, D, "per-lane")),
]
