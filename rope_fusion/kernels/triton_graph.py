"""Emit the Triton rotary kernel into a post-grad graph as Inductor's own user-kernel node.

Our pass runs after AOT tracing, so a plain call of `rope_fusion::rotary_qk_triton` stays an opaque op
(Inductor's fallback kernel) whose every call pays the Python
dispatcher and host planning (~0.1 ms on the H200, BENCHMARKS.md). Here the host side (`launch`) is traced
with make_fx on the node's fake values, and each traced `triton_kernel_wrapper_mutation` is turned into the
functional `triton_kernel_wrapper_functional` that Inductor's later post-grad passes expect: Inductor then
reinplaces it into the fresh output buffers and launches the kernel from its generated code.

The node records its inputs' fake values as `eager_input_vals`: the launch was planned for exactly those
strides (they are constants of the call), and only with eager values does Inductor require exact strides
of a user kernel's inputs; without them it keeps just their stride order, free to hand the kernel a
re-laid-out copy (a dense copy of a strided view, say) whose strides the kernel would misread.

Packed sequences (`cu_seqlens`, `seqlen_offsets`) are kernel inputs as they are: the kernel finds each token's
sequence itself (ops/packed.py's contract), so no ATen ops derive positions before it. Under symbolic sizes such
a call is not planned.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._higher_order_ops.triton_kernel_wrap import (
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)

from ..fx_nodes import chain_back
from ..ops.schema import RotaryCall
from .triton_kernel import rotary_kernel
from .triton_launch import launch
from .triton_plan import NORM_FIRST, Tables, make_launches

_OUT_ARGS = ("qo_ptr", "ko_ptr", "vo_ptr")


def _concrete(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*t.shape, *t.stride()))


def _trace_launch(call: RotaryCall, vals: list, fake_mode: Any) -> fx.GraphModule:
    """The host side (`launch`) traced on fake values: its views, output buffers and kernel launches as ATen
    and `triton_kernel_wrapper_mutation` nodes, with one placeholder per tensor input of the call."""
    slots = [i for i, t in enumerate(call.tensors()) if t is not None]  # where each input goes in the call
    n = len(call.xs)

    def fn(*args):
        full = [None] * len(call.tensors())
        for slot, a in zip(slots, args):
            full[slot] = a
        c = RotaryCall.parse(full, call.params.kwargs(), n)
        return tuple(launch(c.xs, c.cos, c.sin, c.params, c.positions, c.norm_weights, cu_seqlens=c.cu_seqlens,
                            seqlen_offsets=c.seqlen_offsets))

    return trace_host(fn, vals, fake_mode)


def trace_host(fn: Callable[..., Any], vals: list, fake_mode: Any) -> fx.GraphModule:
    """A host function that launches the rotary kernel (through `triton_launch.kernel_for`, which hands the tracer
    `wrap_triton`'s higher-order op), traced on fake values by make_fx: one placeholder per value."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode, enable_python_dispatcher():
        return make_fx(fn, tracing_mode="real")(*vals)


def _fake_values(a: Any) -> Any:
    """`a` with every node replaced by its fake value (for calling an op on fake tensors)."""
    if isinstance(a, fx.Node):
        return a.meta["val"]
    if isinstance(a, dict):
        return {k: _fake_values(v) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return type(a)(_fake_values(v) for v in a)
    return a


def _emit_kernel(graph: fx.Graph, fake_mode: Any, node: fx.Node, env: dict, symbolic: _SymbolicPlan | None,
                 like: fx.Node) -> None:
    """One traced launch as the functional user-kernel node Inductor's later passes expect; the buffers it writes
    are read from its result from then on (`env`)."""
    kw = dict(node.kwargs)
    kwargs = {k: env[v] if isinstance(v, fx.Node) else v for k, v in kw["kwargs"].items()}
    if symbolic is not None:  # the sizes as graph values where the stand-ins had their hints
        kw["grid"], kwargs = symbolic.kernel_args(graph, kw["grid"], kwargs)
    # a read-only pointer needs only the data address: a view that starts where its base starts is
    # passed as the base, so Inductor's wrapper does not re-create the view on every call
    kwargs = {k: _same_address(v) if isinstance(v, fx.Node) and k not in _OUT_ARGS else v
              for k, v in kwargs.items()}
    written = []
    for name in _OUT_ARGS:
        buf = kwargs.get(name)
        if isinstance(buf, fx.Node) and buf not in [kwargs[w] for w in written]:
            written.append(name)
    fkw = dict(kernel_idx=kw["kernel_idx"], constant_args_idx=kw["constant_args_idx"], grid=kw["grid"],
               tma_descriptor_metadata=kw["tma_descriptor_metadata"], kwargs=kwargs,
               tensors_to_clone=written)
    func = graph.call_function(triton_kernel_wrapper_functional, (), fkw)
    with fake_mode:
        func.meta["val"] = triton_kernel_wrapper_functional(**_fake_values(fkw))
    # The strides traced into the launch are constants of the kernel call, so Inductor must hand it
    # tensors with exactly these strides; with no eager values it only keeps their stride order.
    func.meta["eager_input_vals"] = ((), fx.node.map_arg(func.kwargs, lambda a: a.meta["val"]))
    _copy_meta(func, like)
    # later reads of a written buffer read the kernel's result instead
    old = {n2: name for n2, name in ((node.kwargs["kwargs"][w], w) for w in written)}
    for src, name in old.items():
        got = graph.call_function(operator.getitem, (func, name))
        got.meta["val"] = func.meta["val"][name]
        _copy_meta(got, like)
        env[src] = got


def emit_triton(graph: fx.Graph, fake_mode: Any, call: RotaryCall, like: fx.Node) -> list | None:
    """Nodes computing the rotated xs (inserted at the graph's current insertion point), or None when the
    site has symbolic sizes (the caller then emits the op call)."""
    inputs = [t for t in call.tensors() if t is not None]
    vals = [a.meta["val"] for a in inputs]
    symbolic = None
    if not all(_concrete(v) for v in vals):
        symbolic = _SymbolicPlan.of(call, inputs, vals, fake_mode)
        if symbolic is None:
            return None
        vals = symbolic.stand_ins
    gm = _trace_launch(call, vals, fake_mode)
    return replay_traced(graph, fake_mode, gm, inputs, like, symbolic)


def replay_traced(graph: fx.Graph, fake_mode: Any, gm: fx.GraphModule, inputs: list, like: fx.Node,
                  symbolic: _SymbolicPlan | None = None) -> list | None:
    """A traced host function (`trace_host`) copied into `graph` at its insertion point, its placeholders read
    as `inputs`, each kernel launch as the functional user-kernel node (`_emit_kernel`); the nodes of its outputs,
    or None where it traced something else than ATen calls and launches."""
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    env: dict = dict(zip(placeholders, inputs))

    def arg(a):
        return env[a] if isinstance(a, fx.Node) else a

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            return [env[o] for o in node.args[0]]
        if node.op != "call_function":
            return None
        if node.target is triton_kernel_wrapper_mutation:
            _emit_kernel(graph, fake_mode, node, env, symbolic, like)
            continue
        if symbolic is not None and node.target is torch.ops.aten.empty.memory_format:
            new = symbolic.output_buffer(graph, node)  # an output of x's symbolic shape
        else:
            new = graph.node_copy(node, arg)
        _copy_meta(new, like)
        env[node] = new
    return None


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
          torch.ops.aten.expand.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int,
          torch.ops.aten.slice.Tensor, torch.ops.aten.alias.default, torch.ops.aten.select.int}


def _same_address(node: fx.Node) -> fx.Node:
    """The farthest view ancestor of `node` that shares its storage and storage offset (the same data
    address; the kernel reads it with the strides its launch planned), else the node itself."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def address(n: fx.Node) -> tuple | None:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(val.storage_offset(), int):
            return None
        try:
            return StorageWeakRef(val.untyped_storage()), val.storage_offset(), val.device
        except Exception:  # a fake tensor without storage
            return None

    mine = address(node)
    best = node
    for n in chain_back(node, _VIEWS)[1:]:
        if mine is None or address(n) != mine:
            break
        best = n
    return best


class _SymbolicPlan:
    """A launch for sizes that are symbolic only along the tokens (vLLM marks the token count dynamic).

    The launch is traced on stand-ins of the sizes' hints; the host plan run on the symbolic sizes then says
    which scalars and grid entries are sizes (the token count, the programs per token that few tokens get),
    and those become graph values: `sym_size` of an input and sym arithmetic on it, which Inductor evaluates
    in its generated code. A plan that differs at the hints, a compile-time constant of the kernel that
    depends on a size, or a symbol that is no input's size is refused, and the pass emits the opaque op."""

    def __init__(self, call: RotaryCall, inputs: list, vals: list, stand_ins: list, launches: list):
        self.call, self.inputs, self.vals, self.stand_ins, self.launches = call, inputs, vals, stand_ins, launches
        self._sizes: dict = {}  # symbol or expression -> the graph node computing it
        self._launch = self._outputs = 0

    @classmethod
    def of(cls, call: RotaryCall, inputs: list, vals: list, fake_mode: Any) -> _SymbolicPlan | None:
        if fake_mode is None or fake_mode.shape_env is None or call.cu_seqlens is not None:
            return None  # packed sequences: their count is a kernel argument that this plan does not map
        env = fake_mode.shape_env
        try:
            hint = [([_hint(env, d) for d in v.shape], [_hint(env, d) for d in v.stride()]) for v in vals]
        except _NotSimple:
            return None
        with fake_mode:
            stand_ins = [torch.empty_strided(sh, st, dtype=v.dtype, device=v.device) for (sh, st), v in zip(hint, vals)]
            by_node = dict(zip(inputs, vals))
            xs = [by_node[x] for x in call.xs]
            if not all(isinstance(x.stride(-1), int) and x.stride(-1) == 1 for x in xs):
                return None  # `launch` would copy x first
            if call.params.norm != "none" and any(w is not None and by_node[w].dim() > 2
                                                  for w in call.norm_weights or []):
                return None
            plans = []
            for vs in (vals, stand_ins):  # the symbolic plan, and the one traced on the hints
                by_node = dict(zip(inputs, vs))
                xs = [by_node[x] for x in call.xs]
                outs = [torch.empty(x.shape, dtype=call.params.out_dtype, device=x.device) for x in xs]
                weights = [by_node[w] if w is not None else None for w in (call.norm_weights or [None] * len(xs))]
                tables = Tables(by_node[call.cos], by_node[call.sin],
                                by_node[call.positions] if call.positions is not None else None, weights)
                plans.append(make_launches(xs, outs, tables, call.params))
        launches, traced = plans
        if NORM_FIRST in (launches, traced):
            return None
        if not launches or not traced or len(launches) != len(traced):
            return None
        sizes = {d.node.expr for v in vals for d in v.shape if isinstance(d, torch.SymInt)}
        for (group, grid, scalars, meta), (tgroup, tgrid, tscalars, tmeta) in zip(launches, traced):
            if not all(_simple(v, sizes) for v in (*grid, *scalars)):
                return None
            # the same launch but for the sizes' values: else the hints planned another geometry (a symbolic
            # dim that the hint made short enough to loop over, say), and the traced kernel would not fit
            at_hints = [_at_hint(env, v) for v in (*grid, *scalars)]
            if (group, meta) != (tgroup, tmeta) or at_hints != [*tgrid, *tscalars]:
                return None
        return cls(call, inputs, vals, stand_ins, launches)

    def kernel_args(self, graph: fx.Graph, grid: list, kwargs: dict) -> tuple[list, dict]:
        """The traced launch's grid and arguments with the symbolic plan's sizes as graph values."""
        _group, sym_grid, scalars, _meta = self.launches[self._launch]
        self._launch += 1
        names = [a for a in _kernel_args(rotary_kernel) if a in kwargs and not isinstance(kwargs[a], fx.Node)]
        scalar_names = names[: len(scalars)]
        kwargs = dict(kwargs)
        for name, v in zip(scalar_names, scalars):
            kwargs[name] = self._value(graph, v)
        g = tuple(self._value(graph, v) for v in sym_grid)
        g = g + (1,) * (len(grid[0]) - len(g))
        return [g], kwargs

    def output_buffer(self, graph: fx.Graph, node: fx.Node) -> fx.Node:
        """The i-th `empty(x.shape)` of the traced launch (`launch` allocates one per x, in order), with the
        i-th x's symbolic shape."""
        x = self.vals[self.inputs.index(self.call.xs[self._outputs])]
        self._outputs += 1
        new = graph.call_function(node.target, ([self._value(graph, d) for d in x.shape],), dict(node.kwargs))
        with detect_fake_mode([x]):
            new.meta["val"] = torch.empty(x.shape, dtype=node.kwargs["dtype"], device=x.device)
        return new

    def _value(self, graph: fx.Graph, v: Any) -> Any:
        """An int as it is; a symbolic size as graph nodes computing it from the inputs' sizes."""
        if not isinstance(v, torch.SymInt):
            return v
        return self._expr(graph, v.node.expr)

    def _expr(self, graph: fx.Graph, expr: Any) -> Any:
        import sympy

        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            return self._size_node(graph, expr)
        if expr in self._sizes:  # computed once: the grid and a scalar often hold the same expression
            return self._sizes[expr]
        op = _SYM_OPS[_op_name(expr)]
        out = self._expr(graph, expr.args[0])
        for a in expr.args[1:]:
            rhs = self._expr(graph, a)
            val = op(*(x.meta["val"] if isinstance(x, fx.Node) else x for x in (out, rhs)))
            out = graph.call_function(op, (out, rhs))
            out.meta["val"] = val
        self._sizes[expr] = out
        return out

    def _size_node(self, graph: fx.Graph, sym: Any) -> fx.Node:
        if sym in self._sizes:
            return self._sizes[sym]
        for node, val in zip(self.inputs, self.vals):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == sym:
                    out = graph.call_function(torch.ops.aten.sym_size.int, (node, d))
                    out.meta["val"] = size
                    self._sizes[sym] = out
                    return out
        raise _NotSimple(f"no input has the size {sym}")


class _NotSimple(Exception):
    pass


def _hint(env: Any, d: Any) -> int:
    if isinstance(d, int):
        return d
    if not _simple(d):
        raise _NotSimple(str(d))
    return _expr_hint(env, d.node.expr)


def _at_hint(env: Any, v: Any) -> Any:
    return _expr_hint(env, v.node.expr) if isinstance(v, torch.SymInt) else v


def _expr_hint(env: Any, expr: Any) -> int:
    """The example value of a size (`optimization_hint` from torch 2.13, `size_hint` before)."""
    hint = getattr(env, "optimization_hint", None) or env.size_hint
    return int(hint(expr))


# sym arithmetic the generated code evaluates (Inductor lowers these operators to the node's sympy value)
_SYM_OPS = {"Add": operator.add, "Mul": operator.mul, "FloorDiv": operator.floordiv, "Max": torch.sym_max,
            "Min": torch.sym_min}


def _op_name(expr: Any) -> str:
    return type(expr).__name__


def _supported(expr: Any, sizes: set) -> bool:
    import sympy

    if isinstance(expr, sympy.Integer):
        return True
    if isinstance(expr, sympy.Symbol):
        return expr in sizes
    return _op_name(expr) in _SYM_OPS and all(_supported(a, sizes) for a in expr.args)


def _simple(v: Any, sizes: set | None = None) -> bool:
    """A plain value, or a SymInt built from the inputs' size symbols (`sizes`; any symbol when None) by
    the arithmetic of _SYM_OPS."""
    if not isinstance(v, torch.SymInt):
        return isinstance(v, (bool, int, float))
    expr = v.node.expr
    return _supported(expr, sizes if sizes is not None else set(expr.free_symbols))


def _kernel_args(kernel: Any) -> list:
    """The kernel's parameter names in order (a JITFunction, or the interpreter's wrapper of one)."""
    fn = getattr(kernel, "fn", kernel)
    return list(getattr(kernel, "arg_names", None) or getattr(fn, "arg_names", None)
                or fn.__code__.co_varnames[: fn.__code__.co_argcount])


def _copy_meta(node: fx.Node, like: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
