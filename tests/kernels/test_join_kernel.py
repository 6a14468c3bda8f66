"""The Triton join kernel (kernels/triton_join.py), interpreted on the CPU: pieces read where they lie, joined along a
dim into a new contiguous tensor equal to `torch.cat`'s, and the geometries it leaves to `torch.cat`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rope_fusion.ops import joins  # noqa: E402


class Counted:
    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.count += 1
            return self.kernel[grid](*args, **kw)
        return run


pytestmark = pytest.mark.triton_on_cpu(serves=("join",), wrap=Counted)  # the join kernel's launches counted


@pytest.fixture
def join_kernel(triton_on_cpu):
    """The counted interpreted join kernel, serving CPU tensors (tests/conftest.py)."""
    return triton_on_cpu.join


def qkv_views(batch, seq, heads, d, dtype):
    """A stream's v as the models have it: a view of its fused QKV projection [B, S, 3, H, D]."""
    return torch.randn(batch, seq, 3, heads, d).to(dtype).unbind(2)[2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("batch,heads,d", [(1, 24, 128), (2, 3, 80), (3, 1, 20)])
def test_joined_streams_equal_torch_cat(join_kernel, dtype, batch, heads, d):
    torch.manual_seed(d)
    a, b = qkv_views(batch, 5, heads, d, dtype), qkv_views(batch, 7, heads, d, dtype)
    run = joins.plan_join(a, b, 1)
    for calls in (1, 2):  # the plan serves every later pair of its geometry
        a, b = qkv_views(batch, 5, heads, d, dtype), qkv_views(batch, 7, heads, d, dtype)
        out = run(a, b)
        assert join_kernel.count == calls and out.is_contiguous()
        assert torch.equal(out, torch.cat((a, b), 1))


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_dim_and_contiguous_pieces(join_kernel, dim):
    torch.manual_seed(dim + 5)
    a = torch.randn(2, 3, 4, 6)
    shape = list(a.shape)
    shape[dim] = 5
    b = torch.randn(shape)
    if dim == 1:  # b's dims stored in another order: its rows where they lie
        b = b.transpose(0, 1).contiguous().transpose(0, 1)
    out = joins.plan_join(a, b, dim)(a, b)
    assert join_kernel.count == 1 and torch.equal(out, torch.cat((a, b), dim))


def test_geometries_left_to_torch_cat(join_kernel):
    """Trailing dims that are not one contiguous run (heads transposed), leading dims that do not merge, shapes or
    dtypes that do not join, empty pieces: torch.cat, with its own result and errors."""
    torch.manual_seed(3)
    a = torch.randn(2, 4, 3, 8).transpose(2, 1)  # [2, 3, 4, 8]: lanes contiguous, heads not
    b = torch.randn(2, 5, 4, 8)
    assert torch.equal(joins.plan_join(a, b, 1)(a, b), torch.cat((a, b), 1))
    x = torch.randn(4, 3, 2, 8).permute(2, 0, 1, 3)[:, :, :2]  # leading dims [2, 4] that do not merge
    y = torch.randn(2, 4, 5, 8)
    assert torch.equal(joins.plan_join(x, y, 2)(x, y), torch.cat((x, y), 2))
    empty = torch.randn(2, 0, 4, 8)
    assert torch.equal(joins.plan_join(b, empty, 1)(b, empty), b)
    assert join_kernel.count == 0
    with pytest.raises(RuntimeError):
        joins.plan_join(b, b.double(), 1)(b, torch.randn(2, 5, 3, 8))
