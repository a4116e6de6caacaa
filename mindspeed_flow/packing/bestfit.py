"""Best-fit-decreasing packing of sample lengths into bins of a token budget, in O(N log B).

Samples are taken longest first (a counting-style stable sort: lengths are bounded by the budget) and each goes
into the open bin whose remaining capacity is the *smallest one that still fits it*. Finding that bin is a
query on a max segment tree indexed by remaining capacity (0..B): leaf v is "present" when at least one open
bin has exactly v free tokens, and a left-first descent finds the smallest present v >= length in O(log B).
Bins sharing a capacity wait on a per-capacity stack, so the tree only changes when a capacity value appears
or disappears (and a vanished capacity is removed lazily, when a query first lands on it).

When no open bin fits a length, none will fit the rest of that length's run either (bins only shrink), so the
run goes into fresh bins in bulk, `budget // length` per bin: this is exactly what the sequential algorithm
would do, without a tree query per sample.

`pack_into_bins` packs into a *given* number of bins (the step needs a multiple of the DP size): it runs best
fit with the smallest capacity <= budget that needs no more bins, which spreads the tokens evenly instead of
leaving the extra bins empty.

Determinism: ties in length keep the caller's order (stable sort) and every structure is a list or a dict
keyed by int, so the same input gives the same bins on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


FIRST_SLACK = 0.006  # first capacity tried by pack_into_bins, above the lower bound total / bins
SLACK_STEP = 0.003  # then grow by this fraction, doubling the step each time


class CapacityTree:
    """Max segment tree over capacity values 0..budget: which remaining capacities some open bin has."""

    def __init__(self, budget: int) -> None:
        size = 1
        while size < budget + 1:
            size *= 2
        self.size = size
        # tree[node] = the largest present capacity in the node's range, 0 when none (a full bin is never useful).
        self.tree = [0] * (2 * size)

    def insert(self, capacity: int) -> None:
        tree = self.tree
        node = capacity + self.size
        tree[node] = capacity
        node >>= 1
        while node and tree[node] < capacity:  # parents only ever grow on insert; stop once one already covers it
            tree[node] = capacity
            node >>= 1

    def remove(self, capacity: int) -> None:
        tree = self.tree
        node = capacity + self.size
        tree[node] = 0
        best = 0
        while node > 1:  # recompute parents from the sibling until one is unchanged
            sibling = tree[node ^ 1]
            if sibling > best:
                best = sibling
            node >>= 1
            if tree[node] == best:
                break
            tree[node] = best

    @property
    def largest(self) -> int:
        return self.tree[1]

    def best_fit(self, length: int) -> int:
        """Smallest present capacity >= length (the caller checks `largest >= length` first)."""
        tree, size, node = self.tree, self.size, 1
        while node < size:
            node <<= 1
            if tree[node] < length:
                node += 1
        return node - size


@dataclass
class Packing:
    """Bins as lists of indices into the input lengths (in placement order) and their token loads."""

    bins: list[list[int]]
    loads: list[int]
    capacity: int  # the per-bin capacity that was used (<= the budget)


def check_lengths(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Integer lengths in [1, budget]; the message names the first bad index and the rule."""
    if budget < 1:
        raise ValueError(f"token budget {budget}: must be >= 1")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {lengths.shape}")
    lengths = lengths.astype(np.int64, copy=False)
    if lengths.size:
        bad = np.flatnonzero(lengths < 1)
        if bad.size:
            raise ValueError(f"length[{int(bad[0])}]={int(lengths[bad[0]])}: every length must be >= 1")
        bad = np.flatnonzero(lengths > budget)
        if bad.size:
            raise ValueError(f"length[{int(bad[0])}]={int(lengths[bad[0]])} exceeds the token budget {budget}")
    return lengths


def decreasing_order(lengths: np.ndarray) -> np.ndarray:
    """Indices by length, longest first; equal lengths keep input order (stable)."""
    return np.argsort(-lengths, kind="stable")


def best_fit_pack(lengths: np.ndarray, budget: int) -> Packing:
    """Best-fit decreasing into as many bins of `budget` tokens as needed."""
    lengths = check_lengths(lengths, budget)
    order = decreasing_order(lengths)
    sorted_lengths = lengths[order]
    order_list = order.tolist()
    # Runs of equal length: [starts[k], starts[k+1]) all have length run_lengths[k].
    starts = (np.flatnonzero(np.r_[True, sorted_lengths[1:] != sorted_lengths[:-1]]) if lengths.size
              else np.zeros(0, dtype=np.int64))
    run_lengths = sorted_lengths[starts].tolist()
    bounds = starts.tolist() + [int(lengths.size)]

    tree = CapacityTree(budget)
    nodes, size, insert, remove = tree.tree, tree.size, tree.insert, tree.remove
    # remaining capacity -> open bins with exactly that capacity. A key stays (possibly with an empty list) as
    # long as its leaf is present in the tree: a capacity whose last bin left is removed lazily, only if a query
    # lands on it. Most such capacities are below every length still to come and are never touched again.
    holders: dict[int, list[int]] = {}
    bins: list[list[int]] = []
    loads: list[int] = []

    def hold(capacity: int, bin_id: int) -> None:
        if capacity <= 0:
            return
        stack = holders.get(capacity)
        if stack is None:
            holders[capacity] = [bin_id]
            insert(capacity)
        else:
            stack.append(bin_id)

    for run, length in enumerate(run_lengths):
        i, end = bounds[run], bounds[run + 1]
        while i < end and nodes[1] >= length:
            node = 1  # inlined CapacityTree.best_fit: this loop is the packer's hot path
            while node < size:
                node <<= 1
                if nodes[node] < length:
                    node += 1
            capacity = node - size
            stack = holders[capacity]
            if not stack:  # stale capacity: drop it now and ask again
                del holders[capacity]
                remove(capacity)
                continue
            bin_id = stack.pop()
            bins[bin_id].append(order_list[i])
            loads[bin_id] += length
            capacity -= length
            if capacity:  # inlined hold() and CapacityTree.insert()
                stack = holders.get(capacity)
                if stack is None:
                    holders[capacity] = [bin_id]
                    node = capacity + size
                    nodes[node] = capacity
                    node >>= 1
                    while node and nodes[node] < capacity:
                        nodes[node] = capacity
                        node >>= 1
                else:
                    stack.append(bin_id)
            i += 1
        if i < end:
            _open_bins_in_bulk(order_list[i:end], length, budget, bins, loads, hold)
    return Packing(bins, loads, budget)


def _open_bins_in_bulk(items: list[int], length: int, budget: int, bins: list[list[int]], loads: list[int],
                       hold) -> None:
    """No open bin fits `length`: fill fresh bins with `budget // length` samples each, in order."""
    per_bin = budget // length
    for start in range(0, len(items), per_bin):
        chunk = items[start:start + per_bin]
        bins.append(chunk)
        loads.append(len(chunk) * length)
        hold(budget - len(chunk) * length, len(bins) - 1)


def pack_into_bins(lengths: np.ndarray, budget: int, num_bins: int, granularity: int = 1) -> Packing:
    """Best fit into at most `num_bins` bins with the smallest capacity (<= budget) that allows it.

    The capacity starts just above the lower bound max(longest, ceil(total / num_bins)) (by FIRST_SLACK) and grows
    geometrically (rounded to `granularity`) until best fit needs no more than `num_bins` bins; best fit is
    near-optimal for many small items, so this usually takes one or two passes. If even the full budget needs more bins, the full-budget
    packing is returned (the caller rounds the bin count up). Fewer bins than asked are possible when there are
    few samples; the caller splits or pads.
    """
    lengths = check_lengths(lengths, budget)
    if num_bins < 1:
        raise ValueError(f"num_bins={num_bins}: must be >= 1")
    if lengths.size == 0:
        return Packing([], [], budget)
    granularity = max(1, int(granularity))
    total, longest = int(lengths.sum()), int(lengths.max())
    lower = max(longest, math.ceil(total / num_bins))
    # Best fit usually needs 0.5-1% above the lower bound on InfoVQA-like steps: start a little above it.
    capacity = _round_up(min(budget, max(longest, int(lower * (1 + FIRST_SLACK)))), granularity)
    step = max(granularity, _round_up(max(1, int(capacity * SLACK_STEP)), granularity))
    while capacity < budget:
        packing = best_fit_pack(lengths, capacity)
        if len(packing.bins) <= num_bins:
            packing.capacity = capacity
            return packing
        capacity = min(budget, _round_up(capacity + step, granularity))
        step *= 2
    return best_fit_pack(lengths, budget)


def _round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple
