"""rope_fusion: recognise every RoPE in a compiled graph and replace it with one fused rotary op."""

from .ops import apply_rotary, apply_rotary_qk  # noqa: F401
from .passes import Report, RopeFusionPass, inductor_options, install, uninstall  # noqa: F401
from .integrations.vllm import vllm_pass  # noqa: F401  (vLLM resolves __import__("rope_fusion").__dict__["vllm_pass"])
from .integrations.depyf_debug import debug  # noqa: F401

__all__ = ["RopeFusionPass", "Report", "apply_rotary", "apply_rotary_qk", "inductor_options", "install",
           "uninstall", "vllm_pass", "debug"]
