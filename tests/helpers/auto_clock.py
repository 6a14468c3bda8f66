"""`auto`'s measuring on the CPU with a stub clock: each candidate runs once (its outputs and, for "triton", the ops
it called kept) and takes the time given, so a test decides which candidate wins and checks what each computed."""

from __future__ import annotations

import torch


def stub_clock(monkeypatch, tmp_path, triton_us: float) -> tuple[dict, list]:
    """Measure on the CPU with the Triton backend first: "left" 10 us, "inductor" 12 us, "triton" `triton_us`.
    Returns (outputs by candidate, the profiler's op names of the "triton" run), filled as the compile measures."""
    from rope_fusion.ops import backends
    from rope_fusion.passes.auto import auto_timing

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(auto_timing.ENV, raising=False)
    monkeypatch.setattr(auto_timing, "_MEASURE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ["triton", "inductor"])
    times = {"left": 10e-6, "inductor": 12e-6, "triton": triton_us * 1e-6}
    outputs: dict = {}
    ops_called: list = []

    def clock(name, run):
        with torch.profiler.profile() as prof:
            outputs[name] = run()
        if name == "triton":
            ops_called.extend(e.name for e in prof.events())
        return times[name]

    monkeypatch.setattr(auto_timing, "TIMER", clock)
    return outputs, ops_called
