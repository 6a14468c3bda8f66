"""`rope_fusion.passes.kernel_sites` (flash_attn_sites, vllm_op_sites) on real post-grad graphs built on the CPU.

The graphs are built by tests/helpers/kernel_sites.py (its docstring says how: vLLM's flash-attn Triton kernel
traced on the CPU, a capture backend that runs the post-grad passes and then the graph with the kernel
interpreted); vLLM's CUDA rotary ops are the stand-ins of tests/helpers/vllm_ops.py, with the real schemas.

`cpu_triton_tracing()` (examples/vllm_omni_block.py) patches, for the duration of a compile:
`torch.utils._triton.has_triton` -> True (it is False without a GPU, and Dynamo then inlines `JITFunction.run`,
failing on `triton._C.libtriton.getenv_bool`); `torch.cuda._get_device_index` and (where torch has it) Dynamo's
`CUDADeviceVariable._get_device_index_fn` map None to -1, so the wrapper's `with torch.cuda.device(x.device.index)`
is the no-op its docs promise (a CPU torch build raises `TypeError: '<' not supported between NoneType and int`);
and, when no Triton driver is active, a driver that reports a CUDA sm_90 target, so torch's TTIR analysis of which
arguments the kernel writes runs as on a GPU (`tensors_to_clone=["OUT"]`). Without it torch logs a warning and
assumes every input is mutated (the graph then also has getitem(launch, "X"/"COS"/"SIN") nodes);
`test_fallback_without_ttir_analysis` covers that form. `vllm.vllm_flash_attn.layers.rotary` also needs einops
(not a test dependency), so the tests call `ops.triton.rotary.apply_rotary`, which it wraps.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from torch._higher_order_ops.triton_kernel_wrap import (  # noqa: E402
    kernel_side_table,
    triton_kernel_wrapper_functional,
)

from examples.vllm_omni_block import cpu_triton_tracing  # noqa: E402  (one copy, in the example users run)
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.passes.kernel_sites import flash_attn_sites as fas  # noqa: E402
from rope_fusion.passes.kernel_sites import kernel_scan as kscan  # noqa: E402
from tests.helpers.kernel_sites import (  # noqa: E402
    FA_CASES,
    FA_MODULE,
    Capture,
    GraphRun,
    R,  # noqa: F401  (fixture)
    capture_backend,
    compile_capture,
    fa_inputs,
    interpreted,
    load_as,
    ulps_close,
)
from tests.helpers.vllm_ops import (  # noqa: E402
    C_CASES,
    V_NS,
    c_case_inputs,
    flashinfer_case,
    flashinfer_rotary_embedding,
    vllm_ops,  # noqa: F401  (fixture)
)

# ---------------------------------------------------------------------------------------------------------
# 1-3: flash-attn's kernel, q and k rotated by two launches



def _expected_site_fields(site, dtype, rotary_dim, interleaved, conjugate):
    assert site.kind == "flash_attn.rotary_kernel"
    assert site.layout == "bshd" and site.head_dim == 64 and site.rotary_dim == rotary_dim
    assert site.interleaved is interleaved and site.conjugate is conjugate
    assert site.cu_seqlens is None
    assert site.cos_sin_cache is None and site.positions is None
    assert site.node.target.__name__ == "getitem" and site.node.args[1] == "OUT"
    assert site.node.meta["val"].dtype == dtype


def _check_fa_site_numerics(cap, site, seqlen):
    """rotary_reference on the site's inputs == the kernel's own output (interpreted) in the graph."""
    x = cap.value(site.x)
    cos, sin = cap.value(site.cos), cap.value(site.sin)
    off = cap.const(site.seqlen_offset)
    c, s = fas.flash_attn_tables(cos, sin, seqlen, off)
    ref = rotary_reference(x, c, s, interleaved=site.interleaved, rotary_dim=site.rotary_dim, full_tables=False,
                           conjugate=site.conjugate, out_dtype=site.node.meta["val"].dtype)
    ulps_close(cap.value(site.node), ref)


@pytest.mark.parametrize("case", list(FA_CASES))
def test_flash_attn_q_and_k(R, case):  # noqa: F811
    dtype, rd, inter, conj, offs, inplace = FA_CASES[case]
    q, k, cos, sin = fa_inputs(dtype, rd)
    # tensor offsets: batch 1 reaches past the 16-row table (rows 14..) -> the kernel's cos=1, sin=0 rows
    off = torch.tensor([2, 14], dtype=torch.int32) if offs == "tensor" else offs

    def f(q, k, cos, sin, off):
        kw = dict(seqlen_offsets=off, interleaved=inter, conjugate=conj, inplace=inplace)
        return R.apply_rotary(q, cos, sin, **kw) * 1, R.apply_rotary(k, cos, sin, **kw) * 1

    args = (q.clone(), k.clone(), cos, sin, off)
    out, cap = compile_capture(f, *args)
    assert cap.misses == []
    assert len(cap.sites) == 2, cap.graph_text
    sq, sk = cap.sites
    for site in cap.sites:
        _expected_site_fields(site, dtype, rd, inter, conj)
        _check_fa_site_numerics(cap, site, seqlen=8)
    assert sq.node.args[0] is not sk.node.args[0]  # one launch each
    assert tuple(sq.x.meta["val"].shape) == tuple(q.shape) and tuple(sk.x.meta["val"].shape) == tuple(k.shape)
    assert sq.cos is sk.cos and sq.sin is sk.sin
    if offs == "tensor":
        assert isinstance(sq.seqlen_offset, torch.fx.Node) and sq.seqlen_offset.op == "placeholder"
    else:
        assert sq.seqlen_offset == offs
    if inplace:  # OUT is X itself
        assert sq.node.args[0].kwargs["kwargs"]["OUT"] is sq.x
    elif rd < 64:  # the wrapper's tail copy became a slice_scatter
        assert sq.node.args[0].kwargs["kwargs"]["OUT"].target is torch.ops.aten.slice_scatter.default
    # the compiled function (the graph the pass saw, kernel interpreted) == eager with the interpreted kernel
    with cpu_triton_tracing(), interpreted(R):
        eager = f(q.clone(), k.clone(), cos, sin, off)
    for a, e in zip(out, eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@contextlib.contextmanager
def _as_module(path: str, name: str):
    """The file imported as module `name` (with empty parent packages), removed again afterwards: Dynamo looks
    the kernel's module up in sys.modules."""
    parts = name.split(".")
    added = []
    try:
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg not in sys.modules:
                m = types.ModuleType(pkg)
                m.__path__ = []
                sys.modules[pkg] = m
                added.append(pkg)
        mod = load_as(path, name)
        sys.modules[name] = mod
        added.append(name)
        yield mod
    finally:
        for n in reversed(added):
            sys.modules.pop(n, None)


@contextlib.contextmanager
def _flash_attn_from(path: str):
    """The kernel file as `flash_attn.ops.triton.rotary`, any real flash_attn modules set aside meanwhile."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "flash_attn" or k.startswith("flash_attn.")}
    try:
        with _as_module(path, "flash_attn.ops.triton.rotary") as fa:
            yield fa
    finally:
        sys.modules.update(saved)


def test_flash_attn_module_name(R):  # noqa: F811
    """The same kernel code under flash-attn's module name (as upstream flash-attn 2.7.x ships it)."""
    with _flash_attn_from(R.__file__) as fa:
        _flash_attn_module_name(fa)


def _flash_attn_module_name(fa):
    q, k, cos, sin = fa_inputs(torch.float32, 32)

    def f(q, k, cos, sin):
        return fa.apply_rotary(q, cos, sin), fa.apply_rotary(k, cos, sin)

    _, cap = compile_capture(f, q, k, cos, sin)
    assert [s.kind for s in cap.sites] == ["flash_attn.rotary_kernel"] * 2 and cap.misses == []
    for site in cap.sites:
        _check_fa_site_numerics(cap, site, seqlen=8)


def test_fallback_without_ttir_analysis(R):  # noqa: F811
    """No driver at all: torch assumes every input is mutated; later launches read getitem(launch, "COS")."""
    q, k, cos, sin = fa_inputs(torch.float32, 32)

    def f(q, k, cos, sin):
        return R.apply_rotary(q, cos, sin), R.apply_rotary(k, cos, sin)

    _, cap = compile_capture(f, q, k, cos, sin, ttir=False)
    assert "tensors_to_clone: [OUT, X, COS, SIN]" in cap.graph_text
    assert len(cap.sites) == 2 and cap.misses == []
    assert cap.sites[1].cos is cap.sites[0].cos and cap.sites[1].cos.op == "placeholder"  # seen through
    for site in cap.sites:
        _check_fa_site_numerics(cap, site, seqlen=8)


def _upstream_files() -> list:
    """Upstream flash-attn kernel files: ROPE_FUSION_FLASH_ATTN_ROTARY (paths joined by os.pathsep), or the
    installed flash_attn's (located without importing flash_attn, whose __init__ needs its CUDA extension)."""
    paths = [p for p in os.environ.get("ROPE_FUSION_FLASH_ATTN_ROTARY", "").split(os.pathsep) if p]
    spec = importlib.util.find_spec("flash_attn")
    if not paths and spec is not None and spec.submodule_search_locations:
        paths = [os.path.join(spec.submodule_search_locations[0], "ops", "triton", "rotary.py")]
    return paths


@pytest.mark.parametrize("path", _upstream_files() or [None])
def test_upstream_flash_attn_file(R, path):  # noqa: F811
    """Any upstream flash-attn version: the v1 signature (program ids m, batch, head until April 2025; m, head,
    batch after, as in vLLM's copy) or the v2 one (flash-attn 2.8: nheads, ROTARY_DIM, BLOCK_H, wrap_triton)."""
    if path is None:
        pytest.skip("no flash-attn kernel file (install flash-attn, or set ROPE_FUSION_FLASH_ATTN_ROTARY)")
    with _flash_attn_from(path) as fa:
        _upstream(fa)


def _upstream(fa):
    q, k, cos, sin = fa_inputs(torch.bfloat16, 48)

    def f(q, k, cos, sin, off):
        return (fa.apply_rotary(q, cos, sin, seqlen_offsets=off, interleaved=True),
                fa.apply_rotary(k, cos, sin, seqlen_offsets=off, conjugate=True))

    _, cap = compile_capture(f, q, k, cos, sin, torch.tensor([0, 9]))
    assert len(cap.sites) == 2 and cap.misses == [], cap.misses
    for site, inter, conj in zip(cap.sites, (True, False), (False, True)):
        _expected_site_fields(site, torch.bfloat16, 48, inter, conj)
        _check_fa_site_numerics(cap, site, seqlen=8)


def test_dynamic_token_count(R):  # noqa: F811
    """vLLM marks the token count dynamic: seqlen, seqlen_ro, grid and strides are symbolic in the launch."""
    q, k, cos, sin = fa_inputs(torch.float32, 32, s=16)
    for t in (q, k):
        torch._dynamo.mark_dynamic(t, 1)
    for t in (cos, sin):
        torch._dynamo.mark_dynamic(t, 0)

    def f(q, k, cos, sin):
        return R.apply_rotary(q, cos, sin), R.apply_rotary(k, cos, sin, interleaved=True)

    _, cap = compile_capture(f, q, k, cos, sin)
    assert "sym_size" in cap.graph_text or "floordiv" in cap.graph_text  # really symbolic
    assert [(s.rotary_dim, s.interleaved) for s in cap.sites] == [(32, False), (32, True)] and cap.misses == []
    for site in cap.sites:
        _check_fa_site_numerics(cap, site, seqlen=16)


def _vllm_layers_rotary(R):  # noqa: F811
    """vllm.vllm_flash_attn.layers.rotary (what ApplyRotaryEmb.forward_cuda and vllm-omni call). It imports einops
    for its pure-torch reference functions only; when einops is absent an empty stand-in lets it import."""
    name = "vllm.vllm_flash_attn.layers.rotary"
    if name in sys.modules:
        return sys.modules[name]
    stub = importlib.util.find_spec("einops") is None
    if stub:
        einops = types.ModuleType("einops")
        einops.rearrange = einops.repeat = None
        sys.modules["einops"] = einops
    try:
        return importlib.import_module(name)
    finally:
        if stub:
            sys.modules.pop("einops", None)


def test_apply_rotary_emb_as_vllm_custom_op_calls_it(R):  # noqa: F811
    """vLLM's ApplyRotaryEmb.forward_cuda (model_executor/layers/rotary_embedding/common.py; the class itself needs
    more of vLLM than is installed): x [S, H, D] -> unsqueeze(0), fp32 compute, apply_rotary_emb through the
    ApplyRotaryEmb autograd.Function, squeeze, cast back."""
    layers = _vllm_layers_rotary(R)
    q, k, cos, sin = (t[0] for t in fa_inputs(torch.bfloat16, 64, b=1))
    cos, sin = fa_inputs(torch.float32, 64)[2:]

    def forward_cuda(x, cos, sin, is_neox_style=False, enable_fp32_compute=True):
        x = x.unsqueeze(0)
        dt = x.dtype
        if enable_fp32_compute:
            x, cos, sin = x.float(), cos.float(), sin.float()
        out = layers.apply_rotary_emb(x, cos, sin, not is_neox_style)
        return out.squeeze(0).to(dt)

    def f(q, k, cos, sin):
        return forward_cuda(q, cos, sin), forward_cuda(k, cos, sin)

    _, cap = compile_capture(f, q, k, cos[:8], sin[:8])
    assert len(cap.sites) == 2 and cap.misses == []
    for site in cap.sites:
        _expected_site_fields(site, torch.float32, 64, True, False)
        assert site.x.meta["val"].dtype == torch.float32 and site.x.meta["val"].shape[0] == 1
        _check_fa_site_numerics(cap, site, seqlen=8)


# ---------------------------------------------------------------------------------------------------------
# 2: what is not expressible is reported, with its reason


def test_fp64_is_reported_and_varlen_is_a_site(R):  # noqa: F811
    """An fp64 launch is reported; a varlen one is a site of the op's packed form (tests/ops/test_packed_sequences.py
    checks what it fuses into)."""
    x = torch.randn(12, 4, 64)
    cos, sin = (torch.rand(16, 16) * 3).cos(), (torch.rand(16, 16) * 3).sin()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q64, _, c64, s64 = fa_inputs(torch.float64, 32)

    def f(x, cos, sin, cu, q64, c64, s64):
        return R.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=7), R.apply_rotary(q64, c64, s64)

    _, cap = compile_capture(f, x, cos, sin, cu, q64, c64, s64)
    (site,) = cap.sites
    assert site.layout == "thd" and site.cu_seqlens.op == "placeholder"
    reasons = [r for _, r in cap.misses]
    assert len(reasons) == 1 and "float64" in reasons[0]


@pytest.fixture(scope="module")
def fa_graph(R):  # noqa: F811
    """One captured graph (partial rotary, tail copy), for surgery."""
    q, k, cos, sin = fa_inputs(torch.float32, 32)

    def f(q, k, cos, sin):
        return R.apply_rotary(q, cos, sin, seqlen_offsets=2), R.apply_rotary(k, cos, sin, seqlen_offsets=2)

    _, cap = compile_capture(f, q, k, cos, sin)
    assert len(cap.sites) == 2
    return cap.gm


def _copy_with_launch(gm):
    g = torch.fx.Graph()
    vm: dict = {}
    g.output(g.graph_copy(gm.graph, vm))
    launch = next(n for n in g.nodes if n.target is triton_kernel_wrapper_functional)
    return g, launch


def _with_consts(launch, **changes):
    consts = dict(kernel_side_table.get_constant_args(launch.kwargs["constant_args_idx"]))
    consts.update(changes)
    launch.update_kwarg("constant_args_idx", kernel_side_table.add_constant_args(consts))


@pytest.mark.parametrize("surgery, reason", [
    (lambda g, n: n.update_arg(3, 34), "lanes >= rotary_dim"),               # tail copied from lane 34
    (lambda g, n: _with_consts(n, stride_x_seqlen=128), "stride_x_seqlen"),
    (lambda g, n: _with_consts(n, seqlen=4), "seqlen=4"),
    (lambda g, n: _with_consts(n, SEQLEN_OFFSETS=9), "reaches past seqlen_ro"),      # 9 + 8 > 16 rows
    (lambda g, n: _with_consts(n, seqlen_ro=12), "seqlen_ro=12"),
    (lambda g, n: _with_consts(n, BLOCK_K=16), "BLOCK_K=16"),
    (lambda g, n: n.update_kwarg("grid", [(1, 3, 2)]), "grid"),                        # one head short
    (lambda g, n: n.update_kwarg("grid", [(2, 4, 2), (4, 4, 2)]), "grid"),            # autotuned
], ids=["tail", "stride", "seqlen", "offset", "seqlen_ro", "block_k", "grid", "grids"])
def test_graph_surgery_is_reported(fa_graph, surgery, reason):
    g, launch = _copy_with_launch(fa_graph)
    if reason == "lanes >= rotary_dim":
        launch = launch.kwargs["kwargs"]["OUT"]  # the slice_scatter
    surgery(g, launch)
    sites, misses = kscan.find_kernel_sites(g)
    assert len(sites) == 1 and len(misses) == 1, (sites, misses)
    assert reason in misses[0][1], misses[0][1]


def test_mutation_form_is_reported(R):  # noqa: F811
    """Dynamo's own graph (before functionalization) holds triton_kernel_wrapper_mutation."""
    q, k, cos, sin = fa_inputs(torch.float32, 64)
    seen = []

    def backend(gm, example_inputs):
        seen.append(kscan.find_kernel_sites(gm.graph))
        return lambda *args: GraphRun(gm).run(*args)  # the mutation launch, interpreted

    torch._dynamo.reset()
    with cpu_triton_tracing():
        torch.compile(lambda q, cos, sin: R.apply_rotary(q, cos, sin), backend=backend, fullgraph=True)(q, cos, sin)
    (sites, misses), = seen
    assert sites == [] and len(misses) == 1 and "triton_kernel_wrapper_mutation" in misses[0][1]


# ---------------------------------------------------------------------------------------------------------
# 5: near misses: rotary-looking kernels that are not flash-attn's


@triton.jit
def rotary_kernel(OUT, X, N, BLOCK: tl.constexpr):  # same name, this test module
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + i, tl.load(X + i, mask=i < N), mask=i < N)


def _exec_as(src: str, module: str, tag: str) -> dict:
    """Execute kernel source as if it were module `module` (inspect.getsource finds it through linecache)."""
    import linecache

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"<kernel_sites {tag}>")
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    ns: dict = {"__name__": module}
    exec(compile(src, path, "exec"), ns)
    return ns


SPOOFED = """
import triton
import triton.language as tl


@triton.jit
def rotary_kernel(OUT, X, N, BLOCK: tl.constexpr):  # flash-attn's name and module, another signature
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + i, tl.load(X + i, mask=i < N) * 2, mask=i < N)
"""


def test_near_miss_kernels_are_not_sites(R):  # noqa: F811
    # vLLM's own file under its module name, one sign of the kernel flipped: same signature, other math
    src = open(R.__file__).read()
    assert src.count("o1 = x0 * sin + x1 * cos") == 1
    ns = _exec_as(src.replace("o1 = x0 * sin + x1 * cos", "o1 = x1 * cos - x0 * sin"), FA_MODULE, "tampered")
    spoofed_rotary_kernel = _exec_as(SPOOFED, FA_MODULE, "spoofed")["rotary_kernel"]

    x = torch.randn(100)
    q, _, cos, sin = fa_inputs(torch.float32, 32)

    def f(x, q, cos, sin):
        o1, o2 = torch.empty_like(x), torch.empty_like(x)
        rotary_kernel[(4,)](o1, x, 100, BLOCK=32)
        spoofed_rotary_kernel[(4,)](o2, x, 100, BLOCK=32)
        return o1, o2, ns["apply_rotary"](q, cos, sin)

    out, cap = compile_capture(f, x, q, cos, sin)
    assert cap.sites == []
    reasons = [r for _, r in cap.misses]
    assert len(reasons) == 3, reasons
    assert "test_kernel_sites.rotary_kernel is not a known rotary kernel" in reasons[0]
    assert "unknown signature" in reasons[1]
    assert "source differs" in reasons[2] and "o1=x0*sin+x1*cos" in reasons[2]
    torch.testing.assert_close(out[0], x)
    torch.testing.assert_close(out[1], 2 * x)


# ---------------------------------------------------------------------------------------------------------
# 4: vLLM's in-place ops, through stand-ins with the real schemas


def _native(positions, query, key, head_size, rotary_dim, cache, is_neox):
    """vLLM's RotaryEmbedding.forward_static (model_executor/layers/rotary_embedding/base.py) as written there:
    index_select + chunk, ApplyRotaryEmb.forward_static's x1*cos - x2*sin / x2*cos + x1*sin on [..., :rotary_dim],
    pass-through concatenated, reshaped back."""
    def one(x):
        shape = x.shape
        x = x.reshape(n, -1, head_size)
        rot, pas = x[..., :rotary_dim], x[..., rotary_dim:]
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(rot, 2, dim=-1) if is_neox else (rot[..., ::2], rot[..., 1::2])
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        rot = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        return torch.cat((rot, pas), -1).reshape(shape)

    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    return one(query), (one(key) if key is not None else None)


def _check_vllm_site_numerics(cap, site):
    x, cache, pos = cap.value(site.x), cap.value(site.cos_sin_cache), cap.value(site.positions)
    r = site.rotary_dim
    cs = cache[pos.long()]  # [T, R] or [B, S, R]
    cos, sin = cs[..., None, : r // 2], cs[..., None, r // 2:]
    if site.layout in ("t(hd)", "bs(hd)"):
        xh = x.reshape(*x.shape[:-1], -1, site.head_dim)
    else:
        xh = x
    ref = rotary_reference(xh, cos, sin, interleaved=site.interleaved, rotary_dim=r, full_tables=False,
                           conjugate=site.conjugate, out_dtype=x.dtype).reshape(x.shape)
    ulps_close(cap.value(site.node), ref)


def test_other_rotary_ops_are_reported(vllm_ops):  # noqa: F811
    """A rotary op that is not one of the recognised ones (here vLLM's XPU op's schema) is a miss, not a site."""
    from torch.fx.experimental.proxy_tensor import make_fx

    lib = torch.library.Library(V_NS, "FRAGMENT")
    lib.define("xpu_apply_rotary_emb(Tensor x, Tensor cos, Tensor sin, bool is_neox) -> Tensor")
    lib.impl("xpu_apply_rotary_emb", lambda x, c, s, n: x.clone(), "CompositeExplicitAutograd")
    op = getattr(torch.ops, V_NS).xpu_apply_rotary_emb
    gm = make_fx(lambda x, c, s: op(x, c, s, True))(torch.randn(2, 4, 8), torch.randn(2, 4), torch.randn(2, 4))
    sites, misses = kscan.find_kernel_sites(gm.graph)
    assert sites == [] and len(misses) == 1 and "is not a recognised rotary op" in misses[0][1]
    lib._destroy()


def test_c_stand_in_matches_forward_native(vllm_ops):  # noqa: F811
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 40, (7,), generator=g)
    cache = torch.randn(40, 48, generator=g)
    for is_neox in (True, False):
        q, k = torch.randn(7, 4 * 64, generator=g), torch.randn(7, 2, 64, generator=g)
        eq, ek = _native(pos, q, k, 64, 48, cache, is_neox)
        c_op(pos, q, k, 64, cache, is_neox)
        torch.testing.assert_close(q, eq)
        torch.testing.assert_close(k, ek)



@pytest.mark.parametrize("case", list(C_CASES))
def test_vllm_c_rotary_embedding(vllm_ops, case):  # noqa: F811
    c_op, _ = vllm_ops
    v2, qs, kshape, dtype, rd, is_neox, inverse = C_CASES[case]
    pos, q, k, cache = c_case_inputs(case)

    def f(pos, q, k, cache):
        c_op(pos, q, k, 64, cache, is_neox, 0, inverse)
        return (q + 0, k + 0) if k is not None else (q + 0,)

    _, cap = compile_capture(f, pos, q.clone(), None if k is None else k.clone(), cache, v2=v2)
    assert cap.misses == []
    assert len(cap.sites) == (2 if kshape else 1)
    layout = "t(hd)" if len(qs) == 2 else "thd"
    for site in cap.sites:
        assert (site.kind, site.layout, site.head_dim, site.rotary_dim) == ("vllm._C.rotary_embedding", layout, 64, rd)
        assert site.interleaved is (not is_neox) and site.conjugate is inverse
        assert site.cos is None and site.cos_sin_cache.op == "placeholder" and site.positions.op == "placeholder"
        assert site.seqlen_offset == 0 and site.tables == cap.sites[0].tables  # q and k read the same rows
        _check_vllm_site_numerics(cap, site)


def test_vllm_c_dynamic_token_count(vllm_ops):  # noqa: F811
    """vLLM marks num_tokens dynamic; positions and query may carry different symbols (the op checks equality)."""
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(32, 32, generator=g)
    args = (torch.randint(0, 32, (7,), generator=g), torch.randn(7, 4 * 64, generator=g),
            torch.randn(7, 2, 64, generator=g))
    for t in args:
        torch._dynamo.mark_dynamic(t, 0)

    def f(pos, q, k, cache):
        c_op(pos, q, k, 64, cache, True)
        return q + 0, k + 0

    _, cap = compile_capture(f, *args, cache, v2=False)
    assert [(s.layout, s.rotary_dim) for s in cap.sites] == [("t(hd)", 32), ("thd", 32)] and cap.misses == []
    assert not isinstance(cap.sites[0].x.meta["val"].shape[0], int)
    for site in cap.sites:
        _check_vllm_site_numerics(cap, site)


def test_vllm_qkv_split(vllm_ops):  # noqa: F811
    """vLLM's own pattern: q, k = qkv.split(...); v1 gives each rotated half a node, v2 does not."""
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(3)
    pos, cache = torch.randint(0, 32, (5,), generator=g), torch.randn(32, 64, generator=g)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=g)

    def f(pos, qkv, cache):
        q, k, v = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
        c_op(pos, q, k, 64, cache, True)
        return q * 1, k * 1, v * 1

    _, cap = compile_capture(f, pos, qkv.clone(), cache, v2=False)
    assert len(cap.sites) == 2 and cap.misses == []
    for site in cap.sites:
        assert site.layout == "t(hd)" and site.x.target.__name__ == "getitem"  # split outputs (strided views)
        _check_vllm_site_numerics(cap, site)
    _, cap = compile_capture(f, pos, qkv.clone(), cache, v2=True)
    assert cap.sites == [] and len(cap.misses) == 1
    assert "slice of a larger tensor" in cap.misses[0][1]


def test_vllm_batched_positions_and_v2_reshape(vllm_ops):  # noqa: F811
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(32, 64, generator=g)
    pos2 = torch.randint(0, 32, (2, 3), generator=g)
    q, k = torch.randn(2, 3, 4 * 64, generator=g), torch.randn(2, 3, 2, 64, generator=g)

    def f(pos, q, k, cache):
        c_op(pos, q, k, 64, cache, True)
        return q + 0, k + 0

    _, cap = compile_capture(f, pos2, q.clone(), k.clone(), cache, v2=False)
    assert [s.layout for s in cap.sites] == ["bs(hd)", "bshd"] and cap.misses == []
    for site in cap.sites:
        _check_vllm_site_numerics(cap, site)

    pos1 = torch.randint(0, 32, (5,), generator=g)
    q, k = torch.randn(5, 4 * 64, generator=g), torch.randn(5, 2 * 64, generator=g)

    def h(pos, q, k, cache):  # a 3-D view of a flat query: v2 rebuilds it with as_strided
        q3 = q.view(q.shape[0], -1, 64)
        c_op(pos, q3, k, 64, cache, True)
        return q3 + 0, k + 0

    _, cap = compile_capture(h, pos1, q.clone(), k.clone(), cache, v2=True)
    assert [s.layout for s in cap.sites] == ["t(hd)", "t(hd)"] and cap.misses == []
    assert cap.sites[0].x.op == "placeholder"  # the base
    for site in cap.sites:
        _check_vllm_site_numerics(cap, site)


def test_vllm_c_not_expressible(vllm_ops):  # noqa: F811
    c_op, _ = vllm_ops
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(32, 32, generator=g)
    q, k = torch.randn(5, 4 * 64, generator=g), torch.randn(5, 2 * 64, generator=g)
    pos = torch.randint(0, 32, (5,), generator=g)
    q80, k96 = torch.randn(5, 4, 80, generator=g), torch.randn(5, 2, 96, generator=g)

    def f(pos, q, k, cache, q80, k96):
        c_op(pos.int(), q, k, 64, cache, True)          # int32 positions
        q3, k3 = q80[..., :64], k96[..., :64]           # heads 80 and 96 lanes apart: the op addresses
        c_op(pos, q3, k3, 64, cache, True)              # key's heads with QUERY's head stride
        return q + 0, k + 0, q3 + 0, k3 + 0

    _, cap = compile_capture(f, pos, q.clone(), k.clone(), cache, q80.clone(), k96.clone(), v2=False)
    assert cap.sites == []
    reasons = [r for _, r in cap.misses]
    assert len(reasons) == 2, reasons
    assert "int32" in reasons[0]
    assert "head stride" in reasons[1]



def test_vllm_flashinfer_op(vllm_ops):  # noqa: F811
    _, fi_op = vllm_ops
    f, pos, q, k, cache, g = flashinfer_case(fi_op)
    _, cap = compile_capture(f, pos, q.clone(), k.clone(), cache, v2=False)
    assert cap.misses == []
    assert [(s.kind, s.layout, s.rotary_dim, s.interleaved) for s in cap.sites] == [
        ("vllm.flashinfer_rotary_embedding", "t(hd)", 32, True), ("vllm.flashinfer_rotary_embedding", "thd", 32, True)]
    for site in cap.sites:
        _check_vllm_site_numerics(cap, site)
    # forward_native's formula agrees with the stand-in (fp32 inputs, so that both are exact to fp32)
    qf, kf = torch.randn(6, 4 * 64, generator=g), torch.randn(6, 2 * 64, generator=g)
    eq, ek = _native(pos.long(), qf, kf, 64, 32, cache, False)
    flashinfer_rotary_embedding(pos, qf, kf, 64, cache, False)
    torch.testing.assert_close(qf, eq)
    torch.testing.assert_close(kf, ek)

    def bad(pos, q, k, cache):  # a bf16 cache: flashinfer raises, so nothing to claim
        fi_op(pos, q, k, 64, cache.bfloat16(), False)
        return q + 0, k + 0

    torch._dynamo.reset()
    cap = Capture()
    with torch._inductor.config.patch(enable_auto_functionalized_v2=False), \
            pytest.raises(ValueError, match="should be float32"):
        torch.compile(bad, fullgraph=True, backend=capture_backend(cap))(pos, q.clone(), k.clone(), cache)
    assert cap.sites == [] and "flashinfer requires float32" in cap.misses[0][1]
