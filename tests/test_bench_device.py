"""`mindspeed-flow bench device` on the CPU: every section runs end to end and its checks hold (the accelerator
run is the same code with --device cuda|npu; CI has none)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_flow.bench import device as bench_device

CPU_ARGS = ["--device", "cpu", "--model", "tiny_qwen2_vl", "--data", "infovqa_tiny", "--tokens", "1024",
            "--budgets", "256,512,1024", "--steps", "3", "--warmup", "2", "--experiment", "default",
            "--overrides", "parallel.world_size=1 flow=coupled trainer.global_batch_size=6"]


@pytest.mark.timeout(600)
def test_every_section_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "device"
    report = bench_device.measure(bench_device.parse_args([*CPU_ARGS, "--out", str(out)]))
    sections = report["sections"]
    assert list(sections) == list(bench_device.SECTIONS)
    failed = {k: v.get("error", v) for k, v in sections.items() if not v["ok"]}
    assert not failed, failed
    # pool: the 4,096-token item is over the host-tier threshold, the others stay in the device tier
    assert sections["pool"]["consumer_stats"]["host_tier_items"] == 1
    # build: an encoder-only build materialises no backbone parameter and vice versa
    builds = sections["build"]["builds"]
    assert builds["encoder"]["materialized"]["backbone"] == 0 < builds["encoder"]["materialized"]["encoder"]
    assert builds["backbone"]["materialized"]["encoder"] == 0 < builds["backbone"]["materialized"]["backbone"]
    # job: the profile calibrated the simulator, the run trained, each measured step has a prediction
    job = sections["job"]
    assert [r["step"] for r in job["steps"]] == [2]
    assert all(r["measured_s"] > 0 and r["simulated_s"] > 0 for r in job["steps"])
    assert (out / "run" / "metrics.jsonl").exists() and (out / "profile.json").exists()
    assert json.loads((out / "report.json").read_text())["sections"]["job"]["ok"]
    # the table prints every section
    table = bench_device._table(report, None)
    assert all(f"[{name}] ok" in table for name in bench_device.SECTIONS)


def test_existing_output_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("an earlier run")
    with pytest.raises(SystemExit, match="already holds files"):
        bench_device.measure(bench_device.parse_args([*CPU_ARGS, "--out", str(tmp_path), "--sections", "norm"]))
    assert (tmp_path / "keep.txt").read_text() == "an earlier run"


def test_bad_section_is_named() -> None:
    with pytest.raises(SystemExit):
        bench_device.parse_args(["--sections", "pool,warp"])
