"""Which nodes the pass replaces and which near misses it reports, in the cases that used to go wrong.

- A rotation read twice (as is, and through a view for a matmul) is rotated once, not twice.
- A near miss next to a fused rotation, or under an addition, is still reported, with its own reason.
- Every RoPE-like value that does not fuse is a near miss whose reason says what is wrong: per-head tables
  on a flattened head dim, one table for cos and sin, tables computed from x.
"""

from __future__ import annotations

import torch

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics, check_unchanged


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def _tables(*shape):
    a = torch.rand(*shape) * 6
    return a.cos(), a.sin()


def rope_read_twice(q, k, cos, sin):
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q @ k.mT, q * 2


def test_a_rotation_read_as_is_and_through_a_view_is_rotated_once():
    cos, sin = _tables(1, 8, 16)
    args = (torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16), cos, sin)
    out, p = compile_with_pass(rope_read_twice, *args)
    assert len(p.report.sites) == 2 and len(p.report.kernels) == 1, p.report.table()
    assert p.capture.rope_ops == 1 and p.capture.products_after == []
    check_numerics(rope_read_twice, args, out)


def good_plus_near_miss(q, k, cos, sin):
    good = q * cos + rotate_half(q) * sin
    bad = k * cos + rotate_half(k) * cos  # cos where sin belongs
    return good + bad


def test_a_near_miss_beside_a_fused_rotation_is_reported():
    cos, sin = _tables(6, 1, 16)
    args = (torch.randn(2, 6, 4, 16), torch.randn(2, 6, 4, 16), cos, sin)
    out, p = compile_with_pass(good_plus_near_miss, *args)
    assert len(p.report.sites) == 1, p.report.table()
    (miss,) = p.report.misses
    assert miss.reason.startswith("lane 0 multiplies x[0] and x[8] by the same entry of ")
    assert miss.reason.endswith(": cos and sin are one table here") and "test_sites.py" in miss.source
    check_numerics(good_plus_near_miss, args, out)


def near_miss_plus_bias(k, cos, bias):
    return (k * cos + rotate_half(k) * cos) + bias


def test_a_near_miss_under_an_addition_keeps_its_own_reason():
    cos, _ = _tables(6, 1, 16)
    args = (torch.randn(2, 6, 4, 16), cos, torch.randn(16))
    out, p = compile_with_pass(near_miss_plus_bias, *args)
    assert p.report.sites == [] and len(p.report.misses) == 1, p.report.table()
    assert "by the same entry" in p.report.misses[0].reason
    check_unchanged(near_miss_plus_bias, args, out)


def per_head_tables_flat_x(x, cos, sin):
    b, s, hd = x.shape
    xh = x.view(b, s, 4, 16)
    return (xh * cos + rotate_half(xh) * sin).view(b, s, hd)


def test_per_head_tables_on_a_flattened_head_dim_fuse_as_blocks():
    """Each head of the flat [.., H*D] result is rotated by its own table: NeoX pairs within H blocks of D
    lanes whose tables, flattened, are one [.., H*D] table (once a near miss: tables differ between heads)."""
    cos, sin = _tables(6, 4, 16)
    args = (torch.randn(2, 6, 64), cos, sin)
    out, p = compile_with_pass(per_head_tables_flat_x, *args)
    assert [(s.style, s.rotary_blocks, s.rotary_dim) for s in p.report.sites] == [("neox", 4, 64)], p.report.table()
    check_numerics(per_head_tables_flat_x, args, out, context=p.report.table())


def angles_from_x(q):
    return q * q.cos() + rotate_half(q) * q.sin()


def angles_from_upcast_x(q):
    qf = q.float()
    return (qf * qf.cos() + rotate_half(qf) * qf.sin()).to(q.dtype)


def test_tables_computed_from_x_are_not_a_rope():
    """docs/design.md: tables must not depend on x (a rotation by angles taken from x is no position
    embedding), also when x is the upcast or the rotate_half of the input."""
    for fn, dtype in ((angles_from_x, torch.float32), (angles_from_upcast_x, torch.bfloat16)):
        args = (torch.randn(2, 6, 4, 16, dtype=dtype),)
        out, p = compile_with_pass(fn, *args)
        assert p.report.sites == [] and len(p.report.misses) == 1, p.report.table()
        assert "computed from x" in p.report.misses[0].reason, p.report.table()
        check_unchanged(fn, args, out)


def two_independent_attentions(h1, h2, w, cos, sin):
    """q and k of two attentions on different activations, all rotated by one table."""
    def qk(h):
        q, k = (h @ w).view(2, 6, 2, 4, 16).unbind(2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return (*qk(h1), *qk(h2))


def test_a_third_tensor_joins_a_launch_only_from_the_same_activation():
    """q, k and v projected from one activation share a `rotary_qkv` launch (CLVP, the catalogue's M10); the q
    of another, independent attention that reads the same table does not join a pair (its launch would wait
    for that attention's projection): two `rotary_qk`, each attention's q and k."""
    cos, sin = _tables(6, 1, 16)
    args = (torch.randn(2, 6, 32), torch.randn(2, 6, 32), torch.randn(32, 128) / 8, cos, sin)
    out, p = compile_with_pass(two_independent_attentions, *args)
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qk"] * 2, p.report.table()
    assert [sorted(k.sites) for k in p.report.kernels] == [[0, 1], [2, 3]], p.report.table()
    check_numerics(two_independent_attentions, args, out, context=p.report.table())


def three_inputs_one_table(q, k, v, cos, sin):
    return tuple(x * cos + rotate_half(x) * sin for x in (q, k, v))


def test_three_graph_inputs_share_one_launch():
    """q, k and v that are inputs of the graph wait for nothing: one `rotary_qkv`."""
    cos, sin = _tables(6, 1, 16)
    args = (torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16), cos, sin)
    out, p = compile_with_pass(three_inputs_one_table, *args)
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qkv"], p.report.table()
    check_numerics(three_inputs_one_table, args, out, context=p.report.table())
