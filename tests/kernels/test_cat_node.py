"""The cat fold as Inductor's own user-kernel node: on CUDA the pass emits the Triton kernel's CAT launch into the
post-grad graph (kernels/triton_cat.py `emit_node`), as it emits the main op's, so a compiled graph launches it
from its generated code instead of calling `rope_fusion::rotary_qk_cat` through the dispatcher on every step.

The graphs are traced with fake CUDA tensors, which needs no GPU: the node, its arguments and what Inductor's own
passes make of it are checked here; the GPU test compiles Flux's joint q/k and checks its numerics against fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

pytest.importorskip("triton")

from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import rope_fusion  # noqa: E402
from rope_fusion.kernels import triton_launch  # noqa: E402
from tests.helpers.diffusers_rotary import rms  # noqa: E402
from tests.helpers.fake_cuda import inductor_reinplaced, pass_graph, written_by_kernel  # noqa: E402

if triton_launch.INTERPRETED:  # TRITON_INTERPRET=1 set for the whole run
    pytest.skip("the kernel module was imported under TRITON_INTERPRET=1: make_fx cannot trace it",
                allow_module_level=True)


def rope(x, cos, sin):
    """diffusers' apply_rotary_emb on [B, S, H, D] (tests/helpers/diffusers_rotary.py), its tables' broadcast
    spelled with unsqueeze: make_fx on CPU-only torch cannot index fake CUDA tensors with None."""
    cos, sin = cos.unsqueeze(0).unsqueeze(2), sin.unsqueeze(0).unsqueeze(2)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def flux_qk(q, k, eq, ek, wq, wk, weq, wek, cos, sin):
    """FluxAttnProcessor's joint q and k: each piece normed with its own weight, text first, then rotated."""
    q = torch.cat([rms(eq, weq), rms(q, wq)], 1)
    k = torch.cat([rms(ek, wek), rms(k, wk)], 1)
    return rope(q, cos, sin), rope(k, cos, sin)


def unnormed_qk(q, k, eq, ek, cos, sin):
    return rope(torch.cat([eq, q], 1), cos, sin), rope(torch.cat([ek, k], 1), cos, sin)


def _args(device, dtype, text, image, heads, d, normed=True, fake=True):
    """The pieces (image q, k, then text q, k), with `normed` their four weights, and the tables: real values on
    `device`, or fake ones there (no GPU needed to trace)."""
    shapes = [(2, image, heads, d)] * 2 + [(2, text, heads, d)] * 2 + ([(d,)] * 4 if normed else [])
    if fake:
        with FakeTensorMode():
            return [*(torch.empty(s, device=device, dtype=dtype) for s in shapes),
                    *(torch.empty(text + image, d, device=device) for _ in range(2))]
    g = torch.Generator().manual_seed(text * 1000 + image)
    xs = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    xs[4:] = [1.0 + 0.1 * w for w in xs[4:]]
    angles = torch.randn(text + image, d // 2, generator=g, dtype=torch.float64).repeat_interleave(2, -1)
    return [*(x.to(device, dtype) for x in xs), angles.cos().to(device, torch.float32),
            angles.sin().to(device, torch.float32)]


@pytest.mark.parametrize("fn,normed", [(flux_qk, True), (unnormed_qk, False)])
@pytest.mark.parametrize("text,image,heads,d", [(3, 5, 2, 16), (7, 64, 4, 128)])
def test_the_cat_fold_is_one_user_kernel_node(fn, normed, text, image, heads, d):
    """q and k read from their pieces in one CAT launch, each piece its own pointer (and norm weight): no cat, no
    op through the dispatcher, the joined outputs as the kernel's written buffers."""
    args = _args("cuda", torch.bfloat16, text, image, heads, d, normed)
    p, gm = pass_graph(fn, args)
    r = p.report
    assert len(r.kernels) == 1 and r.kernels[0].fold.startswith("cat folded:"), r.table()
    targets = [str(n.target) for n in gm.graph.nodes]
    assert not any("rotary_qk_cat" in t or t == "aten.cat.default" for t in targets), targets
    hop, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    kw = hop.kwargs["kwargs"]
    assert kw["CAT"] is True and kw["cat_split"] == text and kw["NSIDES"] == 2
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # the pieces themselves, text first: the first pieces are the text's, the second the image's
    assert (kw["q_ptr"], kw["k_ptr"], kw["q2_ptr"], kw["k2_ptr"]) == tuple(placeholders[i] for i in (2, 3, 0, 1))
    if normed:
        assert kw["NORM"] == 1 and (kw["wq_ptr"], kw["wq2_ptr"]) == (placeholders[6], placeholders[4])
        assert not any(t in ("aten.rsqrt.default", "aten.mean.dim") for t in targets), targets
    assert sorted(hop.kwargs["tensors_to_clone"]) == ["ko_ptr", "qo_ptr"]
    for name in ("qo_ptr", "ko_ptr"):
        assert tuple(kw[name].meta["val"].shape) == (2, text + image, heads, d)


def test_inductor_lowers_the_cat_node_with_the_traced_strides():
    """After Inductor's reinplacing and decomposition the launch is one mutation node whose eager values pin the
    pieces' traced strides (the kernel's strides are constants of the launch), the second pieces' included."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation

    args = _args("cuda", torch.bfloat16, 3, 5, 2, 16)
    _p, gm = pass_graph(flux_qk, args)
    gm = inductor_reinplaced(gm, args[0].fake_mode)
    mut, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_mutation]
    kw = mut.kwargs["kwargs"]
    eager = mut.meta["eager_input_vals"][1]["kwargs"]
    for name in ("q_ptr", "k_ptr", "q2_ptr", "k2_ptr"):
        assert isinstance(kw[name], fx.Node) and eager[name].stride() == kw[name].meta["val"].stride()
    assert (kw["q2_stride_t1"], kw["q2_stride_t2"]) == (eager["q2_ptr"].stride(0), eager["q2_ptr"].stride(1))


def test_inductors_analysis_finds_only_the_outputs_written(monkeypatch):
    """Inductor reads a user kernel's TTIR to find the tensors it writes, and clones any other it finds written:
    the CAT launch writes the joined outputs alone, so the pieces are passed as they are. Triton builds the TTIR
    for a target, which needs a GPU driver: a stand-in driver names an sm_90 target (nothing is compiled for it
    beyond the TTIR, and nothing runs)."""
    args = _args("cuda", torch.bfloat16, 3, 5, 2, 16)
    _p, gm = pass_graph(flux_qk, args)
    hop, = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    assert written_by_kernel(monkeypatch, hop, args[0].fake_mode) == ["ko_ptr", "qo_ptr"]


def test_the_cpu_keeps_the_op():
    """Inductor compiles user Triton kernels for GPUs only: on other devices the kernel's node is not emitted (the
    tests serve the CPU with the interpreted kernel through the op)."""
    from rope_fusion.ops import cat_rotary

    with FakeTensorMode():
        x = torch.empty(2, 3, 2, 16)
    node = fx.Graph().placeholder("x")
    node.meta["val"] = x
    call = rope_fusion.ops.schema.RotaryCall([node], node, node, None)
    assert cat_rotary.emit_node(fx.Graph(), FakeTensorMode(), cat_rotary.CatCall(call, [node], [None], [1]),
                                node) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_compiled_cat_node_against_fp64(dtype):
    """Flux's joint q/k compiled with the pass on the GPU: the generated code launches the kernel and calls no
    cat op, and the result is the model's within the numbers contract of an fp64 evaluation."""
    from torch._inductor.utils import run_and_get_code

    from tests.helpers.numerics import check_numerics

    torch._dynamo.reset()
    args = _args("cuda", dtype, 7, 64, 4, 128, fake=False)
    p = rope_fusion.RopeFusionPass(backend="triton")
    compiled = torch.compile(flux_qk, options={"post_grad_custom_post_pass": p})
    out, codes = run_and_get_code(compiled, *args)
    assert len(p.report.kernels) == 1 and p.report.kernels[0].fold.startswith("cat folded:"), p.report.table()
    code = "\n".join(codes)
    assert "rotary_qk_cat" not in code and "rotary_kernel" in code
    check_numerics(flux_qk, args, out, context=p.report.table())
