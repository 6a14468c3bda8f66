"""The slice-write fold writes only into bases it may write in place (passes/folds/written_bases.py, ops/overlap.py).

The fold hands the base to `auto_functionalized`; Inductor writes into the base itself where nothing reads its
memory afterwards, else into a copy of the base's storage up to its last element. A base whose elements share
memory (expanded, overlapping rows) gave wrong rows (the kernel read rows it had already rotated) or broke
Inductor's scheduler; a view with an offset or gaps of a tensor the graph computes and reads again gave rows of
1e37 or NaN (the copy did not carry them). Those keep the scatter, with the reason on the kernel's report line;
the rotation still fuses. Graph inputs' views and dense bases at offset 0 fold, read again or not.

The Triton kernel runs interpreted on the CPU (tests/helpers/triton_interpreted.py); Inductor compiles the rest of the
graph to C++. Every result is checked against an fp64 evaluation of the model's code on fresh inputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rope_fusion.ops.overlap import dense_from_start, overlap_reason  # noqa: E402
from tests.helpers.compile_pass import compile_with_pass  # noqa: E402
from tests.helpers.numerics import check_numerics, check_overlapping_output  # noqa: E402

TEXT = 3


pytestmark = pytest.mark.triton_on_cpu(serves=("slice_write",))  # the Triton backend, in place for the slice op too


def rope(x, cos, sin):
    """diffusers' apply_rotary_emb (use_real, unbind -1) on [B, H, S, D], tables [S, D]."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return x * cos + rotated * sin


def written(base_of, read_again: bool):
    """The rows after TEXT of `base_of(x)` rotated and scattered back; the base's old values read again or not."""
    def fn(x, cos, sin):
        y = base_of(x)
        z = torch.slice_scatter(y, rope(y[:, :, TEXT:], cos, sin), 2, TEXT)
        return (z, y + 1.0) if read_again else z
    return fn


def written_densely(base_of):
    """`written` over a dense copy of the base: the values the model means for each element, without the aliasing
    of a base whose elements share memory (the order-free contract's candidates)."""
    return written(lambda x: base_of(x).contiguous(), read_again=False)


def _compile(fn, x, rows, d=8, dtype=torch.float32, check=check_numerics):
    torch.manual_seed(11)
    cos, sin = torch.randn(rows, d, dtype=dtype), torch.randn(rows, d, dtype=dtype)
    x0 = x.clone()
    out, p = compile_with_pass(fn, x, cos, sin, backend="triton")
    check(fn, (x0, cos, sin), out, context=p.report.table())
    assert torch.equal(x, x0), "an input the function does not write was written"
    r = p.report
    assert not r.errors and len(r.sites) == 1 and len(r.kernels) == 1, r.table()
    return r.kernels[0].fold, p


def _scatters(p) -> int:
    return p.capture.graphs[-1].after.counts.get("aten.slice_scatter.default", 0)


# -- views of a tensor the graph computes ----------------------------------------------------------------------

COMPUTED = {  # name -> (the base from x [1, 2, 11, 8], dense from element 0)
    "gaps between heads": (lambda x: (torch.cat([x, x], 2) * 2)[:, :, 1:12], False),
    "a step": (lambda x: (torch.cat([x, x], 2) * 2)[:, :, ::2], False),
    "an offset": (lambda x: (torch.cat([x, x], 0) * 2)[1:], False),
    "gaps between rows": (lambda x: (torch.cat([x, x], -1) * 2)[..., :8], False),
    "a prefix": (lambda x: (torch.cat([x, x], 0) * 2)[:1], True),
    "contiguous": (lambda x: x * 2, True),
}


@pytest.mark.parametrize("read_again", [False, True], ids=["written only", "read again"])
@pytest.mark.parametrize("name", list(COMPUTED))
def test_views_of_computed_tensors_fold_where_the_copy_is_exact(triton_on_cpu, name, read_again):
    """A view of a tensor the graph computes folds unless the graph reads that memory again and the view has an
    offset or gaps: Inductor then writes into a copy that misses its other rows (1e37 and NaN before)."""
    base_of, dense = COMPUTED[name]
    fold, p = _compile(written(base_of, read_again), torch.randn(1, 2, 11, 8), rows=8)
    if dense or not read_again:
        assert fold.startswith("slice write: "), fold
        assert _scatters(p) == 0
    else:
        assert fold.startswith("slice write not folded: its base ") and " is a view (offset " in fold \
            and "reads again" in fold and "does not carry its other rows" in fold, fold
        assert _scatters(p) == 1


def test_a_transposed_view_of_a_computed_tensor_folds_when_read_again(triton_on_cpu):
    """[B, S, H, D] computed, transposed to [B, H, S, D] and read again: dense from element 0, its copy is exact."""
    fold, _ = _compile(written(lambda x: (x * 2).transpose(1, 2), True), torch.randn(1, 11, 2, 8), rows=8)
    assert fold.startswith("slice write: "), fold


def test_the_q_of_a_fused_qkv_is_not_written_in_place(triton_on_cpu):
    """q a view of a fused qkv projection whose v the graph reads after the write: the q rows are not the memory's
    first, so the fold stays off (its copy of q read past q's rows before)."""
    def fn(x, cos, sin):
        b, h, s, d = x.shape
        qkv = (x * 2).transpose(1, 2).reshape(b, s, h * d).repeat(1, 1, 3).view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
        q, v = qkv[0], qkv[2]
        return torch.slice_scatter(q, rope(q[:, :, TEXT:], cos, sin), 2, TEXT), v + 1.0

    fold, p = _compile(fn, torch.randn(1, 2, 11, 8), rows=8)
    assert fold.startswith("slice write not folded: its base ") and "reads again" in fold, fold


# -- graph inputs ------------------------------------------------------------------------------------------------

INPUTS = {  # name -> (x's shape, its view the function writes)
    "the input": ((1, 2, 11, 8), lambda x: x),
    "rows of a longer input": ((1, 2, 22, 8), lambda x: x[:, :, 1:12]),
    "every other row": ((1, 2, 22, 8), lambda x: x[:, :, ::2]),
    "an input after an offset": ((2, 2, 11, 8), lambda x: x[1:]),
}


@pytest.mark.parametrize("read_again", [False, True], ids=["written only", "read again"])
@pytest.mark.parametrize("name", list(INPUTS))
def test_views_of_graph_inputs_fold(triton_on_cpu, name, read_again):
    """A graph input's view is copied from the input's own memory (the function does not write its input): it
    folds, read again or not, and the input keeps its values."""
    shape, base_of = INPUTS[name]
    fold, p = _compile(written(base_of, read_again), torch.randn(shape), rows=8)
    assert fold.startswith("slice write: "), fold
    assert _scatters(p) == 0


# -- elements that share memory --------------------------------------------------------------------------------

def _overlapping(x):
    b, h, s, d = x.shape
    return x.reshape(-1).as_strided((b, h, s - 1, d), (h * s * d, s * d, d // 2, 1))  # rows half a row apart


SHARED = {  # name -> (x's shape, the base, the reason's words)
    "rows overlap (computed)": ((1, 2, 11, 8), lambda x: _overlapping(x * 1.0), "rows that may overlap"),
    "rows overlap (input)": ((1, 2, 11, 8), _overlapping, "rows that may overlap"),
    "expanded (computed)": ((1, 2, 11, 8), lambda x: (x * 1.0).expand(2, -1, -1, -1), "a zero stride on dim 0"),
    "expanded (input)": ((1, 2, 11, 8), lambda x: x.expand(2, -1, -1, -1), "a zero stride on dim 0"),
}


@pytest.mark.parametrize("name", list(SHARED))
def test_bases_whose_elements_share_memory_keep_the_scatter(triton_on_cpu, name):
    """Rows half a row apart (`as_strided`) were rotated in place row after row, each reading lanes the row before
    had rotated (1.02 off); an expanded base broke Inductor's scheduler (KeyError 'op2'). Both keep the scatter."""
    shape, base_of, words = SHARED[name]
    rows = base_of(torch.zeros(shape)).shape[2] - TEXT
    # rows that overlap: also the order-free form of the contract that the GPU test uses
    dense = written_densely(base_of)
    checks = (check_numerics, lambda fn, args, out, context: check_overlapping_output(fn, args, out, dense, context)) \
        if "overlap" in name else (check_numerics,)
    fold, p = _compile(written(base_of, False), torch.randn(shape), rows=rows,
                       check=lambda *a, **k: [c(*a, **k) for c in checks])
    assert fold.startswith("slice write not folded: its base ") and words in fold, fold
    assert _scatters(p) == 1


def test_a_pair_whose_k_is_expanded_over_heads_keeps_the_scatters(triton_on_cpu):
    """q and k share one launch; k expanded from one head to two (GQA's repeat as a view): the pair keeps its
    scatters, named by the member, and still fuses into one launch."""
    def fn(q, k, cos, sin):
        q, k = q * 1.0, (k * 1.0).expand(-1, 2, -1, -1)
        return (torch.slice_scatter(q, rope(q[:, :, TEXT:], cos, sin), 2, TEXT),
                torch.slice_scatter(k, rope(k[:, :, TEXT:], cos, sin), 2, TEXT))

    torch.manual_seed(12)
    args = (torch.randn(1, 2, 11, 8), torch.randn(1, 1, 11, 8), torch.randn(8, 8), torch.randn(8, 8))
    out, p = compile_with_pass(fn, *args, backend="triton")
    r = p.report
    assert [k.op for k in r.kernels] == ["rope_fusion.rotary_qk"], r.table()
    assert r.kernels[0].fold.startswith("slice write not folded: k: its base ") and "zero stride on dim 1" in \
        r.kernels[0].fold, r.table()
    assert _scatters(p) == 2
    check_numerics(fn, args, out, context=r.table())


def test_two_members_written_into_one_memory_keep_the_scatters(triton_on_cpu):
    """q's base is the first row of k's (both dense from element 0 of one computed tensor): written in place by
    one call, each would write where the other reads."""
    def fn(x, cos, sin):
        m = x * 2
        q, k = m[:1], m
        return (torch.slice_scatter(q, rope(q[:, :, TEXT:], cos, sin), 2, TEXT),
                torch.slice_scatter(k, rope(k[:, :, TEXT:], cos, sin), 2, TEXT))

    torch.manual_seed(13)
    args = (torch.randn(2, 2, 11, 8), torch.randn(8, 8), torch.randn(8, 8))
    out, p = compile_with_pass(fn, *args, backend="triton")
    r = p.report
    assert [k.fold for k in r.kernels] == ["slice write not folded: two of the rotations are written into one "
                                           "tensor's memory"], r.table()
    check_numerics(fn, args, out, context=r.table())


# -- the joined write and the ops called directly ---------------------------------------------------------------

@pytest.mark.parametrize("shape,x_of", [((1, 1, 9, 8), lambda x: (x * 1.0).expand(-1, 2, -1, -1)),
                                        ((1, 2, 10, 8), lambda x: _overlapping(x * 1.0))],
                         ids=["x expanded over heads", "x with overlapping rows"])
def test_a_joined_write_reads_any_x_and_writes_a_fresh_join(triton_on_cpu, shape, x_of):
    """The joined write's op writes into a join it allocates in the cat's own (dense) layout: an x whose elements
    share memory is only read, and the fold stays right."""
    def fn(x, t, cos, sin):
        return torch.cat([rope(x_of(x), cos, sin), t], 2)

    torch.manual_seed(14)
    x = torch.randn(shape)
    rows = x_of(x).shape[2]
    args = (x, torch.randn(1, 2, 3, 8), torch.randn(rows, 8), torch.randn(rows, 8))
    out, p = compile_with_pass(fn, *args, backend="triton")
    assert [k.fold.split(":")[0] for k in p.report.kernels] == ["joined write"], p.report.table()
    check_numerics(fn, args, out, context=p.report.table())


KW = dict(interleaved=True, rotary_dim=8, full_tables=True, conjugate=False, out_dtype=torch.float32)


@pytest.mark.parametrize("base,words", [(torch.zeros(1, 2, 11, 8).expand(2, -1, -1, -1), "a zero stride on dim 0"),
                                        (_overlapping(torch.zeros(1, 2, 11, 8)), "rows that may overlap")],
                         ids=["expanded", "overlapping rows"])
def test_the_ops_refuse_to_write_memory_that_elements_share(base, words):
    """Called directly, the slice op and the into op raise one line naming the tensor written and why, rather than
    rotate rows that share memory one after another."""
    rows = base.shape[2] - TEXT
    cos, sin = torch.randn(rows, 8), torch.randn(rows, 8)
    bounds = dict(slice_dims=[2], slice_starts=[TEXT], slice_ends=[base.shape[2]])
    with pytest.raises(ValueError, match=f"the slice of x written in place has {words}"):
        torch.ops.rope_fusion.rotary_slice_(base, cos, sin, **KW, **bounds)
    with pytest.raises(ValueError, match=f"the slice of x written in place has {words}"):
        torch.ops.rope_fusion.rotary_into_(base, torch.randn(base[:, :, TEXT:].shape), cos, sin, **KW, **bounds)


def test_the_proofs_hold_for_symbolic_sizes_without_a_guard():
    """The overlap and density proofs on fake tensors of symbolic sizes: proven statically, no guard added."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    x = mode.from_tensor(torch.randn(3, 2, 22, 8),
                         symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4))
    views = [x, x.transpose(1, 2), x[:, :, 1:12], x[1:], x[:1].expand(2, -1, -1, -1)]  # slicing may guard
    guards = len(env.guards)
    assert [overlap_reason(v) is None for v in views] == [True, True, True, True, False]
    assert [dense_from_start(v) for v in views] == [True, True, False, False, False]
    assert "a zero stride on dim 0" in overlap_reason(views[-1])
    assert len(env.guards) == guards


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,base_of,shape,folds", [
    ("gaps, read again", COMPUTED["gaps between heads"][0], (1, 2, 11, 8), False),
    ("gaps, written only", COMPUTED["gaps between heads"][0], (1, 2, 11, 8), True),
    ("a prefix, read again", COMPUTED["a prefix"][0], (1, 2, 11, 8), True),
    ("an input's rows, read again", INPUTS["rows of a longer input"][1], (1, 2, 22, 8), True),
    ("expanded", SHARED["expanded (computed)"][1], (1, 2, 11, 8), False),
    ("overlapping rows", SHARED["rows overlap (computed)"][1], (1, 2, 11, 8), False),
])
def test_gpu_bases(name, base_of, shape, folds):
    """On a GPU, compiled with the Triton kernel: each base folds or keeps its scatter as on the CPU, and every
    result keeps the numbers contract (the refused forms gave 1e37, NaN or 1.02 off there before). Overlapping rows
    make the order of the model's writes into shared memory undefined (eager and plain compile differ from the CPU's
    order on the H100): there every element must hold a value the model means for one of the elements sharing its
    memory, and eager and plain compile are held to the same."""
    torch.manual_seed(15)
    fn = written(base_of, read_again="read again" in name)
    x = torch.randn(shape, device="cuda")
    rows = base_of(x).shape[2] - TEXT
    cos, sin = torch.randn(rows, 8, device="cuda"), torch.randn(rows, 8, device="cuda")
    x0 = x.clone()
    out, p = compile_with_pass(fn, x, cos, sin, backend="triton")
    (kernel,) = p.report.kernels
    assert kernel.fold.startswith("slice write: " if folds else "slice write not folded: "), p.report.table()
    if "overlapping" in name:
        dense = written_densely(base_of)
        torch._dynamo.reset()
        plain = torch.compile(fn)(x0.clone(), cos, sin)
        for who, result in (("eager", fn(x0.clone(), cos, sin)), ("plain compile", plain), ("the pass", out)):
            check_overlapping_output(fn, (x0, cos, sin), result, dense, context=f"{who}\n{p.report.table()}")
    else:
        check_numerics(fn, (x0, cos, sin), out, context=p.report.table())
    assert torch.equal(x, x0)
