"""The KV-cache op on Ascend (rope_fusion/kernels/npu_kv_cache.py), on the CPU, with stand-in torch_npu ops.

torch_npu needs the CANN runtime, so the stand-ins below are registered in a test namespace with the schemas of
torch_npu's fused cache ops and their documented semantics (op-plugin's torch_npu docs, the ops' READMEs in CANN's
ops-transformer and ops-nn), each asserting the documented constraints and recording its call:

- npu_qkv_rms_norm_rope_cache(Tensor qkv, Tensor q_gamma, Tensor k_gamma, Tensor cos, Tensor sin, Tensor index,
  Tensor(a!) q_out, Tensor(b!) k_cache, Tensor(c!) v_cache, int[4] qkv_size, int[3] head_nums, *, Tensor? k_scale,
  Tensor? v_scale, Tensor? k_offset, Tensor? v_offset, float epsilon=1e-06, str cache_mode="PA_NZ",
  bool is_output_qkv=False) -> (Tensor, Tensor, Tensor): qkv [B*S, (Nq+Nk+Nv)*D] split into q, k, v; q and k
  RMS-normalised (gammas [D]) and rotated half-and-half by cos, sin [B*S, D]; q into q_out; k and v scattered at
  index (-1 skips) into FRACTAL_NZ caches [blocks, Nk*D//16, block_size, 16]; D = 128, Nk = Nv, fp16/bf16.
- npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, Tensor k_cache,
  Tensor ckv_cache, *, Tensor? k_rope_scale, Tensor? c_kv_scale, Tensor? k_rope_offset, Tensor? c_kv_offset,
  float epsilon=1e-5, str cache_mode='Norm', bool is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor): kv
  [B, 1, S, 512 + 64]; the first 512 lanes RMS-normalised by gamma into ckv_cache, the last 64 rotated as
  cat(x[::2], x[1::2]) * cos + cat(-x[1::2], x[::2]) * sin into k_cache, each at index (a negative one skips;
  PA_BNSD: [blocks, block_size, 1, D] rows; PA_NZ: FRACTAL_NZ pages of that shape).

The op's results through them are checked against the op's reference on the same inputs (caches within one bf16
rounding, every other byte as it was), and the calls the bridge declines run the reference, logged.
"""

from __future__ import annotations

import logging

import pytest
import torch

import rope_fusion
from rope_fusion.kernels import npu_kv_cache as bridge
from rope_fusion.ops import kv_cache_op
from rope_fusion.ops.device_registry import DeviceKernel

NS = "rope_fusion_test_npu_kv"
CALLS: list = []
BF16 = torch.bfloat16

_lib = torch.library.Library(NS, "DEF")
_lib.define("npu_qkv_rms_norm_rope_cache(Tensor qkv, Tensor q_gamma, Tensor k_gamma, Tensor cos, Tensor sin, "
            "Tensor index, Tensor(a!) q_out, Tensor(b!) k_cache, Tensor(c!) v_cache, int[4] qkv_size, "
            "int[3] head_nums, *, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? k_offset=None, "
            "Tensor? v_offset=None, float epsilon=1e-06, str cache_mode=\"PA_NZ\", bool is_output_qkv=False) "
            "-> (Tensor, Tensor, Tensor)")
_lib.define("npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, "
            "Tensor k_cache, Tensor ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, "
            "Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, float epsilon=1e-05, str cache_mode='Norm', "
            "bool is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor)")


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()


def _nz_row(cache: torch.Tensor, slot: int, row: torch.Tensor, block_size: int) -> None:
    """Row (a slot's heads x lanes) into FRACTAL_NZ pages: run r of the slot at [block, r, offset, :]."""
    pages = cache.view(cache.shape[0], -1, block_size, 16)
    pages[slot // block_size, :, slot % block_size, :] = row.reshape(-1, 16)


def _stand_in_qkv(qkv, q_gamma, k_gamma, cos, sin, index, q_out, k_cache, v_cache, qkv_size, head_nums, k_scale=None,
                  v_scale=None, k_offset=None, v_offset=None, epsilon=1e-6, cache_mode="PA_NZ", is_output_qkv=False):
    B, S, N, D = qkv_size
    nq, nk, nv = head_nums
    T, dtype = B * S, qkv.dtype
    assert cache_mode == "PA_NZ" and D == 128 and nk == nv and N == nq + nk + nv and dtype in (torch.float16, BF16)
    assert tuple(qkv.shape) == (T, N * D) and qkv.is_contiguous()
    assert q_gamma.shape == k_gamma.shape == (D,) and q_gamma.dtype == k_gamma.dtype == dtype
    assert tuple(cos.shape) == tuple(sin.shape) == (T, D) and cos.dtype == sin.dtype == dtype
    assert index.dtype == torch.int64 and tuple(index.shape) == (T,)
    assert tuple(q_out.shape) == (T, nq * D) and q_out.dtype == dtype
    block_size = k_cache.shape[2]
    assert k_cache.dtype == v_cache.dtype == dtype and block_size % 16 == 0
    assert tuple(k_cache.shape) == tuple(v_cache.shape) == (k_cache.shape[0], nk * D // 16, block_size, 16)
    assert k_scale is None and v_scale is None and k_offset is None and v_offset is None and not is_output_qkv
    CALLS.append(("qkv", qkv.data_ptr(), tuple(qkv_size), tuple(head_nums), epsilon))
    x = qkv.float().view(T, N, D)
    q, k, v = x[:, :nq], x[:, nq:nq + nk], x[:, nq + nk:]
    c, s = cos.float()[:, None], sin.float()[:, None]

    def rope(y):
        y1, y2 = y[..., : D // 2], y[..., D // 2:]
        return y * c + torch.cat((-y2, y1), -1) * s
    q_out.copy_(rope(_rms(q, q_gamma, epsilon)).reshape(T, -1).to(dtype))
    k = rope(_rms(k, k_gamma, epsilon)).to(dtype)
    for t, slot in enumerate(index.tolist()):
        if slot >= 0:
            _nz_row(k_cache, slot, k[t], block_size)
            _nz_row(v_cache, slot, v[t].to(dtype), block_size)
    empty = qkv.new_empty(0)
    return q_out, empty, empty


def _stand_in_kv(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale=None, c_kv_scale=None,
                 k_rope_offset=None, c_kv_offset=None, epsilon=1e-5, cache_mode="Norm", is_output_kv=False):
    B, one, S, hidden = kv.shape
    dtype = kv.dtype
    assert one == 1 and hidden == 576 and dtype in (torch.float16, BF16) and cache_mode in ("PA", "PA_BNSD", "PA_NZ")
    assert tuple(gamma.shape) == (512,) and gamma.dtype == dtype
    assert tuple(cos.shape) == tuple(sin.shape) == (B, 1, S, 64) and cos.dtype == sin.dtype == dtype
    assert index.dtype == torch.int64 and tuple(index.shape) == (B * S,)
    blocks, block_size = k_cache.shape[:2]
    assert tuple(k_cache.shape) == (blocks, block_size, 1, 64)
    assert tuple(ckv_cache.shape) == (blocks, block_size, 1, 512)
    assert k_cache.dtype == ckv_cache.dtype == dtype and k_cache.is_contiguous() and ckv_cache.is_contiguous()
    assert k_rope_scale is None and c_kv_scale is None and k_rope_offset is None and c_kv_offset is None
    CALLS.append(("kv", kv.data_ptr(), cache_mode, epsilon))
    x = kv.float().reshape(B * S, 576)
    y = _rms(x[:, :512], gamma, epsilon).to(dtype)
    rope = x[:, 512:]
    x1, x2 = rope[:, 0::2], rope[:, 1::2]
    c, s = cos.float().reshape(-1, 64), sin.float().reshape(-1, 64)
    k = (torch.cat((x1, x2), -1) * c + torch.cat((-x2, x1), -1) * s).to(dtype)
    for t, slot in enumerate(index.tolist()):
        if slot < 0:
            continue
        if cache_mode == "PA_NZ":
            _nz_row(k_cache, slot, k[t], block_size)
            _nz_row(ckv_cache, slot, y[t], block_size)
        else:
            k_cache.view(-1, 64)[slot] = k[t]
            ckv_cache.view(-1, 512)[slot] = y[t]
    empty = kv.new_empty(0)
    return k_cache, ckv_cache, empty, empty


_lib.impl("npu_qkv_rms_norm_rope_cache", _stand_in_qkv, "CompositeExplicitAutograd")
_lib.impl("npu_kv_rmsnorm_rope_cache", _stand_in_kv, "CompositeExplicitAutograd")


@pytest.fixture
def npu_on_cpu(monkeypatch):
    """The bridge serving CPU tensors through the stand-ins."""
    monkeypatch.setattr(bridge, "OP_NAMESPACE", NS)
    monkeypatch.setitem(kv_cache_op.CACHE_KERNELS.kernels, "cpu", DeviceKernel(bridge.serve))
    CALLS.clear()
    bridge.stats.clear()


def _random_bytes(shape: tuple, dtype: torch.dtype = BF16) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return t


def _vllm_tables(rows: int, width: int, dtype: torch.dtype = BF16) -> tuple:
    ang = torch.rand(rows, width, dtype=torch.float64) * 6
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _through_both(monkeypatch, args: list, kw: dict, cache_at=(5, 6)) -> tuple:
    """(bridge's q, caches; the reference's q, caches) on clones of one call's caches."""
    caches = [args[i] for i in cache_at if args[i] is not None]
    theirs = [c.clone() for c in caches]
    out = rope_fusion.apply_rotary_qk_kv_cache(*args, **kw)
    monkeypatch.delitem(kv_cache_op.CACHE_KERNELS.kernels, "cpu")
    ref_args = list(args)
    for i, c in zip([i for i in cache_at if args[i] is not None], theirs):
        ref_args[i] = c
    want = rope_fusion.apply_rotary_qk_kv_cache(*ref_args, **kw)
    return out, caches, want, theirs


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Byte for byte, or one bf16 rounding apart (the stand-ins' and the reference's fp32 arithmetic)."""
    differ = got.view(torch.int16) != want.view(torch.int16)
    if differ.any():
        g, w = got[differ].float(), want[differ].float()
        assert ((g - w).abs() <= w.abs() * 2 ** -7 + 1e-30).all(), (g - w).abs().max()


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # random bytes hold NaNs


def _qkv_call(packed: bool, T: int = 5) -> tuple:
    nq, nk, D = 2, 1, 128
    qkv = torch.randn(T, (nq + 2 * nk) * D).to(BF16)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([nq * D, nk * D, nk * D], dim=-1))
    if not packed:
        q, k, v = q.clone(), k.clone(), v.clone()
    cos, sin = _vllm_tables(64, D // 2)
    caches = [_random_bytes((3, nk * D // 16, 16, 16)) for _ in range(2)]
    kw = dict(positions=torch.randint(0, 64, (T,)), norm="rms", norm_eps=1e-5, kv_layout="NZ",
              q_norm_weight=(1 + 0.1 * torch.randn(D)).to(BF16), k_norm_weight=(1 + 0.1 * torch.randn(D)).to(BF16))
    return [q, k, v, cos, sin, *caches, torch.tensor([3, -1, 40, 17])], kw, qkv


@pytest.mark.parametrize("packed", [True, False], ids=["views of one qkv", "separate tensors"])
def test_qkv_rms_norm_rope_cache(npu_on_cpu, monkeypatch, packed):
    """Qwen3's QK-norm, NeoX D=128, NZ caches: one npu_qkv_rms_norm_rope_cache, q, k, v passed as the qkv they are
    views of (no copy) or concatenated; a padding slot and a token past slot_mapping write nothing."""
    args, kw, qkv = _qkv_call(packed)
    out, caches, want, ref_caches = _through_both(monkeypatch, args, kw)
    assert bridge.stats == {"qkv_rms_norm_rope_cache": 1}
    (_, ptr, size, heads, eps), = CALLS
    assert (ptr == qkv.data_ptr()) == packed and size == (5, 1, 4, 128) and heads == (2, 1, 1) and eps == 1e-5
    _same(out, want)
    for got, ref in zip(caches, ref_caches):
        _same(got, ref)


def _mla_call(layout: str, T: int = 4) -> tuple:
    H, NOPE, ROPE, RANK = 2, 128, 64, 512
    kv = torch.randn(T, RANK + ROPE).to(BF16)
    v, k = kv[:, :RANK], kv[:, RANK:]  # MLA's latent and k_pe, views of kv_a_proj's output
    q = torch.randn(T, H, NOPE + ROPE).to(BF16)
    cos, sin = _vllm_tables(64, ROPE // 2)
    if layout == "NHD":
        caches = [_random_bytes((2, 16, 1, d)) for d in (ROPE, RANK)]
    else:
        caches = [_random_bytes((2, d // 16, 16, 16)) for d in (ROPE, RANK)]
    kw = dict(positions=torch.randint(0, 64, (T,)), interleaved=True, deinterleave=True, rotary_dim=ROPE,
              rotary_offset=NOPE, offset_q_only=True, kv_layout=layout, norm_eps=1e-6,
              v_norm_weight=(1 + 0.1 * torch.randn(RANK)).to(BF16))
    return [q, k, v, cos, sin, *caches, torch.tensor([5, -1, 30, 0])], kw, kv


@pytest.mark.parametrize("layout,mode", [("NHD", "PA_BNSD"), ("NZ", "PA_NZ")])
def test_kv_rmsnorm_rope_cache(npu_on_cpu, monkeypatch, layout, mode):
    """DeepSeek's MLA with its own k_pe and latent caches: the latent normalised, k_pe's interleaved pairs rotated
    into NeoX order, by one npu_kv_rmsnorm_rope_cache over the kv they are views of; q by the op's rotary."""
    args, kw, kv = _mla_call(layout)
    out, caches, want, ref_caches = _through_both(monkeypatch, args, kw)
    assert bridge.stats == {"kv_rmsnorm_rope_cache": 1}
    (_, ptr, cache_mode, eps), = CALLS
    assert ptr == kv.data_ptr() and cache_mode == mode and eps == 1e-6
    _same(out, want)
    for got, ref in zip(caches, ref_caches):
        _same(got, ref)


def _nhd_caches(args: list, kw: dict) -> None:
    kw["kv_layout"] = "NHD"
    args[5], args[6] = (_random_bytes((3, 16, 1, 128)) for _ in range(2))


def _fp32_tables(args: list, kw: dict) -> None:
    args[3], args[4] = args[3].float(), args[4].float()


def _no_qk_norm(args: list, kw: dict) -> None:
    for name in ("norm", "q_norm_weight", "k_norm_weight"):
        kw.pop(name)


def _interleaved(args: list, kw: dict) -> None:
    kw["interleaved"] = True


NEAR_MISSES = [(_nhd_caches, "kv_layout='NZ'"), (_fp32_tables, "one fp16/bf16 dtype"),
               (_no_qk_norm, "the per-head QK-norm"), (_interleaved, "NeoX pairs")]


@pytest.mark.parametrize("change,needs", NEAR_MISSES, ids=[m[0].__name__.strip("_") for m in NEAR_MISSES])
def test_calls_no_op_takes_run_the_reference_logged(npu_on_cpu, monkeypatch, caplog, change, needs):
    """A call outside both ops' constraints runs the reference (its result exactly), and the log line says what
    each op needs."""
    args, kw, _ = _qkv_call(True)
    change(args, kw)
    with caplog.at_level(logging.WARNING, logger="rope_fusion"):
        out, caches, want, ref_caches = _through_both(monkeypatch, args, kw)
    assert bridge.stats == {"reference": 1} and not CALLS
    assert torch.equal(out, want) and all(_bytes_equal(g, r) for g, r in zip(caches, ref_caches))
    assert any(needs in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_mla_joint_cache_is_not_one_the_ops_take(npu_on_cpu, monkeypatch):
    """vLLM's CUDA MLA cache, one [blocks, block_size, 576] tensor: the ops write two caches of their own."""
    args, kw, _ = _mla_call("NHD")
    kw.pop("kv_layout")
    args[5], args[6] = _random_bytes((2, 16, 576)), None
    out, caches, want, ref_caches = _through_both(monkeypatch, args, kw)
    assert bridge.stats == {"reference": 1}
    assert torch.equal(out, want) and _bytes_equal(caches[0], ref_caches[0])
