"""The four step schedulers: mindspeed-flow's ("flow") and the three baselines it is measured against.

All take the same `StepInputs` and return the same `StepPlan`, so the runtime and the benchmark treat them
alike. Every one places each sample exactly once, keeps every microbatch within the budget and gives every DP
rank the same number of microbatches (at least `min_microbatches`, the pipeline depth).

- flow: best fit decreasing into a multiple-of-DP number of bins (>= DP x min_microbatches) at the smallest
  capacity that allows it, with a repair pass when best fit opens a bin or two too many (bestfit.repair_to_count),
  so tokens spread evenly instead of leaving empty bins; light packs levelled; cost buckets + zig-zag over DP
  ranks x slots; LPT of samples to encoder ranks in consumption order.
- naive: fixed micro-batch size (as many of the step's longest sample as fit the budget), samples in arrival
  order; contiguous chunks per DP rank.
- sorted: samples sorted by length, cut into batches that would fit the budget padded to their longest; batches
  dealt round-robin to DP ranks.
- first_fit: greedy first fit in arrival order into bins of the budget (O(N x bins) scan), round-robin to ranks.

The engine runs every microbatch of every scheduler the same way, as one packed sequence of the step's
`seq_len` (the longest pack rounded up to `pad_multiple`, or the budget), so each plan's padded tokens, and the
`padding_fraction` in metrics.jsonl, are what the backbone really computes over.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from mindspeed_flow.packing.balance import (
    encoder_schedule, level_bins, round_robin_encoders, split_to_count, zigzag_place,
)
from mindspeed_flow.packing.bestfit import pack_into_bins
from mindspeed_flow.packing.types import StepInputs, StepPlan


def round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple


def packed_seq_len(loads: Sequence[int], token_budget: int, pad_multiple: int) -> int:
    """Padded length of a packed microbatch: the budget, or the step's longest pack rounded up to a bucket."""
    if not pad_multiple:
        return token_budget
    return min(token_budget, round_up(max(max(loads, default=0), 1), pad_multiple))


def assemble(inp: StepInputs, placement: list[list[list[int]]], *, token_budget: int, num_encoders: int,
             footprint: Callable[[list[int]], int], seq_len: int, scheduler: str,
             balance_encoders: bool) -> StepPlan:
    """StepPlan from positions per [rank][slot]; `footprint(positions)` gives each microbatch's padded tokens."""
    microbatches = [inp.microbatches(rank, [footprint(pos) for pos in rank]) for rank in placement]
    num_slots = len(placement[0]) if placement else 0
    slots = [[p for rank in placement for p in rank[s]] for s in range(num_slots)]
    schedule = encoder_schedule if balance_encoders else round_robin_encoders
    order, loads = schedule(slots, inp.encoder_costs, inp.ids, num_encoders, inp.has_images)
    return StepPlan(microbatches=microbatches, encoder_order=order, token_budget=token_budget, seq_len=seq_len,
                    scheduler=scheduler, encoder_costs=loads)


def deal_round_robin(batches: list[list[int]], dp: int, min_microbatches: int) -> list[list[list[int]]]:
    """Batch j to rank j % dp, then empty batches so every rank has the same count (>= min_microbatches)."""
    per_rank = max(math.ceil(len(batches) / dp), min_microbatches)
    padded = batches + [[] for _ in range(per_rank * dp - len(batches))]
    return [[padded[slot * dp + r] for slot in range(per_rank)] for r in range(dp)]


def flow_schedule(inp: StepInputs, *, dp: int, num_encoders: int, token_budget: int, min_microbatches: int,
                  pad_multiple: int) -> StepPlan:
    lengths = inp.lengths
    total = int(lengths.sum())
    count = round_up(max(math.ceil(total / token_budget), dp * min_microbatches, 1), dp)
    # With pad_multiple=0 every pack is padded to the budget anyway; the capacity search only spreads tokens for
    # balance, so a 1/128-of-budget granularity is plenty and saves best-fit passes.
    granularity = pad_multiple or max(1, token_budget // 128)
    bins: list[list[int]] = []
    if len(inp):
        bins, count = _pack_count(lengths, token_budget, count, dp, granularity)
    if pad_multiple and len(inp):
        bins, count = _fewer_padded_tokens(lengths, bins, count, token_budget=token_budget, dp=dp,
                                           pad_multiple=pad_multiple)
    bins = split_to_count(bins, lengths, count)
    level_bins(bins, inp.sums(bins)[0].tolist(), lengths.tolist())
    loads, costs = inp.sums(bins)
    ranks = zigzag_place(costs.tolist(), dp)
    placement = [[bins[b] for b in rank] for rank in ranks]
    seq_len = packed_seq_len(loads.tolist(), token_budget, pad_multiple)
    return assemble(inp, placement, token_budget=token_budget, num_encoders=num_encoders,
                    footprint=lambda pos: seq_len, seq_len=seq_len, scheduler="flow", balance_encoders=True)


EXTRA_COUNTS = 2  # flow tries at most this many pack counts above the least one (pad_multiple > 0)


def _pack_count(lengths: np.ndarray, token_budget: int, count: int, dp: int, granularity: int) -> tuple[list[list[int]], int]:
    """Bins of `pack_into_bins` for `count` packs, and the pack count the step then needs (a multiple of dp)."""
    bins = pack_into_bins(lengths, token_budget, count, granularity=granularity).bins
    if len(bins) > count:  # even the full budget needed more bins than asked
        count = round_up(len(bins), dp)
    return bins, count


def _fewer_padded_tokens(lengths: np.ndarray, bins: list[list[int]], count: int, *, token_budget: int, dp: int,
                         pad_multiple: int) -> tuple[list[list[int]], int]:
    """The least pack count is not always the least padding when each step pads to its longest pack.

    When that count only fits at the budget, dp more packs may fit at a much shorter length (8,192-sample
    InfoVQA-like steps at a 16,384 budget: 1.51% padding at the least count, 0.62% with up to 2 x dp more). So while
    the lower bound of count + dp packs (the even share or the longest sample, rounded up) beats the current
    count x length, pack that many and keep it if it really pads less. Each try is one more `pack_into_bins`, so
    only steps padded to the budget try, at most EXTRA_COUNTS times.
    """
    total, longest = int(lengths.sum()), int(lengths.max())
    seq_len = packed_seq_len([int(lengths[b].sum()) for b in bins], token_budget, pad_multiple)
    # Below the budget the gain is small (1,024-sample InfoVQA-like steps: 0.91% -> 0.80%) for 2-3x the planning
    # time, which would take the bench under 100k samples/s.
    if seq_len < token_budget:
        return bins, count
    best = count * seq_len
    for _ in range(EXTRA_COUNTS):
        more = count + dp
        if more * packed_seq_len([longest, -(-total // more)], token_budget, pad_multiple) >= best:
            break
        other, other_count = _pack_count(lengths, token_budget, more, dp, pad_multiple)
        padded = other_count * packed_seq_len([int(lengths[b].sum()) for b in other], token_budget, pad_multiple)
        if padded >= best:
            break
        bins, count, best = other, other_count, padded
    return bins, count


def naive_schedule(inp: StepInputs, *, dp: int, num_encoders: int, token_budget: int, min_microbatches: int,
                   pad_multiple: int) -> StepPlan:
    lengths = inp.lengths
    longest = int(lengths.max()) if len(inp) else 1
    batch = max(1, token_budget // longest)  # fixed micro-batch size: the worst case fits the budget when padded
    placement = []
    for r in range(dp):
        mine = list(range(r * len(inp) // dp, (r + 1) * len(inp) // dp))
        placement.append([mine[i:i + batch] for i in range(0, len(mine), batch)])
    per_rank = max(max(len(rank) for rank in placement), min_microbatches)
    for rank in placement:
        rank.extend([] for _ in range(per_rank - len(rank)))
    return _assemble_packed(inp, placement, token_budget=token_budget, num_encoders=num_encoders,
                            pad_multiple=pad_multiple, scheduler="naive")


def sorted_schedule(inp: StepInputs, *, dp: int, num_encoders: int, token_budget: int, min_microbatches: int,
                    pad_multiple: int) -> StepPlan:
    lengths = inp.lengths
    order = sorted(range(len(inp)), key=lambda i: (-int(lengths[i]), inp.ids[i]))
    batches: list[list[int]] = []
    for i in order:  # longest first: a batch's first sample sets its padded length
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    placement = deal_round_robin(batches, dp, min_microbatches)
    return _assemble_packed(inp, placement, token_budget=token_budget, num_encoders=num_encoders,
                            pad_multiple=pad_multiple, scheduler="sorted")


def first_fit_schedule(inp: StepInputs, *, dp: int, num_encoders: int, token_budget: int, min_microbatches: int,
                       pad_multiple: int) -> StepPlan:
    lengths = inp.lengths.tolist()
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, length in enumerate(lengths):
        for b, load in enumerate(loads):
            if load + length <= token_budget:
                bins[b].append(i)
                loads[b] += length
                break
        else:
            bins.append([i])
            loads.append(length)
    placement = deal_round_robin(bins, dp, min_microbatches)
    return _assemble_packed(inp, placement, token_budget=token_budget, num_encoders=num_encoders,
                            pad_multiple=pad_multiple, scheduler="first_fit")


def _assemble_packed(inp: StepInputs, placement: list[list[list[int]]], *, token_budget: int, num_encoders: int,
                     pad_multiple: int, scheduler: str) -> StepPlan:
    """A baseline's plan as the engine runs it: every microbatch (empty ones included) is one packed sequence of
    the step's `seq_len`, so the plan's padded tokens are what the backbone really computes over."""
    loads = [int(inp.lengths[pos].sum()) for rank in placement for pos in rank]
    seq_len = packed_seq_len(loads, token_budget, pad_multiple)
    return assemble(inp, placement, token_budget=token_budget, num_encoders=num_encoders,
                    footprint=lambda pos: seq_len, seq_len=seq_len, scheduler=scheduler, balance_encoders=False)


SCHEDULERS: dict[str, Callable[..., StepPlan]] = {
    "flow": flow_schedule,
    "naive": naive_schedule,
    "sorted": sorted_schedule,
    "first_fit": first_fit_schedule,
}
