"""A parameter added to the op's schema is refused where it is not handled yet, never passed on or dropped
(issue 28, item 3): code names the RotaryParams fields it handles (`unhandled`), so a new field away from its
default sends the backward through the reference, makes the NPU bridge run the reference (logged) and the NPU
graph form refuse the site with its name. `Dummy` adds such a field to a subclass of the real RotaryParams.

On the pass side a parameter travels as it is: the detector sets it in the site's `params`, and grouping, emission,
the backends' records and the report take `params` whole, so none of them is edited for it. What a new parameter
does touch is `TOUCHED`, each file for what it alone knows: 6, and 8 with the NPU's fast path (`NPU_FAST_PATH`)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from rope_fusion.integrations.fx_pass import FxPass
from rope_fusion.kernels import npu, npu_graph
from rope_fusion.ops.schema import RotaryCall, RotaryParams
from rope_fusion.passes.analysis import matcher
from rope_fusion.passes.report import GraphRecord, Report, Site, plain_params

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "rope_fusion"

# The package files that adding an op parameter touches, and why each.
TOUCHED = {
    "ops/schema.py": "the field: its annotation gives the schema type, and with it every op variant's signature, "
                     "fake and Python keywords",
    "ops/reference.py": "its meaning, the reference the other implementations are checked against",
    "ops/lowering.py": "Inductor's lowering of the op",
    "kernels/triton_plan.py": "the Triton host planner: the kernel's arguments for it",
    "kernels/triton_kernel.py": "the Triton kernel's own code for it",
    "passes/analysis/matcher.py": "the detector: the graph pattern that proves the parameter's value",
}
# Optional: the NPU's fast path. Until a field is in npu.BRIDGE_FIELDS the bridge runs the reference (logged) and
# the graph form refuses the site by name; listing it there obliges npu_graph.py to map it too.
NPU_FAST_PATH = {"kernels/npu.py": "BRIDGE_FIELDS and the bridge's call", "kernels/npu_graph.py": "torch_npu's ops"}


@dataclasses.dataclass(frozen=True)
class Dummy(RotaryParams):
    dummy: int = 0


def _params(**kw) -> RotaryParams:
    base = dict(interleaved=False, rotary_dim=32, full_tables=False, conjugate=False, out_dtype=torch.float32)
    cls = Dummy if "dummy" in kw else RotaryParams
    return cls(**{**base, **kw})


def test_unhandled_names_the_fields_away_from_their_default():
    assert _params().unhandled(()) == ["interleaved", "rotary_dim", "full_tables", "conjugate", "out_dtype"]
    assert _params(rotary_offset=8, norm="rms").unhandled(("interleaved", "rotary_dim", "full_tables",
                                                           "conjugate", "out_dtype")) == ["norm", "rotary_offset"]
    assert _params(dummy=0).unhandled(npu.BRIDGE_FIELDS) == []  # at its default: nothing to handle
    assert _params(dummy=3).unhandled(npu.BRIDGE_FIELDS) == ["dummy"]


@pytest.mark.parametrize("kw,closed", [({}, True), ({"rotary_offset": 8}, True), ({"rotary_blocks": 2}, True),
                                       ({"conjugate": True}, True), ({"norm": "rms"}, False),
                                       ({"interleaved": True, "deinterleave": True}, False),
                                       ({"angle_tables": True}, False), ({"dummy": 1}, False),
                                       ({"dummy": 0}, True)])
def test_the_backward_is_closed_form_only_for_the_fields_it_names(kw, closed):
    assert _params(**kw).closed_form_backward is closed


def test_the_npu_bridge_runs_the_reference_for_a_parameter_it_does_not_know(caplog):
    torch.manual_seed(0)
    x, cos, sin = torch.randn(2, 4, 32), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    with caplog.at_level("WARNING", logger="rope_fusion"):
        assert npu._impl(RotaryCall([x], cos, sin, _params(dummy=1))) is None  # None: the reference serves
    assert "['dummy']" in caplog.text


def test_the_npu_graph_form_refuses_a_parameter_it_does_not_map():
    x, cos, sin = torch.randn(2, 4, 32), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    with pytest.raises(npu_graph.NotTaken, match="dummy"):
        npu_graph._plan(RotaryCall([x], cos, sin, _params(dummy=1)), None, ge=False)


def test_the_triton_backend_refuses_a_parameter_its_kernel_does_not_take(monkeypatch):
    """Until a field is in triton_plan.KERNEL_FIELDS the backend refuses the site by name and an eager call runs
    the reference: never a launch that ignores the field. Both checked with the kernel's module as imported
    (the eager path under the interpreter, which serves CPU tensors)."""
    pytest.importorskip("triton")
    from rope_fusion.kernels import triton_launch, triton_rotary
    from rope_fusion.ops.backends import SiteSpec

    spec = SiteSpec("cuda", ((2, 4, 32),), torch.float32, torch.float32, _params(dummy=1))
    assert "dummy" in (triton_rotary.supports(spec) or "")
    assert triton_rotary.supports(SiteSpec("cuda", ((2, 4, 32),), torch.float32, torch.float32, _params())) is None
    monkeypatch.setattr(triton_launch, "INTERPRETED", True)
    x, cos, sin = torch.randn(2, 4, 32), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    call = RotaryCall([x], cos, sin, _params(dummy=1))
    assert triton_launch.launch_call(call) is None and triton_launch.plan_eager(call) is None


def test_a_new_parameter_touches_at_most_seven_package_files():
    assert len(TOUCHED) <= 7
    assert all((PACKAGE / path).is_file() for path in (*TOUCHED, *NPU_FAST_PATH))


def test_the_detectors_parameter_reaches_the_op_call_unedited(monkeypatch):
    """The matcher's params carry a new field: grouping and emission hand it to the op untouched, and the op's
    schema, generated from RotaryParams (ops/schema.py), is the one place that does not know it yet."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    gm = make_fx(rope)(torch.randn(2, 8, 4, 32), torch.randn(8, 1, 32), torch.randn(8, 1, 32))
    monkeypatch.setattr(matcher, "RotaryParams", lambda **kw: Dummy(**kw, dummy=3))
    p = FxPass(cache_host_tables=False)
    p(gm)
    (error,) = p.report.errors
    assert error.outcome == "site left unfused" and "Unknown keyword argument 'dummy'" in error.error


def test_the_report_keeps_a_new_parameter_by_name():
    """The report's record is made from the params the op was called with: a new field reads as an attribute and
    travels with a cached graph's records, with no field added to report.Site."""
    rep = Report(graphs=1)
    rep.graph_records.append(GraphRecord(0, "inference", "fused", 1))
    rep.sites.append(Site(graph=0, node="add", head_dim=32, x_dtype="float32", table_dtype="float32", shape=(2, 32),
                          source="x.py:1", params=plain_params(_params(dummy=3))))
    assert rep.sites[0].dummy == 3 and rep.sites[0].out_dtype == "float32" and rep.sites[0].style == "neox"
    again = Report()
    again.add_cached_graph(rep.graph_payload(0))
    assert again.sites[0].dummy == 3 and "R=32" in again.table()
