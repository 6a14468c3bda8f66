"""Whether the Triton rotary kernel compiles to the same PTX as before a change, checked without a GPU.

Timing the kernel needs the H200; its generated code does not. `triton.compile` builds the PTX of a kernel for a
target named by hand (sm_90 here) on any machine, so a change that should not alter the device code (a refactor of
the kernel into helpers, renamed arguments) can be checked for that on the CPU, and a change that should can be
seen to.

The specialisations are the ones the host planner launches with: each case below calls the public `launch` with
a recording stand-in for the kernel, at the shapes of benchmarks/kernels.py's rows and of the tests' forms (NeoX
and interleaved, partial rotary, a pass-through head, norms per head and across heads, positions into caches,
packed sequences (as positions, and as cu_seqlens searched in the kernel), q/k/v, the held, rows, halves and
head-pass forms, fp32/bf16/fp16/fp64). Each recorded launch is bound and specialised by Triton's own JIT machinery
on the CPU tensors (their alignment and the integer values Triton specialises on are the same as on the GPU), with
the compile options of a direct launch
(`row_checks`: the row assert compiled in where positions are read), then compiled for sm_90.

The baseline holds, per launch, a hash of its specialisation taken by position (argument types, constexpr values,
alignment attributes, options: renaming an argument changes none of it, reordering does) and a hash of its PTX
with debug locations, the kernel's symbol names and the device assert's source file, function and line removed.

    python -m benchmarks.ptx_identity --record benchmarks/ptx_baseline.json   # before the change
    python -m benchmarks.ptx_identity --compare benchmarks/ptx_baseline.json  # after: exit 1 on a difference
    python -m benchmarks.ptx_identity --compare F --dump DIR                  # also write each normalised PTX
    python -m benchmarks.ptx_identity --extend F    # add the launches of new cases to F, its entries kept as they are

Run it without TRITON_INTERPRET (an interpreted kernel has no compiler behind it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks.spellings import SPELLINGS, flux_tables, vllm_cos_sin_cache  # noqa: E402
from rope_fusion.ops.schema import RotaryParams  # noqa: E402

TARGET = ("cuda", 90, 32)
BF16 = torch.bfloat16


@dataclasses.dataclass
class Launch:
    """One kernel launch as the planner made it."""

    case: str
    index: int
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for the kernel in `launch(kernel=...)`: records `kernel[grid](*args, **kwargs)`."""

    def __init__(self) -> None:
        self.calls: list = []

    def __getitem__(self, grid: Any) -> Callable:
        def run(*args: Any, **kwargs: Any) -> None:
            self.calls.append((args, kwargs))
        return run


def _x(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)  # never written: the pages of a large one stay unallocated


def _spelling(code: str, B: int, S: int, hq: int, hk: int, D: int, dtype: torch.dtype = BF16, **params: Any) -> dict:
    """q, k [B, S, H, D] with a catalogue spelling's tables as the pass feeds them (benchmarks/spellings.py)."""
    s = SPELLINGS[code]
    cos, sin, kw = s.fused(*s.make_tables(B, S, D, torch.device("cpu")))
    rd = cos.shape[-1] * (1 if kw["full_tables"] else 2)
    p = RotaryParams(rotary_dim=rd, conjugate=params.pop("conjugate", False), out_dtype=params.pop("out", dtype),
                     **kw, **params)
    return dict(xs=[_x(B, S, hq, D, dtype=dtype), _x(B, S, hk, D, dtype=dtype)], cos=cos, sin=sin, params=p)


def _flux(B: int, H: int, S: int, D: int, bhsd: bool, **params: Any) -> dict:
    """Flux's full-width interleaved fp32 tables [S, D], broadcast over heads, q and k [B,H,S,D] or [B,S,H,D]."""
    c, s = flux_tables(S, D, "cpu")
    shape = (B, H, S, D) if bhsd else (B, S, H, D)
    view = (1, 1, S, D) if bhsd else (1, S, 1, D)
    p = RotaryParams(interleaved=True, rotary_dim=D, full_tables=True, conjugate=params.pop("conjugate", False),
                     out_dtype=BF16, **params)
    return dict(xs=[_x(*shape), _x(*shape)], cos=c.view(view), sin=s.view(view), params=p)


def _vllm(T: int, head: int, rot: int, neox: bool, hq: int, hk: int, max_pos: int, norm: bool = False,
          pos_dtype: torch.dtype = torch.int64) -> dict:
    """vLLM's forward_native: flat q, k [T, H*D] viewed as heads, the cos|sin cache gathered by positions."""
    cache = vllm_cos_sin_cache(max_pos, rot, 10000.0, "cpu")
    cos, sin = cache.chunk(2, dim=-1)
    p = RotaryParams(interleaved=not neox, rotary_dim=rot, full_tables=False, conjugate=False, out_dtype=BF16,
                     norm="rms" if norm else "none")
    xs = [_x(T, hq * head).view(T, hq, head), _x(T, hk * head).view(T, hk, head)]
    weights = [_x(head), _x(head)] if norm else None
    return dict(xs=xs, cos=cos, sin=sin, params=p, positions=torch.zeros(T, 1, dtype=pos_dtype), weights=weights)


def _norm_rows(label: str, B: int, S: int, H: int, D: int) -> dict:
    """benchmarks/kernels.py's norm rows: a per-head RMSNorm before Flux's and HF's RoPE, one across heads (Wan)."""
    w = [_x(D), _x(D)]
    il = _flux(B, H, S, D, bhsd=False, norm="rms")
    neox = _spelling("N1", B, S, H, H, D, norm="rms")
    wan = _spelling("I1", B, S, H, H, D, norm="rms_across_heads")
    wan["xs"] = [_x(B, S, H * D).view(B, S, H, D) for _ in range(2)]
    return {f"norm rms+flux-il {label}": {**il, "weights": w}, f"norm rms+hf-neox {label}": {**neox, "weights": w},
            f"norm wan-rms-heads {label}": {**wan, "weights": [_x(H * D).view(H, D) for _ in range(2)]}}


def _deepseek_mla(B: int, H: int, T: int, nope: int, rope: int) -> dict:
    """M8: q_pe the last `rope` lanes of q [B,H,T,nope+rope] (a pass-through head), k_pe [B,1,T,rope] alone
    (one head: several tokens a program), and the two in one launch; de-interleave then rotate_half; full NeoX bf16
    tables [B,T,rope]."""
    tables = dict(cos=_x(B, T, rope)[:, None], sin=_x(B, T, rope)[:, None])
    base = dict(interleaved=True, rotary_dim=rope, full_tables=True, conjugate=False, out_dtype=BF16,
                deinterleave=True)
    q = dict(xs=[_x(B, H, T, nope + rope)], params=RotaryParams(**base, rotary_offset=nope), **tables)
    k = dict(xs=[_x(B, 1, T, rope)], params=RotaryParams(**base), **tables)
    # both in one launch: the pass-through head is q's alone (offset_q_only)
    qk = dict(xs=[_x(B, H, T, nope + rope), _x(B, 1, T, rope)],
              params=RotaryParams(**base, rotary_offset=nope, offset_q_only=True), **tables)
    return {"M8 deepseek-v3 q": q, "M8 deepseek-v3 k_pe": k, "M8 deepseek-v3 q+k_pe": qk}


def _cases() -> dict[str, dict]:
    """name -> `launch` arguments (xs, cos, sin, params, positions, weights, tile options)."""
    cases: dict[str, dict] = {}
    # benchmarks/kernels.py's spellings rows: (B, S, q heads, k heads, D)
    shapes = {"2x16384x16x80": (2, 16384, 16, 16, 80), "1x32760x40x128": (1, 32760, 40, 40, 128),
              "decode64x32x128": (64, 1, 32, 32, 128), "gqa8192x32/8x128": (1, 8192, 32, 8, 128)}
    for label, shape in shapes.items():
        for code in ("I1", "I2", "I3", "N1", "N3", "C2"):
            cases[f"{code} {label}"] = _spelling(code, *shape)
    cases["C1 complex128 2x16384x16x80"] = _spelling("C1", *shapes["2x16384x16x80"])  # fp64 tables: fp64 math
    for label, shape in (("1x16384x16x80", (1, 16384, 16, 80)), ("1x32760x12x128", (1, 32760, 12, 128)),
                         ("1x32760x40x128", (1, 32760, 40, 128)), ("1x48x4x32", (1, 48, 4, 32))):
        cases.update(_norm_rows(label, *shape))
    cases["flux-il [B,H,S,D] 1x24x4608x128"] = _flux(1, 24, 4608, 128, bhsd=True)
    for T in (1, 8, 64, 256, 8192):
        cases[f"vllm llama3-8b T={T}"] = _vllm(T, 128, 128, True, 32, 8, 8192)
    cases["vllm gptj-partial T=8192"] = _vllm(8192, 128, 64, False, 32, 32, 8192)
    cases["vllm qwen3-8b+norm T=8192"] = _vllm(8192, 128, 128, True, 32, 8, 40960, norm=True)
    for T in (1, 64, 8192):
        cases[f"vllm qwen2.5-7b T={T}"] = _vllm(T, 128, 128, True, 28, 4, 32768)
    # packed sequences: positions derived from cu_seqlens (int32, as cumsum of int32 lengths gives them)
    cases["packed varlen [T,H,D] int32 positions"] = _vllm(4096, 64, 64, False, 8, 8, 4096, pos_dtype=torch.int32)
    # packed sequences searched in the kernel: cu_seqlens read as they are (int32 and int64), per-sequence offsets,
    # a norm folded, one sequence (Triton specialises a count of 1), one head a program's several tokens (TOKS)
    for name, c, cu, off in (
            ("il int32", _vllm(4096, 64, 64, False, 8, 8, 4096), torch.zeros(9, dtype=torch.int32), None),
            ("neox int64 offsets", _vllm(4096, 128, 128, True, 32, 8, 8192), torch.zeros(9, dtype=torch.int64),
             torch.zeros(8, dtype=torch.int64)),
            ("neox+norm int32 offsets", _vllm(4096, 128, 128, True, 32, 8, 8192, norm=True),
             torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),
            ("one sequence", _vllm(4096, 64, 64, False, 8, 8, 4096), torch.zeros(2, dtype=torch.int32), None),
            ("one head", _vllm(8192, 64, 64, True, 1, 1, 8192), torch.zeros(17, dtype=torch.int64), None)):
        c.pop("positions")
        cases[f"packed cu_seqlens {name}"] = {**c, "cu_seqlens": cu, "seqlen_offsets": off}
    # backward: the closed-form inverse is the conjugate rotation of the output gradients
    cases["backward N1 1x32760x12x128"] = _spelling("N1", 1, 32760, 12, 12, 128, conjugate=True)
    cases["backward flux-il [B,S,H,D]"] = _flux(1, 12, 32760, 128, bhsd=False, conjugate=True)
    cases.update(_deepseek_mla(1, 128, 8192, 128, 64))
    cache = _x(8192, 64)  # k_pe's rows picked by positions: several tokens a program, a table row each
    cases["k_pe gathered rows"] = dict(xs=[_x(1, 1, 8192, 64)], cos=cache, sin=cache,
                                       positions=torch.zeros(1, 1, 8192, dtype=torch.int64),
                                       params=RotaryParams(interleaved=False, rotary_dim=64, full_tables=True,
                                                           conjugate=False, out_dtype=BF16))
    # M9 HiDream: fp32 angles [B,S,D/2] (the pass reads cos and sin of one angle tensor in the kernel)
    ang = _x(1, 4224, 64, dtype=torch.float32)[:, :, None]
    cases["M9 hidream angles"] = dict(xs=[_x(1, 4224, 20, 128), _x(1, 4224, 20, 128)], cos=ang, sin=ang,
                                      params=RotaryParams(interleaved=True, rotary_dim=128, full_tables=False,
                                                          conjugate=False, out_dtype=BF16, angle_tables=True))
    # M10 CLVP: q, k and v by one table pair, partial NeoX (32 of 64 lanes, a pass-through tail)
    t = _x(1, 1, 8192, 32)
    cases["M10 clvp qkv"] = dict(xs=[_x(1, 16, 8192, 64) for _ in range(3)], cos=t, sin=t,
                                 params=RotaryParams(interleaved=False, rotary_dim=32, full_tables=True,
                                                     conjugate=False, out_dtype=BF16))
    # M11 Allegro: three NeoX blocks of 32 lanes, fp32 tables; V-JEPA 2: three interleaved blocks of 20 + 4 lanes
    t = _x(2, 1, 7040, 96, dtype=torch.float32)
    cases["M11 allegro 3-block"] = dict(xs=[_x(2, 24, 7040, 96), _x(2, 24, 7040, 96)], cos=t, sin=t,
                                        params=RotaryParams(interleaved=False, rotary_dim=96, full_tables=True,
                                                            conjugate=False, out_dtype=BF16, rotary_blocks=3))
    for suffix, dtype in (("", BF16), (" fp32-pos", torch.float32)):
        t = _x(1, 1, 8192, 60, dtype=dtype)
        cases[f"M11 vjepa2 3-block{suffix}"] = dict(
            xs=[_x(1, 16, 8192, 64), _x(1, 16, 8192, 64)], cos=t, sin=t,
            params=RotaryParams(interleaved=True, rotary_dim=60, full_tables=True, conjugate=False, out_dtype=dtype,
                                rotary_blocks=3))
    # dtypes: fp16 and fp32 x, fp64 math (fp64 x and output)
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32), ("fp64", torch.float64)):
        cases[f"N1 {name} 1x4096x24x128"] = _spelling("N1", 1, 4096, 24, 24, 128, dtype=dtype)
        cases[f"I3 {name} 1x4096x24x128"] = _spelling("I3", 1, 4096, 24, 24, 128, dtype=dtype)
    cases["N1 bf16 -> fp32 out"] = _spelling("N1", 1, 4096, 24, 24, 128, out=torch.float32)
    # the tests' forms: de-interleaved output under a per-head norm (a weight tile at 64 lanes, a folded row at 80)
    for D in (64, 80):
        c = _spelling("I3", 3, 6, 4, 1, D, norm="rms", deinterleave=True)
        cases[f"deinterleave+rms D={D}"] = {**c, "weights": [_x(D), _x(D)]}
    # a per-head weight that varies over heads ([H, D]) under a per-head norm, and a norm over a pass-through tail
    c = _spelling("N1", 1, 2048, 8, 8, 128, norm="rms")
    cases["rms weight per head"] = {**c, "weights": [_x(8, 128), _x(8, 128)]}
    c = _spelling("N3", 1, 2048, 8, 8, 128, norm="rms")
    cases["rms partial neox tail"] = {**c, "weights": [_x(128), _x(128)]}
    # MiniMax-H3 (vllm-omni's half-split 96 of 128 lanes under a per-head norm, fp32 [T, 1, 48] table halves): the
    # row with its tail in the halves' padding (the default), the halves and tail tile, and few tokens (split)
    for T, tiles in ((4096, {}), (4096, dict(row_tail=False)), (1024, {})):
        table = _x(T, 96, dtype=torch.float32)
        p = RotaryParams(interleaved=False, rotary_dim=96, full_tables=False, conjugate=False, out_dtype=BF16,
                         norm="rms")
        name = f"minimax-h3 rms 96/128 T={T}{' halves' if tiles else ''}"
        cases[name] = dict(xs=[_x(T, 24, 128), _x(T, 24, 128)], cos=table[:, None, :48], sin=table[:, None, 48:],
                           params=p, weights=[_x(128), _x(128)], tiles=tiles)
    # a head loop with offsets past 32 bits (64-bit head offsets): [1, 32, 2^19, 128], the heads looped over
    big = _spelling("N1", 1, 8, 32, 32, 128)
    big["xs"] = [_x(1, 32, 2 ** 19, 128)]
    big["cos"] = big["sin"] = _x(2 ** 19, 128, dtype=torch.float32)[None, None]
    cases["head offsets i64"] = big
    # more than three token dims that do not merge: x and tables materialized, one launch each
    c = _spelling("I3", 1, 8, 4, 4, 32)
    c["xs"] = [_x(5, 4, 3, 2, 4, 32).permute(3, 2, 1, 0, 4, 5) for _ in range(2)]
    c["cos"], c["sin"] = (t[0, 0, 0, :16] for t in (c["cos"], c["sin"]))
    cases["unmerged token dims"] = c
    # the tile options the tile sweep launches with (benchmarks/kernels.py SWEEP_CASES)
    for name, tiles in (("neox halves", dict(neox_row=False)), ("block_h 4 warps 2", dict(block_h=4, num_warps=2)),
                        ("nsplit 2", dict(nsplit=2)), ("no stream", dict(stream=False))):
        cases[f"sweep N1 1x32760x12x128 {name}"] = {**_spelling("N1", 1, 32760, 12, 12, 128), "tiles": tiles}
    c = _spelling("N1", 1, 16384, 16, 16, 80, norm="rms")
    cases["sweep N1 rms D=80 loop"] = {**c, "weights": [_x(80), _x(80)], "tiles": dict(held=False)}
    c = _spelling("I1", 1, 32760, 12, 12, 128, norm="rms_across_heads")
    cases["sweep I1 across heads loop"] = {**c, "weights": [_x(12, 128), _x(12, 128)], "tiles": dict(held=False)}
    return cases


def _cache_call(T: int, hq: int, hk: int, head: int, cache_dtype: torch.dtype, layout: str = "NHD",
                norm: bool = False) -> Any:
    """The KV-cache op's call (ops/kv_cache.py) as vLLM makes it: [T, H, D] q, k and v, the cos|sin cache gathered by
    positions, 64 blocks of 16 slots, NHD or HND caches (an FP8 one with its scales)."""
    from rope_fusion.ops.kv_cache import parse_separate

    c = _vllm(T, head, head, True, hq, hk, 8192, norm=norm)
    q, k = c["xs"]
    shape = (64, 16, hk, head) if layout == "NHD" else (64, hk, 16, head)
    scales = (torch.ones(1), torch.ones(1)) if cache_dtype == torch.float8_e4m3fn else (None, None)
    args = (q, k, _x(T, hk * head).view(T, hk, head), c["cos"], c["sin"], _x(*shape, dtype=cache_dtype),
            _x(*shape, dtype=cache_dtype), torch.zeros(T, dtype=torch.int64), c["positions"],
            *(c["weights"] or (None, None)), None, None, *scales, None)
    return parse_separate(args, {**c["params"].kwargs(), "kv_layout": layout})


def _mla_cache_call(T: int, heads: int) -> Any:
    """DeepSeek's MLA: q [T, H, 128 + 64] rotated after its nope lanes, the one k_pe head, the 512-lane latent normed
    into the [blocks, 16, 576] cache."""
    from rope_fusion.ops.kv_cache import parse_joint

    cache = vllm_cos_sin_cache(8192, 64, 10000.0, "cpu")
    cos, sin = cache.chunk(2, dim=-1)
    p = RotaryParams(interleaved=True, rotary_dim=64, full_tables=False, conjugate=False, out_dtype=BF16,
                     rotary_offset=128, offset_q_only=True)
    args = (_x(T, heads, 192), _x(T, 64), _x(T, 512), cos, sin, _x(64, 16, 576), torch.zeros(T, dtype=torch.int64),
            torch.zeros(T, 1, dtype=torch.int64), None, None, None, None, None, _x(512))
    return parse_joint(args, p.kwargs())


def _cache_cases() -> dict[str, Any]:
    """name -> a call of the KV-cache op (kernels/triton_kv_cache.py) at rows of benchmarks/kv_cache.py."""
    cases = {}
    for T in (1, 64, 8192):
        cases[f"kv cache llama 32/32x128 bf16 T={T}"] = _cache_call(T, 32, 32, 128, BF16)
        cases[f"kv cache gqa 32/8x128 fp8 T={T}"] = _cache_call(T, 32, 8, 128, torch.float8_e4m3fn)
    cases["kv cache gqa 32/8x128 bf16 HND T=256"] = _cache_call(256, 32, 8, 128, BF16, "HND")
    cases["kv cache qwen3 qk-norm 32/8x128 T=8192"] = _cache_call(8192, 32, 8, 128, BF16, norm=True)
    cases["kv cache mla T=64"] = _mla_cache_call(64, 16)
    return cases


def record_launches(cases: dict[str, dict] | None = None) -> list[Launch]:
    """Every launch the host planner makes for the cases, with the compile options of a direct launch; the KV-cache
    op's launches after them."""
    from rope_fusion.kernels.triton_launch import launch, row_checks

    out = []
    for name, c in (cases or _cases()).items():
        rec = _Recorder()
        launch(c["xs"], c["cos"], c["sin"], c["params"], c.get("positions"), c.get("weights"),
               cu_seqlens=c.get("cu_seqlens"), seqlen_offsets=c.get("seqlen_offsets"), kernel=rec, **c.get("tiles", {}))
        rows = c.get("positions") if c.get("positions") is not None else c.get("cu_seqlens")
        for i, (args, kwargs) in enumerate(rec.calls):
            out.append(Launch(name, i, args, {**kwargs, **row_checks(rows)}))
    if cases is None:
        from rope_fusion.kernels.triton_kv_cache import launch_planned, plan_cache_launch

        for name, cc in _cache_cases().items():
            rec = _Recorder()
            plan = plan_cache_launch(cc)
            assert not isinstance(plan, str), f"{name}: {plan}"
            launch_planned(plan, cc, kernel=rec)
            out += [Launch(name, i, args, kwargs) for i, (args, kwargs) in enumerate(rec.calls)]
    return out


def _kernel() -> Any:
    from triton.runtime.jit import JITFunction

    from rope_fusion.kernels.triton_kernel import rotary_kernel as kernel

    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def specialise(kernel: Any, launch: Launch) -> tuple[dict, str]:
    """(what to compile, positional key): the signature, constexprs, attributes and options that
    `JITFunction.run` compiles for this launch, as plain values (the tensors stay in this process)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget(*TARGET))
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    # a parameter the kernel gained with a default, left at it, is not part of the key: the launch compiles what it
    # compiled before the parameter existed (the PTX hash checks that), so a baseline outlives such an addition
    kept = [i for i, p in enumerate(kernel.params) if not (p.has_default and bound[p.name] is p.default)]
    types = list(signature.values())
    key = [[types[i] for i in kept], [repr(constexprs[k]) for k in sorted(constexprs) if k[0] in kept],
           sorted((list(k), repr(v)) for k, v in attrs.items() if k[0] in kept),
           sorted((k, repr(v)) for k, v in options.__dict__.items())]
    job = dict(signature=signature, constexprs=constexprs, attrs=attrs, options=dict(options.__dict__))
    return job, _sha(json.dumps(key))


# debug locations, comments, blank lines, and the labels that delimit an inlined function's scope for the debug
# information (`$L__tmp`: no branch goes to them; branch targets are `$L__BB`)
_DROP = re.compile(r"^\s*(\.loc|\.file|//)|^\s*$|^\$L__tmp\d+:$")
_ASSERT_GLOBAL = re.compile(r"^\s*\.global .* (assertFile|assertFunc)_\d+\[")


def normalise(ptx: str, name: str) -> str:
    """The PTX without what a refactor changes and the code does not: debug locations, sections and scope labels,
    comments, the kernel's and its parameters' names, and the device assert's source file, function and line."""
    lines, depth = [], 0
    for line in ptx.split("\n"):
        if line.lstrip().startswith(".section") and ".debug" in line:
            depth = 1
            continue
        if depth:  # inside a debug section's braces
            depth += line.count("{") - line.count("}")
            if line.strip() == "}" and depth <= 1:
                depth = 0
            continue
        if _DROP.match(line) or _ASSERT_GLOBAL.match(line):
            continue
        lines.append(line)
    out = "\n".join(lines).replace(name, "KERNEL")
    # __assertfail's third argument, the assert's source line (the kernel calls no other function)
    return re.sub(r"(st\.param\.b32\s+\[param2\],\s*)\d+;", r"\1LINE;", out)


def compile_ptx(job: dict) -> str:
    """The normalised PTX of one specialisation (`specialise`), compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(_kernel(), job["signature"], job["constexprs"], job["attrs"])
    compiled = triton.compile(src, target=GPUTarget(*TARGET), options=job["options"])
    return normalise(compiled.asm["ptx"], compiled.metadata.name)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def run(jobs: int = 2, dump: str | None = None, only: str | None = None) -> list[dict]:
    """Each launch's positional key and PTX hash (compiled in `jobs` processes)."""
    kernel = _kernel()
    launches = [la for la in record_launches() if only is None or only in la.case]
    specs = [specialise(kernel, la) for la in launches]
    out = []
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        for la, (_, key), ptx in zip(launches, specs, pool.map(compile_ptx, [job for job, _ in specs])):
            out.append(dict(case=la.case, launch=la.index, num_warps=la.kwargs.get("num_warps"), spec=key,
                            ptx=_sha(ptx)))
            if dump:
                os.makedirs(dump, exist_ok=True)
                with open(os.path.join(dump, f"{_file_name(la.case)}.{la.index}.ptx"), "w") as f:
                    f.write(ptx)
            print(f"{la.case} #{la.index}: spec {key} ptx {out[-1]['ptx']}", flush=True)
    return out


def _file_name(case: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", case)


def compare(baseline: list[dict], now: list[dict]) -> list[str]:
    """Lines naming each launch whose specialisation or PTX differs from the baseline, or that is new or gone."""
    want = {(r["case"], r["launch"]): r for r in baseline}
    got = {(r["case"], r["launch"]): r for r in now}
    problems = [f"{c} #{i}: gone" for c, i in want.keys() - got.keys()]
    problems += [f"{c} #{i}: new" for c, i in got.keys() - want.keys()]
    for k in sorted(want.keys() & got.keys()):
        for field in ("spec", "ptx"):
            if want[k][field] != got[k][field]:
                problems.append(f"{k[0]} #{k[1]}: {field} differs")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="F", help="write the baseline of hashes to F")
    mode.add_argument("--compare", metavar="F", help="compare with the baseline in F")
    mode.add_argument("--extend", metavar="F", help="add the launches F lacks to it, keeping the entries it holds")
    ap.add_argument("--dump", metavar="DIR", help="also write each launch's normalised PTX into DIR")
    ap.add_argument("--only", help="only the cases whose name contains this")
    ap.add_argument("--jobs", type=int, default=2, help="compiles run in this many processes")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    import triton

    now = run(args.jobs, args.dump, args.only)
    if args.record:
        data = dict(triton=triton.__version__, target=f"{TARGET[0]}:{TARGET[1]}", launches=now)
        with open(args.record, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"{len(now)} launches recorded in {args.record}")
        return 0
    if args.extend:  # the entries a baseline holds are what a later change is checked against: never rewritten
        with open(args.extend) as f:
            data = json.load(f)
        held = {(r["case"], r["launch"]) for r in data["launches"]}
        added = [r for r in now if (r["case"], r["launch"]) not in held]
        data["launches"] += added
        with open(args.extend, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"{len(added)} launches added to {args.extend} ({len(held)} kept)")
        return 0
    with open(args.compare) as f:
        data = json.load(f)
    if data["triton"] != triton.__version__:
        print(f"note: the baseline was made with triton {data['triton']}, this is {triton.__version__}")
    base = data["launches"]
    if args.only:
        base = [r for r in base if args.only in r["case"]]
    problems = compare(base, now)
    same = sum(1 for r in now if not any(p.startswith(f"{r['case']} #{r['launch']}:") for p in problems))
    print(f"{same} of {len(now)} launches identical (specialisation and PTX)")
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
