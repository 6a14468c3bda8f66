"""`rope_fusion.passes.kernel_sites` (flash_attn_sites, vllm_op_sites) on real post-grad graphs built on the CPU.

How the real flash-attn Triton kernel gets into a CPU post-grad graph (no GPU, CPU torch, triton installed):
- vLLM's kernel module `vllm.vllm_flash_attn.ops.triton.rotary` comes from the installed wheel, unmodified. Its
  package `vllm.vllm_flash_attn` raises ImportError without the CUDA flash-attention extensions, so an empty
  package object with the real `__path__` stands in for that one `__init__` (`_vllm_rotary_module`); the kernel's
  module name stays `vllm.vllm_flash_attn.ops.triton.rotary`. `vllm.vllm_flash_attn.layers.rotary` also needs
  einops (not a test dependency), so the tests call `ops.triton.rotary.apply_rotary`, which it wraps.
- The module is imported WITHOUT TRITON_INTERPRET: under it `triton.jit` returns an InterpretedFunction, which
  Dynamo does not know as a Triton kernel (it inlines its Python and fails on `data_ptr`).
- `cpu_triton_tracing()` (examples/vllm_omni_block.py) patches, for the duration of a compile:
  `torch.utils._triton.has_triton` -> True (it is False without a GPU, and Dynamo then inlines
  `JITFunction.run`, failing on `triton._C.libtriton.getenv_bool`);
  `torch.cuda._get_device_index` and (where torch has it) Dynamo's `CUDADeviceVariable._get_device_index_fn`
  map None to -1, so the wrapper's `with torch.cuda.device(x.device.index)` is the no-op its docs promise (a CPU
  torch build raises `TypeError: '<' not supported between NoneType and int`); and, when no Triton driver is
  active, a driver that
  reports a CUDA sm_90 target, so torch's TTIR analysis of which arguments the kernel writes runs as on a GPU
  (`tensors_to_clone=["OUT"]`). Without it torch logs a warning and assumes every input is mutated (the graph
  then also has getitem(launch, "X"/"COS"/"SIN") nodes); `test_fallback_without_ttir_analysis` covers that form.
- Full Inductor would then have to generate code for a user Triton kernel on the CPU; instead, as in
  tests/zoo/harness.py, the backend is Inductor's `compile_fx` with an `inner_compile` that runs the post-grad
  passes (where `post_grad_custom_post_pass` sees exactly what the rope_fusion pass sees) and then runs a copy of
  that graph with an fx Interpreter that launches each Triton kernel as `InterpretedFunction(jit.fn)`, which is
  what `triton.jit` builds under TRITON_INTERPRET=1. So the compiled function runs, on the CPU, the graph the pass
  saw, with the kernel's own code; every node's value is kept for the numerics checks.
vLLM's `_C.rotary_embedding` (a CUDA extension) and the flashinfer op are registered as stand-ins with the same
schemas in test namespaces; `vllm_op_sites.VLLM_C_NAMESPACE` / `VLLM_NAMESPACE` point the recogniser at them.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    triton_kernel_wrapper_mutation,
)
from torch._prims_common import clone_preserve_strides  # noqa: E402
from triton_interpreted import interpreted as interpreted_kernel  # noqa: E402

from examples.vllm_omni_block import cpu_triton_tracing  # noqa: E402  (one copy, in the example users run)
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.passes.kernel_sites import flash_attn_sites as fas  # noqa: E402
from rope_fusion.passes.kernel_sites import kernel_scan as kscan  # noqa: E402
from rope_fusion.passes.kernel_sites import vllm_op_sites as vos  # noqa: E402

FA_MODULE = "vllm.vllm_flash_attn.ops.triton.rotary"


# ---------------------------------------------------------------------------------------------------------
# the real kernel module, and tracing it on the CPU


def _vllm_rotary_module():
    try:
        import vllm  # noqa: F401
    except Exception as e:
        pytest.skip(f"vllm is not installed: {type(e).__name__}: {e}")
    pkg = "vllm.vllm_flash_attn"
    if pkg not in sys.modules:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("vllm.vllm_flash_attn is not in the installed vllm")
        stub = types.ModuleType(pkg)
        stub.__path__ = list(spec.submodule_search_locations)
        stub.__spec__ = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
        stub.__spec__.submodule_search_locations = stub.__path__
        sys.modules[pkg] = stub
    mod = importlib.import_module(FA_MODULE)
    if not isinstance(mod.rotary_kernel, triton.runtime.jit.JITFunction):
        pytest.skip(f"{FA_MODULE} was imported under TRITON_INTERPRET=1 (its kernel is not a JITFunction)")
    return mod


def _load_as(path: str, name: str):
    """Execute a kernel file under another module name, without registering it in sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def R():
    return _vllm_rotary_module()


@contextlib.contextmanager
def interpreted(mod):
    """The module's kernel as TRITON_INTERPRET=1 builds it, for eager calls of its wrapper."""
    jit = mod.rotary_kernel
    mod.rotary_kernel = _interp(jit)
    try:
        yield
    finally:
        mod.rotary_kernel = jit


def _interp(jit):
    return interpreted_kernel(jit)  # with its @triton.jit helpers interpreted too (rope_fusion's kernel has some)


# ---------------------------------------------------------------------------------------------------------
# the backend: Inductor's front half + post-grad passes, then the pass-visible graph run by an fx Interpreter


def _launch(hop_kwargs: dict, kw: dict) -> None:
    jit = fas.unwrap_jit(kernel_side_table.get_kernel(hop_kwargs["kernel_idx"]))
    consts = kernel_side_table.get_constant_args(hop_kwargs["constant_args_idx"])
    every = {**consts, **kw}
    (grid,) = hop_kwargs["grid"]
    _interp(jit)[tuple(int(g) for g in grid)](*[every[n] for n in jit.arg_names])


class _Run(torch.fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, n):
        v = super().run_node(n)
        self.values[n] = v.clone() if isinstance(v, torch.Tensor) else v  # inputs get copy_'d into at the end
        return v

    def call_function(self, target, args, kwargs):
        if target is triton_kernel_wrapper_functional:
            kw = dict(kwargs["kwargs"])
            for k in kwargs["tensors_to_clone"]:
                kw[k] = clone_preserve_strides(kw[k])
            _launch(kwargs, kw)
            return {k: kw[k] for k in kwargs["tensors_to_clone"]}
        if target is triton_kernel_wrapper_mutation:
            _launch(kwargs, dict(kwargs["kwargs"]))
            return None
        return super().call_function(target, args, kwargs)


def _seen(site, nodes: dict, vm: dict) -> types.SimpleNamespace:
    """A site as these tests read it: the kernel's options, x, result and table inputs as nodes of the copied
    graph, and the layout of x the kernel addresses (bshd, thd; t(hd), bs(hd) when its heads are flattened)."""
    t = site.tables
    rec = dict(kind=site.origin, node=site.node, x=nodes[site.x.name], head_dim=site.x.head_dim, tables=t,
               rotary_dim=site.params.rotary_dim, interleaved=site.params.interleaved,
               conjugate=site.params.conjugate, cos=None, sin=None, seqlen_offset=0, cu_seqlens=None,
               cos_sin_cache=None, positions=None)
    rec.update({"cos_sin_cache" if f.name == "cache" else f.name: getattr(t, f.name) for f in dataclasses.fields(t)
                if f.name not in ("kind", "rows")})
    rec = {k: vm[v] if isinstance(v, torch.fx.Node) else v for k, v in rec.items()}
    if rec["positions"] is None:
        rec["layout"] = "bshd" if rec["cu_seqlens"] is None else "thd"
    else:
        lead = "t" if rec["positions"].meta["val"].dim() == 1 else "bs"
        rec["layout"] = lead + ("(hd)" if site.x.blocks else "hd")
    return types.SimpleNamespace(**rec)


class Capture:
    """What the post-grad custom pass saw: the sites and misses, and (after a call) every node's value."""

    def __init__(self):
        self.sites, self.misses, self.graph_text = [], [], ""
        self.gm = None
        self.values: dict = {}

    def __call__(self, graph: torch.fx.Graph) -> None:  # the post-grad custom pass
        sites, misses = kscan.find_kernel_sites(graph)
        self.graph_text = str(graph)
        # later post-grad passes rewrite this graph (the functional launches become mutations): keep a copy, and
        # point the sites at the copy's nodes
        vm: dict = {}
        g = torch.fx.Graph()
        g.output(g.graph_copy(graph, vm))
        self.gm = torch.fx.GraphModule(graph.owning_module, g)
        nodes = {n.name: n for n in graph.nodes}
        self.sites = [_seen(s, nodes, vm) for s in sites]
        self.misses = [(vm[n], r) for n, r in misses]

    def uuid(self):
        return None

    def value(self, node):
        return self.values[node]

    def const(self, a):
        return self.value(a) if isinstance(a, torch.fx.Node) else a


def capture_backend(cap: Capture):
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import compile_fx as cfx
    from torch._inductor.virtualized import V

    def inner_compile(gm, example_inputs, **kwargs):
        cfx.view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = cfx.fake_tensor_prop(gm, example_inputs)
        with V.set_fake_mode(fake_mode):
            cfx._recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))

        def run(*args):
            r = _Run(cap.gm)
            out = r.run(*args)
            cap.values = r.values
            return out
        return make_boxed_func(run)

    def backend(gm, example_inputs):
        return cfx.compile_fx(gm, example_inputs, inner_compile=inner_compile,
                              config_patches={"post_grad_custom_post_pass": cap, "fx_graph_cache": False,
                                              "fx_graph_remote_cache": False})
    return backend


def compile_capture(fn, *args, ttir: bool = True, v2: bool = True):
    """Compile `fn` through the capture backend and run it once: (outputs, Capture)."""
    import torch._functorch.config as fconfig

    torch._dynamo.reset()
    cap = Capture()
    with cpu_triton_tracing(ttir), torch._inductor.config.patch(enable_auto_functionalized_v2=v2), \
            fconfig.patch(enable_autograd_cache=False), torch.no_grad():
        out = torch.compile(fn, fullgraph=True, dynamic=False, backend=capture_backend(cap))(*args)
    return out, cap


def _ulps_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one ulp of the dtype, elementwise. (fp32 results come out bit-identical here; in bf16 Triton 3.9's
    interpreter rounds fp32 -> bf16 toward zero where torch, and GPUs, round to nearest: one ulp apart.)"""
    eps = torch.finfo(expected.dtype).eps
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=eps, atol=eps * 1e-3 * scale)


# ---------------------------------------------------------------------------------------------------------
# 1-3: flash-attn's kernel, q and k rotated by two launches


def _fa_inputs(dtype, rotary_dim, head_dim=64, b=2, s=8, hq=4, hk=2, seqlen_ro=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, head_dim, generator=g).to(dtype)
    k = torch.randn(b, s, hk, head_dim, generator=g).to(dtype)
    ang = torch.rand(seqlen_ro, rotary_dim // 2, generator=g) * 6.0
    return q, k, ang.cos().to(dtype), ang.sin().to(dtype)


FA_CASES = {
    # name: (dtype, rotary_dim, interleaved, conjugate, offsets, inplace)
    "neox-full-fp32-int0": (torch.float32, 64, False, False, 0, False),
    "interleaved-partial-bf16-int3": (torch.bfloat16, 32, True, False, 3, False),
    "neox-partial-conj-fp32-tensor": (torch.float32, 48, False, True, "tensor", False),
    "interleaved-full-bf16-tensor-inplace": (torch.bfloat16, 64, True, True, "tensor", True),
}


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
    _ulps_close(cap.value(site.node), ref)


@pytest.mark.parametrize("case", list(FA_CASES))
def test_flash_attn_q_and_k(R, case):
    dtype, rd, inter, conj, offs, inplace = FA_CASES[case]
    q, k, cos, sin = _fa_inputs(dtype, rd)
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
        mod = _load_as(path, name)
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


def test_flash_attn_module_name(R):
    """The same kernel code under flash-attn's module name (as upstream flash-attn 2.7.x ships it)."""
    with _flash_attn_from(R.__file__) as fa:
        _flash_attn_module_name(fa)


def _flash_attn_module_name(fa):
    q, k, cos, sin = _fa_inputs(torch.float32, 32)

    def f(q, k, cos, sin):
        return fa.apply_rotary(q, cos, sin), fa.apply_rotary(k, cos, sin)

    _, cap = compile_capture(f, q, k, cos, sin)
    assert [s.kind for s in cap.sites] == ["flash_attn.rotary_kernel"] * 2 and cap.misses == []
    for site in cap.sites:
        _check_fa_site_numerics(cap, site, seqlen=8)


def test_fallback_without_ttir_analysis(R):
    """No driver at all: torch assumes every input is mutated; later launches read getitem(launch, "COS")."""
    q, k, cos, sin = _fa_inputs(torch.float32, 32)

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
def test_upstream_flash_attn_file(R, path):
    """Any upstream flash-attn version: the v1 signature (program ids m, batch, head until April 2025; m, head,
    batch after, as in vLLM's copy) or the v2 one (flash-attn 2.8: nheads, ROTARY_DIM, BLOCK_H, wrap_triton)."""
    if path is None:
        pytest.skip("no flash-attn kernel file (install flash-attn, or set ROPE_FUSION_FLASH_ATTN_ROTARY)")
    with _flash_attn_from(path) as fa:
        _upstream(fa)


def _upstream(fa):
    q, k, cos, sin = _fa_inputs(torch.bfloat16, 48)

    def f(q, k, cos, sin, off):
        return (fa.apply_rotary(q, cos, sin, seqlen_offsets=off, interleaved=True),
                fa.apply_rotary(k, cos, sin, seqlen_offsets=off, conjugate=True))

    _, cap = compile_capture(f, q, k, cos, sin, torch.tensor([0, 9]))
    assert len(cap.sites) == 2 and cap.misses == [], cap.misses
    for site, inter, conj in zip(cap.sites, (True, False), (False, True)):
        _expected_site_fields(site, torch.bfloat16, 48, inter, conj)
        _check_fa_site_numerics(cap, site, seqlen=8)


def test_dynamic_token_count(R):
    """vLLM marks the token count dynamic: seqlen, seqlen_ro, grid and strides are symbolic in the launch."""
    q, k, cos, sin = _fa_inputs(torch.float32, 32, s=16)
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


def _vllm_layers_rotary(R):
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


def test_apply_rotary_emb_as_vllm_custom_op_calls_it(R):
    """vLLM's ApplyRotaryEmb.forward_cuda (model_executor/layers/rotary_embedding/common.py; the class itself needs
    more of vLLM than is installed): x [S, H, D] -> unsqueeze(0), fp32 compute, apply_rotary_emb through the
    ApplyRotaryEmb autograd.Function, squeeze, cast back."""
    layers = _vllm_layers_rotary(R)
    q, k, cos, sin = (t[0] for t in _fa_inputs(torch.bfloat16, 64, b=1))
    cos, sin = _fa_inputs(torch.float32, 64)[2:]

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


def test_fp64_is_reported_and_varlen_is_a_site(R):
    """An fp64 launch is reported; a varlen one is a site of the op's packed form (tests/test_packed_sequences.py
    checks what it fuses into)."""
    x = torch.randn(12, 4, 64)
    cos, sin = (torch.rand(16, 16) * 3).cos(), (torch.rand(16, 16) * 3).sin()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q64, _, c64, s64 = _fa_inputs(torch.float64, 32)

    def f(x, cos, sin, cu, q64, c64, s64):
        return R.apply_rotary(x, cos, sin, cu_seqlens=cu, max_seqlen=7), R.apply_rotary(q64, c64, s64)

    _, cap = compile_capture(f, x, cos, sin, cu, q64, c64, s64)
    (site,) = cap.sites
    assert site.layout == "thd" and site.cu_seqlens.op == "placeholder"
    reasons = [r for _, r in cap.misses]
    assert len(reasons) == 1 and "float64" in reasons[0]


@pytest.fixture(scope="module")
def fa_graph(R):
    """One captured graph (partial rotary, tail copy), for surgery."""
    q, k, cos, sin = _fa_inputs(torch.float32, 32)

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


def test_mutation_form_is_reported(R):
    """Dynamo's own graph (before functionalization) holds triton_kernel_wrapper_mutation."""
    q, k, cos, sin = _fa_inputs(torch.float32, 64)
    seen = []

    def backend(gm, example_inputs):
        seen.append(kscan.find_kernel_sites(gm.graph))
        return lambda *args: _Run(gm).run(*args)  # the mutation launch, interpreted

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


def test_near_miss_kernels_are_not_sites(R):
    # vLLM's own file under its module name, one sign of the kernel flipped: same signature, other math
    src = open(R.__file__).read()
    assert src.count("o1 = x0 * sin + x1 * cos") == 1
    ns = _exec_as(src.replace("o1 = x0 * sin + x1 * cos", "o1 = x1 * cos - x0 * sin"), FA_MODULE, "tampered")
    spoofed_rotary_kernel = _exec_as(SPOOFED, FA_MODULE, "spoofed")["rotary_kernel"]

    x = torch.randn(100)
    q, _, cos, sin = _fa_inputs(torch.float32, 32)

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

C_NS, V_NS = "rope_fusion_test_vllm_C", "rope_fusion_test_vllm"
C_SCHEMA = ("rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
            "bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()")


def _rotate_lanes(lanes: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """fp32 pair rotation of lanes [..., R] with cos/sin [..., R/2] (the CUDA kernels' per-pair math)."""
    r = lanes.shape[-1]
    x = lanes.float()
    a, b = (x[..., : r // 2], x[..., r // 2:]) if is_neox else (x[..., 0::2], x[..., 1::2])
    oa, ob = a * cos - b * sin, b * cos + a * sin
    return torch.cat((oa, ob), -1) if is_neox else torch.stack((oa, ob), -1).flatten(-2)


def _c_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
    """vLLM csrc/pos_encoding_kernels.cu, addressing included: token t, head h, lane d of a tensor at
    t*stride(positions.dim()-1) + h*head_stride + d, head_stride from QUERY for both tensors."""
    pos = positions.reshape(-1)
    n = pos.numel()
    r = cos_sin_cache.size(1)
    head_stride = query.stride(-2) if query.dim() == positions.dim() + 2 else head_size
    cs = cos_sin_cache[pos].float()
    cos, sin = cs[:, None, : r // 2], cs[:, None, r // 2:]
    if inverse:
        sin = -sin
    for t in (query, key):
        if t is None:
            continue
        heads = t.numel() // n // head_size
        view = t.as_strided((n, heads, head_size), (t.stride(positions.dim() - 1), head_stride, 1),
                            t.storage_offset())
        lanes = view[..., rope_dim_offset: rope_dim_offset + r]
        lanes.copy_(_rotate_lanes(lanes, cos, sin, is_neox).to(t.dtype))


def _flashinfer_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                                 cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """flashinfer.rope.apply_rope_with_cos_sin_cache_inplace as documented: (nnz, -1, head_size) views, float32
    cache, first R lanes of each head rotated, fp32 math."""
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    r = cos_sin_cache.size(1)
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, : r // 2], cs[:, None, r // 2:]
    for t in (query, key):
        lanes = t.view(t.shape[0], -1, head_size)[..., :r]
        lanes.copy_(_rotate_lanes(lanes, cos, sin, is_neox).to(t.dtype))


@pytest.fixture(scope="module")
def vllm_ops():
    from torch.library import infer_schema

    libs = [torch.library.Library(C_NS, "FRAGMENT"), torch.library.Library(V_NS, "FRAGMENT")]
    libs[0].define(C_SCHEMA)
    libs[0].impl("rotary_embedding", _c_rotary_embedding, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{C_NS}::rotary_embedding", lambda *a, **k: None, lib=libs[0])
    try:  # how vLLM registers its flashinfer op (vllm/model_executor/layers/rotary_embedding/common.py)
        from vllm.utils.torch_utils import direct_register_custom_op
    except Exception:  # a partial vLLM install: the same steps by hand
        direct_register_custom_op = None
    if direct_register_custom_op is not None:
        direct_register_custom_op("flashinfer_rotary_embedding", _flashinfer_rotary_embedding,
                                  mutates_args=["query", "key"], fake_impl=lambda *a, **k: None,
                                  target_lib=libs[1], dispatch_key="CompositeExplicitAutograd")
    else:
        libs[1].define("flashinfer_rotary_embedding" + infer_schema(_flashinfer_rotary_embedding,
                                                                    mutates_args=["query", "key"]))
        libs[1].impl("flashinfer_rotary_embedding", _flashinfer_rotary_embedding, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{V_NS}::flashinfer_rotary_embedding", lambda *a, **k: None, lib=libs[1])
    saved = vos.VLLM_C_NAMESPACE, vos.VLLM_NAMESPACE
    vos.VLLM_C_NAMESPACE, vos.VLLM_NAMESPACE = C_NS, V_NS
    yield getattr(torch.ops, C_NS).rotary_embedding, getattr(torch.ops, V_NS).flashinfer_rotary_embedding
    vos.VLLM_C_NAMESPACE, vos.VLLM_NAMESPACE = saved
    for lib in libs:
        lib._destroy()


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
    _ulps_close(cap.value(site.node), ref)


def test_other_rotary_ops_are_reported(vllm_ops):
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


def test_c_stand_in_matches_forward_native(vllm_ops):
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


C_CASES = {
    # name: (v2, query shape, key shape or None, dtype, rotary_dim, is_neox, inverse)
    "flat-neox-full-fp32-v1": (False, (7, 4 * 64), (7, 2 * 64), torch.float32, 64, True, False),
    "heads-gptj-partial-inverse-bf16-v2": (True, (7, 4, 64), (7, 2, 64), torch.bfloat16, 32, False, True),
    "flat-query-only-v2": (True, (7, 4 * 64), None, torch.float32, 48, True, False),
}


def c_case_inputs(case: str) -> tuple:
    """(positions, query, key or None, cos|sin cache) of a C_CASES case, seeded."""
    _, qs, kshape, dtype, rd, _, _ = C_CASES[case]
    g = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 32, (7,), generator=g)
    cache = torch.randn(32, rd, generator=g).to(dtype)
    q = torch.randn(qs, generator=g).to(dtype)
    k = torch.randn(kshape, generator=g).to(dtype) if kshape else None
    return pos, q, k, cache


@pytest.mark.parametrize("case", list(C_CASES))
def test_vllm_c_rotary_embedding(vllm_ops, case):
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


def test_vllm_c_dynamic_token_count(vllm_ops):
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


def test_vllm_qkv_split(vllm_ops):
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


def test_vllm_batched_positions_and_v2_reshape(vllm_ops):
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


def test_vllm_c_not_expressible(vllm_ops):
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


def flashinfer_case(fi_op) -> tuple:
    """(f, pos, q, k, cache, generator): vLLM's flashinfer rotary op in place on a flat q and a [T, H, D] k,
    GPT-J pairs, rotary 32 of 64; the generator goes on where the inputs end."""
    g = torch.Generator().manual_seed(6)
    pos = torch.randint(0, 32, (6,), generator=g, dtype=torch.int32)
    cache = torch.randn(32, 32, generator=g)
    q, k = torch.randn(6, 4 * 64, generator=g).bfloat16(), torch.randn(6, 2, 64, generator=g).bfloat16()

    def f(pos, q, k, cache):
        fi_op(pos, q, k, 64, cache, False)
        return q + 0, k + 0

    return f, pos, q, k, cache, g


def test_vllm_flashinfer_op(vllm_ops):
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
    _flashinfer_rotary_embedding(pos, qf, kf, 64, cache, False)
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
