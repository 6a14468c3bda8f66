"""The `rope-fusion` console script: `explain MODULE:CALLABLE`, `bench`, `coverage`, `--version`, every `--help`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

import rope_fusion
from rope_fusion import cli

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TinyAttention(torch.nn.Module):
    """q/k projections, per-head QK RMSNorm, NeoX RoPE on both (tables shared), [B, S, H, D]."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.norm_q = torch.nn.RMSNorm(dim // heads)
        self.norm_k = torch.nn.RMSNorm(dim // heads)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.norm_q(self.q(x).view(b, s, self.heads, -1))
        k = self.norm_k(self.k(x).view(b, s, self.heads, -1))
        q = q * cos + _rotate_half(q) * sin  # the RoPE line
        k = k * cos + _rotate_half(k) * sin
        return q, k


def tiny_rope():
    """The explain callable: (model, example_inputs)."""
    torch.manual_seed(0)
    ang = torch.rand(6, 1, 8) * 6
    ang = torch.cat((ang, ang), -1)
    return TinyAttention().eval(), (torch.randn(1, 6, 32), ang.cos(), ang.sin())


def tiny_rope_kwargs():
    model, (x, cos, sin) = tiny_rope()
    return model, {"x": x, "cos": cos, "sin": sin}


def _rope_line() -> str:
    with open(__file__) as f:
        n = next(i for i, ln in enumerate(f, 1) if "# the RoPE line" in ln)
    return f"test_cli.py:{n}"


def test_explain_prints_the_report(capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    assert cli.main(["explain", "test_cli:tiny_rope", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "fused 2 sites in 1 kernel, 0 near misses" in out
    assert "rotary_qk[inductor]" in out and _rope_line() in out


def test_explain_rich_table_and_kwargs(capsys, monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.chdir(HERE)
    assert cli.main(["explain", "test_cli:tiny_rope_kwargs"]) == 0
    out = capsys.readouterr().out
    assert "fused sites" in out and "kernels" in out and "rotary_qk" in out and "neox" in out
    assert "fused 2 sites in 1 kernel," in out and "1 compiled graph," in out
    assert "┃" in out or "|" in out  # a table, not the plain listing


class AngleAttention(TinyAttention):
    """TinyAttention taking the angles: the graph computes cos and sin, so the op reads the angles."""

    def forward(self, x, angles):
        return super().forward(x, angles.cos(), angles.sin())


def tiny_rope_angles():
    model, (x, cos, sin) = tiny_rope()
    ang = torch.atan2(sin, cos)
    return AngleAttention().eval(), (x, ang)


def test_explain_rich_table_shows_the_norm_and_angles(capsys, monkeypatch):
    """The rich table has every column of the plain one: the folded QK-norm, and tables read as angles."""
    pytest.importorskip("rich")
    monkeypatch.chdir(HERE)
    assert cli.main(["explain", "test_cli:tiny_rope_angles"]) == 0
    rich_out = capsys.readouterr().out
    assert cli.main(["explain", "test_cli:tiny_rope_angles", "--plain"]) == 0
    plain_out = capsys.readouterr().out
    assert "angles" in plain_out and "norm rms folded" in plain_out, plain_out
    assert "norm" in rich_out and "rms folded" in rich_out and "angles" in rich_out, rich_out


def test_explain_bad_target(capsys):
    assert cli.main(["explain", "no_such_module_xyz:f"]) == 2
    assert cli.main(["explain", "no_colon"]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_console_script_explain():
    """The installed entry point (`rope-fusion` = rope_fusion.cli:main), run as a user would."""
    exe = os.path.join(os.path.dirname(sys.executable), "rope-fusion")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "rope_fusion.cli"]
    r = subprocess.run(cmd + ["explain", "test_cli:tiny_rope"], cwd=HERE, capture_output=True, text=True,
                       timeout=240, env=dict(os.environ, COLUMNS="160"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fused 2 sites in 1 kernel," in r.stdout and "rotary_qk" in r.stdout


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "examples", "wan_demo.py"))
                    or importlib.util.find_spec("diffusers") is None, reason="needs examples/wan_demo.py + diffusers")
def test_explain_wan_demo(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["explain", "examples.wan_demo:tiny_wan", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "transformer_wan.py" in out and "rotary_qk[" in out


def test_bench_without_gpu(capsys, monkeypatch):
    monkeypatch.setattr(cli, "gpu_present", lambda: False)
    assert cli.main(["bench", "--quick"]) == 2
    assert "no GPU" in capsys.readouterr().err


def test_bench_forwards_to_the_kernel_benchmark(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "gpu_present", lambda: True)
    monkeypatch.setattr(cli.subprocess, "call", lambda argv, **kw: calls.append(argv) or 0)
    assert cli.main(["bench", "--quick", "--out", "x.json"]) == 0
    if cli.find_benchmark() is None:
        pytest.skip("no benchmarks/kernels.py in this tree")
    (argv,) = calls
    assert argv == [sys.executable, "-m", "benchmarks.kernels", "--quick", "--out", "x.json"]


def test_bench_help_works_without_a_gpu(capsys):
    """`rope-fusion bench --help` runs the real benchmark's --help (no GPU needed), not the no-GPU message."""
    out = subprocess.run([sys.executable, "-m", "rope_fusion.cli", "bench", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower() and "no GPU" not in out.stderr


def test_coverage_runs_from_the_checkout():
    out = subprocess.run([sys.executable, "-m", "rope_fusion.cli", "coverage", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--markdown" in out.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rope-fusion {rope_fusion.__version__} (torch ") and "triton" in out


def _outside_a_checkout(tmp_path) -> tuple[str, dict]:
    """A copy of the package alone (what a wheel installs) on the path, and a working directory with nothing else."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(ROOT, "rope_fusion"), site / "rope_fusion",
                    ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    return str(work), dict(os.environ, PYTHONPATH=str(site))


@pytest.mark.parametrize("command", [[], ["explain"], ["bench"], ["coverage"], ["calibrate"]],
                         ids=["top", "explain", "bench", "coverage", "calibrate"])
def test_every_help_works_outside_a_checkout(tmp_path, command):
    cwd, env = _outside_a_checkout(tmp_path)
    r = subprocess.run([sys.executable, "-m", "rope_fusion.cli", *command, "--help"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage: rope-fusion") and "not found" not in r.stdout + r.stderr, r.stdout
    if command in (["bench"], ["coverage"]):  # runs a file of a checkout: says so, and what it would run
        assert "source checkout" in r.stdout and ".py" in r.stdout
    if command == []:
        assert all(name in r.stdout for name in ("explain", "bench", "coverage", "calibrate", "--version"))


def test_subcommands_are_a_registry():
    seen = []

    @cli.command("hello-test", "a test subcommand", lambda p: p.add_argument("--n", type=int, default=1))
    def hello(args):
        seen.append(args.n)
        return 0

    try:
        assert cli.main(["hello-test", "--n", "3"]) == 0 and seen == [3]
    finally:
        del cli._COMMANDS["hello-test"]
