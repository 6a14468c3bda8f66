"""The launches the pass warms while Inductor compiles (kernels/triton_warmup.py) are the ones a compiled graph's
first call of the folds' opaque ops launches: Triton's own specialisation (argument types, constexprs, the 16-byte
alignment and integer values it specialises on, the compile options) of each warmed launch, planned on the graph's
fake values with its tensors mocked, equals that of the launch the first call makes on real tensors, for sm_90.

Stand-ins, said so: the warmup's compile (`triton_warmup._submit`, `JITFunction.warmup` in a thread) needs a GPU
driver, so here it records what it would compile; the first call runs the interpreted kernel behind a recorder of
its launches. On a GPU, `test_gpu_first_call_compiles_nothing_the_pass_warmed` runs the real warmup.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from rope_fusion.kernels import triton_warmup
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

triton = pytest.importorskip("triton")
from benchmarks.ptx_identity import Launch, _kernel, specialise  # noqa: E402  (Triton's binder for sm_90)
from tests.helpers.diffusers_rotary import rms  # noqa: E402
from tests.helpers.diffusers_rotary import rope_heads_first as rope  # noqa: E402

TEXT, IMAGE, HEADS, D = 3, 6, 2, 20  # 3 text rows of 20 lanes: the video rows start unaligned in bf16


class Recorded:
    """The interpreted kernel behind a recorder of each launch's arguments."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.launches.append((args, kw))
            return self.kernel[grid](*args, **kw)
        return run


pytestmark = pytest.mark.triton_on_cpu(serves=("slice_write", "cat"), wrap=Recorded)


def joint_streams(tq, tk, tv, iq, ik, iv, tcos, tsin, icos, isin):
    """Qwen-Image's joint attention: each stream rotated with its own tables, joined text first (two joined
    writes, the `rotary_qk_into_` op)."""
    q = torch.cat([rope(tq, tcos, tsin), rope(iq, icos, isin)], dim=2)
    k = torch.cat([rope(tk, tcos, tsin), rope(ik, icos, isin)], dim=2)
    return F.scaled_dot_product_attention(q, k, torch.cat([tv, iv], dim=2))


def video_rows(q, k, v, cos, sin):
    """CogVideoX's attention: the video rows of q and k rotated in place (the `rotary_qk_slice_` op)."""
    q, k = q * 1.0, k * 1.0
    q[:, :, TEXT:] = rope(q[:, :, TEXT:], cos, sin)
    k[:, :, TEXT:] = rope(k[:, :, TEXT:], cos, sin)
    return F.scaled_dot_product_attention(q, k, v)


def normed_pieces(q, k, eq, ek, wq, wk, weq, wek, cos, sin):
    """Flux's joint q/k: text and image normed apart, joined, rotated (the `rotary_qk_cat` op)."""
    q = torch.cat([rms(eq, weq), rms(q, wq)], dim=2)
    k = torch.cat([rms(ek, wek), rms(k, wk)], dim=2)
    return rope(q, cos, sin), rope(k, cos, sin)


def _streams(dtype):
    t = [torch.randn(2, HEADS, TEXT, D, dtype=dtype) for _ in range(3)]
    i = [torch.randn(2, HEADS, IMAGE, D, dtype=dtype) for _ in range(3)]
    return (*t, *i, torch.randn(TEXT, D), torch.randn(TEXT, D), torch.randn(IMAGE, D), torch.randn(IMAGE, D))


def _rows(dtype):
    xs = [torch.randn(2, HEADS, TEXT + IMAGE, D, dtype=dtype) for _ in range(3)]
    return (*xs, torch.randn(IMAGE, D), torch.randn(IMAGE, D))


def _pieces(dtype):
    xs = [torch.randn(2, HEADS, IMAGE, D, dtype=dtype) for _ in range(2)]
    es = [torch.randn(2, HEADS, TEXT, D, dtype=dtype) for _ in range(2)]
    ws = [torch.rand(D, dtype=dtype) + 0.5 for _ in range(4)]
    return (*xs, *es, *ws, torch.randn(TEXT + IMAGE, D), torch.randn(TEXT + IMAGE, D))


CASES = {"joined writes": (joint_streams, _streams, "joined write:", 2),
         "slice writes": (video_rows, _rows, "slice write:", 1),
         "cat": (normed_pieces, _pieces, "cat folded:", 1)}


@pytest.fixture
def warmed(monkeypatch):
    """What the warmup would compile, by launch: (grid, mocked args, mocked kwargs); every device warms."""
    seen: list = []
    monkeypatch.setattr(triton_warmup, "enabled", lambda kernel, device: True)
    monkeypatch.setattr(triton_warmup, "_submit", lambda kernel, grid, args, kw, device: seen.append((grid, args, kw)))
    return seen


def _keys(launches) -> list:
    kernel = _kernel()
    return sorted(specialise(kernel, Launch("", 0, tuple(args), dict(kw)))[1] for args, kw in launches)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_warms_exactly_the_launches_of_the_first_call(triton_on_cpu, warmed, case, dtype):
    fn, make, fold, launches = CASES[case]
    torch.manual_seed(7)
    args = make(dtype)
    out, p = compile_with_pass(fn, *args, backend="triton")
    kernels = p.report.kernels
    assert kernels and all(k.fold.startswith(fold) for k in kernels), p.report.table()
    check_numerics(fn, args, out, context=p.report.table())
    first = triton_on_cpu.rotary.launches  # the compiled graph's first call, through the JIT launcher
    assert len(warmed) == len(first) == launches, (len(warmed), len(first))
    assert all(isinstance(a, triton_warmup.AlignedMock) for _, args, _ in warmed for a in args[:12])
    assert _keys([(a, k) for _, a, k in warmed]) == _keys(first)


def test_an_unaligned_view_is_warmed_unaligned():
    """The mock's address is aligned exactly where the tensor's would be: a view 2 bf16 elements into its base is
    not 16-byte aligned, one 8 elements in is (Triton specialises a pointer on that)."""
    base = torch.empty(4, 16, dtype=torch.bfloat16)
    assert triton_warmup.AlignedMock(base[:, 2:]).data_ptr() % 16 != 0
    assert triton_warmup.AlignedMock(base[:, 8:]).data_ptr() % 16 == 0
    assert triton_warmup.AlignedMock(base[1:]).data_ptr() % 16 == 0


def test_symbolic_sizes_and_other_devices_are_not_warmed(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    seen: list = []
    monkeypatch.setattr(triton_warmup, "_submit", lambda *a: seen.append(a))
    x = torch.empty(4, 16)
    assert not triton_warmup.warm(object(), (1,), (x,), {}, x.device)  # the CPU: nothing to compile for
    monkeypatch.setattr(triton_warmup, "enabled", lambda kernel, device: True)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        sym = mode.from_tensor(x, symbolic_context=context)
    assert not triton_warmup.concrete((sym,)) and not triton_warmup.warm(object(), (1,), (sym,), {}, x.device)
    assert not triton_warmup.warm(object(), (1,), (x, sym.shape[0]), {}, x.device)
    assert not seen
    assert triton_warmup.warm(object(), (1,), (x, 3), {"BLOCK": 16}, x.device)
    (_, grid, args, kwargs, _), = seen
    assert isinstance(args[0], triton_warmup.AlignedMock) and args[1:] == (3,) and kwargs == {"BLOCK": 16}


def test_wait_drops_a_failed_warmup(monkeypatch):
    """A warmup that raises costs the first call nothing but its own compile: `wait` logs it and returns."""
    monkeypatch.setattr(triton_warmup, "enabled", lambda kernel, device: True)

    class Broken:
        def warmup(self, *args, **kwargs):
            raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "device", lambda index: threading.Lock())  # no CUDA device here
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert triton_warmup.warm(Broken(), (1,), (torch.empty(2),), {}, torch.device("cuda"))
    assert triton_warmup.pending() == 1
    triton_warmup.wait()
    assert triton_warmup.pending() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("emitted", ["op", "node"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_first_call_compiles_nothing_the_pass_warmed(case, emitted):
    """On a GPU: the kernel's compiled launches forgotten, the compiled graph's first call compiles none of the
    folds' launches in the main thread. Emitted as ops (the kernels' nodes turned off), the pass warms their
    launches in its threads while Inductor compiles; emitted as the kernel's user-kernel nodes (the default on
    CUDA), Inductor compiles them with the rest of the graph, and nothing is warmed."""
    from rope_fusion.kernels import triton_kernel
    from rope_fusion.ops import device_registry

    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no post-compile hook")
    fn, make, fold, launches = CASES[case]
    torch.manual_seed(8)
    args = [a.cuda() for a in make(torch.bfloat16)]
    compiled_in: list = []

    def hook(*a, **kw):  # each compile of a JIT kernel: the thread, and Triton's line for its specialisation
        compiled_in.append((threading.current_thread().name, kw.get("repr")))
    triton_kernel.rotary_kernel.device_caches.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(knobs.runtime, "jit_post_compile_hook", hook)
        if emitted == "op":
            mp.setattr(device_registry, "NODE_DEVICES", ())
        # as a user compiles: the suite's self-check of every fusion (ROPE_FUSION_VERIFY) would launch the emitted
        # ops on inputs of its own in the main thread while the pass runs
        out, p = compile_with_pass(fn, *args, backend="triton", verify=False)
    assert p.report.kernels and all(k.fold.startswith(fold) for k in p.report.kernels), p.report.table()
    check_numerics(fn, args, out, context=p.report.table())
    warmed = [r for t, r in compiled_in if t.startswith("rope_fusion_warmup")]
    first = [r for t, r in compiled_in if not t.startswith("rope_fusion_warmup")]
    expected = launches if emitted == "op" else 0
    assert len(warmed) == expected and not first, "\n".join(["warmed:", *warmed, "first call:", *first])
