"""`rope_fusion.vllm_pass`: the pass as vLLM's compilation config expects it, without importing vLLM.

vLLM takes a post-grad pass in two forms, and both end with `rope_fusion.vllm_pass`:

    # Python: the object itself
    LLM(model, compilation_config={"inductor_compile_config": {"post_grad_custom_post_pass": rope_fusion.vllm_pass}})
    # CLI / string: vLLM resolves it as __import__("rope_fusion").__dict__["vllm_pass"]
    vllm serve MODEL -cc.inductor_passes.post_grad_custom_post_pass=rope_fusion.vllm_pass

vLLM requires an instance of its own `InductorPass` (vllm.compilation.passes.inductor_pass) in the first
form and wraps anything else in a `CallableInductorPass` in the second. Importing that class imports vLLM,
which changes process settings (vllm.env_override sets TORCHINDUCTOR_COMPILE_THREADS=1), so `import
rope_fusion` does not do it. Instead:

- `rope_fusion.vllm_pass` starts as a `VllmRopeFusionPass` on torch's CustomGraphPass, which works with
  plain torch.compile;
- the moment anything imports vLLM's inductor_pass module (vLLM does, before it reads its config), an import
  hook rebinds `rope_fusion.vllm_pass` to an instance of a class derived from both RopeFusionPass and
  vLLM's InductorPass, with the same options; if vLLM was imported before rope_fusion, that happens at once.
So both forms find vLLM's type whichever of the two packages is imported first. The hook is
rope_fusion/import_hooks.py's, registered by the package's `__init__`, which imports this module only when
`rope_fusion.vllm_pass` is first read or vLLM imports that module (this module imports the pass, and with it
Inductor).

The uuid is RopeFusionPass's (hash of the package sources + options), a plain string, because vLLM's
`PostGradPassManager.uuid()` JSON-encodes the uuids of its passes. vLLM deep-copies and pickles its config
(and the engine runs in another process): a copy is a new pass with the same options and an empty report,
so read what fused from the `rope_fusion` logger (one INFO line per graph), not from `vllm_pass.report`.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from ..import_hooks import VLLM_PASS_MODULE
from ..passes.rope_pass import RopeFusionPass


class VllmRopeFusionPass(RopeFusionPass):
    """RopeFusionPass with vLLM's InductorPass interface; derives from vLLM's class once vLLM is imported."""

    def uuid(self) -> str:
        return RopeFusionPass.uuid(self)

    def __reduce__(self) -> tuple:
        # rebuilt on vLLM's InductorPass when the unpickling process has imported it (the engine process)
        return (_restore, (self.__getstate__(),))

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """vLLM's InductorPass API: the pass applies to every compile range."""
        return True

    def replayed_in_cuda_graphs(self) -> bool:
        """vLLM records its compiled graphs in CUDA graphs itself (its cudagraph mode, not Inductor's config):
        under vLLM that mode decides, unless the `cuda_graphs` option does."""
        if self.cuda_graphs is None:
            mode = vllm_cudagraph_mode()
            if mode is not None:
                return mode != "NONE"
        return super().replayed_in_cuda_graphs()


_classes: dict = {}


def pass_class(base: Any = None) -> type:
    """VllmRopeFusionPass, or the same on top of vLLM's InductorPass `base` (made once per base)."""
    if base is None:
        return VllmRopeFusionPass
    if base not in _classes:
        cls = type("VllmRopeFusionPass", (VllmRopeFusionPass, base), {"__module__": __name__,
                                                                    "__doc__": VllmRopeFusionPass.__doc__})
        cls.__qualname__ = "VllmRopeFusionPass"
        _classes[base] = cls
    return _classes[base]


def _restore(state: dict) -> VllmRopeFusionPass:
    return pass_class(vllm_inductor_pass())(**state)


def vllm_cudagraph_mode() -> str | None:
    """The name of the current vLLM config's cudagraph mode ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", ...),
    or None outside a vLLM compile (never imports vLLM)."""
    module = sys.modules.get("vllm.config")
    current = getattr(module, "get_current_vllm_config_or_none", None)
    config = current() if current is not None else None
    mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
    return getattr(mode, "name", None)


def vllm_inductor_pass() -> Any:
    """vLLM's InductorPass when its module is imported already, else None (never imports vLLM)."""
    module = sys.modules.get(VLLM_PASS_MODULE)
    return getattr(module, "InductorPass", None)


vllm_pass: VllmRopeFusionPass = pass_class(vllm_inductor_pass())()
"""The instance that vLLM's config names (`rope_fusion.vllm_pass`)."""


def rebind(module: Any) -> VllmRopeFusionPass:
    """vLLM's inductor_pass module was just imported: the pass becomes an instance of its InductorPass, with the
    same options. Returns the pass (the package binds it as `rope_fusion.vllm_pass`)."""
    global vllm_pass
    base = getattr(module, "InductorPass", None)
    if base is not None and not isinstance(vllm_pass, base):
        vllm_pass = pass_class(base)(**vllm_pass.__getstate__())
    return vllm_pass


def vllm_installed() -> bool:
    """Whether vLLM can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


__all__ = ["VLLM_PASS_MODULE", "VllmRopeFusionPass", "pass_class", "rebind", "vllm_inductor_pass",
           "vllm_installed", "vllm_pass"]
