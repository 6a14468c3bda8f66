"""Whether the slice-write fold may write into a base (docs/design.md 4.2, "Bases the fold refuses").

The fold hands the base to `auto_functionalized`, and Inductor's reinplacing writes the op into the base itself
where nothing reads its memory afterwards, else into `clone_preserve_strides(base)`: a copy of the base's storage
from element 0 to its last element. Three kinds of base break that:

- elements that share memory (a zero stride on a dim of more than one element, rows that overlap): the op writes
  each row in place, so a row written first is read again, rotated, by the next (1.02 off), and an expanded base
  broke Inductor's scheduler (`KeyError` in `compute_ancestors`);
- a view of a tensor the graph computes, with an offset or gaps, whose memory the graph reads elsewhere: Inductor
  then clones it, and the copy it makes does not carry the rows the rotation leaves (values like 1e37, NaN; measured
  on torch 2.13 for offsets, steps, gaps between heads or lanes, and the q of a fused qkv whose v is read after);
- two members written into one tensor's memory: each would be written in place where the other is read.

A graph input's view is copied from the input's real storage and folds (measured the same way, read again or not),
and so does a dense base at offset 0 (a permutation of a contiguous tensor), whose copy is its own elements. Each
refusal is a reason of the kernel's report line: the scatter stays, and the rotation still fuses.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._inductor.fx_utils import get_node_storage

from ...ops.overlap import dense_from_start, overlap_reason

aten = torch.ops.aten
# users that read a tensor's sizes, not its memory (Inductor's reinplacing ignores them too)
_META_ONLY = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                        aten.sym_storage_offset.default})


def _sharing(base: fx.Node) -> list:
    """Every node whose value shares the base's storage: the tensor it is a view of, and that tensor's views."""
    storage = get_node_storage(base)
    found, stack = {base}, [base]
    while stack:
        n = stack.pop()
        for m in (*n.all_input_nodes, *n.users):
            if m not in found and get_node_storage(m) == storage:
                found.add(m)
                stack.append(m)
    return list(found)


def _after(node: fx.Node) -> set:
    later, n = set(), node.next
    while n.op != "root":
        later.add(n)
        n = n.next
    return later


def base_reason(base: fx.Node, writes: set, site_node: fx.Node) -> str | None:
    """Why the fold may not write into `base` in place (a sentence for the report), None where it may. `writes` are
    the nodes that write the rotation back (the scatter, and the copy into a slice of the base before it)."""
    val = base.meta["val"]
    why = overlap_reason(val)
    if why is not None:
        return f"its base {base.name} has {why}"
    if get_node_storage(base) is None:
        return f"its base {base.name} has no storage to write into"
    sharing = _sharing(base)
    if any(n.op in ("placeholder", "get_attr") for n in sharing) or dense_from_start(val):
        return None
    later = _after(site_node)
    members = set(sharing)
    readers = [u for n in sharing for u in n.users
               if u not in members and u not in writes and u.target not in _META_ONLY and u in later]
    if readers:
        return (f"its base {base.name} is a view (offset {val.storage_offset()}, strides {tuple(val.stride())}) of "
                f"a tensor the graph computes and reads again ({readers[0].name}): Inductor would write into a copy "
                "of the view that does not carry its other rows")
    return None


def shared_reason(bases: list) -> str | None:
    """Why the members' bases cannot be written by one call: two of them share memory."""
    storages = [get_node_storage(b) for b in bases]
    if len(set(storages)) != len(storages):
        return "two of the rotations are written into one tensor's memory"
    return None
