"""The one place that knows how transformers versions differ (4.57, MindSpeed-MM's pin, vs 5.x, the CI venv).

Everything else in the torch host asks this module for the model's parts and for the few calls whose
signature or return type changed between versions:

- model classes and config classes per family, and how `from_pretrained` spells the dtype argument;
- module paths: `model.model.visual` / `model.model.vision_tower` + `multi_modal_projector`,
  `model.model.language_model` (embed_tokens, layers, norm, rotary_emb) and `model.lm_head` are the same in
  4.57 and 5.x for the three families, but older releases kept the language model at `model.model`; the
  lookups below try the known places in order and name what they looked for when none exists;
- `get_image_features(...)`: 5.x returns a ModelOutput whose `pooler_output` is a tuple of per-image
  tensors; 4.57 returns the tuple (Qwen) or a [n_images, tokens, H] tensor (LLaVA) directly;
- `get_rope_index(...)`: 5.x needs `mm_token_type_ids` (text 0 / image 1), 4.57 finds images through
  `vision_start_token_id` in `input_ids` and has no such argument;
- decoder layers: 5.x returns the hidden states, 4.57 returned a tuple in some families.

Kept deliberately small: version checks are done by looking at signatures and return values, not by
comparing version strings, so an intermediate release that mixes the two styles still works.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, Optional

import torch
from torch import nn

from mindspeed_flow.specs import DEEPSTACK_FAMILIES

FAMILY_CLASSES: dict[str, tuple[str, str]] = {
    # family: (model class, config class), both importable from the top-level `transformers` package
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
    "llava": ("LlavaForConditionalGeneration", "LlavaConfig"),
    # several encoders (audio + vision) feeding one LLM; its parts are in hosts/torch/omni.py
    "qwen2_5_omni_thinker": ("Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniThinkerConfig"),
    # deepstack: the ViT also hands features of some of its layers to the first LLM layers
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig"),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig"),
}
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "qwen3_vl", "qwen3_vl_moe")


def encoder_modules(model: nn.Module, family: str) -> dict[str, dict[str, nn.Module]]:
    """Encoder part -> its modules by name. The Omni thinker keeps its towers on `model.model` in 5.x and on the
    thinker itself in 4.57."""
    if family == "qwen2_5_omni_thinker":
        return {"audio": {"audio_tower": _first_attr(model, ("model.audio_tower", "audio_tower"), "audio tower")},
                "vision": vision_modules(model, family)}
    return {"encoder": vision_modules(model, family)}


def _transformers_attr(name: str) -> Any:
    import transformers  # optional: transformers

    try:
        return getattr(transformers, name)
    except AttributeError as exc:  # pragma: no cover - only on a transformers without the family
        raise ImportError(f"transformers {transformers.__version__} has no {name}; "
                          f"mindspeed-flow needs transformers >= 4.57") from exc


def family_classes(family: str) -> tuple[type, type]:
    """(model class, config class) of a family, e.g. Qwen2VLForConditionalGeneration / Qwen2VLConfig."""
    if family not in FAMILY_CLASSES:
        raise ValueError(f"model.family={family!r} is not supported by the torch host; "
                         f"choose one of {sorted(FAMILY_CLASSES)}")
    model_name, config_name = FAMILY_CLASSES[family]
    return _transformers_attr(model_name), _transformers_attr(config_name)


def family_of(model: nn.Module) -> str:
    """Family name of a built HF model (the inverse of `family_classes`)."""
    name = type(model).__name__
    for family, (model_name, _) in FAMILY_CLASSES.items():
        if name == model_name:
            return family
    raise TypeError(f"{name} is not a supported VLM; the torch host splits {sorted(FAMILY_CLASSES)}")


def dtype_kwarg(dtype: torch.dtype, version: Optional[str] = None) -> dict[str, torch.dtype]:
    """`from_pretrained` takes `dtype=` in 5.x and `torch_dtype=` in 4.57 (5.x still accepts it, with a warning)."""
    if version is None:
        import transformers  # optional: transformers

        version = transformers.__version__
    major = int(version.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def _first_attr(obj: Any, paths: tuple[str, ...], what: str) -> Any:
    for path in paths:
        cur = obj
        for part in path.split("."):
            cur = getattr(cur, part, None)
            if cur is None:
                break
        if cur is not None:
            return cur
    raise AttributeError(f"{type(obj).__name__}: cannot find the {what} (looked at {', '.join(paths)})")


def language_model(model: nn.Module) -> nn.Module:
    """The decoder-only text model (owns embed_tokens, layers, norm, rotary_emb)."""
    return _first_attr(model, ("model.language_model", "language_model.model", "model"), "language model")


def lm_head(model: nn.Module) -> nn.Module:
    return _first_attr(model, ("lm_head", "language_model.lm_head"), "lm_head")


def vision_modules(model: nn.Module, family: str) -> dict[str, nn.Module]:
    """The encoder-side modules by name: Qwen {'visual'} (merger included), LLaVA {'vision_tower', 'projector'}."""
    if family in MROPE_FAMILIES:
        return {"visual": _first_attr(model, ("model.visual", "visual"), "vision transformer")}
    return {"vision_tower": _first_attr(model, ("model.vision_tower", "vision_tower"), "vision tower"),
            "projector": _first_attr(model, ("model.multi_modal_projector", "multi_modal_projector"),
                                     "multi-modal projector")}


def unused_vision_parameters(model: nn.Module, family: str) -> list[nn.Parameter]:
    """Encoder parameters the model's image features never depend on (they never get a gradient).

    LLaVA reads `hidden_states[vision_feature_layer]` of its vision tower: the layers after that index and the
    tower's post-layernorm / pooling head are computed on no path to the loss (e.g. CLIP's post_layernorm
    always, and the last layer when vision_feature_layer=-2 as in LLaVA-1.5). Found by module names, which
    differ between 4.57 (`vision_model.encoder.layers`) and 5.x (`encoder.layers`).
    """
    if family in MROPE_FAMILIES:
        return []
    tower = vision_modules(model, family)["vision_tower"]
    layer_lists = [m for name, m in tower.named_modules() if name.endswith("encoder.layers")]
    feature_layer = _llava_layer(multimodal_owner(model))
    unused: list[nn.Module] = [m for name, m in tower.named_modules()
                               if name.split(".")[-1] in ("post_layernorm", "head")]
    if len(layer_lists) == 1:
        layers = layer_lists[0]
        wanted = feature_layer if isinstance(feature_layer, (list, tuple)) else [feature_layer]
        used = max(i if i >= 0 else len(layers) + 1 + i for i in wanted)  # hidden_states[0] = embeddings
        unused += list(layers[used:])
    return [p for m in unused for p in m.parameters()]


def multimodal_owner(model: nn.Module) -> nn.Module:
    """The module whose `get_image_features` / `get_rope_index` the whole model calls (`model.model`; the Omni
    thinker itself, which has both in 4.57 and 5.x while its `model` is the text model in 4.57)."""
    if type(model).__name__ == FAMILY_CLASSES["qwen2_5_omni_thinker"][0]:
        return model
    return _first_attr(model, ("model",), "multimodal base model")


def image_token_id(config: Any) -> int:
    value = getattr(config, "image_token_id", None)
    if value is None:
        value = getattr(config, "image_token_index", None)
    if value is None:
        raise ValueError(f"{type(config).__name__} has neither image_token_id nor image_token_index")
    return int(value)


def _as_token_rows(features: Any) -> torch.Tensor:
    """Normalize every known `get_image_features` return value to one [n_tokens_total, H] tensor."""
    if hasattr(features, "pooler_output"):  # 5.x ModelOutput
        features = features.pooler_output
    if isinstance(features, (tuple, list)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features], dim=0)
    return features.reshape(-1, features.shape[-1])


def deepstack_layers(config: Any) -> int:
    """How many deepstack feature maps the ViT hands to the LLM (0 for families without deepstack): the LLM adds
    map i to its hidden states at the image positions after its decoder layer i."""
    vision = getattr(config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def _with_deepstack(features: Any) -> torch.Tensor:
    """Qwen3-VL's `get_image_features` -> [n_tokens_total, H * (1 + D)]: the merged embeddings, then the D
    deepstack maps side by side, so one sample's transfer is one tensor (one header, one shape check, one
    gradient back). 5.x returns a ModelOutput (`pooler_output` and `deepstack_features` split per image); 4.57
    returns (per-image embeddings, D unsplit maps)."""
    if hasattr(features, "deepstack_features"):
        main, deep = features.pooler_output, features.deepstack_features
    else:
        main, deep = features
    rows = [_as_token_rows(main)] + [_as_token_rows(d) for d in deep]
    return torch.cat(rows, dim=-1)


def image_features(owner: nn.Module, family: str, pixel_values: torch.Tensor,
                   image_grid_thw: Optional[torch.Tensor]) -> torch.Tensor:
    """Image embeddings exactly as the whole model computes them before scattering: [n_tokens_total, H_llm]
    ([n_tokens_total, H_llm * (1 + D)] with D deepstack maps, see `_with_deepstack`)."""
    if family in DEEPSTACK_FAMILIES:
        return _with_deepstack(owner.get_image_features(pixel_values, image_grid_thw))
    if family in MROPE_FAMILIES:
        out = owner.get_image_features(pixel_values, image_grid_thw)
    else:
        # LLaVA reads vision_feature_layer / select strategy from its config when they are None
        out = owner.get_image_features(pixel_values=pixel_values, vision_feature_layer=_llava_layer(owner),
                                       vision_feature_select_strategy=_llava_strategy(owner))
    return _as_token_rows(out)


def _llava_layer(owner: nn.Module) -> Any:
    return owner.config.vision_feature_layer


def _llava_strategy(owner: nn.Module) -> str:
    return owner.config.vision_feature_select_strategy


@functools.lru_cache(maxsize=None)
def _accepts(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def rope_index(owner: nn.Module, input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
               image_token: int) -> torch.Tensor:
    """Qwen 3-D mrope position ids [3, 1, L] of ONE sample, by the model's own `get_rope_index`."""
    ids = input_ids.reshape(1, -1)
    fn = type(owner).get_rope_index
    kwargs: dict[str, Any] = {"image_grid_thw": image_grid_thw, "video_grid_thw": None}
    if _accepts(fn, "mm_token_type_ids"):  # 5.x
        kwargs["mm_token_type_ids"] = (ids == image_token).to(torch.int32)
    position_ids, _ = owner.get_rope_index(ids, **kwargs)
    return position_ids


def whole_model_inputs(model: nn.Module, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
                       image_grid_thw: Optional[torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments for the whole HF model's forward on one unpadded sample (coupled reference)."""
    family = family_of(model)
    ids = input_ids.reshape(1, -1)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if pixel_values is not None:
        kwargs["pixel_values"] = pixel_values
        if family in MROPE_FAMILIES:
            kwargs["image_grid_thw"] = image_grid_thw
    if family in MROPE_FAMILIES and _accepts(type(model).forward, "mm_token_type_ids"):
        kwargs["mm_token_type_ids"] = (ids == image_token_id(model.config)).to(torch.int32)
    return kwargs


def call_decoder_layer(layer: nn.Module, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                       position_embeddings: tuple[torch.Tensor, torch.Tensor], **attention_kwargs: Any) -> torch.Tensor:
    """Run one decoder layer without a KV cache; returns the hidden states in every version.

    `attention_kwargs` reach the attention implementation (both versions forward a layer's extra keyword
    arguments to it), which is how the varlen kernel gets the packed sequence boundaries.
    """
    out = layer(hidden, attention_mask=attention_mask, position_embeddings=position_embeddings,
                position_ids=None, use_cache=False, **attention_kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def model_names_of_checkpoint(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Model parameter name -> checkpoint tensor name, by the model's own renaming rules.

    Both versions save (and publish) the older layout (`visual.*`, `model.layers.*`) and rename on load:
    5.x through `core_model_loading.rename_source_key` over the model's conversion mapping, 4.57 through the
    regexes of `_checkpoint_conversion_mapping` (first matching pattern wins, as its loader does).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # optional: transformers
        from transformers.core_model_loading import (  # optional: transformers 5
            WeightConverter, WeightRenaming, rename_source_key)
    except ImportError:  # 4.57
        mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}

        def rename(key: str) -> str:
            for pattern, replacement in mapping.items():
                key, n = re.subn(pattern, replacement, key)
                if n:
                    break
            return key
    else:
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        state = model.state_dict()

        def rename(key: str) -> str:
            return rename_source_key(key, renamings, converters, model.base_model_prefix, state)[0]

    return {rename(k): k for k in keys}
