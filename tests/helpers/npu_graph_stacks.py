"""npugraph_ex / TorchAir on the CPU: stand-ins for torch_npu's ops with the real schemas and the documented
semantics and constraints (each asserts the constraints and logs its call when it runs, not when the graph's fake
values are propagated), and `npugraph_ex_like`, a Dynamo backend that calls the custom pass as npugraph_ex does.
The graphs are CPU graphs that the pass treats as NPU graphs, so they check what the pass writes into the graph and
that it computes the rotation, not torch_npu's kernels or any Ascend hardware."""

from __future__ import annotations

import types

import torch

import rope_fusion
from rope_fusion.passes import fusion_check

NS = "rope_fusion_test_npu_stacks"
CALLS: list = []
ROTARY_MUL = f"{NS}.npu_rotary_mul.default"
APPLY = f"{NS}.npu_apply_rotary_pos_emb.default"
ROPE_OPS = ("rope_fusion.rotary.default", "rope_fusion.rotary_qk.default")

_lib = torch.library.Library(NS, "DEF")
_lib.define("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor")
_lib.define("npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSH', "
            "str rotary_mode='half') -> (Tensor, Tensor)")

# npu_rotary_mul's documented table shapes per x layout ('half'); 'interleave' takes the first of each only.
_TABLE_FORMS = {"BNSD": ("11SD", "B1SD", "BNSD"), "BSND": ("1S1D", "BS1D", "BSND"), "SBND": ("S11D", "SB1D", "SBND")}


def _documented(x_shape, t_shape, mode) -> bool:
    for layout, forms in _TABLE_FORMS.items():
        sizes = dict(zip(layout, x_shape))
        for form in forms[:1] if mode == "interleave" else forms:
            if all(t == (1 if f == "1" else sizes[f]) for f, t in zip(form, t_shape)):
                b, n = sizes["B"], sizes["N"]
                if (mode == "half" and b < 1000 and n < 1000) or (mode == "interleave" and b * n < 1000):
                    return True
    return False


def _rotate(x, mode):
    if mode == "half":
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


def _rotary_mul(x, r1, r2, rotary_mode="half"):
    assert rotary_mode in ("half", "interleave")
    assert x.dim() == r1.dim() == r2.dim() == 4 and r1.shape == r2.shape
    assert x.dtype == r1.dtype == r2.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert x.shape[-1] % 2 == 0 and x.shape[-1] < 896 and r1.shape[-1] == x.shape[-1]
    assert _documented(tuple(x.shape), tuple(r1.shape), rotary_mode), (x.shape, r1.shape, rotary_mode)
    if not fusion_check.checking():  # the pass's self-check evaluating the graph at compile time
        CALLS.append(("rotary_mul", tuple(x.shape), tuple(r1.shape), rotary_mode))
    return (r1.float() * x.float() + r2.float() * _rotate(x.float(), rotary_mode)).to(x.dtype)


def _apply(query, key, cos, sin, layout="BSH", rotary_mode="half"):
    assert layout in ("BSND", "TND") and rotary_mode == "half", (layout, rotary_mode)
    assert query.dtype == key.dtype == cos.dtype == sin.dtype
    d = query.shape[-1]
    assert d in (64, 128) and key.shape[-1] == d
    assert query.dim() == key.dim() == cos.dim() == (4 if layout == "BSND" else 3)
    assert tuple(cos.shape) == tuple(sin.shape) == (*query.shape[:-2], 1, d), (cos.shape, query.shape)
    assert cos.is_contiguous() and query.is_contiguous() and key.is_contiguous()
    if not fusion_check.checking():  # the pass's self-check evaluating the graph at compile time
        CALLS.append(("apply", tuple(query.shape), tuple(key.shape), layout))
    for t in (query, key):  # in place, as torch_npu's kernel does
        t.copy_(cos.float() * t.float() + sin.float() * _rotate(t.float(), "half"))
    return query, key


_lib.impl("npu_rotary_mul", _rotary_mul, "CPU")
_lib.impl("npu_apply_rotary_pos_emb", _apply, "CPU")
torch.library.register_fake(f"{NS}::npu_rotary_mul", lib=_lib)(
    lambda x, r1, r2, rotary_mode="half": torch.empty_like(x))
torch.library.register_fake(f"{NS}::npu_apply_rotary_pos_emb", lib=_lib)(
    lambda q, k, cos, sin, layout="BSH", rotary_mode="half": (torch.empty_like(q), torch.empty_like(k)))


def npugraph_ex_like(config):
    """A Dynamo backend that calls `config.post_grad_custom_pre_pass(gm, example_inputs, config)` on every ATen
    graph AOTAutograd produces, as npugraph_ex does, then runs the graph; it keeps the graphs' targets."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.decomposition import select_decomp_table

    def compiler(gm, example_inputs):
        config.post_grad_custom_pre_pass(gm, example_inputs, config)
        config.graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return boxed_nop(gm, example_inputs)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=select_decomp_table())


def stack_config(mode="npugraph_ex"):
    """The fields of npugraph_ex's / TorchAir's CompilerConfig that the pass and the harness read."""
    return types.SimpleNamespace(mode=types.SimpleNamespace(value=mode), graphs=[],
                                 post_grad_custom_pre_pass=rope_fusion.FxPass())


def run_stack(fn, args, mode="npugraph_ex"):
    """Under GE (`max-autotune`) TorchAir converts each node and runs the GE graph, so no node is dispatched and
    AOTAutograd's first-call aliasing check of custom ops never sees `npu_apply_rotary_pos_emb`; this harness
    runs the graph's nodes instead, so there it turns that check off. Every other mode keeps it, as npugraph_ex
    does."""
    config = stack_config(mode)
    torch._dynamo.reset()
    with torch._functorch.config.patch(check_custom_op_aliasing=mode != "max-autotune"):
        out = torch.compile(fn, backend=npugraph_ex_like(config), fullgraph=True)(*args)
    return out, config, config.post_grad_custom_pre_pass.report


def graph_targets(config, i=0) -> list:
    """The call targets of the i-th ATen graph the stack compiled, as the pass left it."""
    return config.graphs[i]
