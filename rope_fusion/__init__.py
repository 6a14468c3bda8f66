"""rope_fusion: recognise rotary position embeddings in compiled graphs and replace them with one fused op.

An Inductor post-grad pass proves which subgraphs compute a RoPE rotation and replaces q and k with one fused
node; its report says what fused, what was left alone and why:

    import rope_fusion, torch
    p = rope_fusion.RopeFusionPass()
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": p})
    compiled(*inputs)
    print(p.report.table())       # also one INFO line per graph on the "rope_fusion" logger

`rope_fusion.install()` runs the pass in every later torch.compile of the process instead. Importing the
package defines the `rope_fusion::*` ops and imports nothing heavy: no vLLM, no depyf, no Triton (the Triton
backend loads at the first compile that may use it).
"""

from . import compat  # noqa: F401
from .integrations.depyf_debug import debug  # noqa: F401
from .integrations.vllm import vllm_pass  # noqa: F401  (vLLM resolves __import__("rope_fusion").__dict__["vllm_pass"])
from .norm_rope import rms_norm_rope_qk  # noqa: F401
from .ops import apply_rotary, apply_rotary_qk, apply_rotary_qk_kv_cache, apply_rotary_qkv  # noqa: F401
from .passes import Report, RopeFusionPass, inductor_options, install, installed, uninstall  # noqa: F401
from .passes.dynamo_backend import backend  # noqa: F401
from .passes.fx_pass import FxPass, fx_pass  # noqa: F401


def _version() -> str:
    """The installed distribution's version; a source tree that was never installed reads its pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rope_fusion")
    except PackageNotFoundError:
        import os
        import re

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        try:
            with open(path) as f:
                found = re.search(r'(?m)^version\s*=\s*"([^"]+)"', f.read())
        except OSError:
            found = None
        return found.group(1) if found else "0+unknown"


__version__ = _version()

__all__ = ["RopeFusionPass", "Report", "apply_rotary", "apply_rotary_qk", "apply_rotary_qkv", "rms_norm_rope_qk",
           "apply_rotary_qk_kv_cache", "compat", "inductor_options", "install", "installed", "uninstall", "vllm_pass",
           "debug", "fx_pass", "FxPass", "backend", "__version__"]
