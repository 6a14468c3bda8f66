"""Helpers the test modules share, one topic a module; test modules import them from here, never from each other.

- triton_cpu: the Triton backend serving CPU tensors (the `triton_on_cpu` fixture of tests/conftest.py uses it).
- compat: what a drop-in calls and what the pass emits for the helper it replaces; `kernel_on_cpu`, the drop-ins'
  kernels on CPU tensors, recorded.
"""
