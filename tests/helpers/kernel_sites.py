"""vLLM's flash-attn Triton rotary kernel traced into a real post-grad graph on the CPU, and that graph run with
the kernel interpreted, so the kernel-site tests read what the pass sees and what the kernel computes.

- vLLM's kernel module `vllm.vllm_flash_attn.ops.triton.rotary` comes from the installed wheel, unmodified. Its
  package `vllm.vllm_flash_attn` raises ImportError without the CUDA flash-attention extensions, so an empty
  package object with the real `__path__` stands in for that one `__init__` (`vllm_rotary_module`); the kernel's
  module name stays `vllm.vllm_flash_attn.ops.triton.rotary`.
- The module is imported WITHOUT TRITON_INTERPRET: under it `triton.jit` returns an InterpretedFunction, which
  Dynamo does not know as a Triton kernel (it inlines its Python and fails on `data_ptr`).
- `cpu_triton_tracing()` (examples/vllm_omni_block.py) lets Dynamo and torch's TTIR analysis trace the kernel
  without a GPU (tests/passes/test_kernel_sites.py's docstring says what it patches and why).
- Full Inductor would then have to generate code for a user Triton kernel on the CPU; instead, as in
  tests/zoo/harness.py, `capture_backend` is Inductor's `compile_fx` with an `inner_compile` that runs the
  post-grad passes (where `post_grad_custom_post_pass` sees exactly what the rope_fusion pass sees) and then runs a
  copy of that graph with an fx Interpreter (`GraphRun`) that launches each Triton kernel as
  `InterpretedFunction(jit.fn)`, which is what `triton.jit` builds under TRITON_INTERPRET=1. Every node's value is
  kept for the numerics checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import (
    kernel_side_table,
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)
from torch._prims_common import clone_preserve_strides

from examples.vllm_omni_block import cpu_triton_tracing  # one copy, in the example users run
from rope_fusion.passes.kernel_sites import flash_attn_sites as fas
from rope_fusion.passes.kernel_sites import kernel_scan as kscan
from tests.helpers.triton_interpreted import interpreted as interpreted_kernel

FA_MODULE = "vllm.vllm_flash_attn.ops.triton.rotary"


# ---------------------------------------------------------------------------------------------------------
# the real kernel module, and tracing it on the CPU


def vllm_rotary_module():
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


def load_as(path: str, name: str):
    """Execute a kernel file under another module name, without registering it in sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def R():
    return vllm_rotary_module()


@contextlib.contextmanager
def interpreted(mod):
    """The module's kernel as TRITON_INTERPRET=1 builds it, for eager calls of its wrapper."""
    jit = mod.rotary_kernel
    mod.rotary_kernel = interpreted_jit(jit)
    try:
        yield
    finally:
        mod.rotary_kernel = jit


def interpreted_jit(jit):
    return interpreted_kernel(jit)  # with its @triton.jit helpers interpreted too (rope_fusion's kernel has some)


# ---------------------------------------------------------------------------------------------------------
# the backend: Inductor's front half + post-grad passes, then the pass-visible graph run by an fx Interpreter


def launch_interpreted(hop_kwargs: dict, kw: dict) -> None:
    jit = fas.unwrap_jit(kernel_side_table.get_kernel(hop_kwargs["kernel_idx"]))
    consts = kernel_side_table.get_constant_args(hop_kwargs["constant_args_idx"])
    every = {**consts, **kw}
    (grid,) = hop_kwargs["grid"]
    interpreted_jit(jit)[tuple(int(g) for g in grid)](*[every[n] for n in jit.arg_names])


class GraphRun(torch.fx.Interpreter):
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
            launch_interpreted(kwargs, kw)
            return {k: kw[k] for k in kwargs["tensors_to_clone"]}
        if target is triton_kernel_wrapper_mutation:
            launch_interpreted(kwargs, dict(kwargs["kwargs"]))
            return None
        return super().call_function(target, args, kwargs)


def seen_site(site, nodes: dict, vm: dict) -> types.SimpleNamespace:
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
        self.sites = [seen_site(s, nodes, vm) for s in sites]
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
            r = GraphRun(cap.gm)
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


def ulps_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one ulp of the dtype, elementwise. (fp32 results come out bit-identical here; in bf16 Triton 3.9's
    interpreter rounds fp32 -> bf16 toward zero where torch, and GPUs, round to nearest: one ulp apart.)"""
    eps = torch.finfo(expected.dtype).eps
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=eps, atol=eps * 1e-3 * scale)



def fa_inputs(dtype, rotary_dim, head_dim=64, b=2, s=8, hq=4, hk=2, seqlen_ro=16, seed=0):
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
