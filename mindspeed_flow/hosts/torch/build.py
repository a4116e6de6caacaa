"""Build a whole HF vision-language model from a config dict (tiny presets) or a local checkpoint directory.

Every rank that calls `build_vlm` with the same config and seed gets bit-identical parameters: weights are
initialized under a private, seeded RNG (the caller's RNG state is left untouched), in fp32, then cast to the
requested dtype. Real checkpoints load from a local directory only (config.json + safetensors): training
jobs must never reach the hub.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from mindspeed_flow.hosts.torch import hf_compat

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation={attn_implementation!r} is not supported by the torch host; "
                         f"choose one of {ATTN_IMPLEMENTATIONS} (the whole model's attention; packed "
                         f"microbatches run a varlen kernel over either)")


def build_vlm(family: str, hf_config: Mapping[str, Any], *, seed: int, dtype: torch.dtype = torch.float32,
              pretrained_path: Optional[str] = None, attn_implementation: str = "sdpa") -> nn.Module:
    """The whole HF model (Qwen2VL / Qwen2_5_VL / Llava ...ForConditionalGeneration) in train mode.

    `pretrained_path`: a local directory with config.json and safetensors weights; `hf_config` is then ignored.
    """
    _check_attn(attn_implementation)
    model_cls, config_cls = hf_compat.family_classes(family)
    if pretrained_path is not None:
        model = _load_local(model_cls, family, pretrained_path, dtype, attn_implementation)
    else:
        config = config_cls.from_dict(dict(hf_config))
        # A private RNG stream: identical weights on every rank, and the caller's sampling RNG is not consumed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls._from_config(config, attn_implementation=attn_implementation)
        model = model.to(dtype)
    hf_compat.family_of(model)  # the checkpoint's class must be the family asked for
    model.train()
    return model


def _load_local(model_cls: type, family: str, path: str, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.pretrained_path={path!r} is not a directory (expected config.json and "
                                f"*.safetensors from save_pretrained)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model.pretrained_path={path!r} has no config.json")
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type != family:
        raise ValueError(f"model.pretrained_path={path!r} holds model_type={model_type!r} but model.family={family!r}")
    return model_cls.from_pretrained(path, local_files_only=True, attn_implementation=attn_implementation,
                                     **hf_compat.dtype_kwarg(dtype))
