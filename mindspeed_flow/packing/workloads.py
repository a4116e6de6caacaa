"""Seeded shape-only workloads for the packing scheduler and its benchmark; no pixels.

InfoVQA-like: tall infographics, width about 600-6250 px (typically ~1000), aspect height/width mostly 1:1 to 1:6
(heights up to ~9400 px, typically 1000x3000), resized the Qwen2-VL way (each side to a multiple of 28, pixels
clamped to [min_pixels, max_pixels]); image tokens = (H/28)*(W/28), ViT grid (1, H/14, W/14). Each image has
k ~ Poisson(qa_turns_mean) >= 1 QA turns of a 10-20 token question and a 1-5 token answer. A fraction of
samples can be text-only (ShareGPT-like, up to 2K tokens).

Near-budget: text-only samples whose lengths are drawn relative to the budget (log-normal around 40% of it,
clipped to [16, budget]), so many samples fill most of a pack on their own and packing has to pair large
samples with small ones: the hard case for any packer, where the InfoVQA mix is the easy one.

Vectorized numpy: a million shapes take about a second.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mindspeed_flow.data.image import smart_resize_many
from mindspeed_flow.data.shapes import SampleShape

PATCH = 14
FACTOR = 28  # patch 14 x spatial merge 2


def smart_resize(height: np.ndarray, width: np.ndarray, min_pixels: int,
                 max_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2-VL resize of many shapes (patch 14 x merge 2): the data layer's one rule, vectorised."""
    return smart_resize_many(height, width, min_pixels, max_pixels, FACTOR)


@dataclass
class InfoVQAArrays:
    """Per-sample arrays of an InfoVQA-like workload (no Python objects: a million samples fit easily)."""

    text_tokens: np.ndarray  # int64
    grid_h: np.ndarray  # ViT patches down the image (0 for text-only)
    grid_w: np.ndarray  # ViT patches across

    @property
    def llm_tokens(self) -> np.ndarray:
        return self.text_tokens + (self.grid_h * self.grid_w) // 4

    def shapes(self, start_id: int = 0) -> list[SampleShape]:
        text, gh, gw = self.text_tokens.tolist(), self.grid_h.tolist(), self.grid_w.tolist()
        return [SampleShape(start_id + i, text[i], ((1, gh[i], gw[i]),) if gh[i] else ()) for i in range(len(text))]


def infovqa_arrays(n: int, *, seed: int = 1234, max_pixels: int = 1280 * FACTOR * FACTOR,
                   min_pixels: int = 4 * FACTOR * FACTOR, qa_turns_mean: float = 5.5,
                   question_tokens: Sequence[int] = (10, 20), answer_tokens: Sequence[int] = (1, 5),
                   text_only_fraction: float = 0.0) -> InfoVQAArrays:
    """`n` InfoVQA-like samples as arrays (see the module docstring for the distributions)."""
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} > max_pixels={max_pixels}")
    rng = np.random.default_rng(seed)
    width = np.clip(rng.lognormal(np.log(1000.0), 0.45, n), 600, 6250)
    aspect = np.clip(rng.lognormal(np.log(2.8), 0.55, n), 0.5, 9.0)
    height = np.clip(width * aspect, 340, 9400)
    hb, wb = smart_resize(height, width, min_pixels, max_pixels)
    turns = np.maximum(1, rng.poisson(qa_turns_mean, n))
    text = _turn_tokens(rng, turns, question_tokens, answer_tokens)
    text_only = rng.random(n) < text_only_fraction
    text = np.where(text_only, np.clip(rng.lognormal(np.log(300.0), 0.9, n), 16, 2048).astype(np.int64), text)
    keep = ~text_only
    return InfoVQAArrays(text.astype(np.int64), np.where(keep, hb // PATCH, 0), np.where(keep, wb // PATCH, 0))


def infovqa_shapes(n: int, *, seed: int = 1234, start_id: int = 0, **kwargs: Any) -> list[SampleShape]:
    """`n` InfoVQA-like sample shapes with ids start_id .. start_id + n - 1 (kwargs as `infovqa_arrays`)."""
    return infovqa_arrays(n, seed=seed, **kwargs).shapes(start_id)


def _turn_tokens(rng: np.random.Generator, turns: np.ndarray, question: Sequence[int],
                 answer: Sequence[int]) -> np.ndarray:
    """Sum over each sample's turns of question + answer tokens (uniform within the given inclusive ranges)."""
    total = int(turns.sum())
    per_turn = rng.integers(question[0], question[1] + 1, total) + rng.integers(answer[0], answer[1] + 1, total)
    starts = np.r_[0, np.cumsum(turns)[:-1]]
    return np.add.reduceat(per_turn, starts).astype(np.int64) if total else np.zeros(0, np.int64)




def near_budget_lengths(n: int, budget: int, *, seed: int = 1234) -> np.ndarray:
    """`n` sample lengths (LLM tokens) close to `budget` (see the module docstring)."""
    if n < 0 or budget < 16:
        raise ValueError(f"n={n}, budget={budget}: need n >= 0 and budget >= 16")
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(0.4 * budget), 0.6, n), 16, budget).astype(np.int64)


def near_budget_shapes(n: int, budget: int, *, seed: int = 1234, start_id: int = 0) -> list[SampleShape]:
    """`n` text-only sample shapes of `near_budget_lengths`, ids start_id .. start_id + n - 1."""
    return [SampleShape(start_id + i, int(t)) for i, t in enumerate(near_budget_lengths(n, budget, seed=seed))]
