"""`build_dataset`: the one place that turns a `DataConfig` (recipes/data/*.yaml) into a dataset.

Sources: `synthetic_infovqa` (SyntheticInfoVQA), `sharegpt` (ShareGPTDataset over data.path + data.image_root),
`length_table` (LengthTableDataset replaying data.path), `synthetic_omni` (SyntheticOmni: audio + images for the
Qwen2.5-Omni thinker). Field errors name the `data.` field and the rule.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from mindspeed_flow.data.base import VLMDataset
from mindspeed_flow.data.length_table import LengthTableDataset
from mindspeed_flow.data.omni import AudioSpec, SyntheticOmni
from mindspeed_flow.data.sample import TokenSpec
from mindspeed_flow.data.sharegpt import ShareGPTDataset
from mindspeed_flow.data.synthetic import SyntheticInfoVQA, SyntheticParams
from mindspeed_flow.data.tokens import Tokenizer

SOURCES = ("synthetic_infovqa", "sharegpt", "length_table", "synthetic_omni")


def _pair(data_cfg: Any, name: str) -> tuple[int, int]:
    value = list(getattr(data_cfg, name))
    if len(value) != 2:
        raise ValueError(f"data.{name}={value} must be a [lo, hi] pair")
    return int(value[0]), int(value[1])


def synthetic_params(data_cfg: Any) -> SyntheticParams:
    """The synthetic generator's parameters from a DataConfig (validated: errors name the data. field)."""
    return SyntheticParams(
        num_samples=int(data_cfg.num_samples), seed=int(data_cfg.seed), min_pixels=int(data_cfg.min_pixels),
        max_pixels=int(data_cfg.max_pixels), qa_turns_mean=float(data_cfg.qa_turns_mean),
        question_tokens=_pair(data_cfg, "question_tokens"), answer_tokens=_pair(data_cfg, "answer_tokens"),
        text_only_fraction=float(data_cfg.text_only_fraction))


def _required_path(data_cfg: Any) -> str:
    if not data_cfg.path:
        raise ValueError(f"data.source={data_cfg.source!r} needs data.path (the "
                         f"{'JSON file' if data_cfg.source == 'sharegpt' else 'CSV length table'})")
    if not os.path.exists(data_cfg.path):
        raise FileNotFoundError(f"data.path={data_cfg.path!r} does not exist")
    return str(data_cfg.path)


def build_dataset(data_cfg: Any, token_spec: TokenSpec, tokenizer: Optional[Tokenizer] = None,
                  hf_config: Optional[Mapping[str, Any]] = None) -> VLMDataset:
    """A dataset for `data_cfg.source`; `tokenizer` (str -> ids) is used by sharegpt (default: byte-level),
    `hf_config` (the model's config.json dict) by synthetic_omni (audio ids and mel bins)."""
    source = data_cfg.source
    if int(data_cfg.max_bad_samples) < 0:
        raise ValueError(f"data.max_bad_samples must be >= 0, got {data_cfg.max_bad_samples}")
    if source == "synthetic_infovqa":
        return SyntheticInfoVQA(synthetic_params(data_cfg), token_spec)
    if source == "sharegpt":
        path = _required_path(data_cfg)
        if data_cfg.image_root and not os.path.isdir(data_cfg.image_root):
            raise FileNotFoundError(f"data.image_root={data_cfg.image_root!r} is not a directory")
        table = getattr(data_cfg, "shape_table", None)
        if table and not os.path.exists(table):
            raise FileNotFoundError(f"data.shape_table={table!r} does not exist (write it once with "
                                    "mindspeed_flow.data.export_length_table)")
        if not 0 < int(data_cfg.min_pixels) <= int(data_cfg.max_pixels):
            raise ValueError(f"data.min_pixels={data_cfg.min_pixels} and data.max_pixels={data_cfg.max_pixels} "
                             "need 0 < min_pixels <= max_pixels")
        return ShareGPTDataset(path, token_spec, image_root=data_cfg.image_root, tokenizer=tokenizer,
                               min_pixels=int(data_cfg.min_pixels), max_pixels=int(data_cfg.max_pixels),
                               verify_images=bool(getattr(data_cfg, "verify_images", True)),
                               shape_table=table or None)
    if source == "length_table":
        return LengthTableDataset(_required_path(data_cfg), token_spec, seed=int(data_cfg.seed),
                                  question_tokens=_pair(data_cfg, "question_tokens"),
                                  answer_tokens=_pair(data_cfg, "answer_tokens"))
    if source == "synthetic_omni":
        if hf_config is None:
            raise ValueError("data.source='synthetic_omni' needs the model's HF config (a Qwen2.5-Omni thinker)")
        return SyntheticOmni(synthetic_params(data_cfg), token_spec, AudioSpec.from_hf_config(hf_config),
                             _pair(data_cfg, "audio_frames"))
    raise ValueError(f"data.source={source!r} is unknown; choose one of {SOURCES}")
