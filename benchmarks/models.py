"""Model-level benchmark: real diffusers / transformers blocks compiled with and without the fusion pass.

Models (bf16, random weights, 2 layers, the real attention shapes):
- diffusers Qwen-Image transformer, 1024x1024 image latents (4096 image tokens + text);
- diffusers Wan 1.3B transformer, 480p 81 frames (32760 tokens);
- diffusers Helios transformer (Wan-like, packed per-batch tables);
- transformers Qwen2.5-VL vision tower, 16384 patches.
Each model is compiled plainly and with RopeFusionPass(backend="auto"); outputs are compared (against eager
and between the two compiled forms) and the speedup of the pass over plain torch.compile is printed.
A model whose library is missing or whose build fails is reported and skipped, never fatal.

    python -m benchmarks.models --out $OUT/models.json    # GPU shapes
    python -m benchmarks.models --quick                   # tiny configs on the CPU (smoke test)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.kernels import bench_ms, environment, max_err, print_table, write_json  # noqa: E402


def qwen_image(quick: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    from diffusers import QwenImageTransformer2DModel

    if quick:
        cfg = dict(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
                   axes_dims_rope=(8, 12, 12))
        h = w = 8  # latent patches per side
        txt = 7
    else:
        cfg = dict(num_layers=2)
        h = w = 64  # 1024 px / 8 (VAE) / 2 (patch)
        txt = 256
    m = QwenImageTransformer2DModel(**cfg)
    b = 1
    inputs = dict(
        hidden_states=torch.randn(b, h * w, m.config.in_channels),
        encoder_hidden_states=torch.randn(b, txt, m.config.joint_attention_dim),
        encoder_hidden_states_mask=torch.ones(b, txt, dtype=torch.long),
        timestep=torch.tensor([0.5]),
        img_shapes=[[(1, h, w)]] * b,
        return_dict=False,
    )
    return m, inputs


def _wan_like(cls_name: str, quick: bool) -> tuple[torch.nn.Module, dict]:
    import diffusers

    cls = getattr(diffusers, cls_name)
    if quick:
        cfg = dict(num_layers=1, num_attention_heads=2, attention_head_dim=32, ffn_dim=64, text_dim=32,
                   freq_dim=32)
        frames, hh, ww, txt = 3, 8, 8, 5
    else:  # Wan 1.3B: 12 heads x 128, ffn 8960; 480x832, 81 frames -> latents 21x60x104 -> 32760 tokens
        cfg = dict(num_layers=2, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, text_dim=4096,
                   freq_dim=256)
        frames, hh, ww, txt = 21, 60, 104, 512
    if cls_name == "HeliosTransformer3DModel":
        cfg["rope_dim"] = (12, 10, 10) if quick else (44, 42, 42)
    m = cls(**cfg)
    inputs = dict(hidden_states=torch.randn(1, m.config.in_channels, frames, hh, ww),
                  timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, txt, m.config.text_dim),
                  return_dict=False)
    return m, inputs


def wan(quick: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    return _wan_like("WanTransformer3DModel", quick)


def helios(quick: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    return _wan_like("HeliosTransformer3DModel", quick)


def qwen25_vl_vision(quick: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    if quick:
        cfg = Qwen2_5_VLVisionConfig(depth=1, hidden_size=64, intermediate_size=96, num_heads=2,
                                     out_hidden_size=64, fullatt_block_indexes=[0])
        grid = (1, 8, 8)
    else:
        cfg = Qwen2_5_VLVisionConfig(depth=2, fullatt_block_indexes=[1])
        grid = (1, 128, 128)  # 16384 patches
    cfg._attn_implementation = "sdpa"
    m = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg)
    n = grid[0] * grid[1] * grid[2]
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    return m, dict(hidden_states=torch.randn(n, patch), grid_thw=torch.tensor([grid]))


MODELS: dict[str, Callable] = {"qwen-image": qwen_image, "wan-1.3b": wan, "helios": helios,
                               "qwen2.5-vl-vision": qwen25_vl_vision}


def _to(v: Any, device: str, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(device, dtype) if v.is_floating_point() else v.to(device)
    return v


def run_model(name: str, quick: bool, device: str, dtype: torch.dtype, backend: str = "auto") -> dict:
    import rope_fusion

    rec: dict = {"model": name, "ms": {}, "err": {}, "fused": {}, "errors": {}}
    try:
        m, inputs = MODELS[name](quick, device, dtype)
    except Exception as e:
        rec["errors"]["build"] = f"{type(e).__name__}: {e}"
        return rec
    m = m.to(device, dtype).eval()
    inputs = {k: _to(v, device, dtype) for k, v in inputs.items()}
    with torch.no_grad():
        want = m(**inputs)
        variants: dict[str, tuple] = {"compile": (None,),
                                      "compile+pass": (rope_fusion.RopeFusionPass(backend=backend),)}
        for v, (p,) in variants.items():
            try:
                torch._dynamo.reset()
                opts = {"post_grad_custom_post_pass": p} if p is not None else None
                fn = torch.compile(m, options=opts) if opts else torch.compile(m)
                t0 = time.perf_counter()
                got = fn(**inputs)
                rec.setdefault("compile_s", {})[v] = round(time.perf_counter() - t0, 1)
                rec["err"][v] = max_err(got, want)
                rec["ms"][v] = bench_ms(lambda fn=fn: fn(**inputs), device)
                if p is not None:
                    rec["fused"] = {"sites": len(p.report.sites), "kernels": len(p.report.kernels),
                                    "misses": len(p.report.misses), "errors": len(p.report.errors),
                                    "host_tables": len(p.report.host_tables)}
                rec.setdefault("_out", {})[v] = got
            except Exception as e:  # a failing variant is reported, never fatal
                rec["errors"][v] = f"{type(e).__name__}: {e}"
                traceback.print_exc(limit=4)
    outs = rec.pop("_out", {})
    if len(outs) == 2:
        rec["err"]["pass-vs-compile"] = max_err(outs["compile+pass"], outs["compile"])
    if "compile" in rec["ms"] and "compile+pass" in rec["ms"]:
        rec["speedup"] = rec["ms"]["compile"] / rec["ms"]["compile+pass"]
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny configs on the CPU (smoke test)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help=f"subset of {list(MODELS)}")
    ap.add_argument("--backend", default="auto", help="RopeFusionPass backend for the compile+pass column")
    args = ap.parse_args(argv)
    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    dtype = torch.bfloat16
    print("environment:", environment(), "device:", device, flush=True)
    t_start = time.perf_counter()
    result: dict = {"environment": environment(), "device": device, "records": []}
    for name in args.models:
        rec = run_model(name, args.quick, device, dtype, args.backend)
        result["records"].append(rec)
        write_json(args.out, result, quiet=True)
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name}: {rec['ms']} speedup {rec.get('speedup')} "
              f"fused {rec['fused']} errors {rec['errors']}", flush=True)
    rows = [[r["model"], r["ms"].get("compile"), r["ms"].get("compile+pass"), r.get("speedup"),
             r["fused"].get("kernels"), r["err"].get("compile"), r["err"].get("compile+pass"),
             r["err"].get("pass-vs-compile"), "; ".join(f"{k}: {v[:60]}" for k, v in r["errors"].items())]
            for r in result["records"]]
    print_table(f"models, {dtype}, ms per forward (median), pass backend {args.backend}", rows,
                ["model", "compile", "compile+pass", "speedup", "fused kernels", "err compile",
                 "err pass", "pass vs compile", "errors"])
    result["seconds"] = time.perf_counter() - t_start
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
