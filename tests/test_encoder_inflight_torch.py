"""The torch host's encoder bound (`flow.encoder_inflight`): an encoder rank holds the graphs of at most that many
consumer microbatch slots, retiring the oldest slot (its gradients, its backward) before encoding more, and trains
bit for bit like the whole-step encoder on every layout it accepts; layouts where a bound would deadlock are
refused before launch, naming the field and the minimum.

Multi-rank runs go through the real launcher (torchrun's elastic agent, fork, gloo), as tests/test_train.py.
Nothing here depends on timing: the bound is checked by the held-slot and held-sample counts each step records.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed_flow.config.load import RecipeError, check_rules
from mindspeed_flow.config.schema import FlowJobConfig
from mindspeed_flow.resilience.checkpoint import load_flat
from mindspeed_flow.runtime import launch
from mindspeed_flow.hosts.torch.engine import encode_groups

STEPS = 3

# layout -> (its overrides, the bounds run against the whole step); a 1F1B pipeline of depth 2 needs a bound >= 2
LAYOUTS = {
    "flat_dp2": (["experiment=parity_dp2"], (1, 2)),  # 1 encoder, 2 backbone DP ranks (DDP)
    "pipeline_pp2": (["experiment=parity_pp2"], (2, 3)),  # 1 encoder, 2-stage 1F1B backbone
    "encoder_tp2": (["experiment=parity_tp2", "parallel.backbone.tp=1", "parallel.encoder.tp=2"], (1, 2)),
    "frozen": (["experiment=frozen_encoder"], (1, 2)),
    # 2 encoder DP ranks, several samples per forward
    "batched_enc2": (["experiment=parity_enc2", "flow.encoder_batch_tokens=4096"], (1, 2)),
    "recompute_enc2": (["experiment=parity_enc2", "flow.keep_encoder_activations=false"], (1,)),
    # several producers and consumers, the backbone sharded (a collective in every microbatch's forward/backward)
    "enc2_fsdp_dp2": (["experiment=parity_dp2", "parallel.encoder.dp=2", "parallel.backbone_dp_impl=fsdp"], (1,)),
}


def _train(run_dir: Path, *overrides: str) -> list[dict]:
    rc = launch.main([f"run_dir={run_dir}", "trainer.progress=false", f"trainer.steps={STEPS}",
                      "trainer.save_final=true", *overrides])
    assert rc == 0, f"train {overrides} exited {rc}"
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bounded_encoder_trains_exactly_like_the_whole_step(tmp_path: Path, layout: str) -> None:
    overrides, bounds = LAYOUTS[layout]
    frozen = layout == "frozen"
    whole = _train(tmp_path / "whole", *overrides, "flow.encoder_inflight=0")
    params = load_flat(tmp_path / "whole" / "checkpoints" / f"step-{STEPS - 1}")
    if not frozen:  # the whole step is held: more slots at once than any bound below allows
        assert max(x["encoder_held_slots_peak"] for x in whole) > max(bounds), "the bounds would bound nothing"
    if "encoder_batch_tokens" in " ".join(overrides):  # several samples per forward, within a slot
        assert any(x["encoder_forwards"] < x["encoder_samples"] for x in whole), whole
    for bound in bounds:
        got = _train(tmp_path / f"bound{bound}", *overrides, f"flow.encoder_inflight={bound}")
        assert [x["step"] for x in got] == list(range(STEPS))
        for a, b in zip(got, whole):  # bit for bit: same forwards, same backward order, same sums
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (layout, bound, a["step"])
            assert a["encoder_forwards"] == b["encoder_forwards"]
        mine = load_flat(tmp_path / f"bound{bound}" / "checkpoints" / f"step-{STEPS - 1}")
        assert sorted(mine) == sorted(params)
        unequal = [k for k in params if not torch.equal(mine[k], params[k])]
        assert not unequal, (layout, bound, unequal[:5])
        # the bound holds, by the step records
        if frozen:  # nothing to hold: no gradient comes back
            assert all(x["encoder_held_peak"] == 0 == x["encoder_held_slots_peak"] for x in got), got
            continue
        assert all(1 <= x["encoder_held_slots_peak"] <= bound for x in got), (bound, got)
        assert all(x["encoder_held_peak"] <= w["encoder_held_peak"] for x, w in zip(got, whole))
        assert any(x["encoder_held_peak"] < w["encoder_held_peak"] for x, w in zip(got, whole))
        if "keep_encoder_activations=false" not in " ".join(overrides):  # graphs held: their bytes shrink too
            assert all(0 < x["encoder_held_bytes_peak"] <= w["encoder_held_bytes_peak"] for x, w in zip(got, whole))


def test_omni_encoders_bounded_train_like_the_whole_step(tmp_path: Path) -> None:
    """Several encoder parts (audio and vision producers feeding one backbone): bound 1 trains bit for bit as the
    whole step; each part's encoder holds one slot."""
    whole = _train(tmp_path / "whole", "experiment=omni_3part")
    got = _train(tmp_path / "bound1", "experiment=omni_3part", "flow.encoder_inflight=1")
    assert [(x["loss"], x["grad_norm"]) for x in got] == [(x["loss"], x["grad_norm"]) for x in whole]
    assert all(x["encoder_held_slots_peak"] == 1 for x in got), got
    a = load_flat(tmp_path / "whole" / "checkpoints" / f"step-{STEPS - 1}")
    b = load_flat(tmp_path / "bound1" / "checkpoints" / f"step-{STEPS - 1}")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _job(inflight: int, pp: int = 1, schedule: str = "1f1b", **flow: object) -> FlowJobConfig:
    job = FlowJobConfig()
    job.flow.encoder_inflight = inflight
    job.parallel.backbone.pp = pp
    job.parallel.pp_schedule = schedule
    for key, value in flow.items():
        setattr(job.flow, key, value)
    return job


@pytest.mark.parametrize("job", [
    _job(1), _job(2), _job(2, pp=2), _job(4, pp=4),
    _job(1, pp=2, mode="coupled"),  # coupled ranks hold one microbatch's graph anyway: the bound does not apply
    _job(0, pp=2, schedule="gpipe"),  # 0: the whole step, safe everywhere
])
def test_safe_bounds_are_accepted(job: FlowJobConfig) -> None:
    check_rules(job)


def test_a_frozen_encoder_accepts_any_bound() -> None:
    job = _job(1, pp=2, schedule="gpipe")
    job.model.freeze_encoder = True
    check_rules(job)


@pytest.mark.parametrize("job,message", [
    (_job(1, pp=2), "flow.encoder_inflight=1: must be >= parallel.backbone.pp=2 (1F1B: the backbone's first stage "
                    "forwards 2 microbatches"),
    (_job(3, pp=4), "flow.encoder_inflight=3: must be >= parallel.backbone.pp=4"),
    (_job(8, pp=2, schedule="gpipe"), "flow.encoder_inflight=8 with parallel.pp_schedule='gpipe' and "
                                      "parallel.backbone.pp=2: GPipe forwards every microbatch"),
    (_job(-1), "flow.encoder_inflight=-1: must be an integer >= 0"),
])
def test_a_bound_that_would_deadlock_is_refused(job: FlowJobConfig, message: str) -> None:
    with pytest.raises(RecipeError) as err:
        check_rules(job)
    assert message in str(err.value)


def test_encode_groups_never_span_two_slots() -> None:
    ids, patches, slots = [7, 3, 9, 1, 4], [100, 100, 100, 100, 100], [0, 0, 1, 1, 2]
    assert encode_groups(ids, patches, 10_000, slots=slots) == [[7, 3], [9, 1], [4]]
    assert encode_groups(ids, patches, 150, slots=slots) == [[7], [3], [9], [1], [4]]
    assert encode_groups(ids, patches, 10_000) == [ids]  # without slots: the patch budget alone
