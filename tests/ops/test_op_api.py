"""The op as users call it: `rope_fusion.apply_rotary` / `apply_rotary_qk`, bad inputs, autograd.

Bad inputs fail loudly with a ValueError that names the argument (eagerly and under torch.compile), and the
op is differentiable: the gradient of a rotation is the inverse rotation (with the partner lane's sin entry
when tables hold one entry per lane), and tables that require grad get theirs. Gradients are checked with
torch.autograd.gradcheck in fp64 against finite differences, and against autograd through the reference.
"""

from __future__ import annotations

import logging

import pytest
import torch

import rope_fusion
from rope_fusion.ops.reference import rotary_reference


def _tables(lead, width, dtype=torch.float64, requires_grad=False):
    a = torch.rand(*lead, width, dtype=torch.float64) * 6
    c, s = a.cos().to(dtype), a.sin().to(dtype)
    return c.requires_grad_(requires_grad), s.requires_grad_(requires_grad)


def test_tables_on_another_device_raise_naming_the_devices():
    x = torch.randn(2, 5, 3, 8)
    c = torch.randn(5, 1, 4).to("meta")
    with pytest.raises(ValueError, match="x on cpu, cos on meta, sin on meta"):
        rope_fusion.apply_rotary(x, c, c)
    with pytest.raises(ValueError, match="meta"):
        torch.compile(lambda x, c: rope_fusion.apply_rotary(x, c, c))(x, c)


def test_zero_dim_x_raises():
    with pytest.raises(ValueError, match="at least one dimension"):
        rope_fusion.apply_rotary(torch.tensor(1.0), torch.ones(1), torch.ones(1))


@pytest.mark.parametrize("bad,match", [
    (dict(rotary_dim=3), "rotary_dim"), (dict(rotary_dim=16), "exceeds the head dim"),
    (dict(full_tables=True), "last dim 8"),
])
def test_bad_options_raise(bad, match):
    x = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(ValueError, match=match):
        rope_fusion.apply_rotary(x, c, s, **bad)


# Every option of the schema with values of the wrong type (TypeError) and out of range (ValueError). A flag given
# as "no" was truthy (interleaved="no" rotated interleaved pairs), rotary_dim=0 fell back to the head dim, and
# norm_eps=-1 gave NaN: each now raises one line that names the option.
WRONG_TYPE = {bool: ["no", 1, 1.0], int: [2.0, True, "8"], float: ["1e-6", True],
              str: [1], torch.dtype: ["float32", torch.float32.itemsize]}
OUT_OF_RANGE = {"rotary_dim": [0, -2, 3], "rotary_offset": [-1], "rotary_blocks": [0, -1],
                "norm_eps": [-1.0, float("nan"), float("inf")], "norm": ["layer"], "out_dtype": [torch.int32]}


def _bad_options():
    import dataclasses
    import typing

    from rope_fusion.ops.schema import RotaryParams

    hints = typing.get_type_hints(RotaryParams)
    for f in dataclasses.fields(RotaryParams):
        for value in WRONG_TYPE[hints[f.name]]:
            yield f.name, value, TypeError
        for value in OUT_OF_RANGE.get(f.name, []):
            yield f.name, value, ValueError


@pytest.mark.parametrize("name,value,error", list(_bad_options()), ids=lambda v: repr(v)[:20])
def test_every_option_is_checked_in_every_public_function(name, value, error):
    """Directly (the eager path's first call of a geometry), through the op (autograd to record) and once more
    (no plan is cached for a call that raised): one line that names the option."""
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 3, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    extra = {"norm": "rms"} if name == "norm_eps" else {}
    calls = [lambda t: rope_fusion.apply_rotary(t, c, s, **extra, **{name: value}),
             lambda t: rope_fusion.apply_rotary_qk(t, k, c, s, **extra, **{name: value}),
             lambda t: rope_fusion.apply_rotary_qkv(t, k, v, c, s, **extra, **{name: value})]
    for call in calls:
        for x in (q, q, q.clone().requires_grad_()):
            with pytest.raises(error) as raised:
                call(x)
            message = str(raised.value)
            assert name in message and "\n" not in message, message


@pytest.mark.parametrize("bad", [{"interleaved": "no"}, {"rotary_dim": 0}, {"norm": "rms", "norm_eps": -1.0}],
                         ids=["flag", "rotary_dim", "norm_eps"])
def test_options_are_checked_under_compile(bad):
    """Traced, the call reaches the op's own check: Dynamo stops at the raise and the call runs eagerly, where the
    same one line is raised."""
    q = torch.randn(5, 3, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    name = [k for k in bad if k != "norm"][0]
    torch._dynamo.reset()
    with pytest.raises((TypeError, ValueError), match=f"^{name} must be"):
        torch.compile(lambda x: rope_fusion.apply_rotary(x, c, s, **bad))(q)


def test_rms_norm_rope_qk_checks_its_options():
    """Its own flag, and the op's options through the op's check (eps is the op's norm_eps)."""
    q, k = torch.randn(5, 3, 8), torch.randn(5, 1, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    w = torch.ones(8)
    for bad, error, name in (({"per_head": "no"}, TypeError, "per_head"), ({"eps": -1.0}, ValueError, "norm_eps"),
                             ({"interleaved": "no"}, TypeError, "interleaved"), ({"rotary_dim": 0}, ValueError,
                                                                               "rotary_dim")):
        kw = {"eps": 1e-6, **bad}
        with pytest.raises(error, match=f"^{name} must be"):
            rope_fusion.rms_norm_rope_qk(q, k, w, w, kw.pop("eps"), c, s, **kw)


def test_options_in_range_still_run():
    """The checks refuse nothing the op takes: an int eps, rotary_dim given explicitly, every flag as a bool."""
    q = torch.randn(5, 3, 8)
    c, s = _tables((5, 1), 2, torch.float32)
    out = rope_fusion.apply_rotary(q, c, s, rotary_dim=4, norm="rms", norm_eps=0, interleaved=True,
                                   conjugate=False, out_dtype=torch.float64)
    want = rotary_reference(q, c, s, interleaved=True, rotary_dim=4, full_tables=False, norm="rms", norm_eps=0.0,
                            out_dtype=torch.float64)
    torch.testing.assert_close(out, want)


def test_unknown_option_is_a_type_error():
    q = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(TypeError, match="interleave"):
        rope_fusion.apply_rotary_qk(q, q, c, s, interleave=True)


def test_qk_of_different_dtypes_needs_out_dtype():
    q, k = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16), torch.randn(2, 5, 1, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        rope_fusion.apply_rotary_qk(q, k, c, s)
    qo, ko = rope_fusion.apply_rotary_qk(q, k, c, s, out_dtype=torch.float32)
    assert qo.dtype == ko.dtype == torch.float32
    torch.testing.assert_close(ko, rotary_reference(k, c, s, interleaved=False, rotary_dim=8, full_tables=False))


CASES = [  # interleaved, rotary_dim, full_tables, conjugate
    (False, 8, False, False), (True, 8, False, False), (False, 8, True, False), (True, 8, True, True),
    (False, 4, True, False), (True, 6, False, True),
]


@pytest.mark.parametrize("interleaved,rotary_dim,full,conj", CASES)
def test_gradient_of_x_is_the_inverse_rotation(interleaved, rotary_dim, full, conj):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    c, s = _tables((5, 1), rotary_dim if full else rotary_dim // 2)
    if full:  # one entry per lane, every lane its own angle: the partner's sin entry matters
        c, s = _tables((5, 1), rotary_dim)
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full, conjugate=conj)
    assert torch.autograd.gradcheck(lambda x: rope_fusion.apply_rotary(x, c, s, **kw), (x,))


@pytest.mark.parametrize("interleaved,rotary_dim,full,conj", CASES)
def test_tables_that_require_grad_get_theirs(interleaved, rotary_dim, full, conj):
    torch.manual_seed(1)
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 8, dtype=torch.float64, requires_grad=True)
    c, s = _tables((5, 1), rotary_dim if full else rotary_dim // 2, requires_grad=True)
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, full_tables=full, conjugate=conj)
    assert torch.autograd.gradcheck(lambda q, k, c, s: rope_fusion.apply_rotary_qk(q, k, c, s, **kw), (q, k, c, s))


def test_low_precision_gradients_match_the_reference():
    torch.manual_seed(2)
    x = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    c, s = _tables((16, 1), 32, torch.float32, requires_grad=True)
    g = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16)
    kw = dict(interleaved=True, rotary_dim=64, full_tables=False)
    grads = torch.autograd.grad(rope_fusion.apply_rotary(x, c, s, **kw), (x, c, s), g)
    x64, c64, s64 = (t.detach().double().requires_grad_() for t in (x, c, s))
    ref = torch.autograd.grad(rotary_reference(x64, c64, s64, **kw), (x64, c64, s64), g.double())
    for got, want in zip(grads, ref):
        assert got.dtype == (torch.bfloat16 if got.shape == x.shape else torch.float32)
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-2, err


def test_x_is_not_saved_for_backward_when_tables_need_no_grad():
    """Activation memory: the backward of x needs only the tables."""
    x = torch.randn(2, 5, 3, 8, requires_grad=True)
    c, s = _tables((5, 1), 4, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rope_fusion.apply_rotary(x, c, s)
    assert all(t.shape != x.shape for t in saved) and len(saved) == 2


def test_requested_backend_that_cannot_run_falls_back_with_one_log_line(caplog):
    from tests.helpers.compile_pass import compile_with_pass

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    x = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 8, torch.float32)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        out, p = compile_with_pass(lambda x, c, s: (rope(x, c, s), rope(2 * x, c, s)), x, c, s,
                                   backend="triton", fuse_qk=False)
    assert [k.backend for k in p.report.kernels] == ["inductor", "inductor"], p.report.table()
    assert all("triton" in k.fallback and "cpu" in k.fallback for k in p.report.kernels)
    lines = [r.getMessage() for r in caplog.records if "did not take a site" in r.getMessage()]
    assert len(lines) == 1, lines
    torch.testing.assert_close(out[0], rope(x, c, s), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["rms", "rms_across_heads"])
def test_norm_prologue_matches_the_reference_and_is_differentiable(norm):
    torch.manual_seed(5)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8 if norm == "rms" else (3, 8), dtype=torch.float64, requires_grad=True)
    c, s = _tables((5, 1), 4)
    out = rope_fusion.apply_rotary(x, c, s, norm=norm, norm_eps=1e-5, norm_weight=w)
    dims = (-1,) if norm == "rms" else (-2, -1)
    xn = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(out, rotary_reference(xn, c, s, interleaved=False, rotary_dim=8, full_tables=False))
    assert torch.autograd.gradcheck(
        lambda x, w: rope_fusion.apply_rotary(x, c, s, norm=norm, norm_eps=1e-5, norm_weight=w), (x, w))


def test_norm_weight_without_a_norm_is_refused():
    x = torch.randn(2, 5, 3, 8)
    c, s = _tables((5, 1), 4, torch.float32)
    with pytest.raises(ValueError, match="without a norm"):
        rope_fusion.apply_rotary(x, c, s, norm_weight=torch.ones(8))
    with pytest.raises(ValueError, match="norm must be one of"):
        rope_fusion.apply_rotary(x, c, s, norm="layer")


@pytest.mark.parametrize("full", [False, True])
def test_deinterleave_is_neox_on_the_deinterleaved_x(full):
    """DeepSeek-V3's form: x's interleaved pairs rotated and written in NeoX order; full tables are indexed
    by output lane (as the model applies cat(freqs, freqs) to the de-interleaved x)."""
    torch.manual_seed(6)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    c, s = _tables((5,), 16 if full else 8)
    xd = x.unflatten(-1, (8, 2)).transpose(-1, -2).reshape(3, 5, 16)
    want = rotary_reference(xd, c, s, interleaved=False, rotary_dim=16, full_tables=full)
    kw = dict(interleaved=True, rotary_dim=16, full_tables=full, conjugate=False, out_dtype=torch.float64,
              deinterleave=True)
    torch.testing.assert_close(torch.ops.rope_fusion.rotary(x, c, s, **kw), want)
    compiled = torch.compile(lambda x: torch.ops.rope_fusion.rotary(x, c, s, **kw))  # the lowering
    torch.testing.assert_close(compiled(x.detach()), want.detach())
    assert torch.autograd.gradcheck(lambda x: torch.ops.rope_fusion.rotary(x, c, s, **kw), (x,))
    with pytest.raises(ValueError, match="interleaved=True"):
        torch.ops.rope_fusion.rotary(x, c, s, **{**kw, "interleaved": False})


def _per_block_neox(x, c, s, blocks):
    """An independent spelling of `rotary_blocks`: rotate_half on each block with its slice of full tables."""
    w = c.shape[-1] // blocks
    out = []
    for b in range(blocks):
        xb, cb, sb = (t[..., b * w:(b + 1) * w] for t in (x, c, s))
        out.append(xb * cb + torch.cat((-xb[..., w // 2:], xb[..., :w // 2]), -1) * sb)
    return torch.cat([*out, x[..., c.shape[-1]:]], -1)


@pytest.mark.parametrize("blocks,rotary_dim", [(3, 24), (2, 16), (4, 16)])
def test_rotary_blocks_rotate_each_block_on_its_own(blocks, rotary_dim):
    """Allegro's and Gemma 4's head dim rotated per axis: NeoX pairs within each block, in the reference, the
    lowering and the gradient (the conjugate rotation, its sin entries swapped within each block)."""
    torch.manual_seed(8)
    x = torch.randn(2, 5, 3, 28, dtype=torch.float64, requires_grad=True)
    c, s = _tables((5, 1), rotary_dim)
    want = _per_block_neox(x, c, s, blocks)
    kw = dict(interleaved=False, rotary_dim=rotary_dim, full_tables=True, conjugate=False, out_dtype=torch.float64,
              rotary_blocks=blocks)
    torch.testing.assert_close(torch.ops.rope_fusion.rotary(x, c, s, **kw), want)
    compiled = torch.compile(lambda x: torch.ops.rope_fusion.rotary(x, c, s, **kw))  # the lowering
    torch.testing.assert_close(compiled(x.detach()), want.detach())
    assert torch.autograd.gradcheck(lambda x: torch.ops.rope_fusion.rotary(x, c, s, **kw), (x,))
    # per-pair tables list block 0's pairs, then block 1's: entry j of block b serves lanes bW + j, bW + j + W/2
    cp, sp = _tables((5, 1), rotary_dim // 2)
    cf, sf = (torch.cat([t.unflatten(-1, (blocks, -1))] * 2, -1).flatten(-2) for t in (cp, sp))
    torch.testing.assert_close(rope_fusion.apply_rotary(x, cp, sp, rotary_dim=rotary_dim, rotary_blocks=blocks),
                               _per_block_neox(x, cf, sf, blocks))
    c2, s2 = _tables((5, 1), rotary_dim, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, c, s: torch.ops.rope_fusion.rotary(x, c, s, **kw), (x, c2, s2))
    with pytest.raises(ValueError, match="rotary_blocks"):
        torch.ops.rope_fusion.rotary(x, c, s, **{**kw, "interleaved": True})
    with pytest.raises(ValueError, match="does not split"):
        torch.ops.rope_fusion.rotary(x, c, s, **{**kw, "rotary_blocks": 5})


def test_rotary_qkv_rotates_three_tensors_like_one_each():
    """CLVP's q, k and v by one table: one call, each result as the one-tensor op gives it, gradients too."""
    torch.manual_seed(9)
    q, k, v = (torch.randn(2, 5, h, 8, dtype=torch.float64, requires_grad=True) for h in (3, 1, 2))
    c, s = _tables((5, 1), 3)
    kw = dict(interleaved=False, rotary_dim=6, full_tables=False, conjugate=False, out_dtype=torch.float64)
    outs = torch.ops.rope_fusion.rotary_qkv(q, k, v, c, s, **kw)
    for got, x in zip(outs, (q, k, v)):
        torch.testing.assert_close(got, rotary_reference(x, c, s, interleaved=False, rotary_dim=6, full_tables=False))
    compiled = torch.compile(lambda *xs: torch.ops.rope_fusion.rotary_qkv(*xs, c, s, **kw))
    for got, want in zip(compiled(*(t.detach() for t in (q, k, v))), outs):
        torch.testing.assert_close(got, want.detach())
    assert torch.autograd.gradcheck(lambda q, k, v: torch.ops.rope_fusion.rotary_qkv(q, k, v, c, s, **kw), (q, k, v))
    with pytest.raises(ValueError, match="q and v must share the head dim"):
        torch.ops.rope_fusion.rotary_qkv(q, k, v[..., :6], c, s, **kw)


def test_the_public_op_compiles_in_a_full_graph_before_any_eager_call():
    """Tracing the public function must not import the device kernels (Dynamo cannot trace an import): a
    fresh process compiles it with fullgraph=True first, then the compiled graph runs the op's kernel."""
    import subprocess
    import sys

    code = ("import torch, rope_fusion\n"
            "q, c, s = torch.randn(12, 2, 32), torch.randn(12, 1, 16), torch.randn(12, 1, 16)\n"
            "f = torch.compile(lambda q, c, s: rope_fusion.apply_rotary_qk(q, q * 2, c, s), fullgraph=True)\n"
            "a, b = f(q, c, s)\n"
            "def r(x, c, s):\n"
            "    return rope_fusion.ops.reference.rotary_reference(x, c, s, interleaved=False, rotary_dim=32,\n"
            "                                                      full_tables=False)\n"
            "torch.testing.assert_close(a.double(), r(q.double(), c.double(), s.double()), rtol=1e-5, atol=1e-5)\n"
            "torch.testing.assert_close(b.double(), r(2 * q.double(), c.double(), s.double()), rtol=1e-5, atol=1e-5)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
