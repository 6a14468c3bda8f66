"""The main job: compile an unmodified diffusers Wan transformer with rope_fusion and show what fused.

    python examples/wan_demo.py                 # tiny random Wan on the CPU
    python examples/wan_demo.py --device cuda   # the same on a GPU (bf16)

Prints a table of fused sites with the model source lines, the largest difference to plain
torch.compile and the pass's own share of the compile time; exits non-zero when nothing fused.
Needs diffusers (in the checkout's `.[test]` extra); without it, it exits 1 with one line that says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import rope_fusion

WAN_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
    text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating weights in `dtype` but for the modules the model keeps in fp32 (`_keep_in_fp32_modules`), as
    diffusers' `from_pretrained(torch_dtype=dtype)` loads them. `model.to(dtype)` would cast those too, and
    diffusers warns that it can give inconsistent results."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_floating_point() and t.dtype != dtype and not keep & set(name.split(".")):
            t.data = t.data.to(dtype)
    return model


def tiny_wan(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A random-weight diffusers WanTransformer3DModel and example inputs (no download)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = cast_as_loaded(WanTransformer3DModel(**WAN_CONFIG).to(device), dtype).eval()
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 16, 16, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(1, 12, 16, device=device, dtype=dtype),
        timestep=torch.tensor([1], device=device),
        return_dict=False,
    )
    return model, inputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: float32 on CPU, bfloat16 on GPU")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here (leave --device out for the CPU)")
    try:
        model, inputs = tiny_wan(args.device, dtype)
    except ImportError as e:
        raise SystemExit(f"examples/wan_demo.py needs diffusers: pip install diffusers (or the checkout's .[test] "
                         f"extra); here: {type(e).__name__}: {e}") from None

    # a cache hit would skip the pass (and its report) on a second run of this script; the compile caches are
    # turned off one by one (`force_disable_caches` would also turn off Dynamo's profile-guided sizes, and say so)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        # Plain compile goes first and pays the process's one-time compile costs (Inductor's workers and
        # toolchain, lazy imports), so the timed compile below is the pass's alone. Timing both and comparing
        # them would measure that order, not the pass: its cost is its own analysis time, which the report keeps.
        torch._dynamo.reset()
        plain = torch.compile(model)(**inputs)[0]

        torch._dynamo.reset()
        p = rope_fusion.RopeFusionPass()
        t0 = time.perf_counter()
        fused = torch.compile(model, options=rope_fusion.inductor_options(p))(**inputs)[0]
        t_fused = time.perf_counter() - t0

    print(f"diffusers WanTransformer3DModel (tiny, random weights) on {args.device}, {dtype}")
    print(p.report.table())
    diff = (fused.float() - plain.float()).abs().max().item()
    print(f"max |fused - plain torch.compile| = {diff:.3g}")
    print(f"compile + first run with the pass: {t_fused:.1f} s, of which the pass's own analysis "
          f"{p.report.seconds:.2f} s ({100 * p.report.seconds / t_fused:.1f}%)")
    if not p.report.sites:
        print("nothing was fused", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
