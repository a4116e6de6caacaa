"""Packing over an endless stream of sample shapes with a bounded look-ahead buffer.

The packer holds at most `lookahead` samples (the recipe's `packing.lookahead`). Each round it fills the
buffer from the source, runs best fit decreasing over the buffer, and emits every pack that is at least
`min_fill` full plus, always, the pack holding the oldest buffered sample; the rest go back to the buffer. So
memory stays bounded, packs are nearly full, and no sample waits more than `lookahead` rounds (the oldest one
leaves every round). When the source ends, everything left is emitted: over a finite stream every sample comes
out exactly once (or is reported as oversize under policy "skip").

`steps()` groups the packs into step plans of dp x microbatches_per_rank packs (cost buckets + zig-zag, LPT
encoder order), the "token-defined global batch" mode: a step has a fixed number of packs, not of samples.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

import numpy as np

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing.balance import encoder_schedule, zigzag_place
from mindspeed_flow.packing.bestfit import best_fit_pack
from mindspeed_flow.packing.cost import CostModel
from mindspeed_flow.packing.plan import PackingError, check_arguments
from mindspeed_flow.packing.types import Microbatch, StepPlan, encoder_costs_of


class StreamingPacker:
    """Bounded look-ahead best-fit packer; iterate `microbatches()` or `steps(...)` once."""

    def __init__(self, source: Iterable[SampleShape], *, token_budget: int, cost_model: CostModel,
                 lookahead: int = 1024, oversize_policy: str = "error", min_fill: float = 0.97) -> None:
        check_arguments(dp=1, num_encoders=1, token_budget=token_budget, scheduler="flow", min_microbatches=1,
                        oversize_policy=oversize_policy, pad_multiple=0)
        if lookahead < 1:
            raise PackingError(f"lookahead={lookahead}: the look-ahead buffer must hold at least one sample")
        if not 0.0 < min_fill <= 1.0:
            raise PackingError(f"min_fill={min_fill}: must be in (0, 1]")
        self.source = iter(source)
        self.token_budget = token_budget
        self.cost_model = cost_model
        self.lookahead = lookahead
        self.oversize_policy = oversize_policy
        self.min_fill = min_fill
        self.oversize: list[tuple[int, int]] = []  # (sample_id, llm_tokens) left out under "skip"
        self.shapes: dict[int, SampleShape] = {}  # buffered and emitted-but-not-yet-stepped shapes, by id
        self.max_buffered = 0  # largest buffer size seen (tests check the bound)

    def _admit(self, shape: SampleShape) -> bool:
        tokens = shape.llm_tokens
        if tokens <= 0 or shape.text_tokens < 0:
            raise PackingError(f"sample {shape.sample_id}: llm_tokens={tokens}; a sample needs at least one token")
        if tokens <= self.token_budget:
            return True
        if self.oversize_policy == "error":
            raise PackingError(f"sample {shape.sample_id} has {tokens} LLM tokens, more than token_budget="
                               f"{self.token_budget} (oversize_policy='error')")
        self.oversize.append((shape.sample_id, tokens))
        return False

    def _fill(self, buffer: deque[tuple[SampleShape, int]]) -> bool:
        """Top the buffer up to `lookahead` with (shape, llm_tokens); False once the source is exhausted."""
        while len(buffer) < self.lookahead:
            shape = next(self.source, None)
            if shape is None:
                return False
            if self._admit(shape):
                buffer.append((shape, shape.llm_tokens))
        return True

    def microbatches(self) -> Iterator[Microbatch]:
        buffer: deque[tuple[SampleShape, int]] = deque()
        more = True
        full = self.min_fill * self.token_budget
        while more or buffer:
            more = more and self._fill(buffer)
            self.max_buffered = max(self.max_buffered, len(buffer))
            if not buffer:
                return
            lengths = np.fromiter((tokens for _, tokens in buffer), dtype=np.int64, count=len(buffer))
            packing = best_fit_pack(lengths, self.token_budget)
            taken = np.zeros(len(buffer), dtype=bool)
            for b, load in enumerate(packing.loads):
                if not more or load >= full or 0 in packing.bins[b]:  # position 0 is the oldest sample
                    taken[packing.bins[b]] = True
                    yield self._microbatch([buffer[i] for i in packing.bins[b]], load)
            buffer = deque(entry for entry, done in zip(buffer, taken.tolist()) if not done)

    def _microbatch(self, entries: list[tuple[SampleShape, int]], tokens: int) -> Microbatch:
        for shape, _ in entries:
            self.shapes[shape.sample_id] = shape
        cm = self.cost_model
        squares = sum(t * t for _, t in entries)
        return Microbatch(sample_ids=[s.sample_id for s, _ in entries], tokens=tokens,
                          cost=cm.linear * tokens + cm.quadratic * squares, padded_tokens=self.token_budget)

    def steps(self, *, dp: int, num_encoders: int, microbatches_per_rank: int) -> Iterator[StepPlan]:
        """Step plans of dp x microbatches_per_rank packs; the last one is completed with empty packs."""
        check_arguments(dp=dp, num_encoders=num_encoders, token_budget=self.token_budget, scheduler="flow",
                        min_microbatches=microbatches_per_rank, oversize_policy=self.oversize_policy,
                        pad_multiple=0)
        per_step = dp * microbatches_per_rank
        pending: list[Microbatch] = []
        reported = 0
        for mb in self.microbatches():
            pending.append(mb)
            if len(pending) == per_step:
                yield self._step(pending, dp, num_encoders, self.oversize[reported:])
                reported = len(self.oversize)
                pending = []
        if pending:
            empty = [Microbatch([], 0, 0.0, self.token_budget) for _ in range(per_step - len(pending))]
            yield self._step(pending + empty, dp, num_encoders, self.oversize[reported:])

    def _step(self, packs: list[Microbatch], dp: int, num_encoders: int,
              oversize: list[tuple[int, int]]) -> StepPlan:
        ranks = zigzag_place([mb.cost for mb in packs], dp)
        microbatches = [[packs[b] for b in rank] for rank in ranks]
        ids = [sid for slot in range(len(ranks[0])) for rank in microbatches for sid in rank[slot].sample_ids]
        shapes = [self.shapes.pop(sid) for sid in ids]
        enc, has_images = encoder_costs_of(shapes, self.cost_model, with_mask=True)
        slots, start = [], 0
        for slot in range(len(ranks[0])):
            n = sum(len(rank[slot].sample_ids) for rank in microbatches)
            slots.append(list(range(start, start + n)))
            start += n
        order, loads = encoder_schedule(slots, enc, ids, num_encoders, has_images)
        return StepPlan(microbatches=microbatches, encoder_order=order, token_budget=self.token_budget,
                        oversize=list(oversize), seq_len=self.token_budget, scheduler="flow", encoder_costs=loads)
