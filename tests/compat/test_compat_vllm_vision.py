"""rope_fusion.compat.vllm_vision against vLLM 0.33's own `ApplyRotaryEmb` on the CPU, in the Qwen2.5-VL vision
tower's layout.

The tower (`Qwen2_5_VisionAttention.forward`) rearranges the fused qkv projection `[s, b, 3 * H * D]` to
`b s three head head_dim`, takes q and k as one `(two b) s head head_dim` view, makes it contiguous and rotates it.
The drop-in takes that view as it comes; it is checked within the numerics contract (docs/design.md section 2)
against vLLM's own `forward_native` on the contiguous copy, NeoX and interleaved, with and without
`enable_fp32_compute`; through the Triton kernel (interpreted) it is one launch that reads the projection's memory.
flash-attn's semantics, which vLLM's CUDA path has and its torch form does not (partial rotary, tables with more
rows than the sequence), against an fp64 reference written from them.
"""

from __future__ import annotations

import pytest
import torch

from rope_fusion.compat import vllm_vision
from rope_fusion.ops.reference import rotary_reference
from tests.helpers.compat import kernel_on_cpu  # noqa: F401  (a fixture)
from tests.helpers.numerics import check_numerics, rel_err

S, H, D = 12, 4, 80


@pytest.fixture(scope="module")
def vllm_apply_rotary_emb():
    try:
        from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
    except Exception as e:  # missing vLLM or its Python deps
        pytest.skip(f"vLLM's rotary layers are not importable here: {type(e).__name__}: {e}")
    return ApplyRotaryEmb


def tower_qk(dtype, batch=1, heads=H, d=D):
    """The tower's q and k: a `(two b) s head head_dim` view of the qkv projection's output (a view for b = 1,
    which the tower runs: every image's patches packed into s)."""
    qkv = torch.randn(S, batch, 3 * heads * d).to(dtype)
    five = qkv.view(S, batch, 3, heads, d).permute(1, 0, 2, 3, 4)  # b s three head head_dim
    qk = five[:, :, :2].permute(2, 0, 1, 3, 4).reshape(2 * batch, S, heads, d)
    return qkv, qk


def half_tables(rows, rotary_dim, dtype=torch.float32):
    angles = torch.rand(rows, rotary_dim // 2, dtype=torch.float64) * 20
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("fp32_compute", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_against_vllm_apply_rotary_emb(vllm_apply_rotary_emb, dtype, neox, fp32_compute):
    torch.manual_seed(0)
    qkv, qk = tower_qk(dtype)
    assert qk.data_ptr() == qkv.data_ptr() and not qk.is_contiguous()  # the tower's view, before its copy
    cos, sin = half_tables(S, D)

    def vllm_path(x, cos, sin):
        return vllm_apply_rotary_emb.forward_static(x.contiguous(), cos, sin, neox, fp32_compute)

    out = vllm_vision.ApplyRotaryEmb(enforce_enable=True, is_neox_style=neox,
                                     enable_fp32_compute=fp32_compute)(qk, cos, sin)
    assert out.is_contiguous() and out.dtype == dtype
    check_numerics(vllm_path, (qk, cos, sin), out)
    q, k = out.view(2, 1, S, H, D).unbind(0)  # as the tower reads the result
    assert q.shape == (1, S, H, D)


def fp64_reference(x, cos, sin, neox):
    """flash-attn's semantics: the first seq rows of the half tables, rotary_dim = 2 * their width, the rest of
    each head passing through."""
    seq, r = x.shape[-3], 2 * cos.shape[-1]
    return rotary_reference(x.double(), cos[:seq, None].double(), sin[:seq, None].double(), interleaved=not neox,
                            rotary_dim=r, full_tables=False, out_dtype=torch.float64)


@pytest.mark.parametrize("neox", [True, False])
def test_the_tower_view_is_one_launch_and_no_copy(kernel_on_cpu, neox):  # noqa: F811
    """Through the Triton kernel (interpreted): the tower's view is read where it lies, q and k as the two tensors
    of one launch (a program rotates a token of each, one table row for both), written into one result; a second
    call replays the plan."""
    torch.manual_seed(1)
    qkv, qk = tower_qk(torch.bfloat16)
    cos, sin = half_tables(S, D)
    for call in range(2):
        out = vllm_vision.apply_rotary_emb(qk, cos, sin, is_neox_style=neox)
        assert kernel_on_cpu.count == call + 1
        q_read, k_read, _ = kernel_on_cpu.reads[call]
        assert [q_read.data_ptr(), k_read.data_ptr()] == [qkv.data_ptr(), qk[1].data_ptr()]
        assert q_read.stride() == k_read.stride() == qk.stride()[1:]
        q_out, k_out, _ = kernel_on_cpu.writes[call]
        assert [q_out.data_ptr(), k_out.data_ptr()] == [out.data_ptr(), out[1].data_ptr()]
        assert out.is_contiguous()
        assert rel_err(out, fp64_reference(qk, cos, sin, neox)) <= torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("batch,tensors", [(2, 2), (3, 3), (5, 1)])
def test_batch_rows_as_the_tensors_of_one_launch(kernel_on_cpu, batch, tensors):  # noqa: F811
    """A batch of the tower's `(two b)` view (b = 2: four rows, q's two then k's two) is two tensors of one launch,
    three rows are three, an odd batch of five is rotated whole; each against fp64."""
    torch.manual_seed(batch)
    if batch == 2:
        _, x = tower_qk(torch.bfloat16, batch=2)
    else:
        x = torch.randn(batch, S, H, D).to(torch.bfloat16)
    cos, sin = half_tables(S, 48)
    out = vllm_vision.apply_rotary_emb(x, cos, sin)
    assert kernel_on_cpu.count == 1
    reads = kernel_on_cpu.reads[0]
    assert len({t.data_ptr() for t in reads}) == tensors and reads[0].data_ptr() == x.data_ptr()
    assert rel_err(out, fp64_reference(x, cos, sin, True)) <= torch.finfo(torch.bfloat16).eps
    assert torch.equal(out[..., 48:], x[..., 48:])


@pytest.mark.parametrize("rotary_dim", [D, 48, 2])
def test_q_and_k_apart_partial_rotary_and_longer_tables(kernel_on_cpu, rotary_dim):  # noqa: F811
    """`apply_rotary_emb_qk` on the tower's `qkv.unbind(dim=2)` views (batch 2, so no `(two b)` view exists): one
    launch for both, each read where it lies; a table of more rows than the sequence reads its first rows, and the
    lanes past rotary_dim pass through (flash-attn's kernel, vLLM's CUDA path)."""
    torch.manual_seed(rotary_dim)
    qkv = torch.randn(2, S, 3, H, D).to(torch.bfloat16)
    q, k, _ = qkv.unbind(dim=2)
    cos, sin = half_tables(S + 5, rotary_dim)
    qo, ko = vllm_vision.apply_rotary_emb_qk(q, k, cos, sin)
    assert kernel_on_cpu.count == 1
    assert [t.data_ptr() for t in kernel_on_cpu.reads[0][:2]] == [q.data_ptr(), k.data_ptr()]
    for x, out in ((q, qo), (k, ko)):
        assert rel_err(out, fp64_reference(x, cos, sin, True)) <= torch.finfo(torch.bfloat16).eps
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_three_dims_and_errors():
    torch.manual_seed(2)
    x = torch.randn(S, H, D, dtype=torch.float64)
    cos, sin = half_tables(S, D, torch.float64)
    out = vllm_vision.apply_rotary_emb(x, cos, sin)
    assert rel_err(out, fp64_reference(x, cos, sin, True)) < 1e-14
    with pytest.raises(ValueError, match="at least 12 rows"):
        vllm_vision.apply_rotary_emb(x, cos[:5], sin[:5])
    with pytest.raises(ValueError, match="1 to 40 entries"):
        vllm_vision.apply_rotary_emb(x, *half_tables(S, 2 * D))
    with pytest.raises(ValueError, match="one shape"):
        vllm_vision.apply_rotary_emb(x, cos, sin[:, :4])
    with pytest.raises(ValueError, match=r"\[seq, heads, head_dim\]"):
        vllm_vision.apply_rotary_emb(x[0], cos, sin)
