"""Video samples in a flow job vs the unpatched job (MindSpeed-MM's Megatron path, Qwen2.5-VL).

MindSpeed-MM's `pretrain_vlm.py` trains video as its Qwen2.5-VL README sets it up: data.json's `attr.videos` and
model.json's `img_context_token_id` at the `<|video_pad|>` id, because `get_batch` renames `pixel_values_videos` /
`video_grid_thw` to the image keys and the model scatters the ViT's rows at that one token id
(`tiny.prepare_video_workdir`). Images and videos in one data set cannot run unpatched (the scatter finds no
positions for the other kind: a shape mismatch in `process_multimodal_embeddings`), so the flow job refuses them
(tests/test_mindspeed_mm_host.py) and is compared here on a video data set.

Both jobs load the same coupled checkpoint and run 10 bf16 iterations with `--calculate-per-token-loss`; the flow
job's loss must equal the unpatched job's (first iteration within 5e-3, all within 2e-2 relative) in two layouts:
encoder DP 2 + decoder DP 1 (packed decoder rows), and encoder DP 1 + decoder TP 2 with sequence parallelism
(padded rows), i.e. the decoder on more ranks than the encoder. Both have decoder DP 1, so one unpatched DP 1 job
is the reference of both.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flow_helpers import check_part_groups, nranks, write_recipe

from mindspeed_flow.emulation.jobs import TinyJob, emulate_job

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(2400)]

ITERS = 10
SAMPLES = 16
COMMON = ["--calculate-per-token-loss", "--variable-seq-lengths", "--sequence-parallel"]
LAYOUTS = {
    # name: encoder (dp, tp), decoder (dp, tp, pp), decoder microbatch layout
    "enc_dp2_dec_dp1_packed": ({"dp": 2, "tp": 1}, {"dp": 1, "tp": 1, "pp": 1}, "auto"),
    "enc1_dec_tp2_sp_rows": ({"dp": 1, "tp": 1}, {"dp": 1, "tp": 2, "pp": 1}, "rows"),
}


def _job(assets: dict, iters: int, **kw) -> TinyJob:
    return TinyJob(assets["model_json"], assets["data_json"], train_iters=iters, global_batch_size=4, **kw)


@pytest.fixture(scope="module")
def video_assets(mm_sources, tmp_path_factory) -> dict[str, Path]:
    if importlib.util.find_spec("av") is None:
        pytest.skip("PyAV (av) absent: MindSpeed-MM reads videos with it")
    from mindspeed_flow.emulation import tiny

    return tiny.prepare_video_workdir(tmp_path_factory.mktemp("tiny_video"), n_samples=SAMPLES)


@pytest.fixture(scope="module")
def video_checkpoint(video_assets) -> Path:
    """Two iterations of the unpatched DP 1 job on videos, saved: the common starting point."""
    ckpt = video_assets["workdir"] / "ckpt"
    result = emulate_job("video_coupled_save", _job(video_assets, 2, save=ckpt, extra=list(COMMON)).argv(),
                         log_dir=video_assets["workdir"], nproc=1)
    result.assert_trained(2)
    return ckpt


def _finetune(assets: dict, ckpt: Path) -> TinyJob:
    return _job(assets, ITERS, load=ckpt, extra=COMMON + ["--finetune"])


@pytest.fixture(scope="module")
def video_losses(video_assets, video_checkpoint) -> list[float]:
    result = emulate_job("video_coupled_ref", _finetune(video_assets, video_checkpoint).argv(),
                         log_dir=video_assets["workdir"], nproc=1)
    result.assert_trained(ITERS)
    return result.losses


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flow_job_trains_video_as_the_unpatched_job(layout, video_assets, video_checkpoint, video_losses, run_job,
                                                    tmp_path) -> None:
    enc, dec, decoder_layout = LAYOUTS[layout]
    recipe = write_recipe(tmp_path / f"{layout}.yaml", enc, dec, layout=decoder_layout)
    result = run_job(layout, _finetune(video_assets, video_checkpoint).argv(), nproc=nranks(enc, dec),
                     flow_recipe=recipe)
    result.assert_trained(ITERS)
    check_part_groups(result.output, enc, dec)
    flow, ref = result.losses, video_losses
    rel = [abs(a - b) / abs(b) for a, b in zip(flow, ref)]
    print(f"{layout}: flow {flow}\nunpatched {ref}\nrelative {rel}")
    assert len(flow) == len(ref) == ITERS
    assert rel[0] <= 5e-3, (rel, flow, ref)
    assert max(rel) <= 2e-2, (rel, flow, ref)
    assert sum(flow[-3:]) / 3 < sum(flow[:3]) / 3, flow
