"""rope_fusion.compat.flash_attn.apply_rotary_emb against flash-attn's documented semantics (flash-attn is not
installed here): an independent reference written from them, checked within the numerics contract
(docs/design.md section 2: error against the reference's fp64 evaluation at most the reference's own plus one eps).

Semantics: x [B, S, H, D] (or packed [T, H, D] with cu_seqlens [B + 1]); cos/sin [S_ro, R/2] with R <= D; token s
of sequence b reads table row s + seqlen_offsets[b] (an int: the same offset for all); NeoX halves of the first R
lanes, or interleaved pairs; lanes past R pass through; inplace=True writes into x.
"""

from __future__ import annotations

import pytest
import torch

from rope_fusion.compat.flash_attn import apply_rotary_emb
from tests.helpers.compat import assert_pass_matches_dropin, dropin_calls
from tests.helpers.compile_pass import compile_with_pass
from tests.helpers.numerics import check_numerics

B, S, H, D, S_RO = 3, 6, 4, 64, 16


def _rotate_rows(x, cos, sin, interleaved):
    """x [N, H, D] by per-row tables [N, R/2]: the reference rotation of one row block."""
    r = 2 * cos.shape[-1]
    c, s = cos[:, None], sin[:, None]
    rot = x[..., :r]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, -1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return torch.cat((out, x[..., r:]), -1)


def reference(x, cos, sin, offsets, cu_seqlens, interleaved):
    """flash-attn's result from its documented semantics, one sequence at a time."""
    if cu_seqlens is None:
        spans = [(b, x[b]) for b in range(x.shape[0])]
    else:
        spans = [(b, x[cu_seqlens[b]:cu_seqlens[b + 1]]) for b in range(cu_seqlens.shape[0] - 1)]
    outs = []
    for b, seq in spans:
        off = int(offsets[b]) if isinstance(offsets, torch.Tensor) else offsets
        rows = slice(off, off + seq.shape[0])
        outs.append(_rotate_rows(seq, cos[rows], sin[rows], interleaved))
    return torch.stack(outs) if cu_seqlens is None else torch.cat(outs)


def _tables(width, dtype):
    angles = torch.rand(S_RO, width) * 6
    return angles.cos().to(dtype), angles.sin().to(dtype)


OFFSETS = {"zero": lambda: 0, "int": lambda: 5, "tensor": lambda: torch.tensor([0, 3, 10])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", list(OFFSETS))
@pytest.mark.parametrize("varlen", [False, True])
def test_against_reference(varlen, offsets, interleaved, rotary_dim, dtype):
    off = OFFSETS[offsets]()
    cos, sin = _tables(rotary_dim // 2, dtype)
    if varlen:
        cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
        x = torch.randn(int(cu[-1]), H, D).to(dtype)
    else:
        cu = None
        x = torch.randn(B, S, H, D).to(dtype)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off, cu_seqlens=cu,
                           max_seqlen=6 if varlen else None)
    check_numerics(lambda x, c, s: reference(x, c, s, off, cu, interleaved), (x, cos, sin), out)


@pytest.mark.parametrize("varlen", [False, True])
def test_inplace(varlen):
    cos, sin = _tables(D // 4, torch.float32)
    cu = torch.tensor([0, 2, 7], dtype=torch.int32) if varlen else None
    x = torch.randn(7, H, D) if varlen else torch.randn(B, S, H, D)
    want = reference(x, cos, sin, 2, cu, False)
    x_before = x.clone()
    out = apply_rotary_emb(x, cos, sin, inplace=True, seqlen_offsets=2, cu_seqlens=cu)
    assert out is x
    check_numerics(lambda x, c, s: reference(x, c, s, 2, cu, False), (x_before, cos, sin), x)
    torch.testing.assert_close(x[..., D // 2:], x_before[..., D // 2:], rtol=0, atol=0)
    torch.testing.assert_close(x, want)


def test_rows_past_the_tables_raise():
    cos, sin = _tables(D // 2, torch.float32)
    x = torch.randn(B, S, H, D)
    with pytest.raises(ValueError, match="rows 12..17"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=12)
    with pytest.raises(IndexError):  # gathered positions past the cache: the op's bounds check
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 0, 12]))
    with pytest.raises(ValueError, match="seqlen_ro, rotary_dim / 2"):
        apply_rotary_emb(x, cos[None], sin[None])


def test_pass_emits_dropin_params():
    """flash-attn's documented math, written in torch as model code writes it, fuses into the op parameters the
    drop-in passes."""
    cos, sin = _tables(D // 4, torch.float32)
    x = torch.randn(B, S, H, D)

    def torch_rotary(x, cos, sin):
        return _rotate_rows(x.flatten(0, 1), cos[2:2 + S].repeat(B, 1), sin[2:2 + S].repeat(B, 1),
                            False).view_as(x)

    out, p = compile_with_pass(torch_rotary, x, cos, sin)
    check_numerics(torch_rotary, (x, cos, sin), out)
    calls = dropin_calls(lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=2), x, cos, sin)
    assert_pass_matches_dropin(p.report, calls, 1, p.report.table())
