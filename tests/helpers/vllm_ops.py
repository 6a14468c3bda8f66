"""Stand-ins for vLLM's CUDA rotary ops, registered with the real schemas in test namespaces that
`vllm_op_sites.VLLM_C_NAMESPACE` / `VLLM_NAMESPACE` are pointed at: `_C.rotary_embedding` (a CUDA extension) and
the flashinfer op (registered as vLLM registers it). Each computes what the CUDA kernel computes, addressing
included, so the graphs the pass reads and the values it must reproduce are vLLM's."""

from __future__ import annotations

import pytest
import torch

from rope_fusion.passes.kernel_sites import vllm_op_sites as vos

C_NS, V_NS = "rope_fusion_test_vllm_C", "rope_fusion_test_vllm"
C_SCHEMA = ("rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
            "bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()")


def rotate_lanes(lanes: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """fp32 pair rotation of lanes [..., R] with cos/sin [..., R/2] (the CUDA kernels' per-pair math)."""
    r = lanes.shape[-1]
    x = lanes.float()
    a, b = (x[..., : r // 2], x[..., r // 2:]) if is_neox else (x[..., 0::2], x[..., 1::2])
    oa, ob = a * cos - b * sin, b * cos + a * sin
    return torch.cat((oa, ob), -1) if is_neox else torch.stack((oa, ob), -1).flatten(-2)


def c_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
    """vLLM csrc/pos_encoding_kernels.cu, addressing included: token t, head h, lane d of a tensor at
    t*stride(positions.dim()-1) + h*head_stride + d, head_stride from QUERY for both tensors."""
    pos = positions.reshape(-1)
    n = pos.numel()
    r = cos_sin_cache.size(1)
    head_stride = query.stride(-2) if query.dim() == positions.dim() + 2 else head_size
    cs = cos_sin_cache[pos].float()
    cos, sin = cs[:, None, : r // 2], cs[:, None, r // 2:]
    if inverse:
        sin = -sin
    for t in (query, key):
        if t is None:
            continue
        heads = t.numel() // n // head_size
        view = t.as_strided((n, heads, head_size), (t.stride(positions.dim() - 1), head_stride, 1),
                            t.storage_offset())
        lanes = view[..., rope_dim_offset: rope_dim_offset + r]
        lanes.copy_(rotate_lanes(lanes, cos, sin, is_neox).to(t.dtype))


def flashinfer_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                                 cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """flashinfer.rope.apply_rope_with_cos_sin_cache_inplace as documented: (nnz, -1, head_size) views, float32
    cache, first R lanes of each head rotated, fp32 math."""
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    r = cos_sin_cache.size(1)
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, : r // 2], cs[:, None, r // 2:]
    for t in (query, key):
        lanes = t.view(t.shape[0], -1, head_size)[..., :r]
        lanes.copy_(rotate_lanes(lanes, cos, sin, is_neox).to(t.dtype))


@pytest.fixture(scope="module")
def vllm_ops():
    from torch.library import infer_schema

    libs = [torch.library.Library(C_NS, "FRAGMENT"), torch.library.Library(V_NS, "FRAGMENT")]
    libs[0].define(C_SCHEMA)
    libs[0].impl("rotary_embedding", c_rotary_embedding, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{C_NS}::rotary_embedding", lambda *a, **k: None, lib=libs[0])
    try:  # how vLLM registers its flashinfer op (vllm/model_executor/layers/rotary_embedding/common.py)
        from vllm.utils.torch_utils import direct_register_custom_op
    except Exception:  # a partial vLLM install: the same steps by hand
        direct_register_custom_op = None
    if direct_register_custom_op is not None:
        direct_register_custom_op("flashinfer_rotary_embedding", flashinfer_rotary_embedding,
                                  mutates_args=["query", "key"], fake_impl=lambda *a, **k: None,
                                  target_lib=libs[1], dispatch_key="CompositeExplicitAutograd")
    else:
        libs[1].define("flashinfer_rotary_embedding" + infer_schema(flashinfer_rotary_embedding,
                                                                    mutates_args=["query", "key"]))
        libs[1].impl("flashinfer_rotary_embedding", flashinfer_rotary_embedding, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{V_NS}::flashinfer_rotary_embedding", lambda *a, **k: None, lib=libs[1])
    saved = vos.VLLM_C_NAMESPACE, vos.VLLM_NAMESPACE
    vos.VLLM_C_NAMESPACE, vos.VLLM_NAMESPACE = C_NS, V_NS
    yield getattr(torch.ops, C_NS).rotary_embedding, getattr(torch.ops, V_NS).flashinfer_rotary_embedding
    vos.VLLM_C_NAMESPACE, vos.VLLM_NAMESPACE = saved
    for lib in libs:
        lib._destroy()



C_CASES = {
    # name: (v2, query shape, key shape or None, dtype, rotary_dim, is_neox, inverse)
    "flat-neox-full-fp32-v1": (False, (7, 4 * 64), (7, 2 * 64), torch.float32, 64, True, False),
    "heads-gptj-partial-inverse-bf16-v2": (True, (7, 4, 64), (7, 2, 64), torch.bfloat16, 32, False, True),
    "flat-query-only-v2": (True, (7, 4 * 64), None, torch.float32, 48, True, False),
}


def c_case_inputs(case: str) -> tuple:
    """(positions, query, key or None, cos|sin cache) of a C_CASES case, seeded."""
    _, qs, kshape, dtype, rd, _, _ = C_CASES[case]
    g = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 32, (7,), generator=g)
    cache = torch.randn(32, rd, generator=g).to(dtype)
    q = torch.randn(qs, generator=g).to(dtype)
    k = torch.randn(kshape, generator=g).to(dtype) if kshape else None
    return pos, q, k, cache



def flashinfer_case(fi_op) -> tuple:
    """(f, pos, q, k, cache, generator): vLLM's flashinfer rotary op in place on a flat q and a [T, H, D] k,
    GPT-J pairs, rotary 32 of 64; the generator goes on where the inputs end."""
    g = torch.Generator().manual_seed(6)
    pos = torch.randint(0, 32, (6,), generator=g, dtype=torch.int32)
    cache = torch.randn(32, 32, generator=g)
    q, k = torch.randn(6, 4 * 64, generator=g).bfloat16(), torch.randn(6, 2, 64, generator=g).bfloat16()

    def f(pos, q, k, cache):
        fi_op(pos, q, k, 64, cache, False)
        return q + 0, k + 0

    return f, pos, q, k, cache, g
