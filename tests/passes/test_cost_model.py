"""`auto` on the GPU chooses by estimated bytes: the Triton kernel, the op's Inductor lowering, or the model's
own code left to Inductor (then a near miss "left to Inductor: ..."). The graphs are traced with fake CUDA
tensors, which needs no GPU: the pass decides from shapes, dtypes and where the tables come from.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import rope_fusion
from rope_fusion.ops.cost_model import SiteCost, cheapest, estimates


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rope_qk(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_qk_tables_from_angles(q, k, angles):
    """Per-head tables as large as q, computed in the graph (LTX-style): the Triton kernel would read them
    from memory after another kernel wrote them; Inductor computes them inside the rotation."""
    return rope_qk(q, k, angles.cos(), angles.sin())


def _fake(*shapes_dtypes):
    with FakeTensorMode():
        return [torch.empty(*s, device="cuda", dtype=d) for s, d in shapes_dtypes]


def _run(fn, args, **options):
    from torch._inductor.decomposition import select_decomp_table

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    p = rope_fusion.RopeFusionPass(**options)
    p(gm.graph)
    assert not p.report.errors, p.report.table()
    return p, gm.graph


bf16, f32 = torch.bfloat16, torch.float32


def test_large_site_with_input_tables_takes_the_triton_kernel():
    args = _fake(((1, 32, 8192, 128), bf16), ((1, 8, 8192, 128), bf16), ((1, 1, 8192, 128), f32),
                 ((1, 1, 8192, 128), f32))
    p, graph = _run(rope_qk, args)
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()
    assert any("triton_kernel_wrapper_functional" in str(n.target) for n in graph.nodes)


_DECODE = (((1, 32, 16, 128), bf16), ((1, 8, 16, 128), bf16), ((1, 1, 16, 128), f32), ((1, 1, 16, 128), f32))


def _decode_args():
    return _fake(*_DECODE)


def test_decode_site_in_cuda_graphs_takes_one_launch():
    """At decode sizes launches decide. Replayed in CUDA graphs a launch costs the GPU about a microsecond:
    the kernel takes q and k in one, the lowering and the model's code one per tensor. Inductor's own CUDA
    graphs (`mode="reduce-overhead"`) say so as well as the option."""
    p, _ = _run(rope_qk, _decode_args(), cuda_graphs=True)
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        p, _ = _run(rope_qk, _decode_args())
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()


def test_decode_site_without_cuda_graphs_is_left_to_plain_compile():
    """Without CUDA graphs a graph this small waits on the host, and the kernel's one launch (some fifty
    arguments) costs the host more than plain compile's two kernels: the site is left, and the report says
    that launches were costed as host time."""
    for options in ({}, {"cuda_graphs": False}):
        p, graph = _run(rope_qk, _decode_args(), **options)
        assert p.report.kernels == [] and len(p.report.misses) == 2, p.report.table()
        assert all("left to Inductor" in m.reason and "host time (a host-bound graph" in m.reason
                   for m in p.report.misses), p.report.table()
        assert not any("rope_fusion" in str(n.target) for n in graph.nodes)


def rope_qk_in_a_model(q, k, cos, sin, h, w):
    """The same decode-sized site in a graph that also reads a large weight (a layer's projection): the GPU's
    work outlasts the host's launches, so launches are not host time and the one launch wins."""
    qo, ko = rope_qk(q, k, cos, sin)
    return qo, ko, h @ w


def test_decode_site_in_a_gpu_bound_graph_takes_one_launch():
    args = _fake(*_DECODE, ((16, 8192), bf16), ((8192, 28672), bf16))
    p, _ = _run(rope_qk_in_a_model, args)
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()


def test_site_that_would_lose_is_left_to_inductor_and_reported():
    args = _fake(((1, 32, 8192, 128), bf16), ((1, 32, 8192, 128), bf16), ((1, 32, 8192, 128), f32))
    p, graph = _run(rope_qk_tables_from_angles, args)
    assert p.report.sites == [] and p.report.kernels == [], p.report.table()
    assert len(p.report.misses) == 2 and all(m.reason.startswith("left to Inductor: ") for m in p.report.misses)
    assert not any("rope_fusion" in str(n.target) for n in graph.nodes)


def test_an_explicit_backend_is_not_second_guessed():
    args = _fake(((1, 32, 8192, 128), bf16), ((1, 32, 8192, 128), bf16), ((1, 32, 8192, 128), f32))
    gm = make_fx(rope_qk_tables_from_angles, tracing_mode="fake")(*args)
    p = rope_fusion.RopeFusionPass(backend="triton")
    p(gm.graph)
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()


def rope_qk_lanes_strided(qt, kt, cos, sin):
    """q and k stored [T, D, H] and read as [T, H, D]: lanes with stride H, which the kernel's user-kernel node
    takes only by copying x first, and cannot plan so for a symbolic token count."""
    return rope_qk(qt.transpose(1, 2), kt.transpose(1, 2), cos, sin)


def test_a_symbolic_site_the_kernel_node_cannot_take_gets_the_lowering_not_the_opaque_op():
    """Under `auto` a site whose user-kernel node cannot be planned is declined at emission and lowered, with
    the reason in the report: the opaque Triton op would pay the dispatcher on every call (slower than plain
    compile at decode sizes). Asked for by name, the Triton backend still emits that op."""
    import copy

    from torch._dynamo.source import ConstantSource
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    fm = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    tokens = fm.from_tensor(torch.empty(64, 1, device="meta"), symbolic_context=ctx,
                            source=ConstantSource("tokens")).shape[0]
    with fm:
        args = (torch.empty(tokens, 128, 8, device="cuda", dtype=bf16), torch.empty(tokens, 128, 2, device="cuda",
                dtype=bf16), torch.empty(tokens, 1, 128, device="cuda"), torch.empty(tokens, 1, 128, device="cuda"))
    gm = make_fx(rope_qk_lanes_strided, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    ops = {}
    for backend in ("auto", "triton"):
        graph = copy.deepcopy(gm).graph
        p = rope_fusion.RopeFusionPass(backend=backend)
        p(graph)
        assert len(p.report.sites) == 2 and not p.report.errors, p.report.table()
        ops[backend] = ([k.backend for k in p.report.kernels], [str(n.target) for n in graph.nodes
                                                                  if "rope_fusion" in str(n.target)])
        if backend == "auto":
            assert "user-kernel node cannot be planned" in p.report.kernels[0].fallback, p.report.table()
    assert ops["auto"] == (["inductor"], ["rope_fusion.rotary_qk.default"])
    assert ops["triton"] == (["triton"], ["rope_fusion.rotary_qk_triton.default"])


def _cost(x_mib, table_mib=8, computed=False, users=2, style="neox", **kw):
    return SiteCost(x_bytes=x_mib << 20, table_bytes=table_mib << 20, tables_computed=computed, table_users=users,
                    style=style, **kw)


# Each case is a row of the kernel benchmark (BENCHMARKS.md, H200) and the choice that measured fastest there,
# or the model's own code where the fused forms were within the margin of it.
@pytest.mark.parametrize("cost,expected", [
    (_cost(168), "triton"),  # NeoX cat, input tables: kernel 1.05x against 1.11x and its table reads
    (_cost(168, users=64, computed=True), "left"),  # Llama's computed tables: Inductor computes them in place
    (_cost(168, gathered=True), "triton"),  # vLLM forward_native at 8192 tokens: 1.04x against 1.44-1.99x
    (_cost(168, style="interleaved"), "triton"),  # interleaved: 1.05x against 1.46x
    # CLVP's q, k, v (partial NeoX, 32 of 64 lanes: narrow halves): Inductor's one kernel 0.96x, ours 1.02x
    (_cost(100, table_mib=1, padded=True, tensors=3), "left"),
    # Allegro's three NeoX blocks, tables gathered per axis and concatenated: kernel 1.49x against 2.46x
    (_cost(247, table_mib=10, computed=True, users=2, style="neox-blocks"), "triton"),
    (_cost(168, style="interleaved", padded=True), "triton"),  # D=80: 1.07x against 1.46x
    (_cost(96, 192, computed=True), "left"),  # LTX-style per-head tables computed in the graph
    (_cost(96, 192, computed=True, style="interleaved"), "left"),  # lowering 1.45x against 1.47x: margin
    (_cost(96, 192, computed=True, style="complex64"), "inductor"),  # complex code 5.2x
    (_cost(1, 0, style="complex64"), "triton"),  # decode: one launch for q and k
    (_cost(1, 0), "triton"),  # decode, CUDA-graph replay: 0.87-1.05x against 1.22-1.47x
    # QK-norms folded (CUDA-graph replay, in the graph; BENCHMARKS.md, Kernels):
    (_cost(96, norm="rms"), "triton"),  # per-head norm + NeoX, D=128: kernel 1.09x, Inductor 1.39x, lowering 2.07x
    (_cost(40, norm="rms", padded=True), "triton"),  # the same at D=80: kernel 1.09x (held), Inductor 1.90x
    (_cost(168, norm="rms", gathered=True), "triton"),  # vLLM Qwen3, 8192 tokens: kernel 1.08x, lowering 1.19x
    (_cost(96, norm="rms", style="interleaved"), "triton"),  # + Flux, D=128: kernel 1.11x, Inductor 3.36x
    (_cost(40, norm="rms", style="interleaved", padded=True), "triton"),  # D=80: kernel 1.06x, lowering 1.78x
    (_cost(96, norm="rms_across_heads", style="interleaved"), "triton"),  # Wan: 1.16x against 3.95x
    # vLLM's dynamic token count: the kernel with the count in its grid (Llama NeoX: the model's code 1.41-3.08x)
    (SiteCost(x_bytes=None, table_bytes=0, tables_computed=False, table_users=1, style="neox"), "triton"),
    (SiteCost(x_bytes=None, table_bytes=0, tables_computed=False, table_users=1, style="interleaved"),
     "triton"),  # vLLM GPT-J partial, dynamic tokens: the model's code 2.72x
    (SiteCost(x_bytes=None, table_bytes=0, tables_computed=False, table_users=1, style="neox", norm="rms"),
     "triton"),  # vLLM Qwen3 with a dynamic token count: kernel 1.08x, lowering 1.26x, the model's code 1.76x
])
def test_estimates_pick_the_cheapest(cost, expected):
    best, why = cheapest(cost)
    assert best == expected, (why, estimates(cost) if cost.x_bytes else None)


# In a host-bound graph (no CUDA graphs, few bytes) each choice costs the longer of its GPU time and its
# launches' host time (the kernel's node 0-5 us more than plain compile's two kernels at 1-256 tokens:
# benchmarks/host.py; BENCHMARKS.md, vLLM).
@pytest.mark.parametrize("cost,expected", [
    (_cost(1, 0, gathered=True), "left"),  # vLLM Llama decode, static: host-bound, plain compile's kernels
    (_cost(5, 0, gathered=True), "left"),  # 256 tokens: still host-bound
    (_cost(20, 2, gathered=True), "left"),  # 1024 tokens: the lowering measured 1.26-1.29x plain's GPU time
    (_cost(160, 2, gathered=True), "triton"),  # 8192 tokens: the GPU's time decides, as in CUDA graphs
    (_cost(168), "triton"),  # a large NeoX site with input tables
    (_cost(160, 2, norm="rms", gathered=True), "triton"),  # Qwen3 prefill with its norm folded
    (_cost(1, 0, norm="rms", tensors=1), "left"),  # one small tensor: the node's launch is two of Inductor's
    (SiteCost(x_bytes=None, table_bytes=0, tables_computed=False, table_users=1, style="neox"), "triton"),
])
def test_in_a_host_bound_graph_launches_cost_host_time(cost, expected):
    cost = dataclasses.replace(cost, host_bound=True)
    best, why = cheapest(cost)
    assert best == expected, (why, estimates(cost) if cost.x_bytes else None)
    if cost.x_bytes is not None:
        assert why.endswith("launches costed as host time (a host-bound graph, no CUDA graphs)"), why


def _rms(x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


def projected_normed_rope(h, wq, wk, nq, nk, cos, sin):
    """Wan's shape: q and k from matmuls, an RMSNorm over every head (folded), an interleaved rotation."""
    def rot(x):
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return x * cos + torch.stack((-x2, x1), -1).flatten(-2) * sin
    q = _rms(h @ wq, nq).view(1, 8192, 32, 128)
    k = _rms(h @ wk, nk).view(1, 8192, 8, 128)
    return rot(q), rot(k)


def scaled_rope(h, wq, wk, cos, sin):
    """q and k computed elementwise right before the rotation (a scale that cannot be folded)."""
    q = ((h @ wq).view(1, 8192, 32, 128) * 0.5 + 1).transpose(1, 2)
    k = ((h @ wk).view(1, 8192, 8, 128) * 0.5 + 1).transpose(1, 2)
    return rope_qk(q, k, cos, sin)


def scaled_rope_interleaved(h, wq, wk, cos, sin):
    def rot(x):
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return x * cos + torch.stack((-x2, x1), -1).flatten(-2) * sin
    q = ((h @ wq).view(1, 8192, 32, 128) * 0.5 + 1).transpose(1, 2)
    k = ((h @ wk).view(1, 8192, 8, 128) * 0.5 + 1).transpose(1, 2)
    return rot(q), rot(k)


def _proj_args(norm: bool):
    shapes = [((8192, 4096), bf16), ((4096, 4096), bf16), ((4096, 1024), bf16)]
    if norm:
        shapes += [((4096,), bf16), ((1024,), bf16)]
    table = (8192, 1, 128) if norm else (1, 1, 8192, 128)  # [S, 1, D] against [B, S, H, D], or [B, H, S, D]
    return _fake(*shapes, (table, f32), (table, f32))


def test_folded_norm_over_matmul_outputs_takes_the_triton_kernel():
    p, graph = _run(projected_normed_rope, _proj_args(norm=True))
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()
    assert [s.norm for s in p.report.sites] == ["rms_across_heads folded"] * 2, p.report.table()
    assert not any(n.target is torch.ops.aten.rsqrt.default for n in graph.nodes)


def test_x_computed_elementwise_is_not_read_from_an_opaque_kernel():
    """Inductor fuses the scale into the rotation; the Triton kernel would have it written and read back, so
    the kernel loses, and the lowering is not enough faster than the model's own code: both are left."""
    for fn in (scaled_rope, scaled_rope_interleaved):
        p, _ = _run(fn, _proj_args(norm=False))
        assert p.report.kernels == [] and len(p.report.misses) == 2, p.report.table()
        assert all(m.reason.startswith("left to Inductor: ") and "triton" in m.reason for m in p.report.misses)


@pytest.mark.parametrize("upstream,expected", [(0, "triton"), (168 << 20, "left")])
def test_upstream_elementwise_bytes_count_against_the_kernel(upstream, expected):
    cost = SiteCost(x_bytes=168 << 20, table_bytes=8 << 20, tables_computed=False, table_users=2, style="neox",
                    x_fused_upstream_bytes=upstream)
    assert cheapest(cost)[0] == expected, estimates(cost)


def test_a_failing_host_bound_estimate_never_breaks_the_pass(monkeypatch):
    """Whether a graph is host-bound only feeds the estimates: if working it out fails, the GPU's costs stand
    and the site is fused as without the rule."""
    from rope_fusion.passes import rope_pass

    def broken(graph):
        raise RuntimeError("no sizes here")
    monkeypatch.setattr(rope_pass, "graph_host_bound", broken)
    p, _ = _run(rope_qk, _decode_args())
    assert [k.backend for k in p.report.kernels] == ["triton"] and not p.report.errors, p.report.table()
