"""The Triton rotary kernels against the reference semantics.

On a machine without a GPU the kernels run under Triton's interpreter. `triton.jit` decides at decoration
time whether a kernel is interpreted, and the kernel module is imported as every other module imports it
(compiled: the graph and cost-model tests trace it on fake tensors, which an interpreted kernel cannot do, so
this module must not change how it is imported). The CPU tests launch an interpreted copy of the same kernel
function instead, and the op path `torch.ops.rope_fusion.rotary_triton` runs it on CPU tensors with that copy
patched in. GPU tests run the compiled kernels on realistic shapes and skip without CUDA.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

import rope_fusion  # noqa: E402
import rope_fusion.kernels.triton_launch as launching  # noqa: E402
import rope_fusion.kernels.triton_plan as planner  # noqa: E402
import rope_fusion.kernels.triton_rotary as tr  # noqa: E402
from rope_fusion.ops import backends  # noqa: E402
from rope_fusion.ops.backends import SiteSpec  # noqa: E402
from rope_fusion.ops.reference import rotary_reference  # noqa: E402
from rope_fusion.ops.schema import RotaryParams  # noqa: E402
from tests.helpers.interpreted_rotary import KERNEL, poisoned_outputs  # noqa: E402

OP_INTERPRETED = launching.INTERPRETED  # only with TRITON_INTERPRET=1 for the run
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------------------
# helpers


def check(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool,
          rotary_dim: int, full_tables: bool, conjugate: bool, out_dtype: torch.dtype) -> None:
    """Compare with an fp64 evaluation: one rounding to out_dtype plus the math dtype's own error."""
    assert out.dtype == out_dtype and out.shape == x.shape and out.is_contiguous()
    assert not out.isnan().any(), "some output elements were never written"
    exact = rotary_reference(x.double(), cos.double(), sin.double(), interleaved=interleaved,
                             rotary_dim=rotary_dim, full_tables=full_tables, conjugate=conjugate,
                             out_dtype=torch.float64)
    wide = torch.float64 in (x.dtype, cos.dtype, sin.dtype) and out_dtype in (torch.float32, torch.float64)
    eps_math = torch.finfo(torch.float64 if wide else torch.float32).eps
    # Tables narrower than fp32 are exact in the math dtype; fp64 tables read in fp32 round once more.
    if cos.dtype == torch.float64 and not wide:
        eps_math *= 2
    scale = x.abs().max().double() * (cos.abs().max().double() + sin.abs().max().double())
    tol = torch.finfo(out_dtype).eps * exact.abs() + 4 * eps_math * scale + 1e-300
    err = (out.double().cpu() - exact.cpu()).abs()
    assert (err <= tol.cpu()).all(), f"max err {err.max().item():.3g}, max tol {tol.max().item():.3g}"


def tables(lead: tuple, width: int, dtype=torch.float32, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(*lead, width, dtype=dtype, device=device),
            torch.randn(*lead, width, dtype=dtype, device=device))


TUNING = ("block_h", "num_warps", "nsplit", "neox_row", "stream", "held", "kernel")


def launch(xs: list, cos, sin, **kw) -> list:
    """tr.launch with the op's options and the kernel's tuning options in one keyword list."""
    tuning = {k: kw.pop(k) for k in TUNING if k in kw}
    return tr.launch(xs, cos, sin, RotaryParams(**kw), **tuning)


def run(xs: list, cos, sin, **kw) -> list:
    with poisoned_outputs():
        return launch(xs, cos, sin, kernel=KERNEL, **kw)


def run_and_check(xs: list, cos, sin, block_h=None, nsplit=None, neox_row=None, **kw) -> None:
    outs = run(xs, cos, sin, block_h=block_h, nsplit=nsplit, neox_row=neox_row, **kw)
    assert len(outs) == len(xs)
    for x, out in zip(xs, outs):
        check(out, x, cos, sin, **kw)


def opts(interleaved=False, rotary_dim=None, full_tables=False, conjugate=False, out_dtype=torch.bfloat16,
         head_dim=64) -> dict:
    return dict(interleaved=interleaved, rotary_dim=rotary_dim or head_dim, full_tables=full_tables,
                conjugate=conjugate, out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------------------
# CPU: the kernel under the interpreter


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("full_tables", [False, True], ids=["half", "full"])
@pytest.mark.parametrize("conjugate", [False, True], ids=["rot", "conj"])
def test_styles_qk_gqa(interleaved, full_tables, conjugate):
    """Every style/table/sign combination, q and k with different head counts in one launch, D=80."""
    D, R = 80, 80
    q = torch.randn(2, 3, 4, D, dtype=torch.bfloat16)
    k = torch.randn(2, 3, 1, D, dtype=torch.bfloat16)
    cos, sin = tables((1, 3, 1), R if full_tables else R // 2)
    run_and_check([q, k], cos, sin, **opts(interleaved, R, full_tables, conjugate, head_dim=D))


@pytest.mark.parametrize("neox_row", [False, True], ids=["halves", "rows"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(80, 80), (64, 64), (128, 64), (80, 40), (24, 24), (48, 16)])
@pytest.mark.parametrize("full_tables,conjugate", [(False, False), (True, False), (False, True), (True, True)])
def test_neox_as_halves_or_whole_rows(neox_row, head_dim, rotary_dim, full_tables, conjugate):
    """NeoX has two kernel forms (the two halves as separate tiles, or one load of the row remapped so that
    its halves split in registers): both are exact for every table form and sign, with and without a
    pass-through tail, for halves that are and are not powers of two."""
    q = torch.randn(2, 5, 3, head_dim, dtype=torch.bfloat16)
    k = torch.randn(2, 5, 2, head_dim, dtype=torch.bfloat16)
    cos, sin = tables((1, 5, 1), rotary_dim if full_tables else rotary_dim // 2)
    run_and_check([q, k], cos, sin, neox_row=neox_row,
                  **opts(False, rotary_dim, full_tables, conjugate, head_dim=head_dim))


@pytest.mark.parametrize("block_h,nsplit", [(1, 1), (1, 2), (2, 3), (4, 2), (2, 7), (8, 4)])
def test_work_split_over_programs(block_h, nsplit):
    """q's and k's head blocks are one list of work items dealt round robin over NSPLIT programs per token:
    every split (more programs than items included) writes every head of q and of k exactly once."""
    q = torch.randn(2, 3, 5, 32, dtype=torch.bfloat16)
    k = torch.randn(2, 3, 3, 32, dtype=torch.bfloat16)
    cos, sin = tables((1, 3, 1), 16)
    run_and_check([q, k], cos, sin, block_h=block_h, nsplit=nsplit, **opts(True, 32, head_dim=32))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 32), (80, 40), (96, 96), (128, 64), (256, 256),
                                                 (24, 24), (40, 16), (8, 2), (120, 120)])
def test_head_and_rotary_dims(interleaved, head_dim, rotary_dim):
    """Head dims that are and are not powers of two; partial rotary copies the tail in the same pass."""
    x = torch.randn(3, 2, head_dim, dtype=torch.float16)
    cos, sin = tables((3, 1), rotary_dim // 2)
    run_and_check([x], cos, sin, **opts(interleaved, rotary_dim, out_dtype=torch.float16, head_dim=head_dim))


@pytest.mark.parametrize("x_dtype,table_dtype,out_dtype", [
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float16, torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float64, torch.bfloat16),  # complex128 spelling cast back: fp32 math
    (torch.float32, torch.float64, torch.float32),  # fp64 math
    (torch.float64, torch.float64, torch.float64),
])
def test_dtypes(x_dtype, table_dtype, out_dtype):
    x = torch.randn(2, 3, 2, 32, dtype=x_dtype)
    k = torch.randn(2, 3, 3, 32, dtype=x_dtype)
    cos, sin = tables((3, 1), 32, dtype=table_dtype)
    run_and_check([x, k], cos, sin, **opts(True, 32, full_tables=True, out_dtype=out_dtype, head_dim=32))


def test_layout_bhsd():
    """[B,H,S,D] with tables [1,1,S,W]: the head loop runs over H, tokens over (B,S)."""
    q = torch.randn(2, 4, 5, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 5, 64, dtype=torch.bfloat16)
    cos, sin = tables((1, 1, 5), 64)
    run_and_check([q, k], cos, sin, **opts(False, 64, full_tables=True))


def test_packed_tokens_and_flat_heads():
    """[T,H,D] with [T,1,W] tables; and [B,S,H*D] with a table spanning all heads (every lane its own)."""
    x = torch.randn(7, 3, 48, dtype=torch.bfloat16)
    cos, sin = tables((7, 1), 24)
    run_and_check([x], cos, sin, **opts(False, 48, head_dim=48))
    y = torch.randn(2, 5, 96, dtype=torch.bfloat16)
    cos, sin = tables((2, 5), 96)
    run_and_check([y], cos, sin, **opts(True, 96, full_tables=True, head_dim=96))


def test_per_head_and_per_batch_tables():
    """Tables that vary along heads (Mochi) or batch (Helios): those dims become token dims."""
    x = torch.randn(2, 3, 4, 32, dtype=torch.bfloat16)
    cos, sin = tables((3, 4), 16)
    run_and_check([x], cos, sin, **opts(True, 32, head_dim=32))
    cos, sin = tables((2, 3, 1), 16)
    run_and_check([x, x[:, :, :2]], cos, sin, **opts(False, 32, head_dim=32))


def test_strided_table_views():
    """Tables as the pass feeds them: `freqs[..., 0::2]`, view_as_real parts, a packed [cos|sin] slice."""
    S, D = 5, 32
    x = torch.randn(2, S, 3, D, dtype=torch.bfloat16)
    k = torch.randn(2, S, 1, D, dtype=torch.bfloat16)
    full = torch.randn(1, S, 1, D)
    run_and_check([x, k], full[..., 0::2], full[..., 1::2], **opts(True, D, head_dim=D))
    freqs = torch.polar(torch.ones(S, D // 2), torch.randn(S, D // 2)).view(1, S, 1, D // 2)
    ri = torch.view_as_real(freqs)
    run_and_check([x, k], ri[..., 0], ri[..., 1], **opts(True, D, head_dim=D))
    packed = torch.randn(2, S, 2 * D).unsqueeze(-2)  # [B,S,1,2D]: per-batch cos then sin
    cos, sin = packed.chunk(2, dim=-1)
    run_and_check([x, k], cos[..., 0::2], sin[..., 1::2], **opts(True, D, head_dim=D))
    run_and_check([x, k], cos, sin, **opts(True, D, full_tables=True, head_dim=D))
    e = torch.randn(1, 1, 1, D // 2).expand(2, S, 1, D // 2)  # zero strides everywhere
    run_and_check([x], e, e.flip(-1), **opts(False, D, head_dim=D))


def test_strided_x():
    """x as a slice of a packed qkv tensor, a transposed view, and with a non-unit last stride."""
    qkv = torch.randn(2, 5, 3, 4, 64, dtype=torch.bfloat16)
    q, k = qkv[:, :, 0], qkv[:, :, 1, :2]
    cos, sin = tables((1, 5, 1), 32)
    run_and_check([q, k], cos, sin, **opts(True, 64))
    t = torch.randn(2, 4, 5, 64, dtype=torch.bfloat16).transpose(1, 2)  # [B,S,H,D] view of [B,H,S,D]
    run_and_check([t], cos, sin, **opts(False, 64))
    lanes_last = torch.randn(2, 5, 64, 4, dtype=torch.bfloat16).transpose(-1, -2)
    assert lanes_last.stride(-1) != 1
    run_and_check([lanes_last], cos, sin, **opts(True, 64))


def test_unmergeable_dims_and_separate_launches():
    """More token dims than the kernel holds (materialized fallback); q/k that cannot share one grid."""
    x = torch.randn(2, 3, 2, 3, 2, 16, dtype=torch.float32).permute(0, 2, 1, 4, 3, 5)
    cos, sin = tables((2, 2, 3, 2, 3), 8)
    run_and_check([x], cos, sin, **opts(False, 16, out_dtype=torch.float32, head_dim=16))
    q = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 3, 1, 16, dtype=torch.bfloat16)
    cos, sin = tables((3, 1), 8)
    run_and_check([q, k], cos, sin, **opts(True, 16, head_dim=16))


def test_mixed_qk_dtypes_and_empty():
    q = torch.randn(2, 3, 2, 32, dtype=torch.bfloat16)
    k = torch.randn(2, 3, 1, 32, dtype=torch.float32)
    cos, sin = tables((3, 1), 16)
    run_and_check([q, k], cos, sin, **opts(False, 32, out_dtype=torch.float32, head_dim=32))
    e = torch.randn(0, 3, 2, 32, dtype=torch.bfloat16)
    (out,) = run([e], cos, sin, **opts(False, 32, head_dim=32))
    assert out.shape == e.shape


def test_ops_on_cpu_under_interpreter(monkeypatch):
    """The registered triton_ops themselves (what the pass emits) under the interpreter: the op's CPU path
    launches the module's kernel, here the interpreted copy."""
    monkeypatch.setattr(launching, "rotary_kernel", KERNEL)
    monkeypatch.setattr(launching, "INTERPRETED", True)
    q = torch.randn(2, 4, 3, 80, dtype=torch.bfloat16)
    k = torch.randn(2, 4, 1, 80, dtype=torch.bfloat16)
    cos, sin = tables((1, 4, 1), 40)
    kw = opts(True, 80, head_dim=80)
    with poisoned_outputs():
        qo, ko = torch.ops.rope_fusion.rotary_qk_triton(q, k, cos, sin, **kw)
        xo = torch.ops.rope_fusion.rotary_triton(q, cos, sin, **kw)
    check(qo, q, cos, sin, **kw)
    check(ko, k, cos, sin, **kw)
    check(xo, q, cos, sin, **kw)


def test_bad_arguments_raise_value_error():
    x = torch.randn(2, 3, 32)
    cos, sin = tables((2, 1), 10)
    with pytest.raises(ValueError, match="cos"):
        torch.ops.rope_fusion.rotary_triton(x, cos, sin, **opts(False, 32, out_dtype=torch.float32))


def test_backend_registered_and_supports():
    b = backends.get_backend("triton")
    assert b is not None and "triton" in backends.BACKEND_NAMES and "triton" in backends.available_backends()

    def spec(x_shape=(2, 16, 8, 80), rotary_dim=80, **kw):
        params = RotaryParams(interleaved=True, rotary_dim=rotary_dim, full_tables=False, conjugate=False,
                              out_dtype=torch.bfloat16)
        base = dict(device_type="cuda", x_shapes=(x_shape, x_shape), x_dtype=torch.bfloat16,
                    table_dtype=torch.float32, params=params)
        base.update(kw)
        return SiteSpec(**base)

    assert b.supports(spec()) is None
    assert b.supports(spec(table_dtype=torch.float64, x_shape=(4, 256), rotary_dim=256)) is None
    assert "cpu" in b.supports(spec(device_type="cpu"))
    assert "dtypes" in b.supports(spec(x_dtype=torch.int32))
    assert "head dim" in b.supports(spec(x_shape=(2, 4096), rotary_dim=4096))
    chosen, reasons = backends.choose_backend("triton", spec(device_type="cpu"))
    assert chosen.name == "inductor" and reasons and reasons[0].startswith("triton: ")


def test_host_side_runs_on_fake_tensors():
    """triton_op uses the same function as its fake kernel: the host side must work on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    with FakeTensorMode():
        q = torch.empty(2, 8, 16, 4, 64, dtype=torch.bfloat16)[:, :, :, 0]
        k = torch.empty(2, 8, 2, 64, dtype=torch.bfloat16)
        cos = torch.empty(1, 8, 1, 32)
        qo, ko = launch([q, k], cos, cos, kernel=Recorder(), **opts(False, 64, out_dtype=torch.float32))
        assert qo.shape == q.shape and qo.dtype == torch.float32 and qo.is_contiguous()
        assert ko.shape == k.shape
    assert len(launches) == 1
    grid, args, kwargs = launches[0]
    assert grid[0] == 16 and kwargs["NSIDES"] == 2 and args[14:16] == (16, 2)  # tokens (2*8), heads


@pytest.mark.skipif(OP_INTERPRETED, reason="interpreted kernels cannot run on fake tensors")
def test_fake_tensors_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 16, 4, 64, dtype=torch.bfloat16)[:, :, :, 0]
        k = torch.empty(2, 8, 2, 64, dtype=torch.bfloat16)
        cos = torch.empty(1, 8, 1, 32)
        qo, ko = torch.ops.rope_fusion.rotary_qk_triton(q, k, cos, cos, **opts(False, 64, out_dtype=torch.float32))
        assert qo.shape == q.shape and qo.dtype == torch.float32 and qo.is_contiguous()
        assert ko.shape == k.shape


# ---------------------------------------------------------------------------------------------------------
# GPU: compiled kernels on realistic shapes


def _gpu_case(shape_q, shape_k, interleaved, full_tables, rotary_dim, dtype=torch.bfloat16):
    q = torch.randn(*shape_q, dtype=dtype, device="cuda")
    k = torch.randn(*shape_k, dtype=dtype, device="cuda")
    width = rotary_dim if full_tables else rotary_dim // 2
    cos, sin = tables((1, shape_q[1], 1), width, device="cuda")
    kw = opts(interleaved, rotary_dim, full_tables, out_dtype=dtype)
    return q, k, cos, sin, kw


@cuda
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("shape,heads_k,rotary_dim,full_tables", [
    ((2, 4096, 16, 80), 16, 80, False),
    ((1, 4096, 40, 128), 40, 128, True),
    ((64, 1, 32, 128), 8, 128, False),
    ((2, 2048, 32, 128), 8, 64, True),
    ((1, 1024, 8, 256), 8, 256, False),
    ((2, 1024, 12, 96), 4, 96, False),
])
def test_gpu_realistic(interleaved, shape, heads_k, rotary_dim, full_tables):
    shape_k = shape[:2] + (heads_k, shape[3])
    q, k, cos, sin, kw = _gpu_case(shape, shape_k, interleaved, full_tables, rotary_dim)
    qo, ko = torch.ops.rope_fusion.rotary_qk_triton(q, k, cos, sin, **kw)
    check(qo, q, cos, sin, **kw)
    check(ko, k, cos, sin, **kw)
    xo = torch.ops.rope_fusion.rotary(q, cos, sin, **kw)  # the eager kernel registered for cuda
    check(xo, q, cos, sin, **kw)
    if not interleaved:  # NeoX's other kernel form, compiled
        with poisoned_outputs():
            qo, ko = launch([q, k], cos, sin, neox_row=True, **kw)
        check(qo, q, cos, sin, **kw)
        check(ko, k, cos, sin, **kw)


@cuda
@pytest.mark.parametrize("norm,interleaved,head_dim,dtype", [
    ("rms", True, 80, torch.bfloat16), ("rms", False, 80, torch.bfloat16), ("rms", True, 128, torch.bfloat16),
    ("rms", False, 128, torch.bfloat16), ("rms_across_heads", True, 128, torch.bfloat16),
    ("rms", True, 80, torch.float64), ("rms_across_heads", False, 128, torch.float64),
])
@pytest.mark.parametrize("head_i64", [False, True], ids=["i32", "i64"])
def test_gpu_norm_prologue(norm, interleaved, head_dim, dtype, head_i64, monkeypatch):
    """The compiled kernel's norm loop (not only the interpreter's): a weight row folded into the tables (padded
    rows), a weight tile applied in the loop, rsqrt in fp32 math and 1 / sqrt in fp64, with 32-bit head
    offsets and with 64-bit ones; against the fp64 reference."""
    torch.manual_seed(11)
    q = torch.randn(2, 512, 16, head_dim, dtype=dtype, device="cuda") * 3
    k = torch.randn(2, 512, 4, head_dim, dtype=dtype, device="cuda") * 3
    cos, sin = tables((512, 1), head_dim // 2, dtype=dtype, device="cuda")
    wq, wk = (torch.randn(head_dim if norm == "rms" else (h, head_dim), dtype=dtype, device="cuda") for h in (16, 4))
    kw = opts(interleaved, head_dim, out_dtype=dtype)
    if head_i64:
        rope_fusion.clear_caches()
        monkeypatch.setattr(planner, "heads_fit_int32", lambda *a: False)
    real_empty = torch.empty  # outputs start as NaN (poisoned_outputs would swap in the interpreter's tl.sum)

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    qo, ko = tr.launch([q, k], cos, sin, RotaryParams(**kw, norm=norm, norm_eps=1e-5), None, [wq, wk])
    monkeypatch.setattr(torch, "empty", real_empty)
    for out, x, w in ((qo, q, wq), (ko, k, wk)):
        want = rotary_reference(x.double(), cos.double(), sin.double(), norm=norm, norm_eps=1e-5,
                                norm_weight=w.double(), **{**kw, "out_dtype": torch.float64})
        tol = 1e-12 if dtype == torch.float64 else 4 * torch.finfo(dtype).eps
        assert (out.double() - want).abs().max().item() <= tol * want.abs().max().item()


@cuda
def test_gpu_strided_tables_and_dtypes():
    S, D = 2048, 128
    x = torch.randn(2, S, 8, D, dtype=torch.float16, device="cuda")
    full = torch.randn(1, S, 1, D, device="cuda", dtype=torch.float64)
    kw = opts(True, D, out_dtype=torch.float16, head_dim=D)
    qo, ko = torch.ops.rope_fusion.rotary_qk_triton(x, x[:, :, :2], full[..., 0::2], full[..., 1::2], **kw)
    check(qo, x, full[..., 0::2], full[..., 1::2], **kw)
    kw = opts(False, D, out_dtype=torch.float32, head_dim=D)
    t = full.transpose(1, 2)  # [1,1,S,D] against x as [B,H,S,D]
    (xo,) = launch([x.transpose(1, 2)], t[..., :64], t[..., 64:], **kw)
    check(xo, x.transpose(1, 2), t[..., :64], t[..., 64:], **kw)


@cuda
def test_gpu_one_launch_for_q_and_k():
    q, k, cos, sin, kw = _gpu_case((64, 1, 32, 128), (64, 1, 8, 128), False, False, 128)
    torch.ops.rope_fusion.rotary_qk_triton(q, k, cos, sin, **kw)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.rope_fusion.rotary_qk_triton(q, k, cos, sin, **kw)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name for e in kernels if "rotary" in e.name]
    assert len(names) == 1, [e.name for e in kernels]


@cuda
def test_gpu_compiled_op_and_pass():
    """Inductor calls the kernel inside a compiled graph; the pass with backend='triton' stays correct."""
    import rope_fusion

    q, k, cos, sin, kw = _gpu_case((2, 1024, 8, 128), (2, 1024, 2, 128), False, True, 128)

    def direct(q, k, cos, sin):
        return torch.ops.rope_fusion.rotary_qk_triton(q, k, cos, sin, **kw)

    qo, ko = torch.compile(direct, fullgraph=True)(q, k, cos, sin)
    check(qo, q, cos, sin, **kw)
    check(ko, k, cos, sin, **kw)

    def neox(q, k, cos, sin):
        def rot(x):
            a, b = x.chunk(2, dim=-1)
            return torch.cat((-b, a), dim=-1)
        c, s = cos.to(q.dtype), sin.to(q.dtype)
        return q * c + rot(q) * s, k * c + rot(k) * s

    p = rope_fusion.RopeFusionPass(backend="triton")
    compiled = torch.compile(neox, options={"post_grad_custom_post_pass": p})
    qo, ko = compiled(q, k, cos, sin)
    eq, ek = neox(q, k, cos, sin)
    torch.testing.assert_close(qo, eq, atol=0.05, rtol=0.02)
    torch.testing.assert_close(ko, ek, atol=0.05, rtol=0.02)


@cuda
def test_gpu_symbolic_token_count_takes_the_user_kernel_node():
    """vLLM's forward_native compiled with the token count marked dynamic: the pass emits the kernel as a
    user-kernel node whose grid is the count (no recompile for another T), q and k in one launch, right."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    import rope_fusion

    def forward_native(positions, q, k, cache):
        cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)

        def rot(x):
            x = x.view(x.shape[0], -1, 128)
            a, b = x.chunk(2, dim=-1)
            c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
            return torch.cat((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
        return rot(q), rot(k)

    seen = []

    class Recording(rope_fusion.RopeFusionPass):
        def __call__(self, graph, is_inference=None):
            super().__call__(graph, is_inference)
            seen.append(sum(n.target is triton_kernel_wrapper_functional for n in graph.nodes))

    p = Recording(backend="triton")
    compiled = torch.compile(forward_native, options={"post_grad_custom_post_pass": p})
    cache = torch.randn(4096, 128, device="cuda")
    for t in (300, 77, 2):  # (1 would specialize: Dynamo treats sizes 0 and 1 apart)
        pos = torch.randint(0, 4096, (t,), device="cuda")
        q = torch.randn(t, 8 * 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, 2 * 128, device="cuda", dtype=torch.bfloat16)
        if t == 300:
            for a in (pos, q, k):
                torch._dynamo.mark_dynamic(a, 0)
        qo, ko = compiled(pos, q, k, cache)
        eq, ek = forward_native(pos, q, k, cache)
        torch.testing.assert_close(qo, eq, atol=0.05, rtol=0.02)
        torch.testing.assert_close(ko, ek, atol=0.05, rtol=0.02)
    assert seen == [1], (seen, p.report.table())  # one graph, compiled once, one user-kernel node
    assert [k.backend for k in p.report.kernels] == ["triton"], p.report.table()


@pytest.mark.parametrize("interleaved,rotary_dim", [(False, 64), (True, 64), (False, 32)])
def test_cache_rows_picked_by_positions(interleaved, rotary_dim):
    """vLLM's gathered tables: one [max_pos, R/2] cos and sin (views of one cos|sin cache), a row per token."""
    torch.manual_seed(3)
    cache = torch.randn(40, rotary_dim)
    cos, sin = cache[:, : rotary_dim // 2], cache[:, rotary_dim // 2:]
    q = torch.randn(9, 4, 64, dtype=torch.bfloat16)  # [T, H, D]
    k = torch.randn(9, 2, 64, dtype=torch.bfloat16)
    pos = torch.randint(0, 40, (9, 1))
    kw = opts(interleaved, rotary_dim)
    with poisoned_outputs():
        qo, ko = tr.launch([q, k], cos, sin, RotaryParams(**kw), pos, kernel=KERNEL)
    check(qo, q, cos[pos], sin[pos], **kw)
    check(ko, k, cos[pos], sin[pos], **kw)


@pytest.mark.parametrize("norm,interleaved,rotary_dim,weighted,head_dim,block_h", [
    ("rms", False, 64, True, 64, None), ("rms", True, 64, False, 64, None), ("rms", False, 32, True, 64, None),
    ("rms", True, 80, True, 80, None), ("rms", False, 80, True, 80, None),  # padded rows (D=80)
    ("rms", False, 32, True, 72, None), ("rms", True, 48, True, 72, None),  # a padded tail: the weight as a row
    ("rms_across_heads", True, 64, True, 64, None), ("rms_across_heads", False, 48, False, 64, None),
    ("rms_across_heads", False, 64, True, 64, 1),  # heads over several blocks: the first pass sums them
    ("rms_across_heads", True, 80, True, 80, None),
])
def test_norm_prologue(norm, interleaved, rotary_dim, weighted, head_dim, block_h):
    """The QK-norm folded into the kernel: each head (or every head of a token) RMS-normalised, times the
    per-lane weight (per head and lane across heads), then rotated; against the reference's fp64 result. A
    weight shared by every head is loaded once per tensor, as a tile (rows without padded lanes) or as a row.
    The statistics come from the tile being rotated, or, for a norm across heads whose heads span several
    tiles, from a first pass."""
    torch.manual_seed(4)
    q = torch.randn(2, 5, 4, head_dim, dtype=torch.bfloat16) * 3
    k = torch.randn(2, 5, 2, head_dim, dtype=torch.bfloat16) * 3
    cos, sin = tables((5, 1), rotary_dim // 2)
    shape = (head_dim,) if norm == "rms" else None
    wq = (torch.randn(shape or (4, head_dim)) if weighted else None)
    wk = (torch.randn(shape or (2, head_dim)) if weighted else None)
    kw = opts(interleaved, rotary_dim)
    params = RotaryParams(**kw, norm=norm, norm_eps=1e-5)
    with poisoned_outputs():
        qo, ko = tr.launch([q, k], cos, sin, params, None, [wq, wk], kernel=KERNEL, block_h=block_h)
    for out, x, w in ((qo, q, wq), (ko, k, wk)):
        want = rotary_reference(x.double(), cos.double(), sin.double(), out_dtype=torch.float64, norm=norm,
                                norm_eps=1e-5, norm_weight=None if w is None else w.double(),
                                **{k_: v for k_, v in kw.items() if k_ != "out_dtype"})
        err = (out.double() - want).abs().max().item()
        assert err <= 4 * torch.finfo(torch.bfloat16).eps * want.abs().max().item(), err


@pytest.mark.parametrize("norm,interleaved,head_dim", [("rms", True, 80), ("rms", False, 80), ("rms", False, 64),
                                                    ("rms_across_heads", True, 64)])
def test_norm_prologue_in_fp64(norm, interleaved, head_dim):
    """fp64 inputs take the kernel's fp64 math, where the norm's scale is 1 / sqrt (fp32 takes rsqrt, which
    is an approximation in fp64 too) and a weight row folded into the tables: within a few fp64 ulps of the
    reference."""
    torch.manual_seed(9)
    q = torch.randn(2, 5, 4, head_dim, dtype=torch.float64)
    k = torch.randn(2, 5, 2, head_dim, dtype=torch.float64)
    cos, sin = tables((5, 1), head_dim // 2, dtype=torch.float64)
    wq, wk = (torch.randn(head_dim if norm == "rms" else (h, head_dim), dtype=torch.float64) for h in (4, 2))
    kw = opts(interleaved, head_dim, out_dtype=torch.float64)
    with poisoned_outputs():
        qo, ko = tr.launch([q, k], cos, sin, RotaryParams(**kw, norm=norm, norm_eps=1e-5), None, [wq, wk],
                           kernel=KERNEL)
    for out, x, w in ((qo, q, wq), (ko, k, wk)):
        want = rotary_reference(x, cos, sin, norm=norm, norm_eps=1e-5, norm_weight=w, **kw)
        assert (out - want).abs().max().item() <= 1e-12 * want.abs().max().item()


def test_head_offsets_take_64_bits_only_where_32_could_overflow(monkeypatch):
    """The loop's head offsets are 32-bit where every one provably fits (the planner's rule, on meta tensors
    with a head stride that would overflow), and the 64-bit code computes the same outputs."""
    params = RotaryParams(**opts(True, 64), norm="rms", norm_eps=1e-6)
    cos, sin = tables((8, 1), 32)

    def head_i64(xs: list) -> bool:
        outs = [torch.empty_like(x) for x in xs]
        [(_, _, _, meta)] = planner.make_launches(xs, outs, planner.Tables(cos, sin, None, [None] * len(xs)), params)
        return meta["HEAD_I64"]

    small = torch.empty_strided((1, 8, 16, 64), (8 * 16 * 64, 64, 8 * 64, 1), device="meta")  # [B, S, H, D]
    wide = torch.empty_strided((1, 8, 16, 64), (16 * 2**22 * 64, 64, 2**22 * 64, 1), device="meta")  # [B, H, S, D]
    assert head_i64([small, small]) is False
    assert head_i64([small, wide]) is True

    torch.manual_seed(10)
    q = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 8, 2, 64, dtype=torch.bfloat16)
    w = torch.randn(64)
    with poisoned_outputs():
        narrow = tr.launch([q, k], cos, sin, params, None, [w, w], kernel=KERNEL)
        rope_fusion.clear_caches()
        monkeypatch.setattr(planner, "heads_fit_int32", lambda *a: False)
        wide_out = tr.launch([q, k], cos, sin, params, None, [w, w], kernel=KERNEL)
    for a, b in zip(narrow, wide_out):
        assert torch.equal(a, b)


# Builds the kernel's Triton IR for planned launches in a fresh interpreter: the IR is made before any target
# code, so no GPU is needed, but not in a process where the Triton interpreter has run (it patches the
# language's builtins). stdin: [[meta, scalars], ...]; stdout: for each, the count of fp64 tensor values.
_TTIR_SCRIPT = """
import json, re, sys
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction
import rope_fusion.kernels.triton_kernel as tk

fn = tk.rotary_kernel if isinstance(tk.rotary_kernel, JITFunction) else JITFunction(tk.rotary_kernel.fn)
names = fn.arg_names
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({})
counts = []
for meta, scalars in json.load(sys.stdin):
    meta = {k: v for k, v in meta.items() if k in names}
    # parameters the launch leaves at their defaults (the CAT form's pointers and strides) as Triton binds them
    meta = {**{p.name: p.default for p in fn.params if p.has_default and p.name not in meta}, **meta}
    values = dict(zip([n for n in names if n not in meta and not n.endswith("_ptr")], scalars))
    sig = {}
    for n in names:
        if n in meta:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n[:4] in ("cos_", "sin_", "pos_") else "*bf16"
        elif isinstance(values[n], float):  # Inductor's launcher types a Python float as fp64, Triton's as fp32
            sig[n] = "fp64"
        elif values[n] == 1:  # both specialise an int 1 as a constant
            sig[n] = "constexpr"
            meta[n] = 1
        else:
            sig[n] = "i32"
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in meta.items()})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    text = str(src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                           ctx))
    counts.append(len(re.findall(r"tensor<[^>]*xf64>", text)))
print(json.dumps(counts))
"""


def test_no_scalar_is_typed_apart_by_inductor_and_triton():
    """Inductor's launcher types a Python float argument as fp64, Triton's own launch as fp32. A float scalar once
    promoted the norm's scale and every product of the tile to fp64 in the graph (1.4-1.6x the fp32 kernel's time),
    and, cast back, still compiled the user-kernel node a binary of its own, whose schedule ran 4-7% slower than
    the direct launch's at the Flux joint cat. So no scalar of a launch is a float: eps goes as its fp32 bits, and
    the math stays fp32. Checked on the kernel's Triton IR as Inductor types it, for each norm form, with the fp64
    math variant (fp64 inputs) as the control; and an eps whose bits are 1 (specialised to a constant by both
    launchers) compiles."""
    import json
    import subprocess

    q = torch.randn(1, 4, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    cos, sin = tables((4, 1), 32)
    jobs = []
    for norm, interleaved, neox_row, block_h, eps in (
            ("rms", True, None, None, 1e-6), ("rms", False, True, None, 1e-5), ("rms", False, False, None, 1e-6),
            ("rms_across_heads", True, None, None, 1e-6), ("rms_across_heads", False, None, 1, 1.4e-45)):
        params = RotaryParams(**opts(interleaved), norm=norm, norm_eps=eps)
        weights = [torch.ones(64 if norm == "rms" else (h, 64)) for h in (4, 2)]
        outs = [torch.empty_like(q), torch.empty_like(k)]
        tabs = planner.Tables(cos, sin, None, weights)
        [(_, _, scalars, meta)] = planner.make_launches([q, k], outs, tabs, params, block_h=block_h, neox_row=neox_row)
        assert not meta["MATH_FP64"] and not any(isinstance(v, float) for v in scalars), scalars
        assert planner.eps_bits(eps) in scalars
        jobs += [[meta, scalars], [{**meta, "MATH_FP64": True}, scalars]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _TTIR_SCRIPT], input=json.dumps(jobs), capture_output=True,
                          text=True, env=env, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts[0::2] == [0] * 5, counts  # fp32 math: no fp64 value anywhere in the tile
    assert all(c > 0 for c in counts[1::2]), counts  # the control: the IR shows fp64 math when asked


@pytest.mark.parametrize("head_dim", [64, 80], ids=["weight-tile", "weight-row-folded"])
def test_norm_prologue_with_deinterleaved_output(head_dim):
    """A per-head norm on interleaved input written in NeoX order: the weight acts on the input lanes (also
    where it is folded into the tables: padded rows)."""
    torch.manual_seed(5)
    q = torch.randn(3, 6, 4, head_dim, dtype=torch.bfloat16) * 2
    k = torch.randn(3, 6, 1, head_dim, dtype=torch.bfloat16) * 2
    cos, sin = tables((6, 1), head_dim // 2)
    wq, wk = torch.randn(head_dim), torch.randn(head_dim)
    params = RotaryParams(interleaved=True, rotary_dim=head_dim, full_tables=False, conjugate=False,
                          out_dtype=torch.bfloat16, deinterleave=True, norm="rms", norm_eps=1e-6)
    with poisoned_outputs():
        qo, ko = tr.launch([q, k], cos, sin, params, None, [wq, wk], kernel=KERNEL)
    for out, x, w in ((qo, q, wq), (ko, k, wk)):
        want = rotary_reference(x.double(), cos.double(), sin.double(), interleaved=True, rotary_dim=head_dim,
                                full_tables=False, conjugate=False, out_dtype=torch.float64, deinterleave=True,
                                norm="rms", norm_eps=1e-6, norm_weight=w.double())
        err = (out.double() - want).abs().max().item()
        assert err <= 4 * torch.finfo(torch.bfloat16).eps * want.abs().max().item(), err


@pytest.mark.parametrize("full", [False, True])
def test_deinterleaved_output(full):
    """Interleaved pairs of x written in NeoX order (DeepSeek-V3): checked against the NeoX rotation of the
    de-interleaved x."""
    torch.manual_seed(7)
    q = torch.randn(2, 6, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 6, 1, 64, dtype=torch.bfloat16)
    cos, sin = tables((6, 1), 64 if full else 32)
    params = RotaryParams(interleaved=True, rotary_dim=64, full_tables=full, conjugate=False,
                          out_dtype=torch.bfloat16, deinterleave=True)
    with poisoned_outputs():
        qo, ko = tr.launch([q, k], cos, sin, params, kernel=KERNEL)
    for out, x in ((qo, q), (ko, k)):
        xd = x.unflatten(-1, (32, 2)).transpose(-1, -2).reshape(x.shape)
        check(out, xd, cos, sin, **opts(False, 64, full_tables=full))


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("blocks,head_dim", [(3, 96), (2, 72), (4, 64)])
def test_neox_within_blocks(full, blocks, head_dim):
    """A head dim rotated per axis (Allegro: 3 blocks of 32; a pass-through tail at 72 of 64 rotated): NeoX
    pairs within each block, tables indexed per block, norm weights per lane."""
    torch.manual_seed(11)
    rot = 64 if head_dim == 72 else head_dim
    q = torch.randn(2, 5, 4, head_dim, dtype=torch.bfloat16)
    k = torch.randn(2, 5, 2, head_dim, dtype=torch.bfloat16)
    cos, sin = tables((5, 1), rot if full else rot // 2)
    params = RotaryParams(interleaved=False, rotary_dim=rot, full_tables=full, conjugate=False,
                          out_dtype=torch.float32, rotary_blocks=blocks)
    w = torch.randn(head_dim)
    for norm, weights in (("none", None), ("rms", [w, w])):
        p = params.replace(norm=norm)
        with poisoned_outputs():
            outs = tr.launch([q, k], cos, sin, p, weights=weights, kernel=KERNEL, block_h=2)
        for out, x in zip(outs, (q, k)):
            want = rotary_reference(x.double(), cos.double(), sin.double(), positions=None,
                                    norm_weight=None if weights is None else w.double(),
                                    **{**p.kwargs(), "out_dtype": torch.float64})
            assert not out.isnan().any()
            err = (out.double() - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), err


@pytest.mark.parametrize("nsplit,block_h", [(None, None), (3, 1)])
def test_three_tensors_in_one_launch(nsplit, block_h):
    """q, k and v (CLVP) share tables: one launch whose work items are the head blocks of all three (also
    spread over several programs per token), each tensor with its own head count, strides and norm weight."""
    torch.manual_seed(12)
    q = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 5, 1, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 6, 3, 64, dtype=torch.bfloat16)[:, :5].transpose(1, 2).contiguous().transpose(1, 2)
    cos, sin = tables((5, 1), 16)
    params = RotaryParams(interleaved=False, rotary_dim=32, full_tables=False, conjugate=True,
                          out_dtype=torch.bfloat16)
    calls = []

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return KERNEL[grid]

    with poisoned_outputs():
        outs = tr.launch([q, k, v], cos, sin, params, kernel=Counting(), nsplit=nsplit, block_h=block_h)
    assert len(calls) == 1
    for out, x in zip(outs, (q, k, v)):
        check(out, x, cos, sin, **opts(False, 32, conjugate=True))
    wq, wk, wv = (torch.randn(64) for _ in range(3))
    with poisoned_outputs():
        outs = tr.launch([q, k, v], cos, sin, params.replace(norm="rms"), weights=[wq, wk, wv], kernel=KERNEL,
                         nsplit=nsplit, block_h=block_h)
    for out, x, w in zip(outs, (q, k, v), (wq, wk, wv)):
        want = rotary_reference(x.double(), cos.double(), sin.double(), interleaved=False, rotary_dim=32,
                                full_tables=False, conjugate=True, out_dtype=torch.float64, norm="rms",
                                norm_weight=w.double())
        err = (out.double() - want).abs().max().item()
        assert err <= 4 * torch.finfo(torch.bfloat16).eps * want.abs().max().item(), err


@pytest.mark.parametrize("head_dim,offset,rot,style,norm", [
    (192, 128, 64, "deinterleave", "none"),  # DeepSeek-V3's MLA head: rope after 128 nope lanes
    (192, 128, 64, "neox", "rms"),
    (96, 16, 64, "interleaved", "rms"),  # a head and a tail around the rotated lanes
    (96, 16, 64, "neox", "none"),
    (72, 8, 32, "deinterleave", "rms_across_heads"),
])
def test_pass_through_head(head_dim, offset, rot, style, norm):
    """Lanes [offset, offset + rot) rotate and the lanes around them are copied, in one pass over each row;
    a norm normalises the whole head, pass-through lanes included. Against the fp64 reference."""
    torch.manual_seed(13)
    q = torch.randn(2, 5, 4, head_dim, dtype=torch.bfloat16) * 2
    k = torch.randn(2, 5, 1, head_dim, dtype=torch.bfloat16) * 2
    cos, sin = tables((5, 1), rot)
    params = RotaryParams(interleaved=style != "neox", rotary_dim=rot, full_tables=True, conjugate=False,
                          out_dtype=torch.float32, deinterleave=style == "deinterleave", norm=norm,
                          rotary_offset=offset)
    weights = None if norm == "none" else \
        [torch.randn(head_dim) if norm == "rms" else torch.randn(x.shape[-2], head_dim) for x in (q, k)]
    with poisoned_outputs():
        outs = tr.launch([q, k], cos, sin, params, None, weights, kernel=KERNEL)
    for i, (out, x) in enumerate(zip(outs, (q, k))):
        want = rotary_reference(x.double(), cos.double(), sin.double(),
                                norm_weight=None if weights is None else weights[i].double(),
                                **{**params.kwargs(), "out_dtype": torch.float64})
        assert not out.isnan().any(), "some output elements were never written"
        if norm == "none":
            assert torch.equal(out[..., :offset], x[..., :offset].float())  # the head is copied exactly
        err = (out.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), err


def test_pass_through_head_plan():
    """DeepSeek-V3's q [B, 128, T, 192] (rope after 128 lanes): 4 heads a block, every block a program of its own
    (NSPLIT = the blocks), two warps, streaming hints (the M8 tile sweep's best; BENCHMARKS.md)."""
    q = torch.empty(1, 128, 4096, 192, dtype=torch.bfloat16, device="meta")
    cos = torch.empty(1, 1, 4096, 64, dtype=torch.bfloat16, device="meta")
    params = RotaryParams(interleaved=True, rotary_dim=64, full_tables=True, conjugate=False,
                          out_dtype=torch.bfloat16, deinterleave=True, rotary_offset=128)
    tabs = planner.Tables(cos, cos, None, [None])
    [(_, grid, _, meta)] = planner.make_launches([q], [torch.empty_like(q)], tabs, params)
    assert (meta["BLOCK_H"], meta["num_warps"], meta["STREAM"]) == (4, 2, True)
    assert grid == (4096, 128 // 4)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("norm", ["none", "rms", "rms_across_heads"])
def test_streaming_hints_change_no_result(stream, norm):
    """STREAM only adds cache hints to x's loads and the stores: outputs against the fp64 reference either way,
    and the default takes them only where the sweep measured a gain."""
    torch.manual_seed(16)
    q, k = torch.randn(2, 3, 4, 80, dtype=torch.bfloat16), torch.randn(2, 3, 2, 80, dtype=torch.bfloat16)
    cos, sin = tables((3, 1), 40)
    params = RotaryParams(interleaved=True, rotary_dim=80, full_tables=False, conjugate=False,
                          out_dtype=torch.float32, norm=norm)
    weights = None if norm == "none" else \
        [torch.randn(80) if norm == "rms" else torch.randn(x.shape[-2], 80) for x in (q, k)]
    with poisoned_outputs():
        outs = tr.launch([q, k], cos, sin, params, None, weights, kernel=KERNEL, stream=stream)
    for i, (out, x) in enumerate(zip(outs, (q, k))):
        want = rotary_reference(x.double(), cos.double(), sin.double(),
                                norm_weight=None if weights is None else weights[i].double(),
                                **{**params.kwargs(), "out_dtype": torch.float64})
        assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert planner.default_stream(params) == (norm != "none")  # padded rows (D=80) under a norm
    assert not planner.default_stream(params.replace(rotary_dim=128)) or norm == "rms_across_heads"


@pytest.mark.parametrize("norm", ["rms_across_heads", "rms"])
def test_a_norm_the_kernel_loop_cannot_take_is_applied_first(norm):
    """The kernel normalises the rows it loops over: the heads, the dim along which the tables are constant.
    For x [B, H, S, D], a norm over its last two dims (S and D, not the heads) and a weight [S, D] that varies
    over tokens are not that: they are applied before the rotation, and the result matches the reference."""
    torch.manual_seed(14)
    q, k = torch.randn(2, 3, 5, 32), torch.randn(2, 1, 5, 32)
    cos, sin = tables((5,), 16)
    weights = [torch.randn(5, 32), torch.randn(5, 32)] if norm == "rms" else None
    params = RotaryParams(interleaved=False, rotary_dim=32, full_tables=False, conjugate=False,
                          out_dtype=torch.float32, norm=norm)
    with poisoned_outputs():
        outs = tr.launch([q, k], cos, sin, params, None, weights, kernel=KERNEL)
    for i, (out, x) in enumerate(zip(outs, (q, k))):
        want = rotary_reference(x.double(), cos.double(), sin.double(),
                                norm_weight=None if weights is None else weights[i].double(),
                                **{**params.kwargs(), "out_dtype": torch.float64})
        err = (out.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), err


@cuda
@pytest.mark.parametrize("style", ["deinterleave", "neox", "interleaved"])
def test_gpu_pass_through_head(style):
    """DeepSeek-V3's MLA head on the GPU: the last 64 of 192 lanes rotate, the 128 before them are copied."""
    torch.manual_seed(15)
    q = torch.randn(1, 16, 1024, 192, dtype=torch.bfloat16, device="cuda")
    cos, sin = (t.to("cuda") for t in tables((1024,), 64))
    params = RotaryParams(interleaved=style != "neox", rotary_dim=64, full_tables=True, conjugate=False,
                          out_dtype=torch.bfloat16, deinterleave=style == "deinterleave", rotary_offset=128)
    (out,) = tr.launch([q], cos, sin, params)
    want = rotary_reference(q.double(), cos.double(), sin.double(), **{**params.kwargs(), "out_dtype": torch.float64})
    assert torch.equal(out[..., :128], q[..., :128])
    err = (out.double() - want).abs().max().item()
    assert err <= 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item(), err


@pytest.mark.parametrize("full,conjugate,gathered", [(False, False, False), (True, True, False), (False, False, True)],
                         ids=["per-pair", "full-conj", "cache-rows"])
def test_angle_tables(full, conjugate, gathered):
    """Tables given as angles: the kernel takes cos and sin of each token's angle row once, for every head of
    q and k; angles up to 500 rad (positions x frequencies) against fp64 cos and sin of the same fp32 angles.
    With positions, the angles are cache rows."""
    torch.manual_seed(16)
    q = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 5, 2, 64, dtype=torch.bfloat16)
    width = 64 if full else 32
    if gathered:
        cache, pos = torch.rand(40, width) * 500, torch.randint(0, 40, (2, 5, 1))
        ang = cache[pos]
        args = (cache, cache, RotaryParams(**opts(False, 64, full, conjugate), angle_tables=True), pos)
    else:
        ang = torch.rand(5, 1, width) * 500
        args = (ang, ang, RotaryParams(**opts(False, 64, full, conjugate), angle_tables=True))
    with poisoned_outputs():
        outs = tr.launch([q, k], *args, kernel=KERNEL)
    for out, x in zip(outs, (q, k)):
        check(out, x, ang.double().cos(), ang.double().sin(), **opts(False, 64, full, conjugate))


@cuda
def test_gpu_angle_tables():
    """cos and sin of fp32 angles up to 8192 rad (8192 positions x frequency 1) on the GPU, against fp64."""
    torch.manual_seed(17)
    q = torch.randn(1, 8192, 8, 128, dtype=torch.bfloat16, device="cuda")
    ang = (torch.arange(8192, device="cuda")[:, None] * torch.rand(64, device="cuda"))[:, None]  # [S, 1, 64]
    params = RotaryParams(**opts(True, 128, False, False), angle_tables=True)
    (out,) = tr.launch([q], ang, ang, params)
    check(out, q, ang.double().cos(), ang.double().sin(), **opts(True, 128, False, False))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [(12, 2), (40, 40)])
def test_norm_across_heads_held_in_registers(interleaved, heads):
    """A norm across heads over whole rows holds every head block of a side in registers (HELD: the token is read
    once), q and k with their own block counts; against the fp64 reference, and the plan says so."""
    torch.manual_seed(17)
    hq, hk = heads
    q, k = (torch.randn(1, 3, h, 64, dtype=torch.bfloat16) * 2 for h in heads)
    cos, sin = tables((3, 1), 32)
    params = RotaryParams(**opts(interleaved, 64, out_dtype=torch.float32), norm="rms_across_heads", norm_eps=1e-5)
    weights = [torch.randn(h, 64) for h in heads]
    [(_, _, _, meta)] = planner.make_launches([q, k], [torch.empty_like(q), torch.empty_like(k)],
                                          planner.Tables(cos, sin, None, weights), params, nsplit=1)
    assert meta["HELD"] == -(-max(heads) // meta["BLOCK_H"])  # blocks of the side with the most heads
    with poisoned_outputs():
        outs = tr.launch([q, k], cos, sin, params, None, weights, kernel=KERNEL, nsplit=1)
    for out, x, w in zip(outs, (q, k), weights):
        want = rotary_reference(x.double(), cos.double(), sin.double(), norm_weight=w.double(),
                                **{**params.kwargs(), "out_dtype": torch.float64})
        assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("head_dim,heads,held,warps", [
    (80, (16, 16), True, 2), (80, (8, 8), True, 1), (80, (24, 24), True, 2),
    (80, (40, 40), False, None),  # past HELD_HEADS_ELEMENTS: the head loop
    (80, (16, 8), False, None),  # GQA: the head loop
    (128, (16, 16), False, None), (64, (16, 16), False, None),  # whole rows: the head loop
])
def test_per_head_norm_plan_holds_padded_rows(interleaved, head_dim, heads, held, warps):
    """Under a per-head norm, rows padded to more lanes than the head has (80 in 128) are held in registers, NeoX as
    two halves, where the sweeps measured it ahead of the head loop: up to 24 heads a side, q and k alike; whole
    rows (64, 128), more heads, GQA and fewer tokens than programs to fill the GPU keep the head loop."""
    q, k = (torch.empty(1, 16384, h, head_dim, dtype=torch.bfloat16) for h in heads)
    cos, sin = tables((16384, 1), head_dim)
    params = RotaryParams(**opts(interleaved, head_dim, True), norm="rms")
    tabs = planner.Tables(cos, sin, None, [torch.ones(head_dim)] * 2)
    [(_, grid, _, meta)] = planner.make_launches([q, k], [q, k], tabs, params)
    assert bool(meta["HELD"]) == held and grid == (16384, 1)
    if held:
        assert meta["HELD"] * meta["BLOCK_H"] >= max(heads) and meta["num_warps"] == warps and meta["STREAM"]
        assert not meta["NEOX_ROW"]
    assert planner.default_held(params, head_dim, heads) == held
    short = [t[:, :64] for t in (q, k)]
    short_tabs = planner.Tables(cos[:64], sin[:64], None, tabs.weights)
    [(_, grid, _, meta)] = planner.make_launches(short, short, short_tabs, params)
    assert meta["HELD"] == 0 and grid[1] > 1


@pytest.mark.parametrize("norm,head_dim,tokens,nsplit", [
    ("rms", 128, 1024, 4), ("rms", 128, 2048, 2), ("rms", 128, 4096, 1), ("rms", 128, 256, 4), ("rms", 128, 64, 6),
    ("rms", 80, 2048, 1),  # held rows are never split
    ("none", 128, 2048, 1), ("none", 128, 256, 4), ("rms_across_heads", 128, 2048, 1),
])
def test_per_head_norm_launches_of_few_tokens_fill_the_grid(norm, head_dim, tokens, nsplit):
    """Under a per-head norm (a tile of 4 heads x 128 lanes, one warp), a launch of fewer tokens than
    NORM_SPLIT_PROGRAMS spreads each token's head blocks over programs until it has that many, at most
    NORM_SPLIT_MAX a token on that account (24/24 heads: 12 blocks); 64 tokens, whose every block is a program of
    its own, take blocks of 8 heads (6, `norm_row_tile`); held rows (D=80, a norm across heads) and other launches
    keep MIN_PROGRAMS."""
    q, k = (torch.empty(tokens, 24, head_dim, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = tables((tokens, 1), head_dim // 2)
    params = RotaryParams(**opts(False, head_dim), norm=norm)
    weights = [torch.ones(24, head_dim)] * 2 if norm == "rms_across_heads" else [torch.ones(head_dim)] * 2
    [(_, grid, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, sin, None, weights), params)
    assert grid == (tokens, nsplit)
    assert bool(meta["HELD"]) == (head_dim == 80 or norm == "rms_across_heads")


@pytest.mark.parametrize("interleaved,rotary,heads,tokens,positions,tile", [
    (True, 128, (24, 24), 64, False, (8, 4)),  # every head block a program of its own
    (False, 96, (24, 24), 64, False, (8, 4)),  # MiniMax-H3's NeoX rows with their tail in the halves' padding
    (True, 64, (32, 8), 64, False, (8, 4)),
    (True, 64, (32, 8), 4096, False, (8, 2)),  # GQA's interleaved rows, a program per token
    (True, 128, (24, 24), 4096, False, (4, 1)),  # equal head counts: the general rule
    (False, 128, (32, 8), 4096, False, (4, 1)),  # GQA's NeoX rows: not measured, the general rule
    (True, 128, (24, 24), 256, False, (4, 1)),  # 256 tokens x 6 blocks of 8 exceed MIN_PROGRAMS: the split rule
    (True, 128, (24, 24), 64, True, (4, 1)),  # rows gathered by positions: not measured
])
def test_per_head_norm_rows_of_128_lanes_take_the_measured_tiles(interleaved, rotary, heads, tokens, positions,
                                                                 tile):
    """`norm_row_tile`: a per-head norm's rows of 128 lanes take 8 heads a block and 4 warps where every head
    block is a program of its own, and 8 heads with 2 warps for GQA's interleaved rows a program per token; every
    other launch keeps the general rules; the launch's result is the fp64 reference's (the kernel interpreted, at
    a few tokens of the same heads: the tile is the rule's, asked for)."""
    q, k = (torch.randn(tokens, h, 128) for h in heads)
    params = RotaryParams(interleaved=interleaved, rotary_dim=rotary, full_tables=False, conjugate=False,
                          out_dtype=torch.float32, norm="rms")
    angles = torch.randn(tokens + 3 if positions else tokens, rotary // 2, dtype=torch.float64)
    cos, sin = angles.cos().float(), angles.sin().float()  # cache rows with positions, else a row a token
    if not positions:
        cos, sin = cos[:, None], sin[:, None]
    pos = torch.randperm(tokens + 3)[:tokens, None] if positions else None  # [T, 1]: a row a token, every head
    weights = [torch.rand(128) + 0.5 for _ in range(2)]
    tabs = planner.Tables(cos, sin, pos, weights)
    outs = [torch.empty_like(q), torch.empty_like(k)]
    [(_, grid, _, meta)] = planner.make_launches([q, k], outs, tabs, params)
    assert (meta["BLOCK_H"], meta["num_warps"]) == tile and not meta["HELD"]
    if tile == planner.NORM_FEW_TOKENS_TILE:
        assert grid == (tokens, sum(-(-h // 8) for h in heads))
    few = 5  # the interpreter runs every program: the tile asked for, on a few tokens
    xs = [x[:few] for x in (q, k)]
    cos, sin = (t[:few + 3] if positions else t[:few] for t in (cos, sin))
    pos = torch.randperm(few + 3)[:few, None] if positions else None
    with poisoned_outputs():
        outs = tr.launch(xs, cos, sin, params, pos, weights, kernel=KERNEL, block_h=tile[0], num_warps=tile[1])
    for out, x, w in zip(outs, xs, weights):
        c, s_ = (cos[pos], sin[pos]) if positions else (cos, sin)
        want = rotary_reference(x.double(), c.double(), s_.double(), norm_weight=w.double(),
                                **{**params.kwargs(), "out_dtype": torch.float64})
        assert not out.isnan().any()
        assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("interleaved,neox_row,blocks", [(True, None, 1), (False, None, 1), (False, True, 1),
                                                         (False, None, 2)],
                         ids=["interleaved", "neox-halves", "neox-rows", "neox-blocks"])
@pytest.mark.parametrize("per_head_weight", [False, True], ids=["lane-weight", "head-weight"])
@pytest.mark.parametrize("block_h", [None, 2])
def test_per_head_norm_held_rows(interleaved, neox_row, blocks, per_head_weight, block_h):
    """The held per-head norm (each head block's own statistics, every block of a side loaded first) at D=80,
    q and k with different head counts (blocks of the shorter side masked), NeoX also in two blocks of 40 lanes
    (Allegro's per-axis form), against the fp64 reference."""
    torch.manual_seed(23)
    heads = (5, 3)
    q, k = (torch.randn(1, 3, h, 80, dtype=torch.bfloat16) * 2 for h in heads)
    cos, sin = tables((3, 1), 80)
    params = RotaryParams(**opts(interleaved, 80, True, out_dtype=torch.float32), norm="rms", norm_eps=1e-5,
                          rotary_blocks=blocks)
    weights = [torch.randn(h, 80) if per_head_weight else torch.randn(80) for h in heads]
    tiles = dict(nsplit=1, block_h=block_h, neox_row=neox_row, held=True)  # forced: the rule keeps GQA in the loop
    [(_, _, _, meta)] = planner.make_launches([q, k], [torch.empty_like(q), torch.empty_like(k)],
                                          planner.Tables(cos, sin, None, weights), params, **tiles)
    assert meta["HELD"] == -(-max(heads) // meta["BLOCK_H"])
    assert meta["NEOX_ROW"] == bool(neox_row) and meta["BH"] == 40 // blocks
    with poisoned_outputs():
        outs = tr.launch([q, k], cos, sin, params, None, weights, kernel=KERNEL, **tiles)
    for out, x, w in zip(outs, (q, k), weights):
        want = rotary_reference(x.double(), cos.double(), sin.double(), norm_weight=w.double(),
                                **{**params.kwargs(), "out_dtype": torch.float64})
        assert not out.isnan().any()
        assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@cuda
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_gpu_per_head_norm_held(interleaved):
    """The compiled held per-head norm at D=80 with the default plan (2048 tokens, 16 heads each), against fp64."""
    torch.manual_seed(29)
    q = torch.randn(1, 2048, 16, 80, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 2048, 16, 80, dtype=torch.bfloat16, device="cuda")
    cos, sin = tables((2048, 1), 80, device="cuda")
    weights = [1 + 0.1 * torch.randn(80, device="cuda"), 1 + 0.1 * torch.randn(16, 80, device="cuda")]
    params = RotaryParams(**opts(interleaved, 80, True), norm="rms")
    [(_, _, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, sin, None, weights), params)
    assert meta["HELD"] > 0
    outs = tr.launch([q, k], cos, sin, params, None, weights)
    for out, x, w in zip(outs, (q, k), weights):
        want = rotary_reference(x.double(), cos.double(), sin.double(), norm_weight=w.double(),
                                **{**params.kwargs(), "out_dtype": torch.float64})
        assert (out.double() - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


@pytest.mark.parametrize("style,norm,rotary_dim,gathered", [
    ("deinterleave", "none", 64, False), ("deinterleave", "rms", 64, False), ("neox", "none", 64, False),
    ("neox", "rms", 64, False), ("interleaved", "none", 64, False), ("interleaved", "rms", 64, False),
    ("neox", "rms", 32, False),  # a pass-through tail
    ("neox", "none", 64, True), ("interleaved", "rms", 32, True),  # cache rows picked by positions
])
def test_single_head_rows_take_several_tokens_a_program(style, norm, rotary_dim, gathered, monkeypatch):
    """A tensor of one head (MLA's k_pe [B, 1, T, 64]) takes ROW_TOKENS tokens a program, as one (tokens, lanes)
    tile with a table row per token (picked by positions too); against the fp64 reference, and the plan says so."""
    monkeypatch.setattr(planner, "MIN_PROGRAMS", 2)
    rope_fusion.clear_caches()
    torch.manual_seed(18)
    k = torch.randn(2, 1, 24, 64, dtype=torch.bfloat16) * 2
    pos = None
    if gathered:  # a [max_pos, R] cache and a position per token, broadcast against x's leading dims
        cache_c, cache_s = tables((40,), rotary_dim)
        pos = torch.randint(0, 40, (2, 1, 24))
        cos, sin = cache_c, cache_s
        want_c, want_s = cache_c[pos], cache_s[pos]
    else:
        cos, sin = tables((2, 1, 24), rotary_dim)
        want_c, want_s = cos, sin
    params = RotaryParams(interleaved=style != "neox", rotary_dim=rotary_dim, full_tables=True, conjugate=False,
                          out_dtype=torch.float32, deinterleave=style == "deinterleave", norm=norm)
    weights = [torch.randn(64)] if norm == "rms" else [None]
    tabs = planner.Tables(cos, sin, pos, weights)
    [(_, grid, _, meta)] = planner.make_launches([k], [torch.empty_like(k)], tabs, params)
    assert meta["TOKS"] == planner.ROW_TOKENS and grid == (48 // planner.ROW_TOKENS, 1)
    with poisoned_outputs():
        (out,) = tr.launch([k], cos, sin, params, pos, weights, kernel=KERNEL)
    want = rotary_reference(k.double(), want_c.double(), want_s.double(),
                            norm_weight=None if weights[0] is None else weights[0].double(),
                            **{**params.kwargs(), "out_dtype": torch.float64})
    assert (out.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("tokens,heads,head_dim,warps", [
    (4608, (24, 24), 128, {True: 4, False: 2}),  # 8 heads a step
    (32760, (40, 40), 128, {True: 8, False: 4}),  # 16 heads a step
    (8192, (32, 8), 128, {True: 4, False: 2}),  # GQA: a step as large as 40+40's, half the rows a program
    (32760, (12, 12), 128, {True: 1, False: 1}),  # 4 heads a step: one warp was the best
    (32768, (16, 16), 80, {True: 1, False: 1}),  # padded rows: one warp was the best
    (512, (24, 24), 128, {True: 1, False: 1}),  # decode's head blocks spread over programs: not swept
])
def test_whole_row_warps_follow_the_row_sweep(interleaved, tokens, heads, head_dim, warps):
    """Whole rows of 128 lanes without a norm take more warps where a step holds 8 or more heads and a program
    loops over a token's heads (the H200's whole-row sweep); the rest keep the general rule's one warp, and so do
    the same rows under a norm, with gathered tables or angle tables, and where the tile options set the warps."""
    q, k = (torch.empty(1, tokens, h, head_dim, dtype=torch.bfloat16) for h in heads)
    cos, sin = tables((tokens, 1), head_dim // 2)
    params = RotaryParams(**opts(interleaved, head_dim, head_dim=head_dim))
    [(_, _, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, sin, None, [None, None]), params)
    assert meta["num_warps"] == warps[interleaved]
    if warps[interleaved] == 1:
        return
    general = {"BLOCK_H": meta["BLOCK_H"], "num_warps": 1}
    [(_, _, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, sin, None, [None, None]), params,
                                              num_warps=1)
    assert {k: meta[k] for k in general} == general  # a tile option still decides
    [(_, _, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, sin, None, [None, None]),
                                              params.replace(angle_tables=True))
    assert meta["num_warps"] == 1
    cache = torch.empty(tokens, head_dim // 2)
    pos = torch.zeros(1, tokens, 1, dtype=torch.int64)
    [(_, _, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cache, cache, pos, [None, None]), params)
    assert meta["num_warps"] == 1
    w = [torch.ones(head_dim)] * 2
    [(_, _, _, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, sin, None, w),
                                              params.replace(norm="rms"))
    # under a per-head norm GQA's interleaved rows take their own measured tile (`norm_row_tile`), others the
    # general rule's warps
    gqa = interleaved and heads[0] != heads[1] and head_dim == 128
    want = planner.NORM_GQA_TILE[1] if gqa else planner.warps_for(meta["BLOCK_H"] * head_dim, "rows")
    assert meta["NORM"] == 1 and meta["num_warps"] == want
