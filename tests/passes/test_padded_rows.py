"""The backward of a rotation of a row slice: the rotation's gradient padded with zero rows fuses.

Where the forward reads the slice twice (`y[:, 2:] * cos + rotate_half(y[:, 2:]) * sin`: two slice nodes, as a
model that slices in each product writes it), autograd pads each product's gradient with zero rows on its own and
adds the two: `slice_scatter(zeros, g * cos) + slice_scatter(zeros, rotate_half_T(g * sin))`. The backward graph
fused nothing and reported nothing, under Inductor and under `rope_fusion.backend`. passes/analysis/padded_sums.py
rewrites such a sum as the padded sum; the rotation is then a site, in the backward as in the forward. Checked: the
sites of both graphs, no near misses, and the gradients of every input against fp64 (the numerics contract) on fresh
random inputs; with the Triton kernel (interpreted) too.
"""

from __future__ import annotations

import pytest
import torch

import rope_fusion
from tests.helpers.numerics import check_numerics

pytestmark = pytest.mark.triton_on_cpu(serves=("slice_write",))  # the Triton backend, in place for the slice op too


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rotate_pairs(x):
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-b, a), -1).flatten(-2)


def neox_rows(y, cos, sin):  # y [B, S, D]: the rows from 2 on, sliced in each product
    return y[:, 2:] * cos + rotate_half(y[:, 2:]) * sin


def interleaved_rows_bhsd(y, cos, sin):  # y [B, H, S, D], CogVideoX's layout and pairs
    return y[:, :, 3:] * cos + rotate_pairs(y[:, :, 3:]) * sin


def one_row(y, cos, sin):  # a select: its backward is a select_scatter into zeros
    return y[:, 1] * cos[0] + rotate_half(y[:, 1]) * sin[0]


def rows_of_two_dims(y, cos, sin):  # padded along the batch and the sequence dims
    return y[1:, 2:] * cos + rotate_half(y[1:, 2:]) * sin


def q_and_k(q, k, cos, sin):  # both: dq and dk in one launch
    return neox_rows(q, cos, sin), neox_rows(k, cos, sin)


B, S, D = 3, 10, 16
FORMS = {  # name -> (fn, tensors rotated, their shape, tables' rows)
    "neox-rows": (neox_rows, 1, (B, S, D), S - 2),
    "interleaved-rows-bhsd": (interleaved_rows_bhsd, 1, (B, 2, S, D), S - 3),
    "one-row": (one_row, 1, (B, S, D), 1),
    "rows-of-two-dims": (rows_of_two_dims, 1, (B, S, D), S - 2),
    "q-and-k": (q_and_k, 2, (B, S, D), S - 2),
}


def _inputs(name, seed):
    fn, n, shape, rows = FORMS[name]
    torch.manual_seed(seed)
    angles = torch.rand(rows, D // 2, dtype=torch.float64) * 6
    if name == "interleaved-rows-bhsd":
        angles = angles.repeat_interleave(2, -1)
    else:
        angles = torch.cat((angles, angles), -1)
    return (*(torch.randn(shape) for _ in range(n)), angles.cos().float(), angles.sin().float())


def _grads(fn, n):
    """The gradients of every rotated tensor and of the tables of a weighted sum of fn's outputs."""
    def step(*args):
        leaves = [a.detach().requires_grad_(True) for a in args[:-1]]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs)
        return torch.autograd.grad(loss, leaves)
    return step


def _compiled(fn, how):
    torch._dynamo.reset()
    if how == "backend":
        b = rope_fusion.backend("aot_eager")
        return torch.compile(fn, backend=b), b.report
    p = rope_fusion.RopeFusionPass(backend=how)
    return torch.compile(fn, options={"post_grad_custom_post_pass": p}), p.report


@pytest.mark.parametrize("name,how", [*((name, "backend") for name in FORMS), ("neox-rows", "inductor"),
                                      ("interleaved-rows-bhsd", "inductor")],
                         ids=[*(f"{name}-backend" for name in FORMS), "neox-rows-inductor",
                              "interleaved-rows-bhsd-inductor"])
def test_the_backward_of_a_row_slice_rotation_fuses(name, how):
    fn, n, _, _ = FORMS[name]
    compiled, rep = _compiled(fn, how)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _grads(compiled, n)(*_inputs(name, 0), None)
        args = _inputs(name, 1)  # fresh inputs: the numbers of the graphs compiled above
        got = _grads(compiled, n)(*args, None)
    t = rep.table()
    assert not rep.errors and not rep.misses, t
    for kind in ("forward", "backward"):
        sites = [s for s in rep.sites if s.graph_kind.startswith(kind)]
        assert len(sites) == n, t
        assert all(s.conjugate == (kind == "backward") for s in sites), t
    assert len([k for k in rep.kernels if rep.graph_records[k.graph].kind == "backward"]) == 1, t
    check_numerics(lambda *a: _grads(fn, n)(*a, None), args, got, context=t)


def test_the_padded_backward_with_the_triton_kernel(triton_on_cpu):
    """The padding after the fused node is a scatter of its result into zeros: the Triton kernel's node, whose
    result Inductor cannot fuse, writes the rotated rows into the zeros (the slice-write fold) or is copied in."""
    fn, n, _, _ = FORMS["q-and-k"]
    compiled, rep = _compiled(fn, "triton")
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        args = _inputs("q-and-k", 2)
        got = _grads(compiled, n)(*args, None)
    t = rep.table()
    assert not rep.errors and not rep.misses and len(rep.sites) == 4, t
    assert {k.backend for k in rep.kernels} == {"triton"}, t
    check_numerics(lambda *a: _grads(fn, n)(*a, None), args, got, context=t)


def test_sums_padded_differently_are_left_as_they_are():
    """Only sums of values padded alike (the same rows of zeros of one shape) are merged: other rows, another base
    than zeros, another dim, a sum with a plain tensor."""
    import torch.fx as fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from rope_fusion.passes.analysis.padded_sums import merge_padded_sums

    def alike(a, b):
        z = torch.zeros(4, 6, 8)
        return torch.slice_scatter(z, a, 1, 2) + torch.slice_scatter(z, b, 1, 2)

    def unlike(a, b, base):
        z = torch.zeros(4, 6, 8)
        return (torch.slice_scatter(z, a, 1, 2) + torch.slice_scatter(z, b, 1, 1, 5),
                torch.slice_scatter(base, a, 1, 2) + torch.slice_scatter(z, b, 1, 2),
                torch.slice_scatter(z, a, 1, 2) + base,
                torch.slice_scatter(torch.full((4, 6, 8), 1.0), a, 1, 2) + torch.slice_scatter(z, b, 1, 2))

    a, b, base = torch.randn(4, 4, 8), torch.randn(4, 4, 8), torch.randn(4, 6, 8)
    gm = make_fx(alike, tracing_mode="fake")(a, b)
    assert merge_padded_sums(gm.graph) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.slice_scatter.default) == 1, gm.code
    torch.testing.assert_close(gm(a, b), alike(a, b), rtol=0, atol=0)
    gm = make_fx(unlike, tracing_mode="fake")(a, b, base)
    before = [(n.target, n.args) for n in gm.graph.nodes]
    assert merge_padded_sums(gm.graph) == 0
    assert [(n.target, n.args) for n in gm.graph.nodes] == before
    assert isinstance(gm.graph, fx.Graph)
