"""Learnable synthetic content: pixels and token ids that carry a signal a tiny model picks up in a few steps.

Each sample has a hidden class c in [0, NUM_CLASSES). The image shows it plainly: the class sets the mean RGB
colour (one corner of a colour cube per class) and the period of horizontal stripes, under mild noise. Each
answer is a deterministic function of c and the question's first token k:

    answer[j] = c * ANSWER_SPAN + (k + j) mod ANSWER_SPAN      (folded below first_special_id)

so the loss on answers drops from ln(vocab) first to the class marginal and then further as the model learns
to read the colour from the image. Text-only samples take c from the question (c = k mod NUM_CLASSES).
Everything is drawn from `numpy.random.Generator`s seeded per sample, so any rank regenerates any sample.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from mindspeed_flow.data.image import CLIP_MEAN, CLIP_STD, patchify_qwen2
from mindspeed_flow.data.sample import TokenSpec, VLMSample
from mindspeed_flow.data.tokens import build_conversation

NUM_CLASSES = 8
ANSWER_SPAN = 16
NOISE = 0.12  # half-width of the uniform pixel noise, in [0, 1] RGB units
STRIPE_AMPLITUDE = 0.1


def class_color(klass: int) -> tuple[float, float, float]:
    """Class -> RGB in [0, 1]: the three bits of the class pick low (0.25) or high (0.75) per channel."""
    return tuple(0.25 + 0.5 * ((klass >> bit) & 1) for bit in range(3))  # type: ignore[return-value]


def render_frames(rng: np.random.Generator, klass: int, height: int, width: int, frames: int = 1) -> torch.Tensor:
    """[frames, 3, H, W] float32, CLIP-normalized: class colour + class-period stripes + uniform noise.

    In [0, 1] RGB space the value is colour[c] + stripe(row) + U(-NOISE, NOISE), always inside [0, 1], and is
    normalized in the same pass; numpy's uniform draw and two fused in-place ops keep this at ~1 ms for the
    tiny demo's images.
    """
    rows = np.arange(height, dtype=np.float32)
    stripes = STRIPE_AMPLITUDE * np.sign(np.sin(rows * np.float32(2 * math.pi / (6 + 3 * klass))))
    color = np.asarray(class_color(klass), dtype=np.float32)
    mean, std = np.asarray(CLIP_MEAN, dtype=np.float32), np.asarray(CLIP_STD, dtype=np.float32)
    # offset[c, row] = (colour + stripe - NOISE - mean) / std; scale[c] = 2 * NOISE / std
    offset = ((color[:, None] + stripes[None, :] - NOISE - mean[:, None]) / std[:, None])[:, :, None]
    scale = (2 * NOISE / std)[:, None, None]
    out = rng.random((frames, 3, height, width), dtype=np.float32)
    out *= scale
    out += offset
    return torch.from_numpy(out)


def qwen2_pixels(rng: np.random.Generator, klass: int, grid: tuple[int, int, int],
                 spec: TokenSpec) -> torch.Tensor:
    """Pixels of exactly `grid` (t, h, w) patches, generated at that resolution and patchified."""
    t, h, w = grid
    # A still image (t == 1) is one frame that patchify repeats, as for a real photo; t > 1 is a clip.
    n_frames = 1 if t == 1 else t * spec.temporal_patch_size
    frames = render_frames(rng, klass, h * spec.patch_size, w * spec.patch_size, frames=n_frames)
    pixels, got = patchify_qwen2(frames, spec.patch_size, spec.temporal_patch_size, spec.merge_size)
    assert got == tuple(grid), (got, grid)  # a bug here would silently misalign every image token
    return pixels


def llava_pixels(rng: np.random.Generator, klass: int, spec: TokenSpec) -> torch.Tensor:
    """One LLaVA image [3, S, S], normalized."""
    return render_frames(rng, klass, spec.image_size, spec.image_size)[0]


def random_ids(rng: np.random.Generator, n: int, spec: TokenSpec) -> tuple[int, ...]:
    """`n` ordinary token ids, uniform over [0, first_special_id)."""
    return tuple(int(x) for x in rng.integers(0, spec.first_special_id, size=n))


def answer_ids(klass: int, question: Sequence[int], n: int, spec: TokenSpec) -> tuple[int, ...]:
    """The deterministic answer for (class, question): see the module docstring."""
    key = question[0] if question else 0
    limit = spec.first_special_id
    return tuple((klass * ANSWER_SPAN + (key + j) % ANSWER_SPAN) % limit for j in range(n))


def text_only_class(question: Sequence[int]) -> int:
    return (question[0] if question else 0) % NUM_CLASSES


def make_turns(rng: np.random.Generator, klass: int | None, lengths: Sequence[tuple[int, int]],
               spec: TokenSpec) -> tuple[int, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]:
    """(question, answer) ids for the given (q_len, a_len) turns; klass None = text-only (class from question)."""
    turns = []
    for q_len, a_len in lengths:
        question = random_ids(rng, q_len, spec)
        if klass is None:
            klass = text_only_class(question)
        turns.append((question, answer_ids(klass, question, a_len, spec)))
    return (0 if klass is None else klass), tuple(turns)


def pixel_rng(seed: int, index: int) -> np.random.Generator:
    """The pixel stream of sample `index`, separate from its structure stream so shapes never draw pixels."""
    return np.random.default_rng([seed, index, 1])


def structure_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index, 0])


def render_sample(spec: TokenSpec, sample_id: int, grids: Sequence[tuple[int, int, int]], klass: int,
                  turns: Sequence[tuple[Sequence[int], Sequence[int]]],
                  pixels: np.random.Generator | None) -> VLMSample:
    """Assemble the `VLMSample`: one image per grid (all of class `klass`), then the turns.

    `pixels` None means with_pixels=False: token ids, labels and grids only.
    """
    merge2 = spec.merge_size * spec.merge_size
    counts = [t * h * w // merge2 for t, h, w in grids]
    input_ids, labels = build_conversation(spec, counts, turns)
    pixel_values = None
    if pixels is not None and grids:
        if spec.image_format == "qwen2":
            pixel_values = torch.cat([qwen2_pixels(pixels, klass, g, spec) for g in grids], dim=0)
        else:
            pixel_values = torch.stack([llava_pixels(pixels, klass, spec) for _ in grids], dim=0)
    grid_tensor = torch.tensor([list(g) for g in grids], dtype=torch.int64) if grids else None
    return VLMSample(sample_id, input_ids, labels, pixel_values, grid_tensor, counts)
