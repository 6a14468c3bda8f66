"""Rotary kernels a graph already calls (flash-attn's, vLLM's): recognised as sites by their schema rather than
proved from arithmetic, so that a q/k pair of them becomes one fused call like any other site."""
