"""The parameters of the fused rotary op, spelled once.

Every op variant (`rotary`, `rotary_qk`, a backend's own), its torch.library schema, its fake, the Python
API and the pass's emission derive from `RotaryParams`. Adding a parameter is adding a field here (its type
annotation gives the schema type) and giving it a meaning in the reference, the lowering and the kernels;
nothing else spells the op's signature. docs/design.md section 2 gives the semantics.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from collections.abc import Sequence
from typing import Any

import torch

from .packed import check_packed, positions_shape

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Python annotation -> torch schema type of a keyword-only parameter.
_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str", torch.dtype: "ScalarType"}

# Norms the op can apply to x before rotating it (the attention's QK-norm, docs/design.md section 2).
NORMS = ("none", "rms", "rms_across_heads")

# Names of the rotated tensors of each arity (one tensor; a query and a key that share tables; q, k and v
# rotated by the same tables, as CLVP does) and of the op variant that rotates them.
TENSOR_NAMES = {1: ("x",), 2: ("q", "k"), 3: ("q", "k", "v")}
OP_NAMES = {1: "rotary", 2: "rotary_qk", 3: "rotary_qkv"}


@dataclasses.dataclass(frozen=True)
class RotaryParams:
    """What a fused rotation does, besides its tensors: the keyword-only arguments of every op variant.

    interleaved: pairs (2j, 2j+1) when True, NeoX pairs (j, j + rotary_dim/2) when False.
    rotary_dim: lanes [rotary_offset, rotary_offset + rotary_dim) rotate; the rest of the head dim passes
        through.
    full_tables: tables hold one entry per lane (width rotary_dim) instead of one per pair (rotary_dim/2).
    conjugate: rotate by minus the angle (sin negated).
    out_dtype: the dtype of the result (the math is fp32, fp64 when an input is fp64 and the output holds it).
    norm: an RMSNorm applied to x first, in fp32: "rms" over each head's D lanes, "rms_across_heads" over all
        heads of a token (x's last two dims), times the per-tensor `*_norm_weight` when given; "none" by default.
    norm_eps: the norm's epsilon.
    deinterleave: with interleaved pairs, write the result in NeoX order: out[j] and out[j + R/2] are the
        rotated pair (2j, 2j + 1) of x (DeepSeek-V3's `view(.., D/2, 2).transpose(-1, -2)` before rotate_half);
        full tables are then indexed by output lane.
    rotary_blocks: NeoX pairs within each of this many equal blocks of the rotated lanes: block b of width
        W = rotary_dim / rotary_blocks pairs lane b*W + j with b*W + j + W/2 (a head dim split into per-axis
        blocks, each rotated on its own, as Allegro and Gemma 4's vision tower do); per-pair tables list block
        0's pairs, then block 1's; full tables are indexed by lane. 1 (plain NeoX) for interleaved pairs.
    rotary_offset: the first rotated lane; the lanes before it pass through (a pass-through head: the rope part
        at the end of DeepSeek-V3's MLA head, `cat((q_nope, rope(q_pe)), -1)`). Lane indices of the pairing and
        of full tables count from it. A norm still normalises the whole head.
    angle_tables: cos and sin hold angles: the op rotates by cos(cos) and sin(sin), computed in its math dtype
        (tables that the model computes as cos and sin of one angle tensor, HiDream's, are then never written:
        the op reads the angles once per token instead of two tables).
    offset_q_only: in a call of q and k (and v), rotary_offset applies to q alone: the other tensors rotate their
        whole head from lane 0 (their head dim is rotary_dim), as DeepSeek's MLA rotates q's rope lanes after its
        nope lanes and the single shared k_pe head with the same tables, in one launch. Needs a rotary_offset and
        a second tensor; `of_tensor` gives the parameters each tensor is rotated by.
    """

    interleaved: bool
    rotary_dim: int
    full_tables: bool
    conjugate: bool
    out_dtype: torch.dtype
    norm: str = "none"
    norm_eps: float = 1e-6
    deinterleave: bool = False
    rotary_blocks: int = 1
    rotary_offset: int = 0
    angle_tables: bool = False
    offset_q_only: bool = False

    def kwargs(self) -> dict[str, Any]:
        """The op's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> RotaryParams:
        return dataclasses.replace(self, **changes)

    def rotation_kwargs(self) -> dict[str, Any]:
        """The fields a plain rotation of x by its tables reads (`ROTATION_FIELDS`), by name."""
        return {name: getattr(self, name) for name in ROTATION_FIELDS}

    def unhandled(self, handled: Sequence[str]) -> list[str]:
        """The fields outside `handled` that are away from their default (or have none): what code that takes
        only `handled` would drop. Code names what it handles, not what it leaves out, so a field added to the
        schema later is refused where it is not handled yet, never passed on or dropped unseen."""
        out = []
        for f in dataclasses.fields(self):
            if f.name not in handled and (f.default is dataclasses.MISSING or getattr(self, f.name) != f.default):
                out.append(f.name)
        return out

    def of_tensor(self, i: int) -> RotaryParams:
        """The parameters tensor i of a call is rotated by, as a call of that tensor alone: with offset_q_only,
        q (0) keeps rotary_offset and the tensors after it rotate from lane 0."""
        if not self.offset_q_only:
            return self
        return self.replace(offset_q_only=False, rotary_offset=self.rotary_offset if i == 0 else 0)

    @property
    def closed_form_backward(self) -> bool:
        """Whether the gradient of x is the conjugate rotation of the output's gradient: true of a plain rotation
        with a pass-through head or per-axis blocks (`CLOSED_FORM_FIELDS`); a norm, a de-interleaved output, angle
        tables and any field not listed there send the backward through the reference."""
        return not self.unhandled(CLOSED_FORM_FIELDS)

    @property
    def table_width(self) -> int:
        return self.rotary_dim if self.full_tables else self.rotary_dim // 2


# What a rotation of x by its tables reads; every other field is a transform around it.
ROTATION_FIELDS = ("interleaved", "rotary_dim", "full_tables", "conjugate", "out_dtype")
# The fields under which the gradient is still the conjugate rotation (norm_eps matters only with a norm).
CLOSED_FORM_FIELDS = (*ROTATION_FIELDS, "norm_eps", "rotary_blocks", "rotary_offset", "offset_q_only")


def op_schema(arity: int) -> str:
    """The torch.library schema of a variant that rotates `arity` tensors, e.g.
    `(Tensor x, Tensor cos, Tensor sin, Tensor? positions=None, *, bool interleaved, ...) -> Tensor`.

    `positions` (optional): the tables are a cache gathered per token, `cos[positions]` (the vLLM / flash-attn
    convention of a [max_pos, width] cache); the gathered tables broadcast against x like plain ones.
    `cu_seqlens`, `seqlen_offsets` (optional, last, so that positional calls of the other tensors keep their
    places): x packs sequences, and the positions are derived from where each starts (ops/packed.py)."""
    hints = typing.get_type_hints(RotaryParams)
    options = ", ".join(f"{_SCHEMA_TYPES[hints[f.name]]} {f.name}{_default(f)}"
                        for f in dataclasses.fields(RotaryParams))
    tensors = ", ".join(f"Tensor {n}" for n in (*TENSOR_NAMES[arity], "cos", "sin"))
    tensors += ", " + ", ".join(f"Tensor? {n}=None" for n in optional_tensor_names(arity))
    out = "Tensor" if arity == 1 else "(" + ", ".join(["Tensor"] * arity) + ")"
    return f"({tensors}, *, {options}) -> {out}"


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return ""
    return f'="{f.default}"' if isinstance(f.default, str) else f"={f.default!r}"


PACKED_NAMES = ("cu_seqlens", "seqlen_offsets")


def optional_tensor_names(arity: int) -> tuple:
    """The optional tensor arguments after the tables: positions, one norm weight per rotated tensor, then the
    packed sequences' cu_seqlens and seqlen_offsets."""
    return ("positions", *(f"{n}_norm_weight" for n in TENSOR_NAMES[arity]), *PACKED_NAMES)


@dataclasses.dataclass
class RotaryCall:
    """One call of a variant, its arguments by role: what every implementation (reference, kernels) takes."""

    xs: list
    cos: torch.Tensor
    sin: torch.Tensor
    params: RotaryParams
    positions: torch.Tensor | None = None
    norm_weights: list | None = None  # one per x (None entries: no weight)
    cu_seqlens: torch.Tensor | None = None  # packed sequences (ops/packed.py): [batch + 1] starts
    seqlen_offsets: torch.Tensor | None = None  # and [batch] first rows

    @classmethod
    def parse(cls, args: Sequence[Any], kw: dict, arity: int) -> RotaryCall:
        kw = dict(kw)
        names = optional_tensor_names(arity)
        extra = dict(zip(names, args[arity + 2:]))
        extra.update({n: kw.pop(n) for n in names if n in kw})
        return cls(list(args[:arity]), args[arity], args[arity + 1], RotaryParams(**kw), extra.get("positions"),
                   [extra.get(n) for n in names[1:1 + arity]], extra.get("cu_seqlens"), extra.get("seqlen_offsets"))

    def tensors(self) -> tuple:
        """The op's positional tensor arguments, trailing Nones dropped."""
        out = [*self.xs, self.cos, self.sin, self.positions, *(self.norm_weights or [None] * len(self.xs)),
               self.cu_seqlens, self.seqlen_offsets]
        while out[-1] is None:
            out.pop()
        return tuple(out)

    def weight(self, i: int) -> torch.Tensor | None:
        return self.norm_weights[i] if self.norm_weights else None


def math_dtype(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               out_dtype: torch.dtype) -> torch.dtype:
    """fp64 math only when an input is fp64 and the output can hold the extra precision."""
    wide = torch.float64 in (*(x.dtype for x in xs), cos.dtype, sin.dtype)
    return torch.float64 if wide and out_dtype in (torch.float32, torch.float64) else torch.float32


def gathered_shape(table: torch.Tensor, positions: torch.Tensor | tuple | None) -> tuple:
    """The shape of a table as the op reads it: `table[positions]` when positions (or their shape) are given."""
    if positions is None:
        return tuple(table.shape)
    return (*(positions if isinstance(positions, tuple) else positions.shape), table.shape[-1])


def check_call(call: RotaryCall) -> None:
    check_args(call.xs, call.cos, call.sin, call.params, call.positions, call.norm_weights, call.cu_seqlens,
               call.seqlen_offsets)


def check_args(xs: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams,
               positions: torch.Tensor | None = None, norm_weights: Sequence | None = None,
               cu_seqlens: torch.Tensor | None = None, seqlen_offsets: torch.Tensor | None = None) -> None:
    """Raise ValueError naming the offending argument (TypeError for an option of the wrong type); shapes may be
    symbolic (fake tensors)."""
    names = TENSOR_NAMES[len(xs)]
    check_options(params)
    for name, x, w in zip(names, xs, norm_weights or [None] * len(xs)):
        if w is None:
            continue
        if params.norm == "none":
            raise ValueError(f"{name}_norm_weight given without a norm")
        if w.device != x.device:
            raise ValueError(f"{name}_norm_weight on {w.device}, {name} on {x.device}: all tensors must be on one "
                             "device")
        if w.dim() > x.dim() or any(a != 1 and a != b for a, b in zip(reversed(w.shape), reversed(x.shape))) \
                or w.shape[-1] != x.shape[-1]:
            raise ValueError(f"{name}_norm_weight of shape {tuple(w.shape)} does not broadcast against the lanes of "
                             f"{name} (shape {tuple(x.shape)})")
    if params.deinterleave and not params.interleaved:
        raise ValueError("deinterleave=True rotates interleaved pairs: it needs interleaved=True")
    if params.rotary_blocks != 1:
        if params.interleaved or params.rotary_blocks < 1:
            raise ValueError(f"rotary_blocks={params.rotary_blocks}: blocks of NeoX pairs need interleaved=False "
                             "and a positive count (interleaved pairs never cross a block)")
        if params.rotary_dim % (2 * params.rotary_blocks):
            raise ValueError(f"rotary_dim={params.rotary_dim} does not split into {params.rotary_blocks} blocks "
                             "of an even width")
    if params.norm == "rms_across_heads" and any(x.dim() < 2 for x in xs):
        raise ValueError("norm='rms_across_heads' needs x with a heads dim ([..., H, D])")
    for name, x in zip(names, xs):
        if x.dim() < 1:
            raise ValueError(f"{name} must have at least one dimension (the head dim), got a 0-dim tensor")
    check_packed(xs, names, positions, cu_seqlens, seqlen_offsets)
    if cu_seqlens is not None:
        for arg, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 2:
                raise ValueError(f"with cu_seqlens, {arg} is a [max_positions, width] cache, got shape "
                                 f"{tuple(t.shape)}")
    if positions is not None:
        if positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
        if positions.device != xs[0].device:
            raise ValueError(f"positions on {positions.device}, x on {xs[0].device}: all tensors must be on one device")
        for arg, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 2:
                raise ValueError(f"with positions, {arg} is a [max_positions, width] cache, got shape {tuple(t.shape)}")
    devices = {f"{n}": t.device for n, t in zip((*names, "cos", "sin"), (*xs, cos, sin))}
    if len(set(devices.values())) > 1:
        on = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {on}")
    for name, t in (*zip(names, xs), ("cos", cos), ("sin", sin)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} has unsupported dtype {t.dtype}; expected one of {FLOAT_DTYPES}")
    r, off = params.rotary_dim, params.rotary_offset
    if params.offset_q_only:
        if len(xs) < 2:
            raise ValueError("offset_q_only=True applies rotary_offset to q alone: it needs q and k (rotary_qk or "
                             "rotary_qkv), not one tensor")
        if not off:
            raise ValueError("offset_q_only=True without a rotary_offset: every tensor rotates from lane 0 anyway "
                             "(leave it False)")
        for name, x in zip(names[1:], xs[1:]):
            if x.shape[-1] != r:
                raise ValueError(f"with offset_q_only=True, {name} rotates its whole head from lane 0: its head "
                                 f"dim must be rotary_dim={r}, got {name} {tuple(x.shape)}")
    else:
        for name, x in zip(names[1:], xs[1:]):
            if x.shape[-1] != xs[0].shape[-1]:
                raise ValueError(f"q and {name} must share the head dim, got q {tuple(xs[0].shape)} and {name} "
                                 f"{tuple(x.shape)}")
    for i, (name, x) in enumerate(zip(names, xs)):
        off = params.of_tensor(i).rotary_offset
        if off + r > x.shape[-1]:
            what = f"rotary_offset + rotary_dim = {off} + {r}" if off else f"rotary_dim={r}"
            raise ValueError(f"{what} exceeds the head dim of {name} (shape {tuple(x.shape)})")
        _check_tables(name, x, cos, sin, params, positions if cu_seqlens is None else positions_shape(x))


def _check_tables(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, params: RotaryParams,
                  rows: Any) -> None:
    """The tables' width, and their shape (gathered by `rows`, the positions or their shape) against x's."""
    width, r = params.table_width, params.rotary_dim
    for arg, t in (("cos", cos), ("sin", sin)):
        shape = gathered_shape(t, rows)
        what = f"{arg}[positions] of shape {shape}" if rows is not None else f"{arg} of shape {shape}"
        if t.dim() < 1 or t.shape[-1] != width:
            raise ValueError(f"{arg} must have last dim {width} (rotary_dim={r}, "
                             f"full_tables={params.full_tables}), got shape {tuple(t.shape)}")
        if len(shape) > x.dim():
            raise ValueError(f"{what} has more dims than {name} {tuple(x.shape)}")
        for a, b in zip(reversed(shape[:-1]), reversed(x.shape[:-1])):
            if not _broadcasts(a, b):
                raise ValueError(f"{what} does not broadcast against {name} of shape {tuple(x.shape)}")


# What each option's annotation admits (`RotaryParams`' hints): a flag is a bool (a string such as "no" is truthy,
# and would have rotated interleaved pairs); a count is an integer (numpy's too), or a SymInt while tracing (a
# rotary_dim derived from a symbolic head dim); a number is any real; neither is a bool.
_OPTION_TYPES = {bool: ((bool,), "True or False"), int: ((numbers.Integral, torch.SymInt), "an int"),
                 float: ((numbers.Real,), "a number"), str: ((str,), "a string"),
                 torch.dtype: ((torch.dtype,), "a dtype")}
_OPTION_HINTS = {f.name: typing.get_type_hints(RotaryParams)[f.name] for f in dataclasses.fields(RotaryParams)}


def check_options(params: RotaryParams) -> None:
    """Raise naming the option whose value the op cannot take: TypeError for its type (from the schema's
    annotations, so a new field is checked too), ValueError for its range. Cheap: the public functions call it
    once per cached call geometry, the op's kernels and fake once per call."""
    for name, annotation in _OPTION_HINTS.items():
        value = getattr(params, name)
        types, what = _OPTION_TYPES[annotation]
        if not isinstance(value, types) or (annotation is not bool and isinstance(value, bool)):
            raise TypeError(f"{name} must be {what}, got {value!r}")
    if params.norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {params.norm!r}")
    if not (math.isfinite(params.norm_eps) and params.norm_eps >= 0):
        raise ValueError(f"norm_eps must be a finite number >= 0, got {params.norm_eps!r}")
    if params.out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype {params.out_dtype} is unsupported; expected one of {FLOAT_DTYPES}")
    if params.rotary_offset < 0:  # first: the public functions derive a default rotary_dim from it
        raise ValueError(f"rotary_offset must be >= 0, got {params.rotary_offset}")
    r = params.rotary_dim
    if r <= 0 or r % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {r}")
    if params.rotary_blocks < 1:
        raise ValueError(f"rotary_blocks must be a positive count, got {params.rotary_blocks}")


def _broadcasts(a: Any, b: Any) -> bool:
    """Whether a table dim of size a broadcasts against x's dim of size b; False only where it provably does not.
    Sizes known only at run time (a token count from `nonzero`) are checked there (`torch._check`), not guarded
    on: guarding on a data-dependent size fails the trace."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true, sym_or

    if statically_known_true(a == b) or statically_known_true(a == 1):
        return True
    if guard_or_false(a != 1) and guard_or_false(a != b):
        return False
    torch._check(sym_or(a == 1, a == b), lambda: f"a table dim of size {a} against x's {b}")
    return True
