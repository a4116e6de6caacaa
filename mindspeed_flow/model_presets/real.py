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


REAL_PRESETS: dict[tuple[str, str], dict] = {
    ("qwen2_5_vl", "3b"): _qwen2_5_vl(2048, 11008, 36, 16, 2, 3420, vocab=151936, tie=True),
    ("qwen2_5_vl", "7b"): _qwen2_5_vl(3584, 18944, 28, 28, 4, 3420),
    ("qwen2_5_vl", "32b"): _qwen2_5_vl(5120, 27648, 64, 40, 8, 3456),
    ("qwen2_5_vl", "72b"): _qwen2_5_vl(8192, 29568, 80, 64, 8, 3456),
    ("qwen2_vl", "7b"): _qwen2_vl(3584, 18944, 28, 28, 4),
    ("qwen2_vl", "72b"): _qwen2_vl(8192, 29568, 80, 64, 8),
    ("llava", "internvl_8b"): _internvl_like_8b(),
    ("qwen2_5_vl", "internvit6b_7b"): _internvit6b_like_7b(),
}
