"""TRL's bfd packing side by side with best_fit_pack on the same lengths (TRL is an optional dev extra)."""
from __future__ import annotations

import pytest

from mindspeed_flow.bench import packing as bench


@pytest.mark.slow  # importing TRL pulls transformers and torch: 10-25 s on the CI machine
def test_trl_side_by_side() -> None:
    pytest.importorskip("trl")
    lengths = bench.infovqa_arrays(2000, seed=3).llm_tokens
    out = bench.trl_compare(lengths, 16384)
    ours, trl = out["flow_best_fit"], out["trl_pack_dataset"]
    assert trl["tokens_kept"] == int(lengths.sum())  # no truncation: every length is within the budget
    assert ours["fill"] >= trl["fill"] - 1e-12 and ours["bins"] <= trl["bins"]
