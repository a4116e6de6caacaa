"""Token conventions: the `TokenSpec` of a model family, the conversation template, and a byte-level tokenizer.

Every data source in mindspeed-flow renders a conversation through `build_conversation`, so the template that
`mindspeed_flow.data.sample` documents is written down exactly once:

    for each image:  <vision_start> <image_pad> * n_image_tokens <vision_end>
    for each turn:   question ids  answer ids  <eos>          (labels: answer ids and <eos>)

`ByteTokenizer` is the dependency-free fallback used by the tests and the tiny models: UTF-8 bytes mapped into
the ordinary id range [0, first_special_id), so nothing is downloaded and no id ever collides with a special one.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from mindspeed_flow.data.sample import IGNORE_INDEX, TokenSpec

Tokenizer = Callable[[str], list[int]]

# LLaVA configs carry no vision start/end tokens; the shared template still wants them, so LLaVA reuses the ids
# the tiny presets reserve for them (mindspeed_flow.model_presets.tiny: 381 / 382). For a real LLaVA checkpoint
# these are two ordinary vocabulary entries used as image delimiters, a deliberate, documented simplification.
LLAVA_DEFAULT_VISION_START_ID = 381
LLAVA_DEFAULT_VISION_END_ID = 382

# the Omni thinker: Qwen2.5-VL images; Qwen3-VL and GLM-4.5V: the same patch grid and 2 x 2 merge
QWEN2_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "qwen3_vl", "qwen3_vl_moe", "glm4v_moe")
# InternVL: fixed square tiles like LLaVA, its pixel shuffle merging 2 x 2 patches into one LLM token
LLAVA_FAMILIES = ("llava", "internvl")
# GLM-4.xV names its image delimiters image_start / image_end
_VISION_DELIMITERS = {"glm4v_moe": ("image_start_token_id", "image_end_token_id")}


def _first_id(value: Any, *, field: str) -> int:
    """HF configs store eos as an int or a list of ints; the template needs one."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{field} is an empty list; the template needs one end-of-turn id")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{field} must be an int (or a list of ints), got {value!r}")
    return value


def _lookup(cfg: Mapping[str, Any], key: str, *, family: str) -> Any:
    """Read `key` from text_config first (transformers >= 4.5x layout), then from the top level (older)."""
    text_cfg = cfg.get("text_config") or {}
    if key in text_cfg and text_cfg[key] is not None:
        return text_cfg[key]
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    raise ValueError(f"{family} config has no '{key}' (looked in text_config and at the top level)")


def _qwen2_token_spec(cfg: Mapping[str, Any], family: str) -> TokenSpec:
    vis = cfg.get("vision_config") or {}
    start, end = _VISION_DELIMITERS.get(family, ("vision_start_token_id", "vision_end_token_id"))
    missing = [k for k in ("image_token_id", start, end) if k not in cfg]
    if missing:
        raise ValueError(f"{family} config is missing {missing}: a Qwen2-VL config names its image special tokens")
    return TokenSpec(
        image_token_id=int(cfg["image_token_id"]),
        vision_start_id=int(cfg[start]),
        vision_end_id=int(cfg[end]),
        eos_id=_first_id(_lookup(cfg, "eos_token_id", family=family), field=f"{family} eos_token_id"),
        vocab_size=int(_lookup(cfg, "vocab_size", family=family)),
        image_format="qwen2",
        patch_size=int(vis.get("patch_size", 14)),
        temporal_patch_size=int(vis.get("temporal_patch_size", 2)),
        merge_size=int(vis.get("spatial_merge_size", 2)),
        image_size=0,
    )


def _llava_token_spec(cfg: Mapping[str, Any]) -> TokenSpec:
    vis = {k: v[0] if k in ("image_size", "patch_size") and isinstance(v, (list, tuple)) else v
           for k, v in (cfg.get("vision_config") or {}).items()}  # InternVL gives sizes as [h, w]
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        # "full" keeps the CLS token: (S/p)^2 + 1 tokens, which no (t, h, w) grid describes.
        raise ValueError(f"llava vision_feature_select_strategy={strategy!r} is not supported; only 'default' "
                         "(CLS dropped, (image_size/patch_size)^2 tokens per image) maps onto an image grid")
    image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if image_token is None:
        raise ValueError("llava config has neither 'image_token_index' nor 'image_token_id'")
    image_size = int(vis.get("image_size", 224))  # CLIPVisionConfig defaults
    patch_size = int(vis.get("patch_size", 32))
    if image_size % patch_size:
        raise ValueError(f"llava vision_config.image_size={image_size} is not a multiple of patch_size={patch_size}")
    return TokenSpec(
        image_token_id=int(image_token),
        vision_start_id=int(cfg.get("vision_start_token_id", LLAVA_DEFAULT_VISION_START_ID)),
        vision_end_id=int(cfg.get("vision_end_token_id", LLAVA_DEFAULT_VISION_END_ID)),
        eos_id=_first_id(_lookup(cfg, "eos_token_id", family="llava"), field="llava eos_token_id"),
        vocab_size=int(_lookup(cfg, "vocab_size", family="llava")),
        image_format="llava",
        patch_size=patch_size,
        temporal_patch_size=1,
        # LLaVA: one LLM token per ViT patch, so SampleShape's t*h*w/merge^2 is exact with merge 1; InternVL's
        # pixel shuffle (downsample_ratio 0.5) merges 2 x 2
        merge_size=int(round(1 / float(cfg.get("downsample_ratio", 1.0)))),
        image_size=image_size,
    )


def token_spec_from_hf_config(cfg: Mapping[str, Any]) -> TokenSpec:
    """Build the `TokenSpec` of a HF config.json dict (QWEN2_FAMILIES or LLAVA_FAMILIES)."""
    family = cfg.get("model_type")
    if family in QWEN2_FAMILIES:
        spec = _qwen2_token_spec(cfg, family)
    elif family in LLAVA_FAMILIES:
        spec = _llava_token_spec(cfg)
    else:
        raise ValueError(f"model_type={family!r}: no token spec for it; supported: {QWEN2_FAMILIES + LLAVA_FAMILIES}")
    check_token_spec(spec)
    return spec


def check_token_spec(spec: TokenSpec) -> None:
    """Special ids must be distinct, inside the vocabulary, and leave room for ordinary ids below them."""
    specials = {"image_token_id": spec.image_token_id, "vision_start_id": spec.vision_start_id,
                "vision_end_id": spec.vision_end_id, "eos_id": spec.eos_id}
    for name, value in specials.items():
        if not 0 <= value < spec.vocab_size:
            raise ValueError(f"TokenSpec.{name}={value} is outside the vocabulary [0, {spec.vocab_size})")
    if len(set(specials.values())) != len(specials):
        raise ValueError(f"TokenSpec special ids must be distinct, got {specials}")
    if spec.first_special_id < 2:
        raise ValueError(f"TokenSpec leaves only {spec.first_special_id} ordinary ids below the special ones")
    if spec.image_format not in ("qwen2", "llava"):
        raise ValueError(f"TokenSpec.image_format={spec.image_format!r}; expected 'qwen2' or 'llava'")


class ByteTokenizer:
    """UTF-8 bytes as token ids, folded into [0, limit): no vocabulary file, no download.

    With limit >= 256 (every tiny preset: 380) the map is exact; below that, bytes fold modulo `limit`.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"ByteTokenizer limit must be >= 1, got {limit}")
        self.limit = limit

    def __call__(self, text: str) -> list[int]:
        return [b % self.limit for b in text.encode("utf-8")]


def hf_tokenizer_fn(tokenizer: Any) -> Tokenizer:
    """A transformers tokenizer as the plain `str -> ids` callable the readers take.

    Special tokens are not added: the template places vision and end-of-turn ids itself, and a BOS per turn
    would be noise.
    """
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return encode


def load_local_tokenizer(path: str) -> Tokenizer:
    """The tokenizer saved in a local checkpoint directory (never the hub), as a `str -> ids` callable."""
    from transformers import AutoTokenizer  # optional: transformers

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"model.pretrained_path={path!r}: no tokenizer could be loaded from it "
                                f"({type(exc).__name__}: {exc})") from None
    return hf_tokenizer_fn(tok)


def build_conversation(spec: TokenSpec, image_token_counts: Sequence[int],
                       turns: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Render images and (question ids, answer ids) turns into (input_ids, labels), both int64 [L]."""
    ids: list[int] = []
    labels: list[int] = []
    for n in image_token_counts:
        block = [spec.vision_start_id] + [spec.image_token_id] * int(n) + [spec.vision_end_id]
        ids += block
        labels += [IGNORE_INDEX] * len(block)
    for question, answer in turns:
        ids += list(question)
        labels += [IGNORE_INDEX] * len(question)
        ids += list(answer) + [spec.eos_id]
        labels += list(answer) + [spec.eos_id]
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64)


def template_text_tokens(num_images: int, turns: Sequence[tuple[int, int]]) -> int:
    """Text tokens of the template for given (question length, answer length) turns: the length table's value."""
    return 2 * num_images + sum(q + a + 1 for q, a in turns)


def check_ordinary_ids(ids: Sequence[int], spec: TokenSpec, *, what: str) -> None:
    """Text ids must be ordinary vocabulary ids: a stray image-pad id would shift every embedding scatter."""
    specials = {spec.image_token_id, spec.vision_start_id, spec.vision_end_id}
    for t in ids:
        if not 0 <= t < spec.vocab_size or t in specials:
            raise ValueError(f"{what}: token id {t} is a special id or outside [0, {spec.vocab_size}); the "
                             "tokenizer must not emit image/vision ids")
