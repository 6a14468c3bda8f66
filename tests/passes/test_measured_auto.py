"""`auto` that measures (passes/auto/auto_timing.py, passes/auto/auto_decisions.py): timings steer the choice, decisions
are cached on disk and read back without timing, any failure falls back to the table, and Inductor's FX graph cache
serves a measuring compile's graph to the next start.

Measuring is CUDA-only; these tests add "cpu" to `_MEASURE_DEVICE_TYPES`, so the region extraction, the
candidates' standalone Inductor compiles and their runs are real, on the CPU. Only the clock is steered: `TIMER`
runs each compiled candidate and returns the time the test gives it. On the CPU the candidates are the op's
lowering ("inductor") and the site left to Inductor ("left"); the Triton kernel needs a GPU.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import rope_fusion
from rope_fusion.cli import main as cli_main
from rope_fusion.ops import cost_model
from rope_fusion.passes.auto import auto_decisions, auto_region, auto_timing
from tests.helpers.compile_pass import compile_with_pass, static_lanes
from tests.helpers.numerics import check_numerics


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rope_qk(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _args(tokens=16, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, tokens, heads, dim, generator=g), torch.randn(1, tokens, heads, dim, generator=g),
            torch.randn(tokens, 1, dim, generator=g), torch.randn(tokens, 1, dim, generator=g))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """One Inductor cache dir for the module (compiled C++ kernels are reused between tests); each test starts
    with no rope_fusion decisions in it."""
    root = tmp_path_factory.mktemp("inductor_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
        yield root


class Clock:
    """The timer the measuring code calls: runs the compiled candidate, records its name, returns the time set
    for it (seconds), or raises what `fail` holds."""

    def __init__(self) -> None:
        self.times: dict = {}
        self.calls: list = []
        self.outputs: dict = {}
        self.fail: Exception | None = None

    def __call__(self, name, run):
        self.outputs[name] = run()
        self.calls.append(name)
        if self.fail is not None:
            raise self.fail
        return self.times[name]


@pytest.fixture
def clock(cache_root, monkeypatch):
    import shutil

    shutil.rmtree(auto_decisions.cache_dir(), ignore_errors=True)
    monkeypatch.setattr(auto_timing, "_MEASURE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    c = Clock()
    monkeypatch.setattr(auto_timing, "TIMER", c)
    return c


def _decisions() -> dict:
    with open(auto_decisions.decisions_path()) as f:
        return json.load(f)["decisions"]


def test_a_fast_fused_candidate_is_taken_and_a_slow_one_leaves_the_site(clock):
    args = _args()
    clock.times = {"left": 10e-6, "inductor": 5e-6}
    out, p = compile_with_pass(rope_qk, *args)
    assert sorted(clock.calls) == ["inductor", "left"]
    assert [k.backend for k in p.report.kernels] == ["inductor"] and len(p.report.sites) == 2, p.report.table()
    assert p.report.kernels[0].choice.startswith("measured inductor 5.0 us, left 10.0 us"), p.report.table()
    check_numerics(rope_qk, args, out)
    # the candidates timed compute the site: the op's lowering as the region left to Inductor does
    for fused, left in zip(clock.outputs["inductor"], clock.outputs["left"]):
        torch.testing.assert_close(fused, left, rtol=1e-5, atol=1e-5)

    os.unlink(auto_decisions.decisions_path())
    clock.calls.clear()
    clock.times = {"left": 10e-6, "inductor": 12e-6}
    out, p = compile_with_pass(rope_qk, *args)
    assert sorted(clock.calls) == ["inductor", "left"]
    assert not p.report.kernels and len(p.report.misses) == 2, p.report.table()
    assert all(m.reason.startswith("left to Inductor: measured left 10.0 us, inductor 12.0 us")
               for m in p.report.misses), p.report.table()
    check_numerics(rope_qk, args, out)


def test_the_margin_a_fused_choice_must_win_by():
    assert auto_timing.pick({"left": 10.0, "inductor": 9.9}) == "left"  # 1% faster: not enough
    assert auto_timing.pick({"left": 10.0, "inductor": 9.7, "triton": 9.75}) == "inductor"
    assert auto_timing.pick({"left": 10.0, "inductor": 9.9, "triton": 9.5}) == "triton"


def test_the_second_compile_reads_the_decision_and_times_nothing(clock):
    args = _args(seed=1)
    clock.times = {"left": 10e-6, "inductor": 5e-6}
    before = dict(auto_timing.STATS)
    compile_with_pass(rope_qk, *args)
    assert auto_timing.STATS["timed"] == before.get("timed", 0) + 1 and len(clock.calls) == 2
    (key,) = _decisions()
    assert key.startswith("cpu | torch ") and "triton" in key and "rope_fusion" in key

    clock.calls.clear()
    clock.fail = AssertionError("a warm compile must not time anything")
    out, p = compile_with_pass(rope_qk, *args)
    assert clock.calls == [] and auto_timing.STATS["timed"] == before.get("timed", 0) + 1
    assert auto_timing.STATS["cached"] == before.get("cached", 0) + 1
    assert p.report.kernels[0].choice.startswith("cached inductor 5.0 us"), p.report.table()
    check_numerics(rope_qk, args, out)


@pytest.mark.parametrize("how", ["the timer raises", "measure=False", "ROPE_FUSION_MEASURE=0"])
def test_no_measurement_falls_back_and_says_why(clock, monkeypatch, how):
    args = _args(seed=2)
    clock.times = {"left": 10e-6, "inductor": 12e-6}  # measured, this would leave the site
    options = {}
    if how == "the timer raises":
        clock.fail = RuntimeError("no clock")
        expected = "timing failed: RuntimeError: no clock"
    elif how == "measure=False":
        options = {"measure": False}
        expected = "measuring off (RopeFusionPass(measure=False))"
    else:
        monkeypatch.setenv(auto_timing.ENV, "0")
        expected = "measuring off (ROPE_FUSION_MEASURE=0)"
    out, p = compile_with_pass(rope_qk, *args, **options)
    assert not p.report.errors and [k.backend for k in p.report.kernels] == ["inductor"], p.report.table()
    assert p.report.kernels[0].choice == f"fixed order, not measured: {expected}", p.report.table()
    assert not os.path.exists(auto_decisions.decisions_path())
    check_numerics(rope_qk, args, out)


def test_symbolic_sizes_are_not_measured(clock):
    args = _args(tokens=24, seed=3)
    clock.times = {"left": 10e-6, "inductor": 12e-6}
    out, p = compile_with_pass(rope_qk, *static_lanes(args), dynamic=True)
    assert clock.calls == [] and [k.backend for k in p.report.kernels] == ["inductor"], p.report.table()
    assert "symbolic size" in p.report.kernels[0].choice, p.report.table()
    check_numerics(rope_qk, args, out)


def _compile_cached(fn, args, p):
    """torch.compile with the FX graph cache on (AOTAutograd's off, so the FX graph cache decides)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        return torch.compile(fn, fullgraph=True, options={"post_grad_custom_post_pass": p})(*args)


def _fx_counts() -> tuple:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def test_a_measuring_compile_is_served_to_the_next_start(clock):
    """The decision a measuring compile writes leaves the FX graph cache key as it was: the next start (a fresh
    pass, the file now holding the decision) is served the graph, as plain compile's second start is, where a key
    that covered the file compiled it all again."""
    args = _args(tokens=20, heads=3, seed=4)
    clock.times = {"left": 10e-6, "inductor": 5e-6}
    p1 = rope_fusion.RopeFusionPass()
    key1 = p1.uuid()
    hits, misses = _fx_counts()
    out = _compile_cached(rope_qk, args, p1)
    assert _fx_counts() == (hits, misses + 1) and sorted(clock.calls) == ["inductor", "left"]
    assert [k.backend for k in p1.report.kernels] == ["inductor"], p1.report.table()
    assert len(_decisions()) == 1
    check_numerics(rope_qk, args, out)

    clock.fail = AssertionError("the graph is served: nothing is timed")
    p2 = rope_fusion.RopeFusionPass()
    assert p2.uuid() == key1
    out = _compile_cached(rope_qk, args, p2)
    assert _fx_counts() == (hits + 1, misses + 1)
    # the records stored with the graph: the choice as the first start measured it
    assert p2.report.cached.graphs == 1 and [r.from_cache for r in p2.report.graph_records] == [True]
    assert [k.choice[:38] for k in p2.report.kernels] == ["measured inductor 5.0 us, left 10.0 us"], \
        p2.report.table()
    check_numerics(rope_qk, args, out)

    # the graph cache off (another graph with the same sites): the pass runs, reads the decision, times nothing
    out, p3 = compile_with_pass(rope_qk, *args)
    assert [k.backend for k in p3.report.kernels] == ["inductor"], p3.report.table()
    assert p3.report.kernels[0].choice.startswith("cached inductor 5.0 us, left 10.0 us"), p3.report.table()
    check_numerics(rope_qk, args, out)

    # a pass that does not measure reads no decisions: its own key, its own graph, by the fixed order
    p4 = rope_fusion.RopeFusionPass(measure=False)
    assert p4.uuid() != key1
    out = _compile_cached(rope_qk, args, p4)
    assert _fx_counts() == (hits + 1, misses + 2)
    assert p4.report.kernels[0].choice.startswith("fixed order, not measured"), p4.report.table()
    check_numerics(rope_qk, args, out)


def test_uuid_covers_the_measure_setting_and_what_auto_could_read(cache_root, monkeypatch):
    import shutil

    shutil.rmtree(auto_decisions.cache_dir(), ignore_errors=True)
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    p = rope_fusion.RopeFusionPass()
    base = p.uuid()
    assert rope_fusion.RopeFusionPass(measure=False).uuid() != base
    monkeypatch.setenv(auto_timing.ENV, "0")
    assert p.uuid() != base
    monkeypatch.delenv(auto_timing.ENV)
    assert p.uuid() == base
    auto_decisions.DECISIONS.put("some device | versions | signature", auto_decisions.Decision("left", {}, 0.02))
    assert p.uuid() == base  # a written decision is the graph's own (test_a_measuring_compile_is_served_...)
    fixed = rope_fusion.RopeFusionPass(backend="inductor")
    assert fixed.uuid() == rope_fusion.RopeFusionPass(backend="inductor").uuid()
    assert "measure=False" in repr(rope_fusion.RopeFusionPass(measure=False))
    assert pickle.loads(pickle.dumps(rope_fusion.RopeFusionPass(measure=False))).measure is False
    with pytest.raises(TypeError):
        rope_fusion.RopeFusionPass(measure="yes")


def test_a_damaged_decisions_file_costs_a_measurement_not_a_compile(clock):
    os.makedirs(auto_decisions.cache_dir(), exist_ok=True)
    with open(auto_decisions.decisions_path(), "w") as f:
        f.write("{not json")
    args = _args(tokens=12, seed=5)
    clock.times = {"left": 10e-6, "inductor": 5e-6}
    out, p = compile_with_pass(rope_qk, *args)
    assert [k.backend for k in p.report.kernels] == ["inductor"] and len(clock.calls) == 2, p.report.table()
    assert len(_decisions()) == 1
    check_numerics(rope_qk, args, out)


# -- the table fallback with a calibrated table (fake CUDA tensors: no GPU needed, nothing is measured) --------

def _fake_cuda_site():
    bf16, f32 = torch.bfloat16, torch.float32
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=d) for s, d in
                (((1, 32, 8192, 128), bf16), ((1, 8, 8192, 128), bf16), ((1, 1, 8192, 128), f32),
                 ((1, 1, 8192, 128), f32))]


def _fused_on_fake_cuda():
    from torch._inductor.decomposition import select_decomp_table

    gm = make_fx(rope_qk, decomposition_table=select_decomp_table(), tracing_mode="fake")(*_fake_cuda_site())
    p = rope_fusion.RopeFusionPass()
    p(gm.graph)
    assert not p.report.errors, p.report.table()
    return p


def test_a_calibrated_factor_table_replaces_the_h200_one(cache_root, monkeypatch):
    import shutil

    shutil.rmtree(auto_decisions.cache_dir(), ignore_errors=True)
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    p = _fused_on_fake_cuda()
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()
    assert "table, not measured: no cuda device here to time on" in p.report.kernels[0].choice or \
        torch.cuda.is_available()

    slow = cost_model.Factors.from_json({"triton": {"none": 3.0}, "lowering": {"none/neox": 3.0}}, "test")
    assert slow.triton["rms"] == cost_model.H200.triton["rms"]  # entries not measured stay the H200's
    path = auto_decisions.write_factors("cuda", slow, measured={})
    assert os.path.dirname(path) == auto_decisions.cache_dir()
    p = _fused_on_fake_cuda()
    assert not p.report.kernels and all("calibrated on" in m.reason for m in p.report.misses), p.report.table()

    with open(path, "w") as f:
        json.dump({"factors": {"triton": {"no such form": 1.0}}}, f)
    p = _fused_on_fake_cuda()  # a table this version cannot read: the H200's decides, with a warning
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()


def test_calibrate_without_a_gpu_exits_non_zero(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cli_main(["calibrate"]) != 0
    assert "no GPU" in capsys.readouterr().err


# -- what is timed as "left" ----------------------------------------------------------------------------------

def test_the_left_region_holds_what_inductor_fuses_into_the_rotation_and_starts_at_matmuls():
    """From the rotation back to what is in memory anyway: the QK-norm and the table math are in the region (they
    fuse into plain compile's rotation), the projection's matmul and the graph's inputs are where it starts."""
    from torch._inductor.decomposition import select_decomp_table

    def block(h, w_proj, norm_w, positions, freqs):
        q = (h @ w_proj).unflatten(-1, (2, 32)).float()
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
        angles = (positions[:, None] * freqs).repeat(1, 2)[:, None, :]
        return (q * angles.cos() + rotate_half(q) * angles.sin()).to(h.dtype)

    args = (torch.randn(8, 64), torch.randn(64, 64), torch.rand(32), torch.arange(8.0), torch.rand(16))
    gm = make_fx(block, decomposition_table=select_decomp_table())(*args)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    body, inputs = auto_region.region([out])
    targets = {str(n.target) for n in body}
    assert {"aten.rsqrt.default", "aten.cos.default", "aten.sin.default"} <= targets, targets
    assert not any("mm" in str(n.target) for n in body)
    kinds = sorted(n.op if n.op == "placeholder" else str(n.target) for n in inputs)
    assert kinds == ["aten.mm.default", "placeholder", "placeholder", "placeholder"], kinds  # norm_w, positions, freqs
    assert len(body) <= auto_region.MAX_REGION_NODES


def test_calibrate_writes_a_table_the_fallback_reads(cache_root, monkeypatch):
    """`rope-fusion calibrate`'s rows, run on the CPU with the clock steered (the Triton variant needs a GPU)."""
    import shutil

    from rope_fusion.passes.auto import calibration

    shutil.rmtree(auto_decisions.cache_dir(), ignore_errors=True)
    clock = Clock()
    clock.times = {"floor": 1e-6, "inductor": 2e-6, "left": 3e-6}
    (row,) = [r for r in calibration.ROWS if r.name == "neox D=128"]
    factors, records = calibration.calibrate(device="cpu", tokens=8, dtype=torch.float32, rows=(row,),
                                             variants=("inductor", "left"), timer=clock)
    assert sorted(clock.calls) == ["floor", "inductor", "left"] and not records[0]["skipped"], records
    assert factors.lowering["none", "neox"] == pytest.approx(2.0) and factors.left["neox"] == pytest.approx(3.0)
    assert factors.triton == cost_model.H200.triton  # not measured here: the H200's
    auto_decisions.write_factors("cpu", factors, {r["row"]: r for r in records})
    read = auto_decisions.calibrated_factors("cpu")
    assert read.lowering["none", "neox"] == pytest.approx(2.0) and read.source == "calibrated on cpu"



def test_a_packed_call_is_not_timed():
    """The candidates pass x, the tables, positions and weights; a packed call's rows come from cu_seqlens, so
    timing it would time another computation (flash-attn varlen launches, the one packed form the pass meets,
    are rotary kernels already in the graph and are not timed either)."""
    from rope_fusion.ops.schema import RotaryCall, RotaryParams

    q, cos = torch.randn(12, 2, 32), torch.randn(8, 16)
    call = RotaryCall([q], cos, cos, RotaryParams(interleaved=False, rotary_dim=32, full_tables=False, conjugate=False,
                                                     out_dtype=torch.float32), cu_seqlens=torch.tensor([0, 5, 12]))
    with pytest.raises(auto_region.NotMeasured, match="packed sequences"):
        auto_timing.build(auto_timing.AutoSite((), call), cuda_graphs=False)
