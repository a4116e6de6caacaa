"""TRL's bfd packing side by side with best_fit_pack on the same lengths (TRL is an optional dev extra)."""
from __future__ import annotations

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
