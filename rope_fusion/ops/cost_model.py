"""`auto` on the GPU: which of the Triton kernel, the Inductor lowering of the op, or the model's own code
left to Inductor moves a site's bytes fastest.

Every estimate is in bytes of the copy floor (bytes read and written once), scaled by the factor the kernel
benchmark measured for that kind of code on the H200 (BENCHMARKS.md, "Cost model"), plus one launch's worth
of bytes per kernel (under CUDA graphs, as vLLM runs decode, a launch costs about a microsecond; at decode
sizes that, not the bytes, decides: the Triton kernel takes q and k in one launch, the lowering and the
model's own code one per tensor).

Without CUDA graphs a launch costs host time instead, and there the kernel's one launch is the dearer: its
user-kernel node passes some fifty arguments (every stride of q, k, v and the tables), Inductor's own kernels a
handful each (`python -m benchmarks.host`: the node took 0-3 us more host time than plain compile's two
kernels at 1-256 tokens). That matters only where the call waits on the host: a compiled graph whose inputs
and outputs are too few bytes to keep the GPU busy for a small call's host time (`HOST_BOUND_BYTES`), such as
one decode-sized RoPE. A model's forward keeps the GPU busy while the host launches ahead (Qwen-Image's took
2.8 ms of host time against 4.8 ms on the GPU), and there the GPU's time decides as under CUDA graphs. So for
a host-bound graph each choice costs the longer of its GPU time and its launches' host time, and a site too
small to pay for the node's launch is left to plain compile's code (a lone Llama-3-8B RoPE up to about 1000
tokens, the kernel above that). Whether the graph is replayed in CUDA graphs is the pass's `cuda_graphs` (by
default Inductor's own `triton.cudagraphs`, set by `mode="reduce-overhead"`; under vLLM its cudagraph mode).

- The Triton kernel reads its tables from memory: a table that the graph computes (Llama's cos/sin of
  positions x frequencies, LTX's per-head tables) must first be written by another kernel, which plain
  compile and the op's lowering compute inside the rotation instead. Tables that are cos and sin of one angle
  tensor reach the op as that tensor (angle_tables): only the angles count, written once if computed. An x
  that Inductor computes elementwise (a norm the op could not fold, a cat) fuses into the model's code and
  the lowering, but is written and read again around the Triton kernel.
- A folded QK-norm changes every factor: Inductor fuses a per-head norm with a NeoX rotation well (1.4x at
  D=128, 1.8-1.9x at D=80) and with an interleaved one badly (3.1-3.4x), a norm across heads worse (3.5-4.0x);
  the kernel, as launched from Inductor's code, takes 1.09-1.11x with a per-head norm (1.33-1.38x at D=80) and
  1.14-1.17x with a norm across heads once its norm math stopped being promoted to fp64 by the launcher's
  fp64 eps (before, 1.6-1.75x and 1.35-1.55x), and 1.05-1.10x now that it holds the token's rows in registers
  (BENCHMARKS.md, Kernels; counted as 1.12x, as a per-head norm: a norm across heads of more than 64 heads of
  128 lanes, or of symbolic head counts, still reads them twice).
- The model's own code for vLLM's gathered `forward_native` measured 1.44-2.0x (NeoX) and 2.6-2.7x (GPT-J);
  Allegro's per-axis blocks (chunk, rotate_half per block with embedding-gathered tables, cat) 2.46x.
- Sizes known only at run time (vLLM's dynamic token count) take the Triton kernel: its user-kernel node
  takes the token count as a graph value (kernels/triton_graph.py). The model's own code compiled for a
  symbolic count measured 1.41-3.08x (Llama NeoX) and 2.72x (GPT-J), the lowering 1.16-4.19x; with Qwen3's
  folded norm the kernel 1.08x against the lowering's 1.26x and the model's 1.76x in CUDA-graph replay (in
  do_bench, host-bound at 8192 tokens: 1.55x against 1.46x and 4.39x).
- Training graphs are costed like any other: a Flux training step with the kernel in its forward and backward
  graphs ran at 0.98x plain compile's time (BENCHMARKS.md, Training).
- A fused choice must beat the model's own code by `MARGIN`: the estimates are not better than that, and
  leaving a site alone is never slower than plain torch.compile.
"""

from __future__ import annotations

import dataclasses

MARGIN = 0.05
BYTES_PER_US = 4 * 2**20  # ~1 us of H200 bandwidth
LAUNCH_BYTES = BYTES_PER_US  # one launch in CUDA-graph replay
# Without CUDA graphs (benchmarks/host.py, H200 host, torch 2.11): one Inductor kernel's launch from generated
# code, and the Triton kernel's user-kernel node (about two of those and the cost of its extra arguments).
HOST_LAUNCH_US = 4.0
TRITON_HOST_US = 2 * HOST_LAUNCH_US + 2.0
# A compiled call's own host time (Dynamo's guards, the wrappers: 37-100 us a call of one to a few kernels on
# the H200 machine's host): a graph whose inputs and outputs the GPU moves in less time than this waits on the
# host. Every choice pays it, so it is not part of the estimates: counted in them, it left the Flux-form site
# and HiDream's to plain compile (1.45x and 3.15x the floor, against the kernel's 1.05x and 0.96x in do_bench,
# whose cache flush between calls gives the host that head start).
HOST_BOUND_BYTES = 50 * BYTES_PER_US

# Measured multiples of the copy floor (benchmarks/kernels.py, H200, bf16), by the folded norm.
TRITON_FACTOR = {"none": 1.05, "rms": 1.12, "rms_across_heads": 1.12}
# half or head dim not a power of 2 (across heads: measured before the eps fix, not since; a per-head norm at D=80:
# 1.05-1.20x where the kernel holds its rows, up to 24 heads, 1.17-1.33x in the head loop elsewhere: the upper end)
TRITON_PADDED_FACTOR = {"none": 1.3, "rms": 1.3, "rms_across_heads": 2.5}
LOWERING_FACTOR = {("none", "neox"): 1.25, ("none", "interleaved"): 1.45,
                   ("rms", "neox"): 2.1, ("rms", "interleaved"): 1.9,
                   ("rms_across_heads", "neox"): 3.2, ("rms_across_heads", "interleaved"): 3.2}
# "neox-blocks": a head dim rotated per axis, each block rotate_half with its own gathered tables (Allegro)
LEFT_FACTOR = {"neox": 1.12, "interleaved": 1.47, "complex64": 5.2, "complex128": 8.9, "neox-blocks": 2.4}
LEFT_GATHERED_FACTOR = {"neox": 1.45, "interleaved": 2.6}
LEFT_NORM_FACTOR = {("rms", "neox"): 1.4, ("rms", "interleaved"): 2.9,
                    ("rms_across_heads", "neox"): 1.4, ("rms_across_heads", "interleaved"): 3.5}
LEFT_NORM_PADDED_FACTOR = {"neox": 1.8, "interleaved": 2.8}  # a per-head norm at D=80
# A per-head norm before vLLM's gathered forward_native (Qwen3, flat [T, H*D]): the lowering reads the cache
# row per token and fuses the norm (1.16-1.23x), the model's code measured 1.74-1.82x (CUDA-graph replay).
GATHERED_NORM_FACTOR = {"inductor": 1.2, "left": 1.8}
# The lowering of vLLM's gathered NeoX without a norm (benchmarks/host.py, Llama form at 8192 tokens, GPU-bound
# calls; BENCHMARKS.md, vLLM): 1.26-1.29x plain compile's time, which is 1.42x the floor.
GATHERED_LOWERING_FACTOR = {"neox": 1.8}


@dataclasses.dataclass(frozen=True)
class Factors:
    """One device's factor table: the dicts above by name. `H200` is the default; `rope-fusion calibrate`
    (passes/auto/calibration.py) writes a table measured on the current GPU, which `auto`'s table fallback then reads
    (passes/auto/auto_decisions.py). A calibrated table names only the entries it measured; the rest are the H200's."""

    triton: dict
    triton_padded: dict
    lowering: dict
    left: dict
    left_gathered: dict
    left_norm: dict
    left_norm_padded: dict
    gathered_norm: dict
    gathered_lowering: dict
    source: str = "the H200 table (ops/cost_model.py)"

    def to_json(self) -> dict:
        """The dicts with tuple keys written as "norm/style"."""
        return {f.name: ({"/".join(k) if isinstance(k, tuple) else k: v for k, v in getattr(self, f.name).items()}
                         if isinstance(getattr(self, f.name), dict) else getattr(self, f.name))
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict, source: str) -> Factors:
        """A table from `to_json`'s form over the H200's: unknown names or keys raise ValueError (a table for
        another version of this module is not read as this one)."""
        changes: dict = {"source": source}
        for name, entries in data.items():
            if name == "source":
                continue
            base = getattr(H200, name, None)
            if not isinstance(base, dict) or not isinstance(entries, dict):
                raise ValueError(f"factor table: unknown entry {name!r}")
            merged = dict(base)
            for key, value in entries.items():
                k = tuple(key.split("/")) if "/" in key else key
                if k not in base or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"factor table: {name}[{key!r}] = {value!r} is not a factor of this table")
                merged[k] = float(value)
            changes[name] = merged
        return dataclasses.replace(H200, **changes)


H200 = Factors(TRITON_FACTOR, TRITON_PADDED_FACTOR, LOWERING_FACTOR, LEFT_FACTOR, LEFT_GATHERED_FACTOR,
               LEFT_NORM_FACTOR, LEFT_NORM_PADDED_FACTOR, GATHERED_NORM_FACTOR, GATHERED_LOWERING_FACTOR)


@dataclasses.dataclass(frozen=True)
class SiteCost:
    """What the estimate needs, from the site as the op would read it."""

    x_bytes: int | None  # bytes of reading every x and writing every output (None: a symbolic size)
    table_bytes: int  # bytes of reading the cos and sin views once
    tables_computed: bool  # the graph computes the tables (not inputs or views of inputs)
    table_users: int  # sites that read the same computed tables (their materialisation is shared)
    style: str  # "neox", "neox-blocks", "interleaved", "complex64" or "complex128" (the spelling left to Inductor)
    # bytes of the x's that Inductor computes elementwise right before the site (an unfolded norm, a cat):
    # fused into the model's code or the lowering, written and read again around the Triton kernel
    x_fused_upstream_bytes: int = 0
    norm: str = "none"  # the QK-norm folded into the op
    padded: bool = False  # the rotary half or the head dim is no power of two (the kernel pads its rows), or
    # a partial NeoX half is under 32 lanes
    gathered: bool = False  # tables gathered from a cache by positions (vLLM)
    tensors: int = 2  # x tensors of the site (q and k: 2)
    # the graph waits on the host (no CUDA graphs, too few bytes to keep the GPU busy): launches cost host time
    host_bound: bool = False


def _left_factor(c: SiteCost, f: Factors) -> float:
    spelled = "neox" if c.style.startswith("neox") else "interleaved"
    if c.norm == "rms" and c.gathered:
        return f.gathered_norm["left"]
    if c.norm == "rms" and c.padded and c.style in ("neox", "interleaved"):
        return f.left_norm_padded[spelled]
    if c.norm != "none":
        return f.left_norm[c.norm, spelled] if c.style in ("neox", "interleaved") \
            else f.left[c.style] + 0.5
    if c.gathered:
        return f.left_gathered[spelled]
    return f.left[c.style]


def estimates(c: SiteCost, factors: Factors | None = None) -> dict[str, float]:
    """Estimated bytes-equivalents of the three choices (by the H200's factors unless `factors` is given)."""
    f = factors or H200
    x = float(c.x_bytes or 0)
    spelled = "neox" if c.style.startswith("neox") else "interleaved"
    materialise = 2.0 * c.table_bytes / max(1, c.table_users) if c.tables_computed else 0.0
    table_reads = 0.0 if c.tables_computed else float(c.table_bytes)
    triton = (f.triton_padded if c.padded else f.triton)[c.norm]
    if c.norm == "rms" and c.gathered:
        lowering = f.gathered_norm["inductor"]
    elif c.norm == "none" and c.gathered and spelled in f.gathered_lowering:
        lowering = f.gathered_lowering[spelled]
    else:
        lowering = f.lowering[c.norm, spelled]
    gpu = {
        "triton": triton * (x + c.table_bytes) + materialise + c.x_fused_upstream_bytes + LAUNCH_BYTES,
        "inductor": lowering * x + table_reads + LAUNCH_BYTES * c.tensors,
        "left": _left_factor(c, f) * x + table_reads + LAUNCH_BYTES * c.tensors,
    }
    if not c.host_bound:
        return gpu
    # the host launches while the GPU works: a call takes the longer of the two
    launches = HOST_LAUNCH_US * c.tensors  # the lowering and the model's code: a kernel per tensor
    host = {"triton": TRITON_HOST_US, "inductor": launches, "left": launches}
    return {k: max(v, host[k] * BYTES_PER_US) for k, v in gpu.items()}


def cheapest(c: SiteCost, factors: Factors | None = None) -> tuple[str, str]:
    """("triton" | "inductor" | "left", why) for a CUDA site under `auto`, by `factors` (default: the H200's)."""
    if c.x_bytes is None:  # no bytes to weigh: what was measured for a symbolic token count
        return "triton", "sizes known only at run time: the kernel, its grid the token count"
    est = estimates(c, factors)
    fused = min(("triton", "inductor"), key=est.get)
    best = fused if est[fused] < (1 - MARGIN) * est["left"] else "left"
    shown = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(est.items(), key=lambda kv: kv[1]))
    mode = ", launches costed as host time (a host-bound graph, no CUDA graphs)" if c.host_bound else ""
    table = f" ({factors.source})" if factors is not None and factors is not H200 else ""
    return best, f"estimated MiB-equivalents: {shown}{mode}{table}"
