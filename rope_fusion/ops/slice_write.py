"""The rotation written into a slice of a larger tensor: `rope_fusion::rotary_slice_` and its q/k, q/k/v arities.

CogVideoX rotates only the video rows of q and k, `q[:, :, text:] = rope(q[:, :, text:])`, which the post-grad
graph spells `slice_scatter(q, rope(slice(q)), 2, text, end)`. A fused op that returns the rotated slice leaves
that scatter behind: an opaque kernel writes the slice, and the scatter copies it into q once more (the 5B-shape
model ran at 0.984x with the kernel forced). These ops instead rotate each tensor's slice in place: tensor i
reads and writes `bases[i].narrow(slice_dims[i], slice_starts[i], slice_ends[i] - slice_starts[i])` and leaves
every other row as it was. They declare that mutation (`Tensor(a!)`), so the pass emits them as
`auto_functionalized` and Inductor's reinplacing decides: the base itself where nothing reads it afterwards, a
clone of it otherwise (docs/design.md section 2, "Writes into a slice").

Every other argument is the rotary op's own (`schema.op_schema`), with the same meaning for the slice as for x:
the implementations build the `RotaryCall` of the slices and run the reference or the device kernel on it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .library import LIBRARY, reference_outputs
from .optional_backends import load_backends
from .packed import unpacked
from .schema import OP_NAMES, TENSOR_NAMES, RotaryCall, check_call, op_schema

# the keyword arguments that say where each tensor's rotated slice lies
SLICE_ARGS = ("slice_dims", "slice_starts", "slice_ends")

# in-place rotation of one device's slices: impl(call, views) -> True when done, else the reference runs
InPlace = Callable[[RotaryCall, list], bool]
IN_PLACE: dict[str, InPlace] = {}
"""Device type -> its in-place kernel (the Triton kernel registers for CUDA, kernels/triton_slice.py)."""


def slice_schema(arity: int) -> str:
    """The rotary schema of an arity with its tensors declared written (one alias set each), no result, and the
    slices' bounds: `(Tensor(a!) q, Tensor(b!) k, Tensor cos, ..., *, <params>, int[] slice_dims, SymInt[]
    slice_starts, SymInt[] slice_ends) -> ()`."""
    schema = op_schema(arity)
    for i, name in enumerate(TENSOR_NAMES[arity]):
        schema = re.sub(rf"\bTensor {name}\b", f"Tensor({'abc'[i]}!) {name}", schema, count=1)
    head, _ = schema.rsplit(") ->", 1)
    return f"{head}, int[] slice_dims, SymInt[] slice_starts, SymInt[] slice_ends) -> ()"


def split_kwargs(kw: dict) -> tuple[dict, tuple]:
    """The rotary op's keywords and the slices' (dims, starts, ends)."""
    kw = dict(kw)
    bounds = tuple(list(kw.pop(n)) for n in SLICE_ARGS)
    return kw, bounds


def slice_views(bases: Sequence[torch.Tensor], bounds: tuple) -> list:
    dims, starts, ends = bounds
    if not (len(dims) == len(starts) == len(ends) == len(bases)):
        raise ValueError(f"one slice per tensor: {len(bases)} tensors, slice_dims {list(dims)}, slice_starts "
                         f"{list(starts)}, slice_ends {list(ends)}")
    views = []
    for name, b, d, s, e in zip(TENSOR_NAMES[len(bases)], bases, dims, starts, ends):
        if b.dim() < 2 or not -b.dim() <= d < b.dim() or d % b.dim() == b.dim() - 1:
            raise ValueError(f"slice_dims entry {d} for {name} of shape {tuple(b.shape)}: the slice runs along a "
                             "dim before the lanes")
        d = d % b.dim()
        if not 0 <= s <= e <= b.shape[d]:
            raise ValueError(f"slice [{s}, {e}) of {name} along dim {d} (size {b.shape[d]}) is out of range")
        views.append(b.narrow(d, s, e - s))
    return views


def _call(arity: int, args: tuple, kw: dict) -> tuple[RotaryCall, list]:
    """The call on the slices (checked like the rotary op's own) and the views it writes."""
    kw, bounds = split_kwargs(kw)
    bases = list(args[:arity])
    views = slice_views(bases, bounds)
    call = RotaryCall.parse([*views, *args[arity:]], kw, arity)
    check_call(call)
    for name, b in zip(TENSOR_NAMES[arity], bases):
        if b.dtype != call.params.out_dtype:
            raise ValueError(f"{name} is {b.dtype}: a rotation written into it has out_dtype {b.dtype}, got "
                             f"{call.params.out_dtype}")
    return call, views


def _fake(arity: int) -> Callable[..., None]:
    def fake(*args: Any, **kw: Any) -> None:
        _call(arity, args, kw)
    return fake


def _eager(arity: int) -> Callable[..., None]:
    def run(*args: Any, **kw: Any) -> None:
        call, views = _call(arity, args, kw)
        load_backends()  # the device's in-place kernel registers when its backend imports
        call = unpacked(call)
        impl = IN_PLACE.get(views[0].device.type)
        if impl is not None and impl(call, views):
            return
        for view, out in zip(views, reference_outputs(call)):  # the reference reads x before any view is written
            view.copy_(out)
    return run


def _define() -> tuple:
    ops = []
    for arity, name in OP_NAMES.items():
        qualname = f"rope_fusion::{name}_slice_"
        torch.library.define(qualname, slice_schema(arity), lib=LIBRARY)
        torch.library.impl(qualname, "default", lib=LIBRARY)(_eager(arity))
        torch.library.register_fake(qualname, lib=LIBRARY)(_fake(arity))
        ops.append(getattr(torch.ops.rope_fusion, f"{name}_slice_").default)
    return tuple(ops)


SLICE_OPS = _define()  # by arity - 1: rotary_slice_, rotary_qk_slice_, rotary_qkv_slice_


def register_in_place(device_type: str, impl: InPlace) -> None:
    """Rotate the slices of one device type's tensors in place with `impl` (False from it: the reference)."""
    IN_PLACE[device_type] = impl
