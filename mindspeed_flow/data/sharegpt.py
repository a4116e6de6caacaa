"""Reader for LLaVA / ShareGPT-style JSON + image files (the format MindSpeed-MM and LLaMA-Factory use).

    [{"id": "000001", "image": "rel/a.jpg",            # or "images": ["rel/a.jpg", ...]
      "conversations": [{"from": "human", "value": "<image>\\nQuestion?"},
                        {"from": "gpt",   "value": "Answer."}, ...]}, ...]
    # or "messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]

A `.jsonl` file (one entry per line) is read too. Text is tokenized by the tokenizer given (str -> ids;
`ByteTokenizer` when none), `<image>` tags are removed and the images placed first, as the shared template
says; a system message is prepended to the first question. Images are read with PIL from `image_root`,
smart-resized and patchified (Qwen2-VL) or resized to image_size (LLaVA).

`shape(i)` reads only the image headers (PIL opens lazily) unless `verify_images` is set, in which case each
image is also decoded once (verdict cached), so a truncated file is caught at plan time on every rank alike.
Missing files, unreadable or truncated images and malformed entries raise `BadSample` from `shape(i)`.

Validate once, plan from a table: on a large dataset, decoding every image at plan time on every rank is
wasteful. Export the good shapes once (`export_length_table(ShareGPTDataset(..., verify_images=True), csv)`)
and pass `shape_table=csv`: `shape(i)` then reads no image at all, and a sample missing from the table is a
`BadSample` ("not in the shape table") on every rank alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from mindspeed_flow.data.base import VLMDataset
from mindspeed_flow.data.guard import BadSample, is_system_error
from mindspeed_flow.data.image import (llava_grid, process_pil_llava, process_pil_qwen2, qwen2_grid,
                                       stack_pixels)
from mindspeed_flow.data.records import load_entries
from mindspeed_flow.data.sample import TokenSpec, VLMSample
from mindspeed_flow.data.shapes import SampleShape, read_length_table
from mindspeed_flow.data.tokens import (ByteTokenizer, Tokenizer, build_conversation, check_ordinary_ids,
                                        template_text_tokens)

if TYPE_CHECKING:  # PIL is imported where an image is opened
    from PIL.Image import Image as PILImage

IMAGE_TAG = "<image>"
USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant")
SYSTEM_ROLES = ("system",)


@dataclass(frozen=True)
class _Entry:
    """A parsed, tokenized entry: image paths (as written) and (question ids, answer ids) turns."""

    images: tuple[str, ...]
    turns: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def _image_list(entry: dict, i: int) -> tuple[str, ...]:
    raw = entry.get("images", entry.get("image"))
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise BadSample(i, f"'image'/'images' must be a path or a list of paths, got {raw!r}")
    return tuple(items)


def _messages(entry: dict, i: int) -> list[tuple[str, str]]:
    """[(role, text)] with roles normalised to user / assistant / system."""
    raw = entry.get("conversations", entry.get("messages"))
    if not isinstance(raw, list) or not raw:
        raise BadSample(i, "entry has no 'conversations' / 'messages' list (or it is empty)")
    out = []
    for k, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise BadSample(i, f"message {k} is a {type(msg).__name__}, not an object")
        role = msg.get("from", msg.get("role"))
        text = msg.get("value", msg.get("content"))
        if not isinstance(text, str):
            raise BadSample(i, f"message {k}: 'value'/'content' must be a string, got {type(text).__name__}")
        if role in USER_ROLES:
            out.append(("user", text))
        elif role in ASSISTANT_ROLES:
            out.append(("assistant", text))
        elif role in SYSTEM_ROLES:
            out.append(("system", text))
        else:
            raise BadSample(i, f"message {k}: unknown role {role!r} (expected one of "
                               f"{USER_ROLES + ASSISTANT_ROLES + SYSTEM_ROLES})")
    return out


def _strip_tags(text: str) -> str:
    return text.replace(IMAGE_TAG + "\n", "").replace(IMAGE_TAG, "").strip()


def _text_turns(messages: list[tuple[str, str]], i: int) -> list[tuple[str, str]]:
    """Pair user/assistant messages into (question, answer); system text goes before the first question."""
    system = [t for r, t in messages if r == "system"]
    dialog = [(r, t) for r, t in messages if r != "system"]
    if len(dialog) < 2 or len(dialog) % 2:
        raise BadSample(i, f"{len(dialog)} user/assistant messages; a conversation is user, assistant pairs")
    turns = []
    for k in range(0, len(dialog), 2):
        (r_q, q), (r_a, a) = dialog[k], dialog[k + 1]
        if r_q != "user" or r_a != "assistant":
            raise BadSample(i, f"messages {k}-{k + 1} are ({r_q}, {r_a}); expected (user, assistant)")
        turns.append((_strip_tags(q), _strip_tags(a)))
    if system:
        sys_text = "\n".join(s.strip() for s in system)
        turns[0] = ((sys_text + "\n" + turns[0][0]).strip(), turns[0][1])
    return turns


class ShareGPTDataset(VLMDataset):
    """LLaVA/ShareGPT JSON + images; see the module docstring."""

    def __init__(self, path: str, token_spec: TokenSpec, *, image_root: Optional[str] = None,
                 tokenizer: Optional[Tokenizer] = None, min_pixels: int = 4 * 28 * 28,
                 max_pixels: int = 1280 * 28 * 28, verify_images: bool = True,
                 shape_table: Optional[str] = None) -> None:
        super().__init__(token_spec)
        self.path = os.fspath(path)
        self.image_root = os.fspath(image_root) if image_root else os.path.dirname(os.path.abspath(self.path))
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer(token_spec.first_special_id)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.verify_images = verify_images
        self._raw = load_entries(self.path)
        self._entries: dict[int, _Entry] = {}
        self._shapes: dict[int, SampleShape] = {}
        self._bad: dict[int, str] = {}
        self.shape_table = shape_table
        self._table = self._read_shape_table(shape_table) if shape_table else None

    def _read_shape_table(self, path: str) -> dict[int, SampleShape]:
        rows = {s.sample_id: s for s in read_length_table(path, merge_size=self.merge_size)}
        outside = sorted(i for i in rows if not 0 <= i < len(self._raw))
        if outside:
            raise ValueError(f"data.shape_table={path!r} lists sample ids {outside[:5]} outside this dataset's "
                             f"[0, {len(self._raw)}) entries of {self.path}: the table belongs to another file")
        return rows

    def __len__(self) -> int:
        return len(self._raw)

    def record_id(self, i: int) -> Any:
        """The entry's own "id" (for messages and reports); the index when a valid entry has none; for a malformed
        .jsonl line the id it still shows, or None (its line number, in the cause, names it)."""
        raw = self._raw[self._check_index(i)]
        if isinstance(raw, BadSample):
            return getattr(raw, "record_id", None)
        return raw.get("id", i) if isinstance(raw, dict) else i

    def image_path(self, rel: str) -> str:
        return rel if os.path.isabs(rel) else os.path.join(self.image_root, rel)

    # ---- parsing ---------------------------------------------------------------------------------------------
    def _tokenize(self, text: str, i: int, what: str) -> tuple[int, ...]:
        out = self.tokenizer(text)
        if isinstance(out, Mapping):  # a transformers tokenizer called directly: take its input_ids
            out = out["input_ids"]
        ids = tuple(int(t) for t in out)
        try:
            check_ordinary_ids(ids, self.token_spec, what=what)
        except ValueError as exc:
            raise BadSample(i, str(exc)) from None
        return ids

    def _entry(self, i: int) -> _Entry:
        cached = self._entries.get(i)
        if cached is not None:
            return cached
        raw = self._raw[i]
        if isinstance(raw, BadSample):
            raise BadSample(i, raw.cause)
        if not isinstance(raw, dict):
            raise BadSample(i, f"entry is a {type(raw).__name__}, not an object")
        if raw.get("video") or raw.get("videos"):
            raise BadSample(i, "entry has videos; only images are supported")
        images = _image_list(raw, i)
        messages = _messages(raw, i)
        n_tags = sum(t.count(IMAGE_TAG) for _, t in messages)
        if n_tags and n_tags != len(images):
            raise BadSample(i, f"{n_tags} {IMAGE_TAG} tag(s) in the text but {len(images)} image(s) listed")
        turns = tuple((self._tokenize(q, i, f"turn {k} question"), self._tokenize(a, i, f"turn {k} answer"))
                      for k, (q, a) in enumerate(_text_turns(messages, i)))
        entry = _Entry(images, turns)
        self._entries[i] = entry
        return entry

    # ---- images ----------------------------------------------------------------------------------------------
    def _open(self, i: int, rel: str, *, decode: bool) -> "PILImage":
        """Open image `rel` of sample i (header only unless `decode`); any failure is that sample's BadSample."""
        from PIL import Image  # optional: PIL

        full = self.image_path(rel)
        if not os.path.exists(full):
            raise BadSample(i, f"image {rel!r} not found (looked for {full})")
        img = None
        try:
            img = Image.open(full)
            if decode:
                img.load()  # a truncated JPEG fails only here, not in open()
            return img
        except Exception as exc:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, DecompressionBomb...
            if img is not None:
                img.close()
            if is_system_error(exc) and not isinstance(exc, SyntaxError):  # PIL uses SyntaxError for bad headers
                raise
            raise BadSample(i, f"image {rel!r} cannot be read: {type(exc).__name__}: {exc}") from None

    def _grid(self, i: int, rel: str) -> tuple[int, int, int]:
        with self._open(i, rel, decode=self.verify_images) as img:
            width, height = img.size
        if self.token_spec.image_format == "llava":
            return llava_grid(self.token_spec)
        try:
            return qwen2_grid(height, width, self.token_spec, self.min_pixels, self.max_pixels)
        except ValueError as exc:
            raise BadSample(i, f"image {rel!r}: {exc}") from None

    # ---- dataset API -----------------------------------------------------------------------------------------
    def shape(self, i: int) -> SampleShape:
        i = self._check_index(i)
        if i in self._bad:
            raise BadSample(i, self._bad[i])
        cached = self._shapes.get(i)
        if cached is not None:
            return cached
        try:
            entry = self._entry(i)
            grids = self._table_grids(i, entry) if self._table is not None else tuple(
                self._grid(i, rel) for rel in entry.images)
        except BadSample as exc:
            self._bad[i] = exc.cause  # the verdict is final: re-reading must not flip it on some rank
            raise
        lengths = [(len(q), len(a)) for q, a in entry.turns]
        shape = SampleShape(i, template_text_tokens(len(grids), lengths), grids, self.merge_size)
        self._shapes[i] = shape
        return shape

    def _table_grids(self, i: int, entry: _Entry) -> tuple[tuple[int, int, int], ...]:
        """Grids from the shape table, checked against the entry (a stale table is caught, not trusted)."""
        assert self._table is not None
        row = self._table.get(i)
        if row is None:
            raise BadSample(i, f"not in the shape table {self.shape_table} (it was bad when the table was written)")
        text = template_text_tokens(len(entry.images), [(len(q), len(a)) for q, a in entry.turns])
        if row.num_images != len(entry.images) or row.text_tokens != text:
            raise BadSample(i, f"the shape table {self.shape_table} says {row.num_images} image(s) and "
                               f"{row.text_tokens} text tokens, the entry has {len(entry.images)} and {text} (a "
                               "stale table, or another tokenizer)")
        return row.image_grid_thw

    def sample(self, i: int, with_pixels: bool = True) -> VLMSample:
        shape = self.shape(i)
        entry = self._entry(shape.sample_id)
        counts = list(shape.image_tokens_per_image)
        input_ids, labels = build_conversation(self.token_spec, counts, entry.turns)
        pixel_values = None
        if with_pixels and entry.images:
            pixel_values = stack_pixels(self.token_spec, [self._pixels(shape.sample_id, rel, grid)
                                                          for rel, grid in zip(entry.images, shape.image_grid_thw)])
        grid_tensor = torch.tensor([list(g) for g in shape.image_grid_thw], dtype=torch.int64) if counts else None
        return VLMSample(shape.sample_id, input_ids, labels, pixel_values, grid_tensor, counts)

    def _pixels(self, i: int, rel: str, grid: tuple[int, int, int]) -> torch.Tensor:
        try:
            with self._open(i, rel, decode=True) as img:
                if self.token_spec.image_format == "llava":
                    pixels, got = process_pil_llava(img, self.token_spec)
                else:
                    pixels, got = process_pil_qwen2(img, self.token_spec, self.min_pixels, self.max_pixels)
        except BadSample as exc:
            # The shape was already planned on every rank; skipping now would desynchronise them, so this is
            # an error for the caller (the file changed or vanished after planning).
            raise BadSample(i, f"{exc.cause} (after its shape was planned)") from None
        if tuple(got) != tuple(grid):
            raise BadSample(i, f"image {rel!r} decoded to grid {got} but was planned as {grid} (file changed?)")
        return pixels
