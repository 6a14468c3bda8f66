"""Kernel- and model-level benchmarks of the fused rotary op (run as scripts; see each module's --help)."""
