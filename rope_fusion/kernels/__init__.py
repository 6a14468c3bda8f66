"""Device kernels behind the fused rotary op.

Each module here is an optional backend: it imports its toolkit (Triton, torch_npu), defines ops with the
signature of `rope_fusion::rotary` / `rotary_qk`, and registers itself with `rope_fusion.ops.backends`.
A module whose toolkit is missing raises ImportError on import, which the backend registry tolerates, so
nothing in the package depends on these imports succeeding.

- `triton_rotary`: the Triton backend for CUDA/ROCm (q and k in one launch, tables reused across heads), in parts:
  `triton_kernel` (the kernel), `triton_plan` (the host planner), `triton_launch` (launches, eager and traced),
  `triton_graph` (the kernel as Inductor's user-kernel node).
"""
