"""The suite's fixtures: the Triton backend on CPU tensors (`triton_on_cpu` and its marker), and the plan caches and
`triton.language` put back after every test.

The functions the test modules share live in tests/helpers/ (tests/README.md lists them); import them from there,
as `from tests.helpers.numerics import check_numerics`. The names below are imported back for test modules that
still import them from conftest."""

from __future__ import annotations

import os

import pytest

import rope_fusion
from tests.helpers.compile_pass import compile_with_pass, static_lanes, table_re  # noqa: F401  (imported back)
from tests.helpers.numerics import (  # noqa: F401  (imported back)
    as_tuple,
    check_numerics,
    check_unchanged,
    contract_errors,
    fp64_eval,
    rel_err,
    to_fp64,
)
from tests.helpers.triton_cpu import TritonOnCpu, install, triton_language_kept

# Every group the pass fuses in the suite is first evaluated eagerly against the code it replaces, on random inputs
# of its geometry (passes/fusion_check.py): a fused form that breaks the numbers contract is refused with a near
# miss, so a test that expects it fused fails. ROPE_FUSION_VERIFY=0 turns it off (to time the suite without it).
os.environ.setdefault("ROPE_FUSION_VERIFY", "1")
# The suite measures tiny graphs, whose compiles earn `auto` no allowance for measuring (passes/auto/auto_budget.py):
# no limit here, so that the measuring path runs; tests/passes/test_auto_budget.py sets the share it checks.
os.environ.setdefault("ROPE_FUSION_MEASURE_SHARE", "inf")


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
    """Some interpreted runs leave `triton.language`'s builtins patched (seen after tests/ops/test_eager_op.py: 68
    builtins of triton.language.core), and a compiled kernel analysed later (torch's TTIR analysis of flash-attn's
    rotary_kernel in tests/passes/test_kernel_*.py) then fails, so every test gets the modules back as it found them."""
    with triton_language_kept():
        yield
