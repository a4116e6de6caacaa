"""MindSpeed MC2 (TP + SP + --use-ascend-mc2) with MindSpeed-MM's projector: crash without the patch, trains with it.

MindSpeed's MC2 linears assume [s, b, h] input; MindSpeed-MM's lnmlp projector feeds [tokens, h]. The
mindspeed_flow_patches.mc2 wrappers (applied by `emulate --patches`) make the MC2 layers accept 2-D input.
"""
from __future__ import annotations

import pytest

from mindspeed_flow.emulation.jobs import TinyJob

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]

MC2_OPS = {"torch_npu.npu_all_gather_base_mm", "torch_npu.npu_mm_reduce_scatter_base"}


def _mc2_job(tiny_assets) -> TinyJob:
    return TinyJob(tiny_assets["model_json"], tiny_assets["data_json"], tp=2, sequence_parallel=True, mc2=True,
                   train_iters=3)


def test_mc2_crashes_without_patch(tiny_assets, run_job) -> None:
    result = run_job("tp2_sp_mc2_unpatched", _mc2_job(tiny_assets).argv(), nproc=2)
    assert result.rc != 0
    assert "mc2_feature/linear_function.py" in result.output and "IndexError" in result.output
    assert MC2_OPS & result.log["CALLED"], "MC2 ops should run in the ViT blocks before the projector fails"
    assert result.iterations == []


def test_mc2_trains_with_patch_and_matches_the_non_mc2_path(tiny_assets, run_job) -> None:
    result = run_job("tp2_sp_mc2_patched", _mc2_job(tiny_assets).argv(), nproc=2, patches=True)
    result.assert_trained(3)
    assert "[mindspeed_flow_patches] applied: mindspeed_flow_patches.mc2" in result.output
    assert MC2_OPS <= result.log["CALLED"]
    # MC2 fuses the same all-gather/reduce-scatter + matmul math: the losses equal plain TP + SP training.
    plain = TinyJob(tiny_assets["model_json"], tiny_assets["data_json"], tp=2, sequence_parallel=True, train_iters=3)
    baseline = run_job("tp2_sp_baseline", plain.argv(), nproc=2)
    baseline.assert_trained(3)
    assert not MC2_OPS & baseline.log["CALLED"]
    assert result.losses == pytest.approx(baseline.losses, rel=1e-3)
