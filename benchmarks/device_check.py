"""Where a GPU benchmark runs, and what its CPU smoke test may print.

The benchmarks time GPU kernels. Without a GPU, a benchmark that was not asked for its CPU smoke test stops at
once with one line that says so and names that test (a full sweep run silently on the CPU takes minutes and
measures nothing). The smoke test runs the same code on tiny inputs on the CPU to check the plumbing: that every
variant compiles, what the pass fused, the errors against eager, the JSON. CPU times, and ratios of them, say
nothing about a GPU (one run printed a "speedup" of 0.032, the next 0.995), so a smoke run says first what it
checks and prints no speedup, ratio or multiple of the copy floor; its JSON keeps the raw numbers under the same
note.
"""

from __future__ import annotations

import sys

import torch

GPU_FIGURES = "BENCHMARKS.md"
SMOKE_NOTE = ("CPU smoke run: it checks the plumbing (compiles, fuses, matches eager, writes its JSON), not speed; "
              f"CPU times say nothing about a GPU, so no speedup or ratio is printed (GPU figures: {GPU_FIGURES})")


def gpu_present() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def no_gpu(prog: str, smoke: str) -> int:
    """Say in one line that `prog` needs a GPU and how to run its smoke test instead; the exit code (2)."""
    print(f"{prog}: no GPU here (torch.cuda.is_available() is False), and it times GPU kernels. Its CPU smoke test "
          f"(plumbing, not speed): {smoke}; GPU figures: {GPU_FIGURES}", file=sys.stderr)
    return 2


def is_smoke(device: str) -> bool:
    """Whether a run on `device` is a smoke run: anything but a GPU."""
    return not str(device).startswith("cuda")


def announce(device: str, result: dict | None = None) -> None:
    """Print the smoke note before a CPU run's output (and record it in its JSON)."""
    if is_smoke(device):
        print(SMOKE_NOTE, flush=True)
        if result is not None:
            result["note"] = SMOKE_NOTE


__all__ = ["GPU_FIGURES", "SMOKE_NOTE", "announce", "gpu_present", "is_smoke", "no_gpu"]
