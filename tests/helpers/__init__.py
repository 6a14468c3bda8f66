"""Helpers the test modules share, one topic a module; test modules import them from here, never from each other.

- triton_cpu: the Triton backend serving CPU tensors (the `triton_on_cpu` fixture of tests/conftest.py uses it).
"""
