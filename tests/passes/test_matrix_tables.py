"""2x2 rotation-matrix tables built in the graph (HiDream, PRX, Kandinsky, Flux's original `apply_rope`): the
tables are stacked per axis from cos and sin as [[c, -s], [s, c]], concatenated across the axes, given a heads
dim, and applied to x viewed as pairs, `F[..., 0] * x0 + F[..., 1] * x1` or `(F * x_pairs).sum(-1)`. The
minus sign is in the graph, so the site fuses as an interleaved rotation, q and k in one launch; a matrix with
another sign pattern stays with a reason that names it, and a matrix that arrives as a tensor keeps its own
reason (docs/design.md section 1.3). Real Inductor on the CPU, numerics against an fp64 reference."""

from __future__ import annotations

import os

import pytest
import torch

import rope_fusion
from tests.helpers.compile_pass import compile_with_pass, static_lanes
from tests.helpers.numerics import check_numerics, check_unchanged

os.environ.setdefault("HF_HUB_OFFLINE", "1")

B, S, H = 2, 12, 2
AXES = {1: (16,), 2: (8, 8), 3: (8, 4, 4)}  # per-axis rotary dims; their sum is the head dim
THETA = 10000.0


def angles(pos: torch.Tensor, dim: int, dtype=torch.float32) -> torch.Tensor:
    """positions x inverse frequencies of one axis: [.., S, dim/2]."""
    omega = 1.0 / (THETA ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    return pos.to(dtype).unsqueeze(-1) * omega


def _rows(c, s):  # HiDream, PRX, Kandinsky: stack([cos, -sin, sin, cos]).view(..., 2, 2)
    m = torch.stack([c, -s, s, c], -1)
    return m.view(*m.shape[:-1], 2, 2)


def _nested(c, s):  # a stack of the two rows
    return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)


def _columns(c, s):  # column-major entries, transposed into rows
    return torch.stack([c, s, -s, c], -1).unflatten(-1, (2, 2)).transpose(-1, -2)


def _inverse(c, s):  # [[c, s], [-s, c]]: the inverse rotation (RoPE's backward, a conjugate)
    m = torch.stack([c, s, -s, c], -1)
    return m.view(*m.shape[:-1], 2, 2)


def _symmetric(c, s):  # [[c, s], [s, c]]: no rotation
    m = torch.stack([c, s, s, c], -1)
    return m.view(*m.shape[:-1], 2, 2)


def _both_negated(c, s):  # [[c, -s], [-s, c]]: no rotation
    m = torch.stack([c, -s, -s, c], -1)
    return m.view(*m.shape[:-1], 2, 2)


def tables(ids: torch.Tensor, axes: int, stack, heads_at: int, angle_dtype=torch.float32) -> torch.Tensor:
    """The per-axis matrices [B, S, d/2, 2, 2], concatenated along the pair dim, with a heads dim at `heads_at`
    (2 for a [B, S, H, D] x, 1 for [B, H, S, D]); angles in fp64 and the matrix cast to fp32 as HiDream does."""
    per_axis = [stack(a.cos(), a.sin()).float()
                for a in (angles(ids[..., i], d, angle_dtype) for i, d in enumerate(AXES[axes]))]
    return torch.cat(per_axis, dim=-3).unsqueeze(heads_at)


def by_index(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """HiDream's and Flux's `apply_rope`."""
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (f[..., 0] * x_[..., 0] + f[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


def by_sum(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Kandinsky's `apply_rotary`: the matrix times the pairs, summed over the pair."""
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2).float()
    return (f.float() * x_).sum(dim=-1).reshape(*x.shape).to(dtype=x.dtype)


def model(axes: int, stack, apply, layout: str, angle_dtype=torch.float32):
    """q and k rotated by one set of matrices; layout "bshd", "bhsd", or "bhsd-expand" (the heads dim expanded to
    q's head count instead of broadcast)."""
    heads_at = 2 if layout == "bshd" else 1

    def fn(q, k, ids):
        f = tables(ids, axes, stack, heads_at, angle_dtype)
        if layout.endswith("expand"):
            f = f.expand(-1, q.shape[1], -1, -1, -1, -1)
        return apply(q, f), apply(k, f)
    return fn


def inputs(axes: int, layout: str, dtype) -> tuple:
    d = sum(AXES[axes])
    shape = (B, S, H, d) if layout == "bshd" else (B, H, S, d)
    ids = torch.randint(0, 64, (B, S, axes))
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), ids


FP32, BF16 = torch.float32, torch.bfloat16
FUSED = {  # id -> (axes, stack, apply, layout, x dtype, angle dtype)
    "rows-3axes-bshd-fp64angles": (3, _rows, by_index, "bshd", FP32, torch.float64),
    "nested-2axes-bhsd-bf16": (2, _nested, by_index, "bhsd", BF16, FP32),
    "columns-3axes-bhsd-expand-sum": (3, _columns, by_sum, "bhsd-expand", FP32, FP32),
}


def _fused(fn, args, dynamic=False):
    out, p = compile_with_pass(fn, *args, dynamic=dynamic)
    rep, t = p.report, p.report.table()
    assert not rep.errors, t
    assert len(rep.sites) == 2 and len(rep.kernels) == 1 and not rep.misses, t  # q and k in one launch
    assert all(s.style == "interleaved" and s.rotary_dim == s.head_dim for s in rep.sites), t
    assert p.capture.rope_ops == 1 and not p.capture.products_after and not p.capture.negations_after, t
    check_numerics(fn, args, out, context=t)
    return rep


@pytest.mark.parametrize("case", list(FUSED))
def test_built_matrices_fuse(case):
    axes, stack, apply, layout, dtype, angle_dtype = FUSED[case]
    fn = model(axes, stack, apply, layout, angle_dtype)
    rep = _fused(fn, inputs(axes, layout, dtype))
    assert all(not s.conjugate for s in rep.sites), rep.table()


def test_the_inverse_matrix_fuses_as_the_inverse_rotation():
    fn = model(2, _inverse, by_index, "bhsd")
    rep = _fused(fn, inputs(2, "bhsd", FP32))
    assert all(s.conjugate for s in rep.sites), rep.table()


def test_built_matrices_fuse_with_dynamic_shapes():
    """Batch and sequence symbolic, the head dim static: the positions' sequence dim stays a leading dim (never
    read at its example value), so the fused op holds for every length."""
    fn = model(3, _rows, by_index, "bhsd")
    _fused(fn, static_lanes(inputs(3, "bhsd", FP32)), dynamic=True)


@pytest.mark.parametrize("stack,shown,layout", [(_symmetric, "[[c, s], [s, c]]", "bhsd"),
                                                (_both_negated, "[[c, -s], [-s, c]]", "bshd")],
                         ids=["symmetric", "both-negated"])
def test_a_wrong_matrix_is_a_near_miss_that_names_it(stack, shown, layout):
    fn = model(2, stack, by_index, layout)
    args = inputs(2, layout, FP32)
    out, p = compile_with_pass(fn, *args)
    rep, t = p.report, p.report.table()
    assert not rep.errors and not rep.sites and p.capture.rope_ops == 0, t
    check_unchanged(fn, args, out, context=t)
    assert len(rep.misses) == 2, t
    for miss in rep.misses:
        assert f"multiply each pair of x by the matrix {shown} of two tables c and s that the graph builds" \
            in miss.reason, t
        assert "arrives as a tensor" not in miss.reason, t


def test_a_matrix_that_arrives_as_a_tensor_keeps_its_reason():
    q, k, ids = inputs(3, "bhsd", FP32)
    freqs_cis = tables(ids, 3, _rows, 1)

    def fn(q, k, freqs_cis):
        return by_index(q, freqs_cis), by_index(k, freqs_cis)

    out, p = compile_with_pass(fn, q, k, freqs_cis)
    rep, t = p.report, p.report.table()
    assert not rep.errors and not rep.sites, t
    check_unchanged(fn, (q, k, freqs_cis), out, context=t)
    assert len(rep.misses) == 2, t
    assert all("a table that arrives as a tensor cannot be proven to hold [[cos, -sin], [sin, cos]]" in m.reason
               for m in rep.misses), t


# -- real models -------------------------------------------------------------------------------------

def _kandinsky_1d(q, k, pos):
    from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6RoPE1D, apply_rotary

    rope = Kandinsky6RoPE1D(q.shape[-1], max_pos=64)(pos)
    return apply_rotary(q, rope), apply_rotary(k, rope)


def _kandinsky_3d(q, k, t, h, w):
    from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6RoPE3D, apply_rotary

    rope = Kandinsky6RoPE3D((4, 6, 6), max_pos=(8, 8, 8))((t, h, w))
    return apply_rotary(q, rope), apply_rotary(k, rope)


@pytest.mark.parametrize("axes", [1, 3], ids=["1d-text", "3d-video"])
def test_kandinsky_rope_modules_fuse(axes):
    """diffusers Kandinsky 6's own RoPE modules and `apply_rotary`, unmodified: matrices stacked from the cos and
    sin of gathered angles (per axis, expanded over the [T, H, W] grid and concatenated, for video), a heads
    dim added, applied as `(rope * x_pairs).sum(-1)` in fp32 and cast back to bf16."""
    pytest.importorskip("diffusers")
    if axes == 1:
        fn, grid = _kandinsky_1d, (12,)
        positions = (torch.arange(12),)
    else:
        fn, grid = _kandinsky_3d, (2, 3, 4)
        positions = tuple(torch.arange(n) for n in grid)
    args = (torch.randn(*grid, H, 16).to(BF16), torch.randn(*grid, H, 16).to(BF16), *positions)
    rep = _fused(fn, args)
    assert all("transformer_kandinsky6.py" in s.source for s in rep.sites), rep.table()


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "rms-normed"])
def test_kandinsky_video_matrices_flattened_over_the_grid_fuse(normed):
    """Kandinsky 6's transformer flattens the [T, H, W, 1, D/2, 2, 2] matrices of its video RoPE to [T*H*W, 1, D/2,
    2, 2] for a [B, T*H*W, H, D] q and k, which it RMS-norms first: a reshape of leading dims only, after which the
    matrix still reads as its cos and sin (once "a table that arrives as a tensor", and with the norm "no node
    holds" the normed table)."""
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6RoPE3D, apply_rotary

    grid, heads, d = (2, 3, 4), 2, 16
    weight = torch.rand(d) + 0.5

    def fn(q, k, t, h, w):
        rope = Kandinsky6RoPE3D((4, 6, 6), max_pos=(8, 8, 8))((t, h, w)).flatten(0, 2)
        if normed:
            q, k = (torch.nn.functional.rms_norm(x, (d,), weight, 1e-6) for x in (q, k))
        return apply_rotary(q, rope), apply_rotary(k, rope)

    tokens = grid[0] * grid[1] * grid[2]
    args = (torch.randn(1, tokens, heads, d), torch.randn(1, tokens, heads, d), *(torch.arange(n) for n in grid))
    rep = _fused(fn, args)
    assert all(s.norm == ("rms folded" if normed else "") for s in rep.sites), rep.table()


# Rows regrouped before use: a permutation (or a choice) of rows keeps a rotation a rotation, and the matrix still
# reads as its cos and sin. Each is applied to a [1, T*H*W, heads, D] q and k like Kandinsky's flattened tables.
def _tiles(rope, grid):  # Kandinsky 6 SR's and Kandinsky 5's `_local_patch` into 1 x 2 x 2 tiles, then flattened
    from diffusers.models.transformers.transformer_kandinsky6_sr import _local_patch

    return _local_patch(rope, grid, (1, 2, 2), dim=0).flatten(0, 1)


def _tiles_with_batch(rope, grid):  # Kandinsky 5's `local_patching` (sparse attention on), on a batch of tables
    from diffusers.models.transformers.transformer_kandinsky import local_patching

    return local_patching(rope[None], (1, *grid), (1, 2, 2), dim=1).flatten(1, 2)[0]


REGROUPED = {
    "local-patch": _tiles,
    "kandinsky5-local-patching": _tiles_with_batch,
    "transposed-grid": lambda rope, grid: rope.permute(1, 0, 2, 3, 4, 5, 6).flatten(0, 2),
    "row-blocks-reversed": lambda rope, grid: torch.cat(list(reversed(rope.flatten(0, 2).chunk(4)))),
    "one-frame": lambda rope, grid: rope[1].flatten(0, 1),
    "strided-rows": lambda rope, grid: rope.flatten(0, 2)[::2],
}


def _regrouped_model(regroup, normed, grid=(2, 4, 4), d=16):
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRRoPE3D, apply_rotary

    weight = torch.rand(d) + 0.5

    def fn(q, k, t, h, w):
        rope = regroup(Kandinsky6SRRoPE3D((4, 6, 6), max_pos=(8, 8, 8))((t, h, w), (1.0, 2.0, 2.0)), grid)
        if normed:
            q, k = (torch.nn.functional.rms_norm(x, (d,), weight, 1e-6) for x in (q, k))
        return apply_rotary(q, rope), apply_rotary(k, rope)

    return fn


@pytest.mark.parametrize("regroup,normed", [*((r, False) for r in REGROUPED), ("local-patch", True)],
                         ids=[*REGROUPED, "local-patch-rms-normed"])
def test_matrices_whose_rows_are_regrouped_fuse(regroup, normed):
    """diffusers Kandinsky 6 SR's own RoPE module, `_local_patch` and `apply_rotary`: the [T, H, W, 1, D/2, 2, 2]
    matrices regrouped into tiles of tokens (reshape -> permute -> flatten) for its sparse attention, or their rows
    permuted or picked otherwise. 0 of 2 fused before, and the reasons were untrue ("a general 2x2 matrix of table
    entries", "a table computed in the graph, but no node holds it")."""
    pytest.importorskip("diffusers")
    grid, heads, d = (2, 4, 4), 2, 16
    fn = _regrouped_model(REGROUPED[regroup], normed, grid, d)
    positions = tuple(torch.arange(n) for n in grid)
    tokens = 16 if regroup in ("one-frame", "strided-rows") else 32  # of the 2 x 4 x 4 grid's rows
    args = (torch.randn(1, tokens, heads, d), torch.randn(1, tokens, heads, d), *positions)
    rep = _fused(fn, args)
    assert all(s.norm == ("rms folded" if normed else "") for s in rep.sites), rep.table()
    assert all("transformer_kandinsky6_sr.py" in s.source for s in rep.sites), rep.table()


def test_a_normed_x_and_a_matrix_that_arrives_as_a_tensor_keeps_its_reason():
    """With the norm folded into the factor (x times the norm's scale, its weight and the matrix entry), the reason
    was "its factor ... is a table computed in the graph, but no node holds it": the scale is computed from x, and
    the obstacle is the matrix that arrives as a tensor."""
    q, k, ids = inputs(3, "bshd", FP32)
    freqs_cis = tables(ids, 3, _rows, 2)
    weight = torch.rand(16) + 0.5

    def fn(q, k, freqs_cis):
        q, k = (torch.nn.functional.rms_norm(x, (16,), weight, 1e-6) for x in (q, k))
        return by_index(q, freqs_cis), by_index(k, freqs_cis)

    out, p = compile_with_pass(fn, q, k, freqs_cis)
    rep, t = p.report, p.report.table()
    assert not rep.errors and not rep.sites and len(rep.misses) == 2, t
    check_unchanged(fn, (q, k, freqs_cis), out, context=t)
    assert all("a table that arrives as a tensor cannot be proven to hold [[cos, -sin], [sin, cos]]" in m.reason
               and "no node holds" not in m.reason for m in rep.misses), t


PRX_CONFIG = dict(in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0, num_heads=2,
                  depth=2, axes_dim=[8, 8])


@pytest.mark.slow
def test_prx_fuses_every_rope_of_every_block():
    """diffusers PRX, unmodified: `PRXEmbedND` stacks [[cos, -sin], [sin, cos]] per axis (in fp64 where the
    device has it), concatenates the two axes and adds a heads dim for a [B, H, S, D] q and k; `apply_rope`
    applies it as `F[..., 0] * x0 + F[..., 1] * x1`. Every q and k fuses, one launch per block."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.PRXTransformer2DModel(**PRX_CONFIG).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 16, 16), timestep=torch.tensor([0.5]),
                  encoder_hidden_states=torch.randn(1, 6, 16), return_dict=False)
    p = rope_fusion.RopeFusionPass()
    # the pass runs on every graph (no compile-cache replays of other tests' graphs), and plain compile has no
    # pass whatever an earlier test installed
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        fused = torch.compile(model, options={"post_grad_custom_post_pass": p})(**inputs)[0]
        torch._dynamo.reset()
        plain = torch.compile(model, options={"post_grad_custom_post_pass": None})(**inputs)[0]
        ref = model.to(torch.float64)(**{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                          else v for k, v in inputs.items()})[0]
        model.to(torch.float32)
    rep, t = p.report, p.report.table()
    depth = PRX_CONFIG["depth"]
    assert not rep.errors and not rep.misses, t
    assert len(rep.sites) == 2 * depth and len(rep.kernels) == depth, t
    assert all(k.op == "rope_fusion.rotary_qk" for k in rep.kernels), t
    assert all(s.style == "interleaved" and s.rotary_dim == 16 and "transformer_prx.py" in s.source
               for s in rep.sites), t
    err_fused = ((fused.double() - ref).norm() / ref.norm()).item()
    err_plain = ((plain.double() - ref).norm() / ref.norm()).item()
    assert err_fused <= err_plain + torch.finfo(torch.float32).eps, (err_fused, err_plain)
