"""The `Case` record and the input builders shared by every spelling module."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch

from rope_fusion.ops.reference import rotary_reference

# Small, pairwise distinct sizes (distinct so that dynamic=True does not unify unrelated dims).
B, S, H, D = 2, 7, 3, 16
R_PARTIAL = 8  # partial rotary width (D/2)


@dataclasses.dataclass(frozen=True)
class Expect:
    """What the pass must report for a spelling that it has to fuse."""

    sites: int  # exact number of site records (one per rotated tensor)
    kernels: int  # exact number of fused nodes
    op: str  # op of every kernel: "rope_fusion.rotary", "rope_fusion.rotary_qk" or "rope_fusion.rotary_qkv"
    style: str  # "neox" or "interleaved"
    rotary_dim: int | tuple  # an int, or a tuple of accepted values
    head_dim: int | tuple | None  # None: not asserted
    table_form: str  # "per-pair" (width R/2) or "per-lane" (width R)
    conjugate: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    fn: Callable  # the spelling; takes tensors, returns a tensor or a tuple
    make: Callable  # make(dtype) -> tuple of fresh random inputs
    ref: Callable | None  # ref(*inputs) -> what fn computes, through rotary_reference; None for near misses
    expect: Expect | None  # None: must not fuse
    dtypes: tuple = (torch.bfloat16,)  # first = primary dtype (also compiled with dynamic=True)
    note: str = ""
    compare: Callable | None = None  # near misses: maps an output to its deterministic part
    expect_miss: bool = True  # near misses: p.report.misses must record something


def up(t: torch.Tensor) -> torch.Tensor:
    """`.float()` in a low-precision graph; a no-op on fp64, so the fp64 evaluation stays fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rnd(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def angles(*shape) -> torch.Tensor:
    """Random angles in fp64, spread over several turns."""
    return (torch.rand(*shape, dtype=torch.float64) * 2 - 1) * 4 * math.pi


def half_tables(*shape, dtype=torch.float32):
    """cos, sin of width shape[-1] (one entry per pair)."""
    a = angles(*shape)
    return a.cos().to(dtype), a.sin().to(dtype)


_DISTINCT = [False]


@contextlib.contextmanager
def distinct_tables():
    """Inside: "full" tables get an independent angle per lane, so that a wrong lane of a table shows up in
    the numbers (the pass may assume nothing about table values, docs/design.md section 1)."""
    _DISTINCT.append(True)
    try:
        yield
    finally:
        _DISTINCT.pop()


def full_il_tables(*shape, dtype=torch.float32, distinct=None):
    """Width shape[-1] (=R): c0 c0 c1 c1 ... (distinct=True: every lane its own angle)."""
    *lead, r = shape
    distinct = _DISTINCT[-1] if distinct is None else distinct
    a = angles(*lead, r) if distinct else angles(*lead, r // 2).repeat_interleave(2, -1)
    return a.cos().to(dtype), a.sin().to(dtype)


def full_neox_tables(*shape, dtype=torch.float32, distinct=None):
    """Width shape[-1] (=R): cat(c, c) (distinct=True: every lane its own angle)."""
    *lead, r = shape
    distinct = _DISTINCT[-1] if distinct is None else distinct
    a = angles(*lead, r) if distinct else torch.cat([angles(*lead, r // 2)] * 2, -1)
    return a.cos().to(dtype), a.sin().to(dtype)


def complex_freqs(*shape, dtype=torch.complex64):
    return torch.polar(torch.ones(*shape, dtype=torch.float64), angles(*shape)).to(dtype)


def noncontig_bhsd(b, h, s, d, dtype):
    """[B,H,S,D] as the usual transpose of a [B,S,H,D] projection (not contiguous)."""
    return rnd(b, s, h, d, dtype=dtype).transpose(1, 2)


def rope(x, cos, sin, *, interleaved, rotary_dim=None, full, conjugate=False, out_dtype=None, blocks=1):
    """rotary_reference with the argument names the spellings use."""
    return rotary_reference(x, cos, sin, interleaved=interleaved,
                            rotary_dim=x.shape[-1] if rotary_dim is None else rotary_dim,
                            full_tables=full, conjugate=conjugate, out_dtype=out_dtype, rotary_blocks=blocks)


QK = "rope_fusion.rotary_qk"
QKV = "rope_fusion.rotary_qkv"
ONE = "rope_fusion.rotary"
