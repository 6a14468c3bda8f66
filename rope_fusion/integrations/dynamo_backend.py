"""`rope_fusion.backend(inner)`: a Dynamo backend that fuses RoPE without Inductor.

    torch.compile(model, backend=rope_fusion.backend("eager"))       # or "aot_eager", "cudagraphs", a callable

Dynamo's graph goes through AOTAutograd (with Inductor's decompositions, so the ATen graphs have the form the
pass's lane rules are written for, except for the ops in `KEPT_WHOLE`, which keep their own kernels;
`decompositions="inductor"` takes Inductor's whole table, "core_aten" torch's core ATen set), `fx_pass`
rewrites each graph it produces (the forward and the backward of a training step, or the inference graph), and
the inner backend runs them:

- "eager" and "aot_eager": the rewritten ATen graphs run op by op (after AOTAutograd both are this; they differ in
  what they compare with: torch's "eager" backend runs Dynamo's graph without AOTAutograd);
- "cudagraphs": torch's cudagraphs backend, whose own forward and backward compilers (CUDA graph trees) receive
  the rewritten graphs: torch builds that backend's AOTAutograd inside its call, so for that call the
  `aot_autograd` it looks up in its module is one that puts `fx_pass` and these decompositions in front;
- "inductor": Inductor compiles, with the Inductor pass (`RopeFusionPass`, its cost model and backends) in its
  post-grad slot, composed with whatever Inductor holds (integrations/installation.py); the fx_pass route would hand
  Inductor the fused op where its own kernels may be faster, which its cost model knows and this one does not;
- an `aot_autograd(...)` backend object: its own compilers, decompositions and partitioner, `fx_pass` before each
  compiler;
- any other callable `inner(gm, example_inputs)` (TorchAir's `get_npu_backend(...)`, a user backend): it is
  handed each rewritten ATen graph as a graph to compile. Backends that trace with AOTAutograd themselves trace
  that graph again, with nothing left to differentiate (TorchAir's own custom-pass option is the direct route).

What the fused op runs without Inductor: its eager kernel (the Triton kernel on CUDA, the reference on the CPU,
torch_npu's ops on an NPU graph, see integrations/fx_pass.py). The backend's `report` is its pass's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from ..passes.report import Report
from ..passes.rope_pass import RopeFusionPass
from .fx_pass import FxPass

INNER_NAMES = ("eager", "aot_eager", "cudagraphs", "inductor")
DECOMPOSITIONS = ("rope", "inductor", "core_aten")

# Ops with kernels of their own that never hold a rotation: "rope" keeps them whole. Inductor's table splits
# them into elementwise ops for its fusion; an inner backend without Inductor then runs each piece as a kernel of
# its own, which made Flux (2+2 blocks, bf16, H200) 0.75x as fast under "cudagraphs" and 0.20x under "eager" as
# the inner alone. A norm kept whole is not folded into the fused op (its rotation still fuses).
KEPT_WHOLE = frozenset({
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "_fused_rms_norm",
    "_fused_rms_norm_backward", "gelu", "gelu_backward", "silu", "silu_backward", "mish", "mish_backward",
    "hardswish", "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "_softmax", "_log_softmax",
    "_softmax_backward_data", "_log_softmax_backward_data", "addmm", "addmv", "baddbmm", "bmm", "mm",
    "convolution", "convolution_backward", "native_dropout", "native_dropout_backward",
    "embedding_dense_backward", "upsample_nearest2d", "upsample_bilinear2d", "upsample_nearest3d",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
})


def _decomposition_table(which: str) -> dict:
    if which in ("rope", "inductor"):
        from torch._inductor.decomposition import select_decomp_table

        table = select_decomp_table()
        if which == "rope":
            table = {op: fn for op, fn in table.items()
                     if getattr(op, "name", lambda: "")().split("::")[-1].split(".")[0] not in KEPT_WHOLE}
        return table
    from torch._decomp import core_aten_decompositions

    return dict(core_aten_decompositions())


def _boxed_nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    from torch._dynamo.backends.debugging import boxed_nop

    return boxed_nop(gm, example_inputs)


class RopeFusionBackend:
    """A Dynamo backend: AOTAutograd, `fx_pass` on every graph it produces, then `inner` (see the module)."""

    def __init__(self, inner: str | Callable = "eager", *, decompositions: str = "rope",
                 pass_: RopeFusionPass | None = None, **pass_kwargs: Any) -> None:
        if isinstance(inner, str) and inner not in INNER_NAMES:
            raise ValueError(f"inner must be one of {INNER_NAMES} or a backend callable, got {inner!r}")
        if not (isinstance(inner, str) or callable(inner)):
            raise TypeError(f"inner must be one of {INNER_NAMES} or a backend callable, got {inner!r}")
        if decompositions not in DECOMPOSITIONS:
            raise ValueError(f"decompositions must be one of {DECOMPOSITIONS}, got {decompositions!r}")
        if pass_ is not None and pass_kwargs:
            raise TypeError("give either a pass or its options, not both")
        if inner == "inductor":
            if pass_ is not None and (not isinstance(pass_, RopeFusionPass) or isinstance(pass_, FxPass)):
                raise TypeError(f"inner='inductor' takes a RopeFusionPass, got {type(pass_).__name__}")
            self.pass_ = pass_ or RopeFusionPass(**pass_kwargs)
        else:
            if pass_ is not None and not isinstance(pass_, FxPass):
                raise TypeError(f"pass_ must be a rope_fusion.FxPass, got {type(pass_).__name__}")
            self.pass_ = pass_ or FxPass(**pass_kwargs)
        self.inner = inner
        self.decompositions = decompositions
        self.__name__ = f"rope_fusion_{inner if isinstance(inner, str) else 'custom'}"

    @property
    def report(self) -> Report:
        return self.pass_.report

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        if self.inner == "inductor":
            return self._inductor(gm, example_inputs, **kwargs)
        if self.inner == "cudagraphs":
            return self._cudagraphs(gm, example_inputs)
        from torch._dynamo.backends.common import AotAutograd, aot_autograd

        if isinstance(self.inner, AotAutograd):
            return aot_autograd(**self._fusing(dict(self.inner.kwargs)))(gm, example_inputs)
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if self.inner in ("eager", "aot_eager"):
            compiler = _boxed_nop
        else:
            compiler = self._handed_to(self.inner)
        kwargs = dict(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition,
                      keep_inference_input_mutations=True)
        return aot_autograd(**self._fusing(kwargs))(gm, example_inputs)

    # -- the compilers, with fx_pass in front -------------------------------------------------------------
    def _fusing(self, kwargs: dict) -> dict:
        """AOTAutograd's arguments with fx_pass before each compiler, and our decompositions where none are set."""
        fw = kwargs["fw_compiler"]
        bw = kwargs.get("bw_compiler") or fw
        inference = kwargs.get("inference_compiler") or fw
        kwargs["fw_compiler"] = self._after_pass(fw, is_inference=False)
        kwargs["bw_compiler"] = self._after_pass(bw, is_inference=False)
        kwargs["inference_compiler"] = self._after_pass(inference, is_inference=True)
        if not kwargs.get("decompositions"):
            kwargs["decompositions"] = _decomposition_table(self.decompositions)
        return kwargs

    def _after_pass(self, compiler: Callable, is_inference: bool) -> Callable:
        @functools.wraps(compiler)
        def compile_fused(gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any, **kw: Any) -> Any:
            self.pass_(gm, example_inputs, is_inference=is_inference)
            return compiler(gm, example_inputs, *args, **kw)
        return compile_fused

    @staticmethod
    def _handed_to(inner: Callable) -> Callable:
        """A Dynamo backend as an AOTAutograd compiler: it gets the ATen graph to compile."""
        def compile_with_inner(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            return inner(gm, list(example_inputs))
        return compile_with_inner

    # -- inner backends that build their own compile ------------------------------------------------------
    def _cudagraphs(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        from torch._dynamo.backends import cudagraphs as module

        with self._aot_autograd_of(module):
            return module.cudagraphs(gm, example_inputs)

    @contextlib.contextmanager
    def _aot_autograd_of(self, module: Any):
        """For one call: the `aot_autograd` that `module` looks up, with fx_pass in front of its compilers."""
        real = module.aot_autograd
        module.aot_autograd = lambda **kwargs: real(**self._fusing(kwargs))
        try:
            yield
        finally:
            module.aot_autograd = real

    def _inductor(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        import torch._inductor.compile_fx as cfx

        from .installation import inductor_options

        patches = {**kwargs.pop("config_patches", {}), **inductor_options(self.pass_)}
        return cfx.compile_fx(gm, example_inputs, config_patches=patches, **kwargs)

    def reset(self) -> None:
        """Dynamo's backend reset (torch._dynamo.reset()): the CUDA graph trees, as torch's backend does."""
        if self.inner == "cudagraphs":
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()

    def __repr__(self) -> str:
        return f"rope_fusion.backend(inner={self.inner!r}, decompositions={self.decompositions!r})"


def backend(inner: str | Callable = "eager", **options: Any) -> RopeFusionBackend:
    """A Dynamo backend that runs AOTAutograd, `fx_pass` on the forward and backward graphs, then `inner`:
    "eager", "aot_eager", "cudagraphs", "inductor", or any backend callable. Options: `decompositions`
    ("inductor" or "core_aten"), `pass_` (an FxPass; a RopeFusionPass for inner="inductor") or the pass's options.
    The returned backend's `report` says what fused."""
    return RopeFusionBackend(inner, **options)


__all__ = ["RopeFusionBackend", "backend", "INNER_NAMES"]

