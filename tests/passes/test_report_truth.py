"""The report tells the truth where most of a model fuses (issue 34).

A wrong RoPE in one layer is a near miss whatever fuses around it: a rejected value is dropped only where its
lanes are a fused rotation's, never because it depends on one, or feeds one, through a projection or attention.
Also here: the misconfigurations users try first fail with what to do instead, options are checked when the
pass is made, and the report's text counts in proper English.

The stacks compile at the graph level (tests/zoo/harness.py: Inductor's front half and post-grad passes, the
post-grad graph then run eagerly), so each case costs a trace and the pass, not a C++ build.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rope_fusion
from rope_fusion.passes.report import Report, counted
from tests.zoo.harness import Capture, compile_model

SAME_TABLE = "cos and sin are one table"


def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def _tables(seq, dim, base):
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.outer(torch.arange(seq).float(), inv)
    angles = torch.cat((angles, angles), -1)
    return angles.cos(), angles.sin()


class Block(nn.Module):
    """An attention block with a residual; `good=False` multiplies by cos where sin belongs (issue 34)."""

    def __init__(self, good: bool, base: float):
        super().__init__()
        self.good, self.base = good, base
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).transpose(1, 3).unbind(2)
        c, sn = _tables(s, 16, self.base)
        if self.good:
            q, k = q * c + _rotate_half(q) * sn, k * c + _rotate_half(k) * sn  # the good RoPE
        else:
            q, k = q * c + _rotate_half(q) * c, k * c + _rotate_half(k) * c  # the bad RoPE
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 64))


def _line(marker: str) -> str:
    lines = inspect.getsource(Block).splitlines()
    first = inspect.getsourcelines(Block)[1]
    return f"{os.path.basename(__file__)}:{first + next(i for i, ln in enumerate(lines) if marker in ln)}"


def _graph_level(model, *args):
    """(pass, output, eager output) of `model` compiled with a fresh pass at the graph level."""
    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass()
    with torch.no_grad():
        out = compile_model(model, p, Capture(), full=False)(*args)
        ref = model(*args)
    return p, out, ref


def _check_stack(goods: list, bases: list) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(g, b) for g, b in zip(goods, bases)]).eval()
    p, out, ref = _graph_level(model, torch.randn(2, 8, 64))
    r = p.report
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    good, bad = sum(goods), len(goods) - sum(goods)
    assert len(r.sites) == 2 * good and not r.errors, r.table()
    assert {s.source.split(os.sep)[-1] for s in r.sites} <= {_line("# the good RoPE")}, r.table()
    # one record per bad tensor (q and k of each bad layer), with the reason of a table used twice, at its line
    assert len(r.misses) == 2 * bad and len({m.node for m in r.misses}) == 2 * bad, r.table()
    assert all(SAME_TABLE in m.reason and m.source.endswith(_line("# the bad RoPE")) for m in r.misses), r.table()


@pytest.mark.parametrize("bases", ["shared", "separate"])
@pytest.mark.parametrize("goods", [[True, False], [False, True]], ids=["bad-last", "bad-first"])
def test_the_issue_reproducer_reports_the_bad_block(goods, bases):
    """Two blocks with a residual, the bad one before or after the good one, with tables alike or not: it said
    "fused 2 sites in 1 kernels, 0 near misses"."""
    _check_stack(goods, [1e4, 1e4] if bases == "shared" else [1e4, 5e3])


@pytest.mark.parametrize("layers,bad", [(n, i) for n in (2, 3, 4) for i in range(n)],
                         ids=lambda v: str(v))
def test_a_bad_layer_in_every_position_of_a_stack(layers, bad):
    _check_stack([i != bad for i in range(layers)], [1e4] * layers)


def test_a_stack_without_a_bad_layer_has_no_near_miss():
    _check_stack([True, True, True], [1e4] * 3)


class GatedBlock(Block):
    """A good RoPE block, then a gated unit of one projection (`h * gelu(g)` of its two halves, CLVP's MLP)."""

    def __init__(self, approximate: str):
        super().__init__(True, 1e4)
        self.approximate = approximate
        self.up, self.down = nn.Linear(64, 256), nn.Linear(128, 64)

    def forward(self, x):
        x = super().forward(x)
        h, g = self.up(x).chunk(2, -1)
        return x + self.down(h * F.gelu(g, approximate=self.approximate))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_a_gated_unit_beside_a_rope_is_no_near_miss(approximate):
    """The decomposed GELU of `h * gelu(g)` sums products that read h[d] and g[d], two lanes of one projection:
    the screen passes it, but it pairs no lanes as a rotation does, and is not reported."""
    torch.manual_seed(0)
    model = GatedBlock(approximate).eval()
    p, out, ref = _graph_level(model, torch.randn(2, 8, 64))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(p.report.sites) == 2 and p.report.misses == [], p.report.table()


def test_a_transformers_llama_with_one_layer_rotated_wrong():
    """A real tiny Llama whose middle layer gets (cos, cos) as its position embeddings: that layer's q and k are
    multiplied by cos twice. The other layers fuse; the bad one is two near misses, q and k, with the reason."""
    transformers = pytest.importorskip("transformers")
    from tests.zoo.entries import LLM16

    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(**dict(LLM16, num_hidden_layers=3))).eval()
    model.config._attn_implementation = "sdpa"
    attn = model.layers[1].self_attn
    rotated = attn.forward

    def cos_twice(*args, position_embeddings, **kwargs):
        cos, _ = position_embeddings
        return rotated(*args, position_embeddings=(cos, cos), **kwargs)

    attn.forward = cos_twice
    ids = torch.randint(0, 128, (2, 8))
    p, out, ref = _graph_level(lambda i: model(input_ids=i, use_cache=False).last_hidden_state, ids)
    r = p.report
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert len(r.sites) == 4 and not r.errors, r.table()  # q and k of layers 0 and 2
    assert len(r.misses) == 2 and all(SAME_TABLE in m.reason for m in r.misses), r.table()
    assert all("modeling_llama.py" in m.source for m in r.misses), r.table()


# -- misconfigurations: what to do instead ------------------------------------------------------------------

def _one_rope(q, cos, sin):
    return q * cos + _rotate_half(q) * sin


def _rope_args():
    c, s = _tables(6, 16, 1e4)
    return torch.randn(1, 2, 6, 16), c, s


def test_the_pass_given_as_a_backend_says_how_to_use_it():
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(_one_rope, backend=rope_fusion.RopeFusionPass())(*_rope_args())
    text = str(info.value)
    assert "Inductor post-grad pass" in text and "post_grad_custom_post_pass" in text, text
    assert "rope_fusion.install()" in text and "'GraphModule' object has no attribute" not in text, text
    assert 'rope_fusion.backend("inductor")' in text, text  # the Dynamo backend that runs the pass


def test_the_class_instead_of_an_instance_says_so():
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(_one_rope, options={"post_grad_custom_post_pass": rope_fusion.RopeFusionPass})(*_rope_args())
    text = str(info.value)
    assert "configure an instance, RopeFusionPass(), not the class" in text, text
    assert "backend must be one of" not in text, text
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(_one_rope, backend=rope_fusion.RopeFusionPass)(*_rope_args())
    assert "given as a torch.compile backend" in str(info.value), str(info.value)


@pytest.mark.parametrize("option", ["fuse_qk", "cache_host_tables"])
@pytest.mark.parametrize("value", ["no", 0, None, "False"])
def test_boolean_options_are_checked(option, value):
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        rope_fusion.RopeFusionPass(**{option: value})


def test_options_that_pass_the_check_are_kept():
    p = rope_fusion.RopeFusionPass(fuse_qk=False, cache_host_tables=False)
    assert (p.fuse_qk, p.cache_host_tables) == (False, False)
    with pytest.raises(ValueError, match="backend must be one of"):
        rope_fusion.RopeFusionPass(backend="cuda")


# -- the package ---------------------------------------------------------------------------------------------

def test_version_is_the_installed_distributions():
    assert rope_fusion.__version__ == importlib.metadata.version("rope_fusion")
    assert re.fullmatch(r"\d+(\.\d+)*\S*", rope_fusion.__version__)


def test_package_docstring_names_no_file_outside_the_package():
    """The wheel holds the package only: a docstring that sends readers to README.md or docs/ points nowhere."""
    doc = rope_fusion.__doc__
    assert not re.search(r"\b[\w/.-]+\.(md|rst|txt)\b|docs/", doc), doc
    assert "post_grad_custom_post_pass" in doc and "install()" in doc, doc


# -- counting in words ----------------------------------------------------------------------------------------

def test_counts_are_singular_for_one():
    assert [counted(n, "site") for n in (0, 1, 2)] == ["0 sites", "1 site", "2 sites"]
    assert counted(1, "near miss") == "1 near miss" and counted(3, "near miss") == "3 near misses"
    assert counted(1, "graph") == "1 graph" and counted(1, "kernel") == "1 kernel"


def test_report_and_log_line_say_1_site_and_1_kernel(caplog):
    """One rotated tensor in one graph: "fused 1 site in 1 kernel, 0 near misses", in the summary and the log."""
    torch._dynamo.reset()
    p = rope_fusion.RopeFusionPass()
    with caplog.at_level(logging.INFO, logger="rope_fusion"), \
            torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(_one_rope, options={"post_grad_custom_post_pass": p})(*_rope_args())
    assert p.report.summary() == "fused 1 site in 1 kernel, 0 near misses", p.report.table()
    assert [m for m in caplog.messages if m.startswith("rope_fusion graph")] == \
        ["rope_fusion graph 0 (inference): fused 1 site in 1 kernel, 0 near misses"]
    assert Report().summary() == "fused 0 sites in 0 kernels, 0 near misses"
