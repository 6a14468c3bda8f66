"""One RoPE function for every model: a small vllm-omni-style DiT whose per-model helpers become rope_fusion calls.

vllm-omni's RFC "Unify Rotary Position Embedding Implementations Across Models" asks for one shared function behind
each model's own helper. This script writes a two-block model as vllm-omni's transformers are written:

- a Wan 2.2-like block: q/k RMSNorm over the whole inner dim, then `apply_rotary_emb_wan(x, freqs_cos, freqs_sin)`
  (full-width tables, cos read from the even lanes and sin from the odd ones);
- a Qwen-Image-like block: per-head q/k RMSNorm, then `apply_rotary_emb_qwen(x, freqs_cis, use_real=False)`
  (complex frequencies).

The unified model is the same model with each helper replaced by its rope_fusion drop-in
(`rope_fusion.compat.vllm_omni`) and, for the Wan block, the norm folded into the call
(`rope_fusion.rms_norm_rope_qk(..., per_head=False)`). Both run eagerly and under torch.compile; the script prints
each one's relative error against the original evaluated in fp64, and exits non-zero when the unified model breaks
the numerics contract (docs/design.md section 2: at most the original's own error plus one eps). On a GPU
(`--device cuda`, bf16) it also prints a speed table of the four variants (CUDA-event time per forward, median).

    python examples/unified_rope.py                  # CPU, float32: under a minute
    python examples/unified_rope.py --device cuda    # plus the speed table
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import rope_fusion
from rope_fusion.compat import vllm_omni as omni


def apply_rotary_emb_wan(hidden_states, freqs_cos, freqs_sin):
    """Wan 2.2's helper as model code writes it (the shape of vllm-omni's, not its text)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).type_as(hidden_states)


def apply_rotary_emb_qwen(x, freqs_cis):
    """Qwen-Image's complex branch: x [B, S, H, D] times freqs_cis [S, D/2] per pair."""
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)


class Attention(nn.Module):
    """Self-attention with a QK-norm and RoPE; `kind` picks the Wan-like or the Qwen-Image-like helper."""

    def __init__(self, dim: int, heads: int, kind: str, unified: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.kind, self.unified = heads, dim // heads, kind, unified
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        norm_dim = dim if kind == "wan" else self.head_dim  # Wan norms the inner dim, Qwen-Image each head
        self.norm_q, self.norm_k = nn.RMSNorm(norm_dim, eps=1e-6), nn.RMSNorm(norm_dim, eps=1e-6)

    def forward(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.kind == "wan":
            freqs_cos, freqs_sin = rope
            if self.unified:
                q, k = q.unflatten(-1, (self.heads, -1)), k.unflatten(-1, (self.heads, -1))
                # the drop-in's tables (omni.apply_rotary_emb_wan's views), the norm folded into the same call
                q, k = rope_fusion.rms_norm_rope_qk(q, k, self.norm_q.weight, self.norm_k.weight, 1e-6,
                                                    freqs_cos[..., 0::2], freqs_sin[..., 1::2], per_head=False,
                                                    interleaved=True)
            else:
                q, k = self.norm_q(q), self.norm_k(k)
                q, k = q.unflatten(-1, (self.heads, -1)), k.unflatten(-1, (self.heads, -1))
                q, k = apply_rotary_emb_wan(q, freqs_cos, freqs_sin), apply_rotary_emb_wan(k, freqs_cos, freqs_sin)
        else:
            q, k = q.unflatten(-1, (self.heads, -1)), k.unflatten(-1, (self.heads, -1))
            q, k = self.norm_q(q), self.norm_k(k)
            if self.unified:
                q, k = omni.apply_rotary_emb_qwen(q, rope, use_real=False), omni.apply_rotary_emb_qwen(
                    k, rope, use_real=False)
            else:
                q, k = apply_rotary_emb_qwen(q, rope), apply_rotary_emb_qwen(k, rope)
        v = v.unflatten(-1, (self.heads, -1))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class TinyDiT(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4, unified: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Attention(dim, heads, "wan", unified), Attention(dim, heads, "qwen", unified)])

    def forward(self, x: torch.Tensor, wan_rope: tuple, qwen_rope: torch.Tensor) -> torch.Tensor:
        x = x + self.blocks[0](x, wan_rope)
        return x + self.blocks[1](x, qwen_rope)


def rope_inputs(seq: int, head_dim: int, device: str, dtype: torch.dtype) -> tuple:
    angles = torch.rand(seq, head_dim // 2, device=device) * 6
    lanes = angles.repeat_interleave(2, -1)[None, :, None]  # Wan: [1, S, 1, D], one entry per lane
    wan = (lanes.cos().to(dtype), lanes.sin().to(dtype))
    qwen = torch.polar(torch.ones_like(angles), torch.rand_like(angles) * 6)  # complex64 [S, D/2]
    return wan, qwen


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def fp64(args):
    def one(a):
        if isinstance(a, tuple):
            return tuple(one(t) for t in a)
        return a.to(torch.complex128) if a.is_complex() else a.double()
    return tuple(one(a) for a in args)


def time_ms(fn, args, reps: int = 50) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=None, help="tokens (default: 128 on the CPU, 4096 on a GPU)")
    a = ap.parse_args()
    gpu = a.device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    seq = a.seq or (4096 if gpu else 128)
    dim, heads = (1536, 12) if gpu else (256, 4)
    torch.manual_seed(0)
    t0 = time.perf_counter()

    original = TinyDiT(dim, heads).to(a.device, dtype).eval()
    unified = TinyDiT(dim, heads, unified=True).to(a.device, dtype).eval()
    unified.load_state_dict(original.state_dict())
    x = torch.randn(1, seq, dim, device=a.device, dtype=dtype)
    args = (x, *rope_inputs(seq, dim // heads, a.device, dtype))
    reference = copy.deepcopy(original).double()

    # The Qwen-like block takes complex frequencies, as vllm-omni's helper does: Inductor runs the ops that read a
    # complex input eagerly and warns about it once per process. That is this model's spelling, shown on purpose.
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex operators")
    with torch.no_grad():
        ref = reference(*fp64(args))
        orig_eager = original(*args)
        p = rope_fusion.RopeFusionPass()
        orig_fused = torch.compile(original, options={"post_grad_custom_post_pass": p})
        variants = {
            "original, eager": (original, orig_eager),
            "original, compiled with the pass": (orig_fused, orig_fused(*args)),
            "unified, eager": (unified, unified(*args)),
        }
        unified_compiled = torch.compile(unified)
        variants["unified, compiled"] = (unified_compiled, unified_compiled(*args))

        eps = torch.finfo(dtype).eps
        base = rel_err(orig_eager, ref)
        print(f"relative error against the original in fp64 ({dtype}, {seq} tokens; "
              f"contract: <= {base:.3g} + {eps:.3g})")
        ok = True
        for name, (_, out) in variants.items():
            err = rel_err(out, ref)
            good = err <= base + eps
            ok &= good
            print(f"  {name:34s} {err:.3g}{'' if good else '  BREAKS THE CONTRACT'}")
        print(f"the pass on the original: {len(p.report.sites)} sites, {len(p.report.kernels)} kernels")
        if gpu:
            print(f"\nms per forward (median of 50, CUDA events), {seq} tokens x {heads} heads x {dim // heads}:")
            for name, (fn, _) in variants.items():
                print(f"  {name:34s} {time_ms(fn, args):8.3f}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
