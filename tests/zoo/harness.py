"""Graph-level harness for the model zoo.

Compiling forty models through Inductor's C++ code generation on two cores is slow, so most entries
are tested at the graph level: `torch.compile` with a backend that is Inductor's own `compile_fx`
(pre-grad passes, AOT autograd with Inductor's decomposition table, joint-graph passes) but whose
`inner_compile` stops after Inductor's post-grad passes (which run `post_grad_custom_post_pass`, our
pass) and then runs the resulting GraphModule eagerly (our op has an eager implementation). No code is
generated, yet the graph the pass sees is the one real Inductor gives it: `test_zoo.py` checks this by
comparing per-op node counts with a real `torch.compile` run of the same model.

Independently of the pass, a taint analysis over each post-grad graph counts "RoPE products": `mul`
nodes whose one operand derives from a rotary table (outputs of `cos`/`sin`/`polar`, complex-valued
constants, or graph inputs whose Dynamo name names a table, e.g. Wan's `freqs_cos` buffer) and whose
other operand derives from activations only. Table taint stops at matmuls/convolutions/attention
(a sinusoidal timestep embedding feeding a linear layer is not RoPE) and at our fused op. Before the
pass every RoPE site shows such products; after it there must be none.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten

TABLE_NAME_RE = (r"freqs_cos|freqs_sin|freqs_cis|rotary_emb|rotary_pos_emb|rotary_embedding|cos_cached|sin_cached|"
                 r"position_embeddings|(^|_)(cos|sin)(_|$)")

# buffers of a rotary module that are not tables yet (inverse frequencies), and weights
NOT_TABLE_RE = r"inv_freq|freqs_base|_parameters_"


# --------------------------------------------------------------------------------------------------
# graph analysis (independent of rope_fusion)
# --------------------------------------------------------------------------------------------------

_TABLE_SOURCES = {aten.cos.default, aten.sin.default, aten.polar.default}
_RESETS = {
    aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.convolution.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default, aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.native_layer_norm.default, aten._weight_int8pack_mm.default,
}
_MULS = {aten.mul.Tensor, aten.mul_.Tensor}


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) if not hasattr(t, "_schema") else str(t)


def _is_rope_op(node: torch.fx.Node) -> bool:
    """A rope_fusion op, or the functional form of one that writes in place (a slice write folded in)."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.higher_order.auto_functionalized and node.args:
        return "rope_fusion" in str(node.args[0])
    return "rope_fusion" in str(node.target)


def _val(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v


def _source(node: torch.fx.Node) -> str:
    st = node.meta.get("stack_trace") or ""
    lines = re.findall(r'File "([^"]+)", line (\d+)', st)
    if not lines:
        return "?"
    f, ln = lines[-1]
    return f"{f.rsplit('/', 1)[-1]}:{ln}"


@dataclasses.dataclass
class GraphStats:
    counts: collections.Counter  # op target -> number of nodes
    rope_products: list  # [(node name, source)] table x activation products
    rope_ops: int  # rope_fusion nodes
    nodes: int
    negations: list = dataclasses.field(default_factory=list)  # [(node name, source)] neg of an activation


def analyze(graph: torch.fx.Graph, placeholder_names: list | None = None,
            table_re: str = TABLE_NAME_RE) -> GraphStats:
    table: dict = {}
    act: dict = {}
    counts: collections.Counter = collections.Counter()
    products = []
    negations = []
    rope_ops = 0
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = {}
    if placeholder_names is not None and len(placeholder_names) == len(placeholders):
        names = {n: placeholder_names[i] for i, n in enumerate(placeholders)}
    rx = re.compile(table_re, re.I)
    not_table = re.compile(NOT_TABLE_RE, re.I)

    def inputs(node):
        out = []
        torch.fx.node.map_arg((node.args, node.kwargs), out.append)
        return out

    for node in graph.nodes:
        if node.op == "output":
            continue
        v = _val(node)
        is_complex = isinstance(v, torch.Tensor) and v.is_complex()
        if node.op == "placeholder":
            nm = names.get(node, node.name)
            table[node] = (bool(rx.search(nm)) and not not_table.search(nm)) or is_complex
            act[node] = not table[node]
            continue
        if node.op == "get_attr":
            table[node] = is_complex
            act[node] = False
            continue
        counts[_target_name(node)] += 1
        ins = inputs(node)
        if _is_rope_op(node):
            rope_ops += 1
            table[node], act[node] = False, True
            continue
        if node.target in _TABLE_SOURCES:
            table[node], act[node] = True, False
            continue
        any_t = any(table.get(i, False) for i in ins)
        any_a = any(act.get(i, False) or table.get(i, False) for i in ins)
        if node.target is aten.neg.default and ins and act.get(ins[0], False) and not table.get(ins[0], False):
            negations.append((node.name, _source(node)))
        if node.target in _RESETS:
            table[node], act[node] = False, any_a
            continue
        if node.target is aten.embedding.default:  # rows of its weight: a table gathered by positions (Allegro)
            table[node] = table.get(node.args[0], False)
            act[node] = not table[node]
            continue
        if node.target in _MULS and len(node.args) >= 2 and all(isinstance(a, torch.fx.Node) for a in node.args[:2]):
            a, b = node.args[:2]
            ta, tb = table.get(a, False), table.get(b, False)
            aa, ab = act.get(a, False) and not ta, act.get(b, False) and not tb
            if (ta and ab) or (tb and aa):
                # scalars (0-d tensors) are not lanes of anything
                # the activation side of a RoPE product is a q/k tensor, never a scalar or a 1-D
                # weight (an RMSNorm weight times a normed sinusoidal timestep embedding is not RoPE)
                xv = _val(b) if ta else _val(a)
                tv = _val(a) if ta else _val(b)
                if (isinstance(xv, torch.Tensor) and xv.dim() >= 2
                        and not (isinstance(tv, torch.Tensor) and tv.dim() == 0)):
                    products.append((node.name, _source(node)))
        table[node] = any_t
        act[node] = any(act.get(i, False) for i in ins)
    return GraphStats(counts, products, rope_ops, sum(1 for _ in graph.nodes), negations)


# --------------------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class GraphRecord:
    placeholder_names: list
    before: GraphStats | None = None
    after: GraphStats | None = None
    gm: Any = None
    t_before: float = 0.0
    pass_seconds: float = 0.0  # time spent in our pass on this graph


@dataclasses.dataclass
class Capture:
    graphs: list = dataclasses.field(default_factory=list)

    @property
    def products_before(self) -> list:
        return [p for g in self.graphs if g.before for p in g.before.rope_products]

    @property
    def products_after(self) -> list:
        return [p for g in self.graphs if g.after for p in g.after.rope_products]

    @property
    def negations_after(self) -> list:
        return [p for g in self.graphs if g.after for p in g.after.negations]

    @property
    def rope_ops(self) -> int:
        return sum(g.after.rope_ops for g in self.graphs if g.after)

    def counts_after(self) -> collections.Counter:
        c: collections.Counter = collections.Counter()
        for g in self.graphs:
            if g.after:
                c.update(g.after.counts)
        return c


class _Probe:
    """A post-grad custom pass that records statistics of the graph (placed before and after ours)."""

    def __init__(self, capture: Capture, which: str, table_re: str) -> None:
        self.capture, self.which, self.table_re = capture, which, table_re

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.which == "before":
            # Dynamo names are known for graphs compiled by our backend; full compiles fall back to
            # the post-grad placeholder names.
            if not self.capture.graphs or self.capture.graphs[-1].before is not None:
                self.capture.graphs.append(GraphRecord(placeholder_names=None))
            rec = self.capture.graphs[-1]
            rec.before = analyze(graph, rec.placeholder_names, self.table_re)
            rec.t_before = time.perf_counter()
        else:
            rec = self.capture.graphs[-1]
            rec.pass_seconds = time.perf_counter() - rec.t_before
            rec.after = analyze(graph, rec.placeholder_names, self.table_re)

    def uuid(self):
        return None


def probe_passes(pass_, capture: Capture, table_re: str) -> list:
    """The post-grad passes [probe before, pass_, probe after] (pass_ None: only the probes)."""
    ps = [_Probe(capture, "before", table_re)]
    if pass_ is not None:
        ps.append(pass_)
    ps.append(_Probe(capture, "after", table_re))
    return ps


try:  # torch passes `is_inference` to such passes; torch 2.11 has no such class
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _InferenceAware
    _PassBase: type = _InferenceAware
except ImportError:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
    _InferenceAware = ()  # isinstance(p, ()) is never true


class InOrder(_PassBase):
    """Post-grad passes run one after another as one pass. Newer torch also takes a list of passes for
    `post_grad_custom_post_pass`; torch 2.11 takes one, and the tests run on both. No cache key: the probes have
    none, and the tests compile afresh anyway."""

    def __init__(self, passes: list) -> None:
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
        for p in self.passes:
            if is_inference is not None and isinstance(p, _InferenceAware):
                p(graph, is_inference=is_inference)
            else:
                p(graph)

    def uuid(self) -> None:
        return None


def graph_level_backend(pass_, capture: Capture, table_re: str = TABLE_NAME_RE) -> Callable:
    """A torch.compile backend: Inductor's front half and post-grad passes, then eager execution."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor import compile_fx as cfx
    from torch._inductor.virtualized import V

    def inner_compile(gm, example_inputs, **kwargs):
        cfx.view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = cfx.fake_tensor_prop(gm, example_inputs)
        with V.set_fake_mode(fake_mode):
            cfx._recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))
        gm.recompile()
        capture.graphs[-1].gm = gm
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        capture.graphs.append(GraphRecord(placeholder_names=names))
        return cfx.compile_fx(gm, example_inputs, inner_compile=inner_compile,
                              config_patches=_config_patches(pass_, capture, table_re))

    return backend


def _config_patches(pass_, capture, table_re) -> dict:
    return {"post_grad_custom_post_pass": InOrder(probe_passes(pass_, capture, table_re)), "fx_graph_cache": False,
            "fx_graph_remote_cache": False}


def compile_model(model, pass_, capture: Capture, *, full: bool, table_re: str = TABLE_NAME_RE):
    """`torch.compile` the model, at the graph level or through full Inductor (C++ code generation)."""
    import torch._functorch.config as fconfig
    fconfig.enable_autograd_cache = False
    if full:
        # real Inductor (compile_fx with code generation), only recording the Dynamo placeholder names
        from torch._inductor.compile_fx import compile_fx

        def inductor(gm, example_inputs):
            capture.graphs.append(GraphRecord([n.name for n in gm.graph.nodes if n.op == "placeholder"]))
            return compile_fx(gm, example_inputs, config_patches=_config_patches(pass_, capture, table_re))
        return torch.compile(model, fullgraph=False, dynamic=False, backend=inductor)
    return torch.compile(model, fullgraph=False, dynamic=False,
                         backend=graph_level_backend(pass_, capture, table_re))


# --------------------------------------------------------------------------------------------------
# numerics
# --------------------------------------------------------------------------------------------------

def float_leaves(out) -> list:
    """Every floating-point tensor of a model output (ModelOutput, dataclass, tuple, dict)."""
    res = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() or o.is_complex():
                res.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif dataclasses.is_dataclass(o):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name))
    walk(out)
    return res


def rel_error(out, ref) -> float:
    a, b = float_leaves(out), float_leaves(ref)
    if len(a) != len(b) or not a:
        raise AssertionError(f"output structure differs: {len(a)} vs {len(b)} tensors")
    err = 0.0
    for x, y in zip(a, b):
        x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
        scale = y.abs().max().item() or 1.0
        err = max(err, (x - y).abs().max().item() / scale)
    return err


def cast_inputs(inputs: dict, dtype: torch.dtype) -> dict:
    def c(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        if isinstance(v, (list, tuple)):
            return type(v)(c(x) for x in v)
        return v
    return {k: c(v) for k, v in inputs.items()}


SLACK = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclasses.dataclass
class Result:
    name: str
    dtype: str
    mode: str  # "graph" or "full"
    expected_sites: int
    sites: int = 0
    kernels: int = 0
    qk_kernels: int = 0
    graphs: int = 0
    products_before: int = 0
    products_after: list = dataclasses.field(default_factory=list)
    err_eager: float = float("nan")
    err_pass: float = float("nan")
    tol: float = float("nan")
    sources: list = dataclasses.field(default_factory=list)
    misses: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    failure: str = ""  # could not compile/run at all
    seconds: float = 0.0
    pass_seconds: float = 0.0
    report: Any = None
    capture: Any = None

    @property
    def numerics_ok(self) -> bool:
        return self.err_pass <= self.tol


def run_entry(entry, dtype: torch.dtype, *, full: bool = False, backend: str = "auto",
              ref64_cache: dict | None = None, make_pass: Callable | None = None) -> Result:
    """Build the entry, compile it with the pass in `dtype`, and collect everything the tests assert."""
    import rope_fusion

    t0 = time.perf_counter()
    res = Result(entry.name, str(dtype).replace("torch.", ""), "full" if full else "graph", entry.sites)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = entry.build()
    model.eval()
    # fp64 reference (the numerics contract, docs/design.md section 2)
    key = entry.name
    ref64 = None if ref64_cache is None else ref64_cache.get(key)
    if ref64 is None:
        try:
            with torch.no_grad():
                ref64 = copy.deepcopy(model).to(torch.float64)(**cast_inputs(inputs, torch.float64))
        except Exception:  # some models do not run in fp64: fall back to fp32 eager
            with torch.no_grad():
                ref64 = copy.deepcopy(model)(**inputs)
        if ref64_cache is not None:
            ref64_cache[key] = ref64
    m = model.to(dtype)
    xin = cast_inputs(inputs, dtype)
    with torch.no_grad():
        eager = m(**xin)
    res.err_eager = rel_error(eager, ref64)
    res.tol = 2 * res.err_eager + SLACK[dtype]

    p = rope_fusion.RopeFusionPass(backend=backend, fuse_qk=True) if make_pass is None else make_pass()
    cap = Capture()
    try:
        compiled = compile_model(m, p, cap, full=full, table_re=entry.table_re)
        with torch.no_grad():
            out = compiled(**xin)
    except Exception as e:  # recorded, the test decides
        res.failure = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        res.seconds = time.perf_counter() - t0
        res.report, res.capture = (p.report if p is not None else None), cap
        return res
    res.err_pass = rel_error(out, ref64)
    r = p.report if p is not None else rope_fusion.Report()
    res.sites = len(r.sites)
    res.kernels = len(r.kernels)
    res.qk_kernels = sum(1 for k in r.kernels if len(k.sites) > 1)  # rotary_qk, or rotary_qkv
    res.graphs = len([g for g in cap.graphs if g.before is not None])
    res.products_before = len(cap.products_before)
    res.products_after = cap.products_after
    res.sources = [s.source for s in r.sites]
    res.misses = [(m_.reason, m_.source) for m_ in r.misses]
    res.errors = [e.error for e in r.errors]
    res.report, res.capture = r, cap
    res.pass_seconds = sum(g.pass_seconds for g in cap.graphs)
    res.seconds = time.perf_counter() - t0
    torch._dynamo.reset()
    return res
