"""Placement of packed microbatches over DP ranks x slots, and of samples over encoder ranks.

- `split_to_count`: a step needs a bin count that is a multiple of DP (every pipeline runs the same number of
  microbatches); when the packer made fewer bins, the heaviest splittable bins are halved, and only when no bin
  has two samples left is an empty bin added (the plan reports it).
- `level_bins`: moves samples from the fullest pack to the emptiest while that narrows the gap, so the light
  pack best fit leaves at the end does not unbalance its slot.
- `zigzag_place` ("cost buckets + zig-zag"): bins sorted by cost, cut into buckets of DP consecutive bins; a
  bucket is one slot, so the microbatches that run at the same time on different ranks have similar cost. Inside a
  bucket the heaviest bin goes to the rank with the lightest running total, which generalizes the serpentine
  deal (0..D-1, D-1..0, ...); then `refine_by_slot_swaps` swaps one slot's bins between the heaviest and the
  lightest rank while that lowers the maximum (slots keep their bins, so slot balance is unchanged).
- `encoder_schedule`: LPT of samples to encoder ranks by encoder cost, slot by slot, so each encoder rank's order
  follows the backbone's consumption order (slot 0 of every DP rank first) and slot 0 is ready early.

All ties break on position or rank index, never on hash or set order: every rank computes the same placement.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def split_to_count(bins: list[list[int]], lengths: np.ndarray, count: int) -> list[list[int]]:
    """Make exactly `count` bins (count >= len(bins)) by halving the heaviest bins, then adding empty ones."""
    bins = [list(b) for b in bins]
    if len(bins) >= count:
        return bins
    heap = [(-int(lengths[b].sum()) if b else 0, i) for i, b in enumerate(bins)]
    heapq.heapify(heap)
    while len(bins) < count and heap:
        _, i = heapq.heappop(heap)
        if len(bins[i]) < 2:
            continue  # a single sample cannot be split; it stays as it is
        left, right = halve(bins[i], lengths)
        bins[i] = left
        bins.append(right)
        for j in (i, len(bins) - 1):
            heapq.heappush(heap, (-int(lengths[bins[j]].sum()), j))
    while len(bins) < count:
        bins.append([])
    return bins


def level_bins(bins: list[list[int]], loads: list[int], lengths: Sequence[int], max_moves: int = 0) -> None:
    """Move samples from the fullest pack to the emptiest while that narrows their gap (in place).

    Best fit leaves its last pack (or the ones `split_to_count` added) light; that pack would make its slot
    unbalanced. Each move takes the sample from the fullest pack whose length is closest to half the gap (so the gap
    strictly shrinks and the maximum never grows); it stops when no sample narrows it. `loads` are the packs'
    token sums (updated in place); ties go to the lowest pack index.
    """
    for _ in range(max_moves or 4 * len(bins)):
        if not bins:
            return
        heavy = loads.index(max(loads))
        light = loads.index(min(loads))
        gap = loads[heavy] - loads[light]
        best, best_len = -1, 0
        for k, i in enumerate(bins[heavy]):
            length = lengths[i]
            if length < gap and abs(gap - 2 * length) < abs(gap - 2 * best_len):
                best, best_len = k, length
        if best < 0:
            return
        bins[light].append(bins[heavy].pop(best))
        loads[heavy] -= best_len
        loads[light] += best_len


def halve(items: Sequence[int], lengths: np.ndarray) -> tuple[list[int], list[int]]:
    """Two halves of near-equal tokens: longest first, each to the lighter half."""
    order = sorted(items, key=lambda i: (-int(lengths[i]), i))
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in order:
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += int(lengths[i])
    return halves


def zigzag_place(costs: Sequence[float], dp: int) -> list[list[int]]:
    """Bins (by index) per DP rank in slot order; len(costs) must be a multiple of dp."""
    if len(costs) % dp:
        raise ValueError(f"{len(costs)} microbatches cannot be spread evenly over {dp} DP ranks")
    order = sorted(range(len(costs)), key=lambda b: (-costs[b], b))
    totals = [0.0] * dp
    placement: list[list[int]] = [[] for _ in range(dp)]
    for slot in range(len(costs) // dp):
        bucket = order[slot * dp:(slot + 1) * dp]  # heaviest first
        lightest_first = sorted(range(dp), key=lambda r: (totals[r], r))
        for rank, b in zip(lightest_first, bucket):
            placement[rank].append(b)
            totals[rank] += costs[b]
    refine_by_slot_swaps(placement, costs, totals)
    return placement


def refine_by_slot_swaps(placement: list[list[int]], costs: Sequence[float], totals: list[float],
                         max_rounds: int = 64) -> None:
    """Swap the bins of one slot between the heaviest and the lightest rank while that lowers the maximum.

    A swap inside a slot keeps the slot's set of bins, so slot balance is untouched; the heaviest bucket's spread,
    which the greedy deal cannot fully absorb, is evened out here. In place; deterministic (lowest slot wins ties).
    """
    dp = len(placement)
    for _ in range(max_rounds):
        heavy = max(range(dp), key=lambda r: (totals[r], -r))
        light = min(range(dp), key=lambda r: (totals[r], r))
        gap = totals[heavy] - totals[light]
        best_slot, best_delta = -1, 0.0
        for slot, (hb, lb) in enumerate(zip(placement[heavy], placement[light])):
            delta = costs[hb] - costs[lb]  # moves delta from heavy to light
            if 0 < delta < gap and abs(gap / 2 - delta) < abs(gap / 2 - best_delta):
                best_slot, best_delta = slot, delta
        if best_slot < 0:
            return
        hb, lb = placement[heavy][best_slot], placement[light][best_slot]
        placement[heavy][best_slot], placement[light][best_slot] = lb, hb
        totals[heavy] -= best_delta
        totals[light] += best_delta


def encoder_schedule(slots: Sequence[Sequence[int]], encoder_costs: np.ndarray, ids: Sequence[int],
                     num_encoders: int, has_images: np.ndarray) -> tuple[list[list[int]], list[float]]:
    """Sample ids per encoder rank, in encode order, and each rank's total encoder cost.

    `slots[s]` lists the sample positions the backbone consumes in slot s (all DP ranks). Samples without
    images (`has_images` false) are not listed: there is nothing to encode.
    """
    heap = [(0.0, r) for r in range(num_encoders)]
    order: list[list[int]] = [[] for _ in range(num_encoders)]
    for positions in slots:
        where = np.asarray(positions, dtype=np.int64)
        where = where[has_images[where]]
        # Heaviest first, ties by sample id (np.lexsort: last key is the primary one).
        ordered = where[np.lexsort((np.asarray([ids[p] for p in where.tolist()], dtype=np.int64),
                                    -encoder_costs[where]))] if where.size else where
        costs = encoder_costs[ordered].tolist()
        for p, cost in zip(ordered.tolist(), costs):
            load, rank = heapq.heappop(heap)
            order[rank].append(ids[p])
            heapq.heappush(heap, (load + cost, rank))
    loads = [0.0] * num_encoders
    for load, rank in heap:
        loads[rank] = load
    return order, loads


def round_robin_encoders(slots: Sequence[Sequence[int]], encoder_costs: np.ndarray, ids: Sequence[int],
                         num_encoders: int, has_images: np.ndarray) -> tuple[list[list[int]], list[float]]:
    """Baseline: samples with images dealt to encoder ranks in consumption order, ignoring cost."""
    order: list[list[int]] = [[] for _ in range(num_encoders)]
    loads = [0.0] * num_encoders
    k = 0
    for positions in slots:
        for p in positions:
            if has_images[p]:
                order[k % num_encoders].append(ids[p])
                loads[k % num_encoders] += float(encoder_costs[p])
                k += 1
    return order, loads
