"""Compiling a test function with the pass on the CPU, with probes that record an independent analysis of the
graphs it sees (tests/zoo/harness.py)."""

from __future__ import annotations

import inspect
import re

import torch

import rope_fusion
from tests.zoo.harness import Capture, GraphRecord, InOrder, probe_passes

# Argument names of the spellings that hold tables (their post-grad placeholders carry Dynamo's `L_<name>_`).
TABLE_ARGS = r"cos|sin|c|s|cq|sq|ck|sk|c_\w+|s_\w+|freqs\w*|cos_sin_cache"


def table_re(fn) -> str:
    """A regex for the post-grad placeholders of fn's table arguments (by the argument names)."""
    names = [n for n in inspect.signature(fn).parameters if re.fullmatch(TABLE_ARGS, n)]
    return "|".join(rf"^L_{n}_$" for n in names) or r"^$"


def static_lanes(args) -> tuple:
    """`args` with the last dim of every floating tensor marked static (`torch._dynamo.mark_static`): under
    dynamic=True the batch, sequence and head counts stay symbolic while the head dim is a constant, as a model's
    config makes it. A symbolic head dim leaves its sites unfused and reported, never guarded (docs/design.md 5)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() and (a.is_floating_point() or a.is_complex()):
            torch._dynamo.mark_static(a, a.dim() - 1)
    return args


def compile_with_pass(fn, *args, dynamic=False, **pass_kw):
    """Compile `fn` on the CPU with a fresh `RopeFusionPass(**pass_kw)` and run it on `args`: (out, pass).

    Real Inductor (C++ code generation). Probes before and after the pass record an independent analysis
    of each post-grad graph in `pass.capture` (tests/zoo/harness.py: rope_fusion nodes, and table x activation
    products and negations of activations, found by taint from the table arguments, cos/sin/polar and complex
    values). The FX graph and AOTAutograd caches are off, so that the pass always runs (a hit skips it)."""
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass(**pass_kw)
    capture = Capture()
    tables = table_re(fn)

    def inductor(gm, example_inputs):
        capture.graphs.append(GraphRecord([n.name for n in gm.graph.nodes if n.op == "placeholder"]))
        return compile_fx(gm, example_inputs,
                          config_patches={"post_grad_custom_post_pass": InOrder(probe_passes(p, capture, tables))})

    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(fn, dynamic=dynamic, fullgraph=True, backend=inductor)(*args)
    p.capture = capture
    return out, p
