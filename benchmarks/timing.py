"""Timing shared by the benchmarks whose calls cannot go through triton's do_bench: training steps (each
call runs the backward and an optimizer step) and distributed steps (every rank must make the same number of
calls, they hold collectives)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_ms(call: Callable[[], Any], device: str, steps: int, warmup: int,
            before: Callable[[], Any] | None = None) -> float:
    """Median ms of one call over `steps` calls after `warmup` more (CUDA events on the GPU, wall clock on
    the CPU); `before` runs ahead of each timed call, outside the timing (a barrier between ranks)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(steps):
        sync(device)
        if before is not None:
            before()
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
