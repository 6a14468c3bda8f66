"""The pass adds no guards, so dynamic shapes compile exactly as often as without it.

The analysis reads sizes that it needs as ints (lane counts) at their example values without guarding on them
(fx_sizes.py, `hint_reads`). A site whose proof read a symbolic size is left unfused and reported, naming the size
(passes/analysis/symbolic_sizes.py): fused, it would hold for that value only. Before, such sizes were guarded: a
Conv1d block with time last compiled 8 graphs (and fell back to eager at the recompile limit) for 10 sizes under
`dynamic=True`, a write-back `q[:, :, t:] = rope(q[:, :, t:])` compiled one graph per text length, another head dim
compiled again, and a head dim marked dynamic (`torch._dynamo.mark_dynamic`) failed the compile. Sizes known only at
run time (`nonzero`, `.item()`) have no example value: sites over them fuse where no decision needs them.

Each case counts the graphs compiled over several sizes with the pass and without it, and the guards each call of
the pass adds to the shape environment.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

import rope_fusion
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

pytestmark = pytest.mark.triton_on_cpu(serves=("slice_write",))  # the Triton backend, in place for the slice op too

SIZES = range(5, 25, 2)  # ten sizes of the dynamic dim (not 0 or 1, which Dynamo specialises)


def _shape_env(graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        mode = getattr(val, "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return mode.shape_env
    return None


class _GuardCounting(rope_fusion.RopeFusionPass):
    """The pass, counting the guards that each call adds to the graph's shape environment."""

    def __call__(self, graph, is_inference=None):
        env = _shape_env(graph)
        before, sites = (len(env.guards) if env else 0), len(self.report.sites)
        super().__call__(graph, is_inference)
        self.calls.append((len(env.guards) - before if env else 0, len(self.report.sites) - sites))


def compiled_graphs(fn, make_args, with_pass: bool, sizes=SIZES, dynamic=True, **pass_kw):
    """(graphs compiled for fn over `sizes`, the pass or None): one count per Inductor compile; every result is
    checked against eager. `make_args(n)` builds fresh inputs (and marks their dims, where a case does)."""
    torch._dynamo.reset()
    p = _GuardCounting(**pass_kw) if with_pass else None
    if p is not None:
        p.calls = []
    graphs = 0

    def inductor(gm, example_inputs):
        nonlocal graphs
        graphs += 1
        return compile_fx(gm, example_inputs,
                          config_patches={"post_grad_custom_post_pass": p} if p is not None else {})

    compiled = torch.compile(fn, dynamic=dynamic, backend=inductor)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for n in sizes:
            args = make_args(n)
            want = _tuple(fn(*[a.clone() for a in args]))
            for got, w in zip(_tuple(compiled(*args)), want):
                torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    return graphs, p


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def conv_block(x, w):
    """The issue's Conv1d block with time last: x [1, 4, n]."""
    y = torch.nn.functional.conv1d(x, w, padding=1)
    return torch.nn.functional.gelu(y) * 0.5 + y


def eager_attention(q, k, v, mask):
    """Hugging Face's eager attention: softmax(q @ k^T * scale + mask) @ v over n tokens."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(scores, dim=-1) @ v


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb over a sequence of n tokens: q, k [1, H, n, D], cos, sin [n, D]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _tables(n, d):
    angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.rand(d // 2).repeat(2)
    return angles.cos(), angles.sin()


CASES = {
    "conv1d_time_last": (conv_block, lambda n: (torch.randn(1, 4, n), torch.randn(4, 4, 3))),
    "eager_attention": (eager_attention, lambda n: (torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8),
                                                    torch.randn(1, 2, n, 8), torch.randn(1, 1, n, n))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_graph_without_rope_gets_no_guard(case):
    """No RoPE: as many graphs with the pass as without (one), and the pass adds no guard to any."""
    fn, make_args = CASES[case]
    torch.manual_seed(0)
    plain, _ = compiled_graphs(fn, make_args, with_pass=False)
    fused, p = compiled_graphs(fn, make_args, with_pass=True)
    assert fused == plain == 1, (fused, plain)
    assert p.calls and all(guards == 0 and sites == 0 for guards, sites in p.calls), p.calls


def _static_head(*tensors):
    """The last dim of each tensor marked static: the head dim a constant, as a model's config makes it."""
    for t in tensors:
        torch._dynamo.mark_static(t, t.dim() - 1)
    return tensors


def _guards_and_sites(p) -> tuple:
    return sum(g for g, _ in p.calls), sum(s for _, s in p.calls)


def test_rope_with_a_dynamic_sequence_still_fuses_without_recompiling():
    """RoPE over a dynamic sequence length, the head dim static: q and k fuse, the ten sizes compile as many
    graphs as without the pass, and the pass adds no guard (the sequence is never read at its example value)."""
    torch.manual_seed(1)

    def make_args(n):
        return _static_head(torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16), *_tables(n, 16))

    plain, _ = compiled_graphs(rope, make_args, with_pass=False)
    fused, p = compiled_graphs(rope, make_args, with_pass=True)
    assert fused == plain == 1, (fused, plain)
    assert p.calls == [(0, 2)], p.report.table()
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qk"], p.report.table()


def _head_dims(n):
    """Three head dims and three lengths: q, k [1, 2, S, D] and full-width tables."""
    d, s = {0: (8, 5), 1: (16, 7), 2: (32, 9)}[n]
    return (torch.randn(1, 2, s, d), torch.randn(1, 2, s, d), *_tables(s, d))


def test_a_symbolic_head_dim_is_left_not_guarded():
    """dynamic=True with the head dim symbolic (q and k given as inputs): the proof read the head dim at its
    example value, so the sites are left and reported, naming it, and three head dims compile one graph, as
    without the pass (3 before, each guarded to its head dim)."""
    torch.manual_seed(4)
    plain, _ = compiled_graphs(rope, _head_dims, with_pass=False, sizes=range(3))
    fused, p = compiled_graphs(rope, _head_dims, with_pass=True, sizes=range(3))
    assert fused == plain == 1, (fused, plain)
    assert _guards_and_sites(p) == (0, 0), p.report.table()
    assert len(p.report.misses) == 2, p.report.table()
    for m in p.report.misses:
        assert m.reason.startswith("it reads a symbolic size as a constant: ") and "the head dim of x" in m.reason \
            and "L['q'].size()[3]" in m.reason, m.reason


def packed_halves(q, cos_sin):
    """A packed [n, D] table whose sin half is cut from its end (`cos_sin[..., -h:]`), heads split by a view, the
    rotation written by strided halves into a fresh tensor: under dynamic=True the half's start is `s - h` of the
    table's symbolic width, which only the table's gather in planning reads."""
    c, s = cos_sin[..., :4][:, None, :], cos_sin[..., -4:][:, None, :]
    x = q.view(*q.shape[:-1], 4, 8)
    x1, x2 = x[..., :4], x[..., 4:]
    out = torch.empty_like(x)
    out[..., :4] = x1 * c - x2 * s
    out[..., 4:] = x2 * c + x1 * s
    return out


def _packed(n):
    s = (5, 9)[n]
    angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(4)
    return torch.randn(2, s, 32), torch.cat((angles.cos(), angles.sin()), -1)


def test_a_table_window_read_while_planning_is_a_near_miss():
    """The sin half's start read at its example value while the group is planned (its tables' gather), after the
    sites were chosen: the group is left and reported with the size's reason, the graph compiles as plain
    compile's does, and the pass adds no guard (it was an internal error that left the whole graph unchanged and
    reported nothing)."""
    torch.manual_seed(6)
    plain, _ = compiled_graphs(packed_halves, _packed, with_pass=False, sizes=range(2))
    fused, p = compiled_graphs(packed_halves, _packed, with_pass=True, sizes=range(2))
    assert fused == plain == 1, (fused, plain)
    assert _guards_and_sites(p)[0] == 0 and not p.report.errors and not p.report.kernels, p.report.table()
    assert p.report.misses and all(m.reason.startswith("it reads a symbolic size as a constant: ")
                                   for m in p.report.misses), p.report.table()


def _marked(dims: dict, shape):
    """make_args with dims marked dynamic ({argument index: dim}); `shape(n)` gives the nth call's (S, D)."""
    def make_args(n):
        s, d = shape(n)
        args = (torch.randn(1, 2, s, d), torch.randn(1, 2, s, d), *_tables(s, d))
        for i, dim in dims.items():
            torch._dynamo.mark_dynamic(args[i], dim)
        return args
    return make_args


@pytest.mark.parametrize("dims,shape,fuses", [
    ({0: 3, 1: 3, 2: 1, 3: 1}, lambda n: (7, (8, 16)[n]), False),  # the head dim: the sites read it
    ({0: 2, 1: 2, 2: 0, 3: 0}, lambda n: ((6, 11)[n], 16), True),  # the sequence: never read, the sites fuse
], ids=["head dim marked", "sequence marked"])
def test_a_dim_marked_dynamic_is_never_guarded(dims, shape, fuses):
    """`torch._dynamo.mark_dynamic` on a dim the pass reads: the compile completes (it raised
    ConstraintViolationError: "marked as dynamic but your code specialized it"), the sites are left with a reason
    that names the dim, and two sizes make as many graphs as plain compile. A marked dim the proof does not read
    (the sequence) leaves the sites fused, with no guard."""
    torch.manual_seed(5)
    make_args = _marked(dims, shape)
    plain, _ = compiled_graphs(rope, make_args, with_pass=False, sizes=range(2), dynamic=None)
    fused, p = compiled_graphs(rope, make_args, with_pass=True, sizes=range(2), dynamic=None)
    assert fused == plain == 1, (fused, plain)
    assert _guards_and_sites(p) == (0, 2 if fuses else 0), p.report.table()
    if not fuses:
        assert len(p.report.misses) == 2 and all("the head dim of x" in m.reason and "L['q'].size()[3]" in m.reason
                                                 for m in p.report.misses), p.report.table()


def vllm_flat(query, key, cos, sin):
    """vLLM's forward_native on flat [T, H*D] q and k (NeoX over the whole head of 32)."""
    def one(x):
        shape = x.shape
        x = x.view(x.shape[0], -1, 32)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(shape)
    return one(query), one(key)


@pytest.mark.parametrize("marked,ops", [
    pytest.param({0: 1, 1: 1}, [], marks=pytest.mark.slow),  # 7-28 s on a loaded 2-core host; k's case covers it
    ({1: 1}, ["rope_fusion.rotary"]),
    ({0: 0, 1: 0, 2: 0, 3: 0}, ["rope_fusion.rotary_qk"]),
], ids=["flat H*D marked", "k's flat dim marked", "tokens marked"])
def test_vllm_flat_rows_with_a_marked_dim(marked, ops):
    """vLLM's flat [T, H*D] q and k: with the flat dim marked dynamic the compile completes and the sites are left,
    naming it (it raised ConstraintViolationError); marked on k alone, q still fuses on its own; with the token
    count marked (vLLM's own case) both fuse in one launch. No guard, and as many graphs as plain compile."""
    torch.manual_seed(6)

    def make_args(n):
        t = (7, 12)[n]
        heads = n + 2 if marked.get(0) == 1 else 4  # a marked flat dim changes between calls
        ang = torch.rand(t, 16) * 6
        args = (torch.randn(t, heads * 32), torch.randn(t, 2 * 32), ang.cos(), ang.sin())
        for i, d in marked.items():
            torch._dynamo.mark_dynamic(args[i], d)
        return args

    plain, _ = compiled_graphs(vllm_flat, make_args, with_pass=False, sizes=range(2), dynamic=None)
    fused, p = compiled_graphs(vllm_flat, make_args, with_pass=True, sizes=range(2), dynamic=None)
    assert fused == plain, (fused, plain)
    assert [g for g, _ in p.calls] == [0] * fused, p.calls
    assert [k.op for k in p.report.kernels] == ops * fused, p.report.table()
    left = [name for name, i in (("query", 0), ("key", 1)) if marked.get(i) == 1]
    assert sorted(m.reason.split("from ")[1].split("L['")[1].split("']")[0] for m in p.report.misses) == \
        sorted(left * fused), p.report.table()


def rope_interleaved(x, cos, sin):
    """diffusers' apply_rotary_emb (use_real, unbind -1) on [B, H, S, D], tables [S, D]."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return x * cos + rotated * sin


def write_back_at_t(q, c, s):
    """The issue's reproducer: the rows after a text prefix of symbolic length t rotated in place."""
    t = q.shape[2] - c.shape[0]
    q = q * 1.0
    q[:, :, t:] = rope_interleaved(q[:, :, t:], c, s)
    return q


@pytest.mark.parametrize("head,backend", [("static", "auto"), ("symbolic", "auto"), ("static", "triton")])
def test_a_write_back_at_a_symbolic_start_compiles_once(head, backend, request):
    """`q[:, :, t:] = rope(q[:, :, t:])` with t symbolic, at eight text lengths: one graph with the pass as
    without it (eight before, then the recompile limit: each compile guarded t to its value). With the head dim
    static the rotation fuses for every t (the Triton kernel writes the rows from t in place: t is passed as the
    graph computes it); with it symbolic it is left, naming the head dim."""
    if backend == "triton":
        request.getfixturevalue("triton_on_cpu")
    torch.manual_seed(7)

    def make_args(t):
        args = (torch.randn(1, 2, t + 6, 16), torch.randn(6, 16), torch.randn(6, 16))
        return _static_head(*args) if head == "static" else args

    sizes = range(2, 10) if backend == "auto" else range(2, 5)
    plain, _ = compiled_graphs(write_back_at_t, make_args, with_pass=False, sizes=sizes)
    fused, p = compiled_graphs(write_back_at_t, make_args, with_pass=True, sizes=sizes, backend=backend)
    assert fused == plain == 1, (fused, plain)
    assert _guards_and_sites(p) == (0, 1 if head == "static" else 0), p.report.table()
    if head == "symbolic":
        assert ["the head dim of x" in m.reason for m in p.report.misses] == [True], p.report.table()
    if backend == "triton":
        (kernel,) = p.report.kernels
        assert re.fullmatch(r"slice write: \w+\[dim 2, s\d+ - s\d+:s\d+\]", kernel.fold), p.report.table()


def write_back_after_text(q, c, s):
    """CogVideoX's write-back: the rows after a text prefix of fixed length, over a sequence of dynamic length."""
    q = q * 1.0
    q[:, :, 3:] = rope_interleaved(q[:, :, 3:], c, s)
    return q


def test_a_write_back_over_a_dynamic_sequence_folds_without_a_guard(triton_on_cpu):
    """The rows from 3 to the end of a dynamic sequence: the fold takes the end as the base's size, a graph value,
    and four lengths compile one graph, as without the pass."""
    torch.manual_seed(9)

    def make_args(n):
        return _static_head(torch.randn(1, 2, n + 3, 16), torch.randn(n, 16), torch.randn(n, 16))

    sizes = (4, 6, 9)
    plain, _ = compiled_graphs(write_back_after_text, make_args, with_pass=False, sizes=sizes)
    fused, p = compiled_graphs(write_back_after_text, make_args, with_pass=True, sizes=sizes, backend="triton")
    assert fused == plain == 1, (fused, plain)
    assert _guards_and_sites(p) == (0, 1), p.report.table()
    assert re.fullmatch(r"slice write: \w+\[dim 2, 3:s\d+ \+ 3\]", p.report.kernels[0].fold), p.report.table()


def test_a_training_step_compiles_once_and_fuses_both_ways():
    """Forward and backward under dynamic=True, the head dim static: q and k fuse in both graphs, and five lengths
    compile as many graphs as plain compile, with no guard from the pass; the gradients are eager's."""
    torch.manual_seed(8)

    def step(q, k, cos, sin):
        a, b = rope(q, k, cos, sin)
        return (a * b).sum()

    def run(with_pass):
        torch._dynamo.reset()
        p = _GuardCounting() if with_pass else None
        if p is not None:
            p.calls = []
        graphs = []

        def inductor(gm, example_inputs):
            graphs.append(1)
            return compile_fx(gm, example_inputs,
                              config_patches={"post_grad_custom_post_pass": p} if p is not None else {})

        compiled = torch.compile(step, dynamic=True, backend=inductor)
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            for n in (5, 7, 9, 12, 15):
                q, k, cos, sin = _static_head(torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16), *_tables(n, 16))
                qe, ke = q.clone().requires_grad_(), k.clone().requires_grad_()
                step(qe, ke, cos, sin).backward()
                q.requires_grad_(), k.requires_grad_()
                compiled(q, k, cos, sin).backward()
                torch.testing.assert_close(q.grad, qe.grad, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(k.grad, ke.grad, rtol=1e-5, atol=1e-5)
        return len(graphs), p

    plain, _ = run(False)
    fused, p = run(True)
    assert fused == plain, (fused, plain)
    assert [g for g, _ in p.calls] == [0] * len(p.calls) and sum(s for _, s in p.calls) >= 4, \
        (p.calls, p.report.table())


@pytest.fixture
def data_dependent_capture():
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield


def select_tokens(x, mask, cos, sin):
    """Tokens picked by a mask (`nonzero`: a count known only at run time), then rotated: x [T, H, D]."""
    idx = mask.nonzero().squeeze(-1)
    q, c, s = x[idx], cos[idx].unsqueeze(1), sin[idx].unsqueeze(1)
    return q * c + _rotate_half(q) * s


def tables_at_offset(x, start, cos, sin):
    """Tables read from a data-dependent offset (`.item()`): x [B, S, H, D]."""
    o = start.item()
    torch._check(o >= 0)
    torch._check(o + x.shape[1] <= cos.shape[0])
    c, s = cos[o:o + x.shape[1]].unsqueeze(1), sin[o:o + x.shape[1]].unsqueeze(1)
    return x * c + _rotate_half(x) * s


@pytest.mark.parametrize("fn,args", [
    (select_tokens, lambda: (torch.randn(8, 2, 16), torch.rand(8) > 0.5, *_tables(8, 16))),
    (tables_at_offset, lambda: (torch.randn(1, 5, 2, 16), torch.tensor(3), *_tables(16, 16))),
], ids=["nonzero", "item"])
def test_data_dependent_sizes_fuse(fn, args, data_dependent_capture):
    """A token count from `nonzero` and a table offset from `.item()`: the site fuses (before: a guard on the
    data-dependent size failed and the site was left unfused), with the numbers of the original."""
    torch.manual_seed(2)
    args = args()
    out, p = compile_with_pass(fn, *args)
    assert len(p.report.sites) == 1 and not p.report.errors, (p.report.table(), p.report.errors)
    check_numerics(fn, args, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_gpu_write_back_at_a_symbolic_start_compiles_once(backend):
    """On a GPU: the write-back at a symbolic text length over eight lengths, the head dim static, compiles one
    graph with the pass as without it and adds no guard; with the Triton kernel the rows from t are written in
    place (t passed as the graph computes it), and every result is eager's."""
    torch.manual_seed(10)

    def make_args(t):
        return _static_head(torch.randn(1, 4, t + 64, 64, device="cuda"), torch.randn(64, 64, device="cuda"),
                            torch.randn(64, 64, device="cuda"))

    plain, _ = compiled_graphs(write_back_at_t, make_args, with_pass=False, sizes=range(2, 10))
    fused, p = compiled_graphs(write_back_at_t, make_args, with_pass=True, sizes=range(2, 10), backend=backend)
    assert fused == plain == 1, (fused, plain)
    guards, sites = _guards_and_sites(p)
    assert guards == 0, p.calls
    if backend == "triton":
        assert sites == 1, p.report.table()
        assert re.fullmatch(r"slice write: \w+\[dim 2, s\d+ - s\d+:s\d+\]", p.report.kernels[0].fold), \
            p.report.table()
    else:  # the cost model decides (sizes known only at run time are not measured): fused, or left with its reason
        assert sites == 1 or [m.reason.startswith("left to Inductor") for m in p.report.misses] == [True], \
            p.report.table()
