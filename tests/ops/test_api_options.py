"""Every option of the op is a keyword of every public function, from the schema (ops/schema.RotaryParams).

The public functions' signatures are built from the schema's fields, so a field added to RotaryParams is a
typed keyword of `apply_rotary`, `apply_rotary_qk` and `apply_rotary_qkv` at once (shown here with a copy of
RotaryParams that has a dummy field). Each option is checked to reach the op: on the CPU a call runs the
reference with exactly the options given, so its result is compared bit for bit with the reference's. The
worked examples of docs/api.md run as they stand.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import typing

import pytest
import torch

import rope_fusion
from rope_fusion.ops import public_functions
from rope_fusion.ops.reference import rotary_reference
from rope_fusion.ops.schema import TENSOR_NAMES, RotaryParams

FUNCTIONS = {1: rope_fusion.apply_rotary, 2: rope_fusion.apply_rotary_qk, 3: rope_fusion.apply_rotary_qkv}
FIELDS = [f.name for f in dataclasses.fields(RotaryParams)]
API_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "api.md")


@pytest.mark.parametrize("arity", [1, 2, 3])
def test_signature_is_the_schema(arity):
    sig = inspect.signature(FUNCTIONS[arity])
    names = list(sig.parameters)
    tensors = [*TENSOR_NAMES[arity], "cos", "sin"]
    assert names[:len(tensors)] == tensors
    assert names[len(tensors):] == [*public_functions.tensor_keywords(arity), *FIELDS]
    hints = typing.get_type_hints(RotaryParams)
    for f in dataclasses.fields(RotaryParams):
        p = sig.parameters[f.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
        assert p.annotation in (hints[f.name], hints[f.name] | None)
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default
        assert f.name in FUNCTIONS[arity].__doc__


def test_a_new_schema_field_is_a_keyword_of_every_public_function():
    """A copy of RotaryParams with one more field: the public parameters and their docs include it; a field that
    the schema requires and the public functions cannot default fails loudly, naming it."""
    dummy = dataclasses.make_dataclass("Dummy", [("window", int, dataclasses.field(default=0))],
                                       bases=(RotaryParams,), frozen=True)
    dummy.__doc__ = RotaryParams.__doc__.rstrip() + "\n    window: a dummy option of this test.\n    "
    for arity in (1, 2, 3):
        params = {p.name: p for p in public_functions.option_parameters(arity, dummy)}
        assert set(FIELDS) | {"window"} <= set(params)
        assert params["window"].default == 0 and params["window"].annotation is int
    assert public_functions.field_docs(dummy)["window"] == "a dummy option of this test."
    required = dataclasses.make_dataclass("Required", [("window", int, dataclasses.field(kw_only=True))],
                                          bases=(RotaryParams,), frozen=True)
    with pytest.raises(TypeError, match="Required.window has no default"):
        public_functions.option_parameters(1, required)


def _values(head_dim: int) -> dict:
    """A value other than the default for every field (with what it needs), and the tables' width."""
    d = head_dim
    return {
        "interleaved": (dict(interleaved=True), d // 2),
        "rotary_dim": (dict(rotary_dim=d // 2), d // 4),
        "full_tables": (dict(full_tables=True), d),
        "conjugate": (dict(conjugate=True), d // 2),
        "out_dtype": (dict(out_dtype=torch.bfloat16), d // 2),
        "norm": (dict(norm="rms_across_heads"), d // 2),
        "norm_eps": (dict(norm="rms", norm_eps=0.5), d // 2),
        "deinterleave": (dict(interleaved=True, deinterleave=True), d // 2),
        "rotary_blocks": (dict(rotary_blocks=2), d // 2),
        "rotary_offset": (dict(rotary_offset=d // 4), 3 * d // 8),
        "angle_tables": (dict(angle_tables=True), d // 2),
        "offset_q_only": (dict(rotary_offset=d // 4, rotary_dim=d // 2, offset_q_only=True), d // 4),
    }


@pytest.mark.parametrize("arity", [1, 2, 3])
@pytest.mark.parametrize("field", FIELDS)
def test_every_option_reaches_the_op(arity, field):
    torch.manual_seed(hash(field) % 1000)
    d = 16
    options, width = _values(d)[field]
    xs = [torch.randn(2, 3, h, d) for h in (4, 2, 2)[:arity]]
    cos, sin = torch.randn(3, 1, width), torch.randn(3, 1, width)
    own = [options] * arity
    if options.get("offset_q_only"):  # q's head alone: k (and v) rotate rows of rotary_dim lanes from lane 0
        if arity == 1:
            with pytest.raises(ValueError, match="needs q and k"):
                FUNCTIONS[1](*xs, cos, sin, **options)
            return
        xs = [xs[0], *(x[..., :options["rotary_dim"]].contiguous() for x in xs[1:])]
        own = [{k: v for k, v in options.items() if k != "offset_q_only"}]
        own += [{**own[0], "rotary_offset": 0}] * (arity - 1)
    outs = FUNCTIONS[arity](*xs, cos, sin, **options)
    outs = [outs] if arity == 1 else list(outs)
    full = dict(interleaved=False, rotary_dim=d - options.get("rotary_offset", 0), full_tables=False)
    for x, out, opts in zip(xs, outs, own):
        want = rotary_reference(x, cos, sin, **{**full, **opts})
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert out.dtype == options.get("out_dtype", x.dtype)


def test_every_field_is_exercised_and_documented():
    """A new field fails here until it has a value above and a line in docs/api.md."""
    assert set(_values(16)) == set(FIELDS)
    with open(API_MD) as f:
        text = f.read()
    for name in [*FIELDS, *public_functions.tensor_keywords(3)]:
        assert f"`{name}`" in text, name


def test_tensor_keywords_positions_and_norm_weights():
    torch.manual_seed(7)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cache = torch.randn(9, 8), torch.randn(9, 8)
    pos = torch.randint(0, 9, (5, 1))
    wq, wk = torch.randn(16), torch.randn(16)
    kw = dict(interleaved=False, rotary_dim=16, full_tables=False, norm="rms", positions=pos)
    want = [rotary_reference(x, *cache, norm_weight=w, **kw) for x, w in ((q, wq), (k, wk))]
    for got in (rope_fusion.apply_rotary_qk(q, k, *cache, positions=pos, norm="rms", q_norm_weight=wq,
                                            k_norm_weight=wk),
                rope_fusion.apply_rotary_qk(q, k, *cache, positions=pos, norm="rms", norm_weight=(wq, wk)),
                rope_fusion.apply_rotary_qk(q, k, cos=cache[0], sin=cache[1], positions=pos, norm="rms",
                                            norm_weight=[wq, wk])):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(TypeError, match="not both"):
        rope_fusion.apply_rotary_qk(q, k, *cache, norm="rms", norm_weight=wq, k_norm_weight=wk)
    with pytest.raises(TypeError, match="missing"):
        rope_fusion.apply_rotary_qk(q, k, cache[0])


def _examples() -> list[str]:
    with open(API_MD) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.parametrize("index", range(len(_examples())))
def test_api_md_examples_run(index):
    torch.manual_seed(index)
    exec(compile(_examples()[index], f"docs/api.md example {index}", "exec"), {})
