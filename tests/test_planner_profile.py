"""`mindspeed-flow profile` writes a calibration table the planner reads (compute rates, their spread, the
measured link); the fits recover known lines; plans report ranges and which inputs are assumed."""
from __future__ import annotations

import json

import pytest

from mindspeed_flow.planner import profile
from mindspeed_flow.planner.inputs import build_problem, parse_kv
from mindspeed_flow.planner.plan import make_plan
from mindspeed_flow.planner.report import render_text, spread_of
from mindspeed_flow.planner.validate import parse_layout


def test_fit_recovers_overhead_and_rate() -> None:
    flops = [1e9, 2e9, 4e9, 8e9]
    seconds = [0.003 + f * 2e-11 for f in flops]
    overhead, spf = profile._fit(flops, seconds)
    assert overhead == pytest.approx(0.003, rel=1e-6) and spf == pytest.approx(2e-11, rel=1e-6)


def test_profile_table_calibrates_the_plan(tmp_path, capsys) -> None:
    out, table_csv = tmp_path / "profile.json", tmp_path / "profile.csv"
    rc = profile.main(["model=tiny_qwen2_vl", "data=infovqa_tiny", "cluster=cpu", "--repeats", "1",
                       "--budgets", "512,1024", "--out", str(out), "--csv", str(table_csv)])
    assert rc == 0
    table = json.loads(out.read_text())
    parts = {r["part"] for r in table["rows"]}
    assert parts == {"encoder", "backbone", "link"}
    assert len(table_csv.read_text().splitlines()) == len(table["rows"]) + 1
    cal = table["calibration"]
    assert cal["seconds_per_flop"]["encoder"] > 0 and cal["seconds_per_flop"]["backbone"] > 0
    assert set(cal["spread"]) == {"encoder", "backbone"} and all(v >= 0 for v in cal["spread"].values())
    assert cal["link"]["gbps"] > 0 and cal["link"]["latency_us"] >= 0  # 2 real gloo ranks
    problem, _ = build_problem(parse_kv(["cluster=cpu", "model=tiny_qwen2_vl", "data=infovqa_tiny",
                                         "samples=128", f"planner.profile={out}"]))
    assert problem.cfg.seconds_per_flop == cal["seconds_per_flop"]
    assert problem.cluster.config.intra_node_gbps == pytest.approx(cal["link"]["gbps"])
    plan = make_plan(problem, with_baselines=False)
    assert plan.step_seconds > 0 and plan.devices <= 3
    text = render_text(plan)
    assert "measured by profile: compute rate, link bandwidth/latency" in text
    # The prediction becomes a range from the calibration spread of the plan's bottleneck part; that spread is
    # measured (0 when the part's fit is exact), so either form may come out on a given machine.
    shown = f"{plan.samples_per_s:.4g} samples/s"
    assert shown in text
    assert (f"{shown} (" in text) == (spread_of(plan) > 0), (spread_of(plan), cal["spread"], text)


def test_uncalibrated_plan_says_its_rates_are_assumed() -> None:
    problem, _ = build_problem(parse_kv(["cluster=atlas_800t_a2", "model=qwen2_5_vl_3b", "devices=16",
                                         "samples=64"]))
    text = render_text(make_plan(problem, with_baselines=False))
    assert "assumed: compute rate (efficiency" in text
    assert "link figures intra_node_gbps, intra_node_latency_us, inter_node_gbps, inter_node_latency_us (preset " \
           "atlas_800t_a2, no public source)" in text


def test_link_fit_recovers_bandwidth_and_latency() -> None:
    rows = [{"size": n, "seconds": 2 * 50e-6 + n / 2e9} for n in (1 << 12, 1 << 18, 1 << 22)]
    link = profile.fit_link(rows)
    assert link["gbps"] == pytest.approx(2.0, rel=1e-6) and link["latency_us"] == pytest.approx(50.0, rel=1e-6)


def test_validate_layout_syntax() -> None:
    assert parse_layout("e1-b2") == {"enc_dp": 1, "bb_dp": 2, "bb_pp": 1, "budget": 0}
    assert parse_layout("e1-b1p2@1024") == {"enc_dp": 1, "bb_dp": 1, "bb_pp": 2, "budget": 1024}
    with pytest.raises(ValueError, match="eA-bB"):
        parse_layout("encoder2")
