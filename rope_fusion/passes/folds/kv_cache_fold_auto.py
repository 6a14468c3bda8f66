"""Whether `auto` folds a rotation into vLLM's KV-cache write (passes/folds/kv_cache_fold.py), and why.

The fold pays where a step moves few tokens: there the rotation's launch and the cache write's launch cost more
than the bytes they move, and one launch saves one launch's latency. At many tokens the two are bandwidth-bound,
and where the graph reads k rotated after the write the fused op also joins q's and k's heads first (a copy the
unfused pair does not make). Nothing here times the fold on the device: the bound is vLLM's own for its fusion of
the same pair (`PassConfig.rope_kvcache_fusion_max_token_num`, 256 tokens), taken as the decision until a
measurement replaces it. A graph of a fixed token count is judged by that count; a graph whose token count is
symbolic by the compile range vLLM compiles it for (integrations/vllm_state.py `vllm_compile_range`), and not folded
where the range is unknown or reaches past the bound. A backend asked for by name folds every site it can.
"""

from __future__ import annotations

from typing import Any

import torch

MAX_TOKENS = 256  # vLLM's rope_kvcache_fusion_max_token_num default


def token_range(tokens: Any) -> tuple[int, int] | None:
    """(fewest, most) tokens the graph runs with: its count where fixed, else vLLM's compile range, else None."""
    if isinstance(tokens, int):
        return tokens, tokens
    if isinstance(tokens, torch.SymInt):
        hint = tokens.node.maybe_as_int()
        if hint is not None:
            return hint, hint
    from ...integrations.vllm_state import vllm_compile_range

    return vllm_compile_range()


def decide(backend: str, tokens: Any, max_tokens: int = MAX_TOKENS) -> tuple[bool, str]:
    """(fold, why) for a site whose graph runs `tokens` tokens (an int or a SymInt)."""
    if backend != "auto":
        return True, f"backend {backend!r} asked for: folded at any token count"
    span = token_range(tokens)
    bound = f"not measured: at most {max_tokens} tokens, vLLM's rope_kvcache_fusion_max_token_num"
    if span is None:
        return False, f"token count symbolic and no compile range known; {bound}"
    low, high = span
    where = f"{low} tokens" if low == high else f"compile range [{low}, {high}] tokens"
    if high <= max_tokens:
        return True, f"{where}; {bound}"
    return False, f"{where}, past the bound; {bound}"
