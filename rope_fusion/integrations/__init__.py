"""Integrations with the places the pass is used from: vLLM (`vllm.py`) and depyf (`depyf_debug.py`).

Both are optional: importing this package never imports depyf, and vLLM only when it is installed (its
`InductorPass` is the base class of `rope_fusion.vllm_pass`).
"""
