"""The GPU benchmarks without a GPU: one line and a pointer to the smoke test, never a silent CPU sweep; and a
smoke run says that it checks the plumbing and prints no speedup (benchmarks/device_check.py).

The guard is exercised in this process with `gpu_present` reporting no GPU (on a GPU machine too); the smoke run
is the real benchmark at its tiny size on the CPU.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from benchmarks import device_check

# module: the arguments of a run that asks for the GPU (the default run)
GPU_MODULES = {
    "kernels": [], "models": [], "stacks": [], "training": [], "vllm_omni": [], "profile": ["--model", "flux"],
    "host": [], "auto_choice": [], "distributed": [], "kv_cache": [], "dropins": [], "norm_tiles": [],
}


@pytest.mark.parametrize("name", sorted(GPU_MODULES))
def test_a_gpu_benchmark_without_a_gpu_stops_with_one_line(name, monkeypatch, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(device_check, "gpu_present", lambda: False)
    argv = GPU_MODULES[name]
    if name == "host":  # reads sys.argv itself
        monkeypatch.setattr(sys, "argv", ["host.py", *argv])
        rc = module.main()
    else:
        rc = module.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    (line,) = err.strip().splitlines()
    assert "no GPU here" in line and "smoke test" in line and f"benchmarks{'/' if name == 'distributed' else '.'}" \
        f"{name}" in line.split("smoke test", 1)[1], line


@pytest.mark.slow  # three compiles: about 12 s on 2 cores
def test_a_cpu_smoke_run_says_what_it_checks_and_prints_no_speedup(capsys, tmp_path):
    from benchmarks import host

    out_json = tmp_path / "host.json"
    argv = sys.argv
    sys.argv = ["host.py", "--quick", "--tokens", "8", "--repeats", "1", "--out", str(out_json)]
    try:
        assert host.main() == 0
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert out.splitlines()[0] == device_check.SMOKE_NOTE
    assert "us/call" not in out and "minus compile" not in out and "speedup" not in out.replace(
        device_check.SMOKE_NOTE, "")
    assert "T=8 pass: ran" in out and out_json.exists()
