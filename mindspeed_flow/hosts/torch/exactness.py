"""Measure how exact the split and the packing are, on the tiny presets (fp32, CPU).

    python -m mindspeed_flow.hosts.torch.exactness            # all three families, prints one JSON object

- `split_vs_whole`: per sample, the whole HF model's summed token loss and parameter gradients against
  encoder -> pack (one sample, no padding) -> backbone. Expected: 0 difference.
- `packed_vs_unpacked`: one packed microbatch (with a padding tail) against the sum of its samples run one by
  one. Expected: ~1e-7 relative (only the attention kernel's summation order differs).

The tests (tests/test_host_split.py) assert on these numbers; this entry point prints them.
"""
from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

import torch
from torch import nn

from mindspeed_flow.data.sample import VLMSample
from mindspeed_flow.hosts.torch import hf_compat
from mindspeed_flow.hosts.torch.build import build_vlm
from mindspeed_flow.hosts.torch.packed import shifted_labels
from mindspeed_flow.hosts.torch.split import EncoderPart, split_vlm, token_loss_sum
from mindspeed_flow.hosts.torch.testing import make_samples
from mindspeed_flow.model_presets import hf_config_dict

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "qwen3_vl", "qwen3_vl_moe")


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    return build_vlm(family, hf_config_dict(family, "tiny"), seed=seed, attn_implementation=attn)


def take_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of all parameter gradients by name, then cleared (set to None)."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def encode(encoder: EncoderPart, samples: Sequence[VLMSample]) -> list[Optional[torch.Tensor]]:
    return [encoder(s.pixel_values, s.image_grid_thw) if s.pixel_values is not None else None for s in samples]


def grad_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """max_abs: largest absolute difference; max_abs_rel: that over the largest reference entry;
    global_rel: ||got - ref|| / ||ref|| over all parameters together."""
    if got.keys() != ref.keys():
        raise AssertionError(f"gradients for different parameters: only in one of them "
                             f"{sorted(set(got) ^ set(ref))[:5]}")
    max_abs = max((got[k] - ref[k]).abs().max().item() for k in ref)
    scale = max(g.abs().max().item() for g in ref.values())
    num = sum(float(((got[k] - ref[k]) ** 2).sum()) for k in ref) ** 0.5
    den = sum(float((ref[k] ** 2).sum()) for k in ref) ** 0.5
    return {"max_abs": max_abs, "max_abs_rel": max_abs / scale, "global_rel": num / den}


def split_vs_whole(family: str, n_samples: int = 4, seed: int = 0) -> dict[str, float]:
    model = tiny_model(family)
    encoder, backbone = split_vlm(model)
    worst_loss, worst_grad = 0.0, 0.0
    for s in make_samples(family, n_samples, seed=seed):
        out = model(**hf_compat.whole_model_inputs(model, s.input_ids, s.pixel_values, s.image_grid_thw))
        ref_loss = token_loss_sum(out.logits, shifted_labels(s.labels)[None])
        ref_loss.backward()
        ref = take_grads(model)
        embeds = encode(encoder, [s])
        loss, _ = backbone(backbone.pack([s], embeds, token_budget=s.llm_tokens), embeds)
        loss.backward()
        worst_loss = max(worst_loss, abs(loss.item() - ref_loss.item()))
        worst_grad = max(worst_grad, grad_errors(take_grads(model), ref)["max_abs"])
    return {"loss_abs_diff": worst_loss, "grad_max_abs_diff": worst_grad}


def packed_vs_unpacked(family: str, attn: str = "sdpa", n_samples: int = 4, pad: int = 9,
                       seed: int = 1) -> dict[str, float]:
    model = tiny_model(family, attn)
    encoder, backbone = split_vlm(model)
    samples = make_samples(family, n_samples, seed=seed)
    total = sum(backbone(backbone.pack([s], [e], s.llm_tokens), [e])[0]
                for s, e in zip(samples, encode(encoder, samples)))
    total.backward()
    ref = take_grads(model)
    embeds = encode(encoder, samples)
    packed = backbone.pack(samples, embeds, sum(s.llm_tokens for s in samples) + pad)
    loss, _ = backbone(packed, embeds)
    loss.backward()
    errors = grad_errors(take_grads(model), ref)
    return {"loss_rel_diff": abs(loss.item() - total.item()) / abs(total.item()), **errors}


def main(argv: Optional[list[str]] = None) -> int:
    torch.set_num_threads(1)
    report = {}
    for family in FAMILIES:
        report[family] = {"split_vs_whole": split_vs_whole(family),
                          "packed_vs_unpacked_sdpa": packed_vs_unpacked(family, "sdpa"),
                          "packed_vs_unpacked_eager": packed_vs_unpacked(family, "eager")}
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
