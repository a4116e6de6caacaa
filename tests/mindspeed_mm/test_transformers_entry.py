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

The flow job for this entry is not built yet (`mindspeed_flow_patches.launch` refuses it before launch, tested in
test_faults.py); these runs are its baseline: one rank and two (FSDP 2) give the same per-token losses.

Needs torch 2.7.x (MindSpeed's torch FSDP2 adaptor and MindSpeed-MM's fully_shard patch use torch 2.7's FSDP2).
"""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from mindspeed_flow.emulation.jobs import JobResult, emulate_command, job_result, parse_grad_norms
from mindspeed_flow.emulation.sources import Sources

SCRIPT = "pretrain_transformers.py"
ITERS = 10
IMAGES = (1, 2, 1, 3)
SAMPLES = 14
JOB_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def sft_job(mm_sources: Sources, tmp_path_factory: pytest.TempPathFactory):
    """run(name, nproc) -> JobResult of the tiny 8B example on `nproc` ranks (each run its own save folder)."""
    from mindspeed_flow.emulation import tiny_qwen3vl

    if not torch.__version__.startswith("2.7."):
        pytest.skip(f"torch {torch.__version__}: MindSpeed's torch FSDP2 adaptor and MindSpeed-MM's fully_shard patch "
                    "import torch 2.7's FSDP2 internals; run with the torch 2.7.1 emulate venv (MSF_TORCH=2.7)")
    root = tmp_path_factory.mktemp("sft")

    def run(name: str, nproc: int, moe: bool = False) -> JobResult:
        config = tiny_qwen3vl.prepare_sft_workdir(root / "tiny", mm_sources.mindspeed_mm.root, moe=moe,
                                                  n_samples=SAMPLES,
                                                  images_per_sample=IMAGES, config_name=f"{name}.yaml",
                                                  save_dir=root / name / "save", train_iters=ITERS)["config"]
        log_path = root / f"{name}.emulation.log"
        cmd = emulate_command([SCRIPT, str(config), "--distributed-backend", "nccl"], log_path=log_path, nproc=nproc)
        # The example's launch script exports CUDA_DEVICE_MAX_CONNECTIONS=2 (MindSpeed-MM refuses FSDP with 1).
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=root,
                              env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "2", "OMP_NUM_THREADS": "1"})
        return job_result(proc.returncode, proc.stdout + proc.stderr, log_path)

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
