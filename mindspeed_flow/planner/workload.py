"""The workload a plan is made for: a list of `SampleShape`s drawn from a data recipe, preset or length table.

`data=` accepts:
- `infovqa`: InfoVQA-like shapes at Qwen2-VL's default resolution cap (max_pixels = 16384 * 28 * 28, so
  252 ... 16k image tokens per sample), the planner's default for real clusters;
- a data recipe name (recipes/data/NAME.yaml, e.g. `infovqa_tiny`) or a YAML path (DataConfig fields);
- a length-table CSV path (`sample_id,text_tokens,image_grid_thw`), replayed as is.

Synthetic shapes come from the training data generator itself (`mindspeed_flow.data.synthetic`), so the planner
sees exactly the shapes that `mindspeed-flow train` will train on for the same recipe.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

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


@dataclass(frozen=True)
class Workload:
    name: str
    shapes: tuple[SampleShape, ...]

    @property
    def max_llm_tokens(self) -> int:
        return max(s.llm_tokens for s in self.shapes)

    @property
    def mean_llm_tokens(self) -> float:
        return sum(s.llm_tokens for s in self.shapes) / len(self.shapes)


def _data_config(data: str) -> DataConfig:
    if data in BUILTIN_DATA:
        return DataConfig(**BUILTIN_DATA[data])
    path = data if data.endswith((".yaml", ".yml")) else os.path.join(recipes_dir(), "data", f"{data}.yaml")
    if not os.path.exists(path):
        known = sorted(BUILTIN_DATA) + sorted(
            f[:-5] for f in os.listdir(os.path.join(recipes_dir(), "data")) if f.endswith(".yaml"))
        raise ValueError(f"data={data!r}: not a built-in workload, data recipe, YAML or CSV path; known: {known}")
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"{path}: unknown data field(s) {unknown}")
    return DataConfig(**raw)


def synthetic_shapes(cfg: DataConfig, hf_config: Mapping[str, Any], num_samples: int) -> list[SampleShape]:
    """Shapes of the first `num_samples` samples the training generator would produce (no pixels drawn)."""
    from mindspeed_flow.data.synthetic import SyntheticInfoVQA, SyntheticParams
    from mindspeed_flow.data.tokens import token_spec_from_hf_config

    n = min(num_samples, cfg.num_samples)
    params = SyntheticParams(num_samples=n, seed=cfg.seed, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                             qa_turns_mean=cfg.qa_turns_mean, question_tokens=tuple(cfg.question_tokens),
                             answer_tokens=tuple(cfg.answer_tokens), text_only_fraction=cfg.text_only_fraction)
    dataset = SyntheticInfoVQA(params, token_spec_from_hf_config(hf_config))
    return [dataset.shape(i) for i in range(n)]


def load_workload(data: str, hf_config: Mapping[str, Any], num_samples: int = DEFAULT_SAMPLES) -> Workload:
    """Shapes for `data=` (see the module docstring), in the token geometry of `hf_config`'s family."""
    merge = 1 if hf_config.get("model_type") == "llava" else int(
        hf_config.get("vision_config", {}).get("spatial_merge_size", 2))
    if data.endswith(".csv"):
        return Workload(os.path.basename(data), tuple(read_length_table(data, merge_size=merge)))
    cfg = _data_config(data)
    if cfg.source == "length_table":
        if not cfg.path:
            raise ValueError(f"data={data!r}: source=length_table needs data.path (a CSV file)")
        return Workload(data, tuple(read_length_table(cfg.path, merge_size=merge)))
    if cfg.source != "synthetic_infovqa":
        raise ValueError(f"data={data!r}: source={cfg.source!r} cannot be planned from shapes alone; export a "
                         "length table first (mindspeed_flow.data.length_table.export_length_table)")
    return Workload(data, tuple(synthetic_shapes(cfg, hf_config, num_samples)))
