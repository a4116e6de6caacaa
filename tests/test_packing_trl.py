"""TRL's bfd packing side by side with best_fit_pack on the same lengths (TRL is an optional dev extra)."""
from __future__ import annotations

import numpy as np
import pytest

from mindspeed_flow.bench import packing as bench
from mindspeed_flow.packing.workloads import near_budget_lengths


@pytest.mark.slow  # importing TRL pulls transformers and torch: 10-25 s on the CI machine
@pytest.mark.parametrize("workload", ["infovqa", "near_budget"])
def test_trl_side_by_side(workload: str) -> None:
    pytest.importorskip("trl")
    lengths = (bench.infovqa_arrays(2000, seed=3).llm_tokens if workload == "infovqa"
               else near_budget_lengths(2000, 16384, seed=3))
    out = bench.trl_compare(lengths, 16384)
    ours, trl = out["flow_best_fit"], out["trl_pack_dataset"]
    assert trl["tokens_kept"] == int(lengths.sum())  # no truncation: every length is within the budget
    assert ours["fill"] >= trl["fill"] - 1e-12 and ours["bins"] <= trl["bins"]


@pytest.mark.slow  # imports TRL, as above
def test_trl_under_the_step_constraints_is_above_the_floor() -> None:
    """TRL's bfd placed as the runtime must (per step, packs rounded up to DP, one length per step) is a plan under
    the step constraints, so its padding cannot fall below the floor."""
    pytest.importorskip("trl")
    steps = [near_budget_lengths(256, 16384, seed=s) for s in range(3)]
    for pad_multiple in (0, 128):
        constrained = bench.trl_same_constraints(steps, 16384, 4, 2, pad_multiple)
        assert constrained >= bench.padding_floor(steps, 16384, 4, 2, pad_multiple) - 1e-12
    loads, _ = bench.trl_pack_loads(np.concatenate(steps), 16384)
    assert sum(loads) == int(sum(s.sum() for s in steps)) and max(loads) <= 16384
