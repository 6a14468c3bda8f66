"""What the analysis skips to keep the pass's compile-time cost small, and that skipping loses nothing.

- The rotation screen (`matcher.looks_like_rotation`) answers, in one pass over a lane's atoms, the pairwise
  question it is defined by: do two products of the lane read different lanes of one tensor?
- The acceptor splits each rotated lane into its two products by reading the monomials
  (`matcher._split_products`) where the lane has the common form; it answers as the general search does.
- The lane interpreter skips values wider than any head that only flow into projections, statistics and
  elementwise math (a DiT block's modulation, gates and residual stream); the rotations beside them still
  fuse, with the same numerics. A wide value that the graph returns, or that flows into anything else (a
  cache write), is still analysed: it may be a rotation.
- Three shortcuts leave every answer as it was, sites and near-miss reasons: a reshape of a
  wide projection into heads is rejected before the projection's lanes are built, the acceptor drops an x
  candidate that lane 0 never reads, and a grouping whose rows are heads of one table is tried after the
  one-head grouping.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from rope_fusion.passes.analysis import lanes, matcher, sites
from rope_fusion.passes.analysis.matcher import SCAN_LANES, Acceptor, looks_like_rotation
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics


def _pairwise(entries) -> bool:
    """The screen's definition, checked pair by pair."""
    for e in entries[:SCAN_LANES]:
        products = [m for m in (e or {}) if len(m) > 1]
        atoms = [(a[:3], a[3], i) for i, m in enumerate(products) for a in m]
        if len(products) >= 2 and any(s == t and f != g and i != j
                                      for s, f, i in atoms for t, g, j in atoms):
            return True
    return False


def test_quick_split_agrees_with_the_general_search(monkeypatch):
    """Random x lanes (source lanes, or products such as a normed lane x * rsqrt * weight) and lanes built as
    c1 * t1 * xd + c2 * t2 * xp, some disturbed (a third product, one table for both, a table atom that is an
    x atom, xd == xp, another coefficient): wherever the quick split answers, the general search gives the
    same answer, and it answers for the undisturbed lanes."""
    rng = random.Random(11)
    pool = [(n, 1, False, i) for n in "xrwct" for i in range(3)]

    def mono(k):
        return tuple(sorted(rng.choice(pool) for _ in range(k)))

    answered = 0
    for _ in range(4000):
        md, mp = mono(rng.randint(1, 3)), mono(rng.randint(1, 3))
        xd, xp = {md: rng.choice([1.0, 2.0])}, {mp: 1.0}
        t1, t2 = rng.choice(pool), rng.choice(pool)
        e = {tuple(sorted(md + (t1,))): rng.choice([1.0, -0.5])}
        m2 = tuple(sorted(mp + (t2,)))
        e[m2] = e.get(m2, 0.0) + rng.choice([1.0, -1.0, 3.0])
        if rng.random() < 0.2:
            e[mono(2)] = 1.0
        quick = matcher._split_products(e, xd, xp)
        with monkeypatch.context() as m:
            m.setattr(matcher, "_split_products", lambda *a: None)
            general = Acceptor._split(None, e, xd, xp)
        if quick is not None:
            answered += 1
            assert quick == general, (e, xd, xp, quick, general)
    assert answered > 1000, answered


def test_rotation_screen_matches_its_pairwise_definition():
    rng = random.Random(7)
    agree = positives = 0
    for _ in range(5000):
        lane = {}
        for _ in range(rng.randint(0, 6)):
            mono = tuple(sorted((rng.choice("xyc"), 1, False, rng.randint(0, 3)) for _ in range(rng.randint(1, 3))))
            lane[mono] = rng.choice((1.0, -1.0, 0.5))
        value = lanes.LaneValue((4,), 1, [lane], False)
        want = _pairwise(value.entries)
        positives += want
        agree += looks_like_rotation(value) == want
    assert agree == 5000 and 500 < positives < 4500, (agree, positives)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope_neox(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def dit_block(h, emb, w_mod, wq, wk, wv, wo, nq, nk, cos, sin):
    """A DiT block over a 1152-wide hidden state: adaptive-norm modulation from a 6-way chunk of the
    conditioning, q/k/v projections, a per-head RMSNorm and NeoX RoPE on q and k, attention, a gated
    residual. Everything over 1152 lanes only reaches projections."""
    b, s, d = h.shape
    shift, scale, gate, *_ = (emb @ w_mod).chunk(6, -1)
    x = F.layer_norm(h, (d,)) * (1 + scale[:, None]) + shift[:, None]
    q, k, v = ((x @ w).view(b, s, -1, 64).transpose(1, 2) for w in (wq, wk, wv))
    q, k = _rope_neox(_rms(q, nq), cos, sin), _rope_neox(_rms(k, nk), cos, sin)
    attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
    return h + gate[:, None] * (attn @ wo)


def test_wide_values_that_only_feed_projections_are_skipped_and_the_site_still_fuses(monkeypatch):
    skipped: list = []
    real = lanes.LaneInterpreter._dead_ends

    def record(self):
        found = real(self)
        skipped.append({n.name: tuple(n.meta["val"].shape) for n in found})
        return found

    monkeypatch.setattr(lanes.LaneInterpreter, "_dead_ends", record)
    torch.manual_seed(0)
    d, s = 1152, 8
    ang = torch.rand(s, 32) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    args = (torch.randn(1, s, d), torch.randn(1, 64), torch.randn(64, 6 * d) / 8,
            *(torch.randn(d, d) / 34 for _ in range(4)), 1 + 0.1 * torch.randn(64), 1 + 0.1 * torch.randn(64),
            cos, sin)
    out, p = compile_with_pass(dit_block, *args)
    assert len(p.report.sites) == 2 and len(p.report.kernels) == 1, p.report.table()
    assert [site.norm for site in p.report.sites] == ["rms folded"] * 2, p.report.table()
    check_numerics(dit_block, args, out)
    graph_skips, = skipped
    assert graph_skips and all(shape[-1] > lanes.DEAD_END_LAST_DIM for shape in graph_skips.values())
    # the modulated activation and the layer norm's arithmetic are among them; nothing of a head's width is
    assert any(shape == (1, s, d) for shape in graph_skips.values()), graph_skips


def flat_rope(q, k, cos, sin):
    """vLLM's layout: q and k flat [T, H*D], 2048 lanes wide, rotated per head and returned flat."""
    t = q.shape[0]
    q = _rope_neox(q.view(t, -1, 128), cos[:, None], sin[:, None]).reshape(t, -1)
    k = _rope_neox(k.view(t, -1, 128), cos[:, None], sin[:, None]).reshape(t, -1)
    return q, k


def test_a_wide_value_the_graph_returns_is_still_analysed(monkeypatch):
    skipped: list = []
    real = lanes.LaneInterpreter._dead_ends

    def record(self):
        found = real(self)
        skipped.append(found)
        return found

    monkeypatch.setattr(lanes.LaneInterpreter, "_dead_ends", record)
    ang = torch.rand(6, 64) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    args = (torch.randn(6, 16 * 128), torch.randn(6, 16 * 128), cos, sin)
    out, p = compile_with_pass(flat_rope, *args)
    assert len(p.report.sites) == 2 and len(p.report.kernels) == 1, p.report.table()
    assert skipped == [set()]
    check_numerics(flat_rope, args, out)


def ltx_rope_into_caches(q, k, cos, sin, q_cache, k_cache, slots):
    """LTX-Video's rotation, done on the flat [T, H*D] hidden (2048 lanes) with per-lane tables, then written
    into caches (`index_copy`: no lane rule, no projection): the rotation's arithmetic is itself wide and ends
    there, so it must still be analysed, and it fuses."""
    def rope(x):
        re_, im = x.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-im, re_], -1).flatten(-2)
        return x * cos + rotated * sin

    return q_cache.index_copy(0, slots, rope(q)), k_cache.index_copy(0, slots, rope(k))


def test_a_wide_rotation_that_flows_into_a_cache_write_is_still_analysed():
    ang = torch.rand(6, 1024) * 6
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    args = (torch.randn(6, 2048), torch.randn(6, 2048), cos, sin, torch.zeros(10, 2048), torch.zeros(10, 2048),
            torch.tensor([7, 1, 3, 0, 9, 4]))
    out, p = compile_with_pass(ltx_rope_into_caches, *args)
    assert len(p.report.sites) == 2 and len(p.report.kernels) == 1, p.report.table()
    check_numerics(ltx_rope_into_caches, args, out)



def _answers(graph) -> tuple:
    matches, misses, _ = sites.find_sites(graph)
    return [repr(m) for m in matches], [(n.name, str(r)) for n, r in misses]


def _wide_projection_into_heads(h, w, cos, sin):
    """Flux's form: a 1024-wide projection viewed as 8 heads of 128 (rejected as a source before its lanes are
    built), then NeoX per head."""
    q = (h @ w).view(1, 4, 8, 128)
    return q * cos + torch.cat([-q[..., 64:], q[..., :64]], -1) * sin


def _norm_across_heads(x, weight, cos, sin):
    """Wan's form: an RMSNorm over all 4 x 32 lanes of a token, then the heads' interleaved pairs rotated by
    tables shared by every head (a 2-dim lane grid whose rows share tables)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    x1, x2 = x.view(1, 6, 4, 16, 2).unbind(-1)
    return torch.cat([(x1 * cos - x2 * sin)[..., None], (x1 * sin + x2 * cos)[..., None]], -1).flatten(3)


def test_the_analysis_shortcuts_leave_every_answer_unchanged(monkeypatch):
    """Every catalogue spelling, variation and near miss, traced to aten, with Flux's and Wan's forms at
    widths where the shortcuts act: the sites found (every field of each match) and the near-miss reasons are
    the same with the shortcuts switched off. Among them: complex pairs inside a head (where the wider
    grouping is the head), strided slices, pass-through heads, 2x2 matrices, norms per head and across heads."""
    from tests.spellings import ALL

    calls = [(case.id, case.fn, case.make(case.dtypes[0])) for case in ALL.values()]
    calls.append(("wide projection", _wide_projection_into_heads,
                  (torch.randn(1, 4, 64), torch.randn(64, 1024), torch.randn(4, 1, 128), torch.randn(4, 1, 128))))
    calls.append(("norm across heads", _norm_across_heads,
                  (torch.randn(1, 6, 128), torch.randn(128), torch.randn(6, 1, 16), torch.randn(6, 1, 16))))
    graphs, fast = [], []
    for _, fn, args in calls:
        graphs.append(make_fx(fn, tracing_mode="fake")(*args).graph)
        fast.append(_answers(graphs[-1]))
    assert fast[-2][0] and fast[-1][0]  # both forms are found
    monkeypatch.setattr(lanes.LaneInterpreter, "is_source", lambda self, arg: False)
    monkeypatch.setattr(matcher, "_reads_lane", lambda e, xd: True)
    monkeypatch.setattr(Acceptor, "_rows_share_tables", staticmethod(lambda v, m: False))
    for (name, _, _), graph, f in zip(calls, graphs, fast):
        assert _answers(graph) == f, name
