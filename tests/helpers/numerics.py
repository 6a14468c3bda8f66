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


def check_overlapping_output(fn, args, fused, dense_fn, context: str = "") -> None:
    """The contract where the model's output has elements that share memory (a `slice_scatter` into an `as_strided`
    base with overlapping rows writes its result in the base's strides): which write into a shared element lands
    last is the order the writes run in, which torch leaves undefined (on a GPU eager and plain compile differ from
    the CPU's order). So each element of the fused output must hold, within a few eps of the output dtype, one of
    the values the model means for the elements that share its memory: `dense_fn`, the same model over a dense copy
    of its base, evaluated in fp64, gives those values without the aliasing. Memory that no other element shares
    has one such value: there the check is exact."""
    for i, (f, o, d) in enumerate(zip(as_tuple(fused), as_tuple(fn(*args)), fp64_eval(dense_fn, *args))):
        assert f.shape == o.shape == d.shape, (f.shape, o.shape, d.shape)
        extent = o.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(o.shape, o.stride()) if n > 0)
        cell = torch.arange(extent, device=o.device).as_strided(o.shape, o.stride(), o.storage_offset()).flatten()
        f64, d64 = f.detach().to(torch.float64).flatten(), d.to(torch.float64).flatten()
        same = cell[:, None] == cell[None, :]  # a small output: [n, n] pairs
        gap = torch.where(same, (f64[:, None] - d64[None, :]).abs(), torch.inf).min(dim=1).values
        tol = 16 * torch.finfo(o.dtype).eps * (1 + d64.abs().max())
        worst = gap.max().item()
        where = f"\n{context}" if context else ""
        assert worst <= tol, (f"output {i}: an element {worst:.3g} from every value the model means for the "
                              f"elements sharing its memory (tolerance {tol:.3g}){where}")


def check_unchanged(fn, args, out, compare=None, context: str = "") -> None:
    """A graph left alone must compute what plain compile computes (allclose at a few ulps of the output dtype).
    Not eager: plain compile's code for what the pass leaves rounds otherwise than eager where the graph reduces
    (`cos * x.sum(-1)` differed from eager by 1.7e-6 at a value of 0.39 in fp32, on fresh random inputs)."""
    compare = compare or (lambda t: t)
    torch._dynamo.reset()
    plain = torch.compile(fn, fullgraph=True)(*args)
    for i, (a, b) in enumerate(zip(as_tuple(out), as_tuple(plain))):
        assert a.dtype == b.dtype and a.shape == b.shape
        eps = torch.finfo(b.dtype).eps
        torch.testing.assert_close(compare(a), compare(b), rtol=8 * eps, atol=8 * eps,
                                   msg=lambda m, i=i: f"output {i}: {m}\n{context}")

