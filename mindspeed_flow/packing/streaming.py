"""Packing over an endless stream of sample shapes with a bounded look-ahead buffer: token-defined steps.

The packer holds at most `lookahead` samples. Each round it fills the buffer from the source, runs best fit
decreasing over the buffer, and emits every pack that is at least `min_fill` full plus, always, the pack holding
the oldest buffered sample; the rest go back to the buffer. So memory stays bounded, packs are nearly full, and no
sample waits more than `lookahead` rounds (the oldest one leaves every round). When the source ends, everything
left is emitted: over a finite stream every sample comes out exactly once (or is reported as oversize under
policy "skip").

`next_step()` / `steps()` group the packs into step plans of dp x microbatches_per_rank packs (cost buckets +
zig-zag, LPT encoder order): a step has a fixed number of packs, not of samples (the runtime's
`packing.step_mode: packs`). Emitted packs that do not fill a step yet wait in a ready queue.

Resumable: `state_dict()` names the buffered and the ready samples by id (and whether the source has ended);
`load_state_dict` on a fresh packer over the source's continuation gives exactly the packs and steps the
uninterrupted packer would have given. The source's own position is the caller's to save.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing.balance import encoder_schedule, zigzag_place
from mindspeed_flow.packing.bestfit import best_fit_pack
from mindspeed_flow.packing.cost import CostModel
from mindspeed_flow.packing.plan import PackingError, check_arguments, llm_tokens_of
from mindspeed_flow.packing.schedulers import packed_seq_len
from mindspeed_flow.packing.types import Microbatch, StepPlan, encoder_costs_of

# A pack at least this full leaves the buffer. Lower emits more per round, so fewer best-fit passes per sample;
# 20 steps of `bench packing --stream` (1,024-sample look-ahead, 16,384-token budget) measured:
#   min_fill 0.97: near-budget 0.306% padding at 153k samples/s, InfoVQA-like 0.576% at 295k/s
#   min_fill 0.95: near-budget 0.325% padding at 196k samples/s, InfoVQA-like 0.697% at 339k/s
# (bitset best fit; with the earlier segment tree near-budget ran 105k / 174k, so 0.95 was kept for its speed).
MIN_FILL = 0.95


class StreamingPacker:
    """Bounded look-ahead best-fit packer; iterate `microbatches()` or `steps(...)`, or call `next_step(...)`."""

    def __init__(self, source: Iterable[SampleShape], *, token_budget: int, cost_model: CostModel,
                 lookahead: int = 1024, oversize_policy: str = "error", min_fill: float = MIN_FILL) -> None:
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
        self.shapes: dict[int, SampleShape] = {}  # buffered and ready (emitted, not yet stepped) shapes, by id
        self.max_buffered = 0  # largest buffer size seen (tests check the bound)
        # The buffer in arrival order: sample ids and their LLM tokens (position 0 is the oldest sample).
        self._ids = np.zeros(0, dtype=np.int64)
        self._lengths = np.zeros(0, dtype=np.int64)
        self._ready: deque[Microbatch] = deque()
        self._exhausted = False
        self._deferred: list[SampleShape] = []  # repeats of in-flight sample ids, in arrival order (see _fill)
        self._reported = 0  # oversize samples already reported by a step

    # ---- packs ------------------------------------------------------------------------------------------------
    def _fill(self) -> None:
        """Top the buffer up (see `_fill_once`) until it holds a sample or the source has ended."""
        while True:
            self._fill_once()
            if self._ids.size or self._exhausted:
                return

    def _fill_once(self) -> None:
        """Top the buffer up to `lookahead` samples (fewer when some are left out as oversize); notes when the
        source has ended.

        A sample id that is still in flight (buffered, or in a pack no step has taken yet) when it arrives again, as
        a sampler's next epoch can bring it, waits in `_deferred` until its first copy has left: one step never holds
        a sample twice, and every copy is placed once.
        """
        want = self.lookahead - int(self._ids.size)
        if want <= 0:
            return
        new: list[SampleShape] = []
        seen: set[int] = set()
        if self._deferred:
            waiting = []
            for shape in self._deferred:
                sid = shape.sample_id
                if len(new) < want and sid not in self.shapes and sid not in seen:
                    new.append(shape)
                    seen.add(sid)
                else:
                    waiting.append(shape)
            self._deferred = waiting
        while not self._exhausted and len(new) < want:
            shape = next(self.source, None)
            if shape is None:
                self._exhausted = True
            elif shape.sample_id in self.shapes or shape.sample_id in seen:
                self._deferred.append(shape)
                if len(self._deferred) > self.lookahead:
                    raise PackingError(f"sample ids repeat within the look-ahead buffer ({len(self._deferred)} "
                                       f"repeats waiting, e.g. sample {shape.sample_id}): the source has too few "
                                       f"distinct samples for lookahead={self.lookahead}; lower it")
            else:
                new.append(shape)
                seen.add(shape.sample_id)
        self._admit(new)

    def _admit(self, new: list[SampleShape]) -> None:
        """Append `new` to the buffer, leaving out (or refusing) samples over the budget."""
        if not new:
            return
        tokens = np.asarray(llm_tokens_of(new), dtype=np.int64)
        bad = np.flatnonzero(tokens <= 0)
        if bad.size or min(s.text_tokens for s in new) < 0:
            shape = new[int(bad[0])] if bad.size else next(s for s in new if s.text_tokens < 0)
            raise PackingError(f"sample {shape.sample_id}: llm_tokens={shape.llm_tokens}; a sample needs at least one"
                               " token and text_tokens >= 0")
        keep = tokens <= self.token_budget
        if not keep.all():
            for i in np.flatnonzero(~keep).tolist():
                if self.oversize_policy == "error":
                    raise PackingError(f"sample {new[i].sample_id} has {int(tokens[i])} LLM tokens, more than "
                                       f"token_budget={self.token_budget} (oversize_policy='error')")
                self.oversize.append((new[i].sample_id, int(tokens[i])))
            new = [s for s, k in zip(new, keep.tolist()) if k]
            tokens = tokens[keep]
        ids = [s.sample_id for s in new]
        self.shapes.update(zip(ids, new))
        self._ids = np.concatenate((self._ids, np.asarray(ids, dtype=np.int64)))
        self._lengths = np.concatenate((self._lengths, tokens))
        self.max_buffered = max(self.max_buffered, int(self._ids.size))

    def _round(self) -> None:
        """One best-fit pass over the buffer: full packs (and the oldest sample's) join the ready queue."""
        lengths = self._lengths
        packing = best_fit_pack(lengths, self.token_budget)
        bins = packing.bins
        sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        flat = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(lengths.size))
        owner = np.repeat(np.arange(len(bins)), sizes)
        loads = np.asarray(packing.loads, dtype=np.int64)
        emit = np.ones(len(bins), dtype=bool) if self._exhausted else loads >= self.min_fill * self.token_budget
        emit[owner[np.flatnonzero(flat == 0)[0]]] = True  # the oldest sample always leaves
        cm = self.cost_model
        squares = np.bincount(owner, weights=(lengths[flat] ** 2).astype(np.float64), minlength=len(bins))
        costs = cm.linear * loads + cm.quadratic * squares
        ids = self._ids
        for b in np.flatnonzero(emit).tolist():
            self._ready.append(Microbatch(sample_ids=ids[bins[b]].tolist(), tokens=int(loads[b]),
                                          cost=float(costs[b]), padded_tokens=self.token_budget))
        taken = np.zeros(lengths.size, dtype=bool)
        taken[flat] = emit[owner]
        self._ids, self._lengths = ids[~taken], lengths[~taken]

    def next_packs(self, count: int) -> list[Microbatch]:
        """Up to `count` packs from the ready queue, packing more rounds as needed (fewer only at the end)."""
        while len(self._ready) < count:
            self._fill()
            if not self._ids.size:  # nothing buffered: the source has ended (deferred repeats wait for a step)
                break
            self._round()
        return [self._ready.popleft() for _ in range(min(count, len(self._ready)))]

    def microbatches(self) -> Iterator[Microbatch]:
        while True:
            packs = self.next_packs(1)
            if not packs:
                return
            for sid in packs[0].sample_ids:  # the pack leaves the packer here (no step takes it)
                self.shapes.pop(sid)
            yield packs[0]

    # ---- steps ------------------------------------------------------------------------------------------------
    def next_step(self, *, dp: int, num_encoders: int, microbatches_per_rank: int) -> StepPlan | None:
        """The next step of dp x microbatches_per_rank packs (the last one completed with empty packs), or None
        once every sample has been placed."""
        check_arguments(dp=dp, num_encoders=num_encoders, token_budget=self.token_budget, scheduler="flow",
                        min_microbatches=microbatches_per_rank, oversize_policy=self.oversize_policy,
                        pad_multiple=0)
        per_step = dp * microbatches_per_rank
        packs = self.next_packs(per_step)
        if not packs:
            return None
        packs += [Microbatch([], 0, 0.0, self.token_budget) for _ in range(per_step - len(packs))]
        return self.plan_of(packs, dp, num_encoders)

    def steps(self, *, dp: int, num_encoders: int, microbatches_per_rank: int) -> Iterator[StepPlan]:
        """Step plans of dp x microbatches_per_rank packs; the last one is completed with empty packs."""
        while True:
            plan = self.next_step(dp=dp, num_encoders=num_encoders, microbatches_per_rank=microbatches_per_rank)
            if plan is None:
                return
            yield plan

    def take_oversize(self) -> list[tuple[int, int]]:
        """The oversize samples left out since the last call (a step reports each once)."""
        oversize, self._reported = self.oversize[self._reported:], len(self.oversize)
        return oversize

    def plan_of(self, packs: list[Microbatch], dp: int, num_encoders: int, pad_multiple: int = 0) -> StepPlan:
        """The step plan of these packs (a multiple of dp; they leave the packer), reporting the oversize samples
        left out since the last step; pad_multiple > 0 pads them to the longest rounded up to that multiple."""
        oversize = self.take_oversize()
        seq_len = packed_seq_len([mb.tokens for mb in packs], self.token_budget, pad_multiple)
        for mb in packs:
            mb.padded_tokens = seq_len
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
                        oversize=list(oversize), seq_len=seq_len, scheduler="flow", encoder_costs=loads)

    def pack_of(self, ids: list[int], shape_of: Callable[[int], SampleShape]) -> Microbatch:
        """The pack of these sample ids (a checkpointed one, or part of one), held by the packer until a step."""
        shapes = [shape_of(int(sid)) for sid in ids]
        tokens = llm_tokens_of(shapes)
        if sum(tokens) > self.token_budget:
            raise PackingError(f"checkpointed pack {list(ids[:4])}...: {sum(tokens)} tokens exceed token_budget="
                               f"{self.token_budget} (the budget changed since the checkpoint)")
        self.shapes.update((s.sample_id, s) for s in shapes)
        cm = self.cost_model
        return Microbatch(sample_ids=[int(s) for s in ids], tokens=sum(tokens),
                          cost=cm.linear * sum(tokens) + cm.quadratic * sum(t * t for t in tokens),
                          padded_tokens=self.token_budget)

    # ---- resume -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Buffered sample ids (arrival order), ready packs (ids each), deferred repeats, whether the source ended,
        and the oversize samples not yet reported by a step."""
        return {"buffer": self._ids.tolist(), "ready": [mb.sample_ids for mb in self._ready],
                "deferred": [s.sample_id for s in self._deferred], "exhausted": self._exhausted,
                "oversize": [list(x) for x in self.oversize[self._reported:]]}

    def load_state_dict(self, state: dict[str, Any], shape_of: Callable[[int], SampleShape]) -> None:
        """Restore a state on a fresh packer; `shape_of(sample_id)` gives each named sample's shape."""
        if self._ids.size or self._ready or self.shapes or self._deferred:
            raise PackingError("load_state_dict needs a fresh StreamingPacker (nothing buffered or ready)")
        self._exhausted = False
        self._admit([shape_of(int(sid)) for sid in state["buffer"]])
        self._ready.extend(self.pack_of(pack, shape_of) for pack in state["ready"])
        self._deferred = [shape_of(int(sid)) for sid in state.get("deferred", [])]
        self._exhausted = bool(state["exhausted"])
        self.oversize = [(int(sid), int(t)) for sid, t in state.get("oversize", [])]
        self._reported = 0
