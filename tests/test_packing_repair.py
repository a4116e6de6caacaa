"""The best-fit repair (`repair_to_count`), the capacity search that uses it, and the bench's padding floor."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from mindspeed_flow.bench.packing import bins_lower_bound, padding_floor
from mindspeed_flow.packing import CostModel, best_fit_pack, pack_into_bins, plan_step
from mindspeed_flow.packing.bestfit import repair_to_count
from mindspeed_flow.packing.workloads import infovqa_arrays, near_budget_lengths, near_budget_shapes


def assert_valid(packing, lengths: np.ndarray, capacity: int, count: int) -> None:
    """Every sample exactly once, no bin over the capacity, at most `count` bins, loads that add up."""
    assert len(packing.bins) <= count
    assert sorted(i for b in packing.bins for i in b) == list(range(len(lengths)))
    assert packing.loads == [int(lengths[b].sum()) for b in packing.bins]
    assert max(packing.loads) <= capacity


def test_repair_finds_the_packing_best_fit_misses() -> None:
    # Best fit: 45+45 | 35+35+20 | 20 (3 bins); two bins of 100 exist: 45+35+20 twice. No single swap gets
    # there from the overflowing bin, two samples out for one in does.
    lengths = np.array([45, 45, 35, 35, 20, 20])
    bfd = best_fit_pack(lengths, 100)
    assert len(bfd.bins) == 3
    repaired = repair_to_count(lengths, bfd.bins, 100, 2)
    assert repaired is not None
    assert_valid(repaired, lengths, 100, 2)
    assert repaired.loads == [100, 100]
    assert [list(b) for b in bfd.bins] == [[0, 1], [2, 3, 4], [5]]  # the input is left as it was


def test_repair_gives_up_when_the_count_cannot_hold_the_samples() -> None:
    lengths = np.array([60, 60, 60])  # no two share a bin of 100
    assert repair_to_count(lengths, best_fit_pack(lengths, 100).bins, 100, 2) is None
    lengths = np.array([50, 50, 50, 50, 1])  # 201 tokens in two bins of 100
    assert repair_to_count(lengths, best_fit_pack(lengths, 100).bins, 100, 2) is None


def test_repair_keeps_the_invariants_and_is_deterministic() -> None:
    """InfoVQA-like draws at the tight capacities pack_into_bins tries (the even share, rounded to 128)."""
    rng = np.random.default_rng(11)
    tried = succeeded = 0
    for trial in range(12):
        lengths = np.minimum(infovqa_arrays(int(rng.integers(40, 400)), seed=trial).llm_tokens, 16384)
        count = max(4, -(-math.ceil(lengths.sum() / 16384) // 4) * 4)
        start = max(int(lengths.max()), -(-math.ceil(lengths.sum() / count) // 128) * 128)
        for capacity in range(min(start, 16384), min(16384, start + 640) + 1, 128):
            bins = best_fit_pack(lengths, capacity).bins
            if len(bins) <= count:
                continue
            tried += 1
            repaired = repair_to_count(lengths, bins, capacity, count)
            if repaired is None:
                continue
            succeeded += 1
            assert_valid(repaired, lengths, capacity, count)
            again = repair_to_count(lengths, bins, capacity, count)
            assert again is not None and again.bins == repaired.bins
    assert tried and succeeded  # the repair saves bins on some of these draws, not only on the hand-made case


def test_repair_saves_a_near_budget_step() -> None:
    """A bench step (near_budget, seed 1234, step 9) where best fit needs 473 packs and the step 472 (59 x 8)."""
    lengths = near_budget_lengths(20480, 16384, seed=1234)[9 * 1024:10 * 1024]
    bins = best_fit_pack(lengths, 16384).bins
    assert len(bins) == 473
    repaired = repair_to_count(lengths, bins, 16384, 472)
    assert repaired is not None
    assert_valid(repaired, lengths, 16384, 472)


def test_pack_into_bins_reaches_the_lower_bound_capacity_through_the_repair() -> None:
    lengths = np.array([45, 45, 35, 35, 20, 20])
    packing = pack_into_bins(lengths, 200, 2, granularity=1)
    assert packing.capacity == 100  # the lower bound total / bins; best fit alone needs 3 bins there
    assert_valid(packing, lengths, 100, 2)


def brute_force_bins(lengths: list[int], capacity: int) -> int:
    """Fewest bins, by trying every assignment (tiny inputs only)."""
    best = len(lengths)
    for assignment in itertools.product(range(len(lengths)), repeat=len(lengths)):
        loads: dict[int, int] = {}
        for length, b in zip(lengths, assignment):
            loads[b] = loads.get(b, 0) + length
        if max(loads.values()) <= capacity:
            best = min(best, len(loads))
    return best


def test_bins_lower_bound_is_a_lower_bound_and_beats_the_token_count() -> None:
    rng = np.random.default_rng(3)
    for _ in range(25):
        lengths = rng.integers(1, 101, int(rng.integers(1, 7)))
        bound = bins_lower_bound(lengths, 100)
        assert math.ceil(lengths.sum() / 100) <= bound <= brute_force_bins(lengths.tolist(), 100), lengths
    assert bins_lower_bound(np.array([60, 60, 60]), 100) == 3  # 180 tokens, but no two share a bin
    assert bins_lower_bound(np.array([30] * 7), 100) == 3  # 210 tokens, and three samples per bin at most
    lengths = near_budget_lengths(1024, 16384, seed=2)
    assert math.ceil(lengths.sum() / 16384) < bins_lower_bound(lengths, 16384) <= len(best_fit_pack(lengths, 16384).bins)


@pytest.mark.parametrize("workload", ["infovqa", "near_budget"])
def test_padding_floor_is_below_every_scheduler(workload: str) -> None:
    """The floor is a lower bound for any plan under the step constraints: no scheduler may beat it."""
    budget, dp, pp, pad_multiple = 16384, 4, 2, 128
    cost = CostModel()
    for seed in range(3):
        shapes = (infovqa_arrays(256, seed=seed).shapes() if workload == "infovqa"
                  else near_budget_shapes(256, budget, seed=seed))
        lengths = np.array([s.llm_tokens for s in shapes])
        floor = padding_floor([lengths], budget, dp, pp, pad_multiple)
        for scheduler in ("flow", "sorted", "first_fit", "naive"):
            plan = plan_step(shapes, dp=dp, num_encoders=2, token_budget=budget, cost_model=cost,
                             scheduler=scheduler, min_microbatches=pp, pad_multiple=pad_multiple)
            plan.check(shapes)
            assert plan.padded_tokens == plan.dp * plan.num_slots * plan.seq_len  # what the engine pads
            assert max(mb.tokens for rank in plan.microbatches for mb in rank) <= plan.seq_len
            assert plan.padding_fraction >= floor - 1e-12, (scheduler, plan.padding_fraction, floor)


def test_flow_takes_more_packs_when_the_least_count_only_fits_at_the_budget() -> None:
    """8,192 InfoVQA-like samples: the least pack count (a multiple of 8) needs the full 16,384 tokens per pack;
    dp more packs fit at a shorter per-step length and pad fewer tokens in all. Flow must find that plan, and it
    must still be a valid plan that pads exactly what the engine pads."""
    budget, dp, pp, pad_multiple = 16384, 8, 4, 128
    shapes = infovqa_arrays(8192, seed=1234).shapes()
    lengths = np.array([s.llm_tokens for s in shapes])
    least = -(-max(math.ceil(lengths.sum() / budget), dp * pp) // dp) * dp
    packing = pack_into_bins(lengths, budget, least, granularity=pad_multiple)
    least_count = -(-max(len(packing.bins), least) // dp) * dp
    least_padded = least_count * min(budget, -(-max(packing.loads) // pad_multiple) * pad_multiple)
    assert least_padded == least_count * budget  # the situation this path is for
    plan = plan_step(shapes, dp=dp, num_encoders=4, token_budget=budget, cost_model=CostModel(),
                     min_microbatches=pp, pad_multiple=pad_multiple)
    plan.check(shapes)
    assert plan.dp * plan.num_slots > least_count and plan.seq_len < budget
    assert plan.padded_tokens == plan.dp * plan.num_slots * plan.seq_len < least_padded
    assert plan.padding_fraction >= padding_floor([lengths], budget, dp, pp, pad_multiple)
