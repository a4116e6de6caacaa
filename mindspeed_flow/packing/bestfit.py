"""Best-fit-decreasing packing of sample lengths into bins of a token budget, a few integer operations per sample.

Samples are taken longest first (a counting-style stable sort: lengths are bounded by the budget) and each goes
into the open bin whose remaining capacity is the *smallest one that still fits it*. Finding that bin is a
query on a two-level bitset indexed by remaining capacity (0..B, `CapacityTree`): capacity v is "present" when at
least one open bin has exactly v free tokens, and the lowest set bit at or above the length is the smallest
present v >= length (the bitset's summary word skips empty words; its size is B / 4096 machine words, so a query
is a handful of integer operations at any practical budget). Bins sharing a capacity wait on a per-capacity
stack, so the bitset only changes when a capacity value appears or disappears.

When no open bin fits a length, none will fit the rest of that length's run either (bins only shrink), so the
run goes into fresh bins in bulk, `budget // length` per bin: this is exactly what the sequential algorithm
would do, without a tree query per sample.

`pack_into_bins` packs into a *given* number of bins (the step needs a multiple of the DP size): it looks for
the smallest capacity <= budget at which that many bins hold every sample, which spreads the tokens evenly
instead of leaving the extra bins empty. At each capacity it runs best fit, and when best fit opens a few bins
too many, `repair_to_count` tries to bring them back to the target count (see there): best fit alone loses up
to a whole bin per step to its greedy order, which on a step of a few dozen packs is several points of padding
once every pack is padded to the same length.

Determinism: ties in length keep the caller's order (stable sort) and every structure is a list or a dict
keyed by int, so the same input gives the same bins on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


PAIR_LIMIT = 16  # repair_to_count also moves pairs out of bins of at most this many samples
# repair_to_count gives up after this many exchanges in a row that clear no bin: longer runs rarely end in a fit
# (InfoVQA-like steps: 0.906% padding at 8, 0.864% unbounded, for 1.6x the planning time).
STALL_LIMIT = 8
CAPACITY_STEP = 1 / 1024  # pack_into_bins grows a failed capacity by at least this share (then doubles the step)
WORD_BITS = 6  # CapacityTree: capacities per bitset word = 2 ** WORD_BITS
WORD_MASK = (1 << WORD_BITS) - 1


class CapacityTree:
    """Which remaining capacities 0..budget some open bin has: a two-level bitset.

    Bit v of word v // 64 is set when capacity v is present, and bit w of `summary` when word w has a bit set. The
    smallest present capacity >= a length is the lowest set bit at or above it in its own word, else the lowest
    set bit of the first non-empty word above (found through `summary`): a few integer operations per query,
    insert or remove, where a segment tree walks log2(budget) levels in Python.
    """

    def __init__(self, budget: int) -> None:
        self.words = [0] * ((budget >> WORD_BITS) + 1)
        self.summary = 0

    def insert(self, capacity: int) -> None:
        word = capacity >> WORD_BITS
        self.words[word] |= 1 << (capacity & WORD_MASK)
        self.summary |= 1 << word

    def remove(self, capacity: int) -> None:
        word = capacity >> WORD_BITS
        self.words[word] &= ~(1 << (capacity & WORD_MASK))
        if not self.words[word]:
            self.summary &= ~(1 << word)

    @property
    def largest(self) -> int:
        """The largest present capacity, 0 when none."""
        if not self.summary:
            return 0
        word = self.summary.bit_length() - 1
        return (word << WORD_BITS) + self.words[word].bit_length() - 1

    def best_fit(self, length: int) -> int:
        """Smallest present capacity >= length, -1 when none."""
        word = length >> WORD_BITS
        bits = self.words[word] >> (length & WORD_MASK)
        if bits:
            return length + (bits & -bits).bit_length() - 1
        above = self.summary >> (word + 1)
        if not above:
            return -1
        word += (above & -above).bit_length()
        bits = self.words[word]
        return (word << WORD_BITS) + (bits & -bits).bit_length() - 1


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
    best_fit, insert, remove = tree.best_fit, tree.insert, tree.remove
    # remaining capacity -> open bins with exactly that capacity; a key and its bit live exactly as long as the
    # list is not empty (queries land on live capacities only).
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
        while i < end:
            capacity = best_fit(length)
            if capacity < 0:
                break  # no open bin fits: the rest of the run opens bins in bulk
            stack = holders[capacity]
            bin_id = stack.pop()
            if not stack:  # the capacity's last bin leaves it
                del holders[capacity]
                remove(capacity)
            bins[bin_id].append(order_list[i])
            loads[bin_id] += length
            hold(capacity - length, bin_id)
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
    """Every sample in at most `num_bins` bins, at the smallest capacity (<= budget) this search finds.

    The capacity starts at the lower bound max(longest, ceil(total / num_bins)) rounded up to `granularity` and
    grows by one granularity step (at least CAPACITY_STEP of the capacity) twice, then by doubling steps, until best
    fit, repaired if it opened too many bins, fits in `num_bins`. If even the full budget needs more bins, the
    full-budget best fit is returned (the caller rounds the bin count up). Fewer bins than asked are possible when
    there are few samples; the caller splits or pads.
    """
    lengths = check_lengths(lengths, budget)
    if num_bins < 1:
        raise ValueError(f"num_bins={num_bins}: must be >= 1")
    if lengths.size == 0:
        return Packing([], [], budget)
    granularity = max(1, int(granularity))
    total, longest = int(lengths.sum()), int(lengths.max())
    capacity = min(budget, _round_up(max(longest, math.ceil(total / num_bins)), granularity))
    step = _round_up(max(1, int(capacity * CAPACITY_STEP)), granularity)
    for attempt in range(64):
        packing = best_fit_pack(lengths, capacity)
        if len(packing.bins) > num_bins:
            repaired = repair_to_count(lengths, packing.bins, capacity, num_bins)
            if repaired is not None:
                packing = repaired
        if len(packing.bins) <= num_bins or capacity >= budget:
            packing.capacity = capacity
            return packing
        capacity = min(budget, _round_up(capacity + step, granularity))
        if attempt >= 1:
            step *= 2
    raise AssertionError("unreachable: the capacity reaches the budget within 64 doublings")


def repair_to_count(lengths: np.ndarray, bins: list[list[int]], capacity: int, count: int,
                    max_moves: int = 0) -> Packing | None:
    """Best fit's `bins` brought down to `count` bins of `capacity`, or None when the repair gets stuck.

    The lightest surplus bins are emptied and their samples, longest first, go to the bins with the most room,
    even past the capacity. Then, while a bin is over, its excess is pushed out by the one exchange that fits:
    a sample (or two) moved to the roomiest bin, or swapped with a shorter sample of another bin so that neither
    ends over the capacity (the exchange that leaves the receiving bin tightest is taken, which keeps large gaps for later
    ones). When no exchange clears the excess, the one that lowers it most is taken; total excess strictly falls
    at every exchange, so the loop ends. Each round is one vectorised pass over the step's samples; it gives up
    after STALL_LIMIT rounds in a row that clear no bin, or `max_moves` rounds in all (default 2 per sample of the
    emptied bins, plus 64). Deterministic: ties go to the lowest position.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n, have = int(lengths.size), len(bins)
    if have <= count:
        return Packing([list(b) for b in bins], [int(lengths[b].sum()) for b in bins], capacity)
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=have)
    owner = np.repeat(np.arange(have), sizes)
    bin_of = np.empty(n, dtype=np.int64)
    bin_of[np.fromiter((i for b in bins for i in b), dtype=np.int64, count=n)] = owner
    loads = np.bincount(bin_of, weights=lengths, minlength=have).astype(np.int64)
    kept = np.ones(have, dtype=bool)
    kept[np.argsort(loads, kind="stable")[:have - count]] = False
    new_index = np.cumsum(kept) - 1
    emptied = np.flatnonzero(~kept[bin_of])
    bin_of = np.where(kept[bin_of], new_index[bin_of], -1)
    loads = loads[kept]
    for i in emptied[np.argsort(-lengths[emptied], kind="stable")].tolist():
        b = int(np.argmin(loads))  # the most room; overflow is fixed below
        bin_of[i] = b
        loads[b] += lengths[i]
    never = np.iinfo(np.int64).max
    # Columns of the exchange matrix: sample k < n (take it back in exchange), or n (take nothing back).
    column_len = np.append(lengths, 0)
    stalled = 0  # exchanges in a row that cleared no bin
    for _ in range(max_moves or 2 * int(emptied.size) + 64):
        over = np.flatnonzero(loads > capacity)
        if not over.size:
            return _packing_of(bin_of, lengths, loads, count, capacity)
        heavy = int(over[np.argmax(loads[over])])
        excess = int(loads[heavy]) - capacity
        room = capacity - loads
        room[heavy] = -capacity  # the heavy bin takes nothing from itself
        roomiest = int(np.argmax(room))
        mine = np.flatnonzero(bin_of == heavy)
        column_room = np.append(room[bin_of], room[roomiest])  # room of the bin each column's sample sits in
        # A row giving more than every column's length + room fits nowhere: dropped before the matrix is built
        # (on InfoVQA-like steps most pairs are, which keeps the matrix to the single samples).
        reach = int((column_len + column_room).max())
        # Rows: what the heavy bin gives, one of its samples or, when no single one clears the excess (and the bin
        # has at most PAIR_LIMIT samples), also two of them: a bin of two or three near-budget samples needs that
        # (no single swap clears 45+45 | 35+35+20+20 at 100).
        first, second = mine, np.full(mine.size, -1)
        for with_pairs in (False, True):
            if with_pairs:
                if not 2 <= mine.size <= PAIR_LIMIT:
                    break
                a, b = np.triu_indices(mine.size, 1)
                first, second = np.concatenate((mine, mine[a])), np.concatenate((np.full(mine.size, -1), mine[b]))
            give = lengths[first] + np.where(second >= 0, lengths[second], 0)
            useful = give <= reach
            if not useful.any():
                fits = clears = np.zeros((0, 0), dtype=bool)
                continue
            first, second, give = first[useful], second[useful], give[useful]
            # Only columns some row can use (shorter than what it gives, with room for the difference): the
            # matrix shrinks from rows x samples to rows x a few candidates.
            cols = np.flatnonzero((column_len < give.max()) & (column_len + column_room >= give.min()))
            delta = give[:, None] - column_len[cols][None, :]  # tokens that leave the heavy bin
            fits = (delta > 0) & (delta <= column_room[cols][None, :])
            clears = fits & (delta >= excess)
            if clears.any():
                break
        if not fits.any():
            return None
        stalled = 0 if clears.any() else stalled + 1
        if stalled > STALL_LIMIT:
            return None
        score = (np.where(clears, column_room[cols][None, :] - delta, never) if clears.any()
                 else np.where(fits, -delta, never))
        row, k = divmod(int(np.argmin(score)), delta.shape[1])
        col, moved = int(cols[k]), int(delta[row, k])
        target = roomiest if col == n else int(bin_of[col])
        if col < n:
            bin_of[col] = heavy
        bin_of[first[row]] = target
        if second[row] >= 0:
            bin_of[second[row]] = target
        loads[heavy] -= moved
        loads[target] += moved
    return None


def _packing_of(bin_of: np.ndarray, lengths: np.ndarray, loads: np.ndarray, count: int, capacity: int) -> Packing:
    """Bins as index lists (ascending positions) from a bin-per-sample array."""
    order = np.argsort(bin_of, kind="stable")
    cuts = np.cumsum(np.bincount(bin_of, minlength=count))[:-1]
    return Packing([part.tolist() for part in np.split(order, cuts)], loads.tolist(), capacity)


def _round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple
