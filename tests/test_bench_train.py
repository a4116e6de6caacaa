"""`mindspeed-flow bench train --ranking`: the planner's prediction for the three 2-rank layouts, and one real
interleaved round of all three through the launcher (gloo, fork), reported side by side."""
from __future__ import annotations

import json
from pathlib import Path

from mindspeed_flow.bench import train as bench_train


# What `mindspeed-flow profile model=tiny_qwen2_vl_big_vit data=infovqa_tiny_large` measured on this 2-core machine
# (CPU time, so other jobs' load does not enter): the rates and fixed costs the planner is calibrated with.
PROFILE = {"calibration": {"seconds_per_flop": {"encoder": 1.85e-11, "backbone": 9.71e-12},
                           "item_overhead_s": 0.0227, "microbatch_overhead_s": 0.0198,
                           "link": {"gbps": 0.23, "latency_us": 0.0}}}


def test_planner_ranks_the_three_two_rank_layouts(tmp_path: Path) -> None:
    """Heavy-encoder workload on 2 CPU devices, calibrated: coupled DP2 splits the ViT over both ranks and is
    predicted fastest; coupled PP2 gets a split that moves LLM layers off the ViT's stage but still runs the ViT
    and its per-microbatch costs on its critical path, so it trails decoupled 1 + 1, whose backbone runs beside
    the encoder."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    pred = bench_train.predict_ranking(bench_train.RANKING_MODEL, bench_train.RANKING_DATA, 8, 512, str(profile))
    assert set(pred) == {"coupled_dp2", "coupled_pp2", "decoupled_1+1"}
    layers = pred["coupled_pp2"]["layers"]
    assert len(layers) == 2 and sum(layers) == 4 and layers[0] < layers[1], layers
    order = sorted(pred, key=lambda k: -pred[k]["samples_per_s"])
    assert order == ["coupled_dp2", "decoupled_1+1", "coupled_pp2"], pred


def test_ranking_runs_all_three_layouts(capsys) -> None:
    rc = bench_train.main(["--ranking", "--repeats", "1", "--steps", "2", "--warmup", "1", "--json"])
    assert rc == 0
    text = capsys.readouterr().out
    # each training run prints its own summary first; the bench's report is the last JSON object
    out, _ = json.JSONDecoder().raw_decode(text[text.rindex('{\n  "rows"'):])
    assert set(out["rows"]) == {"coupled_dp2", "coupled_pp2", "decoupled_1+1"}
    for row in out["rows"].values():
        assert row["samples_per_s_median"] > 0 and row["predicted_samples_per_s"] > 0
        assert 0 < row["final_loss"] < 10
    assert sorted(out["measured_ranking"]) == sorted(out["rows"]) and len(out["core_share_per_round"]) == 1
    assert all(0 < share <= 1.05 for share in out["core_share_per_round"][0])


def test_encoder_inflight_rows_side_by_side(capsys) -> None:
    """`--encoder-inflight 0,1`: the whole-step encoder and the bounded one in one run, each row with the peak
    samples and slots an encoder rank held (the bounded row holds fewer, one slot) and the step time."""
    rc = bench_train.main(["--modes", "decoupled", "--encoder-inflight", "0,1", "--steps", "2", "--warmup", "0",
                           "--json", "experiment=parity_dp2"])
    assert rc == 0
    text = capsys.readouterr().out
    out, _ = json.JSONDecoder().raw_decode(text[text.rindex('{\n  "modes"'):])
    whole, bounded = out["modes"]["decoupled/inflight0"], out["modes"]["decoupled/inflight1"]
    assert bounded["encoder_held_slots_peak"] == 1 < whole["encoder_held_slots_peak"]
    assert 0 < bounded["encoder_held_peak"] < whole["encoder_held_peak"]
    assert 0 < bounded["encoder_held_mb"] < whole["encoder_held_mb"]
    assert bounded["median_step_s"] > 0 and whole["final_loss"] == bounded["final_loss"]
