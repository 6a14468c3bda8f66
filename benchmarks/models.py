"""Model-level benchmark: real diffusers / transformers models compiled with and without the fusion pass.

Models (real classes, random weights, bf16, 2 layers or blocks, the real attention shapes):
- `qwen-image`: diffusers QwenImageTransformer2DModel, 1024x1024 latents: 4096 image + 256 text tokens;
- `wan-1.3b`: diffusers WanTransformer3DModel, Wan2.1 1.3B dims, 480x832, 81 frames: 32760 tokens;
- `helios`: diffusers HeliosTransformer3DModel (Wan-like, packed per-batch tables), the same shape;
- `qwen2.5-vl-vision`: transformers Qwen2.5-VL vision tower, 16384 patches;
- `flux`: diffusers FluxTransformer2DModel, Flux.1-dev dims, 2 double + 2 single blocks, 4096 + 512 tokens;
- `hunyuan-video`: diffusers HunyuanVideoTransformer3DModel, 2 + 2 blocks, 544x960, 33 frames: 18360 tokens;
- `ltx-video`: diffusers LTXVideoTransformer3DModel, 2 blocks, 512x704, 121 frames: 5632 tokens;
- `qwen3-8b`: transformers Qwen3Model, Qwen3-8B dims (32/8 heads x 128, per-head q/k RMSNorm), 2 layers,
  8192 tokens prefill; `llama-3-8b` (Llama-3-8B dims) on request, not in the default list;
- `cogvideox-5b` (on request, not in the default list): diffusers CogVideoXTransformer3DModel, CogVideoX-5B dims
  (48 heads x 64, RoPE), 2 blocks, 480x720, 49 frames: 226 text + 17550 video tokens, q and k rotated in
  place on their video rows (`query[:, :, text:] = apply_rotary_emb(...)`), fp32 tables from the pipeline's
  `get_3d_rotary_pos_embed`.

Per model: eager once (the reference), then plain torch.compile and torch.compile + RopeFusionPass(), each
compiled on its first call with caches off (`force_disable_caches`: that call's seconds are the compile time);
outputs are compared (each against eager, and the pass against plain: `agree`). Then `--repeats` repeats,
each timing every variant as the median of several calls (CUDA events, back to back), the variants in turn:
plain, pass, plain#2 on even repeats, plain#2, pass, plain on odd ones. "plain#2" is the plain compiled
function timed again: plain against itself is the run-to-run spread, measured the same way as the speedup.
Printed per model: the median speedup of the pass and its range over the repeats, the spread of plain against
itself, compile times, and the pass's report (sites, kernels, misses and those "left to Inductor", norms
folded, host tables). `--profile` adds the GPU kernels of one call of each variant (no extra compile).
A model whose library is missing or whose build or variant fails is reported with its error and the run goes
on; the JSON is rewritten after every model, so a time limit still leaves the models done so far.

    python -m benchmarks.models --out $OUT/models.json                        # every default model (GPU)
    python -m benchmarks.models --models flux,ltx-video --repeats 5 --profile
    python -m benchmarks.models --models ltx-video --cudagraphs               # both variants under CUDA graphs
    python -m benchmarks.models --quick                                       # tiny configs on the CPU (smoke test)

Without a CUDA device it exits 2 with one line, unless --quick or `--device cpu` says to run on the CPU: a smoke
run, which checks the plumbing and prints no times (benchmarks/device_check.py).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# As a script, benchmarks/ would come first on sys.path and its profile.py shadow the standard library's.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import device_check  # noqa: E402
from benchmarks.kernels import (  # noqa: E402
    environment,
    kernel_times,
    pass_summary,
    print_table,
    raise_recompile_limits,
    warm_up,
    write_json,
)

# ------------------------------------------------------------------------------------------------ models
# Each builder: quick -> (module, forward kwargs), on the current default device (see `build`).

LAYERS = 2  # layers or blocks (of each kind) of the real-size configs; `build(..., layers=)` sets it for one build


def qwen_image(quick: bool) -> tuple[torch.nn.Module, dict]:
    from diffusers import QwenImageTransformer2DModel

    if quick:
        cfg = dict(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
                   axes_dims_rope=(8, 12, 12))
        h = w = 8  # latent patches per side
        txt = 7
    else:
        cfg = dict(num_layers=LAYERS)
        h = w = 64  # 1024 px / 8 (VAE) / 2 (patch)
        txt = 256
    m = QwenImageTransformer2DModel(**cfg)
    return m, dict(hidden_states=torch.randn(1, h * w, m.config.in_channels),
                   encoder_hidden_states=torch.randn(1, txt, m.config.joint_attention_dim),
                   encoder_hidden_states_mask=torch.ones(1, txt, dtype=torch.long), timestep=torch.tensor([0.5]),
                   img_shapes=[[(1, h, w)]], return_dict=False)


def _wan_like(cls_name: str, quick: bool) -> tuple[torch.nn.Module, dict]:
    import diffusers

    cls = getattr(diffusers, cls_name)
    if quick:
        cfg = dict(num_layers=1, num_attention_heads=2, attention_head_dim=32, ffn_dim=64, text_dim=32,
                   freq_dim=32)
        frames, hh, ww, txt = 3, 8, 8, 5
    else:  # Wan 1.3B: 12 heads x 128, ffn 8960; 480x832, 81 frames -> latents 21x60x104 -> 32760 tokens
        cfg = dict(num_layers=LAYERS, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, text_dim=4096,
                   freq_dim=256)
        frames, hh, ww, txt = 21, 60, 104, 512
    if cls_name == "HeliosTransformer3DModel":
        cfg["rope_dim"] = (12, 10, 10) if quick else (44, 42, 42)
    m = cls(**cfg)
    return m, dict(hidden_states=torch.randn(1, m.config.in_channels, frames, hh, ww),
                   timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, txt, m.config.text_dim),
                   return_dict=False)


def wan(quick: bool) -> tuple[torch.nn.Module, dict]:
    return _wan_like("WanTransformer3DModel", quick)


def helios(quick: bool) -> tuple[torch.nn.Module, dict]:
    return _wan_like("HeliosTransformer3DModel", quick)


def qwen25_vl_vision(quick: bool) -> tuple[torch.nn.Module, dict]:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    if quick:
        cfg = Qwen2_5_VLVisionConfig(depth=1, hidden_size=64, intermediate_size=96, num_heads=2,
                                     out_hidden_size=64, fullatt_block_indexes=[0])
        grid = (1, 8, 8)
    else:
        cfg = Qwen2_5_VLVisionConfig(depth=LAYERS, fullatt_block_indexes=[LAYERS - 1])
        grid = (1, 128, 128)  # 16384 patches
    cfg._attn_implementation = "sdpa"
    m = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg)
    n = grid[0] * grid[1] * grid[2]
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    return m, dict(hidden_states=torch.randn(n, patch), grid_thw=torch.tensor([grid]))


def flux(quick: bool) -> tuple[torch.nn.Module, dict]:
    from diffusers import FluxTransformer2DModel

    if quick:
        cfg = dict(in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8))
        h = w = 4
        txt = 8
    else:  # Flux.1-dev dims; 1024 px / 8 (VAE) / 2 (packing) = 64 x 64 image tokens, 512 T5 tokens
        cfg = dict(num_layers=LAYERS, num_single_layers=LAYERS, guidance_embeds=True)
        h = w = 64
        txt = 512
    m = FluxTransformer2DModel(**cfg)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    c = m.config
    return m, dict(hidden_states=torch.randn(1, h * w, c.in_channels),
                   encoder_hidden_states=torch.randn(1, txt, c.joint_attention_dim),
                   pooled_projections=torch.randn(1, c.pooled_projection_dim), timestep=torch.tensor([0.5]),
                   img_ids=img_ids.reshape(h * w, 3), txt_ids=torch.zeros(txt, 3), guidance=torch.tensor([3.5]),
                   return_dict=False)


def hunyuan_video(quick: bool) -> tuple[torch.nn.Module, dict]:
    from diffusers import HunyuanVideoTransformer3DModel

    if quick:
        cfg = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                   num_single_layers=1, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=8,
                   rope_axes_dim=(4, 6, 6))
        frames, hh, ww, txt = 3, 8, 8, 6
    else:  # HunyuanVideo dims (24 heads x 128); 544x960, 33 frames -> latents 9x68x120, patch 2 -> 18360 tokens
        cfg = dict(num_layers=LAYERS, num_single_layers=LAYERS)
        frames, hh, ww, txt = 9, 68, 120, 256
    m = HunyuanVideoTransformer3DModel(**cfg)
    c = m.config
    return m, dict(hidden_states=torch.randn(1, c.in_channels, frames, hh, ww), timestep=torch.tensor([500]),
                   encoder_hidden_states=torch.randn(1, txt, c.text_embed_dim),
                   encoder_attention_mask=torch.ones(1, txt, dtype=torch.long),
                   pooled_projections=torch.randn(1, c.pooled_projection_dim), guidance=torch.tensor([6000.0]),
                   return_dict=False)


def ltx_video(quick: bool) -> tuple[torch.nn.Module, dict]:
    from diffusers import LTXVideoTransformer3DModel

    if quick:
        cfg = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                   cross_attention_dim=32, num_layers=1, caption_channels=16)
        frames, hh, ww, txt = 2, 4, 4, 6
    else:  # LTX-Video dims (32 heads x 64); 512x704, 121 frames -> latents 16x16x22 (VAE 8x32x32) = 5632 tokens
        cfg = dict(num_layers=LAYERS)
        frames, hh, ww, txt = 16, 16, 22, 128
    m = LTXVideoTransformer3DModel(**cfg)
    c = m.config
    return m, dict(hidden_states=torch.randn(1, frames * hh * ww, c.in_channels),
                   encoder_hidden_states=torch.randn(1, txt, c.caption_channels), timestep=torch.tensor([500]),
                   encoder_attention_mask=torch.ones(1, txt, dtype=torch.long), num_frames=frames, height=hh,
                   width=ww, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)


def cogvideox(quick: bool) -> tuple[torch.nn.Module, dict]:
    """CogVideoX rotates only the video rows of q and k, in place (`query[:, :, text:] = apply_rotary_emb(...)`);
    its RoPE tables are an input, made as CogVideoXPipeline._prepare_rotary_positional_embeddings makes them
    (fp32 [frames * h * w, head dim] cos and sin, kept fp32 as the pipeline passes them)."""
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    if quick:  # tests/zoo's tiny CogVideoX
        cfg = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
                   text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8, sample_frames=8,
                   max_text_seq_length=8, use_rotary_positional_embeddings=True)
        frames, hh, ww, txt = 2, 8, 8, 8  # latents
    else:  # CogVideoX-5B: the class defaults but 48 heads (x 64) and RoPE (42 layers; diffusers'
        # scripts/convert_cogvideox_to_diffusers.py); 480x720, 49 frames -> latents 13x60x90, patch 2 ->
        # 13 x 30 x 45 = 17550 video tokens, after 226 T5 tokens
        cfg = dict(num_layers=LAYERS, num_attention_heads=48, attention_head_dim=64,
                   use_rotary_positional_embeddings=True)
        frames, hh, ww, txt = 13, 60, 90, 226
    m = CogVideoXTransformer3DModel(**cfg)
    c = m.config
    p = c.patch_size
    grid = (hh // p, ww // p)
    crops = get_resize_crop_region_for_grid(grid, c.sample_width // p, c.sample_height // p)
    cos, sin = get_3d_rotary_pos_embed(embed_dim=c.attention_head_dim, crops_coords=crops, grid_size=grid,
                                       temporal_size=frames)
    return m, dict(hidden_states=torch.randn(1, frames, c.in_channels, hh, ww),
                   encoder_hidden_states=torch.randn(1, txt, c.text_embed_dim), timestep=torch.tensor([500]),
                   image_rotary_emb=(cos, sin), return_dict=False)


def _llm(kind: str, quick: bool) -> tuple[torch.nn.Module, dict]:
    import transformers

    if quick:
        dims = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=128)
        tokens = 32
    elif kind == "qwen3":  # Qwen3-8B
        dims = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0)
        tokens = 8192
    else:  # Llama-3-8B
        dims = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
        tokens = 8192
    cfg_cls, model_cls = ((transformers.Qwen3Config, transformers.Qwen3Model) if kind == "qwen3"
                          else (transformers.LlamaConfig, transformers.LlamaModel))
    cfg = cfg_cls(num_hidden_layers=2 if quick else LAYERS, **dims)
    cfg._attn_implementation = "sdpa"
    m = model_cls._from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    return m, dict(input_ids=ids, use_cache=False)


def qwen3(quick: bool) -> tuple[torch.nn.Module, dict]:
    return _llm("qwen3", quick)


def llama(quick: bool) -> tuple[torch.nn.Module, dict]:
    return _llm("llama", quick)


# name: (builder, build on the GPU directly). Qwen-Image keeps its RoPE tables on the host on purpose (its
# forward moves them with .to(device), which the pass caches): it is built on the CPU and moved, like a pipeline
# loads it; the others build on the GPU (random init there takes a fraction of the CPU's time).
MODELS: dict[str, tuple[Callable, bool]] = {
    "qwen-image": (qwen_image, False), "wan-1.3b": (wan, True), "helios": (helios, True),
    "qwen2.5-vl-vision": (qwen25_vl_vision, True), "flux": (flux, True), "hunyuan-video": (hunyuan_video, True),
    "ltx-video": (ltx_video, True), "qwen3-8b": (qwen3, True), "llama-3-8b": (llama, True),
    "cogvideox-5b": (cogvideox, True),
}
DEFAULT_MODELS = ["qwen-image", "wan-1.3b", "helios", "qwen2.5-vl-vision", "flux", "hunyuan-video", "ltx-video",
                  "qwen3-8b"]


def _to(v: Any, device: str, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(device, dtype) if v.is_floating_point() else v.to(device)
    if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
        return tuple(t.to(device) for t in v)  # tables (CogVideoX's image_rotary_emb): their dtype as made
    return v


def build(name: str, quick: bool, device: str, dtype: torch.dtype, layers: int = 2) -> tuple[torch.nn.Module, dict]:
    """The model in eval mode on `device` in `dtype`, and its inputs there, with `layers` layers or blocks (of
    each kind) at real size. Built on the GPU where that is allowed; on the CPU (and moved) when that is not, or
    when building on the GPU fails."""
    global LAYERS
    saved, LAYERS = LAYERS, layers
    try:
        return _build(name, quick, device, dtype)
    finally:
        LAYERS = saved


def _build(name: str, quick: bool, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    builder, on_device = MODELS[name]

    def finish(m: torch.nn.Module, inputs: dict) -> tuple[torch.nn.Module, dict]:
        if any(p.is_meta for p in m.parameters()):
            raise RuntimeError("the model was built with parameters on the meta device")
        m = m.to(device, dtype).eval()
        return m, {k: _to(v, device, dtype) for k, v in inputs.items()}

    if on_device and device != "cpu":
        try:
            torch.manual_seed(0)
            with torch.device(device):
                return finish(*builder(quick))
        except Exception as e:  # some __init__ mixes devices: build on the CPU instead
            print(f"  {name}: building on {device} failed ({type(e).__name__}: {e}); building on the CPU", flush=True)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    torch.manual_seed(0)
    return finish(*builder(quick))


# ------------------------------------------------------------------------------------------------ timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(call: Callable[[], Any], n: int, device: str) -> float:
    """Median ms of n calls back to back (CUDA events around each call; wall clock on the CPU)."""
    times = []
    if device == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            s.record()
            call()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in ev]
    else:
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        for o in out:
            t = first_tensor(o)
            if t is not None:
                return t
    for attr in ("sample", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    return None


def compare(got: Any, want: Any) -> dict:
    """Max |difference| and relative 2-norm error (fp64) of the first output tensor."""
    g, w = first_tensor(got), first_tensor(want)
    if g is None or w is None or g.shape != w.shape:
        return {"max": None, "rel": None}
    g, w = g.detach().double(), w.detach().double()
    denom = float(torch.linalg.vector_norm(w)) or 1.0
    return {"max": float((g - w).abs().max()), "rel": float(torch.linalg.vector_norm(g - w)) / denom,
            "finite": bool(torch.isfinite(g).all())}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def _order(r: int, spread: bool) -> list[str]:
    base = ["plain", "pass", "plain#2"] if spread else ["plain", "pass"]
    return base if r % 2 == 0 else base[::-1]


def _range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs} if xs else {}


def caller(fn: Callable, inputs: dict, cudagraphs: bool) -> Callable[[], Any]:
    """One forward. Under CUDA graphs each call is a new step for Inductor's graph trees (their outputs are
    overwritten by the next replay, which a step mark allows)."""
    if not cudagraphs:
        return lambda: fn(**inputs)

    def call() -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return fn(**inputs)
    return call


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def run_model(name: str, quick: bool, device: str, dtype: torch.dtype, backend: str, repeats: int, spread: bool,
              profile: bool, target_s: float, max_calls: int = 30, cudagraphs: bool = False) -> dict:
    """cudagraphs: both variants compiled with Inductor's CUDA graphs (what `mode="reduce-overhead"` sets), so
    the timing is the GPU's work without the host's launch cost."""
    import rope_fusion

    rec: dict = {"model": name, "compile_s": {}, "second_call_s": {}, "err": {}, "ms": {}, "errors": {}}
    t0 = time.perf_counter()
    try:
        m, inputs = build(name, quick, device, dtype)
    except Exception as e:  # a missing library or a config this version does not take
        rec["errors"]["build"] = f"{type(e).__name__}: {e}"[:600]
        traceback.print_exc(limit=4)
        return rec
    rec["build_s"] = round(time.perf_counter() - t0, 1)
    fns: dict[str, Callable] = {}
    p = rope_fusion.RopeFusionPass(backend=backend)
    try:
        with torch.no_grad():
            want = m(**inputs)
            _sync(device)
            outs = {}
            base = {"triton.cudagraphs": True} if cudagraphs else {}
            for v in ("plain", "pass"):
                try:
                    opts = {**base, "post_grad_custom_post_pass": p} if v == "pass" else base
                    fn = torch.compile(m, options=opts) if opts else torch.compile(m)
                    call = caller(fn, inputs, cudagraphs)
                    breaks, skips = _graph_breaks(), _cudagraph_skips()
                    t1 = time.perf_counter()
                    with torch._inductor.config.patch(force_disable_caches=True):
                        out = call()
                        _sync(device)
                    rec["compile_s"][v] = round(time.perf_counter() - t1, 1)
                    rec.setdefault("graph_breaks", {})[v] = _graph_breaks() - breaks
                    t1 = time.perf_counter()
                    out = call()  # a second call: recompiles (and CUDA-graph recording) show here, not in the timing
                    _sync(device)
                    rec["second_call_s"][v] = round(time.perf_counter() - t1, 3)
                    if cudagraphs:  # graphs that Inductor ran without CUDA graphs (a CPU input, say)
                        rec.setdefault("cudagraph_skips", {})[v] = _cudagraph_skips() - skips
                    rec["err"][v] = compare(out, want)
                    first = first_tensor(out)
                    outs[v] = first.clone() if first is not None else out  # a later replay overwrites it
                    fns[v] = call
                except Exception as e:  # a failing variant is reported, never fatal
                    rec["errors"][v] = f"{type(e).__name__}: {e}"[:600]
                    traceback.print_exc(limit=4)
            del want
            if "plain" in outs and "pass" in outs:
                rec["err"]["pass-vs-plain"] = compare(outs["pass"], outs["plain"])
                e_plain, e_pass = rec["err"]["plain"]["rel"], rec["err"]["pass"]["rel"]
                if e_plain is not None and e_pass is not None:  # within the plain compile's own error + bf16 eps
                    rec["agree"] = bool(rec["err"]["pass"].get("finite")) and e_pass <= 2 * e_plain + 2 ** -8
            outs.clear()
            rec["pass"] = pass_summary(p)
            rec["pass_table"] = p.report.table()[:6000]
            if "plain" in fns:
                fns["plain#2"] = fns["plain"]  # the same compiled function, timed again: the spread
            _time_model(rec, fns, device, repeats, spread, target_s, max_calls)
            if profile and fns:
                rec["profile"] = {v: _profile(fns[v], device) for v in ("plain", "pass") if v in fns}
    except Exception as e:  # anything else: the record keeps what was measured
        rec["errors"]["run"] = f"{type(e).__name__}: {e}"[:600]
        traceback.print_exc(limit=4)
    finally:
        fns.clear()
        m = inputs = None
        torch._dynamo.reset()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def _time_model(rec: dict, fns: dict, device: str, repeats: int, spread: bool, target_s: float,
                max_calls: int = 30) -> None:
    if not fns:
        return
    est = {}
    for v in fns:  # a warm call each (synchronised), which sets the calls per repeat
        t1 = time.perf_counter()
        fns[v]()
        _sync(device)
        est[v] = time.perf_counter() - t1
    n = max(3, min(max_calls, int(target_s / max(min(est.values()), 1e-4))))
    rec["calls_per_repeat"] = n
    graphs = _graphs()
    series: dict[str, list] = collections.defaultdict(list)
    for r in range(repeats):
        for v in _order(r, spread and "plain" in fns):
            if v in fns:
                try:
                    series[v].append(time_calls(fns[v], n, device))
                except Exception as e:
                    rec["errors"][f"time {v}"] = f"{type(e).__name__}: {e}"[:600]
    rec["recompiles_while_timing"] = _graphs() - graphs
    rec["ms"] = {v: _range(xs) for v, xs in series.items()}
    pl, pa, p2 = series.get("plain", []), series.get("pass", []), series.get("plain#2", [])
    if pl and len(pl) == len(pa):
        rec["speedup"] = _range([a / b for a, b in zip(pl, pa)])
    if pl and len(pl) == len(p2):
        rec["self_spread"] = _range([b / a for a, b in zip(pl, p2)])


def _profile(call: Callable, device: str, top: int = 12) -> dict:
    times = kernel_times(call, calls=3, device=device)
    ranked = sorted(times.items(), key=lambda kv: -kv[1][1])
    rotary = [(n, c, us) for n, (c, us) in times.items() if "rotary" in n.lower()]
    return {"total_us": sum(us for _, us in times.values()), "launches": sum(c for c, _ in times.values()),
            "rotary_us": sum(us for _, _, us in rotary), "rotary_launches": sum(c for _, c, _ in rotary),
            "top": [[n[:90], c, us] for n, (c, us) in ranked[:top]]}


# ------------------------------------------------------------------------------------------------ output


def _cell(r: dict, key: str) -> Any:
    x = r.get(key) or {}
    return f"{x['median']:.3f} [{x['min']:.3f}, {x['max']:.3f}]" if x else None


def print_summary(records: list[dict], backend: str, dtype: torch.dtype, smoke: bool = False) -> None:
    """The tables of the run; a smoke run's without its times (benchmarks/device_check.py)."""
    rows = []
    for r in records:
        s = r.get("pass") or {}
        timed = [] if smoke else [(r["ms"].get("plain") or {}).get("median"), (r["ms"].get("pass") or {}).get("median"),
                                  _cell(r, "speedup"), _cell(r, "self_spread")]
        rows.append([r["model"], *timed, r["compile_s"].get("plain"),
                     r["compile_s"].get("pass"), s.get("pass_s"), s.get("sites"), s.get("kernels"),
                     s.get("norms_folded"),
                     s.get("left_to_inductor"), s.get("misses"), s.get("host_tables"), len(s.get("errors", [])) or None,
                     r.get("agree"), "; ".join(f"{k}: {v[:50]}" for k, v in r["errors"].items()) or None])
    timed_title = "" if smoke else ("forward ms (median over repeats), speedup of the pass and plain#2/plain "
                                    "(median [min, max] over repeats), ")
    print_table(f"models, {dtype}, pass backend {backend}: {timed_title}compile s (first call, caches off) and the "
                "pass's own s in it", rows,
                ["model", *([] if smoke else ["plain ms", "pass ms", "speedup", "plain#2/plain"]), "compile s",
                 "with pass s", "pass s", "sites",
                 "kernels", "norms folded", "left to Inductor", "misses", "host tables", "pass errors", "agree",
                 "errors"])
    rows = [[r["model"], *((r["err"].get(v) or {}).get(x) for v in ("plain", "pass", "pass-vs-plain")
                           for x in ("max", "rel")), r.get("recompiles_while_timing"),
             (r.get("graph_breaks") or {}).get("plain"), r.get("calls_per_repeat"), r.get("build_s"), r.get("seconds")]
            for r in records]
    print_table("outputs (max |diff|, relative 2-norm) against eager and pass against plain; recompiles while timing, "
                "graph breaks, calls per repeat, build and total seconds", rows,
                ["model", "plain max", "plain rel", "pass max", "pass rel", "p-vs-p max", "p-vs-p rel", "recompiles",
                 "breaks", "calls", "build s", "total s"])
    for r in records:
        if r.get("profile"):
            pr = r["profile"]
            print(f"\n{r['model']}: GPU kernels per call (us): " + ", ".join(
                f"{v} {p['total_us']:.0f} in {p['launches']:.0f} launches (rotary {p['rotary_us']:.0f} in "
                f"{p['rotary_launches']:.0f})" for v, p in pr.items()))
            for v, p in pr.items():
                for n, c, us in p["top"][:8]:
                    print(f"    {v:5s} {us:9.1f} us  x{c:<5.1f} {n}")


def _split(values: list[str] | None) -> list[str]:
    return [x for v in values or [] for x in v.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny configs on the CPU (smoke test)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default: cuda, or cpu with --quick; `--device cpu` without --quick runs the real sizes "
                         "in bf16 on the CPU (minutes per model)")
    ap.add_argument("--out", help="write the results as JSON here (rewritten after every model)")
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS,
                    help=f"comma- or space-separated, of {list(MODELS)}, or 'all' (default: {DEFAULT_MODELS})")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats per variant (default 3)")
    ap.add_argument("--seconds-per-repeat", type=float, default=0.3,
                    help="calls per repeat: about this many seconds of each variant (3 to --max-calls calls)")
    ap.add_argument("--max-calls", type=int, default=30, help="most calls per repeat (default 30)")
    ap.add_argument("--no-spread", action="store_true", help="do not time plain compile against itself")
    ap.add_argument("--profile", action="store_true", help="also the GPU kernels of one call of each variant")
    ap.add_argument("--backend", default="auto", help="RopeFusionPass backend for the pass variant")
    ap.add_argument("--cudagraphs", action="store_true",
                    help="compile both variants with CUDA graphs (as mode='reduce-overhead'): the GPU's time alone")
    args = ap.parse_args(argv)
    names = _split(args.models)
    names = DEFAULT_MODELS if names == ["all"] else names
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}, of {list(MODELS)}")
    device = args.device or ("cpu" if args.quick else "cuda")
    if device == "cuda" and not device_check.gpu_present():
        return device_check.no_gpu("benchmarks.models", "python -m benchmarks.models --quick (tiny configs; "
                                   "--device cpu runs the real sizes there)")
    smoke = device_check.is_smoke(device)
    dtype = torch.bfloat16
    raise_recompile_limits()
    env = environment()
    print("environment:", env, "device:", device, flush=True)
    t_start = time.perf_counter()
    print(f"warm-up (compile workers, Triton, CUDA) {warm_up(device):.1f} s", flush=True)
    result: dict = {"environment": env, "device": device, "argv": sys.argv[1:] if argv is None else argv,
                    "repeats": args.repeats, "backend": args.backend, "cudagraphs": args.cudagraphs, "records": []}
    device_check.announce(device, result)
    for name in names:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name} ...", flush=True)
        rec = run_model(name, args.quick, device, dtype, args.backend, args.repeats, not args.no_spread,
                        args.profile, args.seconds_per_repeat, args.max_calls, args.cudagraphs and device == "cuda")
        result["records"].append(rec)
        write_json(args.out, result, quiet=True)
        sp, ms = rec.get("speedup") or {}, rec.get("ms") or {}
        timed = "" if smoke else (f"plain {(ms.get('plain') or {}).get('median')} ms, pass "
                                  f"{(ms.get('pass') or {}).get('median')} ms, speedup {sp.get('median')} "
                                  f"[{sp.get('min')}, {sp.get('max')}], ")
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name}: {timed}compile {rec['compile_s']}, "
              f"agree {rec.get('agree')}, errors {rec['errors']}"
              + (f", CUDA-graph skips {rec['cudagraph_skips']}" if rec.get("cudagraph_skips") else ""), flush=True)
        if rec.get("pass_table"):
            print("  " + rec["pass_table"].replace("\n", "\n  "), flush=True)
    print_summary(result["records"], args.backend + (", CUDA graphs" if args.cudagraphs and device == "cuda" else ""),
                  dtype, smoke)
    result["seconds"] = time.perf_counter() - t_start
    print(f"\nmodels: {len(result['records'])} models, {result['seconds']:.0f} s", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
