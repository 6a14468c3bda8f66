"""Upstream kernel files carried to the GPU machine for a side-by-side benchmark, never vendored into the package.

vllm-omni's `qk_norm_rope.py` (its `fused_qk_norm_rope` and, in its dual-stream PRs' version, also
`fused_joint_qkv_norm_rope`) imports vLLM and vllm-omni for four small things: the platform's `is_cuda`, vLLM's
re-export of Triton, `direct_register_custom_op` and an environment setting. Neither package installs on the GPU
machine, so the file is executed with stand-ins for exactly those names, with the behaviour vLLM gives them on a
CUDA machine (the op registered for the CUDA dispatch key with torch.library, its fake registered), and its
kernels, launches and checks run as they are. flash-attn's `rotary.py` needs only Triton.

    load_omni_kernels(".kernels/qk_norm_rope.py")    # a module: fused_qk_norm_rope, _eager_qk_norm_rope, ...
    load_flash_attn_rotary(".kernels/rotary.py")     # a module: apply_rotary
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

_STAND_IN_NAMES = ("vllm", "vllm.platforms", "vllm.triton_utils", "vllm.utils", "vllm.utils.torch_utils",
                   "vllm_omni", "vllm_omni.diffusion", "vllm_omni.diffusion.envs", "vllm_omni.platforms")


def _register_custom_op(op_name: str, op_func: Any, mutates_args: Any = None, fake_impl: Any = None,
                        target_lib: Any = None, dispatch_key: str | None = None, tags: tuple = ()) -> None:
    """vLLM's `direct_register_custom_op`: the schema inferred from op_func, the function registered for the
    platform's dispatch key, the fake beside it."""
    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args or [])
    target_lib.define(op_name + schema, tags=tags)
    key = dispatch_key or ("CUDA" if torch.cuda.is_available() else "CPU")
    target_lib.impl(op_name, op_func, key)
    if fake_impl is not None:
        torch.library.register_fake(f"{target_lib.ns}::{op_name}", fake_impl, lib=target_lib)


def _stand_ins() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    mods = {name: types.ModuleType(name) for name in _STAND_IN_NAMES}
    for name in ("vllm", "vllm.utils", "vllm_omni", "vllm_omni.diffusion"):
        mods[name].__path__ = []  # packages, so that their submodules import
    mods["vllm.platforms"].current_platform = types.SimpleNamespace(is_cuda=torch.cuda.is_available)
    mods["vllm.triton_utils"].__dict__.update(HAS_TRITON=True, tl=tl, triton=triton)
    mods["vllm.utils.torch_utils"].direct_register_custom_op = _register_custom_op
    env = os.environ.get("VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS")
    mods["vllm_omni.diffusion.envs"].VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS = env
    mods["vllm_omni.diffusion"].envs = mods["vllm_omni.diffusion.envs"]
    mods["vllm_omni.platforms"].current_omni_platform = types.SimpleNamespace(is_npu=lambda: False)
    return mods


@contextlib.contextmanager
def _imports_stood_in() -> Iterator[None]:
    """The stand-in modules in sys.modules while a file executes; whatever was there before, back after."""
    saved = {name: sys.modules.get(name) for name in _STAND_IN_NAMES}
    sys.modules.update(_stand_ins())
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def _execute(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton's JIT reads a kernel's source through its module
    spec.loader.exec_module(module)
    return module


def load_omni_kernels(path: str) -> types.ModuleType:
    """vllm-omni's `qk_norm_rope.py` (or its PRs' `fused_qk_norm_rope.py`) as a module, its vLLM imports stood in.
    Its ops register in the `vllm_omni` namespace once per process: a second file skips what the first registered
    (the file's own `hasattr` guard)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    with _imports_stood_in():
        return _execute(path, f"omni_kernels_{stem}")


def load_flash_attn_rotary(path: str) -> types.ModuleType:
    """flash-attn's Triton `rotary.py` (vLLM's copy, vllm/vllm_flash_attn/ops/triton/rotary.py) as a module."""
    return _execute(path, "flash_attn_rotary_file")
