"""Per-sample shape metadata and the length table (CSV) that replays any dataset's shape.

A `SampleShape` is everything the planner, the packing scheduler and the step plan need to know about a sample
*before* it is loaded: its text tokens, each image's ViT patch grid (Qwen2-VL's `image_grid_thw`) and each audio
clip's mel frames (100 per second, as Whisper's feature extractor gives them). Every rank can compute the whole step
plan from these shapes alone, so no rank has to ask another what to do.

Length table format (CSV, header required, extra columns ignored):

    sample_id,text_tokens,image_grid_thw
    0,37,1x36x52;1x20x20
    1,120,

`image_grid_thw` lists each image as `t x h x w` (ViT patches), joined by `;`; empty for a text-only sample.
The image's LLM tokens are t*h*w / merge**2 (merge 2 by default, as in Qwen2-VL).

An optional `audio_frames` column lists each audio clip's mel frames, joined by `;` (`3000;1200`; empty: no clip);
it is written only when some sample has clips. A clip of L frames gives Qwen2.5-Omni's audio encoder
(L - 1) // 2 + 1 frames after its two convolutions (the second has stride 2) and the LLM
((L - 1) // 2 + 1 - 2) // 2 + 1 tokens after its stride-2 average pool (`audio_conv_frames`, `audio_llm_tokens`).
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

LENGTH_TABLE_COLUMNS = ("sample_id", "text_tokens", "image_grid_thw")
AUDIO_COLUMN = "audio_frames"  # optional: each clip's mel frames


def audio_conv_frames(mel_frames: int) -> int:
    """Frames the audio encoder's layers see for a clip of `mel_frames` mel frames: conv1 (stride 1) keeps the
    length, conv2 (kernel 3, stride 2, padding 1) halves it, rounding up."""
    return (int(mel_frames) - 1) // 2 + 1


def audio_llm_tokens(mel_frames: int) -> int:
    """LLM tokens of a clip of `mel_frames` mel frames: the conv frames after the stride-2 average pool."""
    return (audio_conv_frames(mel_frames) - 2) // 2 + 1


class LengthTableError(ValueError):
    """A length table that cannot be read; the message names the file, row and field."""


@dataclass(frozen=True)
class SampleShape:
    """Shape of one sample: text tokens, the ViT patch grid (t, h, w) of each image and the mel frames of each
    audio clip (the audio tokens are not counted in `text_tokens`)."""

    sample_id: int
    text_tokens: int
    image_grid_thw: tuple[tuple[int, int, int], ...] = field(default_factory=tuple)
    merge_size: int = 2
    audio_frames: tuple[int, ...] = ()

    @property
    def image_tokens_per_image(self) -> tuple[int, ...]:
        m2 = self.merge_size * self.merge_size
        return tuple(t * h * w // m2 for t, h, w in self.image_grid_thw)

    @property
    def image_tokens(self) -> int:
        return sum(self.image_tokens_per_image)

    @property
    def audio_tokens_per_clip(self) -> tuple[int, ...]:
        return tuple(audio_llm_tokens(f) for f in self.audio_frames)

    @property
    def audio_tokens(self) -> int:
        return sum(self.audio_tokens_per_clip)

    @property
    def llm_tokens(self) -> int:
        """Tokens the LLM backbone sees for this sample: text plus merged image tokens plus audio tokens."""
        return self.text_tokens + self.image_tokens + self.audio_tokens

    @property
    def vit_patches_per_image(self) -> tuple[int, ...]:
        return tuple(t * h * w for t, h, w in self.image_grid_thw)

    @property
    def vit_patches(self) -> int:
        return sum(self.vit_patches_per_image)

    @property
    def num_images(self) -> int:
        return len(self.image_grid_thw)


def format_grid(grid: Iterable[Sequence[int]]) -> str:
    return ";".join(f"{t}x{h}x{w}" for t, h, w in grid)


def parse_grid(text: str, *, where: str = "image_grid_thw") -> tuple[tuple[int, int, int], ...]:
    text = (text or "").strip()
    if not text:
        return ()
    out = []
    for item in text.split(";"):
        parts = item.strip().lower().split("x")
        if len(parts) != 3:
            raise LengthTableError(f"{where}: '{item}' is not of the form TxHxW (for example 1x36x52)")
        try:
            t, h, w = (int(p) for p in parts)
        except ValueError:
            raise LengthTableError(f"{where}: '{item}' has a part that is not an integer") from None
        if t <= 0 or h <= 0 or w <= 0:
            raise LengthTableError(f"{where}: '{item}' must have t, h, w > 0")
        out.append((t, h, w))
    return tuple(out)


def format_frames(frames: Iterable[int]) -> str:
    return ";".join(str(int(f)) for f in frames)


def parse_frames(text: str, *, where: str = AUDIO_COLUMN) -> tuple[int, ...]:
    text = (text or "").strip()
    if not text:
        return ()
    out = []
    for item in text.split(";"):
        try:
            frames = int(item.strip())
        except ValueError:
            raise LengthTableError(f"{where}: '{item}' is not an integer number of mel frames (for example "
                                   "3000;1200)") from None
        if frames <= 0:
            raise LengthTableError(f"{where}: '{item}' must be > 0 mel frames")
        out.append(frames)
    return tuple(out)


def read_length_table(path: str | os.PathLike, *, merge_size: int = 2) -> list[SampleShape]:
    """Read a length table; any malformed row raises `LengthTableError` naming the row and the field."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise LengthTableError(f"length table {path!r} does not exist")
    shapes: list[SampleShape] = []
    seen: set[int] = set()
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in LENGTH_TABLE_COLUMNS if c not in header]
        if missing:
            raise LengthTableError(
                f"{path}: missing column(s) {missing}; the header must contain {','.join(LENGTH_TABLE_COLUMNS)}"
                f" (found {header})"
            )
        for row_no, row in enumerate(reader, start=2):  # row 1 is the header
            where = f"{path}: row {row_no}"
            try:
                sid = int(row["sample_id"])
            except (TypeError, ValueError):
                raise LengthTableError(f"{where}: sample_id {row['sample_id']!r} is not an integer") from None
            if sid in seen:
                raise LengthTableError(f"{where}: sample_id {sid} appears twice")
            seen.add(sid)
            try:
                text = int(row["text_tokens"])
            except (TypeError, ValueError):
                raise LengthTableError(f"{where}: text_tokens {row['text_tokens']!r} is not an integer") from None
            if text < 0:
                raise LengthTableError(f"{where}: text_tokens must be >= 0, got {text}")
            grid = parse_grid(row["image_grid_thw"] or "", where=f"{where}: image_grid_thw")
            clips = parse_frames(row.get(AUDIO_COLUMN) or "", where=f"{where}: {AUDIO_COLUMN}")
            shape = SampleShape(sid, text, grid, merge_size, clips)
            if shape.llm_tokens <= 0:
                raise LengthTableError(f"{where}: sample {sid} has no tokens at all (text_tokens 0, no image, no "
                                       "audio)")
            shapes.append(shape)
    if not shapes:
        raise LengthTableError(f"{path}: the table has a header but no rows")
    return shapes


def write_length_table(path: str | os.PathLike, shapes: Iterable[SampleShape]) -> None:
    """Write `shapes` as a length table; the audio_frames column only when some sample has clips."""
    shapes = list(shapes)
    audio = any(s.audio_frames for s in shapes)
    with open(os.fspath(path), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(LENGTH_TABLE_COLUMNS + ((AUDIO_COLUMN,) if audio else ()))
        for s in shapes:
            row = [s.sample_id, s.text_tokens, format_grid(s.image_grid_thw)]
            w.writerow(row + ([format_frames(s.audio_frames)] if audio else []))
