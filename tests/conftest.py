"""Shared test helpers: compile a function with the pass, an independent check of the graph it leaves, and
the numerics contract (docs/design.md section 2).

Import them as `from conftest import compile_with_pass, check_numerics` (tests/ has no __init__.py). The
`triton_on_cpu` fixture runs the Triton backend on CPU tensors (tests/helpers/triton_cpu.py); helpers that test
modules share live in tests/helpers/."""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch

import rope_fusion
from tests.helpers.triton_cpu import TritonOnCpu, install, triton_language_kept
from tests.zoo.harness import Capture, GraphRecord, InOrder, probe_passes

# Every group the pass fuses in the suite is first evaluated eagerly against the code it replaces, on random inputs
# of its geometry (passes/fusion_check.py): a fused form that breaks the numbers contract is refused with a near
# miss, so a test that expects it fused fails. ROPE_FUSION_VERIFY=0 turns it off (to time the suite without it).
os.environ.setdefault("ROPE_FUSION_VERIFY", "1")

# Argument names of the spellings that hold tables (their post-grad placeholders carry Dynamo's `L_<name>_`).
TABLE_ARGS = r"cos|sin|c|s|cq|sq|ck|sk|c_\w+|s_\w+|freqs\w*|cos_sin_cache"


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def to_fp64(args) -> tuple:
    """Real floating tensors to fp64, complex to complex128; anything else (positions, ints) unchanged."""
    def one(a):
        if isinstance(a, torch.Tensor):
            if a.is_complex():
                return a.to(torch.complex128)
            if a.is_floating_point():
                return a.to(torch.float64)
        return a
    return tuple(one(a) for a in args)


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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error in the 2-norm, computed in fp64."""
    out, ref = out.to(torch.float64), ref.to(torch.float64)
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def fp64_eval(fn, *args) -> tuple:
    """The original function evaluated on its inputs cast to fp64 / complex128."""
    return as_tuple(fn(*to_fp64(args)))


def contract_errors(fn, args, fused, compare=None) -> list:
    """[(err_fused, err_orig, slack)] per output: errors of the fused and of the original (eager, original
    dtype) results against the fp64 evaluation of `fn`; slack = eps of the output dtype."""
    compare = compare or (lambda t: t)
    fused = as_tuple(fused)
    orig = as_tuple(fn(*args))
    ref = fp64_eval(fn, *args)
    assert len(fused) == len(orig) == len(ref)
    rows = []
    for f, o, r in zip(fused, orig, ref):
        assert f.shape == o.shape, f"shape {tuple(f.shape)} != {tuple(o.shape)}"
        assert f.dtype == o.dtype, f"dtype {f.dtype} != {o.dtype}"
        r = compare(r)
        rows.append((rel_err(compare(f), r), rel_err(compare(o), r), torch.finfo(o.dtype).eps))
    return rows


def check_numerics(fn, args, fused, compare=None, context: str = "") -> None:
    """The numerics contract: err_fused <= err_orig + eps(out dtype), for every output."""
    for i, (ef, eo, eps) in enumerate(contract_errors(fn, args, fused, compare)):
        assert ef <= eo + eps, (f"output {i}: fused rel. error {ef:.3g} > original's {eo:.3g} + eps {eps:.3g}"
                                f"{chr(10) + context if context else ''}")


def check_unchanged(fn, args, out, compare=None, context: str = "") -> None:
    """A graph left alone must compute what eager computes (allclose at the output dtype's tolerance)."""
    compare = compare or (lambda t: t)
    for i, (a, b) in enumerate(zip(as_tuple(out), as_tuple(fn(*args)))):
        assert a.dtype == b.dtype and a.shape == b.shape
        eps = torch.finfo(b.dtype).eps
        torch.testing.assert_close(compare(a), compare(b), rtol=8 * eps, atol=8 * eps,
                                   msg=lambda m, i=i: f"output {i}: {m}\n{context}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "triton_on_cpu(serves=(), wrap=None): what the triton_on_cpu fixture serves on the CPU with the "
        "CUDA implementations (names of tests/helpers/triton_cpu.SERVES) and how it wraps the interpreted kernels")


@pytest.fixture
def triton_on_cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> TritonOnCpu:
    """The Triton backend on CPU tensors (tests/helpers/triton_cpu.py): the kernels interpreted, and what else the
    CPU serves as CUDA does named by the test's `triton_on_cpu` marker, since each table changes what the pass
    folds. The test's own `monkeypatch` holds the patches, so its later patches of the same names unwind first."""
    pytest.importorskip("triton")
    marker = request.node.get_closest_marker("triton_on_cpu")
    return install(monkeypatch, **(marker.kwargs if marker else {}))


@pytest.fixture(autouse=True)
def _plans_forgotten():
    """A test that serves CPU tensors with a stand-in kernel plans geometries that a later test, with the stand-in
    gone, must not replay: every test leaves the library's plan caches empty (`rope_fusion.clear_caches`)."""
    yield
    rope_fusion.clear_caches()



@pytest.fixture(autouse=True)
def _triton_language_restored():
    """Some interpreted runs leave `triton.language`'s builtins patched (seen after tests/test_eager_op.py: 68
    builtins of triton.language.core), and a compiled kernel analysed later (torch's TTIR analysis of flash-attn's
    rotary_kernel in tests/test_kernel_*.py) then fails, so every test gets the modules back as it found them."""
    with triton_language_kept():
        yield
