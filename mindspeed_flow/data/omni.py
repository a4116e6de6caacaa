"""`SyntheticOmni`: seeded audio + image conversations for the Qwen2.5-Omni thinker (data.source=synthetic_omni).

Each sample holds an audio clip, an image, or both (a third each), then QA turns as in `SyntheticInfoVQA`. Audio
is a real log-mel spectrogram: a tone whose pitch encodes the sample's class plus noise, run through transformers'
Whisper feature extractor (the one Qwen2.5-Omni's processor uses; 100 frames per second, `num_mel_bins` bins), so
the features have the model's shape and the answers are learnable from the audio alone. A clip of F frames takes
the audio tower's own output length in LLM tokens (`audio_output_lengths`).

Template, per sample:  <audio_start> <audio_pad> * n_audio <audio_end>  (if audio), then the image block and the
turns of `data.tokens.build_conversation`. `shape(i)` carries each clip's mel frames (its placeholders are the
shape's audio tokens, the tower's length rule; the start/end markers are text), so packing sees the right LLM
length and a length table written from the data set keeps the clips the planner prices, without drawing a sample.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from mindspeed_flow.data.base import VLMDataset
from mindspeed_flow.data.content import NUM_CLASSES, make_turns, pixel_rng, qwen2_pixels, structure_rng
from mindspeed_flow.data.image import qwen2_grid
from mindspeed_flow.data.sample import IGNORE_INDEX, TokenSpec, VLMSample
from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.data.synthetic import SyntheticParams, draw_image_size
from mindspeed_flow.data.tokens import build_conversation, template_text_tokens

SAMPLE_RATE = 16_000
HOP = 160  # Whisper features: one frame per 10 ms


def audio_output_lengths(frames: Sequence[int]) -> list[int]:
    """LLM tokens of audio clips of `frames` mel frames each, by the HF audio tower's own length rule."""
    # transformers is imported here, not at the top: reading the data set needs it only for audio
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder  # optional: transformers

    if not frames:
        return []
    # the rule reads no module state, so it is called unbound (no model is built for a length)
    _, out = Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(list(frames)))
    return [int(x) for x in out]


@dataclass(frozen=True)
class AudioSpec:
    """The audio token ids and mel bins of the model (from its HF config)."""

    audio_token_id: int
    audio_start_id: int
    audio_end_id: int
    num_mel_bins: int
    video_token_id: int

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any]) -> "AudioSpec":
        missing = [k for k in ("audio_token_id", "audio_start_token_id", "audio_end_token_id", "audio_config")
                   if k not in cfg]
        if missing:
            raise ValueError(f"data.source=synthetic_omni needs a Qwen2.5-Omni thinker config; it lacks {missing}")
        return AudioSpec(int(cfg["audio_token_id"]), int(cfg["audio_start_token_id"]),
                         int(cfg["audio_end_token_id"]), int(cfg["audio_config"]["num_mel_bins"]),
                         int(cfg.get("video_token_id", cfg["audio_token_id"])))

    @property
    def first_id(self) -> int:
        return min(self.audio_token_id, self.audio_start_id, self.audio_end_id, self.video_token_id)


@dataclass
class OmniSample(VLMSample):
    """A `VLMSample` with audio: one [num_mel_bins, frames] tensor per clip (None without pixels/audio loaded)."""

    audio_features: Optional[list[torch.Tensor]] = None
    audio_frames: list[int] = field(default_factory=list)  # mel frames per clip
    audio_token_counts: list[int] = field(default_factory=list)  # LLM tokens per clip

    @property
    def text_tokens(self) -> int:
        """Tokens that are neither image nor audio placeholders (the clips' start/end markers are text)."""
        return super().text_tokens - sum(self.audio_token_counts)

    def shape(self, merge_size: int = 2) -> SampleShape:
        return dataclasses.replace(super().shape(merge_size), audio_frames=tuple(int(f) for f in self.audio_frames))


@dataclass(frozen=True)
class _Plan:
    hw: Optional[tuple[int, int]]
    frames: tuple[int, ...]
    klass: int
    turns: tuple


class SyntheticOmni(VLMDataset):
    """See the module docstring. `audio_frames` = (lo, hi) mel frames per clip."""

    def __init__(self, params: SyntheticParams, token_spec: TokenSpec, audio: AudioSpec,
                 audio_frames: tuple[int, int]) -> None:
        super().__init__(token_spec)
        lo, hi = audio_frames
        if not 4 <= lo <= hi:
            raise ValueError(f"data.audio_frames={[lo, hi]} must be [lo, hi] with 4 <= lo <= hi (mel frames)")
        self.params, self.audio, self.audio_frames = params, audio, (lo, hi)
        self._shapes: dict[int, SampleShape] = {}
        self._extractor: Any = None

    def __len__(self) -> int:
        return self.params.num_samples

    def _plan(self, i: int) -> _Plan:
        p = self.params
        rng = structure_rng(p.seed, i)
        kind = int(rng.integers(3))  # 0 audio only, 1 image only, 2 both
        hw = draw_image_size(rng) if kind >= 1 else None
        frames = (int(rng.integers(self.audio_frames[0], self.audio_frames[1] + 1)),) if kind != 1 else ()
        klass = int(rng.integers(NUM_CLASSES))
        n_turns = max(1, int(rng.poisson(p.qa_turns_mean)))
        lengths = [(int(rng.integers(p.question_tokens[0], p.question_tokens[1] + 1)),
                    int(rng.integers(p.answer_tokens[0], p.answer_tokens[1] + 1))) for _ in range(n_turns)]
        klass, turns = make_turns(rng, klass, lengths, self.token_spec)
        # Question ids are drawn below the image ids; fold them below the audio/video ids too, so no question
        # token is ever taken for an audio placeholder.
        limit = self.audio.first_id
        turns = tuple((tuple(t % limit for t in q), a) for q, a in turns)
        return _Plan(hw, frames, klass, turns)

    def _grids(self, plan: _Plan) -> tuple[tuple[int, int, int], ...]:
        if plan.hw is None:
            return ()
        return (qwen2_grid(plan.hw[0], plan.hw[1], self.token_spec, self.params.min_pixels, self.params.max_pixels),)

    def shape(self, i: int) -> SampleShape:
        i = self._check_index(i)
        if i not in self._shapes:
            plan = self._plan(i)
            grids = self._grids(plan)
            # each clip's start and end markers are text; its placeholders are the shape's audio tokens
            text = template_text_tokens(len(grids), [(len(q), len(a)) for q, a in plan.turns]) + 2 * len(plan.frames)
            self._shapes[i] = SampleShape(i, text, grids, self.merge_size, audio_frames=plan.frames)
        return self._shapes[i]

    def audio_cost(self, i: int) -> float:
        """Mel frames of sample i's clips (the audio encoder's work; 0 without audio)."""
        return float(sum(self._plan(self._check_index(i)).frames))

    def sample(self, i: int, with_pixels: bool = True) -> OmniSample:
        i = self._check_index(i)
        plan = self._plan(i)
        grids = self._grids(plan)
        merge2 = self.token_spec.merge_size ** 2
        image_counts = [t * h * w // merge2 for t, h, w in grids]
        audio_counts = audio_output_lengths(plan.frames)
        ids, labels = build_conversation(self.token_spec, image_counts, plan.turns)
        a = self.audio
        block = [t for n in audio_counts for t in [a.audio_start_id] + [a.audio_token_id] * n + [a.audio_end_id]]
        ids = torch.cat([torch.tensor(block, dtype=torch.int64), ids])
        labels = torch.cat([torch.full((len(block),), IGNORE_INDEX, dtype=torch.int64), labels])
        pixels = features = None
        if with_pixels:
            rng = pixel_rng(self.params.seed, i)
            if grids:
                pixels = torch.cat([qwen2_pixels(rng, plan.klass, g, self.token_spec) for g in grids], dim=0)
            features = [self._mel(rng, plan.klass, f) for f in plan.frames]
        grid = torch.tensor([list(g) for g in grids], dtype=torch.int64) if grids else None
        return OmniSample(i, ids, labels, pixels, grid, image_counts, audio_features=features,
                          audio_frames=list(plan.frames), audio_token_counts=audio_counts)

    def _mel(self, rng: np.random.Generator, klass: int, frames: int) -> torch.Tensor:
        """[num_mel_bins, frames] log-mel features of a class-pitched tone with noise."""
        if self._extractor is None:
            from transformers import WhisperFeatureExtractor  # optional: transformers

            self._extractor = WhisperFeatureExtractor(feature_size=self.audio.num_mel_bins, sampling_rate=SAMPLE_RATE,
                                                      hop_length=HOP)
        t = np.arange(frames * HOP) / SAMPLE_RATE
        pitch = 220.0 * math.pow(2.0, klass / 2.0)  # half an octave per class
        wave = 0.5 * np.sin(2 * np.pi * pitch * t) + 0.05 * rng.standard_normal(t.size)
        out = self._extractor(wave.astype(np.float32), sampling_rate=SAMPLE_RATE, return_tensors="np",
                              padding=False)["input_features"][0]
        assert out.shape == (self.audio.num_mel_bins, frames), out.shape  # a mismatch would shift every token
        return torch.from_numpy(np.ascontiguousarray(out))
