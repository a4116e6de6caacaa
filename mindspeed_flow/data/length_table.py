"""Length tables: export any dataset's per-sample shapes, and replay a table with synthetic content.

`export_length_table(ds, path)` writes `sample_id,text_tokens,image_grid_thw` (mindspeed_flow.data.shapes) for
every good sample. `LengthTableDataset(path, spec)` turns each row back into a `VLMSample` of exactly that shape
(same text tokens, same image grids), with the learnable synthetic content of `mindspeed_flow.data.content`, so
the shape of a real dataset (or one measured elsewhere) can be trained on without its files.

A row the shared template cannot express (text_tokens < 2 per image for the vision delimiters; a grid the model
family cannot take: Qwen2-VL needs h, w multiples of the merge size, LLaVA exactly (1, S/p, S/p)) raises
`BadSample` from `shape(i)`, so it is skipped and counted like any bad sample.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mindspeed_flow.data.base import VLMDataset
from mindspeed_flow.data.content import NUM_CLASSES, make_turns, pixel_rng, render_sample, structure_rng
from mindspeed_flow.data.guard import BadSample, SampleGuard
from mindspeed_flow.data.image import llava_grid
from mindspeed_flow.data.sample import TokenSpec, VLMSample
from mindspeed_flow.data.shapes import SampleShape, format_grid, read_length_table, write_length_table


def export_length_table(dataset: VLMDataset, path: str | os.PathLike,
                        guard: SampleGuard | None = None) -> dict[int, str]:
    """Write the shapes of every good sample of `dataset` to `path`; return the skipped {sample id: cause}.

    With a `guard`, bad samples are counted there (and its threshold applies); without one, all are skipped.
    """
    guard = guard if guard is not None else SampleGuard(max_bad=len(dataset))
    shapes = [s for s in (guard.shape(dataset, i) for i in range(len(dataset))) if s is not None]
    write_length_table(path, shapes)
    return dict(guard.bad)


def split_text_tokens(rng: np.random.Generator, remaining: int, question_tokens: tuple[int, int],
                      answer_tokens: tuple[int, int]) -> list[tuple[int, int]]:
    """Split `remaining` text tokens into (question, answer) turns of the template (each turn q + a + 1)."""
    turns: list[tuple[int, int]] = []
    while remaining > 0:
        q = int(rng.integers(question_tokens[0], question_tokens[1] + 1))
        a = int(rng.integers(answer_tokens[0], answer_tokens[1] + 1))
        if q + a + 1 > remaining - 2:  # last turn: take the rest (never leave a remainder too short for a turn)
            a = min(a, remaining - 1)
            turns.append((remaining - 1 - a, a))
            break
        turns.append((q, a))
        remaining -= q + a + 1
    return turns


@dataclass(frozen=True)
class _Replay:
    klass: int
    turns: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


class LengthTableDataset(VLMDataset):
    """Rows of a length table as samples: sample i is row i (its table id is `source_id(i)`)."""

    def __init__(self, path: str | os.PathLike, token_spec: TokenSpec, *, seed: int = 0,
                 question_tokens: tuple[int, int] = (10, 20), answer_tokens: tuple[int, int] = (1, 5)) -> None:
        super().__init__(token_spec)
        if seed < 0:
            raise ValueError(f"data.seed must be >= 0 (it seeds numpy's SeedSequence), got {seed}")
        self.path = os.fspath(path)
        self.seed = seed
        self.question_tokens, self.answer_tokens = tuple(question_tokens), tuple(answer_tokens)
        self._rows = read_length_table(self.path, merge_size=token_spec.merge_size)

    def __len__(self) -> int:
        return len(self._rows)

    def source_id(self, i: int) -> int:
        """The sample_id the table gave row i."""
        return self._rows[self._check_index(i)].sample_id

    def _check_row(self, i: int, row: SampleShape) -> None:
        where = f"{self.path}: row {i + 2} (table sample_id {row.sample_id})"
        if row.text_tokens < 2 * row.num_images:
            raise BadSample(i, f"{where}: text_tokens {row.text_tokens} < 2 per image; the template needs a "
                               "vision start and end token around each image")
        spec = self.token_spec
        for grid in row.image_grid_thw:
            if spec.image_format == "llava" and tuple(grid) != llava_grid(spec):
                raise BadSample(i, f"{where}: grid {format_grid([grid])} cannot be a LLaVA image; it must be "
                                   f"{format_grid([llava_grid(spec)])} (image_size {spec.image_size}, patch "
                                   f"{spec.patch_size})")
            if spec.image_format == "qwen2" and (grid[1] % spec.merge_size or grid[2] % spec.merge_size):
                raise BadSample(i, f"{where}: grid {format_grid([grid])} has h or w not a multiple of "
                                   f"merge_size {spec.merge_size}")

    def shape(self, i: int) -> SampleShape:
        i = self._check_index(i)
        row = self._rows[i]
        self._check_row(i, row)
        return SampleShape(i, row.text_tokens, row.image_grid_thw, self.merge_size)

    def _replay(self, shape: SampleShape) -> _Replay:
        rng = structure_rng(self.seed, shape.sample_id)
        klass = int(rng.integers(NUM_CLASSES)) if shape.num_images else None
        lengths = split_text_tokens(rng, shape.text_tokens - 2 * shape.num_images, self.question_tokens,
                                    self.answer_tokens)
        klass_out, turns = make_turns(rng, klass, lengths, self.token_spec)
        return _Replay(klass_out, turns)

    def sample(self, i: int, with_pixels: bool = True) -> VLMSample:
        shape = self.shape(i)
        replay = self._replay(shape)
        rng = pixel_rng(self.seed, shape.sample_id) if with_pixels else None
        return render_sample(self.token_spec, shape.sample_id, shape.image_grid_thw, replay.klass, replay.turns, rng)
