"""Parameter counts of `mindspeed_flow.specs` against the real HF module trees (built on the meta device).

Every preset (tiny and real-architecture) is instantiated with transformers on `torch.device("meta")`, so even
the 72B models cost no memory; the spec's counts must equal the module's parameter count exactly, for the whole
model and for the vision part (ViT + merger / projector).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from mindspeed_flow.model_presets import REAL_PRESETS, TINY_PRESETS, hf_config_dict, load_config_json
from mindspeed_flow.specs import VLMSpec

_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "glm4v_moe": "Glm4vMoeForConditionalGeneration",
}


def _build_on_meta(config: dict) -> torch.nn.Module:
    cls = getattr(transformers, _CLASSES[config["model_type"]])
    if config["model_type"] == "qwen2_5_omni_thinker":  # a sub-config: transformers 4.57's AutoConfig lacks it
        hf_config = transformers.Qwen2_5OmniThinkerConfig.from_dict(config)
    else:
        hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return cls(hf_config)


def _vision_numel(model: torch.nn.Module, family: str) -> int:
    inner = model.model
    if family == "qwen2_5_omni_thinker" and not hasattr(inner, "visual"):  # transformers 4.57: on the thinker
        inner = model
    if family in ("llava", "internvl"):
        return sum(p.numel() for p in inner.vision_tower.parameters()) + sum(
            p.numel() for p in inner.multi_modal_projector.parameters())
    return sum(p.numel() for p in inner.visual.parameters())


@pytest.mark.parametrize("family,preset", sorted({**TINY_PRESETS, **REAL_PRESETS}))
def test_spec_counts_equal_hf_modules(family: str, preset: str) -> None:
    config = hf_config_dict(family, preset)
    model = _build_on_meta(config)
    spec = VLMSpec.from_hf_config(config)
    assert spec.total_params == sum(p.numel() for p in model.parameters()), (family, preset)
    assert spec.vision.params == _vision_numel(model, family), (family, preset)
    if spec.audio is not None:  # the Omni thinker's audio tower
        tower = getattr(model.model, "audio_tower", None) or model.audio_tower
        assert spec.audio.params == sum(p.numel() for p in tower.parameters()), (family, preset)


def test_real_presets_have_published_sizes() -> None:
    # Rounded totals of the published checkpoints (model cards): a guard against a typo in a dimension.
    expected_billions = {("qwen2_5_vl", "3b"): 3.75, ("qwen2_5_vl", "7b"): 8.29, ("qwen2_5_vl", "32b"): 33.45,
                         ("qwen2_5_vl", "72b"): 73.41, ("qwen2_vl", "7b"): 8.29, ("qwen2_vl", "72b"): 73.41}
    for key, billions in expected_billions.items():
        total = VLMSpec.from_hf_config(hf_config_dict(*key)).total_params / 1e9
        assert abs(total - billions) < 0.01, (key, total)


def test_internvit6b_like_encoder_has_the_model_card_size() -> None:
    # InternViT-6B-448px-V1-5 (model card): 45 layers, 5,540 M parameters; 256 LLM tokens per 448 px tile. The
    # Qwen-style 2 x 2 merger (its last part) is counted apart: it stands for InternVL's pixel shuffle + MLP.
    v = VLMSpec.from_hf_config(hf_config_dict("qwen2_5_vl", "internvit6b_7b")).vision
    m = v.hidden_size * v.spatial_merge_size**2
    merger = v.hidden_size + m * m + m + m * v.out_hidden_size + v.out_hidden_size
    assert (v.depth, v.hidden_size, v.num_heads) == (45, 3200, 25)
    assert abs((v.params - merger) / 5.540e9 - 1) < 0.01
    assert v.llm_tokens_per_image(32 * 32) == 256


def test_load_config_json_round_trip(tmp_path) -> None:
    import json

    config = hf_config_dict("qwen2_5_vl", "7b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert VLMSpec.from_hf_config(load_config_json(str(tmp_path))).total_params == 8292166656


# Published sizes of the checkpoints behind the new presets (total / active, billions). Sources: the Hugging Face
# model pages' parameter counts (Qwen/Qwen3-VL-8B-Instruct 8.77 B; Qwen/Qwen3-VL-30B-A3B-Instruct 31.1 B, "A3B":
# Qwen3-30B-A3B's 3.3 B activated; OpenGVLab/InternVL3_5-30B-A3B-Instruct 30.8 B total; zai-org/GLM-4.5V 108 B on
# the page, 106 B total / 12 B active for its GLM-4.5-Air text model on the card; Qwen/Qwen2.5-Omni-7B thinker
# 8.93 B). Active counts the vision encoder and embeddings too (a token passes them), except GLM's, whose card
# counts the text model's layers without embedding and head.
NEW_PRESETS = {("qwen3_vl", "8b"): (8.77, 8.77), ("qwen3_vl_moe", "30b_a3b"): (31.07, 3.89),
               ("internvl", "internvl3_5_30b_a3b"): (30.85, 3.67), ("glm4v_moe", "glm4_5v"): (107.71, 14.28),
               ("qwen2_5_omni_thinker", "7b"): (8.93, 8.29)}


@pytest.mark.parametrize("key", sorted(NEW_PRESETS))
def test_new_presets_have_published_sizes(key: tuple[str, str]) -> None:
    spec = VLMSpec.from_hf_config(hf_config_dict(*key))
    total, active = NEW_PRESETS[key]
    assert abs(spec.total_params / 1e9 - total) < 0.01, (key, spec.total_params)
    assert abs((spec.vision.params + spec.llm.active_params) / 1e9 - active) < 0.01, (key, spec.llm.active_params)


def test_moe_text_models_match_their_cards() -> None:
    # Qwen3-30B-A3B (huggingface.co/Qwen/Qwen3-30B-A3B: 30.5 B total, 3.3 B activated) is the text model of both
    # A3B presets; GLM-4.5-Air (huggingface.co/zai-org/GLM-4.5-Air: 106 B total, 12 B active; the checkpoint's
    # MTP layer left out) is GLM-4.5V's, its active count without embedding and head.
    for key in (("qwen3_vl_moe", "30b_a3b"), ("internvl", "internvl3_5_30b_a3b")):
        llm = VLMSpec.from_hf_config(hf_config_dict(*key)).llm
        assert abs(llm.total_params / 1e9 - 30.5) < 0.1 and abs(llm.active_params / 1e9 - 3.3) < 0.1, key
    glm = VLMSpec.from_hf_config(hf_config_dict("glm4v_moe", "glm4_5v")).llm
    assert abs(glm.total_params / 1e9 - 106) < 1.5
    assert abs((glm.active_params - glm.embedding_params - glm.head_params) / 1e9 - 12) < 0.3


def test_moe_flops_follow_active_parameters() -> None:
    # FLOPs per token of the MoE backbone are 6 x its active parameters (the head included, the embedding lookup
    # not), far below 6 x total; a dense model's active and total parameters coincide.
    llm = VLMSpec.from_hf_config(hf_config_dict("qwen3_vl_moe", "30b_a3b")).llm
    active = llm.active_params - llm.embedding_params - llm.head_params + llm.vocab_size * llm.hidden_size
    assert abs(llm.linear_flops_per_token() / (6 * active) - 1) < 0.03
    assert llm.linear_flops_per_token() < 0.15 * 6 * llm.total_params
    dense = VLMSpec.from_hf_config(hf_config_dict("qwen3_vl", "8b")).llm
    assert dense.active_params == dense.total_params and dense.routed_expert_params == 0
