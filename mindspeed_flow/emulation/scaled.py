"""MindSpeed-MM's own Qwen2.5-VL example configs scaled down to CPU size, and a data set unlike the project's own.

The flow job is checked on models and data it was not written against: `scaled_model_json` reads one of
MindSpeed-MM's `examples/qwen2.5vl/model_{3b,7b,32b,72b}.json` from the pinned sources and keeps every key and
every structural choice (tied or untied embeddings, the GQA ratio, the ViT family, window attention with
full-attention blocks, the mrope sections, which parts are frozen), shrinking only widths, depths and the
vocabulary (to the tiny tokenizer's). `write_user_like_data` writes a captioning/VQA set of its own: multi-turn
conversations, one or two images per sample or none, image sizes that are multiples of nothing (the processor
resizes them), answer lengths that vary, and a sample count that no global batch divides.

    python -m mindspeed_flow.emulation.scaled WORKDIR [--models 3b,7b,32b,72b] [--samples 30]

WORKDIR must hold the tiny processor (`python -m mindspeed_flow.emulation.tiny WORKDIR` builds it).
"""
from __future__ import annotations

import argparse
import copy
import json
import random
from pathlib import Path
from typing import Any

from mindspeed_flow.model_presets.tiny import IMAGE_TOKEN_ID, TINY_VOCAB, VISION_START_ID
from mindspeed_flow.emulation.sources import find_sources

EXAMPLES = ("3b", "7b", "32b", "72b")
# Per-head width of the scaled models: mrope's sections must sum to half of it; MindSpeed-MM's [16, 24, 24] (of
# 128) keeps its proportions as [4, 6, 6] (of 32). 32 also keeps every decoder tensor of a tied model a multiple of
# 128 elements, as at full size: Megatron core_v0.12.1's bucket layout with the distributed optimizer starts a tied
# embedding's own bucket inside the previous bucket's end padding when that padding is not empty ("Param should
# not be in param_gbuf_map"), which only tiny widths trigger.
HEAD_DIM = 32
VIT_HEADS, VIT_LAYERS, VIT_FFN = 2, 4, 64
LLM_KV_GROUPS, LLM_LAYERS = 2, 3  # 3 layers: an even 2-stage pipeline split does not exist, [1, 2] is uneven


def example_model_json(mindspeed_mm_root: Path, size: str) -> dict[str, Any]:
    path = Path(mindspeed_mm_root) / "examples" / "qwen2.5vl" / f"model_{size}.json"
    return json.loads(path.read_text())


def _scaled_mrope(section: list[int]) -> list[int]:
    total = sum(section)
    half = HEAD_DIM // 2
    scaled = [max(1, round(s * half / total)) for s in section]
    scaled[-1] += half - sum(scaled)
    return scaled


def scale_model(cfg: dict[str, Any], *, llm_layers: int = LLM_LAYERS, seq_length: int = 256) -> dict[str, Any]:
    """A copy of a MindSpeed-MM Qwen2.5-VL model.json with CPU-sized widths and depths, structure kept."""
    out = copy.deepcopy(cfg)
    out["img_context_token_id"] = IMAGE_TOKEN_ID
    out["vision_start_token_id"] = VISION_START_ID
    vit = out["image_encoder"]["vision_encoder"]
    proj = out["image_encoder"]["vision_projector"]
    llm = out["text_decoder"]
    vit_hidden_old, llm_hidden_old = vit["hidden_size"], llm["hidden_size"]
    # The LLM keeps its GQA ratio (heads per KV group) with 2 groups, so TP 2 divides both.
    ratio = llm["num_attention_heads"] // llm.get("num_query_groups", llm["num_attention_heads"])
    heads = ratio * LLM_KV_GROUPS
    llm_hidden = heads * HEAD_DIM
    vit_hidden = VIT_HEADS * HEAD_DIM
    full = vit.get("fullatt_block_indexes")
    vit.update(num_layers=VIT_LAYERS, hidden_size=vit_hidden, num_attention_heads=VIT_HEADS,
               ffn_hidden_size=VIT_FFN, pipeline_num_layers=[VIT_LAYERS])
    if "intermediate_size" in vit:
        vit["intermediate_size"] = VIT_FFN
    if "llm_hidden_size" in vit:  # MindSpeed-MM sets it to the ViT's or the LLM's width; keep which
        vit["llm_hidden_size"] = vit_hidden if vit["llm_hidden_size"] == vit_hidden_old else llm_hidden
    if full is not None:
        # Windowed blocks with full-attention blocks between them, as in the original (every 8th of 32 layers).
        vit["fullatt_block_indexes"] = [i for i in range(VIT_LAYERS) if i % 2 == 1]
    # The projector's first layer takes spatial_merge_size^2 merged ViT tokens (5120 = 4 x 1280 in the original).
    merge = int(vit.get("spatial_merge_size", 2))
    proj.update(input_size=vit_hidden, hidden_size=llm_hidden, ffn_hidden_size=vit_hidden * merge * merge)
    assert llm_hidden_old > 0
    llm.update(num_layers=llm_layers, pipeline_num_layers=[llm_layers], hidden_size=llm_hidden,
               ffn_hidden_size=2 * llm_hidden, num_attention_heads=heads, num_query_groups=LLM_KV_GROUPS,
               vocab_size=TINY_VOCAB, seq_length=seq_length, max_position_embeddings=4096, rope_theta=10000.0)
    if "mrope_section" in llm:
        llm["mrope_section"] = _scaled_mrope(list(llm["mrope_section"]))
    return out


def scaled_model_json(mindspeed_mm_root: Path, size: str, out_dir: Path, **overrides: Any) -> Path:
    """Write the scaled copy of `model_<size>.json` to OUT_DIR/model_<size>_tiny.json (overrides: dotted keys)."""
    cfg = scale_model(example_model_json(mindspeed_mm_root, size))
    for dotted, value in overrides.items():
        node = cfg
        keys = dotted.split(".")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"model_{size}_tiny.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


# ------------------------------------------------------------------------------ a data set of its own

_OBJECTS = ("cat", "bicycle", "kettle", "tree", "boat", "lamp", "chair", "kite", "clock", "car")
_PLACES = ("kitchen", "street", "park", "harbour", "office", "garden")
_QUESTIONS = ("What is in the picture?", "Where was this taken?", "How many things can you see?",
              "Describe the colours.", "Is it day or night?", "What stands out?")


def _draw(rng: random.Random, size: tuple[int, int]) -> Any:
    from PIL import Image, ImageDraw  # optional: PIL

    img = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(1, 4)):
        x0, y0 = rng.randrange(size[0]), rng.randrange(size[1])
        x1, y1 = min(size[0], x0 + rng.randint(5, 60)), min(size[1], y0 + rng.randint(5, 60))
        draw.rectangle((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def _answer(rng: random.Random) -> str:
    words = [rng.choice(_OBJECTS), "in", "a", rng.choice(_PLACES)]
    words += [rng.choice(_OBJECTS) for _ in range(rng.randint(0, 6))]
    return " ".join(words)


def write_user_like_data(data_dir: Path, n_samples: int = 30, seed: int = 7) -> Path:
    """A sharegpt-style set unlike the project's tiny captions; returns samples.json.

    Every 7th sample has two images, every 11th none (text only); the rest one image of a size drawn from
    42-190 px per side (the processor resizes to multiples of 28 within the data.json pixel bounds); 1-3 turns."""
    rng = random.Random(seed)
    images_dir = data_dir / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(n_samples):
        n_images = 0 if i % 11 == 10 else (2 if i % 7 == 3 else 1)
        paths = []
        for j in range(n_images):
            size = (rng.randint(42, 190), rng.randint(42, 190))
            path = images_dir / f"{i:04d}_{j}.png"
            _draw(rng, size).save(path)
            paths.append(str(path))
        messages = []
        for turn in range(rng.randint(1, 3)):
            question = rng.choice(_QUESTIONS)
            if turn == 0 and n_images:
                question = "<image>" * n_images + question
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": _answer(rng)})
        samples.append({"messages": messages, "images": paths})
    out = data_dir / "samples.json"
    out.write_text(json.dumps(samples, indent=1))
    return out


def write_user_like_data_json(workdir: Path, n_samples: int = 30, *, max_pixels: int = 140 * 140,
                              min_pixels: int = 56 * 56) -> Path:
    """data.json for the user-like set, in MindSpeed-MM's format (its own data_7b.json keys)."""
    data_dir = workdir / "user_data"
    samples = data_dir / "samples.json"
    if not samples.exists() or len(json.loads(samples.read_text())) != n_samples:
        write_user_like_data(data_dir, n_samples)
    cfg = {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": str(workdir / "processor"), "use_fast_tokenizer": True,
                "split_special_tokens": False, "image_max_pixels": max_pixels, "image_min_pixels": min_pixels,
                "video_max_pixels": 16384, "video_min_pixels": 0, "video_fps": 2.0, "video_maxlen": 64},
            "basic_parameters": {
                "template": "qwen2vl", "dataset_dir": str(data_dir), "dataset": str(samples),
                "cache_dir": str(data_dir / "cache_dir"), "train_on_prompt": False, "mask_history": False,
                "preprocessing_batch_size": 64, "preprocessing_num_workers": 1, "max_samples": None,
                "tool_format": None},
            "attr": {"system": None, "images": "images", "videos": None, "messages": "messages",
                     "role_tag": "role", "content_tag": "content", "user_tag": "user",
                     "assistant_tag": "assistant", "observation_tag": None, "function_tag": None,
                     "system_tag": None},
        },
        "dataloader_param": {
            "dataloader_mode": "sampler", "drop_last": True, "sampler_type": "BaseRandomBatchSampler",
            "collate_param": {"model_name": "qwen2vl", "ignore_pad_token_for_loss": True},
            "pin_memory": False, "shuffle": True},
    }
    path = workdir / "data_user.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_flow.emulation.scaled", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--models", default=",".join(EXAMPLES))
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args(argv)
    root = find_sources().mindspeed_mm.root
    for size in args.models.split(","):
        print(scaled_model_json(root, size, args.workdir))
    print(write_user_like_data_json(args.workdir.resolve(), args.samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
