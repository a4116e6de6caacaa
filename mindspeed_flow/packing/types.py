"""The step plan every rank computes from sample shapes: microbatches per DP rank and slot, and encode orders.

`StepPlan` is the one result type of every scheduler (mindspeed-flow's and the baselines), so the runtime and
the benchmark treat all methods alike. Costs are the cost model's backbone cost of the *real* samples (padding
excluded); `padded_tokens` is what the backbone computes over, padding included, from which the padding
fraction follows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing.cost import CostModel


@dataclass
class Microbatch:
    sample_ids: list[int]  # in packing order inside the microbatch
    tokens: int  # real LLM tokens (sum of the shapes' llm_tokens)
    cost: float  # backbone cost by the cost model (real samples only)
    padded_tokens: int = 0  # tokens the backbone computes over, padding included

    @property
    def empty(self) -> bool:
        return not self.sample_ids


@dataclass
class StepPlan:
    microbatches: list[list[Microbatch]]  # [dp_rank][slot]; equal length for every dp rank
    encoder_order: list[list[int]]  # [encoder_rank] -> sample ids (with images) in the order to encode them
    token_budget: int
    oversize: list[tuple[int, int]] = field(default_factory=list)  # (sample_id, llm_tokens) left out by "skip"
    seq_len: int = 0  # padded length of a packed microbatch in this step (<= token_budget); 0 for padded batches
    scheduler: str = "flow"
    encoder_costs: list[float] = field(default_factory=list)  # per encoder rank

    @property
    def dp(self) -> int:
        return len(self.microbatches)

    @property
    def num_slots(self) -> int:
        return len(self.microbatches[0]) if self.microbatches else 0

    @property
    def rank_costs(self) -> list[float]:
        return [float(sum(mb.cost for mb in rank)) for rank in self.microbatches]

    @property
    def real_tokens(self) -> int:
        return sum(mb.tokens for rank in self.microbatches for mb in rank)

    @property
    def padded_tokens(self) -> int:
        return sum(mb.padded_tokens for rank in self.microbatches for mb in rank)

    @property
    def padding_fraction(self) -> float:
        """Share of the tokens the backbone computes over that are padding."""
        padded = self.padded_tokens
        return 1.0 - self.real_tokens / padded if padded else 0.0

    @property
    def empty_microbatches(self) -> int:
        return sum(mb.empty for rank in self.microbatches for mb in rank)

    @property
    def dp_imbalance(self) -> float:
        """max / mean of the per-rank backbone cost (1.0 is perfect)."""
        return max_over_mean(self.rank_costs)

    @property
    def slot_imbalance(self) -> float:
        """Mean over slots of max / mean cost of the microbatches that run in that slot on the DP ranks."""
        ratios = [max_over_mean([rank[s].cost for rank in self.microbatches]) for s in range(self.num_slots)]
        return float(np.mean(ratios)) if ratios else 1.0

    @property
    def encoder_imbalance(self) -> float:
        return max_over_mean(self.encoder_costs)

    def sample_ids(self) -> list[int]:
        return [sid for rank in self.microbatches for mb in rank for sid in mb.sample_ids]

    def check(self, shapes: Sequence[SampleShape]) -> None:
        """Raise ValueError naming the broken rule: placement exactly once, budget, equal counts per rank."""
        counts = {len(rank) for rank in self.microbatches}
        if len(counts) > 1:
            raise ValueError(f"DP ranks have different microbatch counts {[len(r) for r in self.microbatches]}")
        for r, rank in enumerate(self.microbatches):
            for s, mb in enumerate(rank):
                if mb.tokens > self.token_budget:
                    raise ValueError(f"rank {r} slot {s}: {mb.tokens} tokens exceed the budget {self.token_budget}")
        expected = sorted(s.sample_id for s in shapes)
        left_out = {sid for sid, _ in self.oversize}
        placed = sorted(self.sample_ids() + sorted(left_out))
        if placed != expected:
            seen: dict[int, int] = {}
            for sid in placed:
                seen[sid] = seen.get(sid, 0) + 1
            twice = sorted(sid for sid, n in seen.items() if n > 1)
            missing = sorted(set(expected) - set(seen))
            extra = sorted(set(seen) - set(expected))
            raise ValueError(f"placement is not exactly once: placed twice {twice[:10]}, missing {missing[:10]},"
                             f" unknown {extra[:10]}")
        encoded = sorted(sid for order in self.encoder_order for sid in order)
        with_images = sorted(s.sample_id for s in shapes if s.num_images and s.sample_id not in left_out)
        if encoded != with_images:
            raise ValueError("encoder_order must list every placed sample with images exactly once")


def max_over_mean(values: Sequence[float]) -> float:
    if not len(values):
        return 1.0
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0


@dataclass
class StepInputs:
    """Per-sample arrays of one step, in the order the scheduler received them."""

    ids: list[int]
    lengths: np.ndarray  # int64 LLM tokens
    costs: np.ndarray  # float64 backbone cost
    encoder_costs: np.ndarray  # float64 encoder cost (0 for text-only)
    has_images: np.ndarray  # bool: the sample has something to encode

    @staticmethod
    def from_shapes(shapes: Sequence[SampleShape], cost_model: CostModel,
                    llm_tokens: Sequence[int] | None = None) -> "StepInputs":
        tokens = [s.llm_tokens for s in shapes] if llm_tokens is None else llm_tokens
        lengths = np.fromiter(tokens, dtype=np.int64, count=len(shapes))
        encoder_costs, has_images = encoder_costs_of(shapes, cost_model, with_mask=True)
        return StepInputs([s.sample_id for s in shapes], lengths, cost_model.sample_costs(lengths),
                          encoder_costs, has_images)

    def __len__(self) -> int:
        return len(self.ids)

    def microbatches(self, groups: Sequence[Sequence[int]], padded_tokens: Sequence[int]) -> list[Microbatch]:
        """One microbatch per group of positions; token and cost sums in one vectorized pass."""
        tokens, costs = self.sums(groups)
        ids = self.ids
        return [Microbatch([ids[i] for i in g], t, c, p)
                for g, t, c, p in zip(groups, tokens.tolist(), costs.tolist(), padded_tokens)]

    def sums(self, groups: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, cost) of each group of positions (0 for an empty group)."""
        sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
        flat = np.fromiter((i for g in groups for i in g), dtype=np.int64, count=int(sizes.sum()))
        owner = np.repeat(np.arange(len(groups)), sizes)
        tokens = np.bincount(owner, weights=self.lengths[flat], minlength=len(groups)).astype(np.int64)
        costs = np.bincount(owner, weights=self.costs[flat], minlength=len(groups))
        return tokens, costs


def encoder_costs_of(shapes: Sequence[SampleShape], cost_model: CostModel, with_mask: bool = False):
    """Encoder cost per sample, vectorized over all images of the step (0 for text-only samples).

    With `with_mask`, also a bool array: which samples have images (a zero-cost image still needs encoding).
    """
    counts = np.fromiter((len(s.image_grid_thw) for s in shapes), dtype=np.int64, count=len(shapes))
    patches = np.array([t * h * w for s in shapes for t, h, w in s.image_grid_thw], dtype=np.float64)
    owner = np.repeat(np.arange(len(shapes)), counts)
    cm = cost_model
    windowed = np.minimum(patches, cm.enc_window_patches) if cm.enc_window_patches else patches
    per_image = (cm.enc_linear * patches + cm.enc_quadratic * patches * patches
                 + cm.enc_window_quadratic * patches * windowed)
    costs = np.bincount(owner, weights=per_image, minlength=len(shapes)).astype(np.float64)
    return (costs, counts > 0) if with_mask else costs
