"""Tables gathered per token from a cache (vLLM's `cos_sin_cache.index_select(0, positions).chunk(2, -1)`).

The op takes the cache and the positions (`positions=`): the reference, the Inductor lowering (indirect
indexing) and the Triton kernel (under the interpreter) read `cache[positions]` themselves, gradients reach
the cache rows, and the pass feeds the gather's cache and positions to the op instead of materialising the
gathered rows, for q and k in one launch, with static and dynamic token counts.
"""

from __future__ import annotations

import pytest
import torch

import rope_fusion
from rope_fusion.ops.reference import rotary_reference
from tests.helpers.compile_pass import compile_with_pass, static_lanes
from tests.helpers.numerics import check_numerics


def _cache(rows=32, width=8, dtype=torch.float32):
    a = torch.rand(rows, width, dtype=torch.float64) * 6
    return torch.cat((a.cos(), a.sin()), -1).to(dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_op_reads_cache_rows_by_positions(interleaved):
    torch.manual_seed(0)
    cache = _cache()
    cos, sin = cache[:, :8], cache[:, 8:]  # strided views, as the pass feeds them
    pos = torch.randint(0, 32, (7, 1))
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    qo, ko = rope_fusion.apply_rotary_qk(q, k, cos, sin, positions=pos, interleaved=interleaved)
    for out, x in ((qo, q), (ko, k)):
        want = rotary_reference(x, cos[pos], sin[pos], interleaved=interleaved, rotary_dim=16, full_tables=False)
        torch.testing.assert_close(out, want)
    compiled = torch.compile(lambda q, k, p: rope_fusion.apply_rotary_qk(q, k, cos, sin, positions=p,
                                                                         interleaved=interleaved))
    for got, want in zip(compiled(q, k, pos), (qo, ko)):  # the Inductor lowering: indirect indexing
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_positions_are_checked():
    cache = _cache()
    q = torch.randn(7, 4, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        rope_fusion.apply_rotary(q, cache[:, :8], cache[:, 8:], positions=torch.zeros(7, 1))
    with pytest.raises(ValueError, match="does not broadcast"):
        rope_fusion.apply_rotary(q, cache[:, :8], cache[:, 8:], positions=torch.zeros(5, 1, dtype=torch.long))


def test_gradients_reach_the_cache_rows():
    torch.manual_seed(1)
    cache = _cache(dtype=torch.float64).requires_grad_()
    pos = torch.randint(0, 32, (7, 1))
    x = torch.randn(7, 3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, c: rope_fusion.apply_rotary(x, c[:, :8], c[:, 8:], positions=pos), (x, cache))


def vllm_native(positions, query, key, cos_sin_cache):
    """vLLM's RotaryEmbedding.forward_native (NeoX, rotary dim 16 of head size 32, flat [T, H*D] q/k)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)

    def one(x):
        shape = x.shape
        x = x.view(positions.shape[0], -1, 32)
        rot, rest = x[..., :16], x[..., 16:]
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(rot, 2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1).reshape(shape)

    return one(query), one(key)


@pytest.mark.parametrize("dynamic", [False, True])
def test_pass_feeds_the_cache_and_positions_to_the_op(dynamic):
    torch.manual_seed(2)
    args = (torch.randint(0, 32, (9,)), torch.randn(9, 4 * 32, dtype=torch.bfloat16),
            torch.randn(9, 2 * 32, dtype=torch.bfloat16), _cache())
    if dynamic:  # the token count symbolic; q's and k's [T, H*D] rows static, as a projection makes them
        static_lanes(args)
    out, p = compile_with_pass(vllm_native, *args, dynamic=dynamic)
    assert len(p.report.sites) == 2 and [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qk"], \
        p.report.table()
    after = p.capture.graphs[0].after.counts
    assert not any(k.startswith("aten.index") for k in after), after  # the rows are not gathered in the graph
    check_numerics(vllm_native, args, out)
