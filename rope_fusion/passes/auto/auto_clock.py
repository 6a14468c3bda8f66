"""How `auto` times a compiled candidate (passes/auto/auto_timing.py) and `rope-fusion calibrate` a kernel row
(passes/auto/calibration.py): the way the compiled graph will run.

Replayed in CUDA graphs (`mode="reduce-overhead"`, vLLM's decode), a call costs only its kernels' GPU time, so the
candidate is captured once and its replays are timed. Otherwise every call pays its launches on the host, and a
small call waits on them: the candidate is called back to back in a timed loop, synchronized once per repeat, so
the time per call is the longer of its host and GPU time. Each repeat runs about `TARGET_SECONDS`; the median of
`REPEATS` is the time. On the CPU the same loop runs without synchronizing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

TARGET_SECONDS = 2e-3  # each timed repeat runs about this long
REPEATS = 5  # the median of this many repeats is a candidate's time


def default_timer(cuda_graphs: bool, repeats: int = REPEATS,
                  target_seconds: float = TARGET_SECONDS) -> Callable[[str, Callable[[], Any]], float]:
    """Seconds per call: CUDA-graph replay when the compiled graph will be replayed, else a timed loop of calls
    (launches and host time included, synchronized once per repeat); the median of `repeats` repeats of about
    `target_seconds` (passes/auto/auto_budget.py times briefly first where that settles the choice)."""
    def timer(name: str, run: Callable[[], Any]) -> float:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        for _ in range(3):
            run()
        if cuda:
            torch.cuda.synchronize()
        if cuda and cuda_graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            step = graph.replay
        else:
            step = run

        def once(n: int) -> float:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            if cuda:
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n

        first = once(1)
        n = max(3, min(2000, int(target_seconds / max(first, 1e-7))))
        return statistics.median(once(n) for _ in range(repeats))
    return timer


__all__ = ["REPEATS", "TARGET_SECONDS", "default_timer"]
