"""rope_fusion in vLLM: the two ways to put the pass into vLLM's compilation config.

1. Python (the object):

    import rope_fusion
    from vllm import LLM
    llm = LLM(model, compilation_config={
        "inductor_compile_config": {"post_grad_custom_post_pass": rope_fusion.vllm_pass}})

2. CLI (a qualified name, resolved by vLLM as __import__("rope_fusion").__dict__["vllm_pass"]):

    vllm serve MODEL -cc.inductor_passes.post_grad_custom_post_pass=rope_fusion.vllm_pass
    # or the JSON form
    vllm serve MODEL --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "rope_fusion.vllm_pass"}}'

What fused is logged on the `rope_fusion` logger, one INFO line per compiled graph (vLLM compiles in its
engine process, on a copy of the pass, so `rope_fusion.vllm_pass.report` of your process stays empty):

    fused 64 sites in 32 kernels, 0 near misses

Usage of this script:

    python examples/vllm_config.py                   # print both forms (needs nothing but rope_fusion)
    python examples/vllm_config.py --check           # build both configs with vLLM's own classes (no GPU)
    python examples/vllm_config.py --model Qwen/Qwen3-0.6B   # run a prompt with the pass (GPU + full vLLM)

`--check` needs vLLM's config module importable: from the checkout, without touching torch,
`pip install --no-deps vllm==0.33.0 && pip install --no-deps -r .ci/vllm-deps.txt` (what CI installs).
`--model` needs vLLM installed as its documentation says (it brings its own torch) and a GPU. Without what
they need, both exit 1 with one line that says what to install.
"""

from __future__ import annotations

import argparse
import logging
import sys

import rope_fusion

CLI_FLAG = "-cc.inductor_passes.post_grad_custom_post_pass=rope_fusion.vllm_pass"
# The Python form as a user pastes it; `python_form()` is the same dict, and a test runs these lines.
PYTHON_LINES = (
    "import rope_fusion",
    'compilation_config = {"inductor_compile_config": {"post_grad_custom_post_pass": rope_fusion.vllm_pass}}',
    'llm = vllm.LLM("MODEL", compilation_config=compilation_config)',
)


def python_form() -> dict:
    """The compilation_config argument of vllm.LLM."""
    return {"inductor_compile_config": {"post_grad_custom_post_pass": rope_fusion.vllm_pass}}


def forms() -> str:
    """Both forms, as a user pastes them (MODEL: the model's name)."""
    python = "\n".join(f"    {line}" for line in ("import vllm", *PYTHON_LINES))
    return f"Python:\n{python}\nCLI:\n    vllm serve MODEL {CLI_FLAG}"


NEEDS_CHECK = ("--check needs vLLM's config module: pip install --no-deps vllm==0.33.0 && "
               "pip install --no-deps -r .ci/vllm-deps.txt (from the checkout; leaves torch as it is)")
NEEDS_RUN = ("--model needs a full vLLM install and a GPU: pip install vllm (it pins its own torch), then "
             "pip install -e . from the checkout into the same environment")


def _missing(need: str, e: BaseException) -> int:
    print(f"{need}; here: {type(e).__name__}: {e}".replace("\n", " "), file=sys.stderr)
    return 1


def check() -> int:
    """Build a vLLM CompilationConfig from each form and show that both hold rope_fusion.vllm_pass."""
    try:
        from pydantic import TypeAdapter
        from vllm.config import CompilationConfig
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        return _missing(NEEDS_CHECK, e)

    from_python = CompilationConfig(**python_form())
    parser = FlexibleArgumentParser()
    parser.add_argument("--compilation-config", "-cc",
                        type=lambda v: TypeAdapter(CompilationConfig).validate_json(v))
    from_cli = parser.parse_args([CLI_FLAG]).compilation_config
    for name, cc in (("python", from_python), ("cli", from_cli)):
        p = cc.inductor_compile_config["post_grad_custom_post_pass"]
        print(f"{name:6s}: {type(p).__module__}.{type(p).__name__} uuid={p.uuid()} "
              f"is rope_fusion.vllm_pass: {p is rope_fusion.vllm_pass}")
        if p is not rope_fusion.vllm_pass:
            return 1
    return 0


def run(model: str, prompt: str) -> int:
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        return _missing(NEEDS_RUN, e)
    import torch

    if not torch.cuda.is_available():
        print(f"{NEEDS_RUN}; here: no CUDA device", file=sys.stderr)
        return 1

    logging.basicConfig(level=logging.INFO)
    logging.getLogger("rope_fusion").setLevel(logging.INFO)
    llm = LLM(model, compilation_config=python_form())
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    print(out[0].outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="build both config forms, run nothing")
    ap.add_argument("--model", help="a model to run one prompt with (GPU and a full vLLM install)")
    ap.add_argument("--prompt", default="The rotary position embedding is")
    args = ap.parse_args(argv)
    if args.model:
        return run(args.model, args.prompt)
    if args.check:
        return check()
    print(forms())
    return 0


if __name__ == "__main__":
    sys.exit(main())
