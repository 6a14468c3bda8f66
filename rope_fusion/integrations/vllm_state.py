"""What vLLM is compiling for, read from vLLM's modules where vLLM imported them, without importing vLLM.

A leaf apart from integrations/vllm.py, which imports the pass: the pass's KV-cache fold reads the compile range
while it runs (passes/folds/kv_cache_fold_auto.py), and reading it through vllm.py made the pass and its vLLM
integration import each other.
"""

from __future__ import annotations

import sys

from ..import_hooks import VLLM_PASS_MODULE


def vllm_compile_range() -> tuple[int, int] | None:
    """(start, end), inclusive, of the token range vLLM is compiling the current graph for (its pass context, which
    vLLM sets around its post-grad passes), or None outside a vLLM compile (never imports vLLM). The KV-cache fold's
    token bound reads it where the graph's token count is symbolic (passes/folds/kv_cache_fold_auto.py)."""
    module = sys.modules.get(VLLM_PASS_MODULE)
    context = getattr(module, "_pass_context", None)
    span = getattr(context, "compile_range", None)
    if span is None:
        return None
    return int(span.start), int(span.end)


__all__ = ["vllm_compile_range"]
