"""Small seeded VLMSamples in each family's pixel format, for the torch host's tests and quick checks.

Follows the sample contract of `mindspeed_flow.data.sample` (vision start, image placeholders, vision end,
then question / answer / eos turns; labels on answers and eos). The real synthetic workload lives in
`mindspeed_flow.data`; this one only needs to be tiny and varied (several images, text-only samples).
"""
from __future__ import annotations

from typing import Sequence

import torch

from mindspeed_flow.data.sample import IGNORE_INDEX, VLMSample
from mindspeed_flow.model_presets.tiny import EOS_ID, IMAGE_TOKEN_ID, TINY_PRESETS, VISION_END_ID, VISION_START_ID


def qwen_pixels(grid: Sequence[int], gen: torch.Generator, patch: int = 14, temporal: int = 2) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, 3 * temporal * patch * patch, generator=gen)


def make_sample(family: str, sample_id: int, grids: Sequence[Sequence[int]], turns: int, gen: torch.Generator,
                *, merge: int = 2, llava_image_size: int = 56, llava_patch: int = 14,
                text_vocab: int = 370) -> VLMSample:
    """One conversation: the images of `grids` (Qwen t,h,w patch grids; LLaVA: count only), then `turns` QA turns."""
    ids: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    counts: list[int] = []
    for grid in grids:
        n = (grid[0] * grid[1] * grid[2]) // (merge * merge) if family != "llava" \
            else (llava_image_size // llava_patch) ** 2
        counts.append(n)
        block = torch.tensor([VISION_START_ID] + [IMAGE_TOKEN_ID] * n + [VISION_END_ID])
        ids.append(block)
        labels.append(torch.full_like(block, IGNORE_INDEX))
    for _ in range(turns):
        q = torch.randint(0, text_vocab, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)
        a = torch.randint(0, text_vocab, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
        ids += [q, a, torch.tensor([EOS_ID])]
        labels += [torch.full_like(q, IGNORE_INDEX), a, torch.tensor([EOS_ID])]
    pixel_values, grid_thw = None, None
    if grids:
        if family == "llava":
            pixel_values = torch.randn(len(grids), 3, llava_image_size, llava_image_size, generator=gen)
            side = llava_image_size // llava_patch
            grid_thw = torch.tensor([[1, side, side]] * len(grids))
        else:
            patch = TINY_PRESETS[(family, "tiny")]["vision_config"]["patch_size"]  # Qwen3-VL: 16, before: 14
            pixel_values = torch.cat([qwen_pixels(g, gen, patch) for g in grids])
            grid_thw = torch.tensor([list(g) for g in grids])
    return VLMSample(sample_id=sample_id, input_ids=torch.cat(ids), labels=torch.cat(labels),
                     pixel_values=pixel_values, image_grid_thw=grid_thw, image_token_counts=counts)


def make_samples(family: str, n: int, seed: int = 0) -> list[VLMSample]:
    """n varied samples: one or two images of different grids, every fourth sample text-only."""
    gen = torch.Generator().manual_seed(seed)
    grid_choices = [(1, 4, 6), (1, 6, 4), (1, 2, 2), (1, 4, 4), (1, 8, 2)]
    out = []
    for i in range(n):
        n_images = 0 if i % 4 == 3 else 1 + (i % 2)
        grids = [grid_choices[(i + k) % len(grid_choices)] for k in range(n_images)]
        out.append(make_sample(family, 1000 + i, grids, turns=1 + i % 2, gen=gen))
    return out
