"""Packed (THD) decoder microbatches on MindSpeed-MM's own Qwen2.5-VL: samples in one row stay apart.

`packed_probe.py` runs MindSpeed-MM's `pretrain_vlm.py` under the emulated NPU and, on a real loader microbatch of
three samples with images, packs them into one row (per-sample mrope positions, PackedSeqParams, MindSpeed's flash
attention in TND layout) and runs the whole model: changing one sample's text changes no other sample's logits, and
each sample's logits equal those of the sample run alone. The flow jobs' packed-vs-unpatched parity is in
test_flow.py and test_matrix.py (packed is the default layout there).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_flow.emulation.jobs import TinyJob, emulate_job

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1200)]

PROBE = Path(__file__).with_name("packed_probe.py")


def test_packed_row_keeps_every_sample_to_itself(tiny_assets, tmp_path) -> None:
    job = TinyJob(tiny_assets["model_json"], tiny_assets["data_json"], micro_batch_size=3, global_batch_size=3,
                  train_iters=1)
    argv = job.argv(script=str(PROBE))
    result = emulate_job("packed_probe", argv, log_dir=tmp_path, nproc=1)
    lines = [line for line in result.output.splitlines() if line.startswith("PROBE ")]
    assert result.rc == 0 and lines, result.output[-6000:]
    report = json.loads(lines[0][len("PROBE "):])
    print(report)
    assert report["samples"] == 3 and any(report["images"]), report
    # The changed sample's logits move; no other sample's logits move at all (they never see its tokens).
    assert report["changed_max_abs_diff"] > 1e-3, report
    assert report["other_max_abs_diff"] == 0.0, report
    # Each sample packed computes what it computes alone (bf16 LLM; the same kernels, other row shapes).
    assert report["alone_max_abs_diff"] <= 2e-2 * max(report["logit_scale"], 1.0), report
    assert "torch_npu.npu_fusion_attention" in result.log["CALLED"]
