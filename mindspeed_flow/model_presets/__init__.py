"""Model presets as plain HF `config.json` dicts (pure data, no torch): tiny CPU models and real architectures.

`hf_config_dict(family, preset, overrides)` is the one lookup used by the torch host (to build models), the
planner (to count parameters and FLOPs) and the packing cost model. A local checkpoint directory's
config.json can stand in for a preset (see `load_config_json`).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping

from mindspeed_flow.model_presets.tiny import TINY_PRESETS

try:  # real-architecture presets (planner); optional so the tiny path never depends on them
    from mindspeed_flow.model_presets.real import REAL_PRESETS  # optional: real presets
except ImportError:  # pragma: no cover
    REAL_PRESETS: dict[tuple[str, str], dict] = {}

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "qwen2_5_omni_thinker", "qwen3_vl", "qwen3_vl_moe", "internvl",
            "glm4v_moe")


def deep_merge(base: dict, overrides: Mapping[str, Any]) -> dict:
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def hf_config_dict(family: str, preset: str, overrides: Mapping[str, Any] | None = None) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"model.family={family!r} is not supported; choose one of {FAMILIES}")
    table = {**TINY_PRESETS, **REAL_PRESETS}
    if (family, preset) not in table:
        names = sorted(p for f, p in table if f == family)
        raise ValueError(f"model.preset={preset!r} is unknown for family {family!r}; known presets: {names}")
    return deep_merge(table[(family, preset)], overrides or {})


def load_config_json(path: str) -> dict:
    """Read config.json from a local checkpoint directory (or the file itself)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"model.pretrained_path={path!r}: no config.json found at {file!r}")
    with open(file) as f:
        return json.load(f)
