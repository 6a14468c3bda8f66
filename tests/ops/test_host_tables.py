"""Host-resident RoPE tables: their per-call copy to the device becomes a cached copy (ops/host_tables.py).

On the CPU the op is exercised with the meta device as the target (the only other device a CPU build has),
which checks when a cached copy is reused and when it is made again; the values the cache serves after a write
through every path that bypasses the version counter are checked with the cache itself copying to the CPU (a
copy of its own, as to a GPU), against fp64; and on the GPU through a compiled model whose tables live on the
host as in diffusers Qwen-Image.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx

import rope_fusion
from rope_fusion.ops import host_tables as H
from rope_fusion.passes.host_tables import cache_host_tables

op = torch.ops.rope_fusion.host_table_to_device.default
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _copy(src):
    """The device copy the op's cache holds for src (None: none)."""
    entry = H._CACHE._entries.get(src)
    return entry.copy if entry is not None else None


def test_cached_copy_reused_until_the_table_changes():
    H.clear_cache()
    src = torch.randn(8, 4)
    a = op(src, torch.device("meta"))
    first = _copy(src)
    b = op(src, torch.device("meta"))
    assert _copy(src) is first, "an unchanged table is copied once"
    assert a is not first and b is not first and a is not b, "every call returns its own tensor"
    assert a.shape == src.shape and a.stride() == src.stride() and a.device.type == "meta"
    src.mul_(2)  # an in-place write bumps the version counter
    op(src, torch.device("meta"))
    assert _copy(src) is not first, "a written table is copied again"
    other = src.clone()
    op(other, torch.device("meta"))
    assert H.cached_tables() == 2
    del other
    import gc

    gc.collect()
    assert H.cached_tables() == 1, "the cache does not keep host tables alive"


def _freqs(S: int = 6, pairs: int = 4, seed: int = 0) -> torch.Tensor:
    """Complex freqs [S, pairs] as Qwen-Image keeps them on the host."""
    a = torch.rand(S, pairs, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 12
    return torch.polar(torch.ones_like(a), a).to(torch.complex64)


def _turn(t: torch.Tensor) -> torch.Tensor:
    """A rotation of every entry by 0.7 rad (a new table of the same shape)."""
    return (t.to(torch.complex128) * complex(math.cos(0.7), math.sin(0.7))).to(t.dtype)


def _via_alias(src: torch.Tensor) -> None:
    """Another tensor set onto the table's storage (a version counter of its own), written in place."""
    alias = torch.empty(0, dtype=src.dtype).set_(src.untyped_storage(), src.storage_offset(), src.shape,
                                                 src.stride())
    alias.copy_(_turn(alias))


def _via_real_view(src: torch.Tensor) -> None:
    """The imaginary lanes of a real view of `.data` negated: every table conjugated."""
    torch.view_as_real(src.data)[..., 1].neg_()


# Writes to a host table, each a path that leaves its version counter as it was (but the first two).
WRITES = {
    "in place (bumps the version)": lambda holder: holder["t"].mul_(complex(math.cos(0.3), math.sin(0.3))),
    "set_ to another tensor": lambda holder: holder["t"].set_(_turn(holder["t"])),
    ".data.copy_": lambda holder: holder["t"].data.copy_(_turn(holder["t"])),
    ".data.mul_": lambda holder: holder["t"].data.mul_(complex(math.cos(0.3), math.sin(0.3))),
    "untyped_storage().fill_": lambda holder: holder["t"].untyped_storage().fill_(0x3F),  # every float 0.747
    "another tensor set_ on its storage": lambda holder: _via_alias(holder["t"]),
    "a real view of .data": lambda holder: _via_real_view(holder["t"]),
    "one entry through .data": lambda holder: holder["t"].data[2, 1].mul_(-1),
    "a numpy view": lambda holder: holder["t"].numpy().__imul__(complex(math.cos(0.3), math.sin(0.3))),
    "the numpy array torch.from_numpy aliases": lambda holder: holder["array"].__imul__(1j),
}


def _host_table(path: str, S: int = 6, pairs: int = 4) -> dict:
    if "from_numpy" in path:
        array = _freqs(S, pairs).numpy().copy()
        return {"t": torch.from_numpy(array), "array": array}
    return {"t": _freqs(S, pairs)}


def _rotated(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's rotation of x [S, H, D] by complex freqs [S, D/2]."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[:, None, :]).flatten(-2)


@pytest.mark.parametrize("path", list(WRITES))
def test_a_table_written_through_any_path_is_copied_again(path):
    """The cache's copy after a write matches the table as written, checked on a rotation against fp64: a stale
    copy rotates by the old angles (an error of order 1)."""
    from tests.helpers.numerics import rel_err

    cache = H.HostTableCache()
    holder = _host_table(path)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(1))
    first = cache.get(holder["t"], torch.device("cpu"))
    assert cache.get(holder["t"], torch.device("cpu")) is first, "an unchanged table is copied once"
    old = holder["t"].clone()
    WRITES[path](holder)
    src = holder["t"]
    assert not torch.equal(src, old), "the write changed the table"
    got = _rotated(x, cache.get(src, torch.device("cpu")))
    ref = _rotated(x.double(), src.to(torch.complex128))
    eager = _rotated(x, src)
    assert rel_err(got, ref) <= rel_err(eager, ref) + torch.finfo(torch.float32).eps, f"a stale copy after {path}"
    assert cache.get(src, torch.device("cpu")) is cache.get(src, torch.device("cpu")), "and then cached again"


def test_the_comparison_is_by_bits():
    """A NaN entry still compares equal to itself (no copy per call), a zero whose sign changes does not."""
    cache = H.HostTableCache()
    src = torch.randn(4, 4)
    src[0, 0] = float("nan")
    src[1, 1] = 0.0
    first = cache.get(src, torch.device("meta"))
    assert cache.get(src, torch.device("meta")) is first
    src.data[1, 1] = -0.0
    assert cache.get(src, torch.device("meta")) is not first


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

    def __init__(self, freqs: torch.Tensor) -> None:
        super().__init__()
        self.freqs = freqs

    def forward(self, q, k):
        f = self.freqs.to(q.device)[: q.shape[1]].unsqueeze(1)

        def rot(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * f).flatten(3).type_as(x)

        return rot(q), rot(k)


@cuda
@pytest.mark.parametrize("path", list(WRITES))
def test_gpu_host_tables_copied_once_and_refreshed_when_written(path):
    """Copied once while unchanged; after a write through any path, the compiled model rotates by the new table
    (the contract against fp64, with eager's error as the bound)."""
    from torch.profiler import ProfilerActivity, profile

    from tests.helpers.numerics import rel_err

    holder = _host_table(path, 64, 64)
    m = _HostTableRope(holder["t"])
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
    WRITES[path](holder)
    ref = _HostTableRope(holder["t"].to(torch.complex128))(q.double(), k.double())
    for g, e, r in zip(f(q, k), m(q, k), ref):
        assert rel_err(g, r) <= rel_err(e, r) + torch.finfo(torch.bfloat16).eps, f"a stale table after {path}"
