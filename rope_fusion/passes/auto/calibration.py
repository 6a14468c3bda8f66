"""`rope-fusion calibrate`: the factor table of `auto`'s fallback (ops/cost_model.py), measured on this GPU.

The table fallback decides a site that cannot be measured at compile time (symbolic sizes, measuring off, a failure
while timing). Its factors are multiples of the copy floor (a clone of q and k: the same bytes read and written
once) that the kernel benchmark measured on one H200. Here a few kernel rows, one per form the table
distinguishes (NeoX and interleaved, a folded per-head norm and one across heads, the padded D=80 rows), are
compiled three ways, plain torch.compile ("left"), the pass with the op's lowering ("inductor") and with the Triton
kernel ("triton"), and timed in CUDA-graph replay against the floor, as the kernel benchmark times them. Each timing
sets the table entries its row stands for; entries no row measures (complex, gathered, per-axis blocks) stay the
H200's. A variant the pass did not fuse as asked (no kernel, another backend, the norm not folded) sets nothing:
its time is not the form's.

The table is written next to the decisions cache (passes/auto/auto_decisions.py `factors_path`, one file per device
name and compute capability), where the fallback reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...ops.cost_model import H200, Factors
from .auto_clock import default_timer

_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Row:
    """One kernel row: its form and shape, and the table entry (field, key) each variant's factor sets."""

    name: str
    style: str  # "neox" or "interleaved"
    norm: str  # "none", "rms" (per head) or "rms_across_heads"
    head_dim: int
    q_heads: int
    k_heads: int
    entries: dict  # variant -> (Factors field, key)


ROWS = (
    Row("neox D=128", "neox", "none", 128, 32, 8,
        {"triton": ("triton", "none"), "inductor": ("lowering", ("none", "neox")), "left": ("left", "neox")}),
    Row("interleaved D=128", "interleaved", "none", 128, 32, 8,
        {"inductor": ("lowering", ("none", "interleaved")), "left": ("left", "interleaved")}),
    Row("rms + neox D=128", "neox", "rms", 128, 32, 8,
        {"triton": ("triton", "rms"), "inductor": ("lowering", ("rms", "neox")),
         "left": ("left_norm", ("rms", "neox"))}),
    Row("rms + interleaved D=128", "interleaved", "rms", 128, 24, 24,
        {"inductor": ("lowering", ("rms", "interleaved")), "left": ("left_norm", ("rms", "interleaved"))}),
    Row("rms across heads + neox D=128", "neox", "rms_across_heads", 128, 12, 12,
        {"triton": ("triton", "rms_across_heads"), "inductor": ("lowering", ("rms_across_heads", "neox")),
         "left": ("left_norm", ("rms_across_heads", "neox"))}),
    Row("neox D=80", "neox", "none", 80, 16, 16, {"triton": ("triton_padded", "none")}),
    Row("rms + neox D=80", "neox", "rms", 80, 16, 16,
        {"triton": ("triton_padded", "rms"), "left": ("left_norm_padded", "neox")}),
)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    if style == "neox":
        a, b = x.chunk(2, -1)
        turned = torch.cat((-b, a), -1)
    else:
        a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
        turned = torch.stack((-b, a), -1).flatten(-2)
    return x * cos + turned * sin


def _normed(x: torch.Tensor, w: torch.Tensor, norm: str) -> torch.Tensor:
    xf = x.float()
    if norm == "rms":
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _EPS) * w
    flat = xf.flatten(-2)
    return (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + _EPS) * w).unflatten(-1, x.shape[-2:])


def site_fn(row: Row) -> Callable[..., Any]:
    """The row as model code writes it: the norm (if any) and the rotation in fp32, cast back to x's dtype."""
    def site(q, k, cos, sin, wq, wk):
        outs = []
        for x, w in ((q, wq), (k, wk)):
            xf = _normed(x, w, row.norm) if row.norm != "none" else x.float()
            outs.append(_rotate(xf, cos, sin, row.style).to(x.dtype))
        return tuple(outs)
    return site


def row_inputs(row: Row, tokens: int, device: str, dtype: torch.dtype) -> tuple:
    d = row.head_dim
    q = torch.randn(1, tokens, row.q_heads, d, device=device, dtype=dtype)
    k = torch.randn(1, tokens, row.k_heads, d, device=device, dtype=dtype)
    angles = torch.randn(tokens, 1, d // 2, device=device)
    full = angles.repeat_interleave(2, -1) if row.style == "interleaved" else torch.cat((angles, angles), -1)
    wq, wk = ((torch.rand(h * d if row.norm == "rms_across_heads" else d, device=device) + 0.5)
              for h in (row.q_heads, row.k_heads))
    return q, k, full.cos(), full.sin(), wq, wk


def _fused_as_asked(p: Any, variant: str, row: Row) -> str:
    """"" when the pass fused the row with the variant's backend (the norm folded where the row has one)."""
    kernels = p.report.kernels
    if not kernels or any(k.backend != variant for k in kernels):
        return f"not fused by {variant}: {[k.backend for k in kernels]}, {[m.reason for m in p.report.misses]}"
    if row.norm != "none" and not all(s.norm.endswith("folded") for s in p.report.sites):
        return "the norm was not folded"
    return ""


def calibrate(device: str = "cuda", tokens: int = 8192, dtype: torch.dtype = torch.bfloat16,
              rows: tuple = ROWS, variants: tuple = ("triton", "inductor", "left"),
              timer: Callable[[str, Callable[[], Any]], float] | None = None) -> tuple[Factors, list[dict]]:
    """Time every row's variants and the floor; the table (over the H200's) and one record per row."""
    from ..rope_pass import RopeFusionPass

    timer = timer or default_timer(cuda_graphs=device.startswith("cuda"))
    changes: dict = {}
    records = []
    for row in rows:
        args = row_inputs(row, tokens, device, dtype)
        rec: dict = {"row": row.name, "us": {}, "factor": {}, "skipped": {}}
        torch._dynamo.reset()
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            floor = torch.compile(lambda q, k: (q.clone(), k.clone()))
            rec["us"]["floor"] = timer("floor", lambda f=floor, a=args: f(a[0], a[1])) * 1e6
            for variant in variants:
                if variant not in row.entries:
                    continue
                torch._dynamo.reset()
                if variant == "left":
                    fn = torch.compile(site_fn(row))
                    p = None
                else:
                    p = RopeFusionPass(backend=variant, measure=False)
                    fn = torch.compile(site_fn(row), options={"post_grad_custom_post_pass": p})
                fn(*args)
                why = _fused_as_asked(p, variant, row) if p is not None else ""
                if why:
                    rec["skipped"][variant] = why
                    continue
                rec["us"][variant] = timer(variant, lambda f=fn, a=args: f(*a)) * 1e6
                factor = rec["us"][variant] / rec["us"]["floor"]
                rec["factor"][variant] = factor
                field, key = row.entries[variant]
                changes.setdefault(field, dict(getattr(H200, field)))[key] = factor
        records.append(rec)
    factors = dataclasses.replace(H200, source="calibrated", **changes)
    return factors, records


__all__ = ["ROWS", "Row", "calibrate", "row_inputs", "site_fn"]
