"""`mindspeed-flow bench packing`, the --emit checker script, bad length tables, and the packing recipes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.bench import packing as bench
from mindspeed_flow.cli import main as cli_main
from mindspeed_flow.data.shapes import SampleShape, write_length_table
from mindspeed_flow.packing.workloads import near_budget_lengths

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "scripts" / "check_packing_emit.py"


def run_checker(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), str(path)], capture_output=True, text=True, timeout=60)


def test_json_output_and_emit_pass_the_checker(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    emit = tmp_path / "flow.json"
    rc = cli_main(["bench", "packing", "--workload", "infovqa", "--budget", "16384", "--dp", "8", "--pp", "4",
                   "--steps", "3", "--global-batch", "1024", "--json", "--emit", str(emit)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["methods"]) == {"naive", "sorted", "first_fit", "flow"}
    for m in result["methods"].values():
        assert {"padding_fraction", "dp_imbalance", "slot_imbalance", "samples_per_s"} <= set(m)
    flow, naive = result["methods"]["flow"], result["methods"]["naive"]
    assert flow["padding_fraction"] <= 0.02 and flow["dp_imbalance"] <= 1.03, flow
    assert naive["padding_fraction"] > flow["padding_fraction"]
    doc = json.loads(emit.read_text())
    assert doc["budget"] == 16384 and len(doc["steps"]) == 3 and len(doc["lengths"]) == 3 * 1024
    assert all(len(step) == 8 for step in doc["steps"])
    checked = run_checker(emit)
    assert checked.returncode == 0, checked.stderr
    assert "3072 samples placed exactly once" in checked.stdout


@pytest.mark.parametrize("tamper, reason", [
    (lambda d: d["steps"][0][0][0].append(d["steps"][0][1][0][0]), "already placed"),
    (lambda d: d["steps"][0][2][1].clear(), "never placed"),
    (lambda d: d["steps"][1][3].pop(), "different microbatch counts"),
    (lambda d: d.update(budget=100), "exceed the budget 100"),
    (lambda d: d["steps"][0][0][0].append(999999), "not in lengths"),
])
def test_checker_rejects_broken_assignments(tmp_path: Path, tamper, reason: str) -> None:
    shapes = [SampleShape(i, 100 + i) for i in range(64)]
    from mindspeed_flow.packing import CostModel, plan_step

    plans = [plan_step(shapes[:32], dp=4, num_encoders=1, token_budget=4096, cost_model=CostModel(),
                       min_microbatches=2),
             plan_step(shapes[32:], dp=4, num_encoders=1, token_budget=4096, cost_model=CostModel(),
                       min_microbatches=2)]
    path = tmp_path / "emit.json"
    bench.emit(str(path), plans, shapes, 4096)
    assert run_checker(path).returncode == 0
    doc = json.loads(path.read_text())
    tamper(doc)
    path.write_text(json.dumps(doc))
    checked = run_checker(path)
    assert checked.returncode == 1 and reason in checked.stderr, checked.stderr


def test_length_table_workload_and_bad_tables(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = tmp_path / "good.csv"
    write_length_table(good, [SampleShape(i, 30 + i % 7, ((1, 8 + i % 5, 8),)) for i in range(200)])
    assert bench.main(["--workload", str(good), "--budget", "512", "--dp", "2", "--pp", "2", "--steps", "4",
                       "--global-batch", "50", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["samples"] == 200

    missing = tmp_path / "missing.csv"
    missing.write_text("sample_id,image_grid_thw\n0,1x4x4\n")
    negative = tmp_path / "negative.csv"
    negative.write_text("sample_id,text_tokens,image_grid_thw\n0,12,\n1,-5,1x4x4\n")
    zero = tmp_path / "zero.csv"
    zero.write_text("sample_id,text_tokens,image_grid_thw\n0,12,\n1,0,\n")
    cases = [
        (["--workload", str(missing)], "missing column(s) ['text_tokens']"),
        (["--workload", str(negative)], "row 3: text_tokens must be >= 0, got -5"),
        (["--workload", str(zero)], "row 3: sample 1 has no tokens at all"),
        (["--workload", str(good), "--budget", "20"], "--budget=20 is smaller than the smallest sample (sample 0, 46"),
    ]
    for argv, message in cases:
        assert bench.main(argv + ["--json"]) == 2
        assert message in capsys.readouterr().err


def test_scaling_section(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--steps", "1", "--global-batch", "256", "--scaling", "--scaling-max", "10000",
                       "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["scaling"]["rows"]
    assert [r["n"] for r in rows if r["lengths"] == "infovqa"] == [1000, 10000]
    assert 0.5 < result["scaling"]["exponent"]["uniform"] < 1.5
    assert [r["budget"] for r in result["scaling"]["budgets"]] == [1024, 4096, 16384, 65536, 262144]


def test_streaming_method_static_shapes(capsys: pytest.CaptureFixture) -> None:
    """Token-defined steps at one static shape (every pack padded to the full budget) also stay under 2%."""
    assert bench.main(["--steps", "4", "--global-batch", "1024", "--pad-multiple", "0", "--stream", "--json",
                       "--repeats", "1"]) == 0
    methods = json.loads(capsys.readouterr().out)["methods"]
    stream, flow = methods["flow_stream"], methods["flow"]
    assert stream["padding_fraction"] <= 0.02 and stream["dp_imbalance"] <= 1.03 and stream["empty_microbatches"] == 0
    assert flow["padding_fraction"] == pytest.approx(flow["padding_at_budget"])  # pad multiple 0: budget shape


def test_near_budget_workload_is_hard_and_streaming_packs_it_tightly(capsys: pytest.CaptureFixture) -> None:
    lengths = near_budget_lengths(4096, 16384, seed=5)
    assert lengths.min() >= 16 and lengths.max() <= 16384
    assert (lengths > 16384 // 2).mean() > 0.15  # many samples fill most of a pack on their own
    assert bench.main(["--workload", "near_budget", "--budget", "16384", "--dp", "4", "--pp", "2", "--steps", "4",
                       "--global-batch", "512", "--stream", "--json", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["name"] == "near_budget" and result["workload"]["samples"] == 4 * 512
    m = {k: v["padding_fraction"] for k, v in result["methods"].items()}
    # Per-step plans must round the pack count up to a multiple of DP; the stream carries leftovers over.
    assert m["flow_stream"] < m["flow"] < m["first_fit"] < m["sorted"] < m["naive"], m
    # Window steps keep 512 samples a step but choose them from a pool of whole packs: less padding than the next 512.
    assert m["flow_window"] < m["flow"], m
    window = result["methods"]["flow_window"]
    assert window["whole_pack_steps"] > 0 and window["max_wait_steps"] <= 4 and window["steps"] == 4
