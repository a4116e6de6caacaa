"""`mindspeed-flow bench msmm` reads what the flow job prints (its per-rank exit lines and `[flow]` lines)."""
from __future__ import annotations

import argparse

from mindspeed_flow.bench.msmm import _summary, table

OUTPUT = """
 [flow] iteration 1 | encoder busy 0.1 s wait 0.2 s | padding 4.0% | microbatches 2 | encoder held 3 groups 3000000 bytes (peak, encoder dp0, bound 1024)
 [flow] iteration 2 | encoder busy 0.1 s wait 0.2 s | padding 6.0% | microbatches 2 | encoder held 4 groups 5000000 bytes (peak, encoder dp0, bound 1024)
[mindspeed-flow] rank 0 (encoder dp0) read 64 samples, 2097152 bytes of pixels; peak host memory 900 MiB
[mindspeed-flow] rank 2 (decoder dp1) read 64 samples, 2097152 bytes of pixels; peak host memory 800 MiB
"""


def test_summary_reads_padding_held_activations_and_rank_lines() -> None:
    s = _summary(OUTPUT, [900.0, 100.0, 120.0])
    assert s["padding_pct"] == 5.0 and s["iteration_ms"] == 110.0
    assert (s["encoder_held_groups"], s["encoder_held_bytes"]) == (4, 5000000)
    assert s["ranks"] == {0: {"part": "encoder", "samples": 64, "pixel_bytes": 2097152, "peak_mib": 900},
                          2: {"part": "decoder", "samples": 64, "pixel_bytes": 2097152, "peak_mib": 800}}
    packed = dict(s, padding_pct=0.0, encoder_held_bytes=2500000)
    text = table({"size": "72b", "global_batch": 32, "iters": 2, "layout": "encoder 1 + decoder DP 2",
                  "variants": {"rows, whole step": s, "packed, bounded": packed}}, argparse.Namespace())
    assert "rank 2 (decoder) pixels read (MiB)" in text and "2.00" in text
    assert "encoder activations held: 0.50x of 'rows, whole step'; padding 5.00% -> 0.00%" in text
