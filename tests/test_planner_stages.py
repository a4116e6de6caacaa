"""Uneven pipeline splits: `stage_split` is exact against every layer split, and the plan and the tuned
coupled baseline use it (LM head on the last stage, a coupled ViT on the first)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from mindspeed_flow.planner.cost import stage_layer_list, stage_split


def _brute(layers: int, pp: int, ef: float, el: float) -> float:
    """Slowest stage over every split of `layers` into pp stages of >= 1 layer (extras on first / last)."""
    best = np.inf
    for cut in itertools.combinations(range(1, layers), pp - 1):
        sizes = np.diff((0,) + cut + (layers,))
        t = max(sizes[0] + ef, sizes[-1] + el, *(sizes[1:-1] if pp > 2 else [0]))
        best = min(best, t)
    return float(best)


def test_stage_split_is_exact_against_every_split() -> None:
    rng = np.random.default_rng(0)
    cases = 0
    for _ in range(300):
        layers = int(rng.integers(1, 15))
        pp = int(rng.integers(1, min(layers, 6) + 1))
        ef = float(rng.choice([0.0, rng.uniform(0, 1), rng.uniform(0, layers)]))
        el = float(rng.choice([0.0, rng.uniform(0, 2)]))
        out = stage_split(layers, np.array([pp]), np.array([ef]), np.array([el]), uneven=True)
        t = float(out["t"][0])
        want = layers + ef + el if pp == 1 else _brute(layers, pp, ef, el)
        assert t == pytest.approx(want, abs=1e-9), (layers, pp, ef, el)
        split = stage_layer_list(out, pp, 0)
        assert sum(split) == layers and min(split) >= 1 and len(split) == pp
        times = [n + (ef if s == 0 else 0) + (el if s == pp - 1 else 0) for s, n in enumerate(split)]
        if pp > 1:
            assert max(times) == pytest.approx(t, abs=1e-9)
        cases += 1
    assert cases == 300


def test_uniform_split_puts_the_head_on_the_last_stage() -> None:
    out = stage_split(80, np.array([10]), np.array([0.0]), np.array([3.0]), uneven=False)
    assert float(out["t"][0]) == 8 + 3  # an even split: the last stage pays for the head
    uneven = stage_split(80, np.array([10]), np.array([0.0]), np.array([3.0]), uneven=True)
    assert float(uneven["t"][0]) < 11 and stage_layer_list(uneven, 10, 0)[-1] < 8
