"""`mindspeed-flow bench checkpoint` runs both modes through the real launcher and reports blocked time per save,
bytes and restore time (figures only: no timing assertions, the ratio is read from the printed table)."""
from __future__ import annotations

import json

from mindspeed_flow import cli


def test_bench_checkpoint_reports_both_modes(capfd) -> None:
    assert cli.main(["bench", "checkpoint", "--steps", "4", "--every", "2", "--json",
                     "experiment=parity_dp2"]) == 0
    out = capfd.readouterr().out
    report = json.loads(out[out.index('{\n  "results"'):])
    for mode in ("sync", "async"):
        r = report["results"][mode]
        assert r["saves"] == 2 and r["checkpoint_mb"] > 0
        assert r["median_blocked_s"] > 0 and r["restore_s"] > 0 and r["verify_s"] > 0
    assert report["sync_over_async_blocked"] > 0
