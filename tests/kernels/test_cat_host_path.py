"""The cat ops' host path (kernels/triton_cat.py `launch_cat`): a call geometry is checked and planned once, and
its later calls replay the launch (`_CatRunner`): through the kernel's JIT launcher under the interpreter, through
the compiled kernel on the GPU, with every kernel parameter passed positionally and the call's tensors put in their
slots per call. The joined form's q2, k2 and their weights are parameters after the constexprs: a replay that fixed
them as constants would rotate the first call's pieces on every later call.

The Triton kernel runs interpreted on the CPU (tests/helpers/triton_interpreted.py, as tests/passes/test_cat_pieces.py
runs it; one test runs a process with TRITON_INTERPRET=1 itself). The compiled kernel's replay is run here through a
stand-in compiled kernel whose launcher runs the interpreted kernel with the replay's positional arguments; the static
launcher's argument layout is checked on a CAT launch compiled for sm_90 on the CPU (as
tests/kernels/test_static_launch.py checks the plain launches'). `python tests/kernels/test_cat_host_path.py` prints the
host time of launch_cat at a Flux shape with the kernel launch stubbed; with `--gpu`, on CUDA, the replay's launcher,
its results against the reference (eager and in a CUDA graph) and the op's host time per call, replayed and through the
JIT launcher.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.compiler import CompiledKernel  # noqa: E402

import rope_fusion.kernels.triton_rotary  # noqa: E402,F401  (registers the backend and the cat ops' kernel)
from rope_fusion.kernels import triton_cat, triton_launch  # noqa: E402
from rope_fusion.ops import cat_rotary  # noqa: E402
from rope_fusion.ops.plan_cache import plan_cache  # noqa: E402
from tests.helpers.triton_cpu import CountingLaunches  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADS, D = 2, 16


class _StandInCompiled(CompiledKernel):
    """A compiled kernel whose launcher, `compiled[grid](*every parameter in order)`, runs the interpreted kernel
    with those positional arguments: the compiled launcher's calling convention, run on the CPU."""

    def __init__(self, kernel, record: list) -> None:  # noqa: D107 (no compilation: nothing of the base is set)
        self.interpreted, self.record = kernel, record

    def __getitem__(self, grid):
        def run(*args):
            self.record.append(args)
            self.interpreted[grid](*args)
        return run

    def __del__(self) -> None:  # the base releases a loaded module
        pass


class _JITStandIn:
    """The JIT kernel as `launch_cat` sees it on the GPU: its launch runs the interpreted kernel and returns a
    compiled kernel (`_StandInCompiled`); its parameter names are the real kernel's."""

    def __init__(self, kernel, names) -> None:
        self.kernel, self.arg_names, self.jit_launches, self.replays = kernel, list(names), 0, []

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            self.jit_launches += 1
            run(*args, **kwargs)
            return _StandInCompiled(self.kernel, self.replays)
        return launch


pytestmark = pytest.mark.triton_on_cpu(serves=("cat",), wrap=CountingLaunches)  # the kernel's launches counted


@pytest.fixture
def triton_on_cpu(triton_on_cpu, monkeypatch):
    """The Triton backend on CPU tensors serving the cat ops (tests/conftest.py), with empty plan caches and the
    planner's calls counted (`plans`)."""
    plans = []
    real = triton_cat.plan_cat

    def counting(cat, outs):
        plans.append(tuple(tuple(x.shape) for x in (*cat.firsts, *cat.seconds)))
        return real(cat, outs)

    monkeypatch.setattr(triton_cat, "plan_cat", counting)
    return plans


def _inputs(text=3, image=5, dtype=torch.float32, norm="rms", positions=False, b=2, strided_lanes=False):
    """A joint q/k call's arguments (text pieces first, the image pieces second, joined along dim 1), fresh random
    values: (args, keywords)."""
    r = torch.randn

    def piece(s):
        if strided_lanes:  # lanes 2 apart: the pieces are copied first (`_launch`)
            return r(b, s, HEADS, 2 * D, dtype=dtype)[..., ::2]
        return r(b, s, HEADS, D, dtype=dtype)
    q0, k0, q1, k1 = piece(text), piece(text), piece(image), piece(image)
    w = [1.0 + 0.1 * r(D, dtype=dtype) for _ in range(4)] if norm != "none" else [None] * 4
    rows = text + image + 3
    angles = r(rows if positions else text + image, D // 2)
    cos, sin = angles.cos(), angles.sin()
    if positions:  # rows of a cache picked per token of the joined x, [b, S, 1]: broadcast over the heads
        pos = torch.stack([torch.randperm(rows)[:text + image] for _ in range(b)])[..., None]
    else:  # per pair, broadcast over the heads
        pos, cos, sin = None, cos[:, None], sin[:, None]
    params = dict(interleaved=True, rotary_dim=D, full_tables=False, conjugate=False, out_dtype=dtype, norm=norm,
                  norm_eps=1e-6)
    args = (q0, k0, cos, sin, pos, w[0], w[1])
    return args, dict(params, second_pieces=[q1, k1], second_norm_weights=[w[2], w[3]], cat_dims=[1, 1])


def _exact(args, kw):
    """The module's reference on fp64 copies (fp64 math, fp64 out)."""
    def wide(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    kw = dict(kw, out_dtype=torch.float64, second_pieces=[wide(t) for t in kw["second_pieces"]],
              second_norm_weights=[wide(t) for t in kw["second_norm_weights"]])
    return cat_rotary.reference(cat_rotary.parse(2, tuple(wide(a) for a in args), kw))


def _check(outs, args, kw):
    dtype = kw["out_dtype"]
    for out, exact in zip(outs, _exact(args, kw)):
        assert out.dtype == dtype and out.shape == exact.shape and not out.isnan().any()
        tol = 2 * torch.finfo(dtype).eps * exact.abs().max().item() + 1e-6
        err = (out.double() - exact).abs().max().item()
        assert err <= tol, (err, tol)


def _launch(args, kw):
    """launch_cat on the parsed call (the op's `_eager` parses, then calls it); its outputs, never the reference."""
    outs = triton_cat.launch_cat(cat_rotary.parse(2, args, kw))
    assert outs is not None
    return outs


@pytest.mark.parametrize("norm,positions", [("rms", False), ("none", True), ("rms_across_heads", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_calls_of_one_geometry_plan_once(triton_on_cpu, norm, positions, dtype):
    """Fresh inputs of one geometry each call: each call's own result (fp64 reference), one plan, one launch a
    call."""
    from tests.helpers.interpreted_rotary import poisoned_outputs

    for _ in range(4):
        args, kw = _inputs(dtype=dtype, norm=norm, positions=positions)
        with poisoned_outputs():  # outputs start as NaN: an element the kernel did not write shows
            _check(_launch(args, kw), args, kw)
    assert len(triton_on_cpu) == 1 and len(plan_cache("cat.runners")) == 1, triton_on_cpu
    assert triton_launch.rotary_kernel.launches == 4
    runner = next(iter(plan_cache("cat.runners").values()))
    assert runner.replay is False  # the interpreter's launch returns no compiled kernel: the JIT launcher stays


def test_the_op_serves_repeated_calls_from_the_plan(triton_on_cpu):
    """Through the op (`rope_fusion::rotary_qk_cat`: parse, then the kernel's served function)."""
    for _ in range(3):
        args, kw = _inputs()
        _check(cat_rotary.CAT_OPS[1](*args, **kw), args, kw)
    assert len(triton_on_cpu) == 1 and triton_launch.rotary_kernel.launches == 3


def test_the_op_checks_a_geometry_once(triton_on_cpu, monkeypatch):
    """The op's checks (`cat_rotary.parse`: the pieces join, the rotary op's checks on the joined tensors) run on
    a geometry's first call; later calls of it take their parts as they are, each its own result; a call of
    another geometry is checked again, and a bad one still raises."""
    checked = []
    real = cat_rotary.parse
    # the op's parses, not the fp64 reference's (`_exact` parses its fp64 copies)
    monkeypatch.setattr(cat_rotary, "parse", lambda *a: (a[1][0].dtype != torch.float64 and checked.append(1))
                        or real(*a))
    rope_fusion.clear_caches()
    for _ in range(3):
        args, kw = _inputs()
        _check(cat_rotary.CAT_OPS[1](*args, **kw), args, kw)
    assert len(checked) == 1
    args, kw = _inputs(text=4)
    _check(cat_rotary.CAT_OPS[1](*args, **kw), args, kw)
    assert len(checked) == 2
    bad = dict(kw, second_pieces=[kw["second_pieces"][0][..., :-2], kw["second_pieces"][1]])
    with pytest.raises(ValueError, match="does not join"):
        cat_rotary.CAT_OPS[1](*args, **bad)


def test_a_second_geometry_gets_its_own_plan(triton_on_cpu):
    shapes = [dict(text=3, image=5), dict(text=4, image=2), dict(text=3, image=5, dtype=torch.bfloat16)]
    for _ in range(2):
        for shape in shapes:
            args, kw = _inputs(**shape)
            _check(_launch(args, kw), args, kw)
    assert len(triton_on_cpu) == 3 and len(plan_cache("cat.runners")) == 3, triton_on_cpu
    # the same shapes and strides at another alignment of the data are another geometry
    args, kw = _inputs()
    base = torch.randn(args[0].numel() + 1)
    q0 = base[1:].view(args[0].shape)  # 4 bytes past a 16-byte boundary: Triton specialises on alignment
    args = (q0, *args[1:])
    _check(_launch(args, kw), args, kw)
    assert len(triton_on_cpu) == 4


def test_every_tensor_of_a_call_is_read_per_call(triton_on_cpu, monkeypatch):
    """The compiled kernel's replay (as on the GPU, through a stand-in compiled kernel): every call's own pieces,
    norm weights, tables and positions reach the kernel. Call 1 goes through the JIT launcher, call 2 checks the
    replay against it, calls 3 and 4 replay alone."""
    import rope_fusion.kernels.triton_kernel as tk

    kernel = _JITStandIn(triton_launch.rotary_kernel.kernel, tk.rotary_kernel.arg_names)
    monkeypatch.setattr(triton_launch, "rotary_kernel", kernel)
    calls = []
    for _ in range(4):
        args, kw = _inputs(norm="rms", positions=True)
        outs = _launch(args, kw)
        _check(outs, args, kw)
        calls.append((args, kw, outs))
    runner = next(iter(plan_cache("cat.runners").values()))
    assert runner.checked and runner.replay, "the replay's check failed: it wrote other values than the JIT launch"
    assert kernel.jit_launches == 2 and len(kernel.replays) == 3  # calls 1, 2 JIT; calls 2, 3, 4 replayed
    assert len(triton_on_cpu) == 1
    # the last replay passed every parameter, and call 4's tensors in their slots: its outputs, its tables and
    # positions, and its second pieces and their weights (parameters after the constexprs)
    names = kernel.arg_names
    last = kernel.replays[-1]
    assert len(last) == len(names)
    args, kw, outs = calls[-1]
    mine = dict(qo_ptr=outs[0], ko_ptr=outs[1], cos_ptr=args[2], sin_ptr=args[3], pos_ptr=args[4], wq_ptr=args[5],
                wk_ptr=args[6], q2_ptr=kw["second_pieces"][0], k2_ptr=kw["second_pieces"][1],
                wq2_ptr=kw["second_norm_weights"][0], wk2_ptr=kw["second_norm_weights"][1])
    assert all(last[names.index(n)] is t for n, t in mine.items()), [n for n, t in mine.items()
                                                                      if last[names.index(n)] is not t]
    assert all(not torch.equal(a, b) for a, b in zip(calls[-1][2], calls[-2][2]))


def test_a_replay_that_differs_keeps_the_jit_launcher(triton_on_cpu, monkeypatch, caplog):
    """A replay that writes other values than the JIT launcher is dropped at its check, with one log line; every
    call stays right, the checked one too (the JIT launcher's result)."""
    import rope_fusion.kernels.triton_kernel as tk

    kernel = _JITStandIn(triton_launch.rotary_kernel.kernel, tk.rotary_kernel.arg_names)
    monkeypatch.setattr(triton_launch, "rotary_kernel", kernel)
    real = triton_cat.replay_launch

    def off_by_one(*a, **k):
        run = real(*a, **k)

        def wrong(tensors):
            run(tensors)
            tensors[3].add_(1)  # q's output
        return wrong

    monkeypatch.setattr(triton_cat, "replay_launch", off_by_one)
    for _ in range(4):
        args, kw = _inputs()
        _check(_launch(args, kw), args, kw)
    runner = next(iter(plan_cache("cat.runners").values()))
    assert runner.replay is False and not runner.checked
    assert "wrote other values than its JIT launcher" in caplog.text


def test_refused_and_copied_geometries_keep_their_paths(triton_on_cpu):
    """An empty piece: the reference, every call (None from the kernel), planned never. Lanes with a stride: the
    pieces copied first (`_launch`), right every call. A call on a device the kernel does not serve (the
    interpreter off): None."""
    args, kw = _inputs(image=0)
    for _ in range(2):
        assert triton_cat.launch_cat(cat_rotary.parse(2, args, kw)) is None
        _check(cat_rotary.CAT_OPS[1](*args, **kw), args, kw)
    assert not triton_on_cpu
    for _ in range(2):
        args, kw = _inputs(strided_lanes=True)
        assert not args[0].is_contiguous()
        _check(_launch(args, kw), args, kw)
    args, kw = _inputs()
    _check(_launch(args, kw), args, kw)
    triton_launch.INTERPRETED = False  # the fixture's monkeypatch restores it
    assert triton_cat.launch_cat(cat_rotary.parse(2, args, kw)) is None
    assert triton_cat.why_not(cat_rotary.parse(2, *_inputs(image=0))) == "a piece is empty"


def test_the_static_launchers_pointers_are_the_calls_tensors(monkeypatch):
    """On a CAT launch compiled for sm_90 (on the CPU): the runtime pointers that torch's static launcher takes
    (`triton_launch.static_arguments` over every kernel parameter) are exactly the slots where the replay puts the
    call's 16 tensors, q2, k2 and their weights among them, so no tensor of a call is fixed by the first; and the
    static launcher takes the kernel with those arguments."""
    if triton_launch._static_launcher_class() is None:
        pytest.skip("this torch has no static Triton launcher")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks import ptx_identity

    recorder = ptx_identity._Recorder()  # the launch as planned for CPU tensors, compiled below for the GPU
    monkeypatch.setattr(triton_launch, "rotary_kernel", recorder)
    monkeypatch.setattr(triton_launch, "INTERPRETED", True)
    rope_fusion.clear_caches()
    args, kw = _inputs(dtype=torch.bfloat16, norm="rms", positions=True)
    triton_cat.launch_cat(cat_rotary.parse(2, args, kw))
    (jit_args, jit_kwargs), = recorder.calls
    kernel = ptx_identity._kernel()
    names = list(kernel.arg_names)
    runner = next(iter(plan_cache("cat.runners").values()))
    layout = triton_cat.replay_layout(names, len(runner.scalars), runner.meta)
    assert layout is not None
    values, slots = layout
    # the layout's values are the JIT launch's, by name (the tensors' slots left to each call)
    bound = {**dict(zip(names, jit_args)), **jit_kwargs}
    values[12:12 + len(runner.scalars)] = runner.scalars
    for i, name in enumerate(names):
        if i in slots:
            assert isinstance(bound[name], torch.Tensor) and values[i] is None, name
        else:
            assert values[i] is bound[name] or values[i] == bound[name], name
    launch = ptx_identity.Launch("cat", 0, jit_args, {**jit_kwargs, **triton_launch.row_checks(args[4])})
    job, _ = ptx_identity.specialise(kernel, launch)
    compiled = triton.compile(ASTSource(kernel, job["signature"], job["constexprs"], job["attrs"]),
                              target=GPUTarget(*ptx_identity.TARGET), options=job["options"])
    found = triton_launch.static_arguments(compiled, len(names))
    assert found is not None
    keep, pointers = found
    assert sorted(pointers) == sorted(slots)
    assert {names.index(p) for p in triton_cat._CAT_POINTERS} <= set(pointers)
    static = triton_launch.static_kernel(compiled, keep)
    assert static is not None, "the static launcher refused the CAT kernel"
    assert [c == "O" for c in static.arg_tys] == [i in slots for i in keep]


def test_the_interpreter_keeps_the_jit_launcher():
    """TRITON_INTERPRET=1 for the whole process (the kernel module imported interpreted): repeated calls of one
    geometry plan once and stay right; the interpreted launch returns no compiled kernel, so nothing is replayed."""
    script = textwrap.dedent("""
        import dataclasses
        import torch
        import rope_fusion.kernels.triton_rotary  # noqa: F401
        from rope_fusion.kernels import triton_cat, triton_launch
        from rope_fusion.ops import cat_rotary
        from rope_fusion.ops.plan_cache import plan_cache
        assert triton_launch.INTERPRETED
        kernels = cat_rotary.CAT_KERNELS.kernels
        kernels["cpu"] = dataclasses.replace(kernels["cuda"], plan=None)  # the op's own path, unplanned
        plans = []
        real = triton_cat.plan_cat
        triton_cat.plan_cat = lambda cat, outs: plans.append(1) or real(cat, outs)
        for seed in range(3):
            torch.manual_seed(seed)
            q0, k0, q1, k1 = (torch.randn(1, s, 2, 16) for s in (3, 3, 5, 5))
            angles = torch.randn(8, 8)
            args = (q0, k0, angles.cos()[:, None], angles.sin()[:, None])
            kw = dict(interleaved=False, rotary_dim=16, full_tables=False, conjugate=False, out_dtype=torch.float32,
                      second_pieces=[q1, k1], second_norm_weights=[None, None], cat_dims=[1, 1])
            outs = triton_cat.launch_cat(cat_rotary.parse(2, args, kw))
            wide = cat_rotary.parse(2, tuple(a.double() for a in args),
                                    dict(kw, out_dtype=torch.float64, second_pieces=[q1.double(), k1.double()]))
            for out, exact in zip(outs, cat_rotary.reference(wide)):
                assert (out.double() - exact).abs().max().item() < 1e-5
        runner, = plan_cache("cat.runners").values()
        assert len(plans) == 1 and runner.replay is False, (plans, runner.replay)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------------------
# the host-time measurement (not a test): `python tests/kernels/test_cat_host_path.py`


def host_time(calls: int = 200, rounds: int = 15) -> dict:
    """Microseconds of host time per launch_cat call (and per op call) at Flux's joint attention shape (q and k
    pieces [1, 24, 512, 128] and [1, 24, 4096, 128] bf16, an RMS norm weight per piece), the kernel launch stubbed:
    the best of `rounds` runs of `calls` calls, wall clock and this thread's CPU time (the latter discounts other
    processes on a loaded machine). `replay`: the stub's launch returns a no-op compiled kernel, so the calls after
    the first replay it (its check taken as passed); `jit`: it returns None (the interpreter's case), so each call
    goes through the stub's JIT launcher."""
    kernels = cat_rotary.CAT_KERNELS.kernels
    saved = triton_launch.rotary_kernel, triton_launch.INTERPRETED, dict(kernels)
    names = list(saved[0].arg_names)

    class NoOp(CompiledKernel):
        def __init__(self) -> None:
            pass

        def __getitem__(self, grid):
            return lambda *args: None

        def __del__(self) -> None:
            pass

    class Stub:
        def __init__(self, compiled) -> None:
            self.compiled, self.arg_names = compiled, names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.compiled

    bf = torch.bfloat16
    q0, k0 = (torch.randn(1, 24, 512, 128, dtype=bf) for _ in range(2))
    q1, k1 = (torch.randn(1, 24, 4096, 128, dtype=bf) for _ in range(2))
    w = [torch.ones(128, dtype=bf) for _ in range(4)]
    angles = torch.randn(4608, 64).repeat_interleave(2, -1)
    args = (q0, k0, angles.cos(), angles.sin(), None, w[0], w[1])
    kw = dict(interleaved=True, rotary_dim=128, full_tables=True, conjugate=False, out_dtype=bf, norm="rms",
              norm_eps=1e-6, second_pieces=[q1, k1], second_norm_weights=[w[2], w[3]], cat_dims=[2, 2])
    cat = cat_rotary.parse(2, args, kw)

    def best(fn) -> tuple:
        for _ in range(20):
            fn()
        wall = cpu = float("inf")
        for _ in range(rounds):
            t, c = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            wall = min(wall, (time.perf_counter() - t) / calls * 1e6)
            cpu = min(cpu, (time.thread_time() - c) / calls * 1e6)
        return wall, cpu

    out = {}
    try:
        triton_launch.INTERPRETED = True  # CPU tensors
        kernels["cpu"] = dataclasses.replace(kernels["cuda"], plan=None)  # the op's own path, unplanned
        out["parse"] = best(lambda: cat_rotary.parse(2, args, kw))
        for label, compiled in (("replay", NoOp()), ("jit", None)):
            triton_launch.rotary_kernel = Stub(compiled)
            rope_fusion.clear_caches()
            assert triton_cat.launch_cat(cat) is not None
            runner = next(iter(plan_cache("cat.runners").values()))
            if compiled is not None:
                assert runner.replay
                runner.checked = True  # the no-op writes nothing: its check is taken as passed
            out[f"launch_cat {label}"] = best(lambda: triton_cat.launch_cat(cat))
            out[f"op {label}"] = best(lambda: cat_rotary.CAT_OPS[1](*args, **kw))
    finally:
        triton_launch.rotary_kernel, triton_launch.INTERPRETED = saved[:2]
        kernels.clear()
        kernels.update(saved[2])
        rope_fusion.clear_caches()
    return out


def _flux_call(device, b=1, heads=24, text=512, image=4096, d=128, dtype=torch.bfloat16):
    """Flux's joint attention q/k call on [B, H, S, D] pieces, an RMS norm weight per piece: (args, keywords)."""
    q0, k0 = (torch.randn(b, heads, text, d, dtype=dtype, device=device) for _ in range(2))
    q1, k1 = (torch.randn(b, heads, image, d, dtype=dtype, device=device) for _ in range(2))
    w = [1.0 + 0.1 * torch.randn(d, dtype=dtype, device=device) for _ in range(4)]
    angles = torch.randn(text + image, d // 2, device=device).repeat_interleave(2, -1)
    args = (q0, k0, angles.cos(), angles.sin(), None, w[0], w[1])
    return args, dict(interleaved=True, rotary_dim=d, full_tables=True, conjugate=False, out_dtype=dtype, norm="rms",
                      norm_eps=1e-6, second_pieces=[q1, k1], second_norm_weights=[w[2], w[3]], cat_dims=[2, 2])


def gpu_check(calls: int = 200) -> dict:
    """On CUDA, at Flux's shape: fresh inputs each call match the fp64 reference, through the replay (torch's static
    launcher where this torch has one) after the first calls, eagerly and replayed in a CUDA graph; and the host
    time per op call (`rotary_qk_cat`: parse and launch_cat), replayed and through the JIT launcher."""
    op = cat_rotary.CAT_OPS[1]
    rope_fusion.clear_caches()
    out: dict = {}
    for _ in range(4):  # call 1 JIT, call 2 the replay checked against it, then the replay alone
        args, kw = _flux_call("cuda")
        _check(op(*args, **kw), args, kw)
    replay, = plan_cache("cat.replays").values()  # the op's replay of the call's key
    runner = replay.runner
    out["replay"] = getattr(runner.replay, "__qualname__", runner.replay)
    out["checked"] = runner.checked
    args, kw = _flux_call("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(*args, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = op(*args, **kw)
    for t in (*args[:2], *args[5:], *kw["second_pieces"], *kw["second_norm_weights"]):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    _check(outs, args, kw)
    out["graph replay"] = "matches the reference"

    def host(label):
        op(*args, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            op(*args, **kw)
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        out[f"{label}: host us/call"] = round((enqueued - t) / calls * 1e6, 1)
        out[f"{label}: wall us/call"] = round((done - t) / calls * 1e6, 1)
    host("replay")
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        graph.replay()
    torch.cuda.synchronize()
    out["graph replay: us/call"] = round((time.perf_counter() - t) / calls * 1e6, 1)
    runner.replay, runner.checked = False, False  # the JIT launcher on every call
    host("jit")
    rope_fusion.clear_caches()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_replays_the_compiled_kernel():
    """On the GPU: the replay passes its check and serves later calls, each call's own result, in a CUDA graph too."""
    found = gpu_check(calls=20)
    assert found["checked"] and found["replay"] not in (None, False), found


if __name__ == "__main__":
    if "--gpu" in sys.argv:
        for name, value in gpu_check().items():
            print(f"{name}: {value}")
    else:
        for name, (wall, cpu) in host_time().items():
            print(f"{name:20s} {wall:7.1f} us wall  {cpu:7.1f} us thread CPU")
