"""One key for a whole call of an op behind the dispatcher, and a planned runner fed from the call's own arguments.

The fold ops (`rotary*_cat`, `rotary*_slice_`, `rotary*_into_`) and the KV-cache ops are what a compiled graph
calls through the dispatcher on every step. Their eager kernels parsed the arguments into a call record, keyed the
record's tensors for the checks, and keyed them again for the launch plan, on every call: 70-130 us of host time
a call on a 2-core CPU with the launch itself a no-op, against 22 us for the main op's direct path
(benchmarks/op_families.py). Here a call is read once: `flatten` walks the arguments in their order, giving the
key of the call (each tensor's geometry, as `tensor_geometry` reads it, every other value as it is, and the
nesting) and the tensors themselves; a planned geometry then runs from those tensors, picked by the indices that
`leaf_indices` found when it was planned. What the checks and the plan read is in the key, so a call of a planned
key passes the same checks and takes the same plan.

Arguments reach an op's eager kernel as the dispatcher hands them over (the schema's positional arguments, then
its keyword-only ones), so one op's calls share one nesting and differ only in their values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_TENSOR = torch.Tensor
_KEYED = (torch.Tensor, torch.nn.Parameter)  # a module's weights come as parameters
_SEQUENCES = (list, tuple)
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


def flatten(args: Sequence[Any], kw: dict) -> tuple[tuple, list] | None:
    """(key, tensors) of a call: the key holds every tensor's geometry (shape, strides, dtype, device, and its data
    pointer modulo 16: Triton specialises a launch on 16-byte alignment, also of the views a replay cuts at fixed
    offsets, whose alignment the residue fixes where a bare "aligned or not" would not) in the order the tensors
    come, lists as their length and items, every other value as it is, and the keywords' names; the tensors in
    that order. None where the call cannot be keyed: a tensor without storage, a subclass, an unhashable value.
    One loop, a list's items inline: this is most of a replayed call's own host time (about 5 us for a cat op's
    25 arguments)."""
    key: list = [tuple(kw)]
    leaves: list = []
    append, keep = key.append, leaves.append
    try:
        for a in (*args, *kw.values()):
            cls = a.__class__
            if cls in _PLAIN:  # most of a fold op's arguments: its options, a list's Nones and dims
                append(a)
            elif cls in _KEYED:
                append((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16))
                keep(a)
            elif cls in _SEQUENCES:
                append(len(a))
                for x in a:
                    if x.__class__ in _KEYED:
                        append((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16))
                        keep(x)
                    elif x.__class__ in _PLAIN:
                        append(x)
                    else:
                        _add(x, key, leaves)
            else:
                _add(a, key, leaves)
        out = tuple(key)
        hash(out)
    except (TypeError, RuntimeError):
        return None
    return out, leaves


def _add(a: Any, key: list, leaves: list) -> None:
    if a.__class__ in _KEYED:
        key.append((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16))
        leaves.append(a)
    elif isinstance(a, _SEQUENCES):
        key.append(len(a))
        for x in a:
            _add(x, key, leaves)
    elif isinstance(a, _TENSOR):
        raise TypeError("a tensor subclass is not keyed")
    else:
        key.append(a)


def leaf_indices(args: Sequence[Any], kw: dict, select: Callable[[tuple, dict], Sequence[Any]]) -> list | None:
    """Where each tensor that `select(args, kw)` returns lies among the call's tensors (`flatten`'s order), None for
    an absent one; None where one of them is not an argument of the call (a copy, a view made from one). `select`
    sees every tensor of the call as an object of its own (a view of the same geometry), so two arguments that
    are one tensor in this call are told apart, as they may differ in the next."""
    own = [t.as_strided(t.shape, t.stride(), t.storage_offset()) for t in _tensors(args, kw)]
    it = iter(own)
    selected = select(_rebuild(args, it), {name: _rebuild(a, it) for name, a in kw.items()})
    where = {id(t): i for i, t in enumerate(own)}
    indices: list = []
    for t in selected:
        if t is None:
            indices.append(None)
        elif id(t) in where:
            indices.append(where[id(t)])
        else:
            return None
    return indices


def _tensors(args: Sequence[Any], kw: dict) -> list:
    leaves: list = []
    for a in (*args, *kw.values()):
        _collect(a, leaves)
    return leaves


def _collect(a: Any, leaves: list) -> None:
    if isinstance(a, _TENSOR):
        leaves.append(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _collect(x, leaves)


def _rebuild(a: Any, own: Any) -> Any:
    """`a` with each tensor replaced by the next of `own` (in `flatten`'s order), lists and tuples rebuilt."""
    if isinstance(a, _TENSOR):
        return next(own)
    if isinstance(a, tuple):
        return tuple(_rebuild(x, own) for x in a)
    if isinstance(a, list):
        return [_rebuild(x, own) for x in a]
    return a


def picked(leaves: list, indices: Sequence[int | None]) -> list:
    """The call's tensors at `indices` (`leaf_indices`), None where absent."""
    return [None if i is None else leaves[i] for i in indices]


__all__ = ["flatten", "leaf_indices", "picked"]
