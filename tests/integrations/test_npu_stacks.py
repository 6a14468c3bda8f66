"""`rope_fusion.fx_pass` as npugraph_ex and TorchAir call it, on NPU graphs, with stand-in torch_npu ops.

npugraph_ex and TorchAir run a custom FX pass as `pass_fn(gm, example_inputs, config)` on each ATen graph that
AOTAutograd produced (npugraph_ex/npu_fx_compiler.py `_optimize_fx`, through its GraphTransformObserver), the
option `post_grad_custom_pre_pass` before their own passes. `npugraph_ex_like` (tests/helpers/npu_graph_stacks.py)
is that call around AOTAutograd with Inductor's decompositions. torch_npu needs the CANN runtime, so its ops are
stand-ins there, in a test namespace, with the real schemas and the documented semantics and constraints; each
asserts the constraints and logs its call when it runs (not when the graph's fake values are propagated). The
graphs are CPU graphs that the pass treats as NPU graphs (`NPU_DEVICE_TYPES`), so this checks what the pass writes
into the graph and that it computes the rotation, not torch_npu's kernels or any Ascend hardware.

Checked: under TorchAir's graph mode q and k in BSND and TND (vLLM's token layout) become one
`npu_apply_rotary_pos_emb`, TND passed as BSND (GE has no TND converter); in graphs that run node by node, where
AOTAutograd's aliasing check would reject that op, one `npu_rotary_mul` per tensor; BNSD (Flux, Wan), interleaved
pairs and partial rotary become `npu_rotary_mul` per tensor in 'half' / 'interleave' with full-width tables; a
backward graph's conjugate rotation too; a site the ops cannot take keeps the rope_fusion op with the reason, and
under GE is left unfused with the reason. Results meet the numerics contract.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rope_fusion
from rope_fusion.integrations import fx_pass as fx_pass_module
from rope_fusion.kernels import npu as bridge
from tests.helpers.npu_graph_stacks import (
    APPLY,
    CALLS,
    NS,
    ROPE_OPS,
    ROTARY_MUL,
    graph_targets,
    run_stack,
    stack_config,
)
from tests.helpers.numerics import check_numerics


@pytest.fixture(autouse=True)
def npu_graphs(monkeypatch):
    monkeypatch.setattr(bridge, "OP_NAMESPACE", NS)
    monkeypatch.setattr(fx_pass_module, "NPU_DEVICE_TYPES", ("npu", "cpu"))
    CALLS.clear()
    yield


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def _neox_qk(q, k, cos, sin):  # Hugging Face form: full-width tables
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _neox_half_tables(q, k, cos, sin):  # vLLM form: per-pair tables, [T, N, D]
    def one(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    return one(q), one(k)


def _interleaved_qk(q, k, cos, sin):  # GPT-J form: per-pair tables
    def one(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return one(q), one(k)


def _partial_qk(q, k, cos, sin):  # GPT-NeoX form: rotary_dim < head dim
    r = cos.shape[-1]
    def one(x):
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * cos + _rotate_half(xr) * sin, xp), -1)
    return one(q), one(k)


def _tables(shape, dtype=torch.float32, full=True):
    ang = torch.rand(*shape[:-1], shape[-1] // 2 if full else shape[-1], dtype=torch.float64) * 6
    if full:
        ang = torch.cat((ang, ang), -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bsnd_pair_is_one_apply_rotary_pos_emb_under_ge(dtype):
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 4, 64).to(dtype), torch.randn(2, 8, 2, 64).to(dtype)  # BSND, GQA
    cos, sin = _tables((8, 1, 64), dtype)
    out, config, r = run_stack(_neox_qk, (q, k, cos, sin), "max-autotune")
    assert not r.errors and [(kk.op, kk.backend, kk.fallback) for kk in r.kernels] == \
        [("rope_fusion.rotary_qk", "npu", "")], r.table()
    g = graph_targets(config)
    assert g.count(APPLY) == 1 and ROTARY_MUL not in g and not any(t in g for t in ROPE_OPS), g
    assert CALLS == [("apply", (2, 8, 4, 64), (2, 8, 2, 64), "BSND")]
    check_numerics(_neox_qk, (q, k, cos, sin), out)


def test_a_graph_run_node_by_node_never_gets_the_aliasing_op():
    """npu_apply_rotary_pos_emb returns its inputs under a schema that declares no alias. AOTAutograd checks the
    first call of every custom op for that, an error under CI (here `error_on_custom_op_aliasing` is set, as CI
    sets it): npugraph_ex's graph gets one npu_rotary_mul per tensor, and the first call passes the check."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 4, 64), torch.randn(2, 8, 2, 64)
    cos, sin = _tables((8, 1, 64))
    with torch._functorch.config.patch(error_on_custom_op_aliasing=True):
        out, config, r = run_stack(_neox_qk, (q, k, cos, sin))
    assert [kk.backend for kk in r.kernels] == ["npu"], r.table()
    g = graph_targets(config)
    assert g.count(ROTARY_MUL) == 2 and APPLY not in g, g
    assert CALLS == [("rotary_mul", (2, 8, 4, 64), (1, 8, 1, 64), "half"),
                     ("rotary_mul", (2, 8, 2, 64), (1, 8, 1, 64), "half")], CALLS
    check_numerics(_neox_qk, (q, k, cos, sin), out)


@pytest.mark.parametrize("mode,expected", [
    ("npugraph_ex", [("rotary_mul", (1, 6, 4, 128), (1, 6, 1, 128), "half"),
                     ("rotary_mul", (1, 6, 1, 128), (1, 6, 1, 128), "half")]),
    ("max-autotune", [("apply", (1, 6, 4, 128), (1, 6, 1, 128), "BSND")])])
def test_token_layout_pair(mode, expected):
    """vLLM's [T, N, D] q and k with per-pair tables: npu_rotary_mul on the BSND view [1, T, N, D] with tables
    duplicated to full width; under TorchAir's graph mode one npu_apply_rotary_pos_emb, whose converter has no
    TND, as BSND on a [1, T, N, D] view of the same memory."""
    torch.manual_seed(0)
    q, k = torch.randn(6, 4, 128), torch.randn(6, 1, 128)
    cos, sin = _tables((6, 1, 64), full=False)
    out, config, r = run_stack(_neox_half_tables, (q, k, cos, sin), mode)
    assert [kk.backend for kk in r.kernels] == ["npu"], r.table()
    assert CALLS == expected, CALLS
    check_numerics(_neox_half_tables, (q, k, cos, sin), out)


@pytest.mark.parametrize("fn,x_shape,t_shape,full,mode,table4", [
    (_neox_qk, (1, 4, 8, 64), (1, 1, 8, 64), True, "half", (1, 1, 8, 64)),  # BNSD (Flux, Wan): 11SD
    (_interleaved_qk, (2, 8, 4, 32), (8, 1, 16), False, "interleave", (1, 8, 1, 32)),  # BSND: 1S1D
    (_partial_qk, (2, 8, 4, 80), (8, 1, 32), True, "half", (1, 8, 1, 32)),  # R=32 of D=80
])
def test_rotary_mul_per_tensor(fn, x_shape, t_shape, full, mode, table4):
    torch.manual_seed(0)
    q, k = torch.randn(x_shape), torch.randn(x_shape)
    cos, sin = _tables(t_shape, full=full)
    out, config, r = run_stack(fn, (q, k, cos, sin))
    assert not r.errors and [kk.backend for kk in r.kernels] == ["npu"], r.table()
    g = graph_targets(config)
    assert g.count(ROTARY_MUL) == 2 and APPLY not in g and not any(t in g for t in ROPE_OPS), g
    rotated = (*x_shape[:-1], table4[-1])
    assert CALLS == [("rotary_mul", rotated, table4, mode)] * 2, CALLS
    check_numerics(fn, (q, k, cos, sin), out)


def test_backward_graph_rotates_back_with_rotary_mul():
    """A training step: the forward's rotation and the backward's conjugate rotation (sin negated in the graph)
    both become npu_rotary_mul."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, 4, 8, 64, requires_grad=True) for _ in range(2))
    cos, sin = _tables((1, 1, 8, 64))
    (oq, ok), config, r = run_stack(_neox_qk, (q, k, cos, sin))
    ((oq * 3).sum() + ok.pow(2).sum()).backward()
    # the custom-pass call does not say whether a graph is a training forward; a backward has tangents
    assert [s.graph_kind for s in r.sites] == ["forward or inference"] * 2 + ["backward"] * 2, r.table()
    assert all(kk.backend == "npu" for kk in r.kernels), r.table()
    assert all(g.count(ROTARY_MUL) == 2 for g in config.graphs) and len(config.graphs) == 2
    eq, ek = _neox_qk(q.detach(), k.detach(), cos, sin)
    torch.testing.assert_close(q.grad, _neox_qk(torch.full_like(eq, 3.0), ek, cos, -sin)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad, 2 * k.detach(), rtol=1e-5, atol=1e-5)


def _five_dims(q, k, cos, sin):  # [B, S, G, N, D]: more dims than the NPU ops take
    return _neox_qk(q, k, cos, sin)


def test_a_site_the_npu_ops_cannot_take_keeps_the_rope_fusion_op():
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 2, 2, 64), torch.randn(2, 8, 2, 2, 64)
    cos, sin = _tables((8, 1, 1, 64))
    out, config, r = run_stack(_five_dims, (q, k, cos, sin))
    (kernel,) = r.kernels
    assert kernel.backend == "op" and "more than 4 dims" in kernel.fallback, r.table()
    assert "rope_fusion.rotary_qk.default" in graph_targets(config) and not CALLS
    check_numerics(_five_dims, (q, k, cos, sin), out)


def test_under_torchair_graph_mode_such_a_site_is_left_unfused_with_the_reason():
    """GE converts torch_npu's ops but has no converter for rope_fusion's: the site stays as written."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 2, 2, 64), torch.randn(2, 8, 2, 2, 64)
    cos, sin = _tables((8, 1, 1, 64))
    out, config, r = run_stack(_five_dims, (q, k, cos, sin), mode="max-autotune")
    assert not r.kernels and not r.errors and len(r.misses) == 2, r.table()
    assert all(m.reason.startswith("left in the graph: TorchAir's graph mode") and "more than 4 dims" in m.reason
               for m in r.misses), r.table()
    g = graph_targets(config)
    assert not any(t in g for t in ROPE_OPS) and "aten.cat.default" in g
    eq, ek = _five_dims(q, k, cos, sin)
    torch.testing.assert_close(out[0], eq)
    torch.testing.assert_close(out[1], ek)


def test_fx_pass_signature_is_the_custom_pass_one():
    """npugraph_ex / TorchAir call `fn(gm, example_inputs, config)` and ignore what it returns: the shared
    instance rewrites gm in place, recompiles it, and its report is `rope_fusion.fx_pass.report`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    got = []

    def compiler(gm, example_inputs):
        before = gm.code
        assert rope_fusion.fx_pass(gm, example_inputs, stack_config()) is None
        got.append((before, gm.code))
        return gm.forward

    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 4, 64), torch.randn(2, 8, 4, 64)
    cos, sin = _tables((8, 1, 64))
    n = len(rope_fusion.fx_pass.report.kernels)
    torch._dynamo.reset()
    torch.compile(_neox_qk, backend=aot_autograd(fw_compiler=compiler, decompositions=select_decomp_table()))(
        q, k, cos, sin)
    (before, after), = got
    assert "npu_rotary_mul" not in before and after.count("npu_rotary_mul.default(") == 2
    assert [kk.backend for kk in rope_fusion.fx_pass.report.kernels[n:]] == ["npu"]


def test_vllm_ascend_graph_fusion_pass_manager():
    """vllm-ascend without npugraph_ex: `fusion_pass_compile` runs AOTAutograd (no decompositions) with a forward
    compiler that calls its GraphFusionPassManager on the GraphModule; vLLM adds our pass to that manager from
    `inductor_compile_config["graph_fusion_manager"]`, and the manager's `add` takes only a VllmInductorPass.
    vllm-ascend is not pip-installable without CANN (its build needs it); this runs where its source tree is on
    the path (its GraphFusionPassManager imports without torch_npu)."""
    gfpm = pytest.importorskip("vllm_ascend.compilation.graph_fusion_pass_manager")
    from torch._dynamo.backends.common import aot_autograd
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config.utils import Range

    from rope_fusion.integrations.vllm_ascend import vllm_ascend_pass

    p = vllm_ascend_pass()
    manager = gfpm.GraphFusionPassManager()
    manager.add(p)
    assert copy.deepcopy(p).report.kernels == [] and type(copy.deepcopy(p)) is type(p)
    torch.manual_seed(0)
    q, k = torch.randn(6, 4, 128), torch.randn(6, 1, 128)
    cos, sin = _tables((6, 1, 64), full=False)
    torch._dynamo.reset()
    with pass_context(Range(start=1, end=8)):
        out = torch.compile(_neox_half_tables, backend=aot_autograd(fw_compiler=lambda gm, ex: manager(gm)))(
            q, k, cos, sin)
    assert [kk.backend for kk in p.report.kernels] == ["npu"], p.report.table()
    assert CALLS == [("rotary_mul", (1, 6, 4, 128), (1, 6, 1, 128), "half"),
                     ("rotary_mul", (1, 6, 1, 128), (1, 6, 1, 128), "half")], CALLS
    check_numerics(_neox_half_tables, (q, k, cos, sin), out)
