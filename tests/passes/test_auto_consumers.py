"""`auto` times a site with the consumers plain compile fuses after it (passes/auto/auto_consumers.py): the views and
layout changes up to attention, and attention's own input layout (Inductor's constraint for the attention kernel,
applied by `rope_fusion::attention_layout`), so that a copy the fused op's result would need in the model is in
every candidate's time. Real region extraction, real Inductor compiles and runs on the CPU; the clock is steered.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from rope_fusion.ops import backends
from rope_fusion.ops.op_definition import OPS
from rope_fusion.ops.reference import rotary_reference
from rope_fusion.passes.auto import auto_consumers, auto_timing
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

aten = torch.ops.aten
LAYOUT = torch.ops.rope_fusion.attention_layout.default


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def attention_block(h, wq, wk, wv, cos, sin):
    b, s, _ = h.shape
    q, k, v = ((h @ w).view(b, s, 2, 32) for w in (wq, wk, wv))
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return o.transpose(1, 2).flatten(-2)


def _args(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 16, 64, generator=g), *(torch.randn(64, 64, generator=g) / 8 for _ in range(3)),
            torch.randn(16, 1, 32, generator=g), torch.randn(16, 1, 32, generator=g))


class Recorder:
    """The clock: runs each candidate, keeps what `build` made of the site, returns the time set for it."""

    def __init__(self, times):
        self.times, self.calls, self.built = times, [], []

    def __call__(self, name, run):
        run()
        self.calls.append(name)
        return self.times[name]


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    monkeypatch.setattr(auto_timing, "_MEASURE_DEVICE_TYPES", ("cuda", "cpu"))
    rec = Recorder({"left": 10e-6, "inductor": 5e-6, "triton": 7e-6})
    monkeypatch.setattr(auto_timing, "TIMER", rec)
    real_build = auto_timing.build

    def build(site, cuda_graphs):
        b = real_build(site, cuda_graphs)
        rec.built.append((site, b))
        return b
    monkeypatch.setattr(auto_timing, "build", build)
    return rec


def _targets(g: fx.Graph) -> list:
    return [n.target for n in g.nodes if n.op == "call_function"]


def _layout_args(g: fx.Graph, args: list) -> list:
    """Run g eagerly; what each attention_layout node receives (q, k, v as the attention would read them)."""
    seen = []

    class Run(fx.Interpreter):
        def call_function(self, target, a, kw):
            if target is LAYOUT:
                seen.append(a)
            return super().call_function(target, a, kw)
    Run(fx.GraphModule({}, g)).run(*args)
    return seen


def test_the_timed_region_holds_the_consumers_up_to_attention_and_its_layout(recorder):
    args = _args()
    out, p = compile_with_pass(attention_block, *args, measure=True)
    assert sorted(recorder.calls) == ["inductor", "left"], p.report.table()
    assert p.report.kernels[0].choice.startswith("measured inductor 5.0 us, left 10.0 us"), p.report.table()
    check_numerics(attention_block, args, out)
    ((site, built),) = recorder.built
    targets = _targets(built.left)
    # the layout changes after the rotations, then attention's input layout, are in what "left" times ...
    assert targets.count(aten.permute.default) == 3 and targets[-1] is LAYOUT, targets
    assert not any(t in auto_consumers.ATTENTION for t in targets)  # ... but not the attention itself
    down = built.down
    assert [n.target for n in down.cons.fused] == [aten.permute.default] * 2 and len(down.cons.attention) == 1
    # the lowering's candidate runs the same consumers after the op, in one graph
    fused = auto_timing._with_op(built, site, OPS)
    assert _targets(fused)[-1] is LAYOUT and _targets(fused).count(aten.permute.default) == 3

    # and both lay out the same q, k and v for the attention (the graphs run eagerly on one set of inputs)
    real = auto_timing._inputs(built, site)
    left_qkv = _layout_args(built.left, [real[n] for n in built.left_inputs])
    fused_qkv = _layout_args(fused, [real[n] for n in (*built.upstream_inputs, *down.inputs)])
    assert len(left_qkv) == len(fused_qkv) == 1
    for got, want in zip(fused_qkv[0], left_qkv[0]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_kernel_candidate_feeds_the_consumers_compiled_after_it(recorder, monkeypatch):
    """The kernel's node is opaque to Inductor: its result goes through the consumers compiled on their own, as
    in the model (on the CPU the op's eager path runs where the GPU launches the kernel)."""
    import rope_fusion.kernels.triton_launch as launching
    import rope_fusion.kernels.triton_rotary  # noqa: F401  (registers the backend)

    monkeypatch.setattr(launching, "INTERPRETED", True)  # the backend takes CPU sites (its kernel interpreted)
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ["triton", "inductor"])
    args = _args(seed=1)
    recorder.times["triton"] = 20e-6  # slower than left: nothing emits the kernel on the CPU
    out, p = compile_with_pass(attention_block, *args, measure=True)
    assert sorted(recorder.calls) == ["inductor", "left", "triton"], p.report.table()
    check_numerics(attention_block, args, out)
    ((site, built),) = recorder.built
    real = auto_timing._inputs(built, site)
    # the consumer graph after the kernel, on the rotations the op computes, lays out what "left" lays out
    upstream_out = fx.GraphModule({}, built.upstream)(*(real[n] for n in built.upstream_inputs))
    call = [upstream_out[i] if i is not None else None for i in built.call_slots]
    rotated = [rotary_reference(x, call[2], call[3], **site.call.params.kwargs()) for x in call[:2]]
    down_qkv = _layout_args(built.down.graph, [*built.down.shaped(rotated), *(real[n] for n in built.down.inputs)])
    left_qkv = _layout_args(built.left, [real[n] for n in built.left_inputs])
    for got, want in zip(down_qkv[0], left_qkv[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_site_read_by_nothing_fused_is_timed_as_before():
    """Outputs returned as they are (no consumer plain compile fuses): no downstream, the region ends at them."""
    def f(q, k, cos, sin):
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f, decomposition_table=select_decomp_table())(*(torch.randn(1, 4, 2, 8) for _ in range(2)),
                                                              torch.randn(4, 1, 8), torch.randn(4, 1, 8))
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    cons = auto_consumers.consumers(list(outs))
    assert cons.trivial and cons.ends == list(outs)


def test_a_cat_after_the_rotation_is_a_consumer_unless_the_kernel_writes_into_it():
    def f(q, t, cos, sin):
        r = q * cos + rotate_half(q) * sin
        return torch.cat([t, r], 1).transpose(1, 2) * 2

    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f, decomposition_table=select_decomp_table())(torch.randn(1, 4, 2, 8), torch.randn(1, 3, 2, 8),
                                                              torch.randn(4, 1, 8), torch.randn(4, 1, 8))
    rot = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    through = auto_consumers.consumers([rot])
    assert [n.target for n in through.fused] == [aten.cat.default, aten.permute.default, aten.mul.Tensor]
    assert through.ends == [through.fused[-1]]
    stopped = auto_consumers.consumers([rot], through_cat=False)
    assert stopped.trivial and stopped.ends == [rot]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["launches", "graphs"])
def test_cuda_measures_with_attention_layout(tmp_path, monkeypatch, cuda_graphs):
    """On the GPU, with the real clock: every candidate (the kernel's too) runs through the consumers and the
    attention's layout constraint, the site is measured (not a fallback), and the compiled block keeps the numbers
    contract against fp64 (bf16 attention amplifies rounding: eager and the fused block differ by up to 0.15)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    import rope_fusion

    args = [a.cuda().to(torch.bfloat16) for a in _args(seed=2)]
    args[0] = torch.randn(1, 4096, 64, device="cuda", dtype=torch.bfloat16)
    args[4:] = [torch.randn(4096, 1, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    p = rope_fusion.RopeFusionPass(measure=True, cuda_graphs=cuda_graphs)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        out = torch.compile(attention_block, options={"post_grad_custom_post_pass": p})(*args)
    r = p.report
    choices = [k.choice for k in r.kernels] + [m.reason for m in r.misses if m.reason.startswith("left to Inductor")]
    assert choices and all("measured" in c and "not measured" not in c for c in choices), r.table()
    with torch.no_grad():  # bf16 attention: eager differs from the fused block by rounding, judged against fp64
        check_numerics(attention_block, args, out, context=r.table())
