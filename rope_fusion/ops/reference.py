"""Reference semantics of the fused rotary op (DESIGN.md section 2).

Every backend (Inductor lowering, Triton, NPU bridge) is tested against this function, so it is written
for clarity: plain slicing, no tricks. It also validates arguments, because direct callers deserve a
ValueError that names the bad argument rather than a shape error deep inside a kernel.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def math_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """fp64 math only when an input is fp64 and the output can hold the extra precision."""
    wide = torch.float64 in (x.dtype, cos.dtype, sin.dtype)
    return torch.float64 if wide and out_dtype in (torch.float32, torch.float64) else torch.float32


def table_width(rotary_dim: int, full_tables: bool) -> int:
    return rotary_dim if full_tables else rotary_dim // 2


def check_args(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    full_tables: bool,
    out_dtype: torch.dtype,
    name: str = "x",
) -> None:
    """Raise ValueError naming the offending argument; shapes may be symbolic (fake tensors)."""
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (the head dim), got shape {tuple(x.shape)}")
    for arg, t in ((name, x), ("cos", cos), ("sin", sin)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{arg} has unsupported dtype {t.dtype}; expected one of {FLOAT_DTYPES}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is unsupported; expected one of {FLOAT_DTYPES}")
    head_dim = x.shape[-1]
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} exceeds the head dim of {name} (shape {tuple(x.shape)})")
    width = table_width(rotary_dim, full_tables)
    for arg, t in (("cos", cos), ("sin", sin)):
        if t.dim() < 1 or t.shape[-1] != width:
            raise ValueError(
                f"{arg} must have last dim {width} (rotary_dim={rotary_dim}, full_tables={full_tables}), "
                f"got shape {tuple(t.shape)}"
            )
        if t.dim() > x.dim():
            raise ValueError(f"{arg} of shape {tuple(t.shape)} has more dims than {name} {tuple(x.shape)}")
        for a, b in zip(reversed(t.shape[:-1]), reversed(x.shape[:-1])):
            if a != 1 and a != b:
                raise ValueError(
                    f"{arg} of shape {tuple(t.shape)} does not broadcast against {name} of shape {tuple(x.shape)}"
                )


def _lane_tables(t: torch.Tensor, rotary_dim: int, interleaved: bool, full_tables: bool):
    """Table entries for the first and second lane of each pair, each of width rotary_dim/2."""
    if not full_tables:
        return t, t
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = rotary_dim // 2
    return t[..., :half], t[..., half:]


def rotary_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: int,
    full_tables: bool,
    conjugate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out[a]=x[a]C[a]-x[b]S[a], out[b]=x[b]C[b]+x[a]S[b] per pair (a,b); S negated when conjugate."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    cd = math_dtype(x, cos, sin, out_dtype)
    r = rotary_dim
    xr = x[..., :r].to(cd)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
    else:
        a, b = xr[..., : r // 2], xr[..., r // 2 :]
    ca, cb = (t.to(cd) for t in _lane_tables(cos, r, interleaved, full_tables))
    sa, sb = (t.to(cd) for t in _lane_tables(sin, r, interleaved, full_tables))
    if conjugate:
        sa, sb = -sa, -sb
    oa = a * ca - b * sa
    ob = b * cb + a * sb
    if interleaved:
        rot = torch.stack((oa, ob), dim=-1).flatten(-2)
    else:
        rot = torch.cat((oa, ob), dim=-1)
    rot = rot.to(out_dtype)
    if r < x.shape[-1]:
        rot = torch.cat((rot, x[..., r:].to(out_dtype)), dim=-1)
    return rot
