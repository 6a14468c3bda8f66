"""A new fold is a record: registered with `register_fold` and named in a backend's `folds`, it is planned,
emitted and reported with no edit of the planning code, `auto`'s timing or the pass. The registry's order is the
order the folds are asked in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rope_fusion
from rope_fusion.ops import backends
from rope_fusion.ops.backends import emit_op_call
from rope_fusion.ops.op_definition import OPS
from rope_fusion.passes.emission import unflatten
from rope_fusion.passes.folds import fold_registry
from rope_fusion.passes.folds.fold_registry import Fold, Folded, FoldSite


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _find(site: FoldSite) -> list:
    return [m.node.name for m in site.group]


def _emit(em, site: FoldSite, names: list) -> Folded:
    outs = emit_op_call(OPS, em, site.call, site.like)
    finals = [unflatten(em, o, m) for o, m in zip(outs, site.group)]
    return Folded(finals, [m.node for m in site.group], "dummy: " + ", ".join(names))


@pytest.fixture
def dummy_fold():
    """The dummy fold registered, and named by the inductor backend's record, through the registries' own API."""
    inductor = backends.get_backend("inductor")
    fold_registry.register_fold(Fold("dummy", _find, _emit))  # no runner: `auto` times it as the plain kernel
    backends.register_backend(dataclasses.replace(inductor, folds=("dummy",)))
    yield
    fold_registry.unregister_fold("dummy")
    backends.register_backend(inductor)


def test_a_fold_registered_as_a_record_is_planned_emitted_and_reported(dummy_fold):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 32, dtype=torch.float64)
    ang = torch.randn(8, 1, 32, dtype=torch.float64)
    cos, sin = ang.cos(), ang.sin()
    p = rope_fusion.RopeFusionPass(backend="inductor")
    torch._dynamo.reset()
    out = torch.compile(_rope, options={"post_grad_custom_post_pass": p})(x, cos, sin)
    torch.testing.assert_close(out, _rope(x, cos, sin), rtol=1e-12, atol=1e-12)
    assert len(p.report.kernels) == 1, p.report.table()
    assert p.report.kernels[0].fold.startswith("dummy: "), p.report.table(verbose=True)
    assert "dummy: " in p.report.table(verbose=True)


def test_the_registry_holds_the_built_in_folds_in_order():
    names = [f.name for f in fold_registry.folds()]
    assert names[:3] == ["slice write", "cat", "joined write"]
    # each group fold is timed by `auto` as it runs (its runner), none as the plain kernel
    assert all(f.runner is not None for f in fold_registry.folds()[:3])
    # the KV-cache write claims the pair whose k feeds vLLM's cache update (emitted as the op call), and its
    # epilogue folds the op and the update once every group is committed
    assert names[3] == "kv-cache write" and [f.name for f in fold_registry.epilogues()] == ["kv-cache write"]
