"""Tiny CPU-sized VLM configs (HF config.json dicts), small enough that a training step takes well under a second.

Token ids 380..383 are reserved for the multimodal special tokens in every tiny preset, so one synthetic dataset
serves all families: image pad 380, vision start 381, vision end 382, end of turn / eos 383.
"""
from __future__ import annotations

TINY_VOCAB = 384
IMAGE_TOKEN_ID = 380
VISION_START_ID = 381
VISION_END_ID = 382
EOS_ID = 383
# Qwen2.5-Omni thinker only: audio pad / audio start / audio end (below the four shared ids above).
AUDIO_TOKEN_ID = 376
AUDIO_START_ID = 377
AUDIO_END_ID = 378
# GLM-4.5V only: its 16 special tokens (chat roles, GLM's prefix, image and video markers) at ids 368..383.
GLM_TOKENS = {name: TINY_VOCAB - 16 + i for i, name in enumerate((
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|image|>", "<|video|>"))}

_TINY_TEXT = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": EOS_ID,  # no BOS in the tiny vocabulary; the Qwen default (151643) would be out of range
    "eos_token_id": EOS_ID,
    "pad_token_id": EOS_ID,
}

# Qwen text rope: transformers 5.x reads `rope_parameters`; 4.57 (MindSpeed-MM's pin) reads `rope_scaling` (which
# must not carry rope_theta there: its validator warns) and a top-level `rope_theta`, and would otherwise fall back
# to mrope_section [16, 24, 24], which does not fit head_dim 16. 5.x takes `rope_scaling` over `rope_parameters`
# when both are given and fills rope_theta from the top level, so all three spellings describe one rope.
_TINY_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
_TINY_QWEN_TEXT = {**_TINY_TEXT, "rope_theta": 10000.0, "rope_parameters": {**_TINY_MROPE, "rope_theta": 10000.0},
                   "rope_scaling": dict(_TINY_MROPE)}

# Qwen3-VL's text model: head_dim is explicit; interleaved mrope over [t, h, w] = [2, 3, 3] frequency pairs.
_TINY_QWEN3_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
_TINY_QWEN3_TEXT = {**_TINY_TEXT, "head_dim": 16, "rope_theta": 10000.0,
                    "rope_parameters": {**_TINY_QWEN3_MROPE, "rope_theta": 10000.0},
                    "rope_scaling": dict(_TINY_QWEN3_MROPE)}
_TINY_QWEN3_VIT = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                   "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]}

TINY_PRESETS: dict[tuple[str, str], dict] = {
    ("qwen2_vl", "tiny"): {
        "model_type": "qwen2_vl",
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": IMAGE_TOKEN_ID - 1,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
        "text_config": dict(_TINY_QWEN_TEXT),
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2,
                          "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    },
    ("qwen2_5_vl", "tiny"): {
        "model_type": "qwen2_5_vl",
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": IMAGE_TOKEN_ID - 1,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
        "text_config": dict(_TINY_QWEN_TEXT),
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
    },
    ("llava", "tiny"): {
        "model_type": "llava",
        "image_token_index": IMAGE_TOKEN_ID,
        "image_seq_length": 16,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "projector_hidden_act": "gelu",
        "tie_word_embeddings": False,
        "text_config": {**_TINY_TEXT, "model_type": "llama"},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 56, "patch_size": 14,
                          "projection_dim": 32},
    },
    # Qwen3-VL: ViT with learned position embeddings and deepstack mergers (features of ViT layers 0 and 1 are
    # added to the LLM's hidden states after its layers 0 and 1, at the image positions); interleaved mrope.
    ("qwen3_vl", "tiny"): {
        "model_type": "qwen3_vl",
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": IMAGE_TOKEN_ID - 1,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
        "text_config": {**_TINY_QWEN3_TEXT},
        "vision_config": dict(_TINY_QWEN3_VIT),
    },
    # Qwen3-VL-MoE: the same ViT; every LLM layer a sparse MoE block (4 experts, top 2).
    ("qwen3_vl_moe", "tiny"): {
        "model_type": "qwen3_vl_moe",
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": IMAGE_TOKEN_ID - 1,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
        "text_config": {**_TINY_QWEN3_TEXT, "moe_intermediate_size": 32, "num_experts": 4,
                        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "norm_topk_prob": True},
        "vision_config": dict(_TINY_QWEN3_VIT),
    },
    # Qwen2.5-Omni thinker: audio encoder (Whisper-style, 16 mel bins), Qwen2.5-VL vision encoder, mrope LLM.
    ("qwen2_5_omni_thinker", "tiny"): {
        "model_type": "qwen2_5_omni_thinker",
        "audio_token_id": AUDIO_TOKEN_ID,
        "audio_start_token_id": AUDIO_START_ID,
        "audio_end_token_id": AUDIO_END_ID,
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": IMAGE_TOKEN_ID - 1,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
        "text_config": dict(_TINY_QWEN_TEXT),
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
        "audio_config": {"num_mel_bins": 16, "encoder_layers": 2, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 64, "d_model": 32, "output_dim": 64, "max_source_positions": 1500,
                         "n_window": 50},
    },
    # GLM-4.5V (transformers' Glm4vMoe): a 2-block ViT (patch 14, a 56-px position table interpolated to each
    # image's grid, 2x2 conv downsample, merger MLP); a 3-layer LLM with partial rotary (half of head_dim 16) over
    # mrope [t, h, w] = [1, 1, 2], q/k/v bias, layer 0 dense and layers 1-2 MoE (4 routed experts, top 2, one shared).
    # Its own 16 special tokens at the top ids (GLM's chat, image and video markers), `GLM_TOKENS`.
    ("glm4v_moe", "tiny"): {
        "model_type": "glm4v_moe",
        "image_token_id": GLM_TOKENS["<|image|>"],
        "video_token_id": GLM_TOKENS["<|video|>"],
        "image_start_token_id": GLM_TOKENS["<|begin_of_image|>"],
        "image_end_token_id": GLM_TOKENS["<|end_of_image|>"],
        "video_start_token_id": GLM_TOKENS["<|begin_of_video|>"],
        "video_end_token_id": GLM_TOKENS["<|end_of_video|>"],
        "tie_word_embeddings": False,
        "text_config": {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": True,
                        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                        "partial_rotary_factor": 0.5, "n_routed_experts": 4, "n_shared_experts": 1,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                        "eos_token_id": [GLM_TOKENS["<|endoftext|>"], GLM_TOKENS["<|user|>"],
                                         GLM_TOKENS["<|observation|>"]],
                        "tie_word_embeddings": False, "rope_theta": 10000.0,
                        "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]},
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "mrope_section": [1, 1, 2]}},
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "hidden_act": "silu", "attention_bias": False, "in_channels": 3,
                          "image_size": 56, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "rms_norm_eps": 1e-5},
    },
}
