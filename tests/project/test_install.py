"""`rope_fusion.install()` reaches code that calls torch.compile itself, with no options (vllm-omni).

vllm-omni compiles each repeated transformer block as `torch.compile(block.forward, dynamic=True)` with
default Inductor settings; the helper below does the same. After `install()` such compiles are fused; after
`uninstall()` they are not, and any pass configured before is back. Also: the one INFO line per graph on the
`rope_fusion` logger.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import rope_fusion


def compile_repeated_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """What vllm-omni does to a DiT: compile every block's forward, dynamic, no options."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward, dynamic=True)
    return model


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(torch.nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)  # [B, H, S, D]
        k = self.k(x).view(b, s, self.heads, -1).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return x + (q * k).transpose(1, 2).reshape(b, s, -1)


class Model(torch.nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x, cos, sin):
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return x


def _inputs(s=8):
    torch.manual_seed(0)
    ang = torch.rand(s, 8) * 6
    ang = torch.cat((ang, ang), -1)  # full-neox tables [S, D]
    return torch.randn(2, s, 64), ang.cos(), ang.sin()


class Spy(CustomGraphPass):
    """A post-grad pass that records which ops each graph holds when it runs."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append([str(n.target) for n in graph.nodes if n.op == "call_function"])

    def uuid(self):
        return "spy"

    def fused(self):
        return [any(t.startswith("rope_fusion.") for t in g) for g in self.graphs]


@pytest.fixture
def fresh():
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False, post_grad_custom_post_pass=None), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def test_install_reaches_compiles_without_options(fresh, caplog):
    caplog.set_level(logging.INFO, logger="rope_fusion")
    torch.manual_seed(0)
    model = Model().eval()
    x, cos, sin = _inputs()
    with torch.no_grad():
        expected = model(x, cos, sin)
        p = rope_fusion.install()
        try:
            assert inductor_config.post_grad_custom_post_pass is p
            compiled = compile_repeated_blocks(Model().eval())
            compiled.load_state_dict(model.state_dict())
            out = compiled(x, cos, sin)
            out2 = compiled(*_inputs(12))  # another sequence length: the dynamic graph is reused
        finally:
            rope_fusion.uninstall()
    assert inductor_config.post_grad_custom_post_pass is None
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert out2.shape == (2, 12, 64)
    # each compiled block graph: q and k in one kernel
    assert p.report.graphs >= 1 and p.report.errors == []
    assert len(p.report.kernels) == p.report.graphs and len(p.report.sites) == 2 * p.report.graphs, \
        p.report.table()
    assert all(k.op == "rope_fusion.rotary_qk" for k in p.report.kernels)
    # logging: one INFO line per graph on the rope_fusion logger
    lines = [r.getMessage() for r in caplog.records if r.name == "rope_fusion" and r.levelno == logging.INFO]
    assert len(lines) == p.report.graphs, lines
    assert all(re.search(r"fused 2 sites in 1 kernel, 0 near misses", ln) for ln in lines), lines


def test_uninstall_stops_it_and_restores_the_previous_pass(fresh):
    spy = Spy()
    x, cos, sin = _inputs()
    with inductor_config.patch(post_grad_custom_post_pass=spy), torch.no_grad():
        p = rope_fusion.install()
        assert inductor_config.post_grad_custom_post_pass is not spy  # chained: spy, then ours
        compile_repeated_blocks(Model(n=1).eval())(x, cos, sin)
        rope_fusion.uninstall()
        assert inductor_config.post_grad_custom_post_pass is spy
        assert len(p.report.kernels) == 1 and spy.fused() == [False]  # the spy ran first, on the unfused graph

        torch._dynamo.reset()
        compile_repeated_blocks(Model(n=1).eval())(x, cos, sin)
    assert len(spy.graphs) == 2 and spy.fused() == [False, False]
    assert len(p.report.kernels) == 1  # the uninstalled pass saw nothing more


def test_install_checks_its_argument(fresh):
    with pytest.raises(TypeError, match="RopeFusionPass"):
        rope_fusion.install("hello")
    with pytest.raises(TypeError, match="RopeFusionPass"):
        rope_fusion.inductor_options(pass_=Spy())
    assert inductor_config.post_grad_custom_post_pass is None and rope_fusion.installed() is None


def test_install_twice_is_one_pass(fresh):
    x, cos, sin = _inputs()
    p = rope_fusion.install()
    try:
        assert rope_fusion.install() is p and rope_fusion.install(p) is p
        assert inductor_config.post_grad_custom_post_pass is p  # not a chain of two passes
        with torch.no_grad():
            compile_repeated_blocks(Model(n=1).eval())(x, cos, sin)
        assert len(p.report.sites) == 2 and len(p.report.kernels) == 1, p.report.table()
        assert rope_fusion.install(backend="auto", fuse_qk=True) is p  # the same options: the installed pass
    finally:
        rope_fusion.uninstall()
    assert inductor_config.post_grad_custom_post_pass is None and torch.compile is _ORIGINAL_COMPILE


@pytest.mark.parametrize("again", [lambda: rope_fusion.install(backend="inductor"),
                                   lambda: rope_fusion.install(fuse_qk=False),
                                   lambda: rope_fusion.install(rope_fusion.RopeFusionPass())],
                         ids=["backend", "fuse_qk", "another-pass"])
def test_install_with_other_options_raises_and_keeps_the_installed_pass(fresh, again):
    """install() then install(backend=...) replaced the installed pass without a word, and the pass the caller
    held reported 0 sites from then on. Now it raises one line that says what to do, and the first pass stays
    installed and keeps fusing."""
    x, cos, sin = _inputs()
    p = rope_fusion.install()
    try:
        with pytest.raises(RuntimeError, match=r"is installed already.*rope_fusion\.uninstall\(\) first") as e:
            again()
        assert "\n" not in str(e.value)
        assert rope_fusion.installed() is p and inductor_config.post_grad_custom_post_pass is p
        with torch.no_grad():
            compile_repeated_blocks(Model(n=1).eval())(x, cos, sin)
        assert len(p.report.sites) == 2 and len(p.report.kernels) == 1, p.report.table()
    finally:
        rope_fusion.uninstall()
    q = again()  # after uninstall(): installs as asked
    try:
        assert rope_fusion.installed() is q and q is not p
    finally:
        rope_fusion.uninstall()


def test_uninstall_leaves_a_pass_set_after_install(fresh, caplog):
    spy = Spy()
    rope_fusion.install()
    inductor_config.post_grad_custom_post_pass = spy  # the user replaced it
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        rope_fusion.uninstall()
    assert inductor_config.post_grad_custom_post_pass is spy
    assert any("replaced after install" in r.getMessage() for r in caplog.records)
    assert rope_fusion.installed() is None


def test_explicit_pass_in_options_is_chained_with_the_installed_one(fresh, caplog):
    """torch.compile(options={"post_grad_custom_post_pass": spy}) would replace the installed pass for that
    compile; while installed, both run (the explicit one first)."""
    spy = Spy()
    x, cos, sin = _inputs()
    p = rope_fusion.install()
    try:
        with caplog.at_level(logging.INFO, logger="rope_fusion"), torch.no_grad():
            block = Block().eval()
            out = torch.compile(block, options={"post_grad_custom_post_pass": spy})(x, cos, sin)
    finally:
        rope_fusion.uninstall()
    assert spy.fused() == [False] and len(p.report.kernels) == 1, p.report.table()
    assert any("runs after it" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, block(x, cos, sin), rtol=1e-5, atol=1e-5)


def _plain_pass(graph):
    """A plain-function post-grad pass, as a user might configure one."""


def test_chain_after_a_plain_function_has_a_stable_cache_key(fresh):
    inductor_config.post_grad_custom_post_pass = _plain_pass
    rope_fusion.install()
    try:
        chained = inductor_config.post_grad_custom_post_pass
        key = chained.uuid()
        assert key is not None and "0x" not in repr(key) and key == chained.uuid()
        assert key[1] == rope_fusion.integrations.installation._callable_uuid(_plain_pass)
    finally:
        rope_fusion.uninstall()
    assert inductor_config.post_grad_custom_post_pass is _plain_pass


# Inductor takes a list of post-grad passes where it has this helper (newer torch); torch 2.11 takes one pass
lists = pytest.mark.skipif(not hasattr(torch._inductor.custom_graph_pass, "get_custom_graph_passes"),
                           reason="this torch's Inductor takes one post-grad pass, not a list")


@lists
def test_install_joins_a_configured_list_of_passes(fresh):
    """A list of passes configured before install() gets ours at its end (a chain around the list would call
    the list and break every compile); uninstall() gives back the list as it was."""
    spy = Spy()
    x, cos, sin = _inputs()
    inductor_config.post_grad_custom_post_pass = [spy]
    p = rope_fusion.install()
    try:
        assert inductor_config.post_grad_custom_post_pass == [spy, p]
        assert rope_fusion.install() is p and inductor_config.post_grad_custom_post_pass == [spy, p]
        model = Model(n=1).eval()
        with torch.no_grad():
            want = model(x, cos, sin)
            got = compile_repeated_blocks(model)(x, cos, sin)
    finally:
        rope_fusion.uninstall()
    assert inductor_config.post_grad_custom_post_pass == [spy]
    assert spy.fused() == [False] and len(p.report.kernels) == 1, p.report.table()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@lists
@pytest.mark.parametrize("with_ours", [False, True], ids=["other-pass", "ours-listed"])
def test_explicit_list_of_passes_in_options_while_installed(fresh, with_ours):
    """torch.compile(options={"post_grad_custom_post_pass": [...]}) while installed: the installed pass joins
    the end of the list, unless the list already holds a RopeFusionPass; each pass runs once."""
    spy = Spy()
    x, cos, sin = _inputs()
    p = rope_fusion.install()
    listed = rope_fusion.RopeFusionPass()
    try:
        block = Block().eval()
        with torch.no_grad():
            passes = [spy, listed] if with_ours else [spy]
            out = torch.compile(block, options={"post_grad_custom_post_pass": passes})(x, cos, sin)
            want = block(x, cos, sin)
    finally:
        rope_fusion.uninstall()
    ran = listed if with_ours else p
    idle = p if with_ours else listed
    assert spy.fused() == [False] and len(ran.report.kernels) == 1, ran.report.table()
    assert idle.report.kernels == [] and idle.report.sites == []
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


_ORIGINAL_COMPILE = torch.compile
