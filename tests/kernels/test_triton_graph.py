"""The Triton backend as the pass emits it: Inductor's own `triton_kernel_wrapper_functional` node.

The host side that plans the launch is the one tests/kernels/test_triton_kernels.py runs under the Triton
interpreter; here the point is the node the pass writes into a post-grad graph: one launch for q and k,
the options carried as constexprs, fresh output buffers marked as the written arguments, outputs of x's
shape in out_dtype, and no inlining when sizes are symbolic (the pass then emits the op call).
"""

from __future__ import annotations

import inspect
import operator

import pytest
import torch
import torch.fx as fx

pytest.importorskip("triton")

from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from rope_fusion.kernels import triton_launch  # noqa: E402
from rope_fusion.kernels.triton_graph import emit_triton  # noqa: E402

if triton_launch.INTERPRETED:  # TRITON_INTERPRET=1 set for the whole run
    pytest.skip("the kernel module was imported under TRITON_INTERPRET=1: make_fx cannot trace it",
                allow_module_level=True)
from rope_fusion.ops.schema import RotaryCall, RotaryParams  # noqa: E402


def _graph(fm, tensors):
    g = fx.Graph()
    nodes = []
    for name, t in zip("qkcs", tensors):
        n = g.placeholder(name)
        n.meta["val"] = t
        nodes.append(n)
    return g, nodes


@pytest.mark.parametrize("interleaved,rotary_dim,full,conj,hq,hk,dt", [
    (False, 64, False, False, 4, 2, torch.bfloat16),
    (True, 48, True, True, 2, 2, torch.float16),
    (True, 64, False, False, 8, 1, torch.float32),
])
def test_one_user_kernel_node_for_q_and_k(interleaved, rotary_dim, full, conj, hq, hk, dt):
    fm = FakeTensorMode()
    w = rotary_dim if full else rotary_dim // 2
    with fm:
        q = torch.empty(2, 7, hq, 64, dtype=dt)
        k = torch.empty(2, 7, hk, 64, dtype=dt)
        packed = torch.empty(7, 1, 2 * w)
        cos, sin = packed[..., :w], packed[..., w:]  # strided views, as the pass feeds them
    g, nodes = _graph(fm, (q, k, cos, sin))
    params = RotaryParams(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full, conjugate=conj,
                          out_dtype=dt)
    outs = emit_triton(g, fm, RotaryCall(nodes[:2], nodes[2], nodes[3], params), nodes[0])
    hops = [n for n in g.nodes if n.target is triton_kernel_wrapper_functional]
    assert len(hops) == 1
    kw = hops[0].kwargs["kwargs"]
    assert (kw["ROT"], kw["INTERLEAVED"], kw["FULL_TABLES"], kw["CONJ"], kw["NSIDES"]) == (
        rotary_dim, interleaved, full, conj, 2)
    assert kw["q_ptr"] is nodes[0] and kw["k_ptr"] is nodes[1]
    assert kw["cos_ptr"] is nodes[2] and kw["sin_ptr"] is nodes[3]  # the views themselves, not copies
    assert sorted(hops[0].kwargs["tensors_to_clone"]) == ["ko_ptr", "qo_ptr"]
    assert all(kw[name].target is torch.ops.aten.empty.memory_format for name in ("qo_ptr", "ko_ptr"))
    for out, x in zip(outs, (q, k)):
        val = out.meta["val"]
        assert tuple(val.shape) == tuple(x.shape) and val.dtype == dt
    g.output(tuple(outs))
    g.lint()


def _symbolic(fm, t, dims):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if i in dims else DimDynamic.STATIC
                                                  for i in range(t.dim())])
    return fm.from_tensor(t, symbolic_context=ctx, source=ConstantSource(f"t{len(dims)}_{t.dim()}"))


def test_a_symbolic_token_count_becomes_graph_values():
    """vLLM's form: q and k split from one [T, (Hq + Hk) * D] projection, T symbolic, a cos|sin cache read
    by positions. The user-kernel node is emitted with the grid and the token counts as `sym_size` of an
    input (one program per token, nsplit = 1), the outputs allocated with T."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fm = FakeTensorMode(shape_env=ShapeEnv())
    qk = _symbolic(fm, torch.randn(11, 6 * 64, dtype=torch.bfloat16), {0})
    pos = _symbolic(fm, torch.zeros(11, dtype=torch.int64), {0})
    with fm:
        torch._check(pos.shape[0] == qk.shape[0])
        q, k = qk[:, :4 * 64].view(-1, 4, 64), qk[:, 4 * 64:].view(-1, 2, 64)
        cache = torch.empty(100, 64)
        cos, sin = cache[:, :32], cache[:, 32:]
        pos2 = pos.view(-1, 1)
    g = fx.Graph()
    nodes = []
    for name, t in zip(["q", "k", "c", "s", "p"], (q, k, cos, sin, pos2)):
        n = g.placeholder(name)
        n.meta["val"] = t
        nodes.append(n)
    params = RotaryParams(interleaved=False, rotary_dim=64, full_tables=False, conjugate=False,
                          out_dtype=torch.bfloat16)
    outs = emit_triton(g, fm, RotaryCall(nodes[:2], nodes[2], nodes[3], params, positions=nodes[4]), nodes[0])
    assert outs is not None
    hop, = [n for n in g.nodes if n.target is triton_kernel_wrapper_functional]
    grid, = hop.kwargs["grid"]
    kw = hop.kwargs["kwargs"]
    assert isinstance(grid[0], fx.Node) and grid[0].target is torch.ops.aten.sym_size.int and grid[2] == 1
    assert isinstance(kw["tokens_2"], fx.Node) and kw["tokens_1"] == 1 and kw["HAS_POS"]
    # programs per token: the head blocks spread over the grid for few tokens, one program from 1024 on
    split = grid[1].meta["val"].node.expr
    assert kw["nsplit"] is grid[1] and grid[1].target is torch.sym_max
    t = grid[0].meta["val"].node.expr
    assert split.subs(t, 8) > 1 and split.subs(t, 4096) == 1
    for name, x in (("qo_ptr", q), ("ko_ptr", k)):
        buf = kw[name]
        assert buf.target is torch.ops.aten.empty.memory_format and isinstance(buf.args[0][0], fx.Node)
        assert buf.meta["val"].shape == x.shape
    for out, x in zip(outs, (q, k)):
        assert out.meta["val"].shape == x.shape
    g.output(tuple(outs))
    g.lint()


def test_symbolic_batch_and_sequence_are_inlined_and_symbolic_heads_are_not():
    """Two symbolic dims walked as one token index: the grid is their product, as graph values. A symbolic
    head count would change the kernel's compile-time tiling between sizes: the pass emits the op call."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    params = RotaryParams(interleaved=False, rotary_dim=16, full_tables=False, conjugate=False,
                          out_dtype=torch.float32)
    fm = FakeTensorMode(shape_env=ShapeEnv())
    q = _symbolic(fm, torch.randn(2, 5, 2, 16), {0, 1})
    with fm:
        c = torch.empty(q.shape[0], q.shape[1], 1, 8)
    g, nodes = _graph(fm, (q, q, c, c))
    assert emit_triton(g, fm, RotaryCall(nodes[:2], nodes[2], nodes[3], params), nodes[0]) is not None
    hop, = [n for n in g.nodes if n.target is triton_kernel_wrapper_functional]
    tokens = hop.kwargs["grid"][0][0]
    assert tokens.target is operator.mul and len(tokens.meta["val"].node.expr.free_symbols) == 2

    fm = FakeTensorMode(shape_env=ShapeEnv())
    q = _symbolic(fm, torch.randn(2, 5, 3, 16), {2})
    c = fm.from_tensor(torch.randn(5, 1, 8))
    g, nodes = _graph(fm, (q, q, c, c))
    assert emit_triton(g, fm, RotaryCall(nodes[:2], nodes[2], nodes[3], params), nodes[0]) is None


@pytest.mark.parametrize("cdtype,real", [(torch.complex64, torch.float32), (torch.complex128, torch.float64)])
def test_complex_freqs_are_real_tables_for_the_backend_choice(cdtype, real):
    """A complex spelling's tables are the real and imaginary parts of the freqs (view_as_real views), so
    the backend sees float tables: on CUDA the Triton backend takes the site (a complex table dtype made
    every complex site fall back to the Inductor lowering)."""
    import dataclasses

    from torch.fx.experimental.proxy_tensor import make_fx

    from rope_fusion.kernels.triton_rotary import supports
    from rope_fusion.passes import emission
    from rope_fusion.passes.analysis import sites

    def rope(x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    x = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    freqs = torch.polar(torch.ones(16, 1, 32, dtype=torch.float64), torch.rand(16, 1, 32, dtype=torch.float64))
    gm = make_fx(rope, tracing_mode="fake")(x, freqs.to(cdtype))
    matches, _, acc = sites.find_sites(gm.graph)
    assert len(matches) == 1
    em = emission.Emitter(gm.graph)
    m = matches[0]
    with gm.graph.inserting_before(m.node):
        x = emission.x_input(em, acc.interp.nodes, m)
        cos = emission.table_view(em, acc.interp.nodes, m.tables.cos, m.x.blocks, m.node)
        sin = emission.table_view(em, acc.interp.nodes, m.tables.sin, m.x.blocks, m.node)
    spec = emission.site_spec([x], cos, sin, m.params, m)
    assert spec.table_dtype == real
    assert supports(dataclasses.replace(spec, device_type="cuda")) is None


def test_inductor_keeps_the_traced_strides_of_the_kernel_inputs():
    """The launch's strides are constants of the call, so Inductor must hand the kernel inputs with exactly
    the traced strides. Inductor requires exact strides of a user kernel's inputs only where the mutation node
    it lowers carries `eager_input_vals` (otherwise only the stride order): after its own reinplacing and
    decomposition passes, the mutation node must carry the traced fake values of every input."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation
    from torch._inductor.fx_passes.post_grad import decompose_triton_kernel_wrapper_functional
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V

    fm = FakeTensorMode()
    with fm:
        qkv = torch.empty(2, 7, 3, 4, 64, dtype=torch.bfloat16)
        q, k = qkv[:, :, 0], qkv[:, :, 1, :2]  # strided views of a fused projection, not dense tensors
        packed = torch.empty(7, 1, 64)
        cos, sin = packed[..., :32], packed[..., 32:]
    g, nodes = _graph(fm, (q, k, cos, sin))
    params = RotaryParams(interleaved=False, rotary_dim=64, full_tables=False, conjugate=False,
                          out_dtype=torch.bfloat16)
    outs = emit_triton(g, fm, RotaryCall(nodes[:2], nodes[2], nodes[3], params), nodes[0])
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    # torch 2.13 builds the updater from the graph module, torch 2.11 from its graph
    takes_gm = "gm" in inspect.signature(FakeTensorUpdater).parameters
    with V.set_fake_mode(fm):
        reinplace_inplaceable_ops(FakeTensorUpdater(gm if takes_gm else gm.graph), gm.graph)
        decompose_triton_kernel_wrapper_functional(gm.graph)
    muts = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_mutation]
    assert len(muts) == 1
    kw = muts[0].kwargs["kwargs"]
    eager = muts[0].meta["eager_input_vals"][1]["kwargs"]
    assert set(eager) == set(kw)
    for name in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr"):
        assert eager[name].stride() == kw[name].meta["val"].stride()
    assert eager["q_ptr"].stride() == q.stride() and eager["k_ptr"].stride() == k.stride()
    # the strides the kernel was planned for are the ones the eager values pin
    assert (kw["q_stride_t1"], kw["q_stride_t2"], kw["q_stride_head"]) == (q.stride(0), q.stride(1), q.stride(2))


def test_read_only_pointers_take_the_base_of_a_view_that_starts_where_it_starts():
    """The kernel needs only a read-only tensor's data address (its strides are constants of the launch): a
    view that starts at its base's address is passed as the base, so Inductor's wrapper does not re-create
    the view per call; a view at an offset (k after q in one projection, the sin half of vLLM's cache) stays."""
    aten = torch.ops.aten
    fm = FakeTensorMode()
    with fm:
        qk_val = torch.empty(11, 6 * 64, dtype=torch.bfloat16)
        cache_val = torch.empty(100, 64)
        pos_val = torch.zeros(11, dtype=torch.int64)
    g = fx.Graph()
    qk, cache, pos = g.placeholder("qk"), g.placeholder("cache"), g.placeholder("pos")
    qk.meta["val"], cache.meta["val"], pos.meta["val"] = qk_val, cache_val, pos_val

    def call(target, *args):
        n = g.call_function(target, args)
        with fm:
            n.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
        return n

    q = call(aten.view.default, call(aten.slice.Tensor, qk, 1, 0, 256), [11, 4, 64])
    k = call(aten.view.default, call(aten.slice.Tensor, qk, 1, 256, 384), [11, 2, 64])
    cos, sin = call(aten.slice.Tensor, cache, 1, 0, 32), call(aten.slice.Tensor, cache, 1, 32, 64)
    positions = call(aten.view.default, pos, [11, 1])
    params = RotaryParams(interleaved=False, rotary_dim=64, full_tables=False, conjugate=False,
                          out_dtype=torch.bfloat16)
    outs = emit_triton(g, fm, RotaryCall([q, k], cos, sin, params, positions=positions), q)
    hop, = [n for n in g.nodes if n.target is triton_kernel_wrapper_functional]
    kw = hop.kwargs["kwargs"]
    assert kw["q_ptr"] is qk and kw["cos_ptr"] is cache and kw["pos_ptr"] is pos
    assert kw["k_ptr"] is k.args[0] and kw["sin_ptr"] is sin  # views at an offset stop there
    vals = hop.meta["eager_input_vals"][1]["kwargs"]
    assert tuple(vals["q_ptr"].shape) == (11, 384)  # the base's own strides are what Inductor must provide
    g.output(tuple(outs))
    g.lint()
