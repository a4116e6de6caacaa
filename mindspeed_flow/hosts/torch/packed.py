"""Packed microbatches: several samples concatenated into one sequence of a fixed token budget.

A `PackedBatch` is model-ready metadata for one backbone microbatch (batch dimension 1, length exactly the
token budget, so pipeline shapes never change). Samples never see each other:

- `segment_ids` numbers the samples 0..n-1 in order and gives the padding tail its own segment n;
- attention is causal within each segment (`segments`: the boundaries a varlen kernel takes, never a T x T
  mask), so the padding tail only attends to itself: every row attends to at least one key;
- position ids restart at 0 for every sample (and for the padding tail);
- `labels` are already shifted per sample (label at t is the token predicted from position t), so the last
  token of one sample never predicts the first token of the next; padding carries IGNORE_INDEX.

The functions here are model-independent; `BackbonePart.pack` supplies the per-sample position ids (3-D mrope
for Qwen, computed by the model's own rope index) and the pad token.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mindspeed_flow.data.sample import IGNORE_INDEX
from mindspeed_flow.hosts.torch.attention import Segments


@dataclass
class PackedBatch:
    """One packed microbatch of exactly `token_budget` tokens (batch dimension 1)."""

    input_ids: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T], shifted per sample, IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # int64 [3, 1, T] (mrope) or [1, T]
    segment_ids: torch.Tensor  # int64 [1, T]: sample k -> k, padding tail -> n_samples
    cu_seqlens: torch.Tensor  # int32 [n_segments + 1], padding tail included when present
    seq_lens: list[int]  # real tokens per sample, in order
    sample_ids: list[int]
    image_token_counts: list[int]  # image placeholder tokens per sample
    n_label_tokens: int
    token_budget: int

    @property
    def n_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def real_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def pad_tokens(self) -> int:
        return self.token_budget - self.real_tokens

    def to(self, device: torch.device | str) -> "PackedBatch":
        """The same batch with its tensors on `device` (self when they are there already)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        moved = {name: getattr(self, name).to(device)
                 for name in ("input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens")}
        return dataclasses.replace(self, **moved)

    @property
    def segments(self) -> Segments:
        """The sequence boundaries the varlen attention kernel takes (host integers, no device sync)."""
        return Segments.from_lengths(_segment_lens(self.seq_lens, self.token_budget))


def _segment_lens(seq_lens: Sequence[int], token_budget: int) -> list[int]:
    """Sample lengths plus the padding tail as one more segment (when there is any padding)."""
    return list(seq_lens) + ([token_budget - sum(seq_lens)] if sum(seq_lens) < token_budget else [])


def segment_ids_for(seq_lens: Sequence[int], token_budget: int) -> torch.Tensor:
    """[1, T] segment index per token; the padding tail (if any) is one more segment."""
    lens = _segment_lens(seq_lens, token_budget)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))
    return seg.view(1, -1)


def cu_seqlens_for(seq_lens: Sequence[int], token_budget: int) -> torch.Tensor:
    lens = _segment_lens(seq_lens, token_budget)
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)


def restart_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """[1, T] positions 0, 1, ... restarting at every segment boundary (vectorized, no per-token loop)."""
    seg = segment_ids.reshape(-1)
    t = torch.arange(seg.numel(), device=seg.device)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[1:] = seg[1:] != seg[:-1]
    start_index = torch.cummax(torch.where(starts, t, torch.zeros_like(t)), dim=0).values
    return (t - start_index).view(1, -1)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Per-sample next-token targets: labels[1:] then IGNORE_INDEX (the same shift HF's causal-LM loss does)."""
    return torch.cat([labels[1:], torch.full((1,), IGNORE_INDEX, dtype=labels.dtype)])


def pad_tail(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
    """Append n copies of `value` along the last dimension."""
    if n == 0:
        return t
    return torch.cat([t, torch.full((*t.shape[:-1], n), value, dtype=t.dtype, device=t.device)], dim=-1)


def check_pack_fits(sample_ids: Sequence[int], seq_lens: Sequence[int], token_budget: int) -> None:
    """One packed microbatch within the token budget (the packer's contract; the recipe's budget rule is
    `packing.check_budget`)."""
    if token_budget <= 0:
        raise ValueError(f"packing.token_budget={token_budget} must be positive")
    total = sum(seq_lens)
    if total > token_budget:
        detail = ", ".join(f"{sid}:{n}" for sid, n in zip(sample_ids, seq_lens))
        raise ValueError(f"packed microbatch needs {total} tokens but packing.token_budget={token_budget} "
                         f"(sample_id:tokens = {detail}); the packer must not put these samples together")


def stack_position_ids(packs: Sequence[PackedBatch]) -> torch.Tensor:
    """[n_micro, 3, T] (mrope) or [n_micro, T]: microbatch first, so pipeline schedules can chunk dim 0."""
    pos = [p.position_ids for p in packs]
    if pos[0].dim() == 3:
        return torch.cat([q.permute(1, 0, 2) for q in pos], dim=0)
    return torch.cat(pos, dim=0)


def unstack_position_ids(chunk: torch.Tensor, mrope: bool) -> Optional[torch.Tensor]:
    """Inverse of `stack_position_ids` for one microbatch chunk: [1, 3, T] -> [3, 1, T]; [1, T] unchanged."""
    return chunk.permute(1, 0, 2) if mrope else chunk
