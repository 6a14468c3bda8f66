"""`auto` on the GPU: which of the Triton kernel, the Inductor lowering of the op, or the model's own code
left to Inductor moves a site's bytes fastest.

Every estimate is in bytes of the copy floor (bytes read and written once), scaled by the factor the kernel
benchmark measured for that kind of code on the H200 (BENCHMARKS.md, "Kernels" and "Cost model" sections).
The Triton kernel reads x, the tables and writes x once at about 1.05x the floor, but it reads its tables
from memory: a table that the graph computes (Llama's cos/sin of positions x frequencies, LTX's per-head
tables) must first be written by another kernel, which plain compile (and the op's lowering) would have
computed inside the rotation instead. Code left to Inductor runs at the factor its spelling measured: NeoX
`cat` 1.12x, interleaved stack/slice 1.47x, complex products 5.2x (complex64) to 8.9x (complex128, Inductor
falls back to eager kernels). Below `TRITON_MIN_BYTES` the launch, not the bytes, decides: the lowering.
"""

from __future__ import annotations

import dataclasses

TRITON_MIN_BYTES = 8 * 2**20  # decode-size sites: launch latency dominates (2.3-3.2x lowering, 2.9-14.7x Triton)

# Measured multiples of the copy floor (BENCHMARKS.md, H200, bf16, large shapes).
TRITON_FACTOR = 1.05
LOWERING_FACTOR = {"neox": 1.25, "interleaved": 1.45}
LEFT_FACTOR = {"neox": 1.12, "interleaved": 1.47, "complex64": 5.2, "complex128": 8.9}


@dataclasses.dataclass(frozen=True)
class SiteCost:
    """What the estimate needs, from the site as the op would read it."""

    x_bytes: int | None  # bytes of reading every x and writing every output (None: a symbolic size)
    table_bytes: int  # bytes of reading the cos and sin views once
    tables_computed: bool  # the graph computes the tables (not inputs or views of inputs)
    table_users: int  # sites that read the same computed tables (their materialisation is shared)
    style: str  # "neox", "interleaved", "complex64" or "complex128" (the spelling left to Inductor)


def estimates(c: SiteCost) -> dict[str, float]:
    """Estimated bytes-equivalents of the three choices."""
    x = float(c.x_bytes or 0)
    spelled = "neox" if c.style == "neox" else "interleaved"
    materialise = 2.0 * c.table_bytes / max(1, c.table_users) if c.tables_computed else 0.0
    table_reads = 0.0 if c.tables_computed else float(c.table_bytes)
    return {
        "triton": TRITON_FACTOR * (x + c.table_bytes) + materialise,
        "inductor": LOWERING_FACTOR[spelled] * x + table_reads,
        "left": LEFT_FACTOR[c.style] * x + table_reads,
    }


def cheapest(c: SiteCost) -> tuple[str, str]:
    """("triton" | "inductor" | "left", why) for a CUDA site under `auto`."""
    if c.x_bytes is None:
        return "inductor", "sizes known only at run time (the user-kernel node needs them)"
    if c.x_bytes < TRITON_MIN_BYTES:
        return "inductor", f"{c.x_bytes / 2**20:.1f} MiB moved: launch-bound, the lowering launches cheapest"
    est = estimates(c)
    best = min(est, key=est.get)
    shown = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(est.items(), key=lambda kv: kv[1]))
    return best, f"estimated MiB-equivalents: {shown}"
