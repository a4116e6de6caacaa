"""What a CPU training run leaves for its users: TensorBoard scalars (read back with TensorBoard's own reader), a
Chrome trace with encoder and backbone tracks, and `mindspeed-flow report` PNGs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_flow.runtime import launch, report
from mindspeed_flow.telemetry.tensorboard import SCALARS

STEPS = 4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("traced") / "run"
    rc = launch.main([f"run_dir={out}", "experiment=parity_enc2", f"trainer.steps={STEPS}", "trainer.trace=true",
                      "trainer.progress=false"])
    assert rc == 0
    return out


def test_tensorboard_scalars_match_metrics_jsonl(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(SCALARS) <= tags, set(SCALARS) - tags
    for tag in SCALARS:
        assert [e.step for e in acc.Scalars(tag)] == list(range(STEPS)), tag
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses == pytest.approx([ln["loss"] for ln in lines], rel=1e-6)
    rates = [e.value for e in acc.Scalars("throughput/samples_per_s")]
    assert rates == pytest.approx([ln["samples"] / ln["step_seconds"] for ln in lines], rel=1e-5)
    assert all(e.value > 0 for e in acc.Scalars("parts/encoder_busy_s") + acc.Scalars("parts/backbone_busy_s"))
    assert all(e.value > 0 for e in acc.Scalars("pool/occupancy_peak_mb"))


def test_trace_is_chrome_json_with_encoder_and_backbone_tracks(run_dir: Path) -> None:
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"]
    parts = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(parts.values()) == {"encoder", "backbone"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] in parts for e in spans)
    by_part = {name: {e["name"] for e in spans if parts[e["pid"]] == name} for name in ("encoder", "backbone")}
    assert {"step", "encoder.produce", "encoder.forward", "pool.put", "pool.wait_grad", "busy"} <= by_part["encoder"]
    assert {"step", "backbone.consume", "pool.get", "pool.return_grad", "optimizer", "busy"} <= by_part["backbone"]
    ranks = {e["tid"] for e in spans}
    assert ranks == {0, 1, 2}
    for rank in ranks:  # every rank traced every step, and each pool call lies inside its step's span
        steps = {e["args"]["step"]: e for e in spans if e["tid"] == rank and e["name"] == "step"}
        assert sorted(steps) == list(range(STEPS))
        for e in spans:
            if e["tid"] == rank and e["name"].startswith("pool."):
                outer = steps[e["args"]["step"]]
                assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1.0


def test_report_draws_curves_and_a_step_timeline(run_dir: Path, tmp_path: Path, capsys) -> None:
    from PIL import Image

    assert report.main([str(run_dir), "--step", "2", "--out", str(tmp_path / "png")]) == 0
    for name, min_size in (("curves.png", (1200, 900)), ("timeline.png", (1200, 250))):
        with Image.open(tmp_path / "png" / name) as img:
            assert img.size[0] >= min_size[0] and img.size[1] >= min_size[1], (name, img.size)
            assert len(set(img.convert("L").getdata())) > 20  # drawn, not blank
    chosen, events, names = report.step_events(json.loads((run_dir / "trace.json").read_text()), 2)
    assert chosen == 2 and {names[e["pid"]] for e in events} == {"encoder", "backbone"}
    assert report.main([str(run_dir), "--step", "99", "--out", str(tmp_path / "x")]) == 2
    assert "the trace has steps 0..3" in capsys.readouterr().err
    assert report.main([str(tmp_path / "nothing")]) == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().err


def test_resumed_run_keeps_one_tensorboard_history(tmp_path: Path) -> None:
    """A run that logged steps 0-3 but whose last checkpoint is step 1 resumes at step 2: the curves then hold
    steps 0-3 once each, the resumed values for 2-3 (TensorBoard's purge_step drops the abandoned ones)."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    common = [f"run_dir={run}", "experiment=parity_enc2", f"trainer.steps={STEPS}", "trainer.progress=false",
              "trainer.checkpoint_every=2", "trainer.keep_checkpoints=4"]
    assert launch.main(common) == 0
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS - 1}")  # as if the job died before its last checkpoint
    assert launch.main(common + ["trainer.resume=true"]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(STEPS))
    resumed = {ln["step"]: ln["loss"] for ln in lines}  # the last line of each step is the resumed run's
    assert [e.value for e in events] == pytest.approx([resumed[s] for s in range(STEPS)], rel=1e-6)
