"""What a MindSpeed-MM flow job writes for its users, without MindSpeed sources: the metrics line, where the run
folder is, and the runtime pieces it shares with the torch host (metrics file, TensorBoard sink with a prefix,
peak table, trace merge, report timeline by span category). The flow job itself is checked end to end by
tests/mindspeed_mm/test_flow.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mindspeed_flow.hosts.mindspeed_mm.context import PartFigures, StepCounts, StepStats
from mindspeed_flow.hosts.mindspeed_mm.metrics import FLOW_SCALARS, FlowMetrics, flow_line, set_aside
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError, flow_run_dir, parts_for_job
from mindspeed_flow.runtime import report
from mindspeed_flow.telemetry import trace
from mindspeed_flow.telemetry.metrics import MetricsFile, machine_peak_flops
from mindspeed_flow.telemetry.tensorboard import TensorBoardSink

STATS = StepStats(counts=StepCounts(samples=4, real_tokens=150, padded_tokens=200, microbatches=4,
                                     microbatches_per_rank=2, model_flops=2e12),
                  reduced=PartFigures(encoder_busy_s=0.3, encoder_wait_s=0.1, decoder_busy_s=0.5, decoder_wait_s=0.2,
                                      transfer_exposed_s=0.25, transfer_window_s=0.4, embedding_bytes=4096.0,
                                      grad_bytes_sent=4096.0),
                  grad_norm_global=5.0, grad_norm_part=4.0)


def test_flow_line_has_the_torch_hosts_fields_and_the_parts_norms() -> None:
    line = flow_line(3, STATS, loss=2.5, lr=1e-3, grad_norm=5.0, seconds=2.0, peak_flops=1e12,
                     encoder_trainable=True)
    assert line["step"] == 3 and line["padding_fraction"] == pytest.approx(0.25)
    assert line["grad_norm_encoder"] == pytest.approx(3.0)  # 5^2 = 4^2 + 3^2
    assert line["transfer_hidden_s"] == pytest.approx(0.15) and line["transfer_exposed_s"] == 0.25
    assert line["mfu"] == pytest.approx(1.0)  # 2e12 FLOPs in 2 s on 1e12 FLOP/s
    assert (line["backbone_busy_s"], line["backbone_wait_s"]) == (0.5, 0.2)
    frozen = flow_line(3, STATS, loss=2.5, lr=1e-3, grad_norm=5.0, seconds=2.0, peak_flops=float("nan"),
                       encoder_trainable=False)
    assert frozen["grad_norm_encoder"] is None and frozen["encoder_busy_s"] is None and frozen["mfu"] is None
    # every curve the torch host draws from a field this line has is written, plus the flow job's own
    tags = {tag for tag, get in FLOW_SCALARS.items() if get(line) is not None}
    assert {"train/loss", "throughput/mfu", "parts/encoder_busy_s", "train/grad_norm_encoder",
            "transfer/embedding_mb"} <= tags
    assert "pool/occupancy_peak_mb" not in tags  # the MindSpeed-MM host has no pool: no made-up zero curve


def test_run_dir_is_the_recipes_else_beside_tensorboard_else_beside_save(tmp_path) -> None:
    assert flow_run_dir(str(tmp_path / "r"), ["--save", "x/ckpt"]) == str(tmp_path / "r")
    assert flow_run_dir(None, ["--save", str(tmp_path / "a" / "ckpt"), "--tensorboard-dir",
                               str(tmp_path / "b" / "tb")]) == str(tmp_path / "b")
    assert flow_run_dir(None, [f"--save={tmp_path / 'a' / 'ckpt'}"]) == str(tmp_path / "a")
    assert flow_run_dir(None, ["--lr", "1"]) is None


def test_trace_without_a_run_folder_is_one_clear_error(tmp_path) -> None:
    model = tmp_path / "model.json"
    model.write_text(json.dumps({
        "model_id": "qwen2_5vl",
        "image_encoder": {"vision_encoder": {"model_id": "qwen2vit", "num_attention_heads": 2, "num_layers": 2,
                                             "freeze": False}, "vision_projector": {"model_id": "lnmlp"}},
        "text_decoder": {"model_id": "qwen2_5_lm", "num_attention_heads": 4, "num_layers": 2}}))
    recipe = tmp_path / "flow.yaml"
    recipe.write_text("parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 2}\ntrainer: {trace: true}\n")
    argv = ["--mm-model", str(model), "--global-batch-size", "4", "--micro-batch-size", "1"]
    with pytest.raises(FlowRecipeError, match=r"trainer.trace=true: .* set run_dir in the recipe, or give the job "
                                              r"--tensorboard-dir or --save"):
        parts_for_job(recipe, argv, 3)
    parts = parts_for_job(recipe, argv + ["--tensorboard-dir", str(tmp_path / "run" / "tb")], 3)
    assert parts.trace and parts.run_dir == str(tmp_path / "run")


def test_metrics_file_starts_fresh_or_continues_without_redone_steps(tmp_path) -> None:
    first = MetricsFile(tmp_path)
    for step in (1, 2, 3):
        first.write({"step": step, "loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # the writer was killed while appending this line
    again = MetricsFile(tmp_path, append=True, resume_step=3)  # resumed from the checkpoint of iteration 2
    again.write({"step": 3, "loss": 30.0})
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 30.0}]
    MetricsFile(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_fresh_flow_run_moves_the_earlier_runs_files_aside(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank-00000.json").write_text("{}")
    metrics = FlowMetrics(tmp_path, None, float("nan"), "no peak", encoder_trainable=True)
    metrics.write(1, STATS, loss=1.0, lr=0.1, grad_norm=5.0, logged_at=10.0, step_started_at=9.0)
    metrics.write(2, STATS, loss=0.9, lr=0.1, grad_norm=5.0, logged_at=10.5, step_started_at=10.1)
    metrics.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2] and [ln["step_seconds"] for ln in lines] == [1.0, 0.5]
    (old,) = (tmp_path / "replaced").iterdir()
    assert (old / "metrics.jsonl").read_text() == '{"step": 1}\n' and (old / "trace" / "rank-00000.json").exists()
    assert set_aside(tmp_path / "empty") is None


def test_tensorboard_sink_writes_prefixed_tags(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path, 1, prefix="flow/", scalars=FLOW_SCALARS)
    for step in (1, 2):
        sink.write(flow_line(step, STATS, loss=3.0 - step, lr=1e-3, grad_norm=5.0, seconds=1.0, peak_flops=1e13,
                             encoder_trainable=True))
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"flow/train/loss", "flow/train/grad_norm_encoder", "flow/parts/backbone_wait_s"} <= tags
    assert all(t.startswith("flow/") for t in tags)
    assert [(e.step, e.value) for e in acc.Scalars("flow/train/loss")] == [(1, 2.0), (2, 1.0)]


def test_peak_comes_from_the_sku_table_with_its_source() -> None:
    total, desc = machine_peak_flops("Ascend910B2C", False, "bf16", 16)
    assert total == pytest.approx(16 * 353.9e12) and "CANN platform config" in desc
    total, desc = machine_peak_flops("Some Future NPU", False, "bf16", 16)
    assert math.isnan(total) and "no bf16 peak in the SKU table" in desc


def _span(name: str, cat: str, pid: int, rank: int, ts: float, dur: float, step: int) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": rank, "args": {"step": step}}


def test_trace_merge_and_report_draw_a_flow_jobs_run(tmp_path) -> None:
    """Per-rank files merge (only this world's ranks), and `report` draws spans named by what they are (the
    MindSpeed-MM host's) by their category."""
    from PIL import Image

    for rank, part in ((0, "encoder"), (1, "backbone"), (2, "backbone")):
        tracer = trace.Tracer(rank, part, tmp_path / "trace")
        tracer.events += [_span("encoder.forward" if part == "encoder" else "decoder.forward", "busy",
                                tracer.pid, rank, 1e6, 2e4, 1),
                          _span("wait.embedding", "wait", tracer.pid, rank, 1.03e6, 1e4, 1),
                          _span("optimizer", "optimizer", tracer.pid, rank, 1.05e6, 5e3, 1)]
        tracer.save()
    (tmp_path / "trace" / "rank-00007.json").write_text(json.dumps({"traceEvents": [
        _span("busy", "busy", 2, 7, 0.0, 1.0, 1)]}))  # an earlier, larger run's rank
    trace.merge(tmp_path / "trace", tmp_path / "trace.json", world_size=3)
    merged = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in merged if e["ph"] == "X"} == {0, 1, 2}
    metrics = MetricsFile(tmp_path)
    for step in (1, 2, 3):
        metrics.write(flow_line(step, STATS, loss=3.0 / step, lr=1e-3, grad_norm=5.0, seconds=1.0,
                                peak_flops=1e13, encoder_trainable=True))
    assert report.main([str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    with Image.open(tmp_path / "png" / "timeline.png") as img:
        # tab:blue fills the busy spans of three rows; the legend's own patch is a few hundred pixels
        blue = sum(1 for px in img.convert("RGB").get_flattened_data() if px == (31, 119, 180))
        assert blue > 10_000, blue
    assert (tmp_path / "png" / "curves.png").stat().st_size > 0
