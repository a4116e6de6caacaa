"""`mindspeed-flow bench overlap` end to end on a tiny shape: every variant is timed and reported as JSON."""
from __future__ import annotations

import json

import pytest

from mindspeed_flow.bench import overlap


def test_bench_overlap_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = overlap.main(["--world", "2", "--m", "64", "--k", "32", "--n", "32", "--chunks", "1,2", "--iters", "2",
                       "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    labels = [(r["kind"], r["impl"]) for r in result["rows"]]
    assert labels == [(k, i) for k in ("column", "row") for i in ("plain", "chunked x1", "chunked x2")]
    assert all(r["median_s"] > 0 for r in result["rows"])
    assert all(r["plain_over_this"] == 1.0 for r in result["rows"] if r["impl"] == "plain")
    assert "no speedup is expected" in result["note"]


def test_bench_overlap_rejects_indivisible_shape() -> None:
    with pytest.raises(SystemExit):
        overlap.parse_args(["--world", "4", "--m", "6"])
