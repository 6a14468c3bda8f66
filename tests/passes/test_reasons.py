"""Issue 27 (misses and misleading reasons) and issue 34 (reasons that mislead): each reproducer, reduced, either
fuses (sites counted, numbers against fp64) or is a near miss whose reason names the real obstacle.

A user reads a near miss's reason to decide what to change, so each reason is checked by its text: the forms
that used to be told "enters with a negative factor", "pairs with neither lane 0+R/2 nor lane 1" or "x is
broadcast to the output shape", or nothing at all, and the ones they are now told."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics, check_unchanged

B, S, H, D = 2, 7, 3, 16


def rot_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def tables(*shape):
    a = torch.randn(*shape, dtype=torch.float64) * 3
    return a.cos().float(), a.sin().float()


def fused(fn, *args, sites=1, kernels=1):
    out, p = compile_with_pass(fn, *args)
    t = p.report.table()
    assert not p.report.errors, t
    assert len(p.report.sites) == sites and len(p.report.kernels) == kernels, t
    check_numerics(fn, args, out, context=t)
    return p


def missed(fn, *args, reason: str):
    """Not fused, the numbers unchanged, and exactly one near miss, whose reason contains `reason`."""
    out, p = compile_with_pass(fn, *args)
    t = p.report.table()
    assert not p.report.errors, t
    assert not p.report.sites, t
    check_unchanged(fn, args, out, context=t)
    assert len(p.report.misses) == 1 and reason in p.report.misses[0].reason, t
    return p.report.misses[0].reason


# -- the negated-table form: a rotation by the angle plus pi ------------------------------------------

def negated_tables(x, cos, sin):
    return x * (-cos) + rot_half(x) * (-sin)


def negated_cos_only(x, cos, sin):
    return x * -cos + rot_half(x) * sin  # the rotation by pi minus the angle


def test_negated_tables_fuse():
    """Was "lane 0: x[0] enters with a negative factor" (46 of 200 random table cases)."""
    x, (c, s) = torch.randn(B, S, H, D), tables(S, 1, D)
    fused(negated_tables, x, c, s)
    fused(negated_cos_only, x, c, s)


def negated_without_a_table_node(x, cos, sin):
    return (x * cos) * -1.0 + rot_half(x) * (-sin)


def test_a_negation_that_no_table_holds_says_so():
    x, (c, s) = torch.randn(B, S, H, D), tables(S, 1, D)
    reason = missed(negated_without_a_table_node, x, c, s, reason="no node of the graph holds -")
    assert "negative factor" not in reason


# -- tables computed in the graph ----------------------------------------------------------------------

def table_sum(x, c, s, c2, s2):
    return x * (c + c2) + rot_half(x) * (s + s2)


def angle_sum(x, c1, s1, c2, s2):
    """cos(a + b) and sin(a + b) from the tables of a and of b."""
    return x * (c1 * c2 - s1 * s2) + rot_half(x) * (s1 * c2 + c1 * s2)


def gated_tables(x, c, s, g):
    return x * (c * g) + rot_half(x) * (s * g)


@pytest.mark.parametrize("fn", [table_sum, angle_sum], ids=lambda f: f.__name__)
def test_tables_computed_in_the_graph_fuse(fn):
    """Was "lane 0 pairs with neither lane 0+R/2 (NeoX) nor lane 1 (interleaved) of x"."""
    x, (c1, s1), (c2, s2) = torch.randn(B, S, H, D), tables(S, 1, D), tables(S, 1, D)
    fused(fn, x, c1, s1, c2, s2)


def test_gated_tables_fuse():
    x, (c, s) = torch.randn(B, S, H, D), tables(S, 1, D)
    fused(gated_tables, x, c, s, torch.rand(S, 1, D))


def gate_applied_after_x(x, c, s, g):
    return x * c * g + rot_half(x) * s * g  # (x * c) * g: no tensor holds the table c * g


def test_a_computed_table_that_no_node_holds_says_so():
    x, (c, s) = torch.randn(B, S, H, D), tables(S, 1, D)
    reason = missed(gate_applied_after_x, x, c, s, torch.rand(S, 1, D),
                    reason="is a table computed in the graph, but no node holds it")
    assert "pairs with neither" not in reason


def gate_computed_from_x(x, c, s):
    g = torch.sigmoid(x.mean(-1, keepdim=True))
    return x * (c * g) + rot_half(x) * (s * g)


def test_a_computed_table_that_depends_on_x_says_so():
    x, (c, s) = torch.randn(B, S, H, D), tables(S, 1, D)
    missed(gate_computed_from_x, x, c, s, reason="is computed from x")


# -- complex form -------------------------------------------------------------------------------------

def conj_x_times_freqs(x, freqs):
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc.conj() * freqs).flatten(3)


def test_conj_of_x_is_a_reflection():
    """Was "x is broadcast to the output shape" (of freqs, which the product pairs with x's lanes as if x were
    the tables). conj(x) * freqs is conj(x * conj(freqs)): each pair reflected, which the op cannot compute."""
    x = torch.randn(B, S, H, D)
    freqs = torch.polar(torch.ones(S, 1, D // 2), torch.randn(S, 1, D // 2))
    reason = missed(conj_x_times_freqs, x, freqs, reason="reflect each pair of x instead of rotating it")
    assert "broadcast" not in reason


# -- silent misses ------------------------------------------------------------------------------------

def rotary_dim_2(x, c, s):
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


def rotary_dim_2_of_16(x, c, s):
    a, b = x[..., :2].unflatten(-1, (-1, 2)).unbind(-1)
    return torch.cat([torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2), x[..., 2:]], -1)


def test_rotary_dim_2_fuses():
    c, s = tables(S, 1, 1)
    fused(rotary_dim_2, torch.randn(B, S, H, 2), c, s)
    fused(rotary_dim_2_of_16, torch.randn(B, S, H, D), c, s)


def flat_rotation_into_a_matmul(x, c, s, w):
    return (x * c + rot_half(x) * s) @ w


def test_a_flat_rotation_that_feeds_a_matmul_fuses():
    """[B, S, 2048] rotated whole and projected at once: the dead-end skip (a wide value that only feeds
    projections) used to skip it as it skips a DiT's modulation."""
    c, s = tables(S, 2048)
    fused(flat_rotation_into_a_matmul, torch.randn(1, S, 2048), c, s, torch.randn(2048, 32) / 45)


def test_a_rotation_over_the_lane_cap_is_a_near_miss():
    c, s = tables(S, 5120)
    missed(flat_rotation_into_a_matmul, torch.randn(1, S, 5120), c, s, torch.randn(5120, 32) / 72,
           reason="over the analysis cap of 4096 lanes")


def roll_half_swap(x, cos, sin):
    sign = torch.cat([-torch.ones(D // 2, dtype=x.dtype), torch.ones(D // 2, dtype=x.dtype)])
    return x * cos + torch.roll(x, D // 2, -1) * sign * sin


def test_the_half_swap_written_with_roll_fuses():
    x, (c, s) = torch.randn(B, S, H, D), tables(S, 1, D)
    fused(roll_half_swap, x, c, s)


# -- a 2x2 matrix applied with einsum -----------------------------------------------------------------

def einsum_rotation_matrix(x, angle):
    cos, sin = angle.cos(), angle.sin()
    r = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return torch.einsum("...ij,...j->...i", r, x.reshape(*x.shape[:-1], -1, 2)).flatten(-2)


def test_a_2x2_matrix_applied_with_einsum_is_a_near_miss():
    """Was "0 sites, 0 near misses": the post-grad graph is a bmm over permuted leading dims."""
    missed(einsum_rotation_matrix, torch.randn(B, S, H, D), torch.randn(S, 1, D // 2),
           reason="a 2x2 matrix built from cos and sin is applied to pairs of lanes with a matmul")


def two_feature_layers(x, w1, w2):
    """A linear layer of 2 features (a tiny model's time embedding: CogVideoX's time_embed_dim=2), in a training
    step: its matmuls are [N, 2] @ [2, 2], which no pair rotation applied with einsum is (that is batched)."""
    return F.linear(F.silu(F.linear(x, w1)), w2)


def test_a_linear_layer_of_two_features_is_no_2x2_pair_matrix():
    """Was a near miss "a 2x2 matrix read from a tensor ... is applied to pairs of lanes with a matmul" for every
    such matmul of the forward and the backward."""
    x, w1, w2 = torch.randn(8, 2), torch.randn(2, 2, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    import rope_fusion

    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(two_feature_layers, options={"post_grad_custom_post_pass": p})(x, w1, w2).sum().backward()
    assert p.report.graphs == 2 and not p.report.misses and not p.report.sites, p.report.table()


# -- one bug in q and k of one block: one reason ------------------------------------------------------

def _rope_tables(s, d):
    inv = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    a = torch.outer(torch.arange(s).float(), inv)
    a = torch.cat((a, a), -1)
    return a.cos(), a.sin()


class Block(nn.Module):
    """An attention block with a residual (issue 34's reproducer); `bug` spells its rotation of q and k."""

    def __init__(self, bug):
        super().__init__()
        self.bug = bug
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).transpose(1, 3).unbind(2)
        c, sn = _rope_tables(s, 16)
        q, k = self.bug(q, c, sn), self.bug(k, c, sn)
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 64))


BUGS = {
    "cos_twice": (lambda q, c, s: q * c + rot_half(q) * c, "cos and sin are one table here"),
    "no_negation": (lambda q, c, s: q * c + torch.cat(q.chunk(2, -1)[::-1], -1) * s, "general 2x2 matrix"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_one_bug_in_q_and_k_gets_one_reason(bug):
    fn, reason = BUGS[bug]
    torch.manual_seed(0)
    model = nn.Sequential(Block(lambda q, c, s: q * c + rot_half(q) * s), Block(fn)).eval()
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        out, p = compile_with_pass(model, x)
        want = model.double()(x.double())
    t = p.report.table()
    assert (out.double() - want).abs().max() <= 1e-4 * want.abs().max(), t  # fp32 against fp64
    assert len(p.report.sites) == 2, t  # the correct block's q and k
    reasons = [m.reason for m in p.report.misses]
    assert len(reasons) == 2 and reasons[0] == reasons[1] and reason in reasons[0], t
