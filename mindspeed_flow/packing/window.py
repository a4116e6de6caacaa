"""Sample-count steps chosen from a look-ahead window of packs (`packing.step_mode: window`).

A step is still exactly `global_batch_size` samples, as in `step_mode: samples` (the LR schedule and the loss
normalisation see the same counts), but not necessarily the *next* ones. The streaming packer (streaming.py) packs
the sampler's order with its bounded look-ahead buffer, and the window keeps a pool of its nearly full packs holding
global_batch_size + lookahead samples. A step then takes:

- whole pool packs, when some choice holds exactly global_batch_size samples in a multiple of DP packs (at least
  DP x pp) that are together at least STEP_FILL full (`select_packs`). With the order fixed, a step's pack count
  rounded up to a multiple of DP costs about dp / 2 packs; choosing the packs removes that rounding. This is the
  usual step on near-budget lengths, where only whole packs made over a wide window stay full;
- otherwise the window's oldest samples (the oldest packs, the last one split), packed by `plan_step` like a step
  of `step_mode: samples`. On lengths that all pack about the same count per pack (InfoVQA-like, mostly at the
  pixel cap), whole packs cannot hold every stream's mean tokens per step in a multiple of DP full packs; these
  steps take the long samples the whole-pack steps left, at a shorter padded length (pad_multiple).

Bounded wait: a pack left in the pool grows one step older per step (the rest of a split pack keeps its age); a
pack `max_wait` steps old is taken before any other by both ways of cutting a step. What a step leaves in the pool
is about lookahead samples (at most one pack more), so with lookahead < global_batch_size those forced packs always
fit the next step: a sample waits at most `max_wait` steps once pooled, after at most `lookahead` packing rounds in
the packer's buffer (its oldest sample leaves every round; every step runs rounds while the source lasts). With
lookahead = global_batch_size a step can meet more forced samples than it holds: the forced packs then go in pool
order and the rest wait one more step.

Every sample is placed exactly once over a finite stream (the last step takes what is left and may be short, as the
sampler's last batch is); every rank computes the same steps (stable sorts, no hashing); `state_dict()` names the
pool's packs and the ages beside the packer's state, so a resumed run gives the same steps.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing.cost import CostModel
from mindspeed_flow.packing.plan import PackingError, plan_step
from mindspeed_flow.packing.schedulers import round_up
from mindspeed_flow.packing.streaming import StreamingPacker
from mindspeed_flow.packing.types import Microbatch, StepPlan

MAX_WAIT = 4  # steps a pooled sample may be left out before its pack is taken first
# Whole packs make the step only when their tokens fill at least this share of its packs x budget; below, the
# oldest samples through plan_step do better. 20 steps of `bench packing --stream` (1,024 samples, dp 8, pp 4, pad
# multiple 128; padding, then samples/s), near-budget / InfoVQA-like:
#   no threshold: 0.636% / 1.035% (whole-pack steps that keep the long samples back pay for it in later steps)
#   0.99: 0.636% / 0.811%, 162k / 177k;  0.995: 0.721% / 0.731%, 123k / 152k;  0.998: 0.805% / 0.731%, 119k / 152k
STEP_FILL = 0.99


def select_packs(sizes: np.ndarray, loads: np.ndarray, ages: np.ndarray, *, count: int, dp: int, min_packs: int,
                 max_wait: int) -> np.ndarray | None:
    """Indices of pool packs holding exactly `count` samples in a multiple of `dp` packs (or in fewer than
    `min_packs`, which the plan completes with empty packs), as full as possible; None when no such choice was
    found.

    Packs with a sample `max_wait` steps old come first and always stay in, then the fullest (older first on
    ties). The prefix of that order is cut at the two multiples of dp around the pack count that first reaches
    `count` samples; its sample count is then made exact by swapping a taken pack for a left one of another size,
    the least tokens lost first.
    """
    forced = ages >= max_wait
    order = np.lexsort((-ages, -loads, ~forced))  # the last key sorts first: forced, then fuller, then older
    reach = np.cumsum(sizes[order])
    if reach.size == 0 or reach[-1] < count:
        return None
    need = int(np.searchsorted(reach, count)) + 1  # packs of the prefix that first holds `count` samples
    if need <= min_packs:
        candidates = [need]
    else:
        low = need // dp * dp
        candidates = [k for k in (low, low + dp) if min_packs <= k <= order.size]
    best, best_fill = None, -1.0
    for k in candidates:
        chosen = _exact_count(order, k, sizes, loads, forced, count)
        if chosen is not None and int(loads[chosen].sum()) / k > best_fill:
            best, best_fill = chosen, int(loads[chosen].sum()) / k
    return best


def _exact_count(order: np.ndarray, k: int, sizes: np.ndarray, loads: np.ndarray, forced: np.ndarray,
                 count: int) -> np.ndarray | None:
    """The first k packs of `order`, swapped until they hold exactly `count` samples (None if no swaps do, or if a
    forced pack would be left out)."""
    taken = np.zeros(sizes.size, dtype=bool)
    taken[order[:k]] = True
    delta = count - int(sizes[taken].sum())
    if delta:
        # Per pack size: the taken (not forced) packs emptiest first, the left ones fullest first. Swapping a taken
        # pack of size a for a left one of size b moves the count by b - a and loses their load difference. A few
        # sizes, so plain Python over the size pairs beats building arrays per swap.
        values = np.unique(sizes).tolist()  # the pack sizes present (a few)
        rest = order[k:]
        outs = order[:k][~forced[order[:k]]][::-1]  # `order` is fullest first
        out_by = [outs[sizes[outs] == v].tolist() for v in values]
        in_by = [rest[sizes[rest] == v].tolist() for v in values]
        load_of = loads.tolist()
        out_head, in_head = [0] * len(values), [0] * len(values)  # next candidate per out size / in size
        while delta:
            best = None  # (load lost, out size index, in size index); the first least one wins ties
            for a, size_a in enumerate(values):
                if out_head[a] == len(out_by[a]):
                    continue
                out_load = load_of[out_by[a][out_head[a]]]
                for b, size_b in enumerate(values):
                    step = size_b - size_a
                    if step * delta <= 0 or abs(step) > abs(delta) or in_head[b] == len(in_by[b]):
                        continue
                    lost = out_load - load_of[in_by[b][in_head[b]]]
                    if best is None or lost < best[0]:
                        best = (lost, a, b)
            if best is None:
                return None
            _, a, b = best
            taken[out_by[a][out_head[a]]] = False
            taken[in_by[b][in_head[b]]] = True
            out_head[a] += 1
            in_head[b] += 1
            delta -= values[b] - values[a]
    if (forced & ~taken).any():
        return None
    return np.flatnonzero(taken)


class WindowPacker:
    """Steps of exactly `global_batch_size` samples chosen from a look-ahead pool; see the module docstring."""

    def __init__(self, source: Iterable[SampleShape], *, global_batch_size: int, token_budget: int,
                 cost_model: CostModel, lookahead: int = 1024, oversize_policy: str = "error",
                 max_wait: int = MAX_WAIT, step_fill: float = STEP_FILL) -> None:
        if global_batch_size < 1:
            raise PackingError(f"global_batch_size={global_batch_size}: must be >= 1")
        if not 1 <= lookahead <= global_batch_size:
            raise PackingError(f"lookahead={lookahead}: must be in [1, global_batch_size={global_batch_size}] (the "
                               "samples a step leaves behind must fit the next step)")
        if max_wait < 1:
            raise PackingError(f"max_wait={max_wait}: must be >= 1 step")
        self.global_batch_size = global_batch_size
        self.lookahead = lookahead
        self.max_wait = max_wait
        self.step_fill = step_fill
        self.cost_model = cost_model
        self.oversize_policy = oversize_policy
        self.packer = StreamingPacker(source, token_budget=token_budget, cost_model=cost_model,
                                      lookahead=lookahead, oversize_policy=oversize_policy)
        self.pool: list[Microbatch] = []  # packs taken from the packer, not in a step yet
        self.ages: list[int] = []  # steps each pool pack has been left out of
        self.max_age = 0  # the oldest age a stepped pack had (tests check the bound)
        self.whole_pack_steps = self.oldest_steps = 0  # how the steps were cut (see next_step)

    def _top_up(self) -> None:
        """Pool packs until they hold global_batch_size + lookahead samples (fewer once the source has ended)."""
        want = self.global_batch_size + self.lookahead - sum(len(mb.sample_ids) for mb in self.pool)
        while want > 0:
            packs = self.packer.next_packs(1)
            if not packs:
                return
            self.pool += packs
            self.ages += [0] * len(packs)
            want -= len(packs[0].sample_ids)

    def next_step(self, *, dp: int, num_encoders: int, min_microbatches: int, pad_multiple: int = 0) -> StepPlan | None:
        """The next step's plan: exactly global_batch_size samples (fewer only at the end of a finite stream) in a
        multiple of dp packs, at least dp x min_microbatches; None once every sample has been placed."""
        self._top_up()
        if not self.pool:
            return None
        pool, budget = self.pool, self.packer.token_budget
        sizes = np.fromiter((len(mb.sample_ids) for mb in pool), dtype=np.int64, count=len(pool))
        loads = np.fromiter((mb.tokens for mb in pool), dtype=np.int64, count=len(pool))
        ages = np.asarray(self.ages, dtype=np.int64)
        min_packs = dp * min_microbatches
        chosen = None
        if int(sizes.sum()) > self.global_batch_size:  # else the source has ended: the last step takes the rest
            chosen = select_packs(sizes, loads, ages, count=self.global_batch_size, dp=dp, min_packs=min_packs,
                                  max_wait=self.max_wait)
            if chosen is not None and int(loads[chosen].sum()) < self.step_fill * budget * round_up(
                    max(chosen.size, min_packs), dp):
                chosen = None
        if chosen is None:
            self.oldest_steps += 1
            return self._oldest_step(ages, dp, num_encoders, min_packs, pad_multiple)
        self.whole_pack_steps += 1
        keep = np.ones(len(pool), dtype=bool)
        keep[chosen] = False
        packs = [pool[p] for p in chosen.tolist()]
        self._keep(keep, ages)
        packs += [Microbatch([], 0, 0.0, budget) for _ in range(round_up(max(len(packs), min_packs), dp) - len(packs))]
        return self.packer.plan_of(packs, dp, num_encoders, pad_multiple)

    def _oldest_step(self, ages: np.ndarray, dp: int, num_encoders: int, min_packs: int,
                     pad_multiple: int) -> StepPlan:
        """The oldest global_batch_size samples (forced packs, then pool order; the last pack split, its other
        samples staying pooled) packed by `plan_step`."""
        pool, shapes_of = self.pool, self.packer.shapes
        forced = ages >= self.max_wait
        ids: list[int] = []
        keep = np.ones(len(pool), dtype=bool)
        for p in np.r_[np.flatnonzero(forced), np.flatnonzero(~forced)].tolist():
            if len(ids) >= self.global_batch_size:
                break
            ids += pool[p].sample_ids
            keep[p] = False
            last = p
        ids, rest = ids[:self.global_batch_size], ids[self.global_batch_size:]
        self._keep(keep, ages)
        if rest:  # the split pack's other samples stay pooled, as old as their pack (already counted a step older)
            self.pool.append(self.packer.pack_of(rest, shapes_of.__getitem__))
            self.ages.append(int(ages[last]) + 1)
        plan = plan_step([shapes_of.pop(sid) for sid in ids], dp=dp, num_encoders=num_encoders,
                         token_budget=self.packer.token_budget, cost_model=self.cost_model,
                         min_microbatches=min_packs // dp, oversize_policy=self.oversize_policy,
                         pad_multiple=pad_multiple)
        plan.oversize = self.packer.take_oversize()
        return plan

    def _keep(self, keep: np.ndarray, ages: np.ndarray) -> None:
        """Only the `keep` packs stay pooled, each a step older; the others went into the step."""
        if (~keep).any():
            self.max_age = max(self.max_age, int(ages[~keep].max()))
        self.pool = [mb for mb, k in zip(self.pool, keep.tolist()) if k]
        self.ages = (ages[keep] + 1).tolist()

    def steps(self, *, dp: int, num_encoders: int, min_microbatches: int, pad_multiple: int = 0) -> Iterator[StepPlan]:
        """Every step's plan until the source ends."""
        while (plan := self.next_step(dp=dp, num_encoders=num_encoders, min_microbatches=min_microbatches,
                                      pad_multiple=pad_multiple)) is not None:
            yield plan

    # ---- resume -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The packer's state, and the pool's packs (sample ids each) with their ages."""
        return {"packer": self.packer.state_dict(), "pool": [mb.sample_ids for mb in self.pool], "ages": self.ages}

    def load_state_dict(self, state: dict[str, Any], shape_of: Callable[[int], SampleShape]) -> None:
        """Restore a state on a fresh window; `shape_of(sample_id)` gives each named sample's shape."""
        if self.pool:
            raise PackingError("load_state_dict needs a fresh WindowPacker (an empty pool)")
        self.packer.load_state_dict(state["packer"], shape_of)
        self.pool = [self.packer.pack_of(ids, shape_of) for ids in state["pool"]]
        self.ages = [int(a) for a in state["ages"]]
