"""`auto` on the GPU chooses by estimated bytes: the Triton kernel, the op's Inductor lowering, or the model's
own code left to Inductor (then a near miss "left to Inductor: ..."). The graphs are traced with fake CUDA
tensors, which needs no GPU: the pass decides from shapes, dtypes and where the tables come from.
"""

from __future__ import annotations

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


def _run(fn, args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    p = rope_fusion.RopeFusionPass()
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


def test_decode_site_takes_the_lowering():
    args = _fake(((1, 32, 16, 128), bf16), ((1, 8, 16, 128), bf16), ((1, 1, 16, 128), f32),
                 ((1, 1, 16, 128), f32))
    p, _ = _run(rope_qk, args)
    assert [k.backend for k in p.report.kernels] == ["inductor"], p.report.table()


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


@pytest.mark.parametrize("cost,expected", [
    (SiteCost(x_bytes=168 << 20, table_bytes=8 << 20, tables_computed=False, table_users=2, style="neox"),
     "triton"),
    (SiteCost(x_bytes=168 << 20, table_bytes=8 << 20, tables_computed=True, table_users=64, style="neox"),
     "triton"),  # Llama: tables computed once per forward, shared by every layer's q and k
    (SiteCost(x_bytes=96 << 20, table_bytes=192 << 20, tables_computed=True, table_users=2, style="neox"),
     "left"),  # Inductor's own NeoX code (1.12x) beats the op's lowering (1.25x) and the kernel + tables
    (SiteCost(x_bytes=96 << 20, table_bytes=192 << 20, tables_computed=True, table_users=2,
              style="interleaved"), "inductor"),
    (SiteCost(x_bytes=96 << 20, table_bytes=192 << 20, tables_computed=True, table_users=2,
              style="complex64"), "inductor"),  # complex spelled code is far slower than either fused form
    (SiteCost(x_bytes=1 << 20, table_bytes=1 << 10, tables_computed=False, table_users=2, style="complex64"),
     "inductor"),
    (SiteCost(x_bytes=None, table_bytes=0, tables_computed=False, table_users=1, style="neox"), "inductor"),
])
def test_estimates_pick_the_cheapest(cost, expected):
    best, why = cheapest(cost)
    assert best == expected, (why, estimates(cost) if cost.x_bytes else None)
