"""The flow job adds no host-device synchronisation per microbatch to what the unpatched job makes.

Under strict emulation each rank counts what would make its host wait for the npu (blocking device-to-host copies,
scalar reads, ops whose output size depends on the data; `npu_ext.host_syncs`) and reports the totals at exit.
Each job runs twice, with 2 and with 4 samples per decoder replica and iteration (global batch 4 and 8, one sample
per microbatch: the unpatched job at micro-batch 1, the flow job with the `naive` scheduler and a budget that fits
one sample); the difference between the two runs is what the extra microbatches cost, setup and per-step work
cancel. The flow job's encoder and decoder together must not add more per microbatch than the unpatched job (ViT
and LLM in one rank) does, of each kind. Measured (torch 2.13): the unpatched job pays 3.0 copies to host, 23.0
scalar reads and 4.0 data-dependent shapes per microbatch (MindSpeed-MM's Qwen2-VL ViT reads its image grid element
by element), the flow job 1.0, 19.75 and 1.92 (packed microbatches: positions computed on the host; one ViT call
per decoder microbatch group). Both jobs run with `--tensorboard-dir`, so the flow job also writes
its metrics.jsonl and `flow/` scalars: what it reads for them is read once per iteration, not per microbatch.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flow_helpers import write_recipe

from mindspeed_flow.emulation.jobs import TinyJob, host_syncs
from mindspeed_flow.emulation.scaled import write_user_like_data_json

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]

ITERS = 3
MICROBATCHES = re.compile(r"\[flow\] iteration \d+ \|.*?\| microbatches (\d+)")


def _job(tiny_assets, data: Path, gbs: int, run_dir: Path) -> TinyJob:
    # --tensorboard-dir: both jobs write their curves, and the flow job its metrics.jsonl (RUN_DIR: run_dir)
    return TinyJob(tiny_assets["model_json"], data, train_iters=ITERS, global_batch_size=gbs, seq_length=256,
                   extra=["--calculate-per-token-loss", "--variable-seq-lengths",
                          "--tensorboard-dir", str(run_dir / "tensorboard")])


def test_flow_job_adds_no_host_sync_per_microbatch(tiny_assets, run_job, tmp_path) -> None:
    data = write_user_like_data_json(Path(tiny_assets["workdir"]))
    recipe = write_recipe(tmp_path / "flow.yaml", {"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1})
    recipe.write_text(recipe.read_text().replace("token_budget: 256", "token_budget: 256\n  scheduler: naive"))
    per_mb = {}
    for kind in ("unpatched", "flow"):
        totals, microbatches = {}, {}
        for gbs in (4, 8):
            argv = _job(tiny_assets, data, gbs, tmp_path / f"{kind}_{gbs}").argv()
            result = run_job(f"{kind}_{gbs}", argv, nproc=2 if kind == "unpatched" else 3,
                             flow_recipe=recipe if kind == "flow" else None)
            result.assert_trained(ITERS)
            if kind == "flow":  # the metrics line of every iteration was written (no host sync per microbatch)
                assert len((tmp_path / f"{kind}_{gbs}" / "metrics.jsonl").read_text().splitlines()) == ITERS
            syncs = host_syncs(result.output)
            assert len(syncs) == (2 if kind == "unpatched" else 3), "host sync counts missing (strict emulation off?)"
            totals[gbs] = [sum(kinds) for kinds in zip(*syncs.values())]
            # Microbatches per decoder replica: the flow log line says; the unpatched job runs gbs / DP.
            counts = [int(m) for m in MICROBATCHES.findall(result.output)] if kind == "flow" else [gbs // 2] * ITERS
            microbatches[gbs] = sum(counts) * 2  # both decoder replicas
        added = microbatches[8] - microbatches[4]
        assert added > 0, microbatches
        per_mb[kind] = [(b - a) / added for a, b in zip(totals[4], totals[8])]
        print(f"{kind}: host syncs (copies, scalars, shapes) {totals}, decoder microbatches {microbatches}: "
              f"{[round(x, 2) for x in per_mb[kind]]} per microbatch")
    for name, flow, unpatched in zip(("copies to host", "scalar reads", "data-dependent shapes"), per_mb["flow"],
                                     per_mb["unpatched"]):
        assert flow <= unpatched, (name, per_mb)
