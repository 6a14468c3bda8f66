"""Drop-in replacements for the RoPE helpers that model code calls today, each backed by the fused op.

Each module keeps its upstream's signature and semantics and translates the upstream table layout into the op's
options (docs/compat.md maps every one):

- `rope_fusion.compat.diffusers.apply_rotary_emb`: diffusers' `models.embeddings.apply_rotary_emb`;
- `rope_fusion.compat.transformers.apply_rotary_pos_emb` and its partial-rotary / interleaved variants;
- `rope_fusion.compat.flash_attn.apply_rotary_emb`: flash-attn's `layers.rotary.apply_rotary_emb`, varlen included;
- `rope_fusion.compat.vllm.rotary_embedding` (in place, as vLLM's `_C` op) and `mrope_rotary_embedding`;
- `rope_fusion.compat.vllm_vision`: vLLM's vision-tower `ApplyRotaryEmb`, reading q and k where they lie;
- `rope_fusion.compat.vllm_omni`: vllm-omni's per-model helpers (Wan, Qwen-Image, the shared torch one) and its
  `fused_qk_norm_rope` / `fused_joint_qkv_norm_rope` (compat/qk_norm_rope.py).

The modules import nothing from their upstreams: they run where the upstream is not installed.
"""

from . import diffusers, flash_attn, transformers, vllm, vllm_omni, vllm_vision  # noqa: F401

__all__ = ["diffusers", "flash_attn", "transformers", "vllm", "vllm_omni", "vllm_vision"]
