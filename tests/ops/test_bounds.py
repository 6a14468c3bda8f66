"""Positions that pick rows of a gathered cache are checked: a row outside [0, rows) fails as plain compile fails.

vLLM takes positions from requests, so a fused gather must never read past its cache. The op's rule, in every
backend, is 0 <= position < rows: the Inductor lowering's indirect index is checked (on the CPU an error that names
positions, on the GPU a device-side assert, as plain compile's own gather), the Triton kernel asserts the row, and
the reference raises an IndexError naming positions. Eager's `index_select` and `embedding` raise on a negative
position too, while advanced indexing `cache[positions]` reads row `rows + p`: the pass emits that wrap in the
graph before the op, so the fused result is eager's for every position eager accepts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rope_fusion.ops.reference import rotary_reference
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

D = 16  # head dim; the cache holds cos | sin of D // 2 lanes each
ROWS = 16
BAD = torch.tensor([0, 3, 16, 2, 1000])  # the positions on a 16-row cache
POSITIONS = r"positions must pick rows in \[0, 16\) of cos and sin"  # the op's error on the CPU


def _rotate(positions, q, cos, sin):
    """vLLM's forward_native on a flat [T, H*D] q: NeoX halves, a table row per token."""
    x = q.view(positions.shape[0], -1, D)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).reshape(q.shape)


def by_index_select(positions, q, cache):
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    return _rotate(positions, q, cos, sin)


def by_embedding(positions, q, cache):
    cos, sin = torch.nn.functional.embedding(positions, cache).chunk(2, dim=-1)
    return _rotate(positions, q, cos, sin)


def by_indexing(positions, q, cache):
    cs = cache[positions]
    return _rotate(positions, q, cs[..., : D // 2], cs[..., D // 2:])


def by_indexing_negative_start(positions, q, cache):
    """The second half as a negative-start slice (`cs[..., -(D // 2):]`): lanes D // 2 on of the cache."""
    cs = cache[positions]
    return _rotate(positions, q, cs[..., : D // 2], cs[..., -(D // 2):])


def _inputs(positions):
    torch.manual_seed(0)
    return positions, torch.randn(positions.shape[0], 2 * D), torch.randn(ROWS, D)


def _compiled_with_pass(fn):
    """(fn compiled on the CPU with a fresh pass, the pass); the FX graph caches off, so that the pass runs."""
    from torch._inductor.compile_fx import compile_fx

    import rope_fusion

    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass()

    def inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": p})

    compiled = torch.compile(fn, fullgraph=True, backend=inductor)

    def run(*args):
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            return compiled(*args)

    return run, p


def _fused_then_called(fn, positions):
    """fn compiled with the pass on valid positions of the shape of `positions` (checked: fused, right), then
    called on `positions` (the same graph: only the values differ)."""
    run, p = _compiled_with_pass(fn)
    good = _inputs(positions.clamp(0, ROWS - 1))
    out = run(*good)
    assert len(p.report.sites) == 1 and not p.report.errors, p.report.table()
    check_numerics(fn, good, out)
    return run(*_inputs(positions))


@pytest.mark.parametrize("fn", [by_index_select, by_embedding])
def test_lowering_raises_like_plain_compile(fn):
    """The issue's positions [0, 3, 16, 2, 1000] on a 16-row cache: eager raises IndexError, plain compile
    "index out of bounds", the fused op's lowering an error naming positions and the rows (before: values near
    2e31 read past the cache; then Inductor's bare "index out of bounds")."""
    args = _inputs(BAD)
    with pytest.raises(IndexError):
        fn(*args)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="index out of bounds"):
        torch.compile(fn, fullgraph=True)(*args)  # plain compile
    with pytest.raises(RuntimeError, match=POSITIONS):
        _fused_then_called(fn, BAD)


@pytest.mark.parametrize("fn", [by_index_select, by_embedding])
def test_negative_positions_raise_where_eager_raises(fn):
    """index_select and embedding raise on a negative position in eager: so does the fused op (the lowering's
    index does not wrap negatives). Inductor decomposes index_select into `cache[positions]`; the pass reads
    the op it came from (`original_aten`) and does not wrap there."""
    positions = torch.tensor([0, 3, -1, 2, 5])
    with pytest.raises(IndexError):
        fn(*_inputs(positions))
    with pytest.raises(RuntimeError, match=POSITIONS):
        _fused_then_called(fn, positions)


@pytest.mark.parametrize("fn", [by_indexing, by_indexing_negative_start])
def test_advanced_indexing_wraps_negative_positions_as_eager(fn):
    """`cache[positions]` reads row rows + p for -rows <= p < 0: the fused result is eager's, the wrap is in the
    graph before the op; the negative-start slice of the gathered cache reads lanes D // 2 on (before: an empty
    slice and an internal error). Below -rows, eager and the fused op both raise."""
    args = _inputs(torch.tensor([0, 3, -1, 2, 15, -16]))
    out, p = compile_with_pass(fn, *args)
    assert len(p.report.sites) == 1 and not p.report.errors, p.report.table()
    after = p.capture.graphs[0].after.counts
    assert any(k.startswith("aten.where") for k in after), after  # the wrap, emitted before the op
    assert not any(k.startswith("aten.index") for k in after), after  # the rows are not gathered
    check_numerics(fn, args, out)
    torch.testing.assert_close(out, fn(*args))
    below = torch.tensor([0, 3, -17, 2, 15, 1])
    with pytest.raises(IndexError):
        fn(*_inputs(below))
    with pytest.raises(RuntimeError, match=POSITIONS):
        _fused_then_called(fn, below)


@pytest.mark.parametrize("positions", [BAD.view(-1, 1), torch.tensor([[0], [-1], [2], [3], [4]])],
                         ids=["past_the_end", "negative"])
def test_reference_raises(positions):
    """The reference (the op's eager implementation without a device kernel) takes only rows in [0, rows), and
    says which (before: torch's bare "index out of range in self"); so does every public function on the CPU."""
    import rope_fusion

    cache = torch.randn(ROWS, D)
    x = torch.randn(5, 2, D)
    row = int(positions.min()) if int(positions.min()) < 0 else int(positions.max())
    with pytest.raises(IndexError, match=f"{POSITIONS}, got {row}"):
        rotary_reference(x, cache[:, : D // 2], cache[:, D // 2:], positions=positions, interleaved=False,
                         rotary_dim=D, full_tables=False)
    cos, sin = cache[:, : D // 2], cache[:, D // 2:]
    with pytest.raises(IndexError, match=POSITIONS):  # the direct path
        rope_fusion.apply_rotary_qk(x, x[:, :1], cos, sin, positions=positions)
    with pytest.raises(IndexError, match=POSITIONS), torch.enable_grad():  # through the op: autograd to record
        rope_fusion.apply_rotary(x.clone().requires_grad_(), cos, sin, positions=positions)


def test_triton_kernel_asserts_on_a_row_outside_the_cache():
    """The kernel's `tl.device_assert` on the row, under Triton's interpreter with device asserts on (Inductor
    compiles its kernels and this one with them on: `assert_indirect_indexing`); rows in range rotate right."""
    pytest.importorskip("triton")
    import triton.runtime.interpreter as interpreter

    import rope_fusion.kernels.triton_rotary as tr
    from rope_fusion.ops.schema import RotaryParams
    from tests.helpers.interpreted_rotary import KERNEL, poisoned_outputs

    torch.manual_seed(1)
    cache = torch.randn(ROWS, D)
    cos, sin = cache[:, : D // 2], cache[:, D // 2:]
    q = torch.randn(5, 2, D)
    params = RotaryParams(interleaved=False, rotary_dim=D, full_tables=False, conjugate=False,
                          out_dtype=torch.float32)
    builder = interpreter.interpreter_builder
    plain = builder.options
    builder.options = dataclasses.replace(plain, debug=True)
    try:
        good = torch.tensor([[0], [3], [15], [2], [1]])
        with poisoned_outputs():
            (out,) = tr.launch([q], cos, sin, params, good, kernel=KERNEL)
        want = rotary_reference(q.double(), cos.double(), sin.double(), positions=good, interleaved=False,
                                rotary_dim=D, full_tables=False)
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
        for bad in (BAD.view(-1, 1), torch.tensor([[0], [-1], [2], [3], [4]])):
            with pytest.raises(Exception, match=r"a position outside \[0, rows\)"), poisoned_outputs():
                tr.launch([q], cos, sin, params, bad, kernel=KERNEL)
    finally:
        builder.options = plain
