"""The flow encoder runs one ViT call per decoder microbatch group and holds at most `flow.encoder_inflight` groups.

One job shape: MindSpeed-MM's Qwen2.5-VL 72b example config scaled down (the Qwen2.5 ViT: window attention with
full-attention blocks), its ViT made trainable, on the user-like data set (0-2 images of odd sizes per sample),
encoder 1 + decoder PP 2 (split [1, 2]), global batch 8 packed into more microbatches than the bound. Checked:

- one ViT + projector call per group equals one call per sample (`MSF_FLOW_CHECK_GROUPED_ENCODER=1` makes the
  encoder run each sample alone too, without a graph, and print the largest difference): full attention and the
  windows are built per image from image_grid_thw, so the rows agree to bf16 rounding of the batched matmuls;
- with the bound at the decoder's pipeline depth (2) the encoder holds exactly 2 groups at its peak, fewer bytes
  than with no effective bound (64), and the losses are the unbounded run's (the same computation; only the
  encoder's backward runs earlier, group by group in the same order);
- a bound below the pipeline depth (it would deadlock) is refused before launch with one line naming the field.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from flow_helpers import nranks, write_recipe

from mindspeed_flow.emulation.jobs import TinyJob
from mindspeed_flow.emulation.scaled import scaled_model_json, write_user_like_data_json

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]

ITERS = 3
ENC, DEC = {"dp": 1, "tp": 1}, {"dp": 1, "tp": 1, "pp": 2, "layer_split": [1, 2]}
HELD = re.compile(r"\[flow\] iteration (\d+) \|.*?\| microbatches (\d+).*?\| encoder held (\d+) groups (\d+) bytes "
                  r"\(peak, encoder dp0, bound (\d+)\)")
CHECK = re.compile(r"\[flow\] grouped encoder check: iteration \d+ samples \[([\d, ]+)\] images (\d+) max abs diff "
                   r"(\S+) \(max abs (\S+)\)")
# One call per group vs one per sample, bf16: the largest difference relative to the largest value (measured 0).
GROUPED_RTOL = 1e-2
# Bounded vs unbounded losses: the same computation in the same order of accumulation (measured equal).
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def model_and_data(mm_sources, tiny_assets, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("inflight")
    model = scaled_model_json(mm_sources.mindspeed_mm.root, "72b", folder,
                              **{"image_encoder.vision_encoder.freeze": False})
    return model, write_user_like_data_json(Path(tiny_assets["workdir"]))


def _job(model: Path, data: Path) -> list[str]:
    return TinyJob(model, data, train_iters=ITERS, global_batch_size=8, seq_length=256,
                   extra=["--variable-seq-lengths", "--calculate-per-token-loss"]).argv()


def _recipe(path: Path, bound: int) -> Path:
    return write_recipe(path, ENC, DEC, flow=f"{{encoder_inflight: {bound}}}")


def test_bounded_encoder_holds_the_bound_and_trains_as_unbounded(model_and_data, run_job, tmp_path,
                                                                 monkeypatch) -> None:
    model, data = model_and_data
    monkeypatch.setenv("MSF_FLOW_CHECK_GROUPED_ENCODER", "1")
    bounded = run_job("bound2", _job(model, data), nproc=nranks(ENC, DEC), flow_recipe=_recipe(tmp_path / "b.yaml", 2))
    bounded.assert_trained(ITERS)
    checks = CHECK.findall(bounded.output)
    assert checks, bounded.output[-3000:]
    assert any(int(images) >= 2 for _, images, _, _ in checks), checks  # some call took several images
    worst = max(float(diff) / max(float(scale), 1e-30) for _, _, diff, scale in checks)
    monkeypatch.delenv("MSF_FLOW_CHECK_GROUPED_ENCODER")
    unbounded = run_job("bound64", _job(model, data), nproc=nranks(ENC, DEC),
                        flow_recipe=_recipe(tmp_path / "u.yaml", 64))
    unbounded.assert_trained(ITERS)
    held_b, held_u = HELD.findall(bounded.output), HELD.findall(unbounded.output)
    assert len(held_b) == len(held_u) == ITERS, (bounded.output[-3000:], unbounded.output[-3000:])
    rows = []
    for (it, mbs, groups_b, bytes_b, bound_b), (_, _, groups_u, bytes_u, bound_u) in zip(held_b, held_u):
        assert (int(bound_b), int(bound_u)) == (2, 64)
        # Unbounded, the encoder holds every group of the step; bounded, never more than 2.
        assert int(groups_b) == min(2, int(groups_u)), (it, groups_b, groups_u)
        assert int(groups_u) > 2, f"iteration {it}: {groups_u} groups, not more than the bound ({mbs} microbatches)"
        assert int(bytes_b) < int(bytes_u), (it, bytes_b, bytes_u)
        rows.append((int(it), int(mbs), int(groups_b), int(bytes_b), int(groups_u), int(bytes_u)))
    rel = [abs(a - b) / abs(b) for a, b in zip(bounded.losses, unbounded.losses)]
    print(f"grouped vs per-sample ViT calls: {len(checks)} groups, worst max|diff| / max|x| {worst:.3e}")
    print("iteration, microbatches, bound 2: groups, bytes | bound 64: groups, bytes")
    for row in rows:
        print(row)
    print(f"losses bound 2 {bounded.losses}\nlosses bound 64 {unbounded.losses}\nmax rel {max(rel):.2e}")
    assert worst <= GROUPED_RTOL, checks
    assert max(rel) <= LOSS_RTOL, (bounded.losses, unbounded.losses)


def test_bound_below_the_pipeline_depth_is_refused(model_and_data, tmp_path) -> None:
    model, data = model_and_data
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "emulate", "--nproc", str(nranks(ENC, DEC)),
                           "--flow-recipe", str(_recipe(tmp_path / "r.yaml", 1)), "--dry-run", "--"]
                          + _job(model, data), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "flow.encoder_inflight=1: must be >= parallel.backbone.pp=2" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
