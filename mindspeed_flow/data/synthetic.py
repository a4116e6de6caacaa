"""`SyntheticInfoVQA`: a seeded InfoVQA-like workload with real pixels, token ids and labels.

Shape statistics follow InfoVQA: tall infographics, width log-normal around 1000 px (600-6250), height
log-normal around 3x the width (up to 9400), Qwen2-VL dynamic resolution (`smart_resize` within
[min_pixels, max_pixels]); Poisson(qa_turns_mean) QA turns (at least one), questions of 10-20 and answers of
1-5 tokens by default. At Qwen2-VL's usual max_pixels samples are over 90% image tokens.

Sample i is a pure function of (config, i): its structure comes from `default_rng([seed, i, 0])` and its
pixels from `default_rng([seed, i, 1])`, so `shape(i)` never draws a pixel and every rank, in every run,
sees the same sample. Pixels are generated directly at the resized resolution (no decode, no resize); their
content makes the answers learnable (see `mindspeed_flow.data.content`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mindspeed_flow.data.base import VLMDataset
from mindspeed_flow.data.content import NUM_CLASSES, make_turns, pixel_rng, render_sample, structure_rng
from mindspeed_flow.data.image import llava_grid, qwen2_grid
from mindspeed_flow.data.sample import TokenSpec, VLMSample
from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.data.tokens import template_text_tokens

# InfoVQA-like original image sizes (pixels), before dynamic resolution.
WIDTH_MEDIAN, WIDTH_SIGMA, WIDTH_RANGE = 1000.0, 0.45, (600, 6250)
ASPECT_MEDIAN, ASPECT_SIGMA = 3.0, 0.5  # height / width
HEIGHT_RANGE = (300, 9400)


@dataclass(frozen=True)
class SyntheticParams:
    """The knobs of the generator (the synthetic part of `DataConfig`)."""

    num_samples: int = 4096
    seed: int = 1234
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 64 * 28 * 28
    qa_turns_mean: float = 5.5
    question_tokens: tuple[int, int] = (10, 20)
    answer_tokens: tuple[int, int] = (1, 5)
    text_only_fraction: float = 0.0

    def __post_init__(self) -> None:
        check_synthetic_params(self)


def _check_range(name: str, value: tuple[int, int], lowest: int) -> None:
    if len(value) != 2 or value[0] > value[1] or value[0] < lowest:
        raise ValueError(f"data.{name}={list(value)} must be [lo, hi] with {lowest} <= lo <= hi")


def check_synthetic_params(p: SyntheticParams) -> None:
    if p.num_samples <= 0:
        raise ValueError(f"data.num_samples must be > 0, got {p.num_samples}")
    if p.seed < 0:
        raise ValueError(f"data.seed must be >= 0 (it seeds numpy's SeedSequence), got {p.seed}")
    if not 0 < p.min_pixels <= p.max_pixels:
        raise ValueError(f"data.min_pixels={p.min_pixels} and data.max_pixels={p.max_pixels} need "
                         "0 < min_pixels <= max_pixels")
    if not p.qa_turns_mean > 0:
        raise ValueError(f"data.qa_turns_mean must be > 0, got {p.qa_turns_mean}")
    _check_range("question_tokens", p.question_tokens, 0)
    _check_range("answer_tokens", p.answer_tokens, 1)
    if not 0.0 <= p.text_only_fraction <= 1.0:
        raise ValueError(f"data.text_only_fraction must be in [0, 1], got {p.text_only_fraction}")


@dataclass(frozen=True)
class _Plan:
    """Everything about a sample except its pixels."""

    original_hw: tuple[int, int] | None  # None: text-only
    grids: tuple[tuple[int, int, int], ...]
    klass: int
    turns: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def draw_image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(height, width) of an InfoVQA-like infographic, in original pixels."""
    width = float(np.clip(WIDTH_MEDIAN * math.exp(WIDTH_SIGMA * rng.standard_normal()), *WIDTH_RANGE))
    aspect = ASPECT_MEDIAN * math.exp(ASPECT_SIGMA * rng.standard_normal())
    height = float(np.clip(width * aspect, *HEIGHT_RANGE))
    return int(round(height)), int(round(width))


class SyntheticInfoVQA(VLMDataset):
    """Seeded InfoVQA-like samples; see the module docstring."""

    def __init__(self, params: SyntheticParams, token_spec: TokenSpec) -> None:
        super().__init__(token_spec)
        self.params = params
        self._shapes: dict[int, SampleShape] = {}

    def __len__(self) -> int:
        return self.params.num_samples

    def _grid(self, hw: tuple[int, int]) -> tuple[int, int, int]:
        if self.token_spec.image_format == "llava":
            return llava_grid(self.token_spec)
        return qwen2_grid(hw[0], hw[1], self.token_spec, self.params.min_pixels, self.params.max_pixels)

    def _plan(self, i: int) -> _Plan:
        p = self.params
        rng = structure_rng(p.seed, i)
        text_only = bool(rng.random() < p.text_only_fraction)
        hw = None if text_only else draw_image_size(rng)
        klass = None if text_only else int(rng.integers(NUM_CLASSES))
        n_turns = max(1, int(rng.poisson(p.qa_turns_mean)))
        lengths = [(int(rng.integers(p.question_tokens[0], p.question_tokens[1] + 1)),
                    int(rng.integers(p.answer_tokens[0], p.answer_tokens[1] + 1))) for _ in range(n_turns)]
        klass_out, turns = make_turns(rng, klass, lengths, self.token_spec)
        grids = () if hw is None else (self._grid(hw),)
        return _Plan(hw, grids, klass_out, turns)

    def shape(self, i: int) -> SampleShape:
        i = self._check_index(i)
        cached = self._shapes.get(i)
        if cached is None:
            plan = self._plan(i)
            lengths = [(len(q), len(a)) for q, a in plan.turns]
            cached = SampleShape(i, template_text_tokens(len(plan.grids), lengths), plan.grids, self.merge_size)
            self._shapes[i] = cached
        return cached

    def original_size(self, i: int) -> tuple[int, int] | None:
        """The (height, width) the infographic had before dynamic resolution (None for text-only)."""
        return self._plan(self._check_index(i)).original_hw

    def sample(self, i: int, with_pixels: bool = True) -> VLMSample:
        i = self._check_index(i)
        plan = self._plan(i)
        rng = pixel_rng(self.params.seed, i) if with_pixels else None
        return render_sample(self.token_spec, i, plan.grids, plan.klass, plan.turns, rng)
