"""MindSpeed-MM's `pretrain_transformers.py CONFIG.yaml` (Megatron's loop over an HF-style model sharded by
MindSpeed's torch FSDP2: the entry of its Qwen3-VL 8B/32B, InternVL3.5 and GLM-4.5V examples) under
`mindspeed-flow emulate`, unpatched.

CONFIG.yaml is MindSpeed-MM's own `examples/qwen3vl/qwen3vl_full_sft_8B.yaml` (dense) or `_30B.yaml` (MoE) with
paths and sizes substituted (`mindspeed_flow.emulation.tiny_qwen3vl.sft_config_text`; it names the example's
`fsdp2_config.yaml` as shipped) over a tiny Qwen3-VL (3-block ViT with two deepstack mergers, 4 layers; MoE: 4
experts, top 2, in every layer) whose seeded HF weights the example's
bridge patch loads (`load` at the HF folder), on 14 samples of 1, 2, 1, 3 images: 10 iterations at global batch 2
cross an epoch. What the emulator needed for it, each as the device behaves: torch_npu's 16-byte RNG state behind
`torch.npu.default_generators` (DTensor's RNG tracker during FSDP2 init, Megatron's tracker on the same job),
HCCL's ReduceOp.AVG (a sum, then a division: the entry averages its logged loss with it) and triton's NPU driver
(the bridge imports MindSpeed-MM's Triton kernels, which query the NPU when imported).

The unpatched runs (one rank and two, FSDP 2, give the same per-token losses) are the baselines of the flow job
(`--flow-recipe FLOW.yaml`: the vision tower on the encoder part's ranks, the LLM on the backbone part's, each part
its own FSDP2 job), compared in both layouts (encoder 1 + LLM 2 against the unpatched 2-rank job, encoder 2 + LLM 1
against the 1-rank job): the examples as shipped (vision tower frozen), the tower trained with clipping, the MoE
example; and checkpoints: the flow job's DCP checkpoint is the unpatched job's (same keys, either loads the other's).
Each job runs once per module (`sft_job` caches results by name), so baselines are shared by the tests.

Needs torch 2.7.x (MindSpeed's torch FSDP2 adaptor and MindSpeed-MM's fully_shard patch use torch 2.7's FSDP2).
"""
from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
import torch

from mindspeed_flow.emulation.jobs import JobResult, emulate_command, job_result, parse_grad_norms
from mindspeed_flow.emulation.sources import Sources

from flow_helpers import TRANSFORMERS_FLOW_RECIPE, assert_flow_matches as _assert_flow_matches, rel as _rel

SCRIPT = "pretrain_transformers.py"
ITERS = 10
IMAGES = (1, 2, 1, 3)
SAMPLES = 14
JOB_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def sft_job(mm_sources: Sources, tmp_path_factory: pytest.TempPathFactory):
    """run(name, nproc, moe=False, flow=None, env=None, images=IMAGES, videos=(0,), **edits) -> JobResult of the
    tiny example (8B dense, or 30B-A3B MoE) on `nproc` ranks, unpatched or as a flow job of `flow` = (encoder ranks,
    LLM ranks), sample i holding images[i % len] images and videos[i % len] videos; `edits` are `SftEdits` fields. Each name runs once per module (later calls get the first result); each run saves under
    ROOT/NAME/save (`run.save_dir(name)`)."""
    from mindspeed_flow.emulation import tiny_qwen3vl

    if not torch.__version__.startswith("2.7."):
        pytest.skip(f"torch {torch.__version__}: MindSpeed's torch FSDP2 adaptor and MindSpeed-MM's fully_shard patch "
                    "import torch 2.7's FSDP2 internals; run with the torch 2.7.1 emulate venv (MSF_TORCH=2.7)")
    root = tmp_path_factory.mktemp("sft")
    done: dict[str, JobResult] = {}

    def run(name: str, nproc: int, moe: bool = False, flow: tuple[int, int] | None = None,
            env: dict[str, str] | None = None, images: tuple[int, ...] = IMAGES, videos: tuple[int, ...] = (0,),
            **edits: Any) -> JobResult:
        if name in done:
            return done[name]
        edits.setdefault("train_iters", ITERS)
        config = tiny_qwen3vl.prepare_sft_workdir(root / "tiny", mm_sources.mindspeed_mm.root, moe=moe,
                                                  n_samples=SAMPLES, images_per_sample=images,
                                                  videos_per_sample=videos,
                                                  config_name=f"{name}.yaml", save_dir=root / name / "save",
                                                  **edits)["config"]
        recipe = None
        if flow is not None:
            recipe = root / f"{name}.flow.yaml"
            recipe.write_text(TRANSFORMERS_FLOW_RECIPE.format(world=nproc, enc=flow[0], bb=flow[1]), encoding="utf-8")
        log_path = root / f"{name}.emulation.log"
        cmd = emulate_command([SCRIPT, str(config), "--distributed-backend", "nccl"], log_path=log_path, nproc=nproc,
                              flow_recipe=recipe)
        # The example's launch script exports CUDA_DEVICE_MAX_CONNECTIONS=2 (MindSpeed-MM refuses FSDP with 1).
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=root,
                              env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "2", "OMP_NUM_THREADS": "1",
                                   **(env or {})})
        done[name] = job_result(proc.returncode, proc.stdout + proc.stderr, log_path)
        return done[name]

    run.save_dir = lambda name: root / name / "save"  # type: ignore[attr-defined]
    return run


@pytest.mark.mindspeed_mm
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 120)
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3vl_8b_dense", "qwen3vl_30b_moe"])
def test_transformers_entry_trains_the_example_alike_on_one_and_two_ranks(sft_job, moe: bool) -> None:
    name = "moe" if moe else "dense"
    one, two = sft_job(f"sft_{name}_1rank", 1, moe), sft_job(f"sft_{name}_2ranks", 2, moe)
    for result in (one, two):
        result.assert_trained(ITERS)
        assert "Loading from" in result.output, result.output[-3000:]  # the bridge loaded the HF weights
        assert not result.log.get("MISSING"), result.log.get("MISSING")  # every torch_npu name asked for exists
        assert "successfully saved checkpoint from iteration" in result.output  # DCP save at the end, per the example
    rel = [abs(a - b) / abs(b) for a, b in zip(two.losses, one.losses)]
    # FSDP2 averages the gradients over the ranks (ReduceOp.AVG: a sum, then a division on HCCL), so the 2-rank
    # job's gradient norm is the 1-rank job's (2 accumulation steps), as on the device.
    norms = [parse_grad_norms(r.output) for r in (one, two)]
    norm_rel = [abs(a - b) / b for a, b in zip(norms[1], norms[0])]
    print(f"pretrain_transformers.py, tiny Qwen3-VL {name} example: 1 rank {one.losses}\n2 ranks {two.losses}\n"
          f"largest relative difference: loss {max(rel):.1e}, grad norm {max(norm_rel):.1e}")
    assert max(rel) <= 1e-5, (one.losses, two.losses)
    assert len(norms[0]) == len(norms[1]) == ITERS and max(norm_rel) <= 1e-3, norms
    assert len(set(one.losses)) > 1  # it trains: the losses move


@pytest.mark.mindspeed_mm
@pytest.mark.timeout(5 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3vl_8b_dense", "qwen3vl_30b_moe"])
def test_transformers_flow_matches_the_unpatched_example(sft_job, moe: bool) -> None:
    """The example as shipped (vision tower and projector frozen: MindSpeed-MM then runs the tower under no_grad, so
    the encoder part runs forward only), decoupled with the LLM on more ranks than the encoder, against the
    unpatched job on as many ranks as the LLM part."""
    name = "moe" if moe else "dense"
    # The encoder-DP layout (encoder 2 + LLM 1) runs with the tower trained (next test), where it also moves
    # gradients; as shipped it matched the unpatched 1-rank job exactly too (dense and MoE, by hand).
    for enc, bb in ((1, 2),):
        flow = sft_job(f"flow_{name}_e{enc}b{bb}", enc + bb, moe, flow=(enc, bb))
        _assert_flow_matches(flow, sft_job(f"sft_{name}_{bb}rank{'s' if bb > 1 else ''}", bb, moe),
                             f"{name} example, encoder {enc} + LLM {bb}", ITERS)
        assert "successfully saved checkpoint from iteration" in flow.output
    if not moe:
        # The deepstack maps travel beside the embeddings and reach the decoder: zeroed in flight, the loss moves.
        probe = sft_job("flow_dense_e1b2_zero_deepstack", 3, flow=(1, 2), env={"MSF_FLOW_ZERO_DEEPSTACK": "1"})
        probe.assert_trained(ITERS)
        assert abs(probe.losses[0] - flow.losses[0]) > 1e-4, (probe.losses, flow.losses)


@pytest.mark.mindspeed_mm
@pytest.mark.timeout(5 * JOB_TIMEOUT_S)
def test_transformers_flow_trains_the_vision_tower_with_one_clipped_norm(sft_job) -> None:
    """A user's variation: the tower and projector trained, clipping at 1.0 (every step clips: norms are ~5). The
    tower's gradient comes back from the LLM ranks (scaled by encoder ranks / LLM ranks, as each part's FSDP2
    averages over its own ranks) and the norm is one over both parts."""
    for enc, bb in ((1, 2), (2, 1)):
        flow = sft_job(f"tv_flow_e{enc}b{bb}", enc + bb, flow=(enc, bb), train_vision=True, clip_grad=1.0)
        base = sft_job(f"tv_sft_{bb}", bb, train_vision=True, clip_grad=1.0)
        _assert_flow_matches(flow, base, f"vision trained, clip 1.0, encoder {enc} + LLM {bb}", ITERS)
        assert "Set modules not trainable: set()" in base.output  # the tower really trains in both


@pytest.mark.mindspeed_mm
@pytest.mark.timeout(6 * JOB_TIMEOUT_S)
def test_transformers_flow_checkpoints_are_the_unpatched_jobs(sft_job) -> None:
    """The flow job saves one DCP checkpoint over the world (each part writes its own keys: the same keys as the
    unpatched job's), so either job continues from the other's: the flow job from the unpatched job's iteration-10
    checkpoint trains iterations 11-12 exactly as the unpatched job does from it, and the unpatched job loads the flow
    job's (a strict load: every key there) and trains on within bf16 rounding of the same weights (the example saves
    no optimizer state: a fresh optimizer in all three)."""
    kw = dict(train_vision=True, clip_grad=1.0)
    sft_job("tv_sft_2", 2, **kw), sft_job("tv_flow_e1b2", 3, flow=(1, 2), **kw)  # (compared in the test above)
    base_ckpt, flow_ckpt = sft_job.save_dir("tv_sft_2"), sft_job.save_dir("tv_flow_e1b2")
    assert (flow_ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    more = dict(kw, train_iters=ITERS + 2)
    runs = {
        "flow_from_unpatched": sft_job("tv_flow_from_sft", 3, flow=(1, 2), load_dir=base_ckpt, **more),
        "unpatched_from_unpatched": sft_job("tv_sft_from_sft", 2, load_dir=base_ckpt, **more),
        "unpatched_from_flow": sft_job("tv_sft_from_flow", 2, load_dir=flow_ckpt, **more),
    }
    for name, result in runs.items():
        result.assert_trained(2, first=ITERS + 1)
        assert "Loading from" not in result.output  # the DCP checkpoint, not the HF weights
        print(f"iterations 11-12, {name}: {result.losses}")
    assert runs["flow_from_unpatched"].losses == runs["unpatched_from_unpatched"].losses
    rel = _rel(runs["unpatched_from_flow"].losses, runs["unpatched_from_unpatched"].losses)
    assert max(rel) <= 1e-3, rel


@pytest.mark.mindspeed_mm
@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_transformers_flow_trains_image_video_and_mixed_samples(sft_job) -> None:
    """A user's data set on the 8B example: `videos: videos` in its data section and samples holding images only,
    a video only, or both (1/0/2 images, 0/1/1 videos), the tower trained with clipping. The video rows come back
    from the encoder ranks in the model's own order (images, then videos) and their gradients go back to the tower.
    The baseline is the unpatched job on one rank: on two ranks it failed at iteration 6 of this data, where its
    ranks' FSDP2 collectives over the tower differed (gloo aborts on the size mismatch; HCCL would hang), a rank
    with a video running the tower on more inputs than one without; the flow job's encoder ranks take whatever the
    step holds."""
    mix = dict(images=(1, 0, 2), videos=(0, 1, 1), train_vision=True, clip_grad=1.0)
    flow = sft_job("av_flow_e2b1", 3, flow=(2, 1), **mix)
    _assert_flow_matches(flow, sft_job("av_sft_1", 1, **mix), "images, videos and both, tower trained, encoder 2 + "
                         "LLM 1", ITERS)
    assert "Set modules not trainable: set()" in flow.output
