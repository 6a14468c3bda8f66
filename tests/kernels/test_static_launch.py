"""The direct path's launcher (kernels/triton_launch.py `_static_runner`): torch's static launcher, the C++
launcher Inductor uses for its own Triton kernels, takes the rotary kernel's compiled cubin and only its runtime
parameters. Which of a direct launch's arguments those are is read from the compiled kernel
(`static_arguments`); a wrong reading would launch the kernel with its arguments shifted.

Here, without a GPU: launches the host planner really makes (benchmarks/ptx_identity.py records them, as
benchmarks/kernels.py's rows and the tests' forms plan them) are compiled for sm_90 to a cubin on the CPU, and the
static launcher is built from each. The argument types it derives from the cubin's signature must be those of
the arguments `static_arguments` picks: a pointer for every tensor, an int or a float for every scalar. Loading
and launching need the GPU (tests/ops/test_eager_op.py's CUDA tests check the launches' results there).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from rope_fusion.kernels import triton_launch  # noqa: E402

if triton_launch._static_launcher_class() is None:
    pytest.skip("this torch has no static Triton launcher", allow_module_level=True)

# a norm across heads (its float eps), positions into a cache, q/k/v, and packed sequences' positions: pointers,
# ints and a float, some ints specialised to constants by Triton
CASES = ("norm wan-rms-heads 1x48x4x32", "vllm llama3-8b T=64", "M10 clvp qkv", "packed varlen [T,H,D] int32 positions")


def _compiled(launch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks import ptx_identity

    kernel = ptx_identity._kernel()
    job, _ = ptx_identity.specialise(kernel, launch)
    src = ASTSource(kernel, job["signature"], job["constexprs"], job["attrs"])
    return triton.compile(src, target=GPUTarget(*ptx_identity.TARGET), options=job["options"])


def test_static_launcher_takes_the_runtime_arguments_of_planned_launches():
    from benchmarks import ptx_identity

    cases = ptx_identity._cases()
    missing = [c for c in CASES if c not in cases]
    assert not missing, f"ptx_identity has no case {missing}"
    launches = ptx_identity.record_launches({c: cases[c] for c in CASES})
    assert len(launches) >= len(CASES)
    codes = {"O": torch.Tensor, "i": int, "l": int, "f": float, "d": float}
    for launch in launches:
        compiled = _compiled(launch)
        found = triton_launch.static_arguments(compiled, len(launch.args))
        assert found is not None, launch.case
        keep, pointers = found
        assert pointers == [i for i in keep if isinstance(launch.args[i], torch.Tensor)], launch.case
        kernel = triton_launch.static_kernel(compiled, keep)
        assert kernel is not None, f"{launch.case}: the static launcher refused the kernel"
        picked = [launch.args[i] for i in keep]
        assert len(kernel.arg_tys) == len(picked)
        for code, arg in zip(kernel.arg_tys, picked):
            assert isinstance(arg, codes[code]) and not (code in "il" and isinstance(arg, bool)), \
                (launch.case, code, type(arg))
        # every tensor argument is a runtime pointer (none is folded into the cubin), so each call's tensors reach
        # the kernel; the dropped arguments are the scalars Triton specialised on, fixed by the plan's key
        tensors = [i for i, a in enumerate(launch.args) if isinstance(a, torch.Tensor)]
        assert set(tensors) <= set(keep), launch.case
        assert all(not isinstance(launch.args[i], torch.Tensor) for i in set(range(len(launch.args))) - set(keep))


def test_every_planned_launch_passes_every_kernel_parameter():
    """Each launch the planner makes names every parameter of the kernel, those with defaults too: torch 2.11's
    user-kernel node (`wrap_triton`) rejects a call that leaves one at its default ("Incorrect number of arguments
    passed to kernel"), and the direct path's compiled launcher is kept only where the plan's constants cover the
    kernel's parameters after the positional ones. A parameter added with a default and passed by no plan broke
    both on the GPU, and nothing on the CPU (torch 2.13 binds defaults)."""
    from benchmarks import ptx_identity

    names = list(ptx_identity._kernel().arg_names)
    options = {"num_warps", "debug", "sanitize_overflow"}
    launches = ptx_identity.record_launches()
    assert launches
    for launch in launches:
        given = names[:len(launch.args)] + [k for k in launch.kwargs if k not in options]
        assert sorted(given) == sorted(names), (launch.case, sorted(set(names) - set(given)))
