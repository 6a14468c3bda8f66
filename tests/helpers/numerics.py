"""The numerics contract (docs/design.md section 2) as the tests check it: a fused result's error against an fp64
evaluation of the original may exceed the original's own error by at most the output dtype's epsilon."""

from __future__ import annotations

import torch


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def to_fp64(args) -> tuple:
    """Real floating tensors to fp64, complex to complex128; anything else (positions, ints) unchanged."""
    def one(a):
        if isinstance(a, torch.Tensor):
            if a.is_complex():
                return a.to(torch.complex128)
            if a.is_floating_point():
                return a.to(torch.float64)
        return a
    return tuple(one(a) for a in args)




def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error in the 2-norm, computed in fp64."""
    out, ref = out.to(torch.float64), ref.to(torch.float64)
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def fp64_eval(fn, *args) -> tuple:
    """The original function evaluated on its inputs cast to fp64 / complex128."""
    return as_tuple(fn(*to_fp64(args)))


def contract_errors(fn, args, fused, compare=None) -> list:
    """[(err_fused, err_orig, slack)] per output: errors of the fused and of the original (eager, original
    dtype) results against the fp64 evaluation of `fn`; slack = eps of the output dtype."""
    compare = compare or (lambda t: t)
    fused = as_tuple(fused)
    orig = as_tuple(fn(*args))
    ref = fp64_eval(fn, *args)
    assert len(fused) == len(orig) == len(ref)
    rows = []
    for f, o, r in zip(fused, orig, ref):
        assert f.shape == o.shape, f"shape {tuple(f.shape)} != {tuple(o.shape)}"
        assert f.dtype == o.dtype, f"dtype {f.dtype} != {o.dtype}"
        r = compare(r)
        rows.append((rel_err(compare(f), r), rel_err(compare(o), r), torch.finfo(o.dtype).eps))
    return rows


def check_numerics(fn, args, fused, compare=None, context: str = "") -> None:
    """The numerics contract: err_fused <= err_orig + eps(out dtype), for every output."""
    for i, (ef, eo, eps) in enumerate(contract_errors(fn, args, fused, compare)):
        assert ef <= eo + eps, (f"output {i}: fused rel. error {ef:.3g} > original's {eo:.3g} + eps {eps:.3g}"
                                f"{chr(10) + context if context else ''}")


def check_overlapping_output(fn, args, fused, context: str = "") -> None:
    """The contract where the model's output has rows that share memory (an `as_strided` base with overlapping
    rows that `slice_scatter` then writes): which write lands last is the order the copies run in, not the code's.
    On the CPU, where they run in order, every element of the fused output must hold one of the values that the fp64
    evaluation writes into that element's memory, within the output dtype's rounding (a few eps of the value). On a
    GPU even eager breaks that (5.7 off on the H100: torch leaves a write into memory that a tensor's own elements
    share undefined), so the GPU test compares with plain compile instead."""
    for i, (f, o, r) in enumerate(zip(as_tuple(fused), as_tuple(fn(*args)), fp64_eval(fn, *args))):
        extent = o.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(o.shape, o.stride()) if n > 0)
        cell = torch.arange(extent, device=o.device).as_strided(o.shape, o.stride(), o.storage_offset()).flatten()
        f64, r64 = f.detach().to(torch.float64).flatten(), r.to(torch.float64).flatten()
        same = cell[:, None] == cell[None, :]  # a small output: [n, n] pairs
        gap = torch.where(same, (f64[:, None] - r64[None, :]).abs(), torch.inf).min(dim=1).values
        tol = 16 * torch.finfo(o.dtype).eps * (1 + r64.abs().max())
        worst = gap.max().item()
        assert worst <= tol, (f"output {i}: an element {worst:.3g} from every value the model writes into its memory "
                              f"(tolerance {tol:.3g}){chr(10) + context if context else ''}")


def check_unchanged(fn, args, out, compare=None, context: str = "") -> None:
    """A graph left alone must compute what eager computes (allclose at the output dtype's tolerance)."""
    compare = compare or (lambda t: t)
    for i, (a, b) in enumerate(zip(as_tuple(out), as_tuple(fn(*args)))):
        assert a.dtype == b.dtype and a.shape == b.shape
        eps = torch.finfo(b.dtype).eps
        torch.testing.assert_close(compare(a), compare(b), rtol=8 * eps, atol=8 * eps,
                                   msg=lambda m, i=i: f"output {i}: {m}\n{context}")

