"""The model-ready sample that flows through mindspeed-flow, and the token conventions shared by all families.

One `VLMSample` is one conversation: its images (already processed into the family's pixel format) and its
token ids with every image expanded into its placeholder tokens. The conversation template is deliberately
simple and identical for every family, so the length table's `text_tokens` is exact:

    for each image:  <vision_start> <image_pad> * n_image_tokens <vision_end>
    for each turn:   question ids  answer ids  <eos>

Labels are the answer ids and the turn's <eos>; everything else is IGNORE_INDEX.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from mindspeed_flow.data.shapes import SampleShape

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenSpec:
    """Special token ids and image geometry a sample builder needs from the model config."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    eos_id: int
    vocab_size: int
    # "qwen2": flattened ViT patches [sum(t*h*w), C*tp*p*p] + image_grid_thw, tokens = t*h*w / merge^2
    # "llava": fixed-size images [n, C, S, S], tokens = (S / patch)^2
    image_format: str = "qwen2"
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_size: int = 0  # llava only

    @property
    def first_special_id(self) -> int:
        return min(self.image_token_id, self.vision_start_id, self.vision_end_id, self.eos_id)


@dataclass
class VLMSample:
    sample_id: int
    input_ids: torch.Tensor  # int64 [L]
    labels: torch.Tensor  # int64 [L], IGNORE_INDEX where no loss
    pixel_values: Optional[torch.Tensor]  # family pixel format (see TokenSpec.image_format); None if no image
    image_grid_thw: Optional[torch.Tensor]  # int64 [n_images, 3] ViT patch grid; llava: [n, 1, S/p, S/p]
    image_token_counts: list[int] = field(default_factory=list)  # LLM tokens per image

    @property
    def llm_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def image_tokens(self) -> int:
        return sum(self.image_token_counts)

    @property
    def text_tokens(self) -> int:
        return self.llm_tokens - self.image_tokens

    @property
    def label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def shape(self, merge_size: int = 2) -> SampleShape:
        grid = () if self.image_grid_thw is None else tuple(tuple(int(x) for x in g) for g in self.image_grid_thw)
        return SampleShape(self.sample_id, self.text_tokens, grid, merge_size)
