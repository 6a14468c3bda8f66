"""RoPE-looking arithmetic that is not a rotation of one tensor by tables independent of it: must not fuse.

`ref` is the nearest true RoPE: the self-check proves that each near miss really computes something else
(None where it makes no sense: the tables depend on x; a
lane is undefined)."""

from __future__ import annotations

import torch

from .case import B, Case, D, H, S, complex_freqs, full_neox_tables, half_tables, rnd, rope
from .catalogue import omni_wan_rope, rotate_half

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def neox_make(dt):
    return rnd(B, S, H, D, dtype=dt), *full_neox_tables(1, S, 1, D, dtype=dt)


def neox_ref(x, c, s):
    return rope(x, c, s, interleaved=False, full=True)


def same_table_twice(x, cos, sin):
    return x * cos + rotate_half(x) * cos  # cos where sin should be


def missing_negation(x, cos, sin):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((x2, x1), -1) * sin


def one_pair_wrong_sign(x, cos, sin):
    rot = rotate_half(x)
    rot = torch.cat([-rot[..., :1], rot[..., 1:]], -1)  # pair 0 gets the sign pattern of no rotation
    return x * cos + rot * sin


def scaled_table(x, cos, sin):
    return x * 2 * cos + rotate_half(x) * sin


def table_depends_on_x(x, cos, sin):
    c = cos * x.sum(-1, keepdim=True)
    return x * c + rotate_half(x) * sin


def halves_from_q_and_k(q, k, cos, sin):
    q1 = q[..., : D // 2]
    k2 = k[..., D // 2:]
    return q * cos + torch.cat((-k2, q1), -1) * sin


def qk_make(dt):
    return rnd(B, S, H, D, dtype=dt), rnd(B, S, H, D, dtype=dt), *full_neox_tables(1, S, 1, D, dtype=dt)


def qk_ref(q, k, c, s):
    return rope(q, c, s, interleaved=False, full=True)


def il_make(dt):
    return rnd(B, S, H, D, dtype=dt), *half_tables(1, S, 1, D // 2, dtype=dt)


def il_ref(x, c, s):
    return rope(x, c, s, interleaved=True, full=False)


def pairs_at_wrong_lanes(x, cos, sin):
    """Pair j's results are written at the lanes of pair j-1 (no full rotation exists in the graph)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    oa, ob = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    out = torch.empty_like(x)
    out[..., 0::2] = torch.cat([oa[..., 1:], oa[..., :1]], -1)
    out[..., 1::2] = torch.cat([ob[..., 1:], ob[..., :1]], -1)
    return out


def rotation_then_pair_permutation(x, cos, sin):
    """A true RoPE (the stack) whose pairs are then permuted: fusing the stack is right, the whole is not."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    o = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)  # [..., D/2, 2]
    o = torch.cat([o[..., 1:, :], o[..., :1, :]], -2)  # pair j written at the lanes of pair j-1
    return o.flatten(-2)


def middle_pair_not_rotated(x, cos, sin):
    """Not one rotation; but the graph holds a full rotation r, and pair 0 and pairs 2.. are each a rotation
    (R=2, and one of the slice x[..., 4:]): fusing such pieces is right, one site over all lanes is not."""
    r = omni_wan_rope(x, cos, sin)
    out = x.clone()
    out[..., :2] = r[..., :2]
    out[..., 4:] = r[..., 4:]  # lanes 2, 3 keep x: not a (partial) rotary
    return out


def lane_never_written(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 3::2] = (x1 * sin + x2 * cos)[..., 1:]  # lane 1 is never assigned
    return out


def lane_zero_never_written(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.zeros_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 3::2] = (x1 * sin + x2 * cos)[..., 1:]  # lane 1 stays 0
    return out


def conj_x_times_freqs(x, freqs):
    """conj(x) * freqs: each pair reflected (conj(x * conj(freqs))), not rotated."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc.conj() * freqs).flatten(3).type_as(x)


def conj_make(dt):
    return rnd(B, S, H, D, dtype=dt), complex_freqs(S, 1, D // 2)


def conj_ref(x, f):
    return rope(x, f.real, f.imag, interleaved=True, full=False)


def gate_from_x(x, cos, sin):
    """Tables gated by a value of x: computed from x, not a position embedding."""
    g = torch.sigmoid(x.mean(-1, keepdim=True))
    return x * (cos * g) + rotate_half(x) * (sin * g)


def defined_lanes(out):
    return torch.cat([out[..., :1], out[..., 2:]], -1)


CASES = [
    Case("NM_same_table_twice", same_table_twice, neox_make, neox_ref, None, (bf16,)),
    Case("NM_missing_negation", missing_negation, neox_make, neox_ref, None, (bf16,)),
    Case("NM_one_pair_wrong_sign", one_pair_wrong_sign, neox_make, neox_ref, None, (fp32,)),
    Case("NM_scaled_table_x_2_cos", scaled_table, neox_make, neox_ref, None, (fp16,)),
    Case("NM_table_depends_on_x", table_depends_on_x, neox_make, None, None, (fp32,)),
    Case("NM_halves_from_q_and_k", halves_from_q_and_k, qk_make, qk_ref, None, (bf16,)),
    Case("NM_pairs_at_wrong_lanes", pairs_at_wrong_lanes, il_make, il_ref, None, (bf16,)),
    Case("NM_lane_never_written", lane_never_written, il_make, None, None, (fp32,), compare=defined_lanes),
    Case("NM_lane_zero_never_written", lane_zero_never_written, il_make, il_ref, None, (bf16,)),
    Case("NM_conj_x_times_freqs", conj_x_times_freqs, conj_make, conj_ref, None, (fp32,)),
    Case("NM_table_gated_by_x", gate_from_x, neox_make, None, None, (fp32,)),
]

# Not one rotation, but holding true rotations inside (an intermediate, or pieces over slices of the lanes):
# the pass may fuse those, never the whole; the numbers must hold either way.
MAY_FUSE_PARTS = [
    Case("NM_middle_pair_not_rotated", middle_pair_not_rotated, il_make, il_ref, None, (fp32,),
         expect_miss=False),
    Case("NM_rotation_then_pair_permutation", rotation_then_pair_permutation, il_make, il_ref, None, (bf16,),
         expect_miss=False),
]
