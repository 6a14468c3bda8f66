"""Reading FX nodes: a node's fake value, the chain of ops that pass a value on back to where it arises, and
the nearest upstream node of a kind.

The graph passes walk graphs with these, and so does the kernels' graph-side code (which finds the storage a
launch reads); this module sits below both packages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch.fx as fx


def meta(node: Any) -> Any:
    """The fake value (`meta["val"]`) of an FX node: a FakeTensor, a SymInt, a list of them, or None for
    a node without one and for anything that is not a node (a constant argument)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def chain_back(node: fx.Node, through) -> list:
    """`node` and the nodes it comes from through ops in `through` that pass their first input on (views,
    casts, copies), nearest first: the last one is where the values arise."""
    out = [node]
    while node.target in through and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        out.append(node)
    return out


def upstream(roots: Iterable[fx.Node], follow: Callable[[fx.Node], bool] = lambda n: True) -> Iterator[fx.Node]:
    """Each of `roots` and every node they are computed from, once each (depth first). A node's inputs are
    followed only where `follow` holds for it, so a walk can stop where a node's own record says enough."""
    seen: set = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        if follow(node):
            stack.extend(node.all_input_nodes)


def nearest_upstream(node: fx.Node, found: Callable[[fx.Node], bool], limit: int) -> fx.Node | None:
    """The nearest node at or before `node` (breadth first through every input) for which `found` holds, within
    `limit` nodes visited, else None: a bounded look back that keeps a wide graph cheap."""
    seen, queue, i = {node}, [node], 0
    while i < len(queue) and i < limit:
        n = queue[i]
        i += 1
        if found(n):
            return n
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                queue.append(a)
    return None
