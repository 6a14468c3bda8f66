"""The pass in vllm-ascend, through its `GraphFusionPassManager`, without importing vLLM until asked.

vllm-ascend (vllm_ascend/platform.py) sets `use_inductor = False` and compiles with its `AscendCompiler`
(vllm_ascend/compilation/compiler_interface.py) in one of two ways, chosen by `additional_config=
{"ascend_compilation_config": {"enable_npugraph_ex": ...}}`:

- `enable_npugraph_ex=True` (the default): `npugraph_ex_compile` builds npugraph_ex's CompilerConfig inside the
  call, from a fixed option dict (force_eager, inplace_pass, clone_input, clone_output, static kernels); no
  option of vLLM's or vllm-ascend's reaches `post_grad_custom_pre_pass`, and vllm-ascend's own fusions there
  are npugraph_ex pattern replacements. A custom FX pass has no entry on that path.
- `enable_npugraph_ex=False`: `fusion_pass_compile` runs AOTAutograd with a forward compiler that calls the
  platform's pass manager, `GraphFusionPassManager`, on each forward GraphModule. vLLM's `configure_post_pass`
  (vllm/compilation/backends.py) adds the pass found under the platform's pass key (`"graph_fusion_manager"`)
  in `compilation_config.inductor_compile_config` to that manager, whose `add` takes only a vLLM
  `VllmInductorPass`; a pass given as a string or through `inductor_passes` is wrapped in vLLM's
  `CallableInductorPass` and fails that check. So the pass goes in as an object:

    from rope_fusion.integrations.vllm_ascend import vllm_ascend_pass
    LLM(model, additional_config={"ascend_compilation_config": {"enable_npugraph_ex": False}},
        compilation_config={"inductor_compile_config": {"graph_fusion_manager": vllm_ascend_pass()}})

`vllm_ascend_pass()` is an instance of a class derived from vLLM's `VllmInductorPass` (built on first call, which
imports vLLM) that runs `FxPass` on the GraphModule it is given: the graph is an AOTAutograd forward graph on the
NPU, so its sites become torch_npu's ops (integrations/fx_pass.py). It reads nothing from a VllmConfig, so it is made
without one (VllmInductorPass's constructor, which wants one, is not called). vLLM deep-copies and pickles its
config: a copy is a new pass with the same options and an empty report, as for `rope_fusion.vllm_pass`.
Checked on the CPU through vllm-ascend's own `GraphFusionPassManager`, imported from its source tree (it needs no
torch_npu; the rest of its compiler does), with stand-in NPU ops (tests/integrations/test_npu_stacks.py); not on Ascend
hardware, and not through a vLLM engine.
"""

from __future__ import annotations

import functools
from typing import Any

from .fx_pass import FxPass


@functools.lru_cache(maxsize=1)
def _pass_class() -> type:
    from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

    class VllmAscendRopeFusionPass(VllmInductorPass):
        """FxPass as a VllmInductorPass, for vllm-ascend's GraphFusionPassManager."""

        def __init__(self, **options: Any) -> None:  # no VllmConfig: nothing is read from it
            self.options = options
            self.fx = FxPass(**options)
            self.pass_name = type(self).__name__

        def __call__(self, graph: Any) -> None:
            self.fx(graph)

        @property
        def report(self):
            return self.fx.report

        def uuid(self) -> str:
            return self.fx.uuid()

        def is_applicable_for_range(self, compile_range: Any) -> bool:
            return True

        def __reduce__(self) -> tuple:
            return (vllm_ascend_pass, (), {"options": self.options})

        def __setstate__(self, state: dict) -> None:
            self.__init__(**state["options"])

    return VllmAscendRopeFusionPass


def vllm_ascend_pass(**options: Any) -> Any:
    """A pass for `compilation_config["inductor_compile_config"]["graph_fusion_manager"]` (imports vLLM).
    Options as FxPass's."""
    return _pass_class()(**options)


__all__ = ["vllm_ascend_pass"]
