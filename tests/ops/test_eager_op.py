"""The public functions' eager path (ops/public_functions.py `_apply`) and its per-device dispatch, on the CPU.

An eager call goes straight to its device's kernel through a plan cached by the call's geometry: on CUDA the
Triton kernel's own launcher (never `wrap_triton`, which only a tracer needs), validated once per geometry. Here
the CUDA planner serves CPU tensors with the kernel under Triton's interpreter (as tests/kernels/test_triton_kernels.py
runs it), so the numbers are the kernel's, checked against an fp64 oracle, and the launcher's calls are counted.
Calls that need autograd, run under torch.compile or under fake tensors go through the op instead. The NPU
selection runs with the stand-in torch_npu ops of tests/helpers/npu_standins.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

import rope_fusion
from rope_fusion.ops import device_runners, public_functions
from rope_fusion.ops.device_registry import DeviceKernel
from rope_fusion.ops.plan_cache import plan_cache
from rope_fusion.ops.reference import rotary_reference

pytest.importorskip("triton")

import rope_fusion.kernels.triton_launch as launching  # noqa: E402
import rope_fusion.kernels.triton_rotary  # noqa: E402, F401  (registers the CUDA device kernel)


class CountingLauncher:
    """The interpreted kernel, counting its direct launches (`kernel[grid](...)`)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


pytestmark = pytest.mark.triton_on_cpu(serves=("eager",), wrap=CountingLauncher)  # the CUDA device kernel, counted


@pytest.fixture
def kernel_on_cpu(triton_on_cpu, monkeypatch):
    """CPU tensors served by the CUDA device kernel (the Triton planner, tests/conftest.py), its launches counted;
    wrap_triton fails the test if called. A fresh plan cache, so no plan of another test is reused."""

    def no_wrap(*a, **k):
        raise AssertionError("wrap_triton called on the eager path")

    monkeypatch.setattr(launching, "wrap_triton", no_wrap)
    rope_fusion.clear_caches()
    return triton_on_cpu.rotary


def oracle(x, cos, sin, **kw):
    """fp64 evaluation of the reference, as the op's contract defines it."""
    kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    return rotary_reference(x.double(), cos.double(), sin.double(), out_dtype=torch.float64, **kw)


def close(out, want, dtype):
    tol = 2 * torch.finfo(dtype).eps * want.abs().max().item() + 1e-6
    err = (out.double() - want).abs().max().item()
    assert err <= tol, (err, tol)


def rand_tables(lead, width):
    a = torch.rand(*lead, width, dtype=torch.float64) * 6
    return a.cos().float(), a.sin().float()


CASES = [  # name, q shape, k shape, options, table lead dims
    ("neox_d80_gqa", (1, 3, 4, 80), (1, 3, 2, 80), {}, (3, 1)),
    ("interleaved_flux", (1, 4, 3, 32), (1, 4, 3, 32), dict(interleaved=True), (4, 1)),
    ("full_tables_partial", (2, 2, 2, 64), (2, 2, 1, 64), dict(full_tables=True, rotary_dim=32), (2, 1)),
    ("conjugate_offset", (3, 4, 48), (3, 2, 48), dict(conjugate=True, rotary_offset=16), (3, 1)),
]


@pytest.mark.parametrize("name,qs,ks,kw,lead", CASES, ids=[c[0] for c in CASES])
def test_eager_call_launches_the_kernel_directly(kernel_on_cpu, name, qs, ks, kw, lead):
    torch.manual_seed(0)
    q, k = torch.randn(qs, dtype=torch.bfloat16), torch.randn(ks, dtype=torch.bfloat16)
    r = kw.get("rotary_dim", qs[-1] - kw.get("rotary_offset", 0))
    cos, sin = rand_tables(lead, r if kw.get("full_tables") else r // 2)
    qo, ko = rope_fusion.apply_rotary_qk(q, k, cos, sin, **kw)
    assert kernel_on_cpu.launches == 1  # q and k in one launch, through the kernel's own launcher
    full = {**dict(interleaved=False, rotary_dim=r, full_tables=False), **kw}
    close(qo, oracle(q, cos, sin, **full), torch.bfloat16)
    close(ko, oracle(k, cos, sin, **full), torch.bfloat16)
    # fresh inputs of the same geometry reuse the plan: one more launch, no new plan
    q2, k2 = torch.randn_like(q), torch.randn_like(k)
    qo2, ko2 = rope_fusion.apply_rotary_qk(q2, k2, cos, sin, **kw)
    assert kernel_on_cpu.launches == 2 and len(plan_cache("rotary.direct")) == 1
    close(qo2, oracle(q2, cos, sin, **full), torch.bfloat16)
    close(ko2, oracle(k2, cos, sin, **full), torch.bfloat16)


def test_positions_norm_and_qkv_on_the_direct_path(kernel_on_cpu):
    torch.manual_seed(1)
    t, d = 4, 64
    q, k, v = (torch.randn(t, h, d) for h in (4, 2, 2))
    cache = torch.rand(32, d // 2, dtype=torch.float64) * 6
    cos, sin = cache.cos().float(), cache.sin().float()
    pos = torch.randint(0, 32, (t, 1))
    wq, wk = torch.randn(d), torch.randn(d)
    qo, ko = rope_fusion.apply_rotary_qk(q, k, cos, sin, positions=pos, norm="rms", q_norm_weight=wq,
                                         k_norm_weight=wk, norm_eps=1e-5)
    kw = dict(interleaved=False, rotary_dim=d, full_tables=False, positions=pos, norm="rms", norm_eps=1e-5)
    close(qo, oracle(q, cos, sin, norm_weight=wq, **kw), torch.float32)
    close(ko, oracle(k, cos, sin, norm_weight=wk, **kw), torch.float32)
    outs = rope_fusion.apply_rotary_qkv(q, k, v, cos, sin, positions=pos, interleaved=True)
    for x, o in zip((q, k, v), outs):
        close(o, oracle(x, cos, sin, interleaved=True, rotary_dim=d, full_tables=False, positions=pos),
              torch.float32)
    assert kernel_on_cpu.launches == 2


def test_validation_runs_once_per_geometry_and_bad_calls_still_raise(kernel_on_cpu, monkeypatch):
    checks = []
    real = public_functions.check_call
    monkeypatch.setattr(public_functions, "check_call", lambda call: checks.append(1) or real(call))
    q = torch.randn(2, 4, 2, 16)
    cos, sin = rand_tables((4, 1), 8)
    for _ in range(3):
        rope_fusion.apply_rotary_qk(q, q, cos, sin)
    assert len(checks) == 1 and kernel_on_cpu.launches == 3
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_fusion.apply_rotary_qk(q, q, cos, sin, rotary_dim=6)
    with pytest.raises(ValueError, match="does not broadcast"):
        rope_fusion.apply_rotary(q, *rand_tables((3, 1), 8))
    with pytest.raises(TypeError, match="interleave"):
        rope_fusion.apply_rotary(q, cos, sin, interleave=True)


def test_autograd_goes_through_the_op(kernel_on_cpu):
    """With an input that requires grad the op runs (its CPU kernel: the reference), so its backward works."""
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in rand_tables((5, 1), 4))
    assert torch.autograd.gradcheck(lambda x: rope_fusion.apply_rotary(x, cos, sin), (x,))
    assert kernel_on_cpu.launches == 0
    with torch.no_grad():  # no autograd to record: the direct path
        out = rope_fusion.apply_rotary(x, cos, sin)
    assert kernel_on_cpu.launches == 1 and not out.requires_grad
    close(out, oracle(x.detach(), cos, sin, interleaved=False, rotary_dim=8, full_tables=False), torch.float64)


def test_traced_calls_go_through_the_op(kernel_on_cpu):
    """torch.compile traces the public function into the op (the pass's graphs and Inductor's lowering see it);
    fake tensors get the op's fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(2)
    q, k = torch.randn(2, 6, 4, 32), torch.randn(2, 6, 2, 32)
    cos, sin = rand_tables((6, 1), 16)
    graphs = []

    def backend(gm, inputs):  # the traced graph holds the op; aot_eager then runs it
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, inputs)

    fn = torch.compile(lambda q, k: rope_fusion.apply_rotary_qk(q, k, cos, sin, interleaved=True),
                       backend=backend, fullgraph=True)
    qo, ko = fn(q, k)
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.rope_fusion.rotary_qk.default in targets, targets
    kw = dict(interleaved=True, rotary_dim=32, full_tables=False)
    close(qo, oracle(q, cos, sin, **kw), torch.float32)
    close(ko, oracle(k, cos, sin, **kw), torch.float32)
    with FakeTensorMode() as mode:
        fq, fc, fs = mode.from_tensor(q), mode.from_tensor(cos), mode.from_tensor(sin)
        out = rope_fusion.apply_rotary(fq, fc, fs, out_dtype=torch.bfloat16)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert kernel_on_cpu.launches == 0 and not plan_cache("rotary.direct")


def test_cpu_runs_the_reference():
    """Without a device kernel for the CPU, the direct path runs the reference itself."""
    torch.manual_seed(3)
    x = torch.randn(3, 7, 2, 24, dtype=torch.float64)
    cos, sin = (t.double() for t in rand_tables((7, 1), 12))
    assert "cpu" not in device_runners.ROTARY_KERNELS.kernels
    out = rope_fusion.apply_rotary(x, cos, sin, rotary_blocks=2)
    want = rotary_reference(x, cos, sin, interleaved=False, rotary_dim=24, full_tables=False, rotary_blocks=2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# Ascend: the torch_npu op that fits, else the reference with one log line (stand-in ops of the real schemas)


@pytest.fixture
def npu_on_cpu(monkeypatch):
    from rope_fusion.kernels import npu as bridge
    from tests.helpers import npu_standins as nb

    monkeypatch.setattr(bridge, "OP_NAMESPACE", nb.NS)
    monkeypatch.setattr(bridge, "_LOGGED", set())
    monkeypatch.setitem(device_runners.ROTARY_KERNELS.kernels, "cpu", DeviceKernel(bridge._impl))
    rope_fusion.clear_caches()
    nb.CALLS.clear()
    return nb.CALLS


def test_npu_selection_per_case(npu_on_cpu, caplog):
    torch.manual_seed(4)
    q, k = torch.randn(2, 6, 4, 128, dtype=torch.bfloat16), torch.randn(2, 6, 2, 128, dtype=torch.bfloat16)
    c, s = (t.to(torch.bfloat16) for t in rand_tables((6, 1), 64))
    kw = dict(interleaved=False, rotary_dim=128, full_tables=False)
    qo, ko = rope_fusion.apply_rotary_qk(q, k, c, s)  # BSND, 'half', D=128, one dtype: one apply call
    assert [call[0] for call in npu_on_cpu] == ["apply"]
    close(qo, oracle(q, c, s, **kw), torch.bfloat16)
    close(ko, oracle(k, c, s, **kw), torch.bfloat16)
    npu_on_cpu.clear()
    qo, ko = rope_fusion.apply_rotary_qk(q, k, c, s, interleaved=True)  # interleaved: npu_rotary_mul per tensor
    assert [(call[0], call[3]) for call in npu_on_cpu] == [("rotary_mul", "interleave")] * 2
    close(qo, oracle(q, c, s, **{**kw, "interleaved": True}), torch.bfloat16)
    npu_on_cpu.clear()
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        for _ in range(2):  # no torch_npu op de-interleaves: the reference, one line for both calls
            qo, _ = rope_fusion.apply_rotary_qk(q, k, c, s, interleaved=True, deinterleave=True)
        x5 = torch.randn(2, 6, 2, 2, 64)  # 5-D x: outside npu_rotary_mul's documented layouts
        c5, s5 = rand_tables((6, 1, 1), 32)
        out5 = rope_fusion.apply_rotary(x5, c5, s5)
    assert npu_on_cpu == []
    lines = [r.getMessage() for r in caplog.records if "torch_npu's RoPE ops cannot take" in r.getMessage()]
    assert len(lines) == 2 and "de-interleaved" in lines[0] and "(2, 6, 2, 2, 64)" in lines[1], lines
    close(qo, oracle(q, c, s, **{**kw, "interleaved": True, "deinterleave": True}), torch.bfloat16)
    close(out5, oracle(x5, c5, s5, **{**kw, "rotary_dim": 64}), torch.float32)


def test_compiled_kernel_launcher_is_checked_once_against_the_jit_launcher(kernel_on_cpu, monkeypatch, caplog):
    """After the first launch of a plan, later ones call the compiled kernel's launcher; its first use is compared
    with the JIT launcher's result. Here a stand-in for the compiled launcher runs the interpreted kernel (right)
    or writes zeros (wrong: a warning, the JIT launcher's values, the JIT launcher from then on)."""
    used = []

    def runner_of(write_zeros):
        def make(compiled, grid, meta, n_args):
            def run(*args):
                used.append(grid)
                if write_zeros:
                    for out in args[3:6]:
                        out.zero_()
                else:
                    kernel_on_cpu.kernel[grid](*args, **meta)
            return run
        return make

    torch.manual_seed(5)
    cos, sin = rand_tables((3, 1), 16)
    kw = dict(interleaved=False, rotary_dim=32, full_tables=False)
    for write_zeros in (False, True):
        monkeypatch.setattr(launching, "_compiled_runner", runner_of(write_zeros))
        rope_fusion.clear_caches()
        used.clear()
        kernel_on_cpu.launches = 0
        with caplog.at_level(logging.WARNING, logger="rope_fusion"):
            for _ in range(3):
                q, k = torch.randn(2, 3, 4, 32), torch.randn(2, 3, 2, 32)
                qo, ko = rope_fusion.apply_rotary_qk(q, k, cos, sin)
                close(qo, oracle(q, cos, sin, **kw), torch.float32)
                close(ko, oracle(k, cos, sin, **kw), torch.float32)
        warned = [r for r in caplog.records if "compiled-kernel launcher wrote other values" in r.getMessage()]
        # right: JIT, then compiled + JIT (the check), then compiled only; wrong: JIT, compiled + JIT, JIT
        assert (kernel_on_cpu.launches, len(used), len(warned)) == ((3, 1, 1) if write_zeros else (2, 2, 0))


# ---------------------------------------------------------------------------------------------------------
# On a GPU: the compiled kernel's launcher in use after its check, pointer alignment in the plan key, graph capture

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("interleaved", [False, True])
def test_cuda_direct_path_every_call_and_after_the_launcher_check(interleaved, monkeypatch):
    rope_fusion.clear_caches()
    torch.manual_seed(6)
    t, d = 300, 80 if not interleaved else 128
    cos, sin = (x.cuda() for x in rand_tables((t, 1), d // 2))
    kw = dict(interleaved=interleaved, rotary_dim=d, full_tables=False)
    for offset in (0, 0, 0, 0, 1, 1, 1):  # 1: q starts one element into its storage (not 16-byte aligned)
        q = torch.randn(t * 8 * d + offset, device="cuda", dtype=torch.bfloat16)[offset:].view(t, 8, d)
        k = torch.randn(t, 2, d, device="cuda", dtype=torch.bfloat16)
        qo, ko = rope_fusion.apply_rotary_qk(q, k, cos, sin, interleaved=interleaved)
        close(qo, oracle(q, cos, sin, **kw), torch.bfloat16)
        close(ko, oracle(k, cos, sin, **kw), torch.bfloat16)
    plans = list(plan_cache("rotary.direct").values())
    assert len(plans) == 2  # aligned and not: two plans, each specialized as Triton compiled it
    for plan in plans:
        assert isinstance(plan.run, launching.DirectLaunches)
        assert all(entry[5] for entry in plan.run.entries), "the compiled kernel's launcher is not in use"


@cuda
def test_cuda_direct_path_in_a_cuda_graph(monkeypatch):
    rope_fusion.clear_caches()
    torch.manual_seed(7)
    q, k = torch.randn(64, 4, 64, device="cuda"), torch.randn(64, 2, 64, device="cuda")
    cos, sin = (x.cuda() for x in rand_tables((64, 1), 32))
    for _ in range(3):  # plan, then the compiled launcher's check, outside capture
        rope_fusion.apply_rotary_qk(q, k, cos, sin)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qo, ko = rope_fusion.apply_rotary_qk(q, k, cos, sin)
    q.copy_(torch.randn_like(q))
    k.copy_(torch.randn_like(k))
    graph.replay()
    kw = dict(interleaved=False, rotary_dim=64, full_tables=False)
    close(qo, oracle(q, cos, sin, **kw), torch.float32)
    close(ko, oracle(k, cos, sin, **kw), torch.float32)
