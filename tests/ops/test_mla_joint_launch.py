"""DeepSeek's MLA q and its shared k_pe in one op call (issue 32, item 4): `offset_q_only`.

q's rope lanes follow its nope lanes (`cat(q_nope, rope(q_pe))`, a site with rotary_offset o that writes the whole
head of o + R lanes) and the single k_pe head rotates from lane 0 (head dim R) by the same tables. One
`rotary_qk` with `rotary_offset=o, offset_q_only=True` rotates both: in every backend (the reference, the lowering,
the Triton kernel in one launch, the NPU bridge and its graph form), against an fp64 evaluation of the model's
own formula on fresh random inputs; the pass groups the two sites into that call (docs/design.md sections 1.4, 2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rope_fusion
from rope_fusion.ops.reference import reference_outputs
from rope_fusion.ops.schema import RotaryCall, RotaryParams
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

B, H, T, NOPE, R, ROWS = 2, 4, 16, 32, 16, 40


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def deinterleave(x):
    b, h, s, d = x.shape
    return x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)


def mla(q, k_pe, cos, sin, deinterleaved: bool = True):
    """transformers' DeepSeek-V3 attention (de-interleaved, `rope_interleave`) or DeepSeek-V2's NeoX form: q's
    last R lanes rotate after its NOPE lanes, the one k_pe head rotates whole; tables [B, 1, T, R]."""
    q_pass, q_rot = torch.split(q, [NOPE, R], dim=-1)
    if deinterleaved:
        q_rot, k_pe = deinterleave(q_rot), deinterleave(k_pe)
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_pe = k_pe * cos + rotate_half(k_pe) * sin
    return torch.cat((q_pass, q_rot), dim=-1), k_pe


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, NOPE + R, generator=g).to(dtype)
    k = torch.randn(B, 1, T, R, generator=g).to(dtype)
    ang = torch.rand(ROWS, R // 2, generator=g, dtype=torch.float64) * 6
    ang = torch.cat((ang, ang), -1)
    positions = torch.randint(0, ROWS, (B, 1, T), generator=g)
    return q, k, ang.cos(), ang.sin(), positions


def params(deinterleaved: bool, out_dtype, **kw) -> RotaryParams:
    return RotaryParams(interleaved=deinterleaved, deinterleave=deinterleaved, rotary_dim=R, full_tables=True,
                        conjugate=False, out_dtype=out_dtype, rotary_offset=NOPE, offset_q_only=True, **kw)


def exact(q, k, cos, sin, positions, deinterleaved):
    """The model's formula in fp64, on the tables as the op reads them (gathered by positions)."""
    c, s = cos.double()[positions], sin.double()[positions]
    return mla(q.double(), k.double(), c, s, deinterleaved)


def close(got, want, dtype, context=""):
    """One rounding to the output dtype plus fp32 math: the kernel's and the lowering's contract."""
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape, context
        assert not g.isnan().any(), f"unwritten elements {context}"
        tol = torch.finfo(dtype).eps * w.abs() + 32 * torch.finfo(torch.float32).eps * (w.abs().max() + 1)
        err = (g.double() - w).abs()
        assert (err <= tol).all(), f"max err {err.max().item():.3g} {context}"


FORMS = pytest.mark.parametrize("deinterleaved", [True, False], ids=["deinterleaved-v3", "neox"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
TABLES = pytest.mark.parametrize("cached", [False, True], ids=["tables", "cache-by-positions"])


def _tables_and_positions(cos, sin, positions, cached, dtype):
    """Plain [B, 1, T, R] tables, or the [ROWS, R] caches with positions [B, 1, T]."""
    if cached:
        return cos.to(dtype), sin.to(dtype), positions
    return cos[positions].to(dtype), sin[positions].to(dtype), None


@FORMS
@DTYPES
@TABLES
def test_reference_and_lowering(deinterleaved, dtype, cached):
    """The eager op (the reference on the CPU) and its Inductor lowering, against fp64."""
    q, k, cos, sin, positions = inputs(dtype)
    want = exact(q, k, cos, sin, positions, deinterleaved)
    c, s, pos = _tables_and_positions(cos, sin, positions, cached, torch.float32)
    kw = params(deinterleaved, dtype).kwargs()

    def op(q, k, c, s, pos):
        return torch.ops.rope_fusion.rotary_qk(q, k, c, s, pos, **kw)

    close(op(q, k, c, s, pos), want, dtype, "reference")
    close(torch.compile(op, backend="inductor", fullgraph=True)(q, k, c, s, pos), want, dtype, "lowering")
    api = rope_fusion.apply_rotary_qk(q, k, c, s, positions=pos, interleaved=deinterleaved,
                                      deinterleave=deinterleaved, full_tables=True, rotary_offset=NOPE,
                                      rotary_dim=R, offset_q_only=True)
    close(api, want, dtype, "apply_rotary_qk")


@FORMS
def test_backward(deinterleaved):
    """The gradients of q, k and the tables with q's offset and k's whole head, against autograd through the
    model's formula: NeoX by the closed form (the inverse rotation of each tensor, the tables' sums), the
    de-interleaved form through the reference."""
    q, k, cos, sin, positions = inputs(torch.float64, seed=3)
    c, s = cos[positions].clone(), sin[positions].clone()
    leaves = [t.clone().requires_grad_() for t in (q, k, c, s)]
    got = rope_fusion.apply_rotary_qk(*leaves, interleaved=deinterleaved, deinterleave=deinterleaved,
                                      full_tables=True, rotary_offset=NOPE, rotary_dim=R, offset_q_only=True)
    assert params(deinterleaved, torch.float64).closed_form_backward is not deinterleaved
    grads = [torch.randn_like(g) for g in got]
    torch.autograd.backward(got, grads)
    mine = [t.grad for t in leaves]
    ref = [t.clone().requires_grad_() for t in (q, k, c, s)]
    torch.autograd.backward(mla(*ref, deinterleaved), grads)
    for a, b in zip(mine, (t.grad for t in ref)):
        torch.testing.assert_close(a, b)


def test_direct_calls_say_what_is_wrong():
    q, k, cos, sin, positions = inputs(torch.float32)
    c, s = cos[positions].float(), sin[positions].float()
    kw = dict(interleaved=False, full_tables=True, rotary_dim=R, offset_q_only=True)
    with pytest.raises(ValueError, match="offset_q_only=True without a rotary_offset"):
        rope_fusion.apply_rotary_qk(q[..., NOPE:], k, c, s, **kw)
    with pytest.raises(ValueError, match="k rotates its whole head from lane 0: its head dim must be rotary_dim=16"):
        rope_fusion.apply_rotary_qk(q, q, c, s, rotary_offset=NOPE, **kw)
    with pytest.raises(ValueError, match="needs q and k"):
        rope_fusion.apply_rotary(q, c, s, rotary_offset=NOPE, **kw)
    with pytest.raises(ValueError, match="q and k must share the head dim"):  # without it, as before
        rope_fusion.apply_rotary_qk(q, k, c, s, rotary_offset=NOPE, interleaved=False, full_tables=True,
                                    rotary_dim=R)
    with pytest.raises(ValueError, match="of_tensor"):
        from rope_fusion.ops.reference import rotary_reference
        rotary_reference(q, c, s, **params(False, torch.float32).kwargs())


# -- the Triton kernel (interpreted on the CPU) -------------------------------------------------------------

def _triton():
    pytest.importorskip("triton")
    import rope_fusion.kernels.triton_launch as launching
    import rope_fusion.kernels.triton_plan as planner
    from tests.helpers.interpreted_rotary import KERNEL, poisoned_outputs

    return launching, planner, KERNEL, poisoned_outputs


@FORMS
@DTYPES
@TABLES
def test_triton_kernel_one_launch(deinterleaved, dtype, cached):
    launching, planner, kernel, poisoned_outputs = _triton()
    q, k, cos, sin, positions = inputs(dtype, seed=1)
    want = exact(q, k, cos, sin, positions, deinterleaved)
    c, s, pos = _tables_and_positions(cos, sin, positions, cached, torch.float32)
    p = params(deinterleaved, dtype)
    outs = [torch.empty(x.shape, dtype=dtype) for x in (q, k)]
    launches = planner.make_launches([q, k], outs, planner.Tables(c, s, pos, [None, None]), p)
    [(group, grid, _, meta)] = launches  # one launch for q and k_pe
    assert group == [0, 1] and meta["OFFSET_Q_ONLY"] and meta["OFFSET"] == NOPE and meta["TOKS"] == 1
    with poisoned_outputs():
        got = launching.launch([q, k], c, s, p, pos, kernel=kernel)
    close(got, want, dtype, "triton")


def test_triton_ops_under_the_interpreter(monkeypatch):
    """`rotary_qk_triton`, the op the backend emits where its user-kernel node cannot be planned."""
    launching, _, kernel, poisoned_outputs = _triton()
    import rope_fusion.kernels.triton_rotary  # noqa: F401  (defines the op)

    monkeypatch.setattr(launching, "rotary_kernel", kernel)
    monkeypatch.setattr(launching, "INTERPRETED", True)
    q, k, cos, sin, positions = inputs(torch.bfloat16, seed=2)
    with poisoned_outputs():
        got = torch.ops.rope_fusion.rotary_qk_triton(q, k, cos.float(), sin.float(), positions,
                                                     **params(True, torch.bfloat16).kwargs())
    close(got, exact(q, k, cos, sin, positions, True), torch.bfloat16, "rotary_qk_triton")


def test_triton_norm_takes_a_launch_per_tensor():
    """Under a norm the kernel's statistics would take q's head dim for k too: each tensor is a launch of its own,
    with its own parameters (k from lane 0, several tokens a program), and the result is the reference's."""
    launching, planner, kernel, poisoned_outputs = _triton()
    q, k, cos, sin, positions = inputs(torch.float32, seed=4)
    c, s = cos[positions].float(), sin[positions].float()
    p = params(False, torch.float32, norm="rms")
    weights = [torch.rand(NOPE + R) + 0.5, torch.rand(R) + 0.5]
    outs = [torch.empty_like(x) for x in (q, k)]
    launches = planner.make_launches([q, k], outs, planner.Tables(c, s, None, weights), p)
    assert [(g, m["OFFSET"], m["OFFSET_Q_ONLY"]) for g, _, _, m in launches] == [([0], NOPE, False), ([1], 0, False)]
    with pytest.raises(ValueError, match="offset_q_only with a norm"):
        planner.launch_args(planner.plan_launch([q, k], outs, planner.Tables(c, s)), [q, k], outs,
                            planner.Tables(c, s), [0, 1], p)
    with poisoned_outputs():
        got = launching.launch([q, k], c, s, p, None, weights, kernel=kernel)
    want = reference_outputs(RotaryCall([q.double(), k.double()], c.double(), s.double(),
                                        p.replace(out_dtype=torch.float64), norm_weights=weights))
    close(got, want, torch.float32, "triton under a norm")


def test_planner_at_deepseek_v3_sizes():
    """DeepSeek-V3's q [1, 128, 8192, 192] and k_pe [1, 1, 8192, 64]: one launch of a token a program per head
    block (4 heads of 192 lanes, two warps, as q alone), k_pe's one head the last block: the 8 tokens a program
    that k_pe took alone do not apply to a launch with q's heads."""
    _, planner, _, _ = _triton()
    q = torch.empty(1, 128, 8192, 192, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 1, 8192, 64, dtype=torch.bfloat16, device="meta")
    cos = torch.empty(1, 8192, 64, dtype=torch.bfloat16, device="meta")[:, None]
    p = RotaryParams(interleaved=True, deinterleave=True, rotary_dim=64, full_tables=True, conjugate=False,
                     out_dtype=torch.bfloat16, rotary_offset=128, offset_q_only=True)
    [(group, grid, scalars, meta)] = planner.make_launches([q, k], [q, k], planner.Tables(cos, cos), p)
    alone = planner.make_launches([q], [q], planner.Tables(cos, cos), p.of_tensor(0))[0][3]
    assert group == [0, 1] and grid == (8192, 33) and meta["TOKS"] == 1  # 32 blocks of q, one of k_pe
    keys = ("BLOCK_H", "num_warps", "STREAM", "TAIL_PAD", "OFFSET")
    assert [meta[n] for n in keys] == [alone[n] for n in keys] == [4, 2, True, 128, 128]


# -- the NPU bridge and graph form, with stand-in torch_npu ops ----------------------------------------------

def test_npu_bridge(monkeypatch):
    from rope_fusion.kernels import npu
    from tests.helpers.npu_graph_stacks import CALLS, NS

    monkeypatch.setattr(npu, "OP_NAMESPACE", NS)
    CALLS.clear()
    q, k, cos, sin, positions = inputs(torch.float32, seed=5)
    c, s = cos[positions].float(), sin[positions].float()
    got = npu._impl(RotaryCall([q, k], c, s, params(False, torch.float32)))
    close(got, exact(q, k, cos, sin, positions, False), torch.float32, "npu bridge")
    assert [(call[0], call[1][-1]) for call in CALLS] == [("rotary_mul", R)] * 2  # q's rope lanes, then k_pe


def test_npu_graph_form(monkeypatch):
    """The pass on an NPU graph (npugraph_ex's call): q and k_pe are one group, emitted as torch_npu's ops on q's
    rope lanes (the head put back by a cat) and on k_pe whole."""
    from rope_fusion.integrations import fx_pass
    from rope_fusion.kernels import npu
    from tests.helpers import npu_graph_stacks as stacks

    monkeypatch.setattr(npu, "OP_NAMESPACE", stacks.NS)
    monkeypatch.setattr(fx_pass, "NPU_DEVICE_TYPES", ("npu", "cpu"))
    stacks.CALLS.clear()
    q, k, cos, sin, positions = inputs(torch.float32, seed=6)
    c, s = cos[positions].float(), sin[positions].float()
    fn = lambda q, k, c, s: mla(q, k, c, s, False)  # noqa: E731
    out, config, rep = stacks.run_stack(fn, (q, k, c, s))
    assert len(rep.sites) == 2 and len(rep.kernels) == 1, rep.table()
    targets = stacks.graph_targets(config)
    assert targets.count(stacks.ROTARY_MUL) == 2 and not any(t.startswith("rope_fusion.") for t in targets), targets
    close(out, exact(q, k, cos, sin, positions, False), torch.float32, "npu graph form")


# -- the pass ---------------------------------------------------------------------------------------------

@FORMS
@DTYPES
def test_the_pass_groups_q_and_k_pe(deinterleaved, dtype):
    q, k, cos, sin, positions = inputs(dtype, seed=7)
    c, s = cos[positions].to(dtype), sin[positions].to(dtype)
    fn = lambda q, k, c, s: mla(q, k, c, s, deinterleaved)  # noqa: E731
    out, p = compile_with_pass(fn, q, k, c, s)
    rep = p.report
    assert not rep.errors and not rep.misses, rep.table()
    assert [kk.op for kk in rep.kernels] == ["rope_fusion.rotary_qk"], rep.table()
    by_role = {site.role: site for site in rep.sites}
    assert (by_role["q"].rotary_offset, by_role["q"].head_dim) == (NOPE, NOPE + R), rep.table()
    assert (by_role["k"].rotary_offset, by_role["k"].head_dim) == (0, R), rep.table()
    assert rep.sites[0].role == "q"  # q, with the pass-through head, is the op's first tensor
    counts = p.capture.counts_after()
    assert counts.get("rope_fusion.rotary_qk.default") == 1 and not any("cat" in t for t in counts), counts
    check_numerics(fn, (q, k, c, s), out, context=rep.table())


def test_heads_that_differ_otherwise_do_not_pair():
    """q with a pass-through head and a k of another head dim than rotary_dim (or with a head of its own) stay two
    calls: only a k that rotates its whole head joins q's call."""
    q, k, cos, sin, positions = inputs(torch.float32, seed=8)
    c, s = cos[positions].float(), sin[positions].float()
    k_tail = torch.randn(B, 1, T, R + 8)

    def fn(q, k, c, s):
        qo, _ = mla(q, k[..., :R], c, s, False)
        kr = k[..., :R]
        return qo, torch.cat((kr * c + rotate_half(kr) * s, k[..., R:]), -1)

    out, p = compile_with_pass(fn, q, k_tail, c, s)
    rep = p.report
    assert len(rep.sites) == 2 and [kk.op for kk in rep.kernels] == ["rope_fusion.rotary"] * 2, rep.table()
    check_numerics(fn, (q, k_tail, c, s), out, context=rep.table())


def test_auto_costs_the_pair_as_one_launch(monkeypatch):
    """What `auto` decides by: one site spec for q and k_pe together (two tensors, the joint parameters), whose
    Triton estimate holds one launch and the lowering's and the model's own code one per tensor."""
    from rope_fusion.ops.cost_model import LAUNCH_BYTES, estimates
    from rope_fusion.passes.rope_pass import RopeFusionPass

    specs = []
    choose = RopeFusionPass._choose
    monkeypatch.setattr(RopeFusionPass, "_choose",
                        lambda self, spec, facts: specs.append(spec) or choose(self, spec, facts))
    q, k, cos, sin, positions = inputs(torch.bfloat16, seed=9)
    c, s = cos[positions].to(torch.bfloat16), sin[positions].to(torch.bfloat16)
    compile_with_pass(lambda q, k, c, s: mla(q, k, c, s, True), q, k, c, s)
    [spec] = specs
    assert spec.arity == 2 and spec.params.offset_q_only and spec.x_shapes == (tuple(q.shape), tuple(k.shape))
    assert spec.cost.tensors == 2 and spec.cost.x_bytes == spec.bytes_moved()
    est = estimates(spec.cost)
    one = estimates(dataclasses.replace(spec.cost, tensors=1))
    assert est["triton"] == one["triton"] and est["left"] - one["left"] == pytest.approx(LAUNCH_BYTES)
