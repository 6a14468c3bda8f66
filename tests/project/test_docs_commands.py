"""Every command that README.md and docs/*.md show runs from README's install, or says what it needs.

The commands are read from the documents themselves (code blocks and inline code that start with `python`,
`pytest`, `pip`, `rope-fusion`, `torchrun`, `vllm`, ...), and every one must match a rule below, so a command added
to the docs without a rule fails here. A rule says how the command is checked, and each check runs it:

- `run`: it runs and exits 0 (in the default suite, or under `pytest -m slow` for the ones that take minutes);
- `gpu`: it needs a GPU; without one it must stop at once with a short message that says so (the one-line
  refusal), with one it is a GPU run of minutes and not a test;
- `proxy`: another command, which needs no more than the install, runs in its place (vLLM's own `vllm serve`
  needs a GPU and a full vLLM; `examples/vllm_config.py --check` builds the same config with vLLM's classes);
- `not run`: installs (pip) and the test suite itself, which CI's `.ci/run` runs in a fresh environment.

docs/benchmark-history.md is left out: it is the record of past GPU runs, each command as the project's GPU
driver ran it then; the commands to run now are in BENCHMARKS.md and README.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmark-history.md")]
EXE = r"(?:python3?|pytest|pip|rope-fusion|torchrun|vllm|bash|[A-Z][A-Z_]*=\S+)"  # what a command starts with
GPU = torch.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str  # a regex the whole command matches
    kind: str  # "run", "gpu", "proxy", "not run"
    why: str = ""  # what the command needs, or why it is not run
    slow: bool = False  # minutes (a real model's compile, two ranks, the zoo): under `pytest -m slow`
    args: str = ""  # appended to narrow a long command (the zoo: one entry)
    proxy: str = ""  # the command run in its place
    cwd: str = ""  # "outside": a directory outside the checkout


RULES = [
    Rule(r"pip (install|wheel) .*", "not run", "an install step: CI's .ci/run makes a fresh venv with it"),
    Rule(r"pytest( -rs| -m slow| -n 0 -m fuzz tests/fuzz)?", "not run", "the test suite itself: CI's .ci/run"),
    Rule(r"pytest tests/passes/test_sites\.py tests/passes/test_near_misses\.py tests/project/test_install\.py", "run",
         slow=True),
    Rule(r"PYTHONPATH=<vllm-ascend checkout> pytest tests/integrations/test_npu_stacks\.py -k vllm_ascend", "proxy",
         "a vllm-ascend checkout on the path; without one these tests skip", slow=True,
         proxy="pytest -p no:cacheprovider tests/integrations/test_npu_stacks.py -k vllm_ascend"),
    Rule(r"python examples/wan_demo\.py", "run", slow=True),
    Rule(r"python examples/vllm_config\.py", "run"),
    Rule(r"python examples/vllm_omni_block\.py", "run", slow=True),
    Rule(r"python -m examples\.show_rewrites --changed", "run", slow=True),  # five cold compiles
    Rule(r"rope-fusion --(version|help)", "run"),
    Rule(r"rope-fusion explain examples\.wan_demo:tiny_wan", "run", slow=True),
    Rule(r"PYTHONPATH=/path/to/checkout rope-fusion explain examples\.wan_demo:tiny_wan", "run", slow=True,
         cwd="outside"),
    Rule(r"rope-fusion coverage", "run", slow=True, args="llama"),
    Rule(r"python -m tests\.zoo\.coverage --full --markdown", "run", slow=True, args="llama"),
    Rule(r"python -m tests\.zoo\.coverage NAME \.\.\.", "run", slow=True),
    Rule(r"python -m benchmarks\.kernels --quick", "run", slow=True, args="--groups flux,vllm,backward"),
    Rule(r"python -m benchmarks\.stacks --device cpu --quick", "run", slow=True),
    Rule(r"torchrun --nproc-per-node 2 examples/distributed_attention\.py --mode (tp|ulysses)( --model flux "
         r"--offset symbolic)?", "run", slow=True),
    Rule(r"vllm serve MODEL .*", "proxy", "vLLM's own command: a full vLLM install and a GPU", slow=True,
         proxy="python examples/vllm_config.py --check"),
    # The refusals take a process each (seconds, most of it importing torch): under -m slow; the default suite
    # checks the benchmarks' refusal in one process (tests/project/test_benchmark_guards.py) and the CLI's
    # (test_cli.py).
    Rule(r"torchrun .*", "gpu", slow=True),
    Rule(r".*--device cuda.*", "gpu", slow=True),
    Rule(r"rope-fusion (bench|calibrate)", "gpu", slow=True),
    Rule(r"python -m benchmarks\.\w+( --(model|out) \S+)?", "gpu", slow=True),
]


@dataclasses.dataclass(frozen=True)
class Command:
    text: str
    where: str  # "README.md:95" of its first appearance


def _commands_in(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, command) of the code blocks' command lines and of the inline code that is a command."""
    found, prose, prose_start, fenced = [], [], 0, False

    def flush() -> None:
        for m in re.finditer(r"`([^`]+)`", " ".join(prose)):
            if re.match(EXE + r"[ \t]", m.group(1)):
                found.append((prose_start, " ".join(m.group(1).split())))
        prose.clear()

    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            flush()
            continue
        block = fenced or line.startswith("    ")
        text = re.split(r"\s{2,}#", line.strip())[0].strip()
        if block and re.match(EXE + r"(\s|$)", text):
            flush()
            found.append((n, text))
        elif not line.strip() or block:
            flush()
        else:
            if not prose:
                prose_start = n
            prose.append(line.strip())
    flush()
    return found


def doc_commands() -> list[Command]:
    seen: dict[str, Command] = {}
    for path in DOCS:
        for line, text in _commands_in(path):
            seen.setdefault(text, Command(text, f"{path.name}:{line}"))
    return list(seen.values())


def rule_of(command: str) -> Rule | None:
    return next((r for r in RULES if re.fullmatch(r.pattern, command)), None)


COMMANDS = doc_commands()


def test_the_docs_have_commands_and_every_command_has_a_rule():
    assert len(COMMANDS) > 20, COMMANDS
    missing = [f"{c.where}: {c.text}" for c in COMMANDS if rule_of(c.text) is None]
    assert not missing, "commands without a rule in tests/project/test_docs_commands.py:\n" + "\n".join(missing)
    unused = [r.pattern for r in RULES if not any(re.fullmatch(r.pattern, c.text) for c in COMMANDS)]
    assert not unused, f"rules that match no command of the docs: {unused}"


def _shell(command: str, tmp_path: pathlib.Path, cwd: str = "", timeout: int = 1800) -> subprocess.CompletedProcess:
    """Run a documented command as a user would, from the checkout root (or from outside it): this interpreter's
    `python`, `pytest`, `torchrun` and `rope-fusion` first on PATH, this checkout's package first on the path, and
    $OUT a fresh directory."""
    command = command.replace("/path/to/checkout", str(ROOT)).replace("NAME ...", "llama")
    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "rope-fusion")):  # the install's console script; a bare tree has none
        command = re.sub(r"(^|\s)rope-fusion\b", rf"\1{sys.executable} -m rope_fusion.cli", command)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    where = tmp_path / "elsewhere" if cwd == "outside" else ROOT
    where.mkdir(exist_ok=True)
    return subprocess.run(["bash", "-c", command], cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _check(command: Command, rule: Rule, tmp_path: pathlib.Path) -> str:
    """Run the command as its rule says; "" when it did what the docs say, else what went wrong."""
    if rule.kind == "gpu":
        if GPU:
            return ""  # a GPU run of minutes: not a test
        r = _shell(command.text, tmp_path, timeout=300)
        said = (r.stderr + r.stdout).strip().splitlines()
        refusal = [ln for ln in said if re.search(r"\b(GPU|CUDA|cuda)\b", ln)]
        if r.returncode == 0 or not refusal or len(r.stdout.strip().splitlines()) > 2:
            return f"{command.where} {command.text}: no one-line refusal without a GPU\n{r.stdout[-2000:]}\n" \
                   f"{r.stderr[-2000:]}"
        return ""
    text = rule.proxy or f"{command.text} {rule.args}".strip()
    r = _shell(text, tmp_path, rule.cwd)
    if rule.proxy and r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1:
        return ""  # the proxy says in one line what it needs (vLLM's config module, say)
    if r.returncode != 0:
        return f"{command.where} {text}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return ""


def _cases(slow: bool) -> list:
    out = []
    for c in COMMANDS:
        rule = rule_of(c.text)
        if rule is not None and rule.kind != "not run" and rule.slow == slow:
            out.append(pytest.param(c, rule, id=f"{c.where} {c.text}"[:90]))
    return out


def test_the_cheap_commands_run(tmp_path):
    """The quick ones (a help, a version, the vLLM config's forms: seconds each), side by side."""
    cases = [p.values for p in _cases(slow=False)]
    assert cases
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        failed = [f for f in pool.map(lambda cr: _check(*cr, tmp_path / str(id(cr))), cases) if f]
    assert not failed, "\n\n".join(failed)


@pytest.mark.slow  # compiles of real models, two ranks, the zoo: minutes each; a refusal: seconds
@pytest.mark.parametrize("command,rule", _cases(slow=True))
def test_an_expensive_command_runs(command, rule, tmp_path):
    failed = _check(command, rule, tmp_path)
    assert not failed, failed


def test_what_is_not_run_says_why():
    for c in COMMANDS:
        rule = rule_of(c.text)
        if rule is not None and rule.kind == "not run":
            assert rule.why, c
