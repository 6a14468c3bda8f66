"""`import rope_fusion` loads no compiler: Dynamo, Inductor, Triton, vLLM and depyf load when something uses them.

Each case runs in a fresh interpreter, since this one has long imported everything. What must still hold without
them: the `rope_fusion::*` ops are defined at import (model code calls them, and compiled code that a cache
serves names them), the public names load on first use, and a compile of model code that calls the op lowers it
with the op's own lowering, whether Inductor loads after the package or before it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter with this checkout first on the path; it prints one JSON object."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_loads_no_compiler_and_defines_every_op():
    out = _run("""
        import json, sys, torch
        import rope_fusion
        # sympy: torch's symbolic-shapes module imports it (about 0.2 s); an eager user never needs it
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "vllm", "depyf", "sympy")
                       or m.startswith(("torch._dynamo", "torch._inductor")))
        ops = sorted(n for n in ("rotary", "rotary_qk", "rotary_qkv", "rotary_cat", "rotary_qk_cat",
                                 "rotary_slice_", "rotary_qk_slice_", "rotary_into_", "rotary_qk_into_",
                                 "host_table_to_device") if not hasattr(torch.ops.rope_fusion, n))
        print(json.dumps({"heavy": heavy, "missing_ops": ops, "version": rope_fusion.__version__}))
    """)
    assert out["heavy"] == [], f"import rope_fusion loaded {out['heavy'][:10]}"
    assert out["missing_ops"] == []
    assert out["version"] and out["version"] != "0+unknown"


def test_the_cli_help_loads_no_compiler():
    out = _run("""
        import contextlib, io, json, sys
        from rope_fusion import cli
        with contextlib.redirect_stdout(io.StringIO()) as text:
            for argv in (["--help"], ["explain", "--help"], ["calibrate", "--help"]):
                try:
                    cli.main(argv)
                except SystemExit:
                    pass
        heavy = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor", "triton")))
        print(json.dumps({"heavy": heavy, "help": text.getvalue()}))
    """)
    assert out["heavy"] == [] and "explain" in out["help"] and "--tokens" in out["help"]


def test_public_names_load_on_first_use():
    out = _run("""
        import json, sys
        import rope_fusion
        names = {n: type(getattr(rope_fusion, n)).__name__ for n in rope_fusion.__all__}
        print(json.dumps({"names": names, "in_dir": all(n in dir(rope_fusion) for n in rope_fusion.__all__),
                          "same": rope_fusion.RopeFusionPass is sys.modules["rope_fusion.passes"].RopeFusionPass,
                          "dict": rope_fusion.__dict__.get("vllm_pass") is rope_fusion.vllm_pass,
                          "passes": rope_fusion.integrations.installation.install is rope_fusion.install}))
    """)
    assert out["names"]["RopeFusionPass"] == "ABCMeta" and out["names"]["install"] == "function"
    assert out["names"]["vllm_pass"] == "VllmRopeFusionPass" and out["names"]["compat"] == "module"
    assert out["in_dir"] and out["same"] and out["dict"] and out["passes"]


@pytest.mark.parametrize("inductor_first", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["package_first", "inductor_first"])  # a cold compile in a fresh process each
def test_a_compiled_call_of_the_op_uses_its_lowering(inductor_first):
    """Model code that calls the op, compiled without the pass: the op's lowering (C++ code with the rotation
    inlined), not a fallback call of its eager kernel, and the reference's numbers."""
    first = "import torch._inductor.lowering" if inductor_first else ""
    out = _run(f"""
        import json, torch
        {first}
        import rope_fusion
        from torch._inductor.utils import run_and_get_code
        from rope_fusion.ops import rotary_reference
        x, ang = torch.randn(2, 5, 3, 16), torch.rand(5, 1, 8) * 6
        kw = dict(interleaved=True, rotary_dim=16, full_tables=False, conjugate=False, out_dtype=torch.float32)
        f = lambda x, c, s: torch.ops.rope_fusion.rotary(x, c, s, **kw)
        out, (code,) = run_and_get_code(torch.compile(f, fullgraph=True), x, ang.cos(), ang.sin())
        ref = rotary_reference(x.double(), ang.cos().double(), ang.sin().double(), **dict(kw, out_dtype=torch.float64))
        print(json.dumps({{"extern": "torch.ops.rope_fusion" in code, "kernel": "cpp_fused" in code,
                          "err": (out.double() - ref).abs().max().item()}}))
    """)
    assert out["kernel"] and not out["extern"], out
    assert out["err"] < 1e-5


def test_a_failing_after_import_callback_never_fails_the_import(tmp_path, monkeypatch, caplog):
    from rope_fusion import import_hooks

    (tmp_path / "hooked_module_for_test.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def broken(module):
        raise RuntimeError("broken callback")

    import_hooks.after_import("hooked_module_for_test", broken)
    import_hooks.after_import("hooked_module_for_test", lambda m: seen.append(m.VALUE))
    try:
        with caplog.at_level(logging.WARNING, logger="rope_fusion"):
            import hooked_module_for_test
    finally:
        sys.modules.pop("hooked_module_for_test", None)
    assert hooked_module_for_test.VALUE == 7 and seen == [7]
    assert "broken callback" in caplog.text
