"""`rope_fusion.apply_rotary_qk_kv_cache` (ops/kv_cache*.py): q rotated, k rotated and v written into a paged KV
cache at slot_mapping, in one call.

Each case runs twice on the CPU: through the reference (no device kernel), and through the Triton kernel's KV_CACHE
form run by Triton's interpreter (tests/helpers/triton_interpreted.py, as tests/passes/test_cat_pieces.py runs the
kernel). Both are checked against an fp64 evaluation of the rotation on fresh random inputs (the op's reference on fp64
inputs) and an independent reading of the cache: every written slot holds its token's rows (k rotated, v copied, each
rounded once into the cache's dtype; an FP8 cache within half an e4m3 step of x / scale, saturated at 448), and every
byte of every other slot, of a cache filled with random bytes first, is as it was (padding slots -1, tokens past
slot_mapping). The cases cover every option of the rotary schema at least once, GQA, both strided layouts and
Ascend's NZ (the reference's; the kernel declines it, logged), FP8 caches, packed sequences and MLA's one cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rope_fusion
from rope_fusion.ops import kv_cache_op
from rope_fusion.ops.cache_layouts import nz_run
from rope_fusion.ops.reference import rotary_reference
from rope_fusion.ops.schema import RotaryParams

FP8 = torch.float8_e4m3fn
MAX_POS = 32


pytestmark = pytest.mark.triton_on_cpu(serves=("kv_cache",))  # the `triton` path: the KV-cache op's kernel


@pytest.fixture(params=["reference", "triton"])
def path(request):
    """The op's CPU path: the reference, or the Triton kernel interpreted (its `tl.sum` too) serving CPU tensors."""
    if request.param == "triton":
        request.getfixturevalue("triton_on_cpu")
    return request.param


@dataclasses.dataclass
class Case:
    """One call's geometry and options; what is not said is plain NeoX on bf16 tensors and an NHD bf16 cache."""

    name: str
    hq: int = 4
    hk: int = 2
    d: int = 16
    dq: int | None = None  # q's head dim where it differs from k's (MLA's nope + rope)
    hv: int | None = None  # v's heads (k's when None)
    dv: int | None = None  # v's head dim (d when None)
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None  # the model dtype when None
    layout: str = "NHD"
    tables: str = "positions"  # positions as [T], "positions2d" [T, 1], "plain" [T, 1, W], "packed" cu_seqlens
    options: dict = dataclasses.field(default_factory=dict)
    qk_norm_weights: bool = False
    v_norm: bool = False
    scales: tuple | None = None  # (k_scale, v_scale) of FP8 caches
    mla: bool = False  # MLA's one cache [blocks, block_size, dv + d]: v_cache=None
    slots: tuple = (3, -1, 7, 1, 10)  # one per token, 5 tokens; fewer: the tokens after them write nothing
    tokens: int = 5
    slot_dtype: torch.dtype = torch.int64
    packed_qkv: bool = False  # q, k and v as views of one [T, (Hq + Hk + Hv) * D] projection (vLLM's qkv.split)


CASES = [
    Case("neox mha positions", hq=2, hk=2),
    Case("gqa interleaved conjugate hnd fp32", dtype=torch.float32, layout="HND", tables="positions2d",
         options=dict(interleaved=True, conjugate=True)),
    Case("partial full tables fp16", dtype=torch.float16, tables="plain", options=dict(rotary_dim=8, full_tables=True)),
    Case("qk rms norm weights out fp32", options=dict(norm="rms", out_dtype=torch.float32), qk_norm_weights=True),
    Case("norm across heads eps", dtype=torch.float32, options=dict(norm="rms_across_heads", norm_eps=1e-5)),
    Case("rotary blocks", dtype=torch.float32, options=dict(rotary_blocks=2)),
    Case("angle tables", dtype=torch.float32, tables="plain", options=dict(angle_tables=True, interleaved=True)),
    Case("fp8 caches nhd saturating", cache_dtype=FP8, scales=(0.004, 0.07)),  # k past 448: saturated
    Case("fp8 caches hnd no scale", cache_dtype=FP8, layout="HND", options=dict(interleaved=True)),
    Case("packed sequences", tables="packed"),
    Case("slots past the mapping", slots=(5, -1, 2)),
    Case("v of its own head dim and heads", hv=3, dv=8),
    Case("mla joint cache", hq=4, hk=1, hv=1, d=8, dq=24, dv=32, mla=True, v_norm=True,
         options=dict(interleaved=True, deinterleave=True, rotary_offset=16, offset_q_only=True, full_tables=True)),
    Case("mla joint cache fp8", hq=2, hk=1, hv=1, d=8, dq=8, dv=16, mla=True, cache_dtype=FP8, scales=(0.05, 0.05)),
    Case("nz layout", layout="NZ"),
    Case("head dim 80 int32 slots", d=80, slot_dtype=torch.int32, options=dict(norm="rms")),
    Case("views of one qkv", packed_qkv=True, layout="HND", options=dict(interleaved=True)),
]


@dataclasses.dataclass
class Inputs:
    args: tuple
    kwargs: dict
    positions: torch.Tensor  # [T, 1]: each token's table row, derived here independently of the op
    caches: list  # (name, cache, scale, the first lane of its rows in MLA's entry)


def _tables(case: Case, width: int, T: int) -> tuple:
    rows = T if case.tables == "plain" else MAX_POS
    ang = torch.rand(rows, width, dtype=torch.float64) * 6.0
    if case.options.get("angle_tables"):
        cos, sin = ang.float(), ang.float()
    else:
        cos, sin = ang.cos().float(), ang.sin().float()
    if case.tables == "plain":
        return cos[:, None], sin[:, None]
    return cos, sin


def make_inputs(case: Case) -> Inputs:
    T = case.tokens
    d, dq = case.d, case.dq or case.d
    hv, dv = case.hv or case.hk, case.dv or case.d
    r = case.options.get("rotary_dim", d)
    width = r if case.options.get("full_tables") else r // 2
    if case.packed_qkv:
        qkv = torch.randn(T, (case.hq + case.hk + hv) * d, dtype=case.dtype)
        q, k, v = (t.view(T, -1, d) for t in qkv.split([case.hq * d, case.hk * d, hv * d], dim=-1))
    else:
        q = torch.randn(T, case.hq, dq, dtype=case.dtype)
        k = torch.randn(T, case.hk, d, dtype=case.dtype)
        v = torch.randn(T, hv, dv, dtype=case.dtype)
    cos, sin = _tables(case, width, T)
    kw = dict(case.options)
    positions = torch.randint(0, MAX_POS, (T,))
    if case.tables in ("positions", "positions2d"):
        kw["positions"] = positions if case.tables == "positions" else positions[:, None]
    elif case.tables == "packed":  # two sequences, [0, 2) and [2, 5), first rows 1 and 6
        cu, off = torch.tensor([0, 2, 5]), torch.tensor([1, 6])
        kw.update(cu_seqlens=cu, seqlen_offsets=off)
        positions = torch.tensor([1, 2, 6, 7, 8])
    else:
        positions = torch.arange(T)
    if case.qk_norm_weights:
        kw.update(q_norm_weight=1 + 0.1 * torch.randn(dq), k_norm_weight=1 + 0.1 * torch.randn(d))
    if case.v_norm:
        kw["v_norm_weight"] = 1 + 0.1 * torch.randn(dv)
    cdt = case.cache_dtype or case.dtype
    nb, bs = 3, 4
    scale = tuple(torch.tensor([x]) for x in case.scales) if case.scales else (None, None)
    if case.mla:
        kv = _random_bytes((nb, bs, dv + d), cdt)
        caches = [("k", kv, scale[0], dv), ("v", kv, scale[0], 0)]
        k_cache, v_cache = kv, None
        if case.scales:
            kw["k_scale"] = scale[0]
        k, v = k[:, 0], v[:, 0]  # MLA's k_pe [T, rope] and latent [T, rank]
    else:
        k_cache = _random_bytes(_cache_shape(case.layout, nb, bs, case.hk, d, cdt), cdt)
        v_cache = _random_bytes(_cache_shape(case.layout, nb, bs, hv, dv, cdt), cdt)
        caches = [("k", k_cache, scale[0], 0), ("v", v_cache, scale[1], 0)]
        kw["kv_layout"] = case.layout
        if case.scales:
            kw.update(k_scale=scale[0], v_scale=scale[1])
    slots = torch.tensor(case.slots, dtype=case.slot_dtype)
    args = (q, k, v, cos, sin, k_cache, v_cache, slots)
    return Inputs(args, kw, positions[:, None], caches)


def _cache_shape(layout: str, nb: int, bs: int, heads: int, dim: int, dtype: torch.dtype) -> tuple:
    if layout == "NHD":
        return nb, bs, heads, dim
    if layout == "HND":
        return nb, heads, bs, dim
    run = nz_run(dtype)
    return nb, heads * dim // run, bs, run


def _random_bytes(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return t


def _slot_view(cache: torch.Tensor, layout: str, mla: bool, b: int, o: int) -> torch.Tensor:
    """The slot's region of the cache, read by the layout's definition (not the op's records)."""
    if mla:
        return cache[b, o]
    if layout == "NHD":
        return cache[b, o]
    if layout == "HND":
        return cache[b, :, o]
    return cache[b, :, o, :]


def fp64_expected(case: Case, inp: Inputs) -> tuple:
    """(q rotated, k rotated, v as cached before rounding), each in fp64, from the op's reference on fp64 inputs."""
    q, k, v, cos, sin = inp.args[:5]
    kw = inp.kwargs
    opts = {n: v2 for n, v2 in case.options.items()}
    r = opts.pop("rotary_dim", case.d)
    params = RotaryParams(interleaved=opts.pop("interleaved", False), rotary_dim=r,
                          full_tables=opts.pop("full_tables", False), conjugate=opts.pop("conjugate", False),
                          out_dtype=torch.float64, **{n: v2 for n, v2 in opts.items() if n != "out_dtype"})
    k3 = k if k.dim() == 3 else k[:, None]
    v3 = v if v.dim() == 3 else v[:, None]
    positions = None if case.tables == "plain" else inp.positions
    c64, s64 = cos.double(), sin.double()

    def rotate(x, i, weight):
        w = None if weight is None else weight.double()
        return rotary_reference(x.double(), c64, s64, positions=positions, norm_weight=w,
                                **params.of_tensor(i).kwargs())
    q64 = rotate(q, 0, kw.get("q_norm_weight"))
    k64 = rotate(k3, 1, kw.get("k_norm_weight"))
    v64 = v3.double()
    if case.v_norm:
        w = kw["v_norm_weight"].double()
        v64 = v64 * torch.rsqrt(v64.pow(2).mean(-1, keepdim=True) + params.norm_eps) * w
    return q64, k64, v64


def _e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values around |x| (subnormal spacing 2^-9 below 2^-6)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6)))
    return torch.exp2(e - 3)


def check_rows(got: torch.Tensor, want64: torch.Tensor, scale: torch.Tensor | None, what: str) -> None:
    """Rows as a cache (or output) of got's dtype holds them: an FP8 value within half an e4m3 step of want / scale
    (saturated), others within one rounding of their dtype (Triton's interpreter truncates bf16), plus fp32 math."""
    eps32 = torch.finfo(torch.float32).eps
    if got.dtype == FP8:
        want = (want64 / (scale.double() if scale is not None else 1.0)).clamp(-448.0, 448.0)
        err = (got.double() - want).abs()
        bound = 0.5 * _e4m3_step(want) + 8 * eps32 * want.abs().max() + 1e-12
    else:
        want = want64
        err = (got.double() - want).abs()
        bound = 2 * torch.finfo(got.dtype).eps * want.abs() + 8 * eps32 * want.abs().max() + 1e-12
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3g} (max error {err.max().item():.3g})"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_option_against_fp64(path, case):
    torch.manual_seed(hash(case.name) % 1000)
    inp = make_inputs(case)
    distinct = {id(c): c for _, c, *_ in inp.caches}  # MLA's two entries share one cache
    before = {i: c.view(torch.uint8).clone() for i, c in distinct.items()}
    out = rope_fusion.apply_rotary_qk_kv_cache(*inp.args, **inp.kwargs)
    q64, k64, v64 = fp64_expected(case, inp)
    out_dtype = case.options.get("out_dtype", case.dtype)
    assert out.shape == inp.args[0].shape and out.dtype == out_dtype
    check_rows(out, q64, None, "q")
    written = {i: torch.zeros_like(b, dtype=torch.bool) for i, b in before.items()}
    for t, s in enumerate(case.slots):
        if s < 0:
            continue
        b, o = divmod(s, 4)
        for name, cache, scale, lane0 in inp.caches:
            want = k64[t] if name == "k" else v64[t]
            region = _slot_view(cache, case.layout, case.mla, b, o)
            mask = _slot_view(written[id(cache)].view(*cache.shape, -1), case.layout, case.mla, b, o)
            if case.mla:  # one head: the entry's lanes of this tensor
                rows = region[lane0:lane0 + want.shape[-1]][None]
                mask[lane0:lane0 + want.shape[-1]] = True
            else:
                rows = region.reshape(want.shape)
                mask[...] = True
            check_rows(rows, want, scale, f"{name} of token {t} in slot {s}")
    for i, cache in distinct.items():
        now, was, w = cache.view(torch.uint8), before[i], written[i]
        assert w.any() and torch.equal(now[~w], was[~w]), "a byte outside the written slots moved"


def _plain(T: int = 4, hq: int = 4, hk: int = 2, d: int = 16, dtype: torch.dtype = torch.float32,
           cache_dtype: torch.dtype | None = None, blocks: int = 3, block_size: int = 4) -> list:
    """A plain NeoX call's positional arguments: q, k, v, the cos|sin halves, NHD caches and one slot per token."""
    cos, sin = _tables(Case("plain", tables="plain"), d // 2, T)
    cdt = cache_dtype or dtype
    q, k, v = (torch.randn(T, h, d, dtype=dtype) for h in (hq, hk, hk))
    caches = [torch.zeros(blocks, block_size, hk, d, dtype=cdt) for _ in range(2)]
    return [q, k, v, cos, sin, *caches, torch.arange(T) * 2]


def _replaced(args: list, **by_name) -> list:
    names = ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slot_mapping")
    return [by_name.get(n, a) for n, a in zip(names, args)]


ERRORS = [
    ("layout", {}, dict(kv_layout="XYZ"), ValueError, "kv_layout='XYZ'"),
    ("scale of a float cache", {}, dict(k_scale=torch.tensor([1.0])), ValueError, "a scale applies to an FP8 cache"),
    ("uint8 cache", dict(k_cache=torch.zeros(3, 4, 2, 16, dtype=torch.uint8)), {}, ValueError,
     r"view\(torch.float8_e4m3fn\)"),
    ("cache heads", dict(k_cache=torch.zeros(3, 4, 3, 16)), {}, ValueError, "does not hold k's 2 heads of 16"),
    ("float slots", dict(slot_mapping=torch.zeros(4)), {}, ValueError, "slot_mapping must be a 1-D int32/int64"),
    ("more slots than tokens", dict(slot_mapping=torch.arange(5)), {}, ValueError, "holds 5 slots for 4 tokens"),
    ("unknown option", {}, dict(block_table=None), TypeError, "unknown option"),
    ("v's dtype", dict(v=torch.randn(4, 2, 16, dtype=torch.float16)), {}, ValueError, "v is torch.float16"),
    ("blocks differ", dict(v_cache=torch.zeros(2, 4, 2, 16)), {}, ValueError, "share \\(num_blocks, block_size\\)"),
    ("mla cache width", dict(v_cache=None), {}, ValueError, "kv_cache must be MLA's"),
    ("fp8 scale dtype", dict(k_cache=torch.zeros(3, 4, 2, 16, dtype=FP8)), dict(k_scale=torch.tensor([1.0]).double()),
     ValueError, "float32 tensor of one element"),
    ("q rank", dict(q=torch.randn(4, 1, 4, 16)), {}, ValueError, r"q must be \[tokens, heads, head_dim\]"),
]


@pytest.mark.parametrize("by_name,options,error,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_arguments_raise_naming_them(by_name, options, error, match):
    args = _replaced(_plain(), **by_name)
    caches = [c.clone() for c in args[5:7] if c is not None]
    with pytest.raises(error, match=match):
        rope_fusion.apply_rotary_qk_kv_cache(*args, **options)
    assert all(torch.equal(c.view(torch.uint8), b.view(torch.uint8)) for c, b in zip(
        [c for c in args[5:7] if c is not None], caches)), "a cache was written by a call that raised"


def test_slot_past_the_cache_raises(path):
    """A slot past num_blocks * block_size: the reference raises IndexError before writing; the kernel's device
    assert (compiled into its direct launches, here the interpreter's with asserts on) fails, and its store is masked
    where asserts are off, so nothing is written out of bounds either way."""
    args = _replaced(_plain(), slot_mapping=torch.tensor([0, 12, 2, 3]))
    before = [c.clone() for c in args[5:7]]
    if path == "reference":
        with pytest.raises(IndexError, match="slot 12 is outside the cache's 3 blocks of 4 slots"):
            rope_fusion.apply_rotary_qk_kv_cache(*args)
        assert all(torch.equal(c, b) for c, b in zip(args[5:7], before))
        return
    import dataclasses as dc

    import triton.runtime.interpreter as interpreter

    builder = interpreter.interpreter_builder
    plain = builder.options
    builder.options = dc.replace(plain, debug=True)
    try:
        with pytest.raises(Exception, match="a slot outside the KV cache's blocks"):
            rope_fusion.apply_rotary_qk_kv_cache(*args)
    finally:
        builder.options = plain
    out = rope_fusion.apply_rotary_qk_kv_cache(*args)  # asserts off: the bad slot's rows are not stored
    assert out.shape == args[0].shape
    written = args[5].view(-1, 2, 16)
    assert torch.count_nonzero(written[[1, 4, 5, 7, 8, 9, 10, 11]]) == 0  # only slots 0, 2 and 3 were written


def test_kernel_plans_a_geometry_once(path, monkeypatch):
    """Repeated calls of one geometry plan once, and each call writes its own tensors."""
    if path != "triton":
        pytest.skip("the kernel's plan cache")
    from rope_fusion.kernels import triton_kv_cache

    planned = []
    real = triton_kv_cache.plan_cache_launch
    monkeypatch.setattr(triton_kv_cache, "plan_cache_launch", lambda cc: planned.append(1) or real(cc))
    for _ in range(3):
        args = _plain(T=3, hq=3, hk=1, d=24)  # a geometry no other test launches
        out = rope_fusion.apply_rotary_qk_kv_cache(*args)
        q, k, v, cos, sin, kc, vc, slots = args
        kw = dict(interleaved=False, rotary_dim=24, full_tables=False)
        torch.testing.assert_close(out, rotary_reference(q, cos, sin, **kw))
        torch.testing.assert_close(kc.view(-1, 1, 24)[slots], rotary_reference(k, cos, sin, **kw))
        assert torch.equal(vc.view(-1, 1, 24)[slots], v)
    assert len(planned) == 1


def test_kernel_declines_the_nz_layout():
    """The NZ layout is no stride per axis: the kernel says so, and the reference writes it (the cases above)."""
    pytest.importorskip("triton")
    from rope_fusion.kernels import triton_kv_cache
    from rope_fusion.ops.kv_cache import parse_separate

    inp = make_inputs(Case("nz", layout="NZ"))
    kw = {**inp.kwargs}
    positions = kw.pop("positions")
    args = (*inp.args, positions, None, None, None, None, None, None, None)
    cc = parse_separate(args, dict(interleaved=False, rotary_dim=16, full_tables=False, conjugate=False,
                                   out_dtype=torch.bfloat16, kv_layout="NZ"))
    assert triton_kv_cache.why_not(cc) == "the NZ layout is not a stride per axis"


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_on_the_cpu_writes_the_caches_in_place(backend):
    """Under torch.compile the call is the op, auto_functionalized; the compiled graph writes the caches given as
    inputs (Inductor's reinplacing, or the functional graph's copy back into the mutated inputs)."""
    def step(q, k, v, cos, sin, kc, vc, slots, positions):
        return rope_fusion.apply_rotary_qk_kv_cache(q, k, v, cos, sin, kc, vc, slots, positions=positions) * 2

    torch.manual_seed(3)
    args = _plain(T=4)
    cache = torch.rand(MAX_POS, 16, dtype=torch.float64) * 6
    args[3], args[4] = cache[:, :8].cos().float(), cache[:, :8].sin().float()
    positions = torch.randint(0, MAX_POS, (4,))
    eager = [a.clone() for a in args]
    want = step(*eager, positions)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend=backend)(*args, positions)
    torch.testing.assert_close(got, want)
    assert torch.equal(args[5], eager[5]) and torch.equal(args[6], eager[6]) and args[5].count_nonzero() > 0


def test_fake_tensors_give_q_rotated_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _plain(dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(a) for a in args]
        out = rope_fusion.apply_rotary_qk_kv_cache(*fake, out_dtype=torch.float32)
    assert out.shape == args[0].shape and out.dtype == torch.float32


def test_not_differentiable():
    """A cache write is inference: a call that would record a gradient raises, naming the op; under no_grad it runs."""
    args = _plain()
    args[0].requires_grad_()
    with pytest.raises(RuntimeError, match="rotary_qk_kv_cache is not differentiable"):
        rope_fusion.apply_rotary_qk_kv_cache(*args)
    assert torch.count_nonzero(args[5]) == 0
    with torch.no_grad():
        out = rope_fusion.apply_rotary_qk_kv_cache(*args)
    assert not out.requires_grad and torch.count_nonzero(args[5]) > 0


@pytest.fixture(scope="module")
def vllm_rope():
    """vLLM 0.33's own rotary layer (`get_rope`), built on the CPU."""
    import types

    try:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
    except Exception as e:  # missing vLLM or its Python deps
        pytest.skip(f"vLLM's rotary layers are not importable here: {type(e).__name__}: {e}")
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.model_config = types.SimpleNamespace(max_model_len=MAX_POS)

    def make(head_size: int, neox: bool, dtype: torch.dtype):
        with set_current_vllm_config(cfg):
            return get_rope(head_size, max_position=MAX_POS, is_neox_style=neox, dtype=dtype)
    return make


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_compat_vllm_rotary_embedding_writes_the_cache(path, vllm_rope, neox, kv_cache_dtype):
    """`compat.vllm.rotary_embedding(..., value=, k_cache=, v_cache=, slot_mapping=)` against vLLM's unfused pair:
    its layer's `forward_native`, then an index_put of k and v into the cache rows of their slots. q within the
    numerics contract of the pair's own result; the caches within one rounding of the fp64 pair (an FP8 cache: half
    an e4m3 step of x / scale); key left as it was (its rotation lives in the cache)."""
    from rope_fusion.compat import vllm as compat_vllm
    from tests.helpers.numerics import check_numerics

    D, T, HQ, HK, BLOCKS, BS = 32, 5, 4, 2, 3, 4
    layer = vllm_rope(D, neox, torch.bfloat16)
    torch.manual_seed(5)
    positions = torch.randint(0, MAX_POS, (T,))
    query, key, value = (torch.randn(T, h * D).bfloat16() for h in (HQ, HK, HK))
    slots = torch.tensor([3, 7, 1, 10, 4])

    def unfused(p, q, k, v):
        q2, k2 = layer.forward_native(p, q, k)
        k_cache, v_cache = (torch.zeros(BLOCKS * BS, HK, D, dtype=q.dtype) for _ in range(2))
        k_cache[slots] = k2.view(T, HK, D)
        v_cache[slots] = v.view(T, HK, D)
        return q2, k_cache, v_cache

    fp8 = kv_cache_dtype == "fp8"
    cdt = torch.uint8 if fp8 else torch.bfloat16  # vLLM keeps an FP8 cache as bytes
    k_cache, v_cache = (torch.zeros(BLOCKS, BS, HK, D, dtype=cdt) for _ in range(2))
    scales = (torch.tensor(0.02), torch.tensor(0.03))
    q, k = query.clone(), key.clone()
    ret = compat_vllm.rotary_embedding(positions, q, k, D, layer._match_cos_sin_cache_dtype(query), neox, value=value,
                                       k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                                       kv_cache_dtype=kv_cache_dtype, k_scale=scales[0], v_scale=scales[1])
    assert ret is None and torch.equal(k, key)
    got = (q, *(c.view(torch.float8_e4m3fn) if fp8 else c for c in (k_cache, v_cache)))
    if not fp8:
        check_numerics(unfused, (positions, query, key, value), (got[0], *(c.view(-1, HK, D) for c in got[1:])))
        return
    check_numerics(lambda p, q, k, v: unfused(p, q, k, v)[0], (positions, query, key, value), got[0])
    want = unfused(positions, query.double(), key.double(), value.double())
    for cache, want64, scale in zip(got[1:], want[1:], scales):
        check_rows(cache.view(-1, HK, D)[slots], want64[slots], scale.reshape(1), "cache")


def test_a_dynamic_token_count_compiles_once():
    """vLLM compiles with a symbolic token count: the op's checks decide what they can without a guard, and one graph
    serves every count, writing the caches each call gives it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(q, k, v, cos, sin, kc, vc, slots, positions):
        return rope_fusion.apply_rotary_qk_kv_cache(q, k, v, cos, sin, kc, vc, slots, positions=positions)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, dynamic=True, fullgraph=True)
    cos, sin = _tables(Case("dynamic"), 8, 0)
    for T in (3, 5, 9):
        args = _plain(T=T, blocks=8)
        args[3], args[4] = cos, sin
        args[7] = torch.randperm(32)[:T]
        positions = torch.randint(0, MAX_POS, (T,))
        eager = [a.clone() for a in args]
        torch.testing.assert_close(compiled(*args, positions), step(*eager, positions))
        assert torch.equal(args[5], eager[5]) and torch.equal(args[6], eager[6])
    assert counter.frame_count == 1


def test_a_cache_of_other_strides(path, monkeypatch):
    """An NHD cache whose memory is head-major (vLLM's HND order viewed as NHD): the kernel writes through the
    strides what the reference writes."""
    torch.manual_seed(11)
    args = _plain(T=5, hq=4, hk=2, d=16, dtype=torch.bfloat16)
    caches = [_random_bytes((3, 2, 4, 16), torch.bfloat16).transpose(1, 2) for _ in range(2)]  # [blocks, 4, 2, 16]
    theirs = [c.clone() for c in caches]
    args[5:7] = caches
    args[7] = torch.tensor([0, 9, -1, 4, 11])
    out = rope_fusion.apply_rotary_qk_kv_cache(*args)
    if path == "triton":
        monkeypatch.delitem(kv_cache_op.CACHE_KERNELS.kernels, "cpu")
    want = rope_fusion.apply_rotary_qk_kv_cache(*args[:5], *theirs, args[7])
    torch.testing.assert_close(out, want, rtol=2 ** -7, atol=2 ** -7)
    for got, ref in zip(caches, theirs):
        differ = got.view(torch.int16) != ref.view(torch.int16)
        assert differ.sum() <= 0.2 * differ.numel() and ((got[differ].float() - ref[differ].float()).abs()
                                                           <= ref[differ].float().abs() * 2 ** -7).all()


HELD = [Case("held rows d80 fp8", d=80, hq=2, hk=2, tokens=6, slots=(3, -1, 7, 1, 10, 2), cache_dtype=FP8,
             scales=(0.05, 0.05), options=dict(norm="rms")),
        Case("held across heads", hq=3, hk=3, tokens=6, slots=(3, -1, 7, 1, 10, 2), dtype=torch.float32,
             options=dict(norm="rms_across_heads"))]


@pytest.mark.parametrize("case", HELD, ids=[c.name for c in HELD])
def test_held_rows_write_the_cache(path, case, monkeypatch):
    """The kernel's held form (a token's head rows in registers under a norm, one program a token) writes k's rows
    into the cache as its head loop does: six tokens count as many programs here."""
    if path == "triton":
        import rope_fusion.kernels.triton_plan as planner

        monkeypatch.setattr(planner, "MIN_PROGRAMS", 2)
        from rope_fusion.kernels import triton_kv_cache
        from rope_fusion.ops.kv_cache import parse_separate

        inp = make_inputs(case)
        kw = dict(inp.kwargs)
        scales = (kw.pop("k_scale", None), kw.pop("v_scale", None))
        positions = kw.pop("positions")
        cc = parse_separate((*inp.args, positions, None, None, None, None, *scales, None),
                            dict(interleaved=False, rotary_dim=case.d, full_tables=False, conjugate=False,
                                 out_dtype=case.dtype, **kw))
        plan = triton_kv_cache.plan_cache_launch(cc)
        assert plan.meta["HELD"] > 0 and plan.grid[1] == 1, (plan.meta["HELD"], plan.grid)
    test_every_option_against_fp64(path, case)


def test_the_op_checks_and_plans_a_key_once(path, monkeypatch):
    """Through the dispatcher, as a compiled graph calls it: a call's key is checked and planned on its first call;
    later calls of it (fresh tensors each) are neither, and each writes its own rows and returns its own q. A call
    of another geometry is checked again."""
    from rope_fusion.ops import kv_cache_op

    checks, plans = [], []
    real_check, real_plan = kv_cache_op.check, kv_cache_op.planned_runner
    monkeypatch.setattr(kv_cache_op, "check", lambda cc: checks.append(1) or real_check(cc))
    monkeypatch.setattr(kv_cache_op, "planned_runner", lambda cc: plans.append(1) or real_plan(cc))
    kw = dict(interleaved=False, rotary_dim=24, full_tables=False, conjugate=False, out_dtype=torch.float32)
    for _ in range(3):
        args = _plain(T=3, hq=3, hk=1, d=24)
        with torch.no_grad():
            out = torch.ops.rope_fusion.rotary_qk_kv_cache(*args, **kw)
        q, k, v, cos, sin, kc, vc, slots = args
        ref = {n: kw[n] for n in ("interleaved", "rotary_dim", "full_tables")}
        torch.testing.assert_close(out, rotary_reference(q, cos, sin, **ref))
        torch.testing.assert_close(kc.view(-1, 1, 24)[slots], rotary_reference(k, cos, sin, **ref))
        assert torch.equal(vc.view(-1, 1, 24)[slots], v)
    assert len(checks) == 1 and len(plans) == 1
    with torch.no_grad():
        torch.ops.rope_fusion.rotary_qk_kv_cache(*_plain(T=2, hq=3, hk=1, d=24), **kw)
    assert len(checks) == 2


def test_a_dispatch_mode_sees_the_op_below_autograd():
    """The op's Autograd kernel runs its eager kernel directly only for plain tensors with no dispatch mode: a mode
    (fake tensors, functionalization, a tracer) still sees the call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    kw = dict(interleaved=False, rotary_dim=16, full_tables=False, conjugate=False, out_dtype=torch.float32)
    args = _plain()
    with Seen() as seen:
        out = torch.ops.rope_fusion.rotary_qk_kv_cache(*args, **kw)
    assert "rope_fusion.rotary_qk_kv_cache.default" in seen.ops
    torch.testing.assert_close(out, rotary_reference(args[0], args[3], args[4], interleaved=False, rotary_dim=16,
                                                     full_tables=False))
