"""A table is the node the op reads with its full geometry, never a node whose lanes merely look alike.

Computed tables (`c * 2`, `cs * 0.9`) are found by their lanes (passes/analysis/matcher.py `_gathered`): each lane is
one atom with its grid rank, and the rank says which leading index the atom stands for. A key without it once
let `c * 2` ([2, 8], one row per head) stand for its own row `(c * 2)[0]`, and a scaled packed `[S, 2, D]`
table stand for its cos half. q and k share one launch only where their table views broadcast alike
(passes/analysis/grouping.py `table_view_geometry`). Every case: the number of fused sites, the result against eager,
and the numerics contract against fp64 (docs/design.md section 2).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import as_tuple, check_numerics, check_unchanged


def rot_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def row_0_of_a_scaled_table(k, c, s):
    """issue 27: `c * 2` has one row per head of k; the table is its row 0."""
    return k * (c * 2)[0] + rot_half(k) * (s * 2)[0]


def row_1_of_a_scaled_table(k, c, s):
    return k * (c * 2)[1] + rot_half(k) * (s * 2)[1]


def last_row_of_a_scaled_table(k, c, s):
    return k * (c * 2)[-1] + rot_half(k) * (s * 2)[-1]


def packed_scaled_table(q, cs):
    """issue 27: a packed [S, 2, D] cos|sin table times an attention factor, split by select on dim 1."""
    t = cs * 0.9
    return q * t[:, 0] + rot_half(q) * t[:, 1]


def packed_scaled_table_swapped(q, cs):
    """The same table with the sin half first: the cos table is the select of index 1."""
    t = cs * 0.9
    return q * t[:, 1] + rot_half(q) * t[:, 0]


def middle_select_of_scaled_tables(k, c, s):
    """c and s [S, 2, D]: the second of two table sets, selected on a middle dim."""
    return k * (c * 2)[:, 1] + rot_half(k) * (s * 2)[:, 1]


def strided_lanes_of_scaled_tables(x, c, s):
    """Every other lane of a computed [S, 2D] table: a slice with a step along the lanes."""
    return x * (c * 2)[..., ::2] + rot_half(x) * (s * 2)[..., ::2]


def row_slice_of_scaled_tables(x, c, s):
    """Rows 1:2 of computed [2, S, D] tables: a slice of a leading dim that keeps it."""
    return x * (c * 2)[1:2] + rot_half(x) * (s * 2)[1:2]


def packed_last_dim_pairs(x, cs):
    """A [S, D, 2] table with cos and sin interleaved in its last dim, scaled, selected on that dim."""
    t = cs * 0.5
    return x * t[..., 0] + rot_half(x) * t[..., 1]


def qk_tables_broadcast_differently(q, k, c, s):
    """One cos/sin storage, read as [S, 1, D] for a [B, S, H, D] q and as [S, D] for a [B, H, S, D] k: with as
    many heads as positions both views broadcast against both x, but pair the positions with other dims."""
    return q * c.unsqueeze(1) + rot_half(q) * s.unsqueeze(1), k * c + rot_half(k) * s


def qk_computed_tables_broadcast_differently(q, k, c, s):
    """The same with computed tables: `(c * 1.5).unsqueeze(1)` for q, `c * 1.5` for k."""
    cq, sq = c * 1.5, s * 1.5
    return q * cq.unsqueeze(1) + rot_half(q) * sq.unsqueeze(1), k * cq + rot_half(k) * sq


def table_computed_after_the_rotation(x, c, s):
    """x is multiplied by c, then by 2; the only node that holds `c * 2` comes after the rotation (returned)."""
    return x * c * 2 + rot_half(x) * s * 2, c * 2, s * 2


R = torch.randn
CASES = [
    (row_0_of_a_scaled_table, lambda: (R(1, 4, 2, 8), R(2, 8), R(2, 8)), 1),
    (row_1_of_a_scaled_table, lambda: (R(1, 4, 2, 8), R(2, 8), R(2, 8)), 1),
    (last_row_of_a_scaled_table, lambda: (R(1, 4, 2, 8), R(2, 8), R(2, 8)), 1),
    (packed_scaled_table, lambda: (R(2, 2, 8), R(2, 2, 8)), 1),
    (packed_scaled_table_swapped, lambda: (R(2, 2, 8), R(2, 2, 8)), 1),
    (middle_select_of_scaled_tables, lambda: (R(1, 4, 2, 8), R(2, 2, 8), R(2, 2, 8)), 1),
    (strided_lanes_of_scaled_tables, lambda: (R(2, 4, 8), R(4, 16), R(4, 16)), 1),
    (row_slice_of_scaled_tables, lambda: (R(2, 4, 8), R(2, 4, 8), R(2, 4, 8)), 1),
    (packed_last_dim_pairs, lambda: (R(2, 3, 8), R(3, 8, 2)), None),  # fused or left alone, never wrong
    (table_computed_after_the_rotation, lambda: (R(2, 4, 8), R(4, 8), R(4, 8)), 1),
]


@pytest.mark.parametrize("fn,make,sites", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_table_is_the_view_the_graph_reads(fn, make, sites):
    torch.manual_seed(0)
    args = make()
    out, p = compile_with_pass(fn, *args)
    rep = p.report
    assert not rep.errors, rep.table()
    if sites is not None:
        assert len(rep.sites) == sites, rep.table()
    check_unchanged(fn, args, out)  # against eager, to a few ulps
    check_numerics(fn, args, out)  # against fp64


@pytest.mark.parametrize("fn", [qk_tables_broadcast_differently, qk_computed_tables_broadcast_differently])
def test_q_and_k_whose_tables_broadcast_differently_do_not_share_a_launch(fn):
    torch.manual_seed(0)
    S, H = 4, 2
    args = (R(1, S, H, 8), R(1, S, S, 8), R(S, 8), R(S, 8))  # k has as many heads as positions
    out, p = compile_with_pass(fn, *args)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 2 and not rep.errors, rep.table()
    check_unchanged(fn, args, out)
    check_numerics(fn, args, out)


def test_q_and_k_with_one_table_view_still_share_a_launch():
    """The near miss of the case above: the same [S, 1, D] view for two [B, S, H, D] tensors is one launch."""
    def fn(q, k, c, s):
        c, s = c.unsqueeze(1), s.unsqueeze(1)
        return q * c + rot_half(q) * s, k * c + rot_half(k) * s

    torch.manual_seed(0)
    args = (R(1, 4, 2, 8), R(1, 4, 4, 8), R(4, 8), R(4, 8))
    out, p = compile_with_pass(fn, *args)
    rep = p.report
    assert len(rep.sites) == 2 and len(rep.kernels) == 1 and not rep.errors, rep.table()
    for a, b in zip(as_tuple(out), as_tuple(fn(*args))):
        torch.testing.assert_close(a, b, rtol=0, atol=8 * torch.finfo(torch.float32).eps)
    check_numerics(fn, args, out)


def test_a_table_node_computed_from_the_rotation_is_not_read():
    """A lookup by lane values can name a node that reads the rotation itself (`(c + o - o) * 2` holds 2c):
    the op would read its own output, so the site is left unfused (with the reason), and the graph computes
    what eager computes."""
    def fn(x, c, s):
        out = x * c * 2 + rot_half(x) * s * 2
        o = out[0]
        return out, (c + o - o) * 2, (s + o - o) * 2

    torch.manual_seed(0)
    args = (R(2, 4, 8), R(4, 8), R(4, 8))
    out, p = compile_with_pass(fn, *args)
    rep = p.report
    assert rep.sites == [] and len(rep.errors) == 1, rep.table()
    assert "computed from the rotation" in rep.errors[0].error and rep.errors[0].outcome == "site left unfused"
    check_unchanged(fn, args, out)
