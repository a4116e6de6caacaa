"""Packing building blocks: cost model against the spec formulas, capacity bitset, best fit, placement."""
from __future__ import annotations

import numpy as np
import pytest

from mindspeed_flow.config.packing import PackingConfig
from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.packing import (
    CapacityTree, CostModel, best_fit_pack, encoder_schedule, pack_into_bins, split_to_count, zigzag_place,
)
from mindspeed_flow.specs import VLMSpec


def spec(family: str, preset: str) -> VLMSpec:
    return VLMSpec.from_hf_config(hf_config_dict(family, preset))


# ---- cost model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("frozen", [False, True])
def test_cost_model_matches_spec_flops(family: str, frozen: bool) -> None:
    s = spec(family, "7b")
    cm = CostModel.from_spec(s, frozen_encoder=frozen)
    for tokens in (1, 300, 4096, 16384):
        assert cm.sample_cost(tokens) == pytest.approx(s.llm.sample_flops(tokens), rel=1e-12)
    for patches in (4, 64, 1000, 5120, 20000):  # below and above the Qwen2.5-VL window
        assert cm.image_cost(patches) == pytest.approx(s.vision.image_flops(patches, trainable=not frozen), rel=1e-12)


def test_frozen_encoder_costs_one_third() -> None:
    s = spec("qwen2_vl", "7b")
    shape = SampleShape(0, 50, ((1, 80, 40), (1, 20, 20)))
    trainable = CostModel.from_spec(s).encoder_cost(shape)
    frozen = CostModel.from_spec(s, frozen_encoder=True).encoder_cost(shape)
    assert frozen == pytest.approx(trainable / 3, rel=1e-12)
    assert CostModel.from_spec(s).encoder_cost(SampleShape(1, 50)) == 0.0


def test_windowed_encoder_is_closer_to_linear() -> None:
    full, windowed = CostModel.from_spec(spec("qwen2_vl", "7b")), CostModel.from_spec(spec("qwen2_5_vl", "7b"))
    ratio = lambda cm: cm.image_cost(20000) / (10 * cm.image_cost(2000))  # noqa: E731
    assert ratio(full) > ratio(windowed) > 1.0


def test_profiled_coefficients_override_as_pairs() -> None:
    s = spec("qwen2_vl", "7b")
    cm = CostModel.from_config(PackingConfig(linear_coeff=2.0), s)
    assert (cm.linear, cm.quadratic) == (2.0, 0.0)  # both taken from the recipe, not mixed with FLOPs
    assert cm.enc_linear == CostModel.from_spec(s).enc_linear
    cfg = PackingConfig(encoder_linear_coeff=1.0, encoder_quadratic_coeff=0.5)
    assert CostModel.from_config(cfg, s).image_cost(10) == pytest.approx(10 + 50)
    assert CostModel.from_config(PackingConfig(), s) == CostModel.from_spec(s)
    with pytest.raises(ValueError, match="linear"):
        CostModel(linear=-1.0)


# ---- capacity bitset and best fit ----------------------------------------------------------------------------
def test_capacity_tree_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    budget, present = 1000, set()
    tree = CapacityTree(budget)
    for _ in range(3000):
        v = int(rng.integers(1, budget + 1))
        if v in present:
            tree.remove(v)
            present.discard(v)
        else:
            tree.insert(v)
            present.add(v)
        length = int(rng.integers(1, budget + 1))
        fits = [c for c in present if c >= length]
        assert tree.largest == max(present, default=0)
        assert tree.best_fit(length) == (min(fits) if fits else -1)


def reference_bfd(lengths: list[int], budget: int) -> list[int]:
    """Textbook best fit decreasing, O(N x bins): loads of the bins."""
    loads: list[int] = []
    for length in sorted(lengths, reverse=True):
        fits = [b for b, load in enumerate(loads) if load + length <= budget]
        if fits:
            b = min(fits, key=lambda b: (budget - loads[b], b))
            loads[b] += length
        else:
            loads.append(length)
    return loads


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_equals_textbook_bfd(seed: int) -> None:
    rng = np.random.default_rng(seed)
    budget = int(rng.integers(50, 500))
    lengths = rng.integers(1, budget + 1, int(rng.integers(1, 400)))
    packing = best_fit_pack(lengths, budget)
    assert sorted(packing.loads) == sorted(reference_bfd(lengths.tolist(), budget))
    assert sorted(i for b in packing.bins for i in b) == list(range(len(lengths)))  # each exactly once
    assert all(int(lengths[b].sum()) == load <= budget for b, load in zip(packing.bins, packing.loads))


@pytest.mark.parametrize("budget", [63, 64, 65, 4095, 4096, 16385])
def test_best_fit_equals_textbook_bfd_across_bitset_words(budget: int) -> None:
    # Budgets at and around the bitset's word sizes (64 capacities a word, 64 words a summary word); lengths from
    # a few distinct values, so bins share capacities and queries cross empty words.
    rng = np.random.default_rng(budget)
    lengths = rng.choice(rng.integers(1, budget + 1, 7), 300)
    packing = best_fit_pack(lengths, budget)
    assert sorted(packing.loads) == sorted(reference_bfd(lengths.tolist(), budget))
    assert sorted(i for b in packing.bins for i in b) == list(range(len(lengths)))


def test_best_fit_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match=r"length\[1\]=0"):
        best_fit_pack(np.array([3, 0, 2]), 10)
    with pytest.raises(ValueError, match=r"length\[0\]=-4"):
        best_fit_pack(np.array([-4]), 10)
    with pytest.raises(ValueError, match=r"length\[2\]=11 exceeds the token budget 10"):
        best_fit_pack(np.array([3, 4, 11]), 10)


def test_pack_into_bins_spreads_tokens() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(200, 1400, 1000)
    natural = len(best_fit_pack(lengths, 16384).bins)
    target = natural + 7
    packing = pack_into_bins(lengths, 16384, target, granularity=1)
    assert len(packing.bins) <= target
    assert max(packing.loads) <= packing.capacity < 16384
    assert max(packing.loads) < 1.02 * lengths.sum() / target  # tight: within 2% of the even share
    assert sorted(i for b in packing.bins for i in b) == list(range(len(lengths)))


def test_split_to_count_halves_then_pads() -> None:
    lengths = np.array([5, 5, 4, 1])
    bins = split_to_count([[0, 1, 2, 3]], lengths, 3)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3]
    assert len(bins) == 3 and all(bins)
    bins = split_to_count([[0], [1]], lengths, 4)
    assert bins[2:] == [[], []]


# ---- placement ------------------------------------------------------------------------------------------------
def test_zigzag_balances_ranks_and_slots() -> None:
    rng = np.random.default_rng(2)
    costs = rng.lognormal(0, 0.2, 64).tolist()
    placement = zigzag_place(costs, 8)
    assert sorted(b for rank in placement for b in rank) == list(range(64))
    assert {len(rank) for rank in placement} == {8}
    totals = [sum(costs[b] for b in rank) for rank in placement]
    naive_totals = [sum(costs[r::8]) for r in range(8)]
    assert max(totals) / np.mean(totals) < 1.01 < 1.03 < max(naive_totals) / np.mean(naive_totals)
    for slot in range(8):  # a slot holds 8 neighbours in cost order
        in_slot = sorted(costs[rank[slot]] for rank in placement)
        assert in_slot == sorted(costs)[::-1][slot * 8:(slot + 1) * 8][::-1]
    with pytest.raises(ValueError, match="cannot be spread evenly"):
        zigzag_place([1.0] * 5, 2)


def test_encoder_order_follows_slots_and_balances() -> None:
    rng = np.random.default_rng(3)
    enc = rng.uniform(1, 10, 40)
    enc[5] = 0.0  # text-only: nothing to encode
    ids = list(range(100, 140))
    slots = [list(range(s * 10, (s + 1) * 10)) for s in range(4)]
    order, loads = encoder_schedule(slots, enc, ids, 3, enc > 0)
    assert sorted(sid for o in order for sid in o) == [i for i in ids if i != 105]
    slot_of = {ids[p]: s for s, positions in enumerate(slots) for p in positions}
    for o in order:  # consumption order: slot never decreases along an encoder's list
        assert [slot_of[sid] for sid in o] == sorted(slot_of[sid] for sid in o)
    assert max(loads) / np.mean(loads) < 1.1
    assert loads == pytest.approx([sum(enc[ids.index(sid)] for sid in o) for o in order])
