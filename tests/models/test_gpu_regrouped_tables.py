"""On a GPU, diffusers Kandinsky 6 SR, unmodified and compiled whole: every rotation of every block fuses.

Its rotation matrices are regrouped into tiles of tokens before use (`_local_patch`: reshape -> permute -> flatten)
for its sparse (flex) attention. The CPU tests (test_matrix_tables.py) run the model's own RoPE module,
`_local_patch` and `apply_rotary`; the whole model does not compile on the CPU with or without the pass (flex
attention's CPU lowering fails on its block mask), so this test compiles it whole on CUDA, flex attention in the
graph, and counts the sites: q and k of each block in one launch, and the output against an fp64 eager run, no
further from it than plain compile's.
"""

from __future__ import annotations

import pytest
import torch

import rope_fusion

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = dict(in_visual_dim=4, out_visual_dim=4, time_dim=16, patch_size=(1, 1, 1), model_dim=32, ff_dim=64,
              num_visual_blocks=2, axes_dims=(4, 6, 6))


def test_kandinsky6_sr_fuses_every_rotation_of_every_block():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.Kandinsky6SRTransformer3DModel(**CONFIG).eval()
    x, t = torch.randn(1, 1, 8, 16, 9), torch.tensor([500.0])  # a 1 x 8 x 16 token grid: two 64-token blocks
    with torch.no_grad():
        ref = model.double()(hidden_states=x.double(), timestep=t.double()).sample  # eager, on the CPU
        model = model.float().cuda()
        args = dict(hidden_states=x.cuda(), timestep=t.cuda())
        p = rope_fusion.RopeFusionPass(backend="triton")
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            torch._dynamo.reset()
            fused = torch.compile(model, options={"post_grad_custom_post_pass": p})(**args).sample
            torch._dynamo.reset()
            plain = torch.compile(model, options={"post_grad_custom_post_pass": None})(**args).sample
    rep, table = p.report, p.report.table()
    blocks = CONFIG["num_visual_blocks"]
    assert not rep.errors and not rep.misses, table
    assert len(rep.sites) == 2 * blocks and len(rep.kernels) == blocks, table
    assert all(k.op == "rope_fusion.rotary_qk" and k.backend == "triton" for k in rep.kernels), table
    assert all("transformer_kandinsky6_sr.py" in s.source for s in rep.sites), table

    def err(out):
        return ((out.double().cpu() - ref).norm() / ref.norm()).item()

    assert err(fused) <= err(plain) + torch.finfo(torch.float32).eps, (err(fused), err(plain))
