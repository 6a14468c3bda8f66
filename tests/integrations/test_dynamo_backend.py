"""`rope_fusion.backend(inner)`: the pass without Inductor, on real tiny models, forward and backward.

Unmodified diffusers Wan, Helios and Flux and transformers Llama (tests/zoo/entries.py configs, no downloads)
compiled with `torch.compile(model, backend=rope_fusion.backend(inner))`, then one training step (forward, a
sum-of-squares loss, backward). After AOTAutograd, "eager" and "aot_eager" are one code path (the rewritten
ATen graphs run op by op), so each model runs under one of them and each inner under two models: a compile of a
tiny model takes tens of seconds on a loaded 2-core machine. Checked per model:
- the forward graph fuses every site the model has (counted from its source in the zoo entry), q and k of each
  attention in one launch, and the backward graph fuses their gradients (the conjugate rotation) the same way;
  no errors, and no near miss at a line of the model's RoPE (the lane screen reports some products in the
  norms and FFNs of the un-normalised AOT graphs as RoPE-looking: reported, left alone);
- the outputs and every parameter gradient meet the numerics contract against an fp64 eager run: error with
  the pass <= the error of the same compile without it + eps, that compile being torch's
  "aot_eager_decomp_partition" (AOTAutograd with Inductor's decompositions and partitioner, as here, then the
  graphs run op by op): a parameter gradient deep in the model sums in another order than eager's, which moves
  its fp32 error by more than an eps either way, with the pass or without.
"""

from __future__ import annotations

import pytest
import torch

import rope_fusion
from tests.helpers.numerics import check_numerics
from tests.zoo.entries import by_name
from tests.zoo.harness import float_leaves

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

def _fresh(inputs: dict) -> dict:
    return {k: torch.randn_like(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs.items()}


def _step(model, inputs: dict, run) -> tuple[list, list]:
    """Outputs and parameter gradients of one forward + backward through `run`."""
    model.zero_grad(set_to_none=True)
    outs = float_leaves(run(**inputs))
    sum(o.double().pow(2).sum() for o in outs).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [o.detach() for o in outs], grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("name,inner", [("wan", "eager"),  # the rest are real-model compiles of a minute: -m slow
                                        pytest.param("helios", "aot_eager", marks=pytest.mark.slow),
                                        pytest.param("flux", "eager", marks=pytest.mark.slow),
                                        pytest.param("llama", "aot_eager", marks=pytest.mark.slow)])
def test_every_site_fuses_forward_and_backward(name, inner):
    entry = by_name(name)
    torch.manual_seed(0)
    model, inputs = entry.build()
    model = model.float().eval()
    inputs = _fresh(inputs)
    be = rope_fusion.backend(inner)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be)
    fused_out, fused_grads = _step(model, inputs, compiled)
    torch._dynamo.reset()
    decomposed_out, decomposed_grads = _step(model, inputs,
                                             torch.compile(model, backend="aot_eager_decomp_partition"))
    eager_out, eager_grads = _step(model, inputs, model)
    model64 = model.double()
    ref_out, ref_grads = _step(model64, {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                         else v for k, v in inputs.items()}, model64)
    model.float()

    r = be.report
    assert not r.errors, r.table()
    rope_lines = {s.source for s in r.sites}
    assert not [m for m in r.misses if m.source in rope_lines], r.table()
    for kind in ("forward", "backward"):
        sites = [s for s in r.sites if s.graph_kind == kind]
        kernels = {s.kernel for s in sites}
        assert len(sites) == entry.compiled_sites, (kind, r.table())
        assert len(kernels) == entry.compiled_kernels, (kind, r.table())
    assert all(k.op == "rope_fusion.rotary_qk" and k.backend == "op" for k in r.kernels), r.table()

    assert len(fused_out) == len(ref_out) and len(fused_grads) == len(ref_grads) > 0
    eps = torch.finfo(torch.float32).eps
    # the contract against what the model gets without the pass: eager, or compiled through AOTAutograd with
    # Inductor's whole decomposition table (the backend keeps some ops whole, so either summation order is fair)
    for what, fused, eager, decomposed, ref in (("output", fused_out, eager_out, decomposed_out, ref_out),
                                                ("gradient", fused_grads, eager_grads, decomposed_grads, ref_grads)):
        for i, (f, e, d, x) in enumerate(zip(fused, eager, decomposed, ref)):
            base = max(_rel(e, x), _rel(d, x))
            assert _rel(f, x) <= base + eps, f"{what} {i}: {_rel(f, x):.3g} > {base:.3g} + eps"


def _qk(q, k, cos, sin):
    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _qk_inputs():
    torch.manual_seed(0)
    q, k = (torch.randn(2, 8, 4, 32, requires_grad=True) for _ in range(2))
    ang = torch.rand(8, 1, 16) * 6
    return q, k, torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()


def test_the_inductor_inner_runs_the_inductor_pass():
    """inner="inductor": Inductor compiles with the Inductor pass in its post-grad slot (its cost model and
    backends), forward and backward."""
    q, k, cos, sin = _qk_inputs()
    be = rope_fusion.backend("inductor")
    assert type(be.pass_) is rope_fusion.RopeFusionPass
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        oq, ok = torch.compile(_qk, backend=be, fullgraph=True)(q, k, cos, sin)
        (oq.pow(2).sum() + ok.pow(2).sum()).backward()
    r = be.report
    assert not r.errors, r.table()
    assert [s.graph_kind for s in r.sites] == ["forward"] * 2 + ["backward"] * 2, r.table()
    assert all(kk.backend == "inductor" for kk in r.kernels), r.table()
    check_numerics(_qk, (q.detach(), k.detach(), cos, sin), (oq.detach(), ok.detach()))
    torch.testing.assert_close(q.grad, 2 * q.detach(), rtol=1e-5, atol=1e-5)  # d|Rq|^2/dq = 2 R^T R q


def test_a_backend_callable_gets_the_rewritten_aten_graphs():
    """Any Dynamo backend as inner: it is handed each rewritten ATen graph (forward, backward) to compile."""
    seen = []

    def inner(gm, example_inputs):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    f = _qk
    q, k, cos, sin = _qk_inputs()
    be = rope_fusion.backend(inner)
    torch._dynamo.reset()
    oq, ok = torch.compile(f, backend=be, fullgraph=True)(q, k, cos, sin)
    (oq.pow(2).sum() + ok.pow(2).sum()).backward()
    eq, ek = f(q.detach(), k.detach(), cos, sin)
    torch.testing.assert_close(oq, eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok, ek, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad, 2 * q.detach(), rtol=1e-5, atol=1e-5)  # d|Rq|^2/dq = 2 R^T R q
    assert len(seen) == 2 and all("rope_fusion.rotary_qk.default" in g for g in seen), seen
    assert all("aten.mul.Tensor" not in g for g in seen), seen  # the table x activation products died
    assert "aten.cat.default" not in seen[0], seen  # and the rotate-half cats (the backward's swap the tables)


def test_backend_checks_its_arguments():
    with pytest.raises(ValueError, match="inner"):
        rope_fusion.backend("tvm")
    with pytest.raises(ValueError, match="decompositions"):
        rope_fusion.backend("eager", decompositions="mine")
    with pytest.raises(TypeError, match="FxPass"):
        rope_fusion.backend("eager", pass_=rope_fusion.RopeFusionPass())
    with pytest.raises(TypeError, match="RopeFusionPass"):
        rope_fusion.backend("inductor", pass_=rope_fusion.FxPass())


def _aot_nop():
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    return aot_autograd(fw_compiler=boxed_nop)


@pytest.mark.parametrize("inner,options", [
    ("cudagraphs", {}),  # on the CPU torch's cudagraphs backend skips the graphs and runs them: the wiring
    ("aot_eager", {"decompositions": "core_aten"}),
    (_aot_nop, {}),  # an aot_autograd(...) object: its compilers, fx_pass in front
], ids=["cudagraphs", "core-aten", "aot-autograd-object"])
def test_other_inners_fuse_forward_and_backward(inner, options):
    q, k, cos, sin = _qk_inputs()
    be = rope_fusion.backend(inner() if callable(inner) else inner, **options)
    torch._dynamo.reset()
    oq, ok = torch.compile(_qk, backend=be, fullgraph=True)(q, k, cos, sin)
    (oq.pow(2).sum() + ok.pow(2).sum()).backward()
    r = be.report
    assert not r.errors and [s.graph_kind for s in r.sites] == ["forward"] * 2 + ["backward"] * 2, r.table()
    check_numerics(_qk, (q.detach(), k.detach(), cos, sin), (oq.detach(), ok.detach()))
    torch.testing.assert_close(q.grad, 2 * q.detach(), rtol=1e-5, atol=1e-5)
