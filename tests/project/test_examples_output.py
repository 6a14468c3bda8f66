"""What the examples print: code a user can paste, and no warning that the example's own settings cause.

The demo and the CPU examples run in fresh processes with a fresh compile cache (a warm one would skip the
compiles, and the warnings with them), so they are slow; the vLLM config's pasted form is cheap.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import rope_fusion

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args: list[str], tmp_path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_vllm_configs_python_form_runs_when_pasted(tmp_path):
    r = _run(["examples/vllm_config.py"], tmp_path, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    text = r.stdout.split("Python:\n", 1)[1].split("CLI:\n", 1)
    python = [ln.strip() for ln in text[0].splitlines()]
    assert python[0] == "import vllm" and python[-1].startswith("llm = vllm.LLM(")
    assert text[1].strip() == "vllm serve MODEL -cc.inductor_passes.post_grad_custom_post_pass=rope_fusion.vllm_pass"
    compile("\n".join(python), "<pasted>", "exec")  # every line is Python
    vllm_config = None
    try:  # what `import vllm` brings first, where vLLM's config imports (CI installs its dependencies: README)
        from vllm.compilation.passes.inductor_pass import InductorPass
        from vllm.config import CompilationConfig
        vllm_config = (CompilationConfig, InductorPass)
    except ImportError:
        pass
    pasted: dict = {}
    exec("\n".join(python[1:-1]), pasted)  # all but `import vllm` and building the engine (a GPU's work)
    config = pasted["compilation_config"]
    assert config["inductor_compile_config"]["post_grad_custom_post_pass"] is rope_fusion.vllm_pass
    if vllm_config is not None:
        CompilationConfig, InductorPass = vllm_config
        p = CompilationConfig(**config).inductor_compile_config["post_grad_custom_post_pass"]
        assert p is rope_fusion.vllm_pass and isinstance(p, InductorPass)


EXAMPLES = {
    "wan_demo": ("diffusers",),
    "unified_rope": (),
    "vllm_omni_block": ("triton", "vllm"),
}


@pytest.mark.slow  # a fresh process and a cold compile cache each: 30-160 s
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_example_prints_no_warning_of_its_own(name, tmp_path):
    missing = [m for m in EXAMPLES[name] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"examples/{name}.py needs {missing}")
    r = _run([f"examples/{name}.py"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == "", r.stderr[-3000:]
    assert "Warning" not in r.stdout, r.stdout[-3000:]
