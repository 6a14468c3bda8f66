"""The self-check of every fusion (passes/fusion_check.py): a fused form that computes other numbers than the model's
code is refused, with a near miss and a WARNING, and a right one passes.

Two places check: `auto`'s measured candidates (on the CPU here: "cpu" added to the measured device types, the
clock steered, every compile and run real), and `RopeFusionPass(verify=True)`, which evaluates each planned group
eagerly on random inputs. The wrong fused forms are real components that compute wrong numbers: a backend record
registered in the backend registry whose emission calls the op with the sign of the sine flipped (`conjugate`
inverted), and a device kernel registered for the CPU in the op's kernel registry that does the same; the checker
itself is never replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch

import rope_fusion
from rope_fusion.ops import backends, device_runners, slice_write
from rope_fusion.ops.backends import Backend, emit_op_call
from rope_fusion.ops.device_registry import DeviceKernel
from rope_fusion.ops.op_definition import OPS
from rope_fusion.ops.reference import reference_outputs
from rope_fusion.passes import fusion_check
from rope_fusion.passes.auto import auto_decisions, auto_timing
from tests.helpers.compile_pass import compile_with_pass, static_lanes
from tests.helpers.numerics import check_numerics, contract_errors

pytestmark = pytest.mark.triton_on_cpu(serves=("slice_write",))  # the Triton backend, in place for the slice op too


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rope_qk(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _args(tokens=16, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, tokens, heads, dim, generator=g), torch.randn(1, tokens, heads, dim, generator=g),
            torch.randn(tokens, 1, dim, generator=g), torch.randn(tokens, 1, dim, generator=g))


def _flipped(call):
    """The call with the sine's sign flipped: a rotation by the opposite angle, the bug of a kernel that gets the
    sign of one product wrong."""
    return dataclasses.replace(call, params=call.params.replace(conjugate=not call.params.conjugate))


def _backend(wrong: bool) -> Backend:
    """A backend record (registered under "npu", which no CPU build has) that emits the op, or the op with the
    sine's sign flipped."""
    def emit(em, call, like):
        return emit_op_call(OPS, em, _flipped(call) if wrong else call, like)
    return Backend("npu", lambda spec: None, emit)


@pytest.fixture
def registered(monkeypatch):
    """Registers a backend record for the test, the registry restored afterwards."""
    backends.load_backends()

    def register(backend: Backend) -> None:
        monkeypatch.setitem(backends._BACKENDS, backend.name, backend)
    return register


def _disagreements(p) -> list:
    return [m for m in p.report.misses if m.reason.startswith(fusion_check.PHRASE)]


# -- the pass's eager check (verify=True) ---------------------------------------------------------------------------

def test_a_backend_that_flips_a_sign_is_refused(registered, caplog):
    registered(_backend(wrong=True))
    args = _args()
    before = dict(fusion_check.STATS)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        out, p = compile_with_pass(rope_qk, *args, backend="npu", verify=True)
    assert not p.report.kernels and len(_disagreements(p)) == 2, p.report.table()
    assert all("max err" in m.reason for m in p.report.misses), p.report.table()
    assert any(fusion_check.PHRASE in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert fusion_check.STATS["refused"] == before.get("refused", 0) + 1
    check_numerics(rope_qk, args, out)  # the model's code ran


def test_without_the_check_the_wrong_backend_gives_wrong_numbers(registered):
    """What the check stands between: the same backend fused without it changes the result."""
    registered(_backend(wrong=True))
    args = _args(seed=1)
    out, p = compile_with_pass(rope_qk, *args, backend="npu", verify=False)
    assert len(p.report.kernels) == 1, p.report.table()
    (ef, eo, eps), _ = contract_errors(rope_qk, args, out)
    assert ef > eo + eps and ef > 0.1


@pytest.mark.parametrize("verify", [True, None])
def test_a_right_backend_passes(registered, monkeypatch, verify):
    """verify=True, or verify=None with ROPE_FUSION_VERIFY=1 (the test suite's setting)."""
    monkeypatch.setenv(fusion_check.ENV, "1")
    registered(_backend(wrong=False))
    args = _args(seed=2)
    before = fusion_check.STATS["checked"]
    out, p = compile_with_pass(rope_qk, *args, backend="npu", verify=verify)
    assert [k.backend for k in p.report.kernels] == ["npu"] and not p.report.misses, p.report.table()
    assert fusion_check.STATS["checked"] == before + 1
    check_numerics(rope_qk, args, out)


def test_the_switch_and_the_option():
    assert fusion_check.enabled(True) and not fusion_check.enabled(False)
    on, off = rope_fusion.RopeFusionPass(verify=True), rope_fusion.RopeFusionPass(verify=False)
    assert on.uuid() != off.uuid() and "verify=True" in repr(on)
    import pickle

    assert pickle.loads(pickle.dumps(on)).verify is True
    with pytest.raises(ValueError, match="verify"):
        rope_fusion.RopeFusionPass(verify="yes")


def gathered(q, k, cache, positions):
    """vLLM's form: one [max_pos, D] cos|sin cache gathered by integer positions."""
    cos, sin = cache.index_select(0, positions).chunk(2, -1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rot(x):
        x1, x2 = x[..., :8], x[..., 8:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    return rot(q), rot(k)


@pytest.mark.parametrize("wrong", [False, True])
def test_positions_index_valid_rows(registered, wrong):
    """Random positions stay below the cache's rows (valid indices), so the check runs rather than skipping."""
    registered(_backend(wrong=wrong))
    T, P = 12, 40
    args = (torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(P, 16), torch.randint(0, P, (T,)))
    before = dict(fusion_check.STATS)
    out, p = compile_with_pass(gathered, *args, backend="npu", verify=True)
    assert fusion_check.STATS["checked"] == before.get("checked", 0) + 1
    assert fusion_check.STATS["skipped"] == before.get("skipped", 0)
    if wrong:
        assert not p.report.kernels and len(_disagreements(p)) == 2, p.report.table()
    else:
        assert len(p.report.kernels) == 1 and not p.report.misses, p.report.table()
    check_numerics(gathered, args, out)


def strided_inputs(x, cos, sin):
    """x read through a view with gaps and tables that broadcast by a zero stride."""
    y = x[:, ::2]
    return y * cos + rotate_half(y) * sin


@pytest.mark.parametrize("wrong", [False, True])
def test_inputs_keep_their_strides(registered, wrong):
    registered(_backend(wrong=wrong))
    x = torch.randn(2, 10, 3, 16)
    cos, sin = torch.randn(5, 1, 16).expand(5, 3, 16), torch.randn(5, 1, 16).expand(5, 3, 16)
    before = fusion_check.STATS["checked"]
    out, p = compile_with_pass(strided_inputs, x, cos, sin, backend="npu", verify=True)
    assert fusion_check.STATS["checked"] == before + 1
    assert (not p.report.kernels) == wrong and (len(_disagreements(p)) == 1) == wrong, p.report.table()
    check_numerics(strided_inputs, (x, cos, sin), out)


def test_dynamic_sizes_are_checked_at_their_example_values_without_guards(registered):
    """Under dynamic=True the check evaluates at the sizes' hints: no guard, so no more graphs than without it."""
    registered(_backend(wrong=False))
    graphs = {}
    for verify in (False, True):
        torch._dynamo.reset()
        p = rope_fusion.RopeFusionPass(backend="npu", verify=verify)
        count = []

        def counting(gm, example_inputs, p=p, count=count):
            from torch._inductor.compile_fx import compile_fx

            count.append(1)
            return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": p})
        f = torch.compile(rope_qk, backend=counting, dynamic=True, fullgraph=True)
        with torch._inductor.config.patch(fx_graph_cache=False):
            for tokens in (16, 24, 40):
                args = static_lanes(_args(tokens=tokens, seed=tokens))
                check_numerics(rope_qk, args, f(*args))
        assert len(p.report.kernels) == 1, p.report.table()
        graphs[verify] = len(count)
    assert graphs[True] == graphs[False] == 1


# -- writes into a slice, in place (the Triton backend's fold, its kernel interpreted) ---------------------------

TEXT = 3


def rope_interleaved(x, cos, sin):
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return x * cos + torch.stack([-imag, real], -1).flatten(-2) * sin


def write_back(q, cos, sin):
    """The rotation written back into the rows it read, of a graph input (a `copy_` into q after the scatter)."""
    q[:, :, TEXT:] = rope_interleaved(q[:, :, TEXT:], cos, sin)
    return q * 1.0


def read_again(x, cos, sin):
    """The written base is read again after the write: Inductor writes into a clone."""
    y = x * 2.0
    z = torch.slice_scatter(y, rope_interleaved(y[:, :, TEXT:], cos, sin), 2, TEXT)
    return z, y + 1.0


def _flipped_in_place(call, views) -> bool:
    """An in-place kernel that writes the rotation by the opposite angle into the slices."""
    for view, out in zip(views, reference_outputs(_flipped(call))):
        view.copy_(out)
    return True


@pytest.mark.parametrize("fn", [write_back, read_again])
def test_slice_writes_in_place(triton_on_cpu, fn):
    """The fold's auto_functionalized call evaluated on its own copies of the bases (the op by its reference on
    the CPU): it passes, and the result (a graph input written back, a base read again) is right."""
    x = torch.randn(2, 2, 11, 16)
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    before = dict(fusion_check.STATS)
    out, p = compile_with_pass(fn, x.clone(), cos, sin, backend="triton", verify=True)
    assert fusion_check.STATS["checked"] == before.get("checked", 0) + 1, p.report.table()
    assert fusion_check.STATS["skipped"] == before.get("skipped", 0)
    assert p.report.kernels[0].fold.startswith("slice write:"), p.report.table()
    check_numerics(fn, (x.clone(), cos, sin), out)


# -- `auto`'s measured candidates -----------------------------------------------------------------------------------

@pytest.fixture
def clock(tmp_path, monkeypatch):
    """`auto` measuring on the CPU with a steered clock (runs each candidate once, returns the time set for it), its
    decisions in a fresh cache dir, and the Triton backend's candidate allowed on CPU tensors."""
    import rope_fusion.kernels.triton_launch as launching

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(auto_timing, "_MEASURE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ["triton", "inductor"])
    monkeypatch.setattr(launching, "INTERPRETED", True)

    class Clock:
        times: dict = {}
        calls: list = []

        def __call__(self, name, run):
            run()
            self.calls.append(name)
            return self.times[name]
    c = Clock()
    c.calls = []
    monkeypatch.setattr(auto_timing, "TIMER", c)
    return c


def _kernel(wrong: bool, monkeypatch) -> None:
    """The CPU's device kernel of the op (what the "triton" candidate runs here): the reference, or with the
    sine's sign flipped."""
    def impl(call):
        return reference_outputs(_flipped(call) if wrong else call)
    monkeypatch.setitem(device_runners.ROTARY_KERNELS.kernels, "cpu", DeviceKernel(impl))


def test_auto_refuses_a_candidate_that_disagrees_and_leaves_the_site(clock, monkeypatch, caplog):
    _kernel(True, monkeypatch)
    clock.times = {"left": 10e-6, "triton": 2e-6, "inductor": 12e-6}
    args = _args(seed=3)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        out, p = compile_with_pass(rope_qk, *args, verify=False)
    assert not p.report.kernels and len(_disagreements(p)) == 2, p.report.table()
    assert "(triton); measured left 10.0 us, inductor 12.0 us" in p.report.misses[0].reason, p.report.table()
    assert any("auto's candidate 'triton' refused" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
    check_numerics(rope_qk, args, out)


def test_auto_takes_another_candidate_and_does_not_cache_the_refusal(clock, monkeypatch):
    _kernel(True, monkeypatch)
    clock.times = {"left": 10e-6, "triton": 2e-6, "inductor": 5e-6}
    args = _args(seed=4)
    out, p = compile_with_pass(rope_qk, *args, verify=False)
    assert [k.backend for k in p.report.kernels] == ["inductor"], p.report.table()
    assert f"refused triton: {fusion_check.PHRASE}" in p.report.kernels[0].choice, p.report.table()
    assert not auto_decisions.DECISIONS.digest(), "a decision with a refusal is not cached"
    check_numerics(rope_qk, args, out)


def test_auto_checks_a_right_candidate_and_times_it(clock, monkeypatch):
    _kernel(False, monkeypatch)
    clock.times = {"left": 10e-6, "triton": 2e-6, "inductor": 5e-6}
    before = fusion_check.STATS["checked"]
    args = _args(seed=5)
    out, p = compile_with_pass(rope_qk, *args, verify=False)
    assert sorted(clock.calls) == ["inductor", "left", "triton"]
    assert fusion_check.STATS["checked"] == before + 2  # both fused candidates compared with left
    assert p.report.kernels and p.report.kernels[0].choice.startswith("measured triton 2.0 us"), p.report.table()
    assert auto_decisions.DECISIONS.digest(), "the decision is cached"
    check_numerics(rope_qk, args, out)


def test_auto_checks_the_fold_of_a_write_back(clock, triton_on_cpu, monkeypatch):
    """A slice write into a graph input: "left" writes the input back, the fold writes its base in place; the
    inputs are restored before each candidate's first run, so each is compared on the same numbers."""
    clock.times = {"left": 10e-6, "triton": 2e-6, "inductor": 12e-6}
    x = torch.randn(2, 2, 11, 16)
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    for wrong in (False, True):
        if wrong:
            monkeypatch.setitem(slice_write.IN_PLACE_KERNELS.kernels, "cpu", DeviceKernel(_flipped_in_place))
            rope_fusion.clear_caches()  # the first compile's plan of this geometry is gone
        clock.calls = []
        shutil.rmtree(auto_decisions.cache_dir(), ignore_errors=True)  # measured anew, not read from the first
        before = fusion_check.STATS["refused"]
        out, p = compile_with_pass(write_back, x.clone(), cos, sin, verify=False, measure=True)
        assert fusion_check.STATS["refused"] == before + wrong
        assert bool(_disagreements(p)) == wrong, p.report.table()
        check_numerics(write_back, (x.clone(), cos, sin), out)


@pytest.mark.parametrize("wrong", [False, True])
def test_auto_checks_gathered_tables_on_valid_positions(clock, monkeypatch, wrong):
    """Positions that `auto` builds pick valid rows of the cache, so the candidates are compared, not skipped."""
    _kernel(wrong, monkeypatch)
    clock.times = {"left": 10e-6, "triton": 2e-6, "inductor": 12e-6}
    T, P = 12, 40
    args = (torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(P, 16), torch.randint(0, P, (T,)))
    before = dict(fusion_check.STATS)
    out, p = compile_with_pass(gathered, *args, verify=False)
    assert fusion_check.STATS["checked"] == before.get("checked", 0) + 2
    assert fusion_check.STATS["skipped"] == before.get("skipped", 0)
    assert bool(_disagreements(p)) == wrong and bool(p.report.kernels) != wrong, p.report.table()
    check_numerics(gathered, args, out)
