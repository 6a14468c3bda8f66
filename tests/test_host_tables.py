"""Host-resident RoPE tables: their per-call copy to the device becomes a cached copy (ops/host_tables.py).

On the CPU the cache is exercised with the meta device as the target (the only other device a CPU build
has), which checks when a cached copy is reused and when it is made again; the values it serves are checked
on the GPU, through a compiled model whose tables live on the host as in diffusers Qwen-Image.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import rope_fusion
from rope_fusion.ops import host_tables as H
from rope_fusion.passes.host_tables import cache_host_tables

op = torch.ops.rope_fusion.host_table_to_device.default
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _entry(src):
    return H._CACHE.get(src)


def test_cached_copy_reused_until_the_table_changes():
    H.clear_cache()
    src = torch.randn(8, 4)
    a = op(src, torch.device("meta"))
    first = _entry(src)[1]
    b = op(src, torch.device("meta"))
    assert _entry(src)[1] is first, "an unchanged table is copied once"
    assert a is not first and b is not first and a is not b, "every call returns its own tensor"
    assert a.shape == src.shape and a.stride() == src.stride() and a.device.type == "meta"
    src.mul_(2)  # an in-place write bumps the version counter
    op(src, torch.device("meta"))
    assert _entry(src)[1] is not first, "a written table is copied again"
    other = src.clone()
    op(other, torch.device("meta"))
    assert H.cached_tables() == 2
    del other
    import gc

    gc.collect()
    assert H.cached_tables() == 1, "the cache does not keep host tables alive"


def test_same_device_is_a_plain_copy():
    src = torch.randn(3, 2)
    out = op(src, torch.device("cpu"))
    assert out is not src and torch.equal(out, src)


def _graph_with_copy(target_kwargs: dict, src_val: torch.Tensor, placeholder: bool = True) -> tuple:
    """A post-grad-like graph: host table -> copy to meta -> slice (the table view a fused op would read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fm = FakeTensorMode()
    g = fx.Graph()
    t = g.placeholder("freqs")
    t.meta["val"] = fm.from_tensor(src_val)
    src = t
    if not placeholder:
        src = g.call_function(torch.ops.aten.mul.Tensor, (t, 2))
        with fm:
            src.meta["val"] = t.meta["val"] * 2
    copy = g.call_function(torch.ops.aten._to_copy.default, (src,), target_kwargs)
    with fm:
        copy.meta["val"] = torch.ops.aten._to_copy.default(src.meta["val"], **target_kwargs)
    view = g.call_function(torch.ops.aten.slice.Tensor, (copy, 1, 0, 2))
    with fm:
        view.meta["val"] = copy.meta["val"][:, 0:2]
    g.output((view,))
    return g, view


def test_pass_replaces_the_copy_of_a_host_input():
    g, view = _graph_with_copy({"device": torch.device("meta")}, torch.randn(6, 4))
    assert cache_host_tables(g, [view]) == ["freqs"]
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    copies = [n for n in g.nodes if n.target is torch.ops.aten._to_copy.default]
    assert op in targets and all(not n.users for n in copies)  # the old copy is dead (the pass's DCE drops it)
    new = next(n for n in g.nodes if n.target is op)
    assert new.meta["val"].device.type == "meta" and tuple(new.meta["val"].shape) == (6, 4)
    g.lint()


@pytest.mark.parametrize("kwargs,placeholder", [
    ({"device": torch.device("meta"), "dtype": torch.float64}, True),  # also converts: not a plain move
    ({"dtype": torch.float64}, True),  # no device change
    ({"device": torch.device("meta")}, False),  # a value computed in the graph, not a host input
])
def test_pass_leaves_other_copies(kwargs, placeholder):
    g, view = _graph_with_copy(kwargs, torch.randn(6, 4), placeholder)
    assert cache_host_tables(g, [view]) == []
    assert all(n.target is not op for n in g.nodes)


def test_option_in_uuid_and_pickle():
    import pickle

    on, off = rope_fusion.RopeFusionPass(), rope_fusion.RopeFusionPass(cache_host_tables=False)
    assert on.cache_host_tables and not off.cache_host_tables
    assert on.uuid() != off.uuid()
    assert pickle.loads(pickle.dumps(off)).cache_host_tables is False


class _HostTableRope(torch.nn.Module):
    """Qwen-Image's arrangement: complex freqs kept on the host (not a buffer), moved inside forward."""

    def __init__(self, S: int, D: int) -> None:
        super().__init__()
        a = torch.arange(S, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(D // 2) / (D // 2))
        self.freqs = torch.polar(torch.ones_like(a), a).to(torch.complex64)

    def forward(self, q, k):
        f = self.freqs.to(q.device)[: q.shape[1]].unsqueeze(1)

        def rot(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * f).flatten(3).type_as(x)

        return rot(q), rot(k)


@cuda
def test_gpu_host_tables_copied_once_and_refreshed_when_written():
    from torch.profiler import ProfilerActivity, profile

    m = _HostTableRope(64, 128)
    q = torch.randn(2, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    p = rope_fusion.RopeFusionPass(backend="triton")
    f = torch.compile(m, options={"post_grad_custom_post_pass": p, "fx_graph_cache": False})
    got = f(q, k)
    assert len(p.report.kernels) == 1 and len(p.report.host_tables) == 1
    for g, w in zip(got, m(q, k)):
        torch.testing.assert_close(g, w, atol=0.02, rtol=0.02)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f(q, k)
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "HtoD" in e.name]
    assert not h2d, f"the host table was copied again: {[e.name for e in h2d]}"
    m.freqs.mul_(torch.polar(torch.ones(()), torch.tensor(0.3)).to(torch.complex64))
    for g, w in zip(f(q, k), m(q, k)):
        torch.testing.assert_close(g, w, atol=0.02, rtol=0.02)
