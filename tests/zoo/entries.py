"""The model zoo: unmodified diffusers and transformers models with tiny random-init configs.

Each entry builds a model (no downloads) and its example inputs, and states how many RoPE sites one
forward pass has, counted from the model's own source (the `note` says where). `kernels` is the number of
fused nodes expected when q and k that share tables are grouped, `qk` how many of those are
`rotary_qk` or `rotary_qkv` (one launch for several tensors). Categories: "must" (every site must fuse) and
"should" (catalogue forms not fused yet, M9's general 2x2 tables: fused correctly or left alone, never a wrong
rewrite). The configs are the team's list of tiny configurations with
which these models build offline.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402

from .harness import TABLE_NAME_RE  # noqa: E402


@dataclasses.dataclass
class Entry:
    name: str
    build: Callable  # () -> (model, kwargs inputs)
    sites: int  # RoPE sites per forward (rotated tensors), counted from the source
    kernels: int  # fused nodes when q/k are grouped
    qk: int  # of which rotary_qk
    source_file: str  # basename that every site's source line must point into
    note: str  # where the sites were counted
    category: str = "must"
    full_compile: bool = False  # also (or only) compiled through full torch.compile
    dtypes: tuple = ("float32", "bfloat16")
    table_re: str = TABLE_NAME_RE
    slow: bool = False  # its float32 case too outside the default selection (its other dtypes are there always)
    compile_note: str = ""  # known limitation of compiling the model at all
    graph_sites: int | None = None  # sites in the compiled graphs when a graph break makes Dynamo
    # reuse one compiled graph for several layers (per-forward sites > sites the pass sees)
    graph_kernels: int | None = None
    expect_failure: str = ""  # the model cannot be compiled at all: the reason (recorded in the table)
    triton_row: bool = False  # also a row with the Triton backend (interpreted on the CPU): what only it folds

    @property
    def compiled_sites(self) -> int:
        return self.sites if self.graph_sites is None else self.graph_sites

    @property
    def compiled_kernels(self) -> int:
        return self.kernels if self.graph_kernels is None else self.graph_kernels

    @property
    def compiled_qk(self) -> int:
        return self.qk if self.graph_kernels is None else self.qk * self.graph_kernels // max(self.kernels, 1)


def _ids(n=16, vocab=128, b=1):
    return torch.randint(3, vocab, (b, n))


def hf_model(config_cls: str, model_cls: str, kwargs: dict, inputs: Callable | None = None,
        attr: str | None = None, attn: str = "sdpa"):
    """A builder of a randomly initialised transformers model, by class names, so that an entry imports
    transformers only when it runs."""
    def build():
        import transformers
        cfg = getattr(transformers, config_cls)(**kwargs)
        cfg._attn_implementation = attn
        model = getattr(transformers, model_cls)(cfg)
        if attr:
            model = getattr(model, attr)
        inp = inputs() if inputs else {"input_ids": _ids(), "use_cache": False}
        return model, inp
    return build


def _df(model_cls: str, kwargs: dict, inputs: Callable, module: str = "diffusers"):
    def build():
        import importlib
        mod = importlib.import_module(module)
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        model = getattr(mod, model_cls)(**kw)
        return model, inputs()
    return build


def _r(*shape):
    return torch.randn(*shape)


def _t(n=1, hi=1000):
    return torch.randint(0, hi, (n,))


LLM = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
LLM16 = dict(LLM, head_dim=16)


def _clvp():
    import transformers
    cfg = transformers.ClvpEncoderConfig(vocab_size=128, hidden_size=128, intermediate_size=128, projection_dim=128,
                                         num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.0,
                                         dropout=0.0)
    return transformers.ClvpEncoder(cfg), {"input_ids": _ids()}


def _vjepa2():
    import transformers
    from transformers.models.vjepa2.modeling_vjepa2 import VJEPA2Encoder
    # head dim 16: d/h/w blocks of 2 * ((16 // 3) // 2) = 4 lanes each, the last 4 lanes pass through
    cfg = transformers.VJEPA2Config(patch_size=4, crop_size=16, frames_per_clip=4, tubelet_size=2, hidden_size=32,
                                    num_attention_heads=2, num_hidden_layers=2, mlp_ratio=2.0)
    cfg._attn_implementation = "sdpa"
    return VJEPA2Encoder(cfg), {"pixel_values_videos": _r(1, 4, 3, 16, 16)}  # 2 x 4 x 4 = 32 tokens


def _gemma4_vision():
    import transformers
    cfg = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                          pooling_kernel_size=2, patch_size=4, position_embedding_size=16)
    cfg._attn_implementation = "sdpa"
    g = torch.arange(4)
    pos = torch.stack(torch.meshgrid(g, g, indexing="xy"), -1).reshape(1, 16, 2)  # (x, y) of a 4 x 4 grid
    return transformers.Gemma4VisionModel(cfg), {"pixel_values": torch.rand(1, 16, 48), "pixel_position_ids": pos}


ENTRIES: list[Entry] = []


def add(*entries: Entry) -> None:
    ENTRIES.extend(entries)


# ------------------------------------------------------------------------------------------------ transformers
_L = "Attention.forward: apply_rotary_pos_emb(q, k) once per layer, 2 layers"
_EP = TABLE_NAME_RE + "|embed_positions"  # GPT-J/CodeGen keep [sin|cos] in a buffer
add(
    Entry("llama", hf_model("LlamaConfig", "LlamaModel", LLM16), 4, 2, 2, "modeling_llama.py",
          "modeling_llama.py Llama" + _L + " (N1)", full_compile=True),
    Entry("qwen2", hf_model("Qwen2Config", "Qwen2Model", LLM), 4, 2, 2, "modeling_qwen2.py",
          "modeling_qwen2.py Qwen2" + _L + " (N1)"),
    Entry("qwen3", hf_model("Qwen3Config", "Qwen3Model", LLM16), 4, 2, 2, "modeling_qwen3.py",
          "modeling_qwen3.py Qwen3" + _L + " (N1, after q/k RMSNorm)"),
    Entry("mistral", hf_model("MistralConfig", "MistralModel", LLM16), 4, 2, 2, "modeling_mistral.py",
          "modeling_mistral.py Mistral" + _L + " (N1)", dtypes=("float32",)),
    Entry("gemma3", hf_model("Gemma3TextConfig", "Gemma3TextModel", dict(LLM16, sliding_window=8)), 4, 2, 2,
          "modeling_gemma3.py", "modeling_gemma3.py Gemma3" + _L + "; sliding and full layers use "
          "different tables (local/global rope), still one q/k pair per layer"),
    Entry("gpt_neox", hf_model("GPTNeoXConfig", "GPTNeoXModel", LLM), 4, 2, 2, "modeling_gpt_neox.py",
          "modeling_gpt_neox.py GPTNeoXAttention.forward: apply_rotary_pos_emb on q/k[..., :R] with "
          "R = 0.25*16 = 4, cat with the pass-through (N3), 2 layers"),
    Entry("phi", hf_model("PhiConfig", "PhiModel", LLM), 4, 2, 2, "modeling_phi.py",
          "modeling_phi.py PhiAttention.forward: partial rotary R = 0.5*16 split in the caller (M4), 2 layers"),
    Entry("phi3", hf_model("Phi3Config", "Phi3Model", dict(LLM, partial_rotary_factor=0.5, pad_token_id=0)), 4, 2, 2,
          "modeling_phi3.py", "modeling_phi3.py apply_rotary_pos_emb with q[..., :rotary_dim] (R = 8 of 16), "
          "2 layers"),
    Entry("gptj", hf_model("GPTJConfig", "GPTJModel", {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8,
                                                   "n_positions": 128, "vocab_size": 128}), 4, 2, 2,
          "modeling_gptj.py", "modeling_gptj.py GPTJAttention.forward: apply_rotary_pos_emb(k_rot), "
          "apply_rotary_pos_emb(q_rot), rotate_every_two (I6), R = 8 of 16, 2 layers", table_re=_EP),
    Entry("codegen", hf_model("CodeGenConfig", "CodeGenModel", {"n_embd": 64, "n_layer": 2, "n_head": 4,
                                                           "rotary_dim": 8, "n_positions": 128, "n_ctx": 128,
                                                           "vocab_size": 128}), 4, 2, 2,
          "modeling_codegen.py", "modeling_codegen.py CodeGenAttention.forward: k_rot/q_rot, rotate_every_two "
          "(I6), R = 8 of 16, 2 layers", table_re=_EP, dtypes=("float32",)),
    Entry("falcon", hf_model("FalconConfig", "FalconModel", {"vocab_size": 128, "hidden_size": 64,
                                                        "num_hidden_layers": 2, "num_attention_heads": 4,
                                                        "new_decoder_architecture": True, "num_kv_heads": 2,
                                                        "max_position_embeddings": 128}), 4, 2, 2,
          "modeling_falcon.py", "modeling_falcon.py FalconAttention.forward: apply_rotary_pos_emb(q, k), 2 layers"),
    Entry("cohere", hf_model("CohereConfig", "CohereModel", LLM), 4, 2, 2, "modeling_cohere.py",
          "modeling_cohere.py Cohere" + _L + " (M1: interleaved rotate_half, repeat_interleave tables, "
          ".float() upcast)"),
    Entry("glm4", hf_model("Glm4Config", "Glm4Model", dict(LLM16, pad_token_id=0, eos_token_id=1)), 4, 2, 2,
          "modeling_glm4.py", "modeling_glm4.py Glm4" + _L + " (M1, partial 0.5: R = 8 of 16)"),
    Entry("helium", hf_model("HeliumConfig", "HeliumModel", LLM16), 4, 2, 2, "modeling_helium.py",
          "modeling_helium.py Helium" + _L + " (M1 interleaved)", dtypes=("float32",)),
    Entry("ernie4_5", hf_model("Ernie4_5Config", "Ernie4_5Model", LLM16), 4, 2, 2, "modeling_ernie4_5.py",
          "modeling_ernie4_5.py Ernie4_5" + _L + " (M1 interleaved, fp32 math)"),
    Entry("gpt_oss", hf_model("GptOssConfig", "GptOssModel", dict(LLM16, num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=8), attn="eager"), 4, 2, 2,
          "modeling_gpt_oss.py",
          "modeling_gpt_oss.py GptOss" + _L + " (M2: chunk halves, half tables, _apply_rotary_emb per tensor)"),
    Entry("deepseek_v2", hf_model("DeepseekV2Config", "DeepseekV2Model", dict(
        LLM, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4)), 4, 2, 2,
          "modeling_deepseek_v2.py",
          "modeling_deepseek_v2.py DeepseekV2Attention.forward: apply_rotary_emb(q_pe, k_pe) (complex, C2/M12) on "
          "the rope part (R = 8) split from q and the shared k_pe, 2 layers; q's site is cat(q_nope, q_pe), the "
          "whole head (rotary_offset 8), and shares one rotary_qk with k_pe (offset_q_only)"),
    Entry("llama4", hf_model("Llama4TextConfig", "Llama4TextModel", dict(
        LLM16, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1,
        no_rope_layers=[1, 1], attention_chunk_size=16)), 4, 2, 2, "modeling_llama4.py",
          "modeling_llama4.py Llama4TextAttention.forward: apply_rotary_emb(q, k) (view_as_complex, M12) in every "
          "layer with no_rope_layers[i] == 1, 2 layers"),
    Entry("deepseek_v3", hf_model("DeepseekV3Config", "DeepseekV3Model", dict(
        LLM, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4)), 4, 2, 2,
          "modeling_deepseek_v3.py",
          "modeling_deepseek_v3.py apply_rotary_pos_emb_interleave(q_rot, k_rot) (M8: de-interleave then NeoX), "
          "2 layers; q's site is cat(q_pass, q_rot), the whole head (rotary_offset 8), and shares one rotary_qk "
          "with k_rot (offset_q_only)", dtypes=("float32",)),
    Entry("clvp", _clvp, 6, 2, 2, "modeling_clvp.py",
          "modeling_clvp.py ClvpSelfAttention.forward: apply_rotary_pos_emb(query_rot, key_rot, value_rot) (M10: "
          "q, k AND v rotated by one table: one rotary_qkv per layer), 2 layers", dtypes=("float32",)),
    Entry("vjepa2", _vjepa2, 4, 2, 2, "modeling_vjepa2.py",
          "modeling_vjepa2.py VJEPA2RopeAttention.apply_rotary_embeddings(key), (query) (M11: head dim in 3 blocks): "
          "rotate_queries_or_keys on the d/h/w blocks (interleaved pairs, sin/cos computed in the graph from the "
          "token ids, widths 4 + 4 + 4 of 16) and torch.cat with the pass-through tail; VJEPA2Encoder, 2 layers",
          dtypes=("float32", "bfloat16")),
    Entry("gemma4.vision", _gemma4_vision, 4, 2, 2, "modeling_gemma4.py",
          "modeling_gemma4.py Gemma4VisionAttention.forward: apply_multidimensional_rope(q), (k) after q/k RMSNorm "
          "(M11: head dim in 2 blocks): torch.split into ndim = 2 blocks of 8, apply_rotary_pos_emb (NeoX) with the "
          "matching slices of one cos/sin, torch.cat; Gemma4VisionModel, 2 layers", dtypes=("float32",),
          compile_note="2 graphs: hidden_states[pooler_mask] (aten.nonzero) breaks the graph after the pooler; "
                       "all 4 sites are in the first graph"),
)


# ------------------------------------------------------------------------------------------------ diffusers
def _qwen25_vl_vision():
    import transformers
    cfg = transformers.Qwen2_5_VLConfig(**{
        "vocab_size": 152064, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 32, "num_heads": 4,
                          "out_hidden_size": 32, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}})
    cfg.vision_config._attn_implementation = "sdpa"
    model = transformers.Qwen2_5_VLModel(cfg).visual
    return model, {"hidden_states": _r(16, 1176), "grid_thw": torch.tensor([[1, 4, 4]])}


WAN = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
       "out_channels": 4, "text_dim": 16, "freq_dim": 256, "ffn_dim": 32, "num_layers": 2,
       "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32}

add(
    Entry("qwen2_5_vl.vision", _qwen25_vl_vision, 4, 2, 2, "modeling_qwen2_5_vl.py",
          "Qwen2_5_VLVisionAttention.forward: apply_rotary_pos_emb_vision(q, k) (fp32 upcast, [S,H,D]), "
          "depth 2", full_compile=True, graph_sites=2, graph_kernels=1,
          compile_note="13 graphs: get_vision_window_index and the attention's lengths.tolist() break the "
                       "graph; both blocks reuse one compiled attention graph, so the pass sees 2 of 4 sites"),
    Entry("wan", _df("WanTransformer3DModel", WAN, lambda: {
        "hidden_states": _r(1, 4, 2, 16, 16), "encoder_hidden_states": _r(1, 12, 16), "timestep": _t()}),
        4, 2, 2, "transformer_wan.py",
        "WanAttnProcessor.__call__: apply_rotary_emb(query), apply_rotary_emb(key) in attn1 only "
        "(attn2 gets rotary_emb=None), 2 blocks", full_compile=True),
    Entry("helios", _df("HeliosTransformer3DModel", {
        "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
        "out_channels": 4, "text_dim": 16, "freq_dim": 256, "ffn_dim": 32, "num_layers": 2,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_dim": [4, 4, 4],
        "has_multi_term_memory_patch": True, "guidance_cross_attn": True, "zero_history_timestep": True,
        "is_amplify_history": False}, lambda: {
        "hidden_states": _r(1, 4, 2, 16, 16), "timestep": _t(), "encoder_hidden_states": _r(1, 12, 16),
        "indices_hidden_states": torch.tensor([[4.0, 5.0]]), "indices_latents_history_short": torch.tensor([[3.0]]),
        "indices_latents_history_mid": torch.tensor([[2.0]]),
        "indices_latents_history_long": torch.tensor([[0.0, 0.0, 1.0, 1.0]]),
        "latents_history_short": _r(1, 4, 1, 16, 16), "latents_history_mid": _r(1, 4, 1, 16, 16),
        "latents_history_long": _r(1, 4, 4, 16, 16)}),
        4, 2, 2, "transformer_helios.py",
        "HeliosAttnProcessor.__call__: apply_rotary_emb_transposed(query/key) in attn1 only, 2 blocks",
        full_compile=True),
    Entry("qwenimage", _df("QwenImageTransformer2DModel", {
        "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 4, "joint_attention_dim": 16, "guidance_embeds": False,
        "axes_dims_rope": [8, 4, 4]}, lambda: {
        "hidden_states": _r(1, 16, 16), "encoder_hidden_states": _r(1, 8, 16),
        "encoder_hidden_states_mask": torch.ones(1, 8, dtype=torch.long), "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 4, 4)]]}),
        8, 4, 4, "transformer_qwenimage.py",
        "QwenDoubleStreamAttnProcessor2_0.__call__: apply_rotary_emb_qwen on img q/k (img_freqs) and txt "
        "q/k (txt_freqs), complex64, 2 blocks", full_compile=True, triton_row=True),
)


def _qwen25_vl_text():
    import transformers
    cfg = transformers.Qwen2_5_VLTextConfig(vocab_size=128, hidden_size=32, intermediate_size=37,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                             "rope_theta": 10000.0})
    cfg._attn_implementation = "sdpa"
    model = transformers.Qwen2_5_VLTextModel(cfg)
    pos = torch.stack([torch.arange(12), torch.arange(12) // 2, torch.arange(12) % 4])[:, None, :]
    return model, {"input_ids": _ids(12), "position_ids": pos, "use_cache": False}


def _qwen2_vl():
    import transformers
    cfg = transformers.Qwen2VLConfig(**{
        "vocab_size": 152064, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 32, "mlp_ratio": 4, "num_heads": 4,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}})
    cfg._attn_implementation = "sdpa"
    cfg.vision_config._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = "sdpa"
    model = transformers.Qwen2VLModel(cfg)
    ids = torch.randint(3, 1000, (1, 12))
    ids[0, 2] = cfg.vision_start_token_id
    ids[0, 3:7] = cfg.image_token_id
    ids[0, 7] = cfg.vision_end_token_id
    tt = torch.zeros(1, 12, dtype=torch.long)
    tt[0, 3:7] = 1
    return model, {"input_ids": ids, "pixel_values": _r(16, 1176), "image_grid_thw": torch.tensor([[1, 4, 4]]),
                   "attention_mask": torch.ones(1, 12, dtype=torch.long), "mm_token_type_ids": tt,
                   "use_cache": False}


add(
    Entry("qwen2_5_vl.text", _qwen25_vl_text, 4, 2, 2, "modeling_qwen2_5_vl.py",
          "Qwen2_5_VLAttention.forward: apply_rotary_pos_emb(q, k) with mrope tables ([3,B,S] position ids "
          "mixed by mrope_section in the rotary module), 2 layers"),
    Entry("qwen2_vl", _qwen2_vl, 8, 4, 4, "modeling_qwen2_vl.py",
          "vision: VisionAttention.forward apply_rotary_pos_emb_vision(q, k) x depth 2 (N2); text: "
          "Qwen2VLAttention.forward apply_multimodal_rotary_pos_emb(q, k) x 2 layers",
          graph_sites=6, graph_kernels=3, dtypes=("float32",),
          compile_note="multimodal rope index and vision cu_seqlens use .tolist()/itertools: graph breaks; "
                       "both vision blocks reuse one compiled graph (pass sees 2 of 4 vision sites)"),
)


# ------------------------------------------------------------------------------------------------ diffusers (2)
_EMB = "embeddings.py"  # diffusers' shared apply_rotary_emb: the innermost frame of the products


def _df_src(own: str) -> str:
    return own + "|" + _EMB


def _allegro():
    import diffusers
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro
    model = diffusers.AllegroTransformer3DModel(
        num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, num_layers=2,
        cross_attention_dim=24, sample_width=8, sample_height=8, sample_frames=8, caption_channels=8)
    c = model.config
    # the tables and positions as AllegroPipeline._prepare_rotary_positional_embeddings builds them:
    # 2 frames x 4 x 4 patches
    ft, fh, fw, gt, gh, gw = get_3d_rotary_pos_embed_allegro(
        embed_dim=c.attention_head_dim, crops_coords=((0, 0), (4, 4)), grid_size=(4, 4), temporal_size=2,
        interpolation_scale=(c.interpolation_scale_t, c.interpolation_scale_h, c.interpolation_scale_w))
    pos = torch.cartesian_prod(gt.long(), gh.long(), gw.long()).reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1)
    return model, {"hidden_states": _r(2, 4, 2, 8, 8), "encoder_hidden_states": _r(2, 16, 8), "timestep": _t(2),
                   "image_rotary_emb": ((ft, fh, fw), tuple(pos.contiguous()))}


add(
    Entry("wan_vace", _df("WanVACETransformer3DModel", {
        "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 16,
        "out_channels": 16, "text_dim": 32, "freq_dim": 256, "ffn_dim": 32, "num_layers": 4,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32,
        "vace_layers": [0, 2], "vace_in_channels": 48}, lambda: {
        "hidden_states": _r(1, 16, 2, 16, 16), "encoder_hidden_states": _r(1, 12, 32),
        "control_hidden_states": _r(1, 48, 2, 16, 16), "timestep": _t()}),
        12, 6, 6, "transformer_wan.py",
        "transformer_wan_vace.py: 4 WanTransformerBlocks + 2 WanVACETransformerBlocks (vace_layers [0, 2]), each "
        "attn1(rotary_emb) -> WanAttnProcessor apply_rotary_emb(query/key) in transformer_wan.py",
        dtypes=("float32",), slow=True),
    Entry("flux", _df("FluxTransformer2DModel", {
        "patch_size": 1, "in_channels": 4, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
        "axes_dims_rope": [4, 4, 8]}, lambda: {
        "hidden_states": _r(1, 16, 4), "encoder_hidden_states": _r(1, 48, 32), "pooled_projections": _r(1, 32),
        "img_ids": _r(16, 3), "txt_ids": _r(48, 3), "timestep": torch.tensor([0.5])}),
        4, 2, 2, _df_src("transformer_flux.py"),
        "transformer_flux.py FluxAttnProcessor: apply_rotary_emb(query/key, image_rotary_emb) (I4) in the double "
        "block (joint txt+img) and in the single block: 1 + 1 blocks", triton_row=True),
    Entry("flux2", _df("Flux2Transformer2DModel", {
        "patch_size": 1, "in_channels": 4, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "timestep_guidance_channels": 256,
        "axes_dims_rope": [4, 4, 4, 4]}, lambda: {
        "hidden_states": _r(1, 16, 4), "encoder_hidden_states": _r(1, 48, 32),
        "img_ids": torch.randint(0, 4, (1, 16, 4)), "txt_ids": torch.randint(0, 4, (1, 48, 4)),
        "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5])}),
        4, 2, 2, _df_src("transformer_flux2.py"),
        "transformer_flux2.py Flux2AttnProcessor (double) + Flux2ParallelSelfAttnProcessor (single): "
        "apply_rotary_emb(query/key), 1 + 1 blocks", dtypes=("float32",), triton_row=True),
    Entry("hunyuan_video", _df("HunyuanVideoTransformer3DModel", {
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10, "num_layers": 1,
        "num_single_layers": 1, "num_refiner_layers": 1, "patch_size": 1, "patch_size_t": 1,
        "guidance_embeds": True, "text_embed_dim": 16, "pooled_projection_dim": 8, "rope_axes_dim": [2, 4, 4],
        "image_condition_type": None}, lambda: {
        "hidden_states": _r(1, 4, 1, 16, 16), "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _r(1, 12, 16), "pooled_projections": _r(1, 8),
        "encoder_attention_mask": torch.ones(1, 12), "guidance": torch.tensor([3.5])}),
        4, 2, 2, _df_src("transformer_hunyuan_video.py"),
        "transformer_hunyuan_video.py HunyuanVideoAttnProcessor2_0: apply_rotary_emb on the image part of q/k "
        "(single block: q[:, :-txt] then cat, M6), 1 double + 1 single block; the token refiner has no rope",
        triton_row=True),
    Entry("cogvideox", _df("CogVideoXTransformer3DModel", {
        "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4, "out_channels": 4,
        "time_embed_dim": 2, "text_embed_dim": 8, "num_layers": 2, "sample_width": 8, "sample_height": 8,
        "sample_frames": 8, "patch_size": 2, "patch_size_t": None, "temporal_compression_ratio": 4,
        "max_text_seq_length": 8, "use_rotary_positional_embeddings": True}, lambda: {
        "hidden_states": _r(2, 1, 4, 8, 8), "encoder_hidden_states": _r(2, 8, 8), "timestep": _t(2),
        "image_rotary_emb": (_r(16, 16), _r(16, 16))}),
        4, 2, 2, "attention_processor.py|embeddings.py",
        "attention_processor.py CogVideoXAttnProcessor2_0: query[:, :, text_seq_length:] = apply_rotary_emb(...) "
        "and the same for key (M6), 2 blocks", triton_row=True),
    Entry("ltx", _df("LTXVideoTransformer3DModel", {
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
        "cross_attention_dim": 16, "num_layers": 1, "qk_norm": "rms_norm_across_heads", "caption_channels": 16},
        lambda: {"hidden_states": _r(2, 512, 4), "encoder_hidden_states": _r(2, 16, 16), "timestep": _t(2),
                 "encoder_attention_mask": torch.ones(2, 16, dtype=torch.bool), "num_frames": 2, "height": 16,
                 "width": 16}),
        2, 1, 1, "transformer_ltx.py",
        "transformer_ltx.py LTXVideoAttnProcessor: apply_rotary_emb(query/key) (I8, [B,S,H*D]) in attn1; attn2 "
        "gets image_rotary_emb=None; 1 block"),
    Entry("ltx2", _df("LTX2VideoTransformer3DModel", {
        "in_channels": 4, "out_channels": 4, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 2,
        "attention_head_dim": 8, "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4,
        "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
        "num_layers": 2, "qk_norm": "rms_norm_across_heads", "caption_channels": 16,
        "rope_double_precision": False}, lambda: _ltx2_inputs()),
        16, 8, 8, "transformer_ltx2.py",
        "transformer_ltx2.py LTX2AudioVideoAttnProcessor: per block attn1 (video q/k), audio_attn1 (audio q/k), "
        "audio_to_video_attn (q: video ca tables, k: audio ca tables) and video_to_audio_attn (the reverse); "
        "attn2/audio_attn2 get no rope; 2 blocks -> 16 sites. Sites that share tables share a launch: the a2v "
        "query (video ca tables) pairs with the v2a key (video ca tables), and the other way round, so 8 q/k "
        "kernels"),
    Entry("ltx2_split", _df("LTX2VideoTransformer3DModel", {
        "in_channels": 4, "out_channels": 4, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 2,
        "attention_head_dim": 8, "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4,
        "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
        "num_layers": 2, "qk_norm": "rms_norm_across_heads", "caption_channels": 16,
        "rope_double_precision": False, "rope_type": "split"}, lambda: _ltx2_inputs()),
        16, 8, 8, "transformer_ltx2.py", "as ltx2 with apply_split_rotary_emb (N6: addcmul_ on views)",
        slow=True),
    Entry("stable_audio", _df("StableAudioDiTModel", {
        "sample_size": 4, "in_channels": 3, "num_layers": 2, "attention_head_dim": 4,
        "num_key_value_attention_heads": 2, "out_channels": 3, "cross_attention_dim": 4, "time_proj_dim": 8,
        "global_states_input_dim": 8, "cross_attention_input_dim": 4}, lambda: {
        "hidden_states": _r(1, 3, 8), "timestep": _t(), "encoder_hidden_states": _r(1, 4, 4),
        "global_hidden_states": _r(1, 1, 8), "rotary_embedding": (_r(9, 2), _r(9, 2))}),
        4, 2, 2, "attention_processor.py|embeddings.py",
        "attention_processor.py StableAudioAttnProcessor2_0: partial apply_rotary_emb on query and key (N4, "
        "R = 2 of 4) in attn1 (self); attn2 is cross-attention (no key rope, no rotary passed); 2 blocks"),
    Entry("lumina2", _df("Lumina2Transformer2DModel", {
        "sample_size": 16, "patch_size": 2, "in_channels": 4, "hidden_size": 24, "num_layers": 2,
        "num_refiner_layers": 1, "num_attention_heads": 3, "num_kv_heads": 1, "multiple_of": 2,
        "ffn_dim_multiplier": None, "norm_eps": 1e-05, "scaling_factor": 1.0, "axes_dim_rope": [4, 2, 2],
        "axes_lens": [128, 128, 128], "cap_feat_dim": 32}, lambda: {
        "hidden_states": _r(2, 4, 16, 16), "encoder_hidden_states": _r(2, 16, 32), "timestep": torch.tensor([0.5, 0.5]),
        "encoder_attention_mask": torch.ones(2, 16, dtype=torch.bool)}),
        8, 4, 4, _df_src("transformer_lumina2.py"),
        "transformer_lumina2.py Lumina2AttnProcessor2_0: apply_rotary_emb(query/key, use_real=False) (C2) in "
        "noise_refiner (1) + context_refiner (1) + layers (2) = 4 blocks", dtypes=("float32",)),
    Entry("omnigen", _df("OmniGenTransformer2DModel", {
        "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 32,
        "num_layers": 2, "pad_token_id": 0, "vocab_size": 1000, "in_channels": 4, "time_step_dim": 4,
        "rope_scaling": {"long_factor": [1, 2], "short_factor": [1, 2]}}, lambda: {
        "hidden_states": _r(2, 4, 8, 8), "timestep": torch.tensor([0.5, 0.5]),
        "input_ids": torch.randint(3, 1000, (2, 24)),
        "input_img_latents": [_r(1, 4, 8, 8)], "input_image_sizes": {0: [[0, 16]]},
        "attention_mask": torch.ones(2, 41, 41), "position_ids": torch.arange(41).repeat(2, 1)}),
        4, 2, 2, _df_src("transformer_omnigen.py"),
        "transformer_omnigen.py OmniGenAttnProcessor2_0: apply_rotary_emb(query/key, use_real_unbind_dim=-2) "
        "(N5), num_layers reduced from the zoo's 20 to 2", dtypes=("float32",),
        table_re=TABLE_NAME_RE + r"|^l_stack0_[01]_$",
        compile_note="4 graphs: the tables reach the layers' graph through a graph break (resume inputs stack0)"),
    Entry("z_image", _df("ZImageTransformer2DModel", {
        "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 16, "n_layers": 1,
        "n_refiner_layers": 1, "n_heads": 1, "n_kv_heads": 2, "qk_norm": True, "cap_feat_dim": 16,
        "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [8, 4, 4], "axes_lens": [256, 32, 32]}, lambda: {
        "x": [_r(16, 1, 16, 16)], "cap_feats": [_r(16, 16)], "t": torch.tensor([0.5])}),
        6, 3, 3, "transformer_z_image.py",
        "transformer_z_image.py ZSingleStreamAttnProcessor: apply_rotary_emb(query/key, freqs_cis) (complex, "
        "M12) in noise_refiner (1) + context_refiner (1) + layers (1) = 3 blocks", dtypes=("float32",)),
    Entry("cosmos", _df("CosmosTransformer3DModel", {
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 12, "num_layers": 2,
        "mlp_ratio": 2, "text_embed_dim": 16, "adaln_lora_dim": 4, "max_size": [4, 32, 32], "patch_size": [1, 2, 2],
        "rope_scale": [2.0, 1.0, 1.0], "concat_padding_mask": False, "extra_pos_embed_type": "learnable"},
        lambda: {"hidden_states": _r(1, 4, 1, 16, 16), "timestep": _t(), "encoder_hidden_states": _r(1, 12, 16),
                 "attention_mask": torch.ones(1, 12), "fps": 30}),
        4, 2, 2, _df_src("transformer_cosmos.py"),
        "transformer_cosmos.py CosmosAttnProcessor2_0: apply_rotary_emb(query/key, use_real_unbind_dim=-2) in "
        "attn1 only, 2 blocks"),
    Entry("hidream", _df("HiDreamImageTransformer2DModel", {
        "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 1, "num_single_layers": 1,
        "attention_head_dim": 8, "num_attention_heads": 4, "caption_channels": [8, 4], "text_emb_dim": 8,
        "num_routed_experts": 2, "num_activated_experts": 2, "axes_dims_rope": [4, 2, 2],
        "max_resolution": [32, 32], "llama_layers": [0, 1], "force_inference_output": True}, lambda: {
        "hidden_states": _r(2, 4, 32, 32), "encoder_hidden_states_t5": _r(2, 8, 8),
        "encoder_hidden_states_llama3": _r(2, 2, 8, 4), "pooled_embeds": _r(2, 8), "timesteps": _t(2)}),
        6, 3, 3, "transformer_hidream_image.py",
        "transformer_hidream_image.py HiDreamAttnProcessor: apply_rope(query_i, key_i, rope) (M9: 2x2 rotation "
        "matrices, F[...,0]*x0 + F[...,1]*x1) on image q/k plus text q/k in the double block (4) and joint q/k "
        "in the single block (2)", category="should", dtypes=("float32",)),
    Entry("prx", _df("PRXTransformer2DModel", {
        "in_channels": 4, "patch_size": 2, "context_in_dim": 16, "hidden_size": 32, "mlp_ratio": 2.0, "num_heads": 2,
        "depth": 2, "axes_dim": [8, 8]}, lambda: {
        "hidden_states": _r(1, 4, 16, 16), "timestep": torch.tensor([0.5]), "encoder_hidden_states": _r(1, 6, 16)}),
        4, 2, 2, "transformer_prx.py",
        "transformer_prx.py PRXAttnProcessor2_0: apply_rope(query/key, image_rotary_emb) per block (M9: PRXEmbedND "
        "stacks [[cos, -sin], [sin, cos]] per axis, cats the 2 axes, adds a heads dim), 2 blocks", dtypes=("float32",),
        triton_row=True),
    Entry("kandinsky6", _df("Kandinsky6Transformer3DModel", {
        "in_visual_dim": 4, "out_visual_dim": 4, "in_text_dim": 16, "in_text_dim2": 8, "time_dim": 16,
        "patch_size": [1, 2, 2], "model_dim": 32, "ff_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 2,
        "axes_dims": [4, 6, 6], "visual_cond": False}, lambda: {
        "hidden_states": _r(1, 2, 8, 8, 4), "encoder_hidden_states": _r(1, 6, 16), "pooled_projections": _r(1, 8),
        "timestep": torch.tensor([500.0])}),
        6, 3, 3, "transformer_kandinsky6.py",
        "transformer_kandinsky6.py Kandinsky6AttnProcessor: apply_rotary(query, rope), (key, rope_kv) in the text "
        "block's self-attention (1D rope, 2) and each visual block's self-attention (2 blocks, 4; cross-attention "
        "has no rope): 2x2 matrices stacked from cos/sin, [T, H, W, 1, D/2, 2, 2] flattened to [T*H*W, ...], "
        "applied as (rope * x_pairs).sum(-1), q/k RMS-normed first", dtypes=("float32",)),
    Entry("allegro", _allegro, 4, 2, 2, "attention_processor.py|embeddings.py",
          "attention_processor.py AllegroAttnProcessor2_0: apply_rotary_emb_allegro(query), (key) in attn1 (attn2 "
          "is cross-attention) (M11: head dim in 3 blocks): embeddings.py x.chunk(3, -1), NeoX rotate_half per "
          "block with F.embedding-gathered t/h/w tables (width 4 of 12 each), torch.cat; 2 blocks"),
)


def _ltx2_inputs():
    return {"hidden_states": _r(2, 512, 4), "audio_hidden_states": _r(2, 9, 4),
            "encoder_hidden_states": _r(2, 16, 16), "audio_encoder_hidden_states": _r(2, 16, 16),
            "timestep": torch.tensor([0.5, 0.5]), "encoder_attention_mask": torch.ones(2, 16, dtype=torch.bool),
            "num_frames": 2, "height": 16, "width": 16, "audio_num_frames": 9, "fps": 25.0}


def by_name(name: str) -> Entry:
    for e in ENTRIES:
        if e.name == name:
            return e
    raise KeyError(name)
