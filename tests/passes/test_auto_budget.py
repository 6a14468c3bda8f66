"""What `auto` measures (passes/auto/auto_budget.py): only the sites whose choice the factor table cannot call, only the
candidates it does not rule out, briefly where a brief timing settles the choice; decisions shared by every site of
one signature, across the blocks of a model and its forward and backward graphs.

The estimates are the real cost model's (ops/cost_model.py) on the sites of the zoo's GPU models as the pass costs
them (shapes, dtypes, folded norms and table sources of their post-grad graphs); the integration tests run the
pass on fake CUDA tensors (nothing to time on: what the budget decides shows in the report) and on the CPU with
measuring on and the clock steered, as tests/passes/test_measured_auto.py does.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import rope_fusion
from rope_fusion.ops.cost_model import SiteCost, cheapest, estimates
from rope_fusion.passes.auto import auto_budget, auto_decisions, auto_timing
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

BF16 = 2


def _cost(tokens, heads_q, heads_k, head_dim, *, norm="none", style="interleaved", table_bytes, computed=True,
          users=1, padded=False, x_bytes_each=BF16 + BF16, **kw):
    x = tokens * (heads_q + heads_k) * head_dim * x_bytes_each
    return SiteCost(x_bytes=x, table_bytes=table_bytes, tables_computed=computed, table_users=users, style=style,
                    norm=norm, padded=padded, **kw)


# The zoo's sites as the pass costs them (the pass's SiteCost on each model's real-size post-grad graph).
ZOO = {
    "wan-1.3b": _cost(32760, 12, 12, 128, norm="rms_across_heads", table_bytes=8386560),
    "qwen-image image": _cost(4096, 24, 24, 128, norm="rms", table_bytes=2097152),
    "qwen-image text": _cost(256, 24, 24, 128, norm="rms", table_bytes=131072),
    "flux per-head norm": _cost(4608, 24, 24, 128, norm="rms", table_bytes=4718592, users=8),
    "hunyuan-video per-head norm": _cost(18360, 24, 24, 128, norm="rms", table_bytes=18800640, users=8),
    # the joint pair with its pieces' norms folded into the cat op (passes/folds/fold_cat.py costs them)
    "flux joint": _cost(4608, 24, 24, 128, norm="rms", table_bytes=4718592, users=8),
    "flux joint, pieces unnormed": _cost(4608, 24, 24, 128, table_bytes=4718592, users=8),
    "ltx-video": _cost(5632, 1, 1, 2048, norm="rms", table_bytes=23046144, padded=True),
    "qwen3-8b": _cost(8192, 32, 8, 128, norm="rms", style="neox", table_bytes=4194304, users=2),
    "qwen2.5-vl vision": _cost(32768, 16, 16, 80, style="neox", table_bytes=2 * 32768 * 80 * 4, computed=False,
                               padded=True, x_bytes_each=4 + 4),
    "hunyuan-video joined text": _cost(18360, 24, 24, 128, table_bytes=18800640, users=8,
                                       x_fused_upstream_bytes=451215360),
}
UNMEASURED = {"wan-1.3b": "triton", "qwen-image image": "triton", "qwen-image text": "triton",
              "flux per-head norm": "triton", "hunyuan-video per-head norm": "triton", "flux joint": "triton"}


@pytest.mark.parametrize("name", list(ZOO))
def test_only_sites_the_table_cannot_call_are_measured(name):
    cost = ZOO[name]
    budget = auto_budget.plan(cost, ["triton", "inductor"])
    est = estimates(cost)
    ratio = min(est["triton"], est["inductor"]) / est["left"]
    if name in UNMEASURED:  # the table's fused pick at half of left or less: no candidate is compiled
        assert not budget.measure and budget.choice == UNMEASURED[name] == cheapest(cost)[0], (ratio, budget)
        assert ratio <= auto_budget.FUSED_CLEAR and "clear-cut, not measured" in budget.why
    else:  # LTX-Video's and the vision tower's sites, where the table chose wrong, among them
        assert budget.measure and budget.choice is None, (ratio, budget)
        assert auto_budget.FUSED_CLEAR < ratio < auto_budget.LEFT_CLEAR
        assert set(budget.candidates) == {"triton", "inductor"}  # none estimated at twice the other


def test_ltx_and_the_vision_tower_are_measured_whatever_the_candidates():
    for name in ("ltx-video", "qwen2.5-vl vision"):
        for candidates in (["triton", "inductor"], ["inductor"], ["triton"]):
            assert auto_budget.plan(ZOO[name], candidates).measure, (name, candidates)


def test_a_candidate_the_table_rules_out_by_twice_the_best_is_not_compiled():
    # tables as large as x, computed in the graph and read by this site alone (LTX's per-head tables): the kernel
    # would read them after another kernel wrote them; the lowering and plain compile compute them inline
    cost = _cost(5632, 32, 32, 64, style="neox", table_bytes=2 * 5632 * 32 * 64 * 4)  # fp32 cos and sin
    est = estimates(cost)
    assert est["triton"] >= auto_budget.RULED_OUT * est["inductor"]
    budget = auto_budget.plan(cost, ["triton", "inductor"])
    assert budget.measure and budget.candidates == ("inductor",)


def test_left_is_taken_unmeasured_where_every_fused_choice_is_twice_its_estimate():
    # a norm across heads before a NeoX rotation on a device whose only fused choice is the lowering
    cost = _cost(32760, 12, 12, 128, norm="rms_across_heads", style="neox", table_bytes=8386560)
    est = estimates(cost)
    assert est["inductor"] >= auto_budget.LEFT_CLEAR * est["left"]
    budget = auto_budget.plan(cost, ["inductor"])
    assert not budget.measure and budget.choice == "left" and "left unmeasured" in budget.why
    assert auto_budget.plan(cost, ["triton", "inductor"]).measure  # with the kernel (0.8 of left): measured


def test_measure_true_measures_every_site_and_sizes_known_at_run_time_are_left_to_measuring():
    for cost in ZOO.values():
        assert auto_budget.plan(cost, ["triton", "inductor"], True) == auto_budget.Budget(True, ("triton",
                                                                                                "inductor"))
    symbolic = SiteCost(None, 0, False, 1, "neox")
    assert auto_budget.plan(symbolic, ["triton"]).measure  # measuring then says why not (a symbolic size)


def test_a_quick_timing_stands_where_it_settles_the_choice():
    plans = []

    def timer_for(timing):
        plans.append(timing)
        return lambda name, run: run() * 1e-6

    runs = {"left": lambda: 10.0, "triton": lambda: 5.0, "inductor": lambda: 8.0}
    assert auto_budget.time_runs(runs, timer_for, 0.02) == {"left": 10.0, "triton": 5.0, "inductor": 8.0}
    assert plans == [auto_budget.QUICK]
    plans.clear()  # the best fused candidate near the margin: timed again in full
    runs = {"left": 10.0, "triton": 9.7, "inductor": 12.0}
    auto_budget.time_runs({k: (lambda v=v: v) for k, v in runs.items()}, timer_for, 0.02)
    assert plans == [auto_budget.QUICK, auto_budget.FULL]
    plans.clear()  # two fused candidates within SETTLED of each other
    runs = {"left": 10.0, "triton": 5.0, "inductor": 5.2}
    auto_budget.time_runs({k: (lambda v=v: v) for k, v in runs.items()}, timer_for, 0.02)
    assert plans == [auto_budget.QUICK, auto_budget.FULL]
    plans.clear()
    auto_budget.time_runs({"left": lambda: 10.0, "triton": lambda: 5.0}, timer_for, 0.02, policy=True)
    assert plans == [auto_budget.FULL]


# -- through the pass: fake CUDA tensors (no device to time on) ----------------------------------------------

def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rope_interleaved(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    rot = torch.stack((-x2, x1), -1).flatten(-2)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def normed_qk(q, k, wq, wk, cos, sin):
    """Wan-like: a norm across all heads of the token, then an interleaved rotation."""
    b, s, h, d = q.shape
    q = rms(q.flatten(-2).float(), wq).to(q.dtype).unflatten(-1, (h, d))
    k = rms(k.flatten(-2).float(), wk).to(k.dtype).unflatten(-1, (h, d))
    return rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)


def _fake_cuda(*specs):
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=d) for s, d in specs]


def _run_fake(fn, args, **options):
    from torch._inductor.decomposition import select_decomp_table

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    p = rope_fusion.RopeFusionPass(**options)
    p(gm.graph)
    assert not p.report.errors, p.report.table()
    return p


@pytest.fixture
def fresh_decisions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(auto_timing.ENV, raising=False)


def _wan_site(tokens):
    return _fake_cuda(((1, tokens, 12, 128), torch.bfloat16), ((1, tokens, 12, 128), torch.bfloat16),
                      ((1536,), torch.float32), ((1536,), torch.float32), ((tokens, 1, 128), torch.float32),
                      ((tokens, 1, 128), torch.float32))


def test_the_pass_takes_a_clear_cut_choice_without_trying_to_measure(fresh_decisions):
    before = collections.Counter(auto_timing.STATS)
    p = _run_fake(normed_qk, _wan_site(8192))
    (kernel,) = p.report.kernels
    assert kernel.backend == "triton" and kernel.choice.startswith("table, clear-cut, not measured"), kernel.choice
    assert auto_timing.STATS["clear"] == before["clear"] + 1 and auto_timing.STATS["table"] == before["table"]
    # measure=True tries to measure it (here there is no GPU to time on: the table decides, and says why)
    p = _run_fake(normed_qk, _wan_site(8192), measure=True)
    assert "table, not measured: no cuda device here to time on" in p.report.kernels[0].choice
    assert auto_timing.STATS["clear"] == before["clear"] + 1


# -- through the pass on the CPU, measuring on, the clock steered ------------------------------------------

class Clock:
    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, name, run):
        run()
        self.calls.append(name)
        return self.times[name]


@pytest.fixture
def clock(fresh_decisions, monkeypatch):
    monkeypatch.setattr(auto_timing, "_MEASURE_DEVICE_TYPES", ("cuda", "cpu"))
    c = Clock({"left": 10e-6, "inductor": 5e-6})
    monkeypatch.setattr(auto_timing, "TIMER", c)
    return c


def rope_complex(q, k, freqs):
    """Complex q and k times complex freqs: plain compile's complex multiply is estimated at 5.2x the floor, the
    lowering at 1.45x."""
    return torch.view_as_real(q * freqs).flatten(-2), torch.view_as_real(k * freqs).flatten(-2)


def _complex_args(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 1024, 8, 32, 2, generator=g) for _ in range(2))
    ang = torch.rand(1024, 1, 32, generator=g) * 6
    return torch.view_as_complex(q), torch.view_as_complex(k), torch.polar(torch.ones_like(ang), ang)


def test_a_clear_cut_site_compiles_and_times_nothing_and_measure_true_times_it(clock):
    """(Costed as replayed in CUDA graphs: a graph this small without them waits on the host, where the launches'
    host time, not the bytes, decides and the choice is not clear-cut.)"""
    args = _complex_args()
    out, p = compile_with_pass(rope_complex, *args, cuda_graphs=True)
    assert clock.calls == [] and [k.backend for k in p.report.kernels] == ["inductor"], p.report.table()
    assert p.report.kernels[0].choice.startswith("table, clear-cut, not measured"), p.report.table()
    check_numerics(rope_complex, args, out)
    out, p = compile_with_pass(rope_complex, *args, cuda_graphs=True, measure=True)
    assert sorted(clock.calls) == ["inductor", "left"], p.report.table()
    assert p.report.kernels[0].choice.startswith("measured inductor 5.0 us, left 10.0 us"), p.report.table()
    check_numerics(rope_complex, args, out)


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


class Block(torch.nn.Module):
    def __init__(self, dim=64, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, h, cos, sin):
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, self.heads, -1) for p in (self.q, self.k, self.v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return h + o.transpose(1, 2).flatten(-2)


class TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, h, cos, sin):
        for b in self.blocks:
            h = b(h, cos, sin)
        return h


def test_the_blocks_of_a_model_and_its_backward_share_decisions(clock):
    """Every block's site reads alike (one signature): the first is timed, the second reads its decision; the
    backward graph's sites (the inverse rotation of the gradient attention's backward wrote) are one more
    signature, timed once for both blocks."""
    torch.manual_seed(0)
    m = TwoBlocks()
    h = torch.randn(1, 16, 64, requires_grad=True)
    cos, sin = torch.randn(16, 1, 32), torch.randn(16, 1, 32)
    before = collections.Counter(auto_timing.STATS)
    out, p = compile_with_pass(m, h, cos, sin, measure=True)
    fwd = {k: auto_timing.STATS[k] - before[k] for k in ("timed", "cached")}
    assert fwd == {"timed": 1, "cached": 1} and len(p.report.kernels) == 2, p.report.table()
    out.sum().backward()
    bwd = {k: auto_timing.STATS[k] - before[k] - fwd[k] for k in ("timed", "cached")}
    graphs = [r.kind for r in p.report.graph_records]
    assert graphs == ["forward", "backward"] and bwd == {"timed": 1, "cached": 1}, (bwd, p.report.table())
    assert len(auto_decisions.DECISIONS._entries) == 2
    torch.testing.assert_close(out, m(h, cos, sin))


def test_the_kernel_is_never_compiled_under_a_norm_across_heads_with_per_head_tables():
    """LTX-Video's form, its heads split out: a norm across 32 heads of 64 and a table per head computed in the
    graph; the kernel measured 1.7x plain compile there. Wan's form (tables shared by the heads) keeps it."""
    ltx = _cost(5632, 32, 32, 64, norm="rms_across_heads", table_bytes=5632 * 1024 * 4)
    budget = auto_budget.plan(ltx, ["triton", "inductor"])
    assert "triton" not in budget.candidates and budget.choice != "triton", budget
    assert auto_budget.plan(ZOO["wan-1.3b"], ["triton", "inductor"]).choice == "triton"
    given = _cost(5632, 32, 32, 64, norm="rms_across_heads", table_bytes=5632 * 1024 * 4, computed=False)
    assert "triton" in auto_budget.plan(given, ["triton", "inductor"], True).candidates  # tables read as they are


def test_a_site_whose_only_candidate_is_never_taken_is_left_unmeasured():
    ltx = _cost(5632, 32, 32, 64, norm="rms_across_heads", table_bytes=5632 * 1024 * 4)
    budget = auto_budget.plan(ltx, ["triton"])
    assert not budget.measure and budget.choice == "left" and "1.7x plain compile" in budget.why


# -- the compile's allowance: measuring takes at most a share of the compile --------------------------------

def _graph_of(nodes: int) -> torch.fx.Graph:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for _ in range(nodes):
        x = g.call_function(torch.ops.aten.neg.default, (x,))
    g.output(x)
    return g


def test_an_allowance_is_a_share_of_the_graphs_estimated_compile_less_what_measuring_spent():
    a = auto_budget.Allowance(0.1)
    g = _graph_of(1000)
    a.earn(g)
    a.earn(g)  # a graph earns once
    assert a.nodes == 1000 and a.earned == pytest.approx(0.1 * auto_budget.NODE_SECONDS * 1000)
    two = auto_budget.Allowance.cost(1)  # "left" and one fused candidate
    assert two == pytest.approx(2 * auto_budget.CANDIDATE_SECONDS + auto_budget.TIMING_SECONDS)
    assert a.affords(1) is (a.earned >= two)
    a.earn(_graph_of(int(two / (0.1 * auto_budget.NODE_SECONDS)) + 1))  # a second piece of the same compile
    assert a.affords(1) and not a.affords(50)
    a.spend(a.earned)
    assert not a.affords(1)
    words = a.refusal(1)
    assert words.startswith(f"not measured: measuring this signature would take about {two:.1f} s") and \
        "allowance for measuring is 0.00 s" in words and "measure=True" in words


@pytest.mark.parametrize("text,want", [("0.25", 0.25), ("inf", float("inf")), ("0", 0.0), ("", auto_budget.SHARE),
                                       ("lots", auto_budget.SHARE), ("-1", auto_budget.SHARE)])
def test_the_share_comes_from_the_environment(monkeypatch, caplog, text, want):
    monkeypatch.setenv(auto_budget.SHARE_ENV, text)
    with caplog.at_level("WARNING", logger="rope_fusion"):
        assert auto_budget.share() == want
    assert (auto_budget.SHARE_ENV in caplog.text) is (text in ("lots", "-1"))


def attention(h, wq, wk, wv, cos, sin):
    """Block's forward as a function of its weights (the fp64 reference casts them too)."""
    b, s, _ = h.shape
    q, k, v = ((h @ w).view(b, s, 2, 32) for w in (wq, wk, wv))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return h + o.transpose(1, 2).flatten(-2)


def test_a_small_compile_leaves_an_undecided_site_unmeasured_and_reads_a_decision_measured_once(clock, monkeypatch):
    """Under "auto" the one-block graph earns far less than measuring its signature costs: nothing is compiled or
    timed, the site stays as plain compile writes it, and the report says why. `measure=True` measures it once;
    every later "auto" compile reads that decision from disk and fuses, timing nothing."""
    monkeypatch.setenv(auto_budget.SHARE_ENV, str(auto_budget.SHARE))
    torch.manual_seed(0)
    args = (torch.randn(1, 16, 64), *(torch.randn(64, 64) / 8 for _ in range(3)), torch.randn(16, 1, 32),
            torch.randn(16, 1, 32))
    before = collections.Counter(auto_timing.STATS)
    out, p = compile_with_pass(attention, *args)
    assert clock.calls == [] and auto_timing.STATS["over allowance"] - before["over allowance"] == 1
    assert not p.report.kernels and any("would take about" in x.reason and "allowance" in x.reason
                                        for x in p.report.misses), p.report.table()
    check_numerics(attention, args, out)
    compile_with_pass(attention, *args, measure=True)
    assert sorted(clock.calls) == ["inductor", "left"]
    out, p = compile_with_pass(attention, *args)
    assert sorted(clock.calls) == ["inductor", "left"] and [k.backend for k in p.report.kernels] == ["inductor"]
    assert p.report.kernels[0].choice.startswith("cached"), p.report.table()
    check_numerics(attention, args, out)


def test_every_graph_of_a_compile_earns_its_allowance_with_or_without_a_rotation():
    """vLLM compiles a model as pieces, one Dynamo compile: a piece without a rotation (the MLP, the norms) still
    adds to what measuring may take in a later piece that holds one."""
    import torch._guards

    from rope_fusion import RopeFusionPass

    with torch._guards.compile_context(torch._guards.CompileContext(None)):
        p = RopeFusionPass()
        p(_graph_of(300))
        p(_graph_of(200))
        a = auto_budget.allowance(_graph_of(10))
        assert a.nodes == 510 and not p.report.sites
        RopeFusionPass(measure=False)(_graph_of(400))  # a policy that never measures earns nothing
        assert auto_budget.allowance(_graph_of(0)).nodes == 510
    with torch._guards.compile_context(torch._guards.CompileContext(None)):  # the next compile starts afresh
        assert auto_budget.allowance(_graph_of(7)).nodes == 7
