"""The pass adds no guards to graphs it leaves alone, so dynamic shapes compile as often as without it.

The analysis reads sizes that it needs as ints (lane counts) at their example values without guarding on them
(passes/fx_util.py, `deferred_guards`), and guards only the sizes that a fused site depends on. Before, it
guarded every lane dim it looked at: a Conv1d block with time last compiled 8 graphs (and fell back to eager
at the recompile limit) for 10 sizes under `dynamic=True`, where plain compile compiles one. Sizes known only
at run time (`nonzero`, `.item()`) have no example value: sites over them fuse where no decision needs them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import check_numerics, compile_with_pass
from torch._inductor.compile_fx import compile_fx

import rope_fusion

SIZES = range(5, 25, 2)  # ten sizes of the dynamic dim (not 0 or 1, which Dynamo specialises)


def _shape_env(graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        mode = getattr(val, "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return mode.shape_env
    return None


class _GuardCounting(rope_fusion.RopeFusionPass):
    """The pass, counting the guards that each call adds to the graph's shape environment."""

    def __call__(self, graph, is_inference=None):
        env = _shape_env(graph)
        before, sites = (len(env.guards) if env else 0), len(self.report.sites)
        super().__call__(graph, is_inference)
        self.calls.append((len(env.guards) - before if env else 0, len(self.report.sites) - sites))


def compiled_graphs(fn, make_args, with_pass: bool):
    """(graphs compiled for fn over SIZES under dynamic=True, the pass or None): one count per Inductor compile;
    every result is checked against eager."""
    torch._dynamo.reset()
    p = _GuardCounting() if with_pass else None
    if p is not None:
        p.calls = []
    graphs = 0

    def inductor(gm, example_inputs):
        nonlocal graphs
        graphs += 1
        return compile_fx(gm, example_inputs,
                          config_patches={"post_grad_custom_post_pass": p} if p is not None else {})

    compiled = torch.compile(fn, dynamic=True, backend=inductor)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for n in SIZES:
            args = make_args(n)
            for got, want in zip(_tuple(compiled(*args)), _tuple(fn(*args))):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return graphs, p


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def conv_block(x, w):
    """The issue's Conv1d block with time last: x [1, 4, n]."""
    y = torch.nn.functional.conv1d(x, w, padding=1)
    return torch.nn.functional.gelu(y) * 0.5 + y


def eager_attention(q, k, v, mask):
    """Hugging Face's eager attention: softmax(q @ k^T * scale + mask) @ v over n tokens."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(scores, dim=-1) @ v


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb over a sequence of n tokens: q, k [1, H, n, D], cos, sin [n, D]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _tables(n, d):
    angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.rand(d // 2).repeat(2)
    return angles.cos(), angles.sin()


CASES = {
    "conv1d_time_last": (conv_block, lambda n: (torch.randn(1, 4, n), torch.randn(4, 4, 3))),
    "eager_attention": (eager_attention, lambda n: (torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8),
                                                    torch.randn(1, 2, n, 8), torch.randn(1, 1, n, n))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_graph_without_rope_gets_no_guard(case):
    """No RoPE: as many graphs with the pass as without (one), and the pass adds no guard to any."""
    fn, make_args = CASES[case]
    torch.manual_seed(0)
    plain, _ = compiled_graphs(fn, make_args, with_pass=False)
    fused, p = compiled_graphs(fn, make_args, with_pass=True)
    assert fused == plain == 1, (fused, plain)
    assert p.calls and all(guards == 0 and sites == 0 for guards, sites in p.calls), p.calls


def test_rope_with_a_dynamic_sequence_still_fuses_without_recompiling():
    """RoPE over a dynamic sequence length: q and k fuse, and the ten sizes compile as many graphs as without
    the pass; its guards fix only the sizes the fused op takes as constants (the head dim), never the sequence."""
    torch.manual_seed(1)

    def make_args(n):
        return (torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16), *_tables(n, 16))

    plain, _ = compiled_graphs(rope, make_args, with_pass=False)
    fused, p = compiled_graphs(rope, make_args, with_pass=True)
    assert fused == plain == 1, (fused, plain)
    assert [sites for _, sites in p.calls] == [2], p.report.table()
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qk"], p.report.table()


@pytest.fixture
def data_dependent_capture():
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield


def select_tokens(x, mask, cos, sin):
    """Tokens picked by a mask (`nonzero`: a count known only at run time), then rotated: x [T, H, D]."""
    idx = mask.nonzero().squeeze(-1)
    q, c, s = x[idx], cos[idx].unsqueeze(1), sin[idx].unsqueeze(1)
    return q * c + _rotate_half(q) * s


def tables_at_offset(x, start, cos, sin):
    """Tables read from a data-dependent offset (`.item()`): x [B, S, H, D]."""
    o = start.item()
    torch._check(o >= 0)
    torch._check(o + x.shape[1] <= cos.shape[0])
    c, s = cos[o:o + x.shape[1]].unsqueeze(1), sin[o:o + x.shape[1]].unsqueeze(1)
    return x * c + _rotate_half(x) * s


@pytest.mark.parametrize("fn,args", [
    (select_tokens, lambda: (torch.randn(8, 2, 16), torch.rand(8) > 0.5, *_tables(8, 16))),
    (tables_at_offset, lambda: (torch.randn(1, 5, 2, 16), torch.tensor(3), *_tables(16, 16))),
], ids=["nonzero", "item"])
def test_data_dependent_sizes_fuse(fn, args, data_dependent_capture):
    """A token count from `nonzero` and a table offset from `.item()`: the site fuses (before: a guard on the
    data-dependent size failed and the site was left unfused), with the numbers of the original."""
    torch.manual_seed(2)
    args = args()
    out, p = compile_with_pass(fn, *args)
    assert len(p.report.sites) == 1 and not p.report.errors, (p.report.table(), p.report.errors)
    check_numerics(fn, args, out)
