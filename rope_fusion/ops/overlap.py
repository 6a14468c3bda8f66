"""Proofs about a tensor's memory that an in-place write relies on, read from sizes and strides without a guard.

The slice op rotates each row of its slice where it lies: a program loads a row, rotates it and stores it. That is
exact only when no two elements of the written tensor share memory; on a base whose rows overlap (`as_strided` with
a row stride under the row's length) or that is expanded (stride 0), the row written first is read again, already
rotated, by the next (1.02 off, where the model's own scatter writes a fresh tensor). The pass asks these questions
of the graph's fake values, where sizes may be symbolic: every answer is a static proof (`statically_known_true`),
never a guard, so a layout that holds only for some sizes reads as unproven and the fold is left, not specialised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _known(cond) -> bool:
    if isinstance(cond, bool):
        return cond
    # symbolic sizes only: torch's symbolic-shapes module imports sympy (about 0.2 s), which `import rope_fusion`
    # would otherwise pay for every eager user
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)


def _hint(v) -> int | None:
    """An int size or stride, or a symbolic one's example value (read without a guard; None without one)."""
    if isinstance(v, int):
        return v
    node = getattr(v, "node", None)
    return int(node.hint) if node is not None and node.has_hint() else None


def _nested(sizes: Sequence, strides: Sequence) -> tuple[list, str | None]:
    """The dims of more than one element, innermost first, and why their strides do not provably nest (each dim's
    stride past the last element the dims inside it reach), None when they do."""
    dims = [(d, s, st) for d, (s, st) in enumerate(zip(sizes, strides)) if not _known(s <= 1)]
    for d, s, st in dims:
        if _known(st == 0):
            return dims, f"a zero stride on dim {d} of size {s} (an expanded tensor: its rows share memory)"
    hints = [_hint(st) for _, _, st in dims]
    if None in hints:
        return dims, "rows that may overlap (strides with no example value, in no known order)"
    dims = [dim for _, dim in sorted(zip(hints, dims), key=lambda p: p[0])]
    reach = 0  # the last element, counted from the first, that the dims inside reach
    for d, s, st in dims:
        if not _known(st >= reach + 1):
            return dims, f"rows that may overlap (dim {d}'s stride {st} is within the {reach + 1} elements that " \
                         "the dims inside it span)"
        reach = reach + (s - 1) * st
    return dims, None


def overlap_reason(t: torch.Tensor) -> str | None:
    """Why two elements of `t` may share memory, or None when provably none do. torch's own verdict first where it
    has one for these sizes (`torch._debug_has_internal_overlap`: 1 overlapping, 0 non-overlapping and dense), else
    the strides' nesting, proven without a guard."""
    sizes, strides = tuple(t.shape), tuple(t.stride())
    if all(isinstance(v, int) for v in (*sizes, *strides)):
        verdict = torch._debug_has_internal_overlap(t)
        if verdict == 0:
            return None
        if verdict == 1:
            d = next((d for d, (s, st) in enumerate(zip(sizes, strides)) if st == 0 and s > 1), None)
            if d is None:
                return "elements that share memory (torch's internal-overlap check)"
            return f"a zero stride on dim {d} of size {sizes[d]} (an expanded tensor: its rows share memory)"
    return _nested(sizes, strides)[1]


def dense_from_start(t: torch.Tensor) -> bool:
    """Whether `t` provably covers its storage from element 0 without a gap (a permutation of a contiguous tensor,
    at offset 0): a copy of its storage up to its last element (`clone_preserve_strides`) is then `t`'s own
    elements and nothing else."""
    if not _known(t.storage_offset() == 0):
        return False
    dims, why = _nested(tuple(t.shape), tuple(t.stride()))
    if why is not None:
        return False
    reach = 0
    for _, s, st in dims:
        if not _known(st == reach + 1):
            return False
        reach = reach + (s - 1) * st
    return True
