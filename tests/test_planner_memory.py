"""The planner's memory model against measurements on the tiny HF models (CPU, fp32).

- static memory (weights + grads + AdamW states) predicted from the spec counts vs the bytes of the real
  tensors after one AdamW step: within 1% (it is exact up to AdamW's scalar `step` tensors, excluded);
- activation memory predicted vs the bytes autograd saves for backward (distinct non-parameter storages,
  `planner.measure.saved_activation_bytes`): goal within 20%, for each family's encoder (one image) and
  backbone (packed microbatches at three token budgets).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mindspeed_flow.config.planner import PlannerConfig
from mindspeed_flow.data.synthetic import SyntheticInfoVQA, SyntheticParams
from mindspeed_flow.data.tokens import token_spec_from_hf_config
from mindspeed_flow.hosts.torch.build import build_vlm
from mindspeed_flow.hosts.torch.split import split_vlm
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.planner.cost import (
    CostContext, Layouts, backbone_activation_memory, encoder_activation_memory, static_memory,
)
from mindspeed_flow.planner.hardware import load_cluster
from mindspeed_flow.planner.measure import saved_activation_bytes, static_bytes_after_step
from mindspeed_flow.planner.parts import vlm_parts
from mindspeed_flow.specs import VLMSpec

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")
CPU_CFG = PlannerConfig(dtype="fp32", flash_attention=False, distributed_optimizer=False)
# Packed backbone microbatches attend with the varlen kernel (per-sequence causal SDPA, no score matrix kept).
CPU_CFG_VARLEN = dataclasses.replace(CPU_CFG, flash_attention=True)


def _setup(family: str):
    cfg = hf_config_dict(family, "tiny")
    model = build_vlm(family, cfg, seed=0)
    enc, bb = split_vlm(model)
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=16, max_pixels=50176), token_spec_from_hf_config(cfg))
    parts = vlm_parts(VLMSpec.from_hf_config(cfg), [ds.shape(i) for i in range(16)])
    ctx = CostContext(load_cluster("cpu"), CPU_CFG, 8)
    return model, enc, bb, ds, parts, ctx


@pytest.mark.parametrize("family", FAMILIES)
def test_static_memory_matches_adamw_tensors(family: str) -> None:
    model, enc, bb, _, (pe, pb), ctx = _setup(family)
    for module, part in ((enc, pe), (bb, pb)):
        measured = static_bytes_after_step(module)
        predicted = static_memory(ctx, np.array([part.total_params], dtype=np.float64), np.array([1]), True)
        for key in ("weights", "grads", "optim"):
            assert abs(float(predicted[key][0]) - measured[key]) <= 0.01 * measured[key], (family, part.name, key)


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_memory_within_20_percent(family: str) -> None:
    torch.manual_seed(0)
    model, enc, bb, ds, (pe, pb), ctx = _setup(family)
    samples = [ds.sample(i) for i in range(8)]
    rows = []
    for s in samples[:2]:
        shape = ds.shape(s.sample_id)
        measured, _ = saved_activation_bytes(lambda: enc(s.pixel_values, s.image_grid_thw), model.parameters())
        one = dataclasses.replace(pe, tokens_per_sample=float(shape.vit_patches), max_item_tokens=shape.vit_patches)
        pred = float(encoder_activation_memory(one, ctx, np.array([1.0]), np.array([1]), np.array([0]))[0])
        rows.append(("encoder", shape.vit_patches, measured, pred))
    with torch.no_grad():
        embeds = [enc(x.pixel_values, x.image_grid_thw) if x.pixel_values is not None else None for x in samples]
    for k, budget in ((2, 512), (4, 1024), (8, 2048)):
        packed = bb.pack(samples[:k], embeds[:k], token_budget=budget)
        measured, _ = saved_activation_bytes(lambda: bb(packed, embeds[:k]), model.parameters())
        L = Layouts.from_rows([{"dp": 1, "tp": 1, "pp": 1, "cp": 1, "b": budget, "rc": 0}])
        # + the fp32 log-probs the loss saves (the planner books them, with their gradient, as buffers)
        varlen = dataclasses.replace(ctx, cfg=CPU_CFG_VARLEN)
        pred = float(backbone_activation_memory(pb, varlen, L, np.array([1.0]))[0]) + budget * pb.vocab * 4
        rows.append(("backbone", budget, measured, pred))
    for what, size, measured, pred in rows:
        err = pred / measured - 1
        print(f"{family:<11} {what:<8} size {size:>5}: measured {measured / 2**20:7.2f} MiB, "
              f"predicted {pred / 2**20:7.2f} MiB, error {100 * err:+.1f}%")
        assert abs(err) <= 0.20, (family, what, size, measured, pred)


def test_real_config_static_memory_uses_exact_counts() -> None:
    """bf16 + distributed optimizer at dp=1, tp=pp=1: 2 + 4 + 12 bytes per parameter of the exact count."""
    cfg = hf_config_dict("qwen2_5_vl", "72b")
    spec = VLMSpec.from_hf_config(cfg)
    ctx = CostContext(load_cluster("atlas_900_a3_384"), PlannerConfig(), 16)
    total = spec.llm.total_params
    mem = static_memory(ctx, np.array([float(total)]), np.array([1]), True)
    assert sum(float(v[0]) for v in mem.values()) == pytest.approx(total * 18, rel=1e-12)
    assert total == 73_410_777_344 - spec.vision.params
