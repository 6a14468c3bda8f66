"""rope_fusion: recognise rotary position embeddings in compiled graphs and replace them with one fused op.

Importing it defines the `rope_fusion::*` ops and imports nothing heavy: no vLLM, no depyf, no Triton (the
Triton backend loads at the first compile that may use it). See README.md and docs/design.md.
"""

from .integrations.depyf_debug import debug  # noqa: F401
from .integrations.vllm import vllm_pass  # noqa: F401  (vLLM resolves __import__("rope_fusion").__dict__["vllm_pass"])
from .ops import apply_rotary, apply_rotary_qk, apply_rotary_qkv  # noqa: F401
from .passes import Report, RopeFusionPass, inductor_options, install, installed, uninstall  # noqa: F401
from .passes.dynamo_backend import backend  # noqa: F401
from .passes.fx_pass import FxPass, fx_pass  # noqa: F401

__all__ = ["RopeFusionPass", "Report", "apply_rotary", "apply_rotary_qk", "apply_rotary_qkv", "inductor_options",
           "install", "installed", "uninstall", "vllm_pass", "debug", "fx_pass", "FxPass", "backend"]
