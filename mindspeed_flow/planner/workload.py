"""The workload a plan is made for: a list of `SampleShape`s drawn from a data recipe, preset or length table.

`data=` accepts:
- `infovqa`: InfoVQA-like shapes at Qwen2-VL's default resolution cap (max_pixels = 16384 * 28 * 28, so
  252 ... 16k image tokens per sample), the planner's default for real clusters;
- a data recipe name (recipes/data/NAME.yaml, e.g. `infovqa_tiny`, or `omni_tiny`: audio + image samples for the
  Omni thinker) or a YAML path (DataConfig fields);
- a length-table CSV path (`sample_id,text_tokens,image_grid_thw`), replayed as is;
- encoder-heavy planning workloads (shapes only, no training data source: `PLAN_ONLY_DATA`):
  `video`: 16-64 frames a sample, each frame one 448 px tile (InternVL's way of feeding video: every frame its own
  tile and attention sequence), and `infovqa_tiles`: the InfoVQA-like images cut into InternVL's dynamic 448 px
  tiles (at most 12, plus a thumbnail when there are several); and, for a model with an audio encoder (the
  Qwen2.5-Omni thinker), `infovqa_audio`: the `infovqa` samples, each with one spoken-question clip of 2-30 s
  (its mel frames in `SampleShape.audio_frames`, its LLM tokens by the Omni audio encoder's length rule).

Synthetic shapes come from the training data generator itself (`mindspeed_flow.data.synthetic`), so the planner
sees exactly the shapes that `mindspeed-flow train` will train on for the same recipe.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from omegaconf import OmegaConf

from mindspeed_flow.config.schema import DataConfig
from mindspeed_flow.data.shapes import SampleShape, read_length_table
from mindspeed_flow.planner.hardware import recipes_dir

# Qwen2-VL's preprocessor defaults (preprocessor_config.json): the full-resolution InfoVQA workload.
QWEN_MAX_PIXELS = 16384 * 28 * 28
QWEN_MIN_PIXELS = 4 * 28 * 28
BUILTIN_DATA: dict[str, dict[str, Any]] = {
    "infovqa": {"source": "synthetic_infovqa", "min_pixels": QWEN_MIN_PIXELS, "max_pixels": QWEN_MAX_PIXELS},
}
DEFAULT_SAMPLES = 2048

# Encoder-heavy workloads: InternVL's 448 px tile (InternVL 1.5, arXiv 2404.16821: dynamic tiling, at most 12 tiles
# in training, plus a thumbnail). The frame count and the text lengths of `video` are assumed (16-64 frames a
# sample is the range the planner is asked to cover), not drawn from a dataset.
TILE_PX = 448
MAX_TILES = 12
VIDEO_FRAMES = (16, 64)
VIDEO_PROMPT_TOKENS = (20, 60)
VIDEO_ANSWER_TOKENS = (10, 200)
VIDEO_TOKENS_PER_FRAME_MARKUP = 4  # "Frame k: <img>" ... "</img>" around each frame's tokens
# `infovqa_audio`: one spoken question per sample, its length uniform in AUDIO_SECONDS. The range is assumed (2 s:
# a few words; 30 s: the Whisper feature extractor's window), not drawn from a dataset. Whisper's features are 100
# mel frames a second; the clip's <|audio_bos|> and <|audio_eos|> are text tokens.
AUDIO_SECONDS = (2, 30)
MEL_FRAMES_PER_SECOND = 100
AUDIO_MARKUP_TOKENS = 2
PLAN_ONLY_DATA = ("video", "infovqa_tiles", "infovqa_audio")
# data sources whose shapes come from the generator without drawing a sample
SHAPED_SOURCES = ("synthetic_infovqa", "synthetic_omni")


@dataclass(frozen=True)
class Workload:
    name: str
    shapes: tuple[SampleShape, ...]


def _data_config(data: str) -> DataConfig:
    if data in BUILTIN_DATA:
        return DataConfig(**BUILTIN_DATA[data])
    path = data if data.endswith((".yaml", ".yml")) else os.path.join(recipes_dir(), "data", f"{data}.yaml")
    if not os.path.exists(path):
        known = sorted(BUILTIN_DATA) + list(PLAN_ONLY_DATA) + sorted(
            f[:-5] for f in os.listdir(os.path.join(recipes_dir(), "data")) if f.endswith(".yaml"))
        raise ValueError(f"data={data!r}: not a built-in workload, data recipe, YAML or CSV path; known: {known}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"{path}: unknown data field(s) {unknown}")
    return DataConfig(**raw)


def synthetic_shapes(cfg: DataConfig, hf_config: Mapping[str, Any], num_samples: int) -> list[SampleShape]:
    """Shapes of the first `num_samples` samples the training generator would produce (no pixels drawn): the
    data set `mindspeed-flow train` builds from the same recipe (synthetic_omni's shapes carry each clip's mel
    frames)."""
    from mindspeed_flow.data.build import build_dataset  # lazy: torch
    from mindspeed_flow.data.tokens import token_spec_from_hf_config  # lazy: torch

    dataset = build_dataset(cfg, token_spec_from_hf_config(hf_config), hf_config=hf_config)
    return [dataset.shape(i) for i in range(min(num_samples, len(dataset)))]


def _tile_grid(hf_config: Mapping[str, Any]) -> tuple[int, int, int]:
    """The ViT patch grid of one 448 px tile (32 x 32 patches of 14 px)."""
    side = TILE_PX // int(hf_config.get("vision_config", {}).get("patch_size", 14))
    return (1, side, side)


def tile_count(height: int, width: int, max_tiles: int = MAX_TILES) -> int:
    """InternVL-style dynamic tiling: the tile grid (cols x rows, at most `max_tiles` tiles) whose aspect ratio is
    nearest the image's, the larger grid on a tie when the image has the pixels for it; + 1 thumbnail if > 1."""
    aspect = width / height
    best, best_diff = (1, 1), float("inf")
    for n in range(1, max_tiles + 1):
        for cols in range(1, n + 1):
            if n % cols:
                continue
            rows = n // cols
            diff = abs(aspect - cols / rows)
            if diff < best_diff or (diff == best_diff and height * width > 0.5 * TILE_PX**2 * cols * rows):
                best, best_diff = (cols, rows), diff
    tiles = best[0] * best[1]
    return tiles + 1 if tiles > 1 else tiles


def video_shapes(hf_config: Mapping[str, Any], num_samples: int, merge: int, seed: int = 1234) -> list[SampleShape]:
    """`video`: 16-64 frames a sample (uniform), each one 448 px tile, plus a prompt and an answer."""
    rng = np.random.default_rng(seed)
    grid = _tile_grid(hf_config)
    out = []
    for i in range(num_samples):
        frames = int(rng.integers(VIDEO_FRAMES[0], VIDEO_FRAMES[1] + 1))
        text = (int(rng.integers(*VIDEO_PROMPT_TOKENS)) + int(rng.integers(*VIDEO_ANSWER_TOKENS))
                + VIDEO_TOKENS_PER_FRAME_MARKUP * frames)
        out.append(SampleShape(i, text, (grid,) * frames, merge))
    return out


def tiled_infovqa_shapes(hf_config: Mapping[str, Any], num_samples: int, merge: int) -> list[SampleShape]:
    """`infovqa_tiles`: the `infovqa` samples' text and original image sizes, each image cut into 448 px tiles."""
    from mindspeed_flow.data.synthetic import SyntheticInfoVQA, SyntheticParams  # lazy: torch
    from mindspeed_flow.data.tokens import token_spec_from_hf_config  # lazy: torch

    cfg = DataConfig(**BUILTIN_DATA["infovqa"])
    n = min(num_samples, cfg.num_samples)
    dataset = SyntheticInfoVQA(SyntheticParams(num_samples=n, seed=cfg.seed, min_pixels=cfg.min_pixels,
                                               max_pixels=cfg.max_pixels), token_spec_from_hf_config(hf_config))
    grid = _tile_grid(hf_config)
    out = []
    for i in range(n):
        hw = dataset.original_size(i)
        tiles = 0 if hw is None else tile_count(*hw)
        out.append(SampleShape(i, dataset.shape(i).text_tokens, (grid,) * tiles, merge))
    return out


def audio_infovqa_shapes(hf_config: Mapping[str, Any], num_samples: int, seed: int = 4321) -> list[SampleShape]:
    """`infovqa_audio`: the `infovqa` samples, each with one spoken-question clip (AUDIO_SECONDS, uniform)."""
    if not hf_config.get("audio_config"):
        raise ValueError(f"data=infovqa_audio: the model ({hf_config.get('model_type')}) has no audio encoder "
                         "(audio_config); plan it on infovqa")
    rng = np.random.default_rng(seed)
    lo, hi = (sec * MEL_FRAMES_PER_SECOND for sec in AUDIO_SECONDS)
    out = []
    for s in synthetic_shapes(DataConfig(**BUILTIN_DATA["infovqa"]), hf_config, num_samples):
        frames = int(rng.integers(lo, hi + 1))
        out.append(dataclasses.replace(s, text_tokens=s.text_tokens + AUDIO_MARKUP_TOKENS, audio_frames=(frames,)))
    return out


def load_workload(data: str, hf_config: Mapping[str, Any], num_samples: int = DEFAULT_SAMPLES) -> Workload:
    """Shapes for `data=` (see the module docstring), in the token geometry of `hf_config`'s family."""
    merge = 1 if hf_config.get("model_type") == "llava" else int(
        hf_config.get("vision_config", {}).get("spatial_merge_size", 2))
    if data == "video":
        return Workload(data, tuple(video_shapes(hf_config, num_samples, merge)))
    if data == "infovqa_tiles":
        return Workload(data, tuple(tiled_infovqa_shapes(hf_config, num_samples, merge)))
    if data == "infovqa_audio":
        return Workload(data, tuple(audio_infovqa_shapes(hf_config, num_samples)))
    if data.endswith(".csv"):
        return Workload(os.path.basename(data), tuple(read_length_table(data, merge_size=merge)))
    cfg = _data_config(data)
    if cfg.source == "length_table":
        if not cfg.path:
            raise ValueError(f"data={data!r}: source=length_table needs data.path (a CSV file)")
        return Workload(data, tuple(read_length_table(cfg.path, merge_size=merge)))
    if cfg.source not in SHAPED_SOURCES:
        raise ValueError(f"data={data!r}: source={cfg.source!r} cannot be planned from shapes alone; export a "
                         "length table first (mindspeed_flow.data.length_table.export_length_table)")
    return Workload(data, tuple(synthetic_shapes(cfg, hf_config, num_samples)))
