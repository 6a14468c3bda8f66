"""A parameter added to the op's schema is refused where it is not handled yet, never passed on or dropped
(issue 28, item 3): code names the RotaryParams fields it handles (`unhandled`), so a new field away from its
default sends the backward through the reference, makes the NPU bridge run the reference (logged) and the NPU
graph form refuse the site with its name. `Dummy` adds such a field to a subclass of the real RotaryParams."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rope_fusion.kernels import npu, npu_graph
from rope_fusion.ops.schema import RotaryCall, RotaryParams


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
