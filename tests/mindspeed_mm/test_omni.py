"""Qwen2.5-Omni on MindSpeed-MM's Megatron path (`pretrain_vlm.py`) as a flow job vs the unpatched job.

The tiny job is MindSpeed-MM's own Omni example scaled down (`tiny_omni.prepare_omni_workdir`: model_7b.json and
data_7b.json with their keys, token ids, frozen encoders and `qwen2_omni` template; tiny widths): every sample holds
one video and one audio clip. The vision encoder runs on its own ranks; the audio encoder runs on the decoder's
ranks, whole on its first stage, and its features reach them through MindSpeed-MM's collator as in the unpatched
job. Both jobs load the same coupled checkpoint (audio encoder included) and run 10 bf16 iterations with
`--calculate-per-token-loss`; the flow job's loss must equal the unpatched job's (first iteration within 5e-3, all
within 2e-2 relative; gradient norms within 1e-2) with the vision encoder on 2 DP ranks, and with the decoder on more ranks than the encoder
(TP 2; with sequence parallelism MindSpeed-MM's audio encoder asks for clip lengths divisible by TP, which the tiny
clips are not).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flow_helpers import assert_flow_matches, check_part_groups, nranks, write_recipe

from mindspeed_flow.emulation.jobs import JobResult, TinyJob, emulate_job

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(2400)]

ITERS = 10
SAMPLES = 16
# As MindSpeed-MM's Omni example script: frozen encoders under the distributed optimizer, variable lengths.
COMMON = ["--calculate-per-token-loss", "--variable-seq-lengths", "--use-distributed-optimizer"]
LAYOUTS = {
    # name: encoder (dp, tp), decoder (dp, tp, pp)
    "enc_dp2_dec1": ({"dp": 2, "tp": 1}, {"dp": 1, "tp": 1, "pp": 1}),
    "enc1_dec_tp2": ({"dp": 1, "tp": 1}, {"dp": 1, "tp": 2, "pp": 1}),
}


def _job(assets: dict, iters: int, **kw) -> TinyJob:
    from mindspeed_flow.emulation.tiny_omni import VOCAB_SIZE

    return TinyJob(assets["model_json"], assets["data_json"], train_iters=iters, global_batch_size=4,
                   seq_length=256, vocab_size=VOCAB_SIZE, **kw)


@pytest.fixture(scope="module")
def omni_assets(mm_sources, tmp_path_factory) -> dict[str, Path]:
    for module, why in (("av", "MindSpeed-MM reads videos with PyAV"), ("librosa", "MindSpeed-MM reads audio with it")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} absent: {why}")
    from mindspeed_flow.emulation import tiny_omni

    return tiny_omni.prepare_omni_workdir(tmp_path_factory.mktemp("tiny_omni"), mm_sources.mindspeed_mm.root,
                                          n_samples=SAMPLES)


@pytest.fixture(scope="module")
def omni_checkpoint(omni_assets) -> Path:
    """Two iterations of the unpatched 1-rank job, saved: the common starting point (its audio encoder too)."""
    ckpt = omni_assets["workdir"] / "ckpt"
    result = emulate_job("omni_coupled_save", _job(omni_assets, 2, save=ckpt, extra=list(COMMON)).argv(),
                         log_dir=omni_assets["workdir"], nproc=1)
    result.assert_trained(2)
    return ckpt


def _finetune(assets: dict, ckpt: Path, *more: str) -> TinyJob:
    return _job(assets, ITERS, load=ckpt, extra=COMMON + ["--finetune", *more])


@pytest.fixture(scope="module")
def omni_reference(omni_assets, omni_checkpoint) -> JobResult:
    return emulate_job("omni_coupled_ref", _finetune(omni_assets, omni_checkpoint).argv(),
                       log_dir=omni_assets["workdir"], nproc=1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flow_job_trains_omni_as_the_unpatched_job(layout, omni_assets, omni_checkpoint, omni_reference, run_job,
                                                   tmp_path) -> None:
    enc, dec = LAYOUTS[layout]
    recipe = write_recipe(tmp_path / f"{layout}.yaml", enc, dec)
    result = run_job(layout, _finetune(omni_assets, omni_checkpoint).argv(), nproc=nranks(enc, dec),
                     flow_recipe=recipe)
    assert_flow_matches(result, omni_reference, layout, ITERS)
    check_part_groups(result.output, enc, dec)
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3, result.losses
