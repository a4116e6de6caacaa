"""Real MindSpeed-MM Qwen2.5-VL training on CPU under emulation: parallel layouts, convergence, checkpoints."""
from __future__ import annotations

import pytest

from mindspeed_flow.emulation.jobs import TinyJob

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]

# Names torch code probes with hasattr; their absence is expected and harmless.
KNOWN_PROBES = {"torch_npu.npu_moe_token_permute_with_routing_map", "torch_npu.npu_moe_token_unpermute_with_routing_map"}

LAYOUTS = {
    "dp2": dict(nproc=2, job=dict(distributed_optimizer=True)),
    "tp2_sp": dict(nproc=2, job=dict(tp=2, sequence_parallel=True)),
    "pp2": dict(nproc=2, job=dict(pp=2), pp_model=True),
    "dp2xpp2": dict(nproc=4, job=dict(pp=2, global_batch_size=4, distributed_optimizer=True), pp_model=True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_trains_three_iterations(layout: str, tiny_assets, run_job) -> None:
    spec = LAYOUTS[layout]
    model = tiny_assets["model_pp2_json"] if spec.get("pp_model") else tiny_assets["model_json"]
    job = TinyJob(model, tiny_assets["data_json"], train_iters=3, **spec["job"])
    result = run_job(layout, job.argv(), nproc=spec["nproc"])
    result.assert_trained(3)
    assert {"torch_npu.npu_fusion_attention", "torch_npu.npu_rms_norm", "torch_npu.npu_rotary_mul"} <= \
        result.log["CALLED"]
    assert result.log["MISSING"] <= KNOWN_PROBES, result.log["MISSING"] - KNOWN_PROBES


def test_loss_falls_over_twenty_iterations(tiny_assets, run_job) -> None:
    job = TinyJob(tiny_assets["model_json"], tiny_assets["data_json"], train_iters=20, lr=2e-3,
                  distributed_optimizer=True)
    result = run_job("dp2_20it", job.argv(), nproc=2)
    result.assert_trained(20)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 0.5, result.losses


def test_save_then_load_resumes_at_next_iteration(tiny_assets, run_job, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    # Same --train-iters in both runs (Megatron checks the LR schedule length on load); the first stops at 4.
    first = TinyJob(tiny_assets["model_json"], tiny_assets["data_json"], train_iters=6, save=ckpt, save_interval=4,
                    extra=["--exit-interval", "4"])
    r1 = run_job("save4", first.argv(), nproc=2)
    r1.assert_trained(4)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    second = TinyJob(tiny_assets["model_json"], tiny_assets["data_json"], train_iters=6, load=ckpt)
    r2 = run_job("load4_to6", second.argv(), nproc=2)
    r2.assert_trained(2, first=5)
    assert "loading checkpoint" in r2.output.lower() and "iteration 4" in r2.output.lower()
    # Resumed training continues from the saved weights, not from a fresh init.
    assert r2.losses[0] < r1.losses[0]
