"""Integrations with the places the pass is used from: vLLM (`vllm.py`) and depyf (`depyf_debug.py`).

Both are optional and neither is imported by `import rope_fusion` beyond this package's own code: depyf is
imported when `rope_fusion.debug` is entered, vLLM never (vllm.py waits for vLLM to be imported).
"""
