"""rope_fusion.compat.vllm_omni's `fused_qk_norm_rope` and `fused_joint_qkv_norm_rope` against vllm-omni's contract.

vllm-omni does not install here: the upstream functions are written below from the contract its module states
(per-head RMSNorm `x * rsqrt(mean(x^2) + eps) * w` in the activations' dtype, then the packed `[cos | sin]` table's
rotation, half-split `(d, d + R/2)` or adjacent `(2i, 2i + 1)` pairs, the lanes past R kept), and the drop-ins are
held to the numerics contract against their fp64 evaluation (docs/design.md section 2) on every branch: the four
float dtypes, both pairings at partial, whole and two-lane rotations, GQA, tables in fp32 or the activations'
dtype. The reference serves CPU tensors; `kernel_on_cpu` runs the same calls through the Triton kernel,
interpreted, and counts its launches (q and k in one).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rope_fusion.compat import vllm_omni
from rope_fusion.compat.direct import ALL_PLANS
from tests.helpers.compat import kernel_on_cpu  # noqa: F401  (a fixture)
from tests.helpers.numerics import check_numerics, rel_err

T, HQ, HK, EPS = 6, 4, 2, 1e-6
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
GEOMETRIES = [(64, 48), (64, 64), (64, 2), (80, 80), (80, 32)]  # (head_dim, rotary_dim)


def upstream_rope(x, table, rotary_dim, interleaved):
    """vllm-omni's table rotation: cos and sin halves of the table, one angle per pair, lanes past R kept."""
    half = rotary_dim // 2
    cos, sin = table[..., None, :half].to(x.dtype), table[..., None, half:].to(x.dtype)
    first = x[..., 0:rotary_dim:2] if interleaved else x[..., :half]
    second = x[..., 1:rotary_dim:2] if interleaved else x[..., half:rotary_dim]
    a, b = first * cos - second * sin, second * cos + first * sin
    rot = torch.stack((a, b), -1).flatten(-2) if interleaved else torch.cat((a, b), -1)
    return torch.cat((rot, x[..., rotary_dim:]), -1)


def upstream_qk(q, k, q_weight, k_weight, rope_table, eps, rotary_dim, interleaved):
    d = q.shape[-1]
    qn, kn = F.rms_norm(q, (d,), q_weight.to(q.dtype), eps), F.rms_norm(k, (d,), k_weight.to(k.dtype), eps)
    return upstream_rope(qn, rope_table, rotary_dim, interleaved), upstream_rope(kn, rope_table, rotary_dim,
                                                                                  interleaved)


def upstream_joint(q0, k0, v0, q1, k1, v1, wq0, wk0, wq1, wk1, rope_table, eps, rotary_dim, interleaved):
    """The joint form: each stream normalised with its weights, joined (stream 0 first), rotated; v joined."""
    d = q0.shape[-1]
    q = torch.cat((F.rms_norm(q0, (d,), wq0.to(q0.dtype), eps), F.rms_norm(q1, (d,), wq1.to(q1.dtype), eps)), 1)
    k = torch.cat((F.rms_norm(k0, (d,), wk0.to(k0.dtype), eps), F.rms_norm(k1, (d,), wk1.to(k1.dtype), eps)), 1)
    table = rope_table.view(q.shape[0], q.shape[1], -1)
    return (upstream_rope(q, table, rotary_dim, interleaved), upstream_rope(k, table, rotary_dim, interleaved),
            torch.cat((v0, v1), 1))


def packed_table(rows, rotary_dim, dtype=torch.float32):
    angles = torch.rand(rows, rotary_dim // 2, dtype=torch.float64) * 20
    return torch.cat((angles.cos(), angles.sin()), -1).to(dtype)


def qk_inputs(d, rotary_dim, dtype, table_dtype, hq=HQ, hk=HK):
    q, k = torch.randn(T, hq, d).to(dtype), torch.randn(T, hk, d).to(dtype)
    qw, kw = (torch.rand(d) + 0.5).to(dtype), (torch.rand(d) + 0.5).to(dtype)
    return q, k, qw, kw, packed_table(T, rotary_dim, table_dtype)


def check_qk(args, interleaved, rotary_dim, out):
    assert all(o.dtype == args[0].dtype for o in out)

    def upstream(q, k, qw, kw, table):
        return upstream_qk(q, k, qw, kw, table, EPS, rotary_dim, interleaved)
    check_numerics(upstream, args, out, context=f"R={rotary_dim} interleaved={interleaved}")


@pytest.mark.parametrize("table_dtype", ["fp32", "same"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,r", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qk_norm_rope_matches_the_contract(dtype, d, r, interleaved, table_dtype):
    torch.manual_seed(d + r)
    args = qk_inputs(d, r, dtype, torch.float32 if table_dtype == "fp32" else dtype)
    rotary = None if r == args[4].shape[-1] else r
    out = vllm_omni.fused_qk_norm_rope(*args, EPS, rotary_dim=rotary, interleaved=interleaved)
    check_qk(args, interleaved, r, out)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,r", [(64, 48), (64, 64), (64, 2), (80, 80)])
def test_fused_qk_norm_rope_one_launch_of_the_kernel(kernel_on_cpu, d, r, interleaved):  # noqa: F811
    """The Triton kernel, interpreted: q and k (GQA) in one launch, at the contract's numerics; fresh inputs of the
    same geometry replay the plan, and a strided q (a chunked QKV's view) is read where it lies."""
    torch.manual_seed(r)
    args = qk_inputs(d, r, torch.bfloat16, torch.float32)
    out = vllm_omni.fused_qk_norm_rope(*args, EPS, interleaved=interleaved)
    assert kernel_on_cpu.count == 1
    check_qk(args, interleaved, r, out)
    fresh = (torch.randn_like(args[0]), torch.randn_like(args[1]), *args[2:4], packed_table(T, r))
    out = vllm_omni.fused_qk_norm_rope(*fresh, EPS, interleaved=interleaved)
    assert kernel_on_cpu.count == 2 and sum(len(p) for p in ALL_PLANS) == 1
    check_qk(fresh, interleaved, r, out)
    qkv = torch.randn(T, 3, HQ, d).to(torch.bfloat16)
    q, k, _ = qkv.unbind(1)
    out = vllm_omni.fused_qk_norm_rope(q, k, *args[2:], EPS, interleaved=interleaved)
    assert kernel_on_cpu.count == 3 and kernel_on_cpu.reads[-1][0].data_ptr() == q.data_ptr()
    check_qk((q, k, *args[2:]), interleaved, r, out)


class StaticLauncherStandIn:
    """Torch's static Triton launcher runs only compiled CUDA kernels: in its place, a launcher of its interface
    (`tensors_only`: called with a launch's 12 tensors; `from_pointers`: with their data pointers) that records what
    it was given. The GPU test of the same path launches the real one (tests/compat/test_dropins_gpu.py)."""

    tensors_only = True

    def __init__(self) -> None:
        self.given: list = []

        def from_pointers(*pointers: int) -> None:
            self.given.append(("pointers", pointers))
        from_pointers.count = 12
        self.from_pointers = from_pointers

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.given.append(("tensors", tuple(t.data_ptr() for t in tensors)))


@pytest.mark.parametrize("offset", [0, 3])
def test_a_checked_plan_launches_from_the_pointers_of_its_call(kernel_on_cpu, offset):  # noqa: F811
    """Once a plan's launch is checked and runs through a launcher that takes pointers, a call passes its q, k,
    outputs and weights' pointers, the table's for cos (and the unused rows) and the table's plus the offset of
    its sin half: the pointers of the tensors the call's launch reads and writes, with no view made. The table is
    cut from a buffer at an element offset (another 16-byte residue at offset 3)."""
    from rope_fusion.ops.plan_cache import plan_cache

    d, r = 64, 48
    torch.manual_seed(offset)
    args = qk_inputs(d, r, torch.bfloat16, torch.float32)
    vllm_omni.fused_qk_norm_rope(*args, EPS)  # planned, launched by the JIT launcher
    (runner,) = plan_cache("compat.qk_norm_rope").values()
    stand_in = StaticLauncherStandIn()
    (entry,) = runner.run.entries
    entry[4:] = (stand_in, True)  # the launch checked, its launcher the stand-in
    vllm_omni.fused_qk_norm_rope(*args, EPS)  # through the launcher with tensors; the plan takes its pointers
    assert stand_in.given[-1][0] == "tensors" and runner.by_pointers is not None
    buffer = torch.randn(T * r + offset)
    q, k, qw, kw = torch.randn_like(args[0]), torch.randn_like(args[1]), args[2].clone(), args[3].clone()
    table = buffer[offset:].view(T, r)
    table.copy_(args[4])
    if offset:  # another residue: a plan of its own, checked and launched apart
        vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS)
        runner = next(p for p in plan_cache("compat.qk_norm_rope").values() if p.by_pointers is None)
        (entry,) = runner.run.entries
        entry[4:] = (stand_in, True)
        vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS)
    outs = vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS)
    kind, pointers = stand_in.given[-1]
    cos, sin = table[:, None, :r // 2], table[:, None, r // 2:]
    want = (q, k, k, *outs, outs[1], cos, sin, cos, qw, kw, kw)
    assert kind == "pointers" and pointers == tuple(t.data_ptr() for t in want)


def test_eps_and_pairing_are_part_of_the_plan(kernel_on_cpu):  # noqa: F811
    """A plan is keyed by what it bakes in: another eps or pairing on the same tensors is a plan of its own."""
    torch.manual_seed(3)
    q, k, qw, kw, table = qk_inputs(64, 48, torch.float32, torch.float32)
    q = q * 1e-3  # eps matters at this scale
    for eps, interleaved in ((1e-6, False), (1e-2, False), (1e-2, True)):
        out = vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, eps, interleaved=interleaved)
        want = upstream_qk(*(t.double() for t in (q, k, qw, kw, table)), eps, 48, interleaved)
        assert max(rel_err(o, w) for o, w in zip(out, want)) < 1e-6
    assert sum(len(p) for p in ALL_PLANS) == 3


def test_zero_tokens_and_fp64():
    q, k, qw, kw, table = qk_inputs(32, 32, torch.float64, torch.float64)
    out = vllm_omni.fused_qk_norm_rope(q[:0], k[:0], qw, kw, table[:0], EPS)
    assert [tuple(o.shape) for o in out] == [(0, HQ, 32), (0, HK, 32)]
    out = vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS)
    want = upstream_qk(q, k, qw, kw, table, EPS, 32, False)
    assert max(rel_err(o, w) for o, w in zip(out, want)) < 1e-14


def test_autograd_and_compile_go_through_the_op():
    """With autograd to record, or under torch.compile, the call is the op's (rope_fusion::rotary_qk with its norm):
    gradients and the compiled result match fp64."""
    torch.manual_seed(4)
    q, k, qw, kw, table = qk_inputs(64, 48, torch.float32, torch.float32)
    q.requires_grad_(True)
    qw.requires_grad_(True)
    out = vllm_omni.fused_qk_norm_rope(q, k, qw, kw, table, EPS, interleaved=True)
    (out[0] * out[0].detach().sin()).sum().backward()
    q64, qw64 = q.detach().double().requires_grad_(True), qw.detach().double().requires_grad_(True)
    ref = upstream_qk(q64, k.double(), qw64, kw.double(), table.double(), EPS, 48, True)
    (ref[0] * out[0].detach().double().sin()).sum().backward()
    assert rel_err(q.grad, q64.grad) < 1e-5 and rel_err(qw.grad, qw64.grad) < 1e-5
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: vllm_omni.fused_qk_norm_rope(*a, EPS), fullgraph=True)
    args = (q.detach(), k, qw.detach(), kw, table)
    check_qk(args, False, 48, fn(*args))


@pytest.mark.parametrize("bad,match,exc", [
    (dict(q=torch.randn(T, HQ * 64)), r"\[tokens, heads, head_dim\]", ValueError),
    (dict(k=torch.randn(T + 1, HK, 64)), "share tokens and head_dim", ValueError),
    (dict(k=torch.randn(T, HK, 64).double()), "share dtype and device", ValueError),
    (dict(q=torch.randn(T, HQ, 64).int(), k=torch.randn(T, HK, 64).int()), "float tensor", TypeError),
    (dict(head_dim=32), "head_dim=32", ValueError),
    (dict(rotary_dim=47), "even and in", ValueError),
    (dict(table=torch.randn(T, 66), rotary_dim=66), "even and in", ValueError),
    (dict(qw=torch.randn(32)), r"q_weight must be \[64\]", ValueError),
    (dict(table=torch.randn(T, 48).half()), "float32", ValueError),
    (dict(table=torch.randn(T + 1, 48)), r"rope_table must be \[6, 48\]", ValueError),
])
def test_fused_qk_norm_rope_contract_errors(bad, match, exc):
    args = dict(q=torch.randn(T, HQ, 64), k=torch.randn(T, HK, 64), qw=torch.ones(64), kw=torch.ones(64),
                table=packed_table(T, 48))
    options = {n: bad.pop(n) for n in ("head_dim", "rotary_dim") if n in bad}
    args.update(bad)
    with pytest.raises(exc, match=match):
        vllm_omni.fused_qk_norm_rope(*args.values(), EPS, **options)


B, S0, S1 = 2, 3, 5


def joint_inputs(d, rotary_dim, dtype, hq=HQ, hk=HK):
    """Each stream's q, k and v as views of its fused QKV projection `[B, S, HQ + 2 * HK, D]` (strided)."""
    torch.manual_seed(d + rotary_dim)
    streams = tuple(t for s in (S0, S1) for t in torch.randn(B, s, hq + 2 * hk, d).to(dtype).split([hq, hk, hk], 2))
    weights = tuple((torch.rand(d) + 0.5).to(dtype) for _ in range(4))
    return (*streams, *weights, packed_table(B * (S0 + S1), rotary_dim))


def check_joint(args, rotary_dim, interleaved, out):
    assert [tuple(o.shape) for o in out] == [(B, S0 + S1, h, args[0].shape[-1]) for h in (HQ, HK, HK)]
    assert torch.equal(out[2], torch.cat((args[2], args[5]), 1))

    def upstream(*a):
        return upstream_joint(*a, EPS, rotary_dim, interleaved)[:2]
    check_numerics(upstream, args, out[:2], context=f"R={rotary_dim} interleaved={interleaved}")


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("d,r", [(64, 64), (64, 48), (80, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_joint_qkv_norm_rope_matches_the_contract(dtype, d, r, interleaved):
    args = joint_inputs(d, r, dtype)
    out = vllm_omni.fused_joint_qkv_norm_rope(*args, EPS, interleaved=interleaved)
    check_joint(args, r, interleaved, out)


@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_joint_qkv_norm_rope_one_launch_of_the_cat_kernel(kernel_on_cpu, interleaved):  # noqa: F811
    """The cat kernel, interpreted: q and k of both streams in one launch that reads each stream where it lies
    (the text stream's q is the kernel's first piece), at the contract's numerics; v one launch of the join kernel
    reading each stream's v where it lies (a view of its QKV projection), exactly the join; a second call replays
    both plans."""
    args = joint_inputs(64, 48, torch.bfloat16)
    for call in range(2):
        out = vllm_omni.fused_joint_qkv_norm_rope(*args, EPS, interleaved=interleaved)
        assert kernel_on_cpu.count == call + 1 and kernel_on_cpu.reads[call][0].data_ptr() == args[0].data_ptr()
        joins = kernel_on_cpu.joins
        assert joins.count == call + 1
        v0, v1, v = joins.reads[call]
        assert (v0.data_ptr(), v1.data_ptr(), v.data_ptr()) == (args[2].data_ptr(), args[5].data_ptr(),
                                                               out[2].data_ptr())
        assert not args[2].is_contiguous()
        check_joint(args, 48, interleaved, out)


def test_fused_joint_qkv_norm_rope_autograd():
    """With autograd to record the joint form goes through the op (each joined token normalised with its stream's
    weight): gradients of the image stream's q match fp64."""
    args = list(joint_inputs(64, 64, torch.float32))
    args[3].requires_grad_(True)
    out = vllm_omni.fused_joint_qkv_norm_rope(*args, EPS)
    check_joint([a.detach() for a in args], 64, True, [o.detach() for o in out])
    out[0].square().sum().backward()
    a64 = [a.detach().double() for a in args]
    a64[3].requires_grad_(True)
    upstream_joint(*a64, EPS, 64, True)[0].square().sum().backward()
    assert rel_err(args[3].grad, a64[3].grad) < 1e-5


@pytest.mark.parametrize("index,replace,match", [
    (1, torch.randn(B, S0 + 1, HK, 64), "k0 must be"),
    (3, torch.randn(B, S1, HQ, 32), "q1 must be"),
    (5, torch.randn(B, S1, HK, 64).double(), "share dtype and device"),
    (8, torch.randn(32), r"q1_weight must be \[64\]"),
    (10, packed_table(S0 + S1, 64), r"rope_table must be \[16, 64\]"),
])
def test_fused_joint_qkv_norm_rope_contract_errors(index, replace, match):
    args = list(joint_inputs(64, 64, torch.float32))
    args[index] = replace
    with pytest.raises(ValueError, match=match):
        vllm_omni.fused_joint_qkv_norm_rope(*args, EPS)
