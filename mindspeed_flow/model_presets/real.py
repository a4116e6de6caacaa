"""Real VLM architectures as HF `config.json` dicts (pure data): the planner's model presets.

Dimensions are those of the published checkpoints' config.json files (Qwen/Qwen2-VL-*-Instruct,
Qwen/Qwen2.5-VL-*-Instruct). They are written in transformers 5's nested form (`text_config` +
`vision_config`), which transformers also reads back (4.57 reads `tie_word_embeddings` from `text_config`,
5.x from the top level, so it is given in both), so the torch host can build any of them on the `meta`
device and the parameter counts in `mindspeed_flow.specs` are checked against the real module tree
(tests/test_specs_real.py).

The InternVL-style preset is represented in the LLaVA family (HF `LlavaForConditionalGeneration`): a CLIP-style
ViT with the dims of InternViT-300M-448px (24 layers, hidden 1024, MLP 4096, 16 heads, 448 px, patch 14) and
the Qwen2.5-7B text model that InternVL3-8B uses. Differences from the real InternVL, stated so nobody is
misled: LLaVA has no pixel-shuffle, so each 448 px tile gives 1024 LLM tokens (InternVL: 256), and InternViT's
layer-scale vectors and MLP-projector LayerNorm are absent (about 0.1 M parameters).

The encoder-heavy preset `internvit6b_7b` (`_internvit6b_like_7b`) takes its encoder figures from OpenGVLab's
InternViT-6B-448px-V1-5 (huggingface.co/OpenGVLab/InternViT-6B-448px-V1-5, config.json and model card): 45
layers, hidden 3200, MLP 12800, 25 heads, 448 px input, patch 14, 5,540 M parameters (InternViT-6B had 48 layers
and 5.9 B; the 448 px versions drop the last 3); and InternVL 1.5's pixel shuffle (arXiv 2404.16821): a 448 px tile
is 1024 patches and 256 LLM tokens. Differences, stated: the Qwen-style merger (2 x 2 patches -> 12800 -> 12800
-> LLM width, 0.21 B) is larger than InternVL's projector (LayerNorm + 12800 -> LLM width -> LLM width, 0.06 B);
no QK-norm or layer scale; 25 heads leave the encoder no TP size but 1 (as for the real InternViT-6B).
"""
from __future__ import annotations

# Multimodal special token ids shared by every Qwen2/Qwen2.5-VL checkpoint.
_QWEN_TOKENS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}


def _qwen_text(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int,
               max_positions: int) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "rope_parameters": dict(_MROPE),
    }


def _qwen2_vl(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int = 152064,
              tie: bool = False) -> dict:
    return {
        "model_type": "qwen2_vl",
        **_QWEN_TOKENS,
        "tie_word_embeddings": tie,
        "text_config": {**_qwen_text(hidden, ffn, layers, heads, kv_heads, vocab, 32768), "tie_word_embeddings": tie},
        "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": hidden, "hidden_act": "quick_gelu",
                          "mlp_ratio": 4, "num_heads": 16, "in_channels": 3, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
    }


def _qwen2_5_vl(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vision_ffn: int,
                vocab: int = 152064, tie: bool = False) -> dict:
    return {
        "model_type": "qwen2_5_vl",
        **_QWEN_TOKENS,
        "tie_word_embeddings": tie,
        "text_config": {**_qwen_text(hidden, ffn, layers, heads, kv_heads, vocab, 128000), "tie_word_embeddings": tie},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": vision_ffn, "num_heads": 16,
                          "hidden_act": "silu", "out_hidden_size": hidden, "in_channels": 3, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2},
    }


def _internvl_like_8b() -> dict:
    text = _qwen_text(3584, 18944, 28, 28, 4, 151674, 32768)
    text.pop("rope_parameters")
    text.update({"model_type": "qwen2", "rope_theta": 1000000.0})
    return {
        "model_type": "llava",
        "image_token_index": 151667,
        "image_seq_length": 1024,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "projector_hidden_act": "gelu",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 448,
                          "patch_size": 14, "projection_dim": 1024},
    }


def _internvit6b_like_7b() -> dict:
    """An InternViT-6B-like encoder with Qwen2.5-7B, written as a Qwen2.5-VL model (the family the MindSpeed-MM
    job plans): InternViT-6B-448px-V1-5's depth, width and heads with full attention in every layer, and a 2 x 2
    patch merger standing for InternVL's pixel shuffle (scale 0.5: a 448 px tile's 1024 patches become 256 LLM
    tokens). Its GELU MLP (3200 -> 12800 -> 3200) is replaced by a SwiGLU of the same parameters and FLOPs per
    patch (3 x 3200 x 8533 ~ 2 x 3200 x 12800)."""
    cfg = _qwen2_5_vl(3584, 18944, 28, 28, 4, 8533)
    cfg["vision_config"].update({"depth": 45, "hidden_size": 3200, "num_heads": 25,
                                 "fullatt_block_indexes": list(range(45))})
    return cfg


def _qwen3_text(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, **moe: int) -> dict:
    """A Qwen3(-MoE) text config as Qwen3-VL and InternVL3.5 ship it: head_dim 128, q/k norms, no q/k/v bias."""
    return {"vocab_size": 151936, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128, "attention_bias": False,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "bos_token_id": 151643,
            "eos_token_id": 151645, "tie_word_embeddings": False, **moe}


# Qwen3-30B-A3B's MoE: 128 experts of width 768, 8 per token, in every layer (Qwen3-VL-30B-A3B, InternVL3.5-30B-A3B)
_QWEN3_A3B_MOE = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


_QWEN3_MROPE = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}


def _qwen3_vl(text: dict, moe: bool) -> dict:
    """Qwen3-VL: a 27-layer SigLIP2-style ViT (patch 16, learned 48 x 48 position table interpolated to the grid,
    LayerNorm, GELU-tanh MLP) with a 2 x 2 merger, and DeepStack: the features of ViT layers 8, 16 and 24, each
    through its own merger, are added to the LLM's hidden states at its first three layers. Differences, stated:
    the spec prices every ViT parameter (position table included) at 6 FLOPs per patch, and the deepstack
    injection (3 additions per image token) as free."""
    return {
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        **_QWEN_TOKENS,
        "tie_word_embeddings": False,
        # the rope in the three spellings transformers reads (5.x: rope_parameters; 4.57, MindSpeed-MM's pin:
        # rope_scaling without rope_theta, plus a top-level rope_theta), as model_presets/tiny.py explains
        "text_config": {**text, "rope_theta": 5000000.0,
                        "rope_parameters": {**_QWEN3_MROPE, "rope_theta": 5000000.0},
                        "rope_scaling": dict(_QWEN3_MROPE)},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": text["hidden_size"],
                          "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
    }


def _qwen3_vl_8b() -> dict:
    """Qwen3-VL-8B (dense). Source: huggingface.co/Qwen/Qwen3-VL-8B-Instruct config.json (text: 36 layers, hidden
    4096, MLP 12288, 32 heads / 8 KV, head_dim 128, vocab 151936, untied), checked against MindSpeed-MM
    examples/qwen3vl/qwen3vl_full_sft_8B.yaml (model_id qwen3_vl, loaded from that checkpoint). 8.77 B parameters."""
    return _qwen3_vl(_qwen3_text(4096, 12288, 36, 32, 8), moe=False)


def _qwen3_vl_30b_a3b() -> dict:
    """Qwen3-VL-30B-A3B (MoE). Source: huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct config.json (text: 48
    layers, hidden 2048, 32 heads / 4 KV, head_dim 128, 128 experts of width 768, top-8, no shared expert, every
    layer MoE; vision as Qwen3-VL-8B's with out_hidden_size 2048), checked against MindSpeed-MM
    examples/qwen3vl/qwen3vl_full_sft_30B.yaml (model_id qwen3_vl_moe, text hidden_size 2048, vision 1152).
    31.1 B total, 3.5 B active (the model card: 30B total, 3B active, counting the LLM without the ViT)."""
    return _qwen3_vl(_qwen3_text(2048, 6144, 48, 32, 4, **_QWEN3_A3B_MOE), moe=True)


def _internvl3_5_30b_a3b() -> dict:
    """InternVL3.5-30B-A3B, the size MindSpeed-MM's InternVL3.5 example ships (MindSpeed-MM
    examples/internvl3.5/model.json: init_from_hf_path InternVL3_5-30B-A3B-Instruct, img_context_token_id 151671).
    Source: huggingface.co/OpenGVLab/InternVL3_5-30B-A3B-Instruct config.json: InternViT-300M-448px-V2.5 (24
    layers, hidden 1024, MLP 4096, 16 heads, 448 px, patch 14, layer scale), pixel shuffle at downsample_ratio 0.5
    (a 448 px tile's 1024 patches become 256 LLM tokens), MLP projector (LayerNorm 4096 -> 2048 -> 2048) and the
    Qwen3-30B-A3B text model. Written as transformers' InternVL (InternVLForConditionalGeneration). Differences,
    stated: one 448 px tile per image (InternVL's dynamic tiling, up to 12 tiles + a thumbnail, is not modelled:
    the workload's images are single tiles); the spec prices the projector at 6 FLOPs per patch (it runs on the
    shuffled tokens, a quarter of them). 30.8 B total, 3.6 B active."""
    return {
        "model_type": "internvl",
        "image_token_id": 151671,
        "image_seq_length": 256,
        "downsample_ratio": 0.5,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False,
        "text_config": {**_qwen3_text(2048, 6144, 48, 32, 4, **_QWEN3_A3B_MOE), "model_type": "qwen3_moe",
                        "rope_theta": 1000000.0},
        "vision_config": {"model_type": "internvl_vision", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": [448, 448],
                          "patch_size": [14, 14], "num_channels": 3, "hidden_act": "gelu", "norm_type": "layer_norm",
                          "use_qk_norm": False, "attention_bias": False, "layer_scale_init_value": 0.1,
                          "use_mean_pooling": True},
    }


def _glm4_5v() -> dict:
    """GLM-4.5V (MoE, 106 B total / 12 B active by its model card). Source: huggingface.co/zai-org/GLM-4.5V
    config.json: GLM-4.5-Air text model (46 layers, hidden 4096, 96 heads / 8 KV, head_dim 128, q/k/v bias, layer 0
    dense with MLP 10944, then 128 routed experts of width 1408, top-8, plus 1 shared expert; vocab 151552), and a
    24-layer ViT (hidden 1536, 12 heads, patch 14, 336 px position table, RMSNorm, SwiGLU at width 4096, 2 x 2
    conv downsample, merger MLP 10944); checked against MindSpeed-MM examples/glm4.5v/model_106B.json (vision
    24 layers x 1536 x 12 heads, text 46 layers x 96 heads). Written as transformers' Glm4vMoeForConditionalGeneration.
    Differences, stated: the checkpoint's multi-token-prediction layer (num_nextn_predict_layers 1, not built by
    transformers and not trained by MindSpeed-MM's example) is left out; the ViT's 3-D RoPE and bicubic position
    interpolation are priced as free. 107.7 B total, 12.6 B active (the card's 106 B / 12 B is the text model)."""
    return {
        "model_type": "glm4v_moe",
        "image_token_id": 151363,
        "video_token_id": 151364,
        "image_start_token_id": 151339,
        "image_end_token_id": 151340,
        "video_start_token_id": 151341,
        "video_end_token_id": 151342,
        "tie_word_embeddings": False,
        "text_config": {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
                        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
                        "head_dim": 128, "attention_bias": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                        "max_position_embeddings": 65536, "partial_rotary_factor": 0.5, "use_qk_norm": False,
                        "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "norm_topk_prob": True,
                        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                        "eos_token_id": [151329, 151336, 151338], "tie_word_embeddings": False,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "mrope_section": [8, 12, 12]}},
        "vision_config": {"depth": 24, "hidden_size": 1536, "intermediate_size": 10944, "num_heads": 12,
                          "out_hidden_size": 4096, "hidden_act": "silu", "attention_bias": False, "in_channels": 3,
                          "image_size": 336, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "rms_norm_eps": 1e-5},
    }


def _qwen2_5_omni_7b() -> dict:
    """Qwen2.5-Omni-7B's thinker (the part MindSpeed-MM's example trains). Source:
    huggingface.co/Qwen/Qwen2.5-Omni-7B config.json, thinker_config: a Whisper-style audio encoder (128 mel bins,
    32 layers, d_model 1280, FFN 5120, 20 heads, output 3584), Qwen2.5-VL-7B's ViT (32 layers, 1280, MLP 3420,
    out 3584) and the Qwen2.5-7B text model; checked against MindSpeed-MM examples/qwen2.5omni/model_7b.json
    (vision 32 x 1280 x 3420 -> 3584, audio 32 x 1280 x 5120, 20 heads). Represented as the tiny_qwen2_5_omni
    recipe is (family qwen2_5_omni_thinker: audio, vision, backbone). The planner prices the audio encoder as a
    part of its own (`planner.parts.audio_part`: its FLOPs per clip, `specs.AudioSpec.clip_flops`) on a workload
    with audio clips (data=infovqa_audio, or a length table with audio_frames); on one without, it prices the
    vision encoder and the LLM and the idle audio encoder's parameters are counted only. 8.93 B parameters."""
    cfg = _qwen2_5_vl(3584, 18944, 28, 28, 4, 3420)
    cfg.update({"model_type": "qwen2_5_omni_thinker", "audio_token_id": 151646, "audio_start_token_id": 151647,
                "audio_end_token_id": 151648, "position_id_per_seconds": 25, "seconds_per_chunk": 2,
                "audio_config": {"num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20,
                                 "encoder_ffn_dim": 5120, "d_model": 1280, "output_dim": 3584,
                                 "max_source_positions": 1500, "n_window": 100}})
    return cfg


REAL_PRESETS: dict[tuple[str, str], dict] = {
    ("qwen2_5_vl", "3b"): _qwen2_5_vl(2048, 11008, 36, 16, 2, 3420, vocab=151936, tie=True),
    ("qwen2_5_vl", "7b"): _qwen2_5_vl(3584, 18944, 28, 28, 4, 3420),
    ("qwen2_5_vl", "32b"): _qwen2_5_vl(5120, 27648, 64, 40, 8, 3456),
    ("qwen2_5_vl", "72b"): _qwen2_5_vl(8192, 29568, 80, 64, 8, 3456),
    ("qwen2_vl", "7b"): _qwen2_vl(3584, 18944, 28, 28, 4),
    ("qwen2_vl", "72b"): _qwen2_vl(8192, 29568, 80, 64, 8),
    ("llava", "internvl_8b"): _internvl_like_8b(),
    ("qwen2_5_vl", "internvit6b_7b"): _internvit6b_like_7b(),
    ("qwen3_vl", "8b"): _qwen3_vl_8b(),
    ("qwen3_vl_moe", "30b_a3b"): _qwen3_vl_30b_a3b(),
    ("internvl", "internvl3_5_30b_a3b"): _internvl3_5_30b_a3b(),
    ("glm4v_moe", "glm4_5v"): _glm4_5v(),
    ("qwen2_5_omni_thinker", "7b"): _qwen2_5_omni_7b(),
}
