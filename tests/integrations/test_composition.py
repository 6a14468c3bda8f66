"""`install()` and `inductor_options()` compose with the post-grad pass that Inductor holds at compile time.

torch_npu loads its Inductor support on the first NPU compile: its patched `_TorchCompileInductorWrapper.__call__`
imports torch_npu._inductor, which *assigns* `config.post_grad_custom_post_pass = AscendCustomPostPass()`
(torch_npu/_inductor/fx_passes/graph_match_pass.py; a CustomGraphPass whose uuid hashes its file and whose call
runs Ascend's registered post passes), then compiles. `TorchNpuStandIn` reproduces exactly that on the CPU, with a
stand-in Ascend pass that runs two folds of the kind Ascend registers (identity casts, chains of views) and
records whether the graph it saw already held the fused op. Checked, in both orders of `install()` and the
first compile, and with `inductor_options()`: both passes run on every graph, in the order the module docstring of
integrations/installation.py gives (ours first where the Ascend pass arrived after ours), the result is right, and the
FX graph cache key changes when either pass's uuid does.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import rope_fusion

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


class AscendStandInPostPass(CustomGraphPass):
    """Stands in for AscendCustomPostPass: equivalent rewrites, and a log of what it saw."""

    version = "1"  # its uuid: torch_npu hashes the pass's source file; a new version is a new pass
    seen: list = []  # per graph: whether rope_fusion's op was already there

    def __call__(self, graph: torch.fx.Graph) -> None:
        type(self).seen.append(any(str(n.target).startswith("rope_fusion.") for n in graph.nodes))
        for n in list(graph.nodes):
            if n.target is torch.ops.prims.convert_element_type.default and \
                    n.args[0].meta["val"].dtype == n.args[1]:  # fold_cast: an identity cast
                n.replace_all_uses_with(n.args[0])
                graph.erase_node(n)
            elif n.target in _VIEWS and getattr(n.args[0], "target", None) in _VIEWS:  # view_fold_pass
                n.replace_input_with(n.args[0], n.args[0].args[0])
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return f"ascend-stand-in-{self.version}"


class TorchNpuStandIn:
    """torch_npu's lazy Inductor setup: on the first compile, assign Ascend's pass, then compile."""

    def __init__(self, monkeypatch) -> None:
        self.loaded = False
        original = torch._TorchCompileInductorWrapper.__call__

        def new_call(wrapper, model_, inputs_, **kwargs):
            if not self.loaded:
                self.loaded = True
                inductor_config.post_grad_custom_post_pass = AscendStandInPostPass()
            return original(wrapper, model_, inputs_, **kwargs)

        monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__", new_call)


@pytest.fixture
def npu(monkeypatch):
    torch._dynamo.reset()
    AscendStandInPostPass.seen = []
    with inductor_config.patch(fx_graph_cache=False, post_grad_custom_post_pass=None), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield TorchNpuStandIn(monkeypatch)
        rope_fusion.uninstall()
    torch._dynamo.reset()


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def attention_scores(q, k, cos, sin):
    q = (q * cos + _rotate_half(q) * sin).to(torch.float32)  # an identity cast for the Ascend stand-in
    k = k * cos + _rotate_half(k) * sin
    return (q @ k.transpose(-1, -2)).reshape(2, 4, 8, 8).reshape(2, 4, 64)


def _inputs():
    torch.manual_seed(0)
    ang = torch.rand(8, 16) * 6
    ang = torch.cat((ang, ang), -1)
    return torch.randn(2, 4, 8, 32), torch.randn(2, 4, 8, 32), ang.cos(), ang.sin()


def _compile_and_check(**compile_kwargs):
    args = _inputs()
    with torch.no_grad():
        out = torch.compile(attention_scores, **compile_kwargs)(*args)
        torch.testing.assert_close(out, attention_scores(*args), rtol=1e-4, atol=1e-4)


def test_install_then_the_first_npu_compile(npu):
    """torch_npu's assignment replaces the installed pass in Inductor's setting; at compile time both run, ours
    first (the Ascend pass sees the fused op)."""
    p = rope_fusion.install()
    _compile_and_check()
    assert isinstance(inductor_config.post_grad_custom_post_pass, AscendStandInPostPass)  # as torch_npu left it
    assert AscendStandInPostPass.seen == [True]
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qk"], p.report.table()


def test_first_npu_compile_then_install(npu):
    """The other order: install() finds Ascend's pass held and chains after it, as after any configured pass."""
    _compile_and_check()  # the first compile: torch_npu assigns its pass
    assert AscendStandInPostPass.seen == [False]
    torch._dynamo.reset()
    p = rope_fusion.install()
    _compile_and_check()
    assert AscendStandInPostPass.seen == [False, False]  # Ascend first, then ours
    assert [k.op for k in p.report.kernels] == ["rope_fusion.rotary_qk"], p.report.table()


def test_inductor_options_run_with_the_held_pass(npu):
    """options= replaces the global setting for that compile; a RopeFusionPass given there runs with what
    Inductor holds (the Ascend pass torch_npu assigned on this very compile), ours first."""
    options = rope_fusion.inductor_options()
    _compile_and_check(options=options)
    assert AscendStandInPostPass.seen == [True]
    assert len(options["post_grad_custom_post_pass"].report.kernels) == 1


def test_fx_graph_cache_key_holds_both_passes(npu, monkeypatch):
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    p = rope_fusion.install()

    def compile_once():
        torch._dynamo.reset()
        before = dict(counters["inductor"])
        _compile_and_check()
        return {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}

    with fresh_cache(), inductor_config.patch(fx_graph_cache=True):
        assert compile_once() == {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 0}
        assert compile_once() == {"fxgraph_cache_miss": 0, "fxgraph_cache_hit": 1}  # same passes: a hit
        monkeypatch.setattr(AscendStandInPostPass, "version", "2")  # another Ascend pass: another key
        assert compile_once() == {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 0}
        rope_fusion.install(fuse_qk=False)  # another pass of ours: another key
        assert compile_once() == {"fxgraph_cache_miss": 1, "fxgraph_cache_hit": 0}
    assert p.report.graphs >= 1


def test_for_this_compile_rules():
    from rope_fusion.integrations.installation import _KEEP, ChainedPass, for_this_compile

    ours, other, ascend = rope_fusion.RopeFusionPass(), rope_fusion.RopeFusionPass(), AscendStandInPostPass()
    chosen = for_this_compile(ascend, installed=ours)
    assert isinstance(chosen, ChainedPass) and (chosen.first, chosen.second) == (ours, ascend)
    assert chosen.uuid() == ("chain", ours.uuid(), ascend.uuid()) and chosen.report is ours.report
    assert for_this_compile(ChainedPass(ascend, ours), installed=ours) is _KEEP  # install() found it held
    assert for_this_compile(None, installed=ours) is ours  # the setting was cleared after install()
    assert for_this_compile(ascend) is _KEEP  # nothing of ours: nothing changes
    assert for_this_compile([ascend], installed=ours) == [ours, ascend]
    explicit = for_this_compile(ChainedPass(ascend, ours), other, installed=ours)  # inductor_options(other)
    assert (explicit.first, explicit.second) == (other, ascend)  # each RopeFusionPass runs once
    assert for_this_compile(ascend, ascend) is _KEEP  # an explicit pass of another kind: Inductor's rule
