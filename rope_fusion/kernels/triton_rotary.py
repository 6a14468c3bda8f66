"""The `triton` backend for CUDA / ROCm: the fused rotary op's Triton kernel as a backend record.

Its parts, one job each: kernels/triton_kernel.py the kernel, kernels/triton_plan.py the host planner (any layout
onto the kernel's form, and the tile rules), kernels/triton_launch.py the launches (eager, traced, the direct path
of the public functions), kernels/triton_graph.py the kernel as Inductor's user-kernel node in a graph. This module
says which sites the backend takes, defines the ops `rope_fusion::rotary_triton` and its arities, and registers the
backend and the CUDA device kernel. Importing it needs triton (an optional backend: the registry tolerates its
ImportError).
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.backends import Backend, Refusal, SiteSpec, emit_op_call, register_backend
from ..ops.device_runners import ROTARY_KERNELS
from ..ops.op_definition import define_rotary_ops
from ..ops.schema import RotaryCall
from . import (  # noqa: F401  (the slice, cat, join and KV-cache ops' CUDA kernels register)
    triton_cat,
    triton_join,
    triton_kv_cache,
    triton_launch,
    triton_slice,
)
from .triton_graph import emit_triton
from .triton_launch import launch, launch_call, plan_eager
from .triton_plan import KERNEL_FIELDS, MAX_HEAD_DIM

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# `rope_fusion::rotary_triton` / `rotary_qk_triton`: the kernel behind an opaque op, for sites whose sizes are
# symbolic (the user-kernel node of kernels/triton_graph.py needs concrete sizes) and for direct calls.
TRITON_OPS = define_rotary_ops("_triton", launch_call, takes_packed=True)  # by arity - 1
ROTARY_TRITON, ROTARY_QK_TRITON, ROTARY_QKV_TRITON = TRITON_OPS


def supports(spec: SiteSpec) -> str | None:
    """Sites this backend takes: GPU tensors of float dtypes and a static head dim the kernel can hold."""
    # ROCm tensors also have device type "cuda"; under the interpreter (tests) the kernel runs on CPU tensors
    if spec.device_type != "cuda" and not (spec.device_type == "cpu" and triton_launch.INTERPRETED):
        return f"runs on CUDA/ROCm devices, the site is on {spec.device_type}"
    dtypes = (spec.x_dtype, spec.table_dtype, spec.params.out_dtype)
    if not all(d in SUPPORTED_DTYPES for d in dtypes):
        return f"dtypes {dtypes} not among {SUPPORTED_DTYPES}"
    unknown = spec.params.unhandled(KERNEL_FIELDS)
    if unknown:
        return f"the kernel does not take {', '.join(unknown)}"
    head_dim = spec.head_dim
    if not isinstance(head_dim, int):
        return "the head dim is symbolic"
    if not head_dim <= MAX_HEAD_DIM:
        return f"head dim {head_dim} > {MAX_HEAD_DIM}"
    return None


def _emit(emitter: Any, call: RotaryCall, like: Any) -> list | Refusal:
    """Inductor's own user-kernel node where the launch can be planned for the node's sizes (launched from
    generated code, no op dispatch per call). Where it cannot (sizes symbolic beyond what the node takes),
    `auto` declines the site, and the lowering takes it: the opaque op would pay the dispatcher on every call.
    Asked for by name, the backend emits that opaque op."""
    if emitter.fake_mode is not None and call.xs[0].meta["val"].device.type == "cuda":
        outs = emit_triton(emitter.graph, emitter.fake_mode, call, like)
        if outs is not None:
            return outs
    if emitter.requested == "auto":
        return Refusal("its user-kernel node cannot be planned for these symbolic sizes")
    return emit_op_call(TRITON_OPS, emitter, call, like)


register_backend(Backend("triton", supports, _emit, folds=("slice write", "cat", "joined write", "kv-cache write")))
ROTARY_KERNELS.register("cuda", launch_call, plan=plan_eager, takes_packed=True)  # the kernel searches cu_seqlens

__all__ = ["ROTARY_TRITON", "ROTARY_QK_TRITON", "ROTARY_QKV_TRITON", "TRITON_OPS", "launch", "plan_eager", "supports"]
