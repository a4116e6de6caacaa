"""The planner's MindSpeed-MM memory model against the npu peak of a flow job, per rank.

One job (`bench.memory.mm_job`): MindSpeed-MM's Qwen2.5-VL 72B example config scaled down, its ViT trainable,
bf16 with the distributed optimizer, encoder 1 + decoder PP 2 (split [1, 2]), the encoder's bound at its default
(pp + 1 = 3 groups), 3 iterations, every rank printing its memory and the step's shapes (MSF_FLOW_MEMORY=1).
Checked per rank, with the planner's functions evaluated on those shapes (`planner.memory.compare_mm`):

- the bytes held between steps (weights, fp32 main gradients, fp32 main weights + Adam states, MindSpeed's cached
  causal mask) within 5% of the prediction;
- the peak (the emulator's exit summary) within 15% of the prediction: the static bytes plus the activations of
  the microbatches (decoder stages, 1F1B) or groups (encoder, the bound) held at once, plus the last stage's
  logits.
"""
from __future__ import annotations

import pytest

from mindspeed_flow.bench.memory import compare_mm_output, mm_job
from mindspeed_flow.hosts.mindspeed_mm.memory import MEMORY_ENV
from mindspeed_flow.planner import memory

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]

ITERS = 3
STATIC_RTOL = 0.05


def test_predicted_peak_per_rank_within_15_percent(mm_sources, run_job, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(MEMORY_ENV, "1")
    job = mm_job(tmp_path / "assets", mm_sources.mindspeed_mm.root, ITERS)
    result = run_job("memory", job["argv"], nproc=job["nproc"], flow_recipe=job["recipe"])
    result.assert_trained(ITERS)
    rows = compare_mm_output(result.output, job["model_json"])
    print("\n" + memory.table("MindSpeed-MM flow job: predicted vs measured npu peak per rank", rows))
    assert [r.part for r in rows] == ["encoder", "decoder stage 0", "decoder stage 1"], result.output[-3000:]
    for r in rows:
        static = sum(v for k, v in r.terms.items() if k in ("weights", "grads", "optim", "caches"))
        assert abs(static / r.measured_static - 1) <= STATIC_RTOL, (r.part, static, r.measured_static)
        assert r.measured > r.measured_static and r.terms["activations"] > 0, (r.part, r.terms)
        assert abs(r.error) <= memory.TOLERANCE, (r.part, r.predicted, r.measured, r.terms)
