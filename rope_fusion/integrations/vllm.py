"""`rope_fusion.vllm_pass`: the pass as vLLM's compilation config expects it.

vLLM takes a post-grad pass in two forms, and both end with this module-level instance:

    # Python: the object itself
    LLM(model, compilation_config={"inductor_compile_config": {"post_grad_custom_post_pass": rope_fusion.vllm_pass}})
    # CLI: a qualified name, which vLLM resolves as __import__("rope_fusion").__dict__["vllm_pass"]
    vllm serve MODEL -cc.inductor_passes.post_grad_custom_post_pass=rope_fusion.vllm_pass

vLLM checks `isinstance(p, InductorPass)` (its `vllm.compilation.passes.inductor_pass.InductorPass`),
otherwise it wraps a callable in a `CallableInductorPass` whose uuid hashes only the class source, and the
Python form asserts the type outright. So when vLLM is importable the class derives from vLLM's
`InductorPass` (and from `RopeFusionPass` for the behaviour); without vLLM it is a plain torch
`CustomGraphPass`. Its `uuid()` is RopeFusionPass's (hash of the package sources + options), a plain
string, because vLLM's `PostGradPassManager.uuid()` JSON-encodes the uuids of its passes and vLLM's config
hash calls `uuid()` on any object in `inductor_compile_config`.

vLLM deep-copies and pickles its config (and the engine runs in another process): a copy is a new pass with
the same options and an empty report, so read what fused from the `rope_fusion` logger (one INFO line per
graph), not from `rope_fusion.vllm_pass.report`.

Importing vLLM: when vLLM is installed, `import rope_fusion` imports `vllm.compilation.passes.inductor_pass`
(which imports `vllm`, and with it `vllm.env_override`: it sets TORCHINDUCTOR_COMPILE_THREADS=1 and patches
a few Inductor internals). Set ROPE_FUSION_VLLM=0 to skip it; `vllm_pass` is then a plain CustomGraphPass
(fine for torch.compile, rejected by vLLM's Python form).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from torch._inductor.custom_graph_pass import CustomGraphPass

from ..passes.rope_pass import RopeFusionPass


def _find_inductor_pass() -> Any:
    """vLLM's InductorPass class, or None when vLLM is absent, disabled or fails to import."""
    if os.environ.get("ROPE_FUSION_VLLM", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if "vllm" not in sys.modules:
        try:
            if importlib.util.find_spec("vllm") is None:
                return None
        except (ImportError, ValueError):
            return None
    try:
        from vllm.compilation.passes.inductor_pass import InductorPass
    except Exception:  # a vLLM built for another torch may fail in any way; the pass still works without it
        return None
    return InductorPass


InductorPass = _find_inductor_pass()
HAVE_VLLM = InductorPass is not None


def make_pass_class(base: Any = None) -> type:
    """The pass class on top of `base` (vLLM's InductorPass), or of torch's CustomGraphPass when None."""
    if base is None:

        class VllmRopeFusionPass(RopeFusionPass, CustomGraphPass):
            """RopeFusionPass as a torch `CustomGraphPass` (vLLM is not installed)."""

            def uuid(self) -> str:
                return RopeFusionPass.uuid(self)

            def is_applicable_for_range(self, compile_range: Any) -> bool:
                """vLLM's InductorPass API: the pass applies to every compile range."""
                return True

    else:

        class VllmRopeFusionPass(RopeFusionPass, base):  # type: ignore[no-redef, misc, valid-type]
            """RopeFusionPass that is also a vLLM `InductorPass` (vLLM is installed)."""

            def uuid(self) -> str:
                return RopeFusionPass.uuid(self)

    VllmRopeFusionPass.__qualname__ = "VllmRopeFusionPass"  # pickled by reference to this module
    return VllmRopeFusionPass


VllmRopeFusionPass = make_pass_class(InductorPass)

vllm_pass = VllmRopeFusionPass()
"""The instance that vLLM's config names (`rope_fusion.vllm_pass`)."""

__all__ = ["HAVE_VLLM", "InductorPass", "VllmRopeFusionPass", "make_pass_class", "vllm_pass"]
