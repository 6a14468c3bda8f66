"""The rotary kernel as the CPU tests launch it directly: an interpreted copy (`KERNEL`; the kernel module itself is
imported compiled, since the graph and cost-model tests trace it on fake tensors), and output buffers poisoned with
NaN so an element the kernel fails to write shows up."""

from __future__ import annotations

import contextlib

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

import rope_fusion.kernels.triton_kernel as tk
from tests.helpers.triton_interpreted import interpreted

KERNEL = interpreted(tk.rotary_kernel)  # the kernel and its @triton.jit helpers, interpreted


@contextlib.contextmanager
def poisoned_outputs():
    """Output buffers start as NaN, so an element the kernel fails to write shows up as NaN. Also, for the
    interpreted kernel: Triton's own reductions (`tl.sum`, a @jit function of its standard library, imported
    compiled with torch before this module could set TRITON_INTERPRET) run interpreted too."""
    real_empty, real_sum = torch.empty, triton.language.sum

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    torch.empty = empty
    if not isinstance(real_sum, InterpretedFunction):
        triton.language.sum = InterpretedFunction(real_sum.fn)
    try:
        yield
    finally:
        torch.empty, triton.language.sum = real_empty, real_sum
