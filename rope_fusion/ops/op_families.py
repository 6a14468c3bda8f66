"""The package's torch.library fragment and the one way an op family is defined in it.

Every family of `rope_fusion::*` ops (the rotary ops and their backends' variants, the cat, slice and into ops, the
KV-cache ops, the layer-cache op) is a set of members that share one definition: a schema, an eager kernel behind
the dispatcher's default key, a fake for tracing and, where gradients flow (or must be refused), an Autograd
registration, each made from the member's key (an arity, a parser, a schema type). Defining them in one place keeps
every family registered alike: an op missing its fake or its autograd rule would fail only where it is traced or
differentiated.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import torch

LIBRARY = torch.library.Library("rope_fusion", "FRAGMENT")
"""The fragment that keeps every op, kernel and fake of the package registered for the life of the process."""

K = TypeVar("K", bound=Hashable)


def define_family(names: Mapping[K, str], schema: Callable[[K], str], eager: Callable[[K], Callable[..., Any]],
                  fake: Callable[[K], Callable[..., Any]],
                  autograd: Callable[[str, K], None] | None = None) -> tuple[Any, ...]:
    """Define each member `names[key]` (`op` or `op.overload`, in the `rope_fusion` namespace) with
    `schema(key)`, `eager(key)` as its default kernel, `fake(key)` as its fake and, given `autograd`, whatever
    `autograd(qualname, key)` registers for it; return the members' overloads in the order of `names`."""
    ops = []
    for key, name in names.items():
        qualname = f"rope_fusion::{name}"
        torch.library.define(qualname, schema(key), lib=LIBRARY)
        torch.library.impl(qualname, "default", lib=LIBRARY)(eager(key))
        torch.library.register_fake(qualname, lib=LIBRARY)(fake(key))
        if autograd is not None:
            autograd(qualname, key)
        packet, _, overload = name.partition(".")
        ops.append(getattr(getattr(torch.ops.rope_fusion, packet), overload or "default"))
    return tuple(ops)
