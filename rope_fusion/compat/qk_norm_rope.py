"""vllm-omni's QK-norm + RoPE ops on the fused op: `fused_qk_norm_rope` and `fused_joint_qkv_norm_rope`.

vllm-omni's diffusion models call these by hand (`vllm_omni/diffusion/layers/ops/rope/qk_norm_rope.py`; the joint
form in its dual-stream PRs). The contract, as upstream states and checks it:

- `fused_qk_norm_rope(q, k, q_weight, k_weight, rope_table, eps, *, head_dim=None, rotary_dim=None,
  interleaved=False) -> (q, k)`: q and k `[tokens, heads, head_dim]` of one dtype and device (head counts may
  differ); each head RMS-normalised over its lanes, `x * rsqrt(mean(x^2) + eps) * weight`, weights `[head_dim]`;
  then rotated by `rope_table` `[tokens, rotary_dim]`, which holds `[cos | sin]`, each `rotary_dim / 2` wide, one
  angle per pair, in the activations' dtype or fp32. `interleaved=False` pairs lanes `(d, d + rotary_dim / 2)`,
  `True` pairs `(2i, 2i + 1)`; the lanes past `rotary_dim` keep their normalised value. `rotary_dim` defaults to
  the table's width, `head_dim` to q's.
- `fused_joint_qkv_norm_rope(q0, k0, v0, q1, k1, v1, q0_weight, k0_weight, q1_weight, k1_weight, rope_table, eps,
  *, rotary_dim=None, interleaved=True) -> (q, k, v)`: two streams `[B, S_i, H, D]` (text first in Flux), each
  stream's q and k normalised with its own weights, joined along the sequence (stream 0 first) and rotated by a
  table `[B * (S_0 + S_1), rotary_dim]` in the joined token order; v is the join of v0 and v1. Results
  `[B, S_0 + S_1, H, D]`.

What upstream's kernels leave to its eager fallback is served here too: every float dtype, both pairings at every
even `rotary_dim <= head_dim`, GQA, tables in either dtype, q and k in one launch at any token count. The math is
fp32 (fp64 for fp64 inputs), rounded once: upstream rounds the normalised value to the activations' dtype before
rotating, so results differ from it by that rounding, and are closer to an fp64 evaluation. The table is read
through two views (`[T, 1, R / 2]` halves), never copied; q and k may be strided views (a chunked QKV).
"""

from __future__ import annotations

from typing import Any

import torch

from ..norm_rope import rms_norm_rope_qk
from ..ops import cat_rotary, device_runners, joins
from ..ops.optional_backends import load_backends
from ..ops.public_functions import apply_rotary_qk
from ..ops.schema import FLOAT_DTYPES, RotaryCall, RotaryParams, check_call
from .direct import Plans, call_key

_QK_PLANS = Plans("qk_norm_rope")
_JOINT_PLANS = Plans("joint_qk_norm_rope")


def _params(dtype: torch.dtype, rotary_dim: int, interleaved: bool, eps: float) -> RotaryParams:
    return RotaryParams(interleaved=bool(interleaved), rotary_dim=rotary_dim, full_tables=False, conjugate=False,
                        out_dtype=dtype, norm="rms", norm_eps=float(eps))


def _tables(rope_table: torch.Tensor, lead: tuple, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin halves of a packed `[tokens, 2 * half]` table as views `[*lead, 1, half]` that broadcast
    over the heads (lead: the token dims of x, whose product is the table's rows)."""
    return rope_table.view(*lead, 1, 2, half).unbind(-2)


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {t.dtype}")


def _check_rotary(rope_table: torch.Tensor, rotary_dim: int | None, head_dim: int) -> int:
    rotary_dim = rope_table.shape[-1] if rotary_dim is None else rotary_dim
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, {head_dim}], got {rotary_dim}")
    return rotary_dim


def _check_table(rope_table: torch.Tensor, like: torch.Tensor, rows: int, rotary_dim: int) -> None:
    if rope_table.device != like.device or rope_table.dtype not in (like.dtype, torch.float32):
        raise ValueError(f"rope_table must be on q's device ({like.device}) in q's dtype ({like.dtype}) or float32, "
                         f"got {rope_table.dtype} on {rope_table.device}")
    if tuple(rope_table.shape) != (rows, rotary_dim):
        raise ValueError(f"rope_table must be [{rows}, {rotary_dim}] ([tokens, rotary_dim]: cos | sin), got "
                         f"{tuple(rope_table.shape)}")


def _check_weights(weights: dict[str, torch.Tensor], head_dim: int, like: torch.Tensor) -> None:
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}] (one weight per lane of a head), got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        _check_dtype(name, w)
        if w.device != like.device:
            raise ValueError(f"{name} is on {w.device}, the activations on {like.device}")


def check_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             rope_table: torch.Tensor, head_dim: int | None, rotary_dim: int | None) -> tuple[int, int]:
    """`fused_qk_norm_rope`'s contract: (head_dim, rotary_dim), or ValueError / TypeError naming the argument."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share tokens and head_dim")
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"q and k must share dtype and device, got {q.dtype} on {q.device} and {k.dtype} on "
                         f"{k.device}")
    _check_dtype("q", q)
    head_dim = q.shape[-1] if head_dim is None else head_dim
    if q.shape[-1] != head_dim:
        raise ValueError(f"head_dim={head_dim}, but q and k have {q.shape[-1]} lanes a head")
    rotary_dim = _check_rotary(rope_table, rotary_dim, head_dim)
    _check_weights({"q_weight": q_weight, "k_weight": k_weight}, head_dim, q)
    _check_table(rope_table, q, q.shape[0], rotary_dim)
    return head_dim, rotary_dim


class _QkRunner:
    """The runner of a checked call geometry: its device's planned launch (one for q and k on CUDA), given the
    table's two halves as views until the plan launches from data pointers (`DirectLaunches.pointer_launches`);
    from then on the halves are the table's pointer and the offset of its sin half, which the call's key fixes
    (shape, strides, dtype and the pointer's 16-byte residue), and a call makes no view."""

    __slots__ = ("run", "lead", "half", "sin_offset", "by_pointers")

    def __init__(self, run: Any, rope_table: torch.Tensor, half: int) -> None:
        self.run, self.lead, self.half = run, (rope_table.shape[0],), half
        self.sin_offset = half * rope_table.stride(-1) * rope_table.element_size()
        self.by_pointers = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 rope_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        go = self.by_pointers
        if go is not None:
            q_out, k_out = self.run.outputs((q, k))
            table = rope_table.data_ptr()
            go((q.data_ptr(), k.data_ptr()), (q_out.data_ptr(), k_out.data_ptr()), table, table + self.sin_offset,
               table, (q_weight.data_ptr(), k_weight.data_ptr()))
            return q_out, k_out
        cos, sin = _tables(rope_table, self.lead, self.half)
        q_out, k_out = self.run((q, k), cos, sin, None, (q_weight, k_weight))
        ready = getattr(self.run, "pointer_launches", None)
        if ready is not None:
            self.by_pointers = ready()
        return q_out, k_out


def _plan_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             rope_table: torch.Tensor, params: RotaryParams) -> _QkRunner:
    """The runner of a checked call geometry (`_QkRunner`), its launch planned for the device."""
    half = params.rotary_dim // 2
    cos, sin = _tables(rope_table, (rope_table.shape[0],), half)
    call = RotaryCall([q, k], cos, sin, params, None, [q_weight, k_weight])
    check_call(call)
    load_backends()  # the device kernels register on import
    return _QkRunner(device_runners.device_runner(call), rope_table, half)


def fused_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       rope_table: torch.Tensor, eps: float, *, head_dim: int | None = None,
                       rotary_dim: int | None = None, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm-omni's `fused_qk_norm_rope`: RMSNorm each head of q and k (own weights), then RoPE by the packed
    `[cos | sin]` table; new tensors in q's dtype (the module docstring has the contract). On CUDA one launch of
    the Triton kernel for q and k at every token count; a call geometry is checked once, later calls of it replay
    its launch."""
    key = call_key((q, k, q_weight, k_weight, rope_table), (eps, head_dim, rotary_dim, bool(interleaved)))
    run = _QK_PLANS.get(key)
    if run is None:
        head_dim, rotary_dim = check_qk(q, k, q_weight, k_weight, rope_table, head_dim, rotary_dim)
        params = _params(q.dtype, rotary_dim, interleaved, eps)
        if key is None:  # traced, or autograd to record: the op, through the public function
            cos, sin = _tables(rope_table, (q.shape[0],), rotary_dim // 2)
            return rms_norm_rope_qk(q, k, q_weight, k_weight, float(eps), cos, sin, interleaved=bool(interleaved),
                                    rotary_dim=rotary_dim)
        run = _QK_PLANS.put(key, _plan_qk(q, k, q_weight, k_weight, rope_table, params))
    return run(q, k, q_weight, k_weight, rope_table)


def check_joint(streams: tuple, weights: dict[str, torch.Tensor], rope_table: torch.Tensor,
                rotary_dim: int | None) -> int:
    """`fused_joint_qkv_norm_rope`'s contract: rotary_dim, or ValueError / TypeError naming the argument."""
    names = ("q0", "k0", "v0", "q1", "k1", "v1")
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in streams):
        raise ValueError("q0, k0, v0, q1, k1, v1 must be [batch, seq, heads, head_dim]")
    q0, k0, _, q1, _, _ = streams
    batch, s0, hq, head_dim = q0.shape
    s1, hk = q1.shape[1], k0.shape[2]
    want = ((batch, s0, hq, head_dim), (batch, s0, hk, head_dim), (batch, s0, hk, head_dim),
            (batch, s1, hq, head_dim), (batch, s1, hk, head_dim), (batch, s1, hk, head_dim))
    for name, t, shape in zip(names, streams, want):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} to join its stream, got {list(t.shape)} "
                             f"(shapes: {[tuple(s.shape) for s in streams]})")
        if t.dtype != q0.dtype or t.device != q0.device:
            raise ValueError(f"q0, k0, v0, q1, k1, v1 must share dtype and device; {name} is {t.dtype} on "
                             f"{t.device}, q0 {q0.dtype} on {q0.device}")
    _check_dtype("q0", q0)
    rotary_dim = _check_rotary(rope_table, rotary_dim, head_dim)
    _check_weights(weights, head_dim, q0)
    _check_table(rope_table, q0, batch * (s0 + s1), rotary_dim)
    return rotary_dim


def _joined_weights(first: torch.Tensor, second: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """Two streams' `[D]` weights as one weight per joined token, `[S_0 + S_1, 1, D]`: it broadcasts against the
    joined `[B, S, H, D]`, so the op's per-head norm applies each stream's weight to its own rows."""
    d = first.shape[-1]
    return torch.cat((first.expand(s0, 1, d), second.expand(s1, 1, d)))


def _joint_through_op(streams: tuple, weights: tuple, rope_table: torch.Tensor, params: RotaryParams) -> tuple:
    """The joint form composed of the public function (traced, or autograd to record): the pieces joined, each
    token normalised with its stream's weight by the op's own norm, rotated, one rounding."""
    q0, k0, v0, q1, k1, v1 = streams
    batch, s0, s1 = q0.shape[0], q0.shape[1], q1.shape[1]
    cos, sin = _tables(rope_table, (batch, s0 + s1), params.rotary_dim // 2)
    q_w, k_w = (_joined_weights(a, b, s0, s1) for a, b in ((weights[0], weights[2]), (weights[1], weights[3])))
    q, k = apply_rotary_qk(torch.cat((q0, q1), 1), torch.cat((k0, k1), 1), cos, sin,
                           q_norm_weight=q_w, k_norm_weight=k_w, **params.kwargs())
    return q, k, torch.cat((v0, v1), 1)


def _plan_joint(streams: tuple, weights: tuple, rope_table: torch.Tensor, params: RotaryParams) -> Any:
    """The runner of a checked joint geometry: q and k through the cat op's device kernel (one launch that reads
    each stream's rows where they are and writes the joined, normalised, rotated rows; its replayed launch where the
    device plans one, `cat_rotary.device_runner`), or its reference where no kernel takes the geometry; v joined by
    the device's join kernel, which also reads the streams' rows where they are (ATen's cat of strided views is its
    generic per-element kernel), else `torch.cat`."""
    q0, q1 = streams[0], streams[3]
    lead, half = (q0.shape[0], q0.shape[1] + q1.shape[1]), params.rotary_dim // 2
    cos, sin = _tables(rope_table, lead, half)
    cat = cat_rotary.parse(2, (q0, streams[1], cos, sin, None, weights[0], weights[1]),
                           dict(second_pieces=[q1, streams[4]], second_norm_weights=[weights[2], weights[3]],
                                cat_dims=[1, 1], **params.kwargs()))  # the cat op's own checks, once
    run_qk = cat_rotary.device_runner(cat)
    join_v = joins.plan_join(streams[2], streams[5], 1)

    def runner(q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor,
               v1: torch.Tensor, q0_weight: torch.Tensor, k0_weight: torch.Tensor, q1_weight: torch.Tensor,
               k1_weight: torch.Tensor, rope_table: torch.Tensor) -> tuple:
        cos, sin = _tables(rope_table, lead, half)
        call = RotaryCall([q0, k0], cos, sin, params, None, [q0_weight, k0_weight])
        q, k = run_qk(cat_rotary.CatCall(call, [q1, k1], [q1_weight, k1_weight], [1, 1]))
        return q, k, join_v(v0, v1)
    return runner


def fused_joint_qkv_norm_rope(q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, q1: torch.Tensor,
                              k1: torch.Tensor, v1: torch.Tensor, q0_weight: torch.Tensor, k0_weight: torch.Tensor,
                              q1_weight: torch.Tensor, k1_weight: torch.Tensor, rope_table: torch.Tensor, eps: float,
                              *, rotary_dim: int | None = None, interleaved: bool = True) -> tuple:
    """vllm-omni's dual-stream `fused_joint_qkv_norm_rope`: each stream's q and k RMS-normalised with its own
    `[D]` weights, joined along the sequence (stream 0 first), rotated by the joined table; v joined. Returns
    (q, k, v), each `[B, S_0 + S_1, H, D]` (the module docstring has the contract). On CUDA q and k are one launch
    that reads the streams in place and writes the joined rows (no cat of q or k), v one launch of the join
    kernel, which reads each stream's v where it lies."""
    streams = (q0, k0, v0, q1, k1, v1)
    weights = (q0_weight, k0_weight, q1_weight, k1_weight)
    key = call_key((*streams, *weights, rope_table), (eps, rotary_dim, bool(interleaved)))
    run = _JOINT_PLANS.get(key)
    if run is None:
        rotary_dim = check_joint(streams, dict(zip(("q0_weight", "k0_weight", "q1_weight", "k1_weight"), weights)),
                                 rope_table, rotary_dim)
        params = _params(q0.dtype, rotary_dim, interleaved, eps)
        if key is None:
            return _joint_through_op(streams, weights, rope_table, params)
        run = _JOINT_PLANS.put(key, _plan_joint(streams, weights, rope_table, params))
    return run(*streams, *weights, rope_table)


__all__ = ["check_joint", "check_qk", "fused_joint_qkv_norm_rope", "fused_qk_norm_rope"]
