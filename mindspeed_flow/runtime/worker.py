"""One training process: init the world, build the topology, the model half this rank runs, the pool and the
data, then run the step loop. Launched by `mindspeed-flow train` (torchrun's elastic agent) or by an outer
torchrun (`torchrun --nproc-per-node N -m mindspeed_flow.runtime.worker RUN_DIR/config.yaml`).
"""
from __future__ import annotations

import datetime
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from mindspeed_flow import torch_compat
from mindspeed_flow.accelerator import Accelerator
from mindspeed_flow.config import load as config_load
from mindspeed_flow.config.load import model_hf_config, model_limits
from mindspeed_flow.config.schema import FlowJobConfig
from mindspeed_flow.data import build_dataset, iter_global_batches, token_spec_from_hf_config
from mindspeed_flow.packing import CostModel
from mindspeed_flow.resilience.checkpoint import Checkpointer
from mindspeed_flow.runtime import build
from mindspeed_flow.runtime.engine import StepEngine
from mindspeed_flow.runtime.metrics import MetricsGatherer, StepRecord, StepStatic, measure_cpu_peak_flops
from mindspeed_flow.runtime.plan import StepWork, label_normalizer, plan_coupled_step, plan_decoupled_step
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.topology import Layout, Topology


def init_distributed(acc: Accelerator, timeout_s: float) -> tuple[int, int]:
    """Join the world. A worker restarted by the elastic agent gets a fresh store prefix: a restarted worker's
    plain init_process_group fails to connect the gloo mesh (DESIGN §7)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout) if "TORCHELASTIC_RUN_ID" in os.environ else \
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=(rank == 0),
                      timeout=timeout)
    dist.init_process_group(acc.backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)
    return rank, world


def step_model_flops(spec: VLMSpec, shapes: list, trained: set[int], frozen_encoder: bool) -> float:
    total = 0.0
    for s in shapes:
        if s.sample_id not in trained:
            continue
        total += spec.llm.sample_flops(s.llm_tokens)
        total += sum(spec.vision.image_flops(p, trainable=not frozen_encoder) for p in s.vit_patches_per_image)
    return total


def machine_peak_flops(acc: Accelerator, job: FlowJobConfig, world: int) -> tuple[float, str]:
    """Peak FLOP/s of all devices together, and how it was obtained.

    Accelerators: devices x the per-SKU table. CPU: every rank times a matmul at the same moment (one thread
    each) and the rates are summed, so ranks sharing cores share the peak (3 ranks on 2 cores sum to about 2
    cores' worth) and MFU cannot exceed 1 because of oversubscription.
    """
    if acc.device_type != "cpu":
        per_device = acc.peak_flops("bf16" if job.model.dtype != "float32" else "fp32") or float("nan")
        return per_device * world, f"{world} x {per_device / 1e12:.1f} TFLOPS ({acc.device_name}, table)"
    dist.barrier()
    rate = torch.tensor([measure_cpu_peak_flops()], dtype=torch.float64)
    dist.all_reduce(rate)
    total = float(rate)
    return total, f"{total / 1e12:.4f} TFLOPS: {world} ranks timing an fp32 matmul concurrently, summed"


def plan_for_step(job: FlowJobConfig, topo: Topology, step: int, shapes: list, cost_model: CostModel) -> StepWork:
    """The step plan, identical on every rank (see runtime/plan.py)."""
    p = job.packing
    common = dict(token_budget=p.token_budget, cost_model=cost_model, scheduler=p.scheduler,
                  oversize_policy=p.oversize_policy, pad_multiple=p.pad_multiple)
    if topo.layout.mode == "decoupled":
        return plan_decoupled_step(step, shapes, bridge=topo.bridge,
                                   min_microbatches=topo.layout.part("backbone").pp, **common)
    return plan_coupled_step(step, shapes, world_size=topo.world_size, **common)


def step_static(work: StepWork, spec: VLMSpec, shapes: list, frozen: bool, bad_samples: int,
                optim: Any) -> StepStatic:
    """What the metrics writer knows about a step without communication."""
    trained = {s.sample_id for s in shapes} - {sid for sid, _ in work.plan.oversize}
    return StepStatic(step=work.step, samples=len(trained), model_flops=step_model_flops(spec, shapes, trained, frozen),
                      oversize_skipped=len(work.plan.oversize), bad_samples_total=bad_samples,
                      lr=optim.optimizer.param_groups[0]["lr"] if optim.optimizer else 0.0, **plan_stats(work))


def plan_stats(work: StepWork) -> dict[str, float]:
    plan = work.plan
    loads = list(work.encoder_cost.values())
    enc_imb = max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) > 0 else 1.0
    n_mb = sum(len(r) for r in plan.microbatches)
    return dict(microbatches=n_mb, real_tokens=plan.real_tokens, padded_tokens=plan.padded_tokens,
                padding_fraction=float(plan.padding_fraction), dp_imbalance=float(plan.dp_imbalance),
                slot_imbalance=float(plan.slot_imbalance), encoder_imbalance=enc_imb,
                rank_costs=tuple(float(c) for c in plan.rank_costs))


def run_worker(config_path: str) -> None:
    # torch 2.13 deprecates DDP's broadcast_buffers in favour of a flag 2.7 lacks; the old one is the portable one.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    job = config_load.load(config_path)
    torch.set_num_threads(int(os.environ.get("MSF_THREADS_PER_RANK", "1")))
    acc = Accelerator.detect(os.environ.get("MSF_DEVICE", "auto"))
    rank, world = init_distributed(acc, job.flow.timeout_s)
    device = acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    hf_cfg = model_hf_config(job)
    spec = VLMSpec.from_hf_config(hf_cfg)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    layout.validate(world_size=world, limits=model_limits(spec), global_batch_size=job.trainer.global_batch_size,
                    expected_world=job.parallel.world_size)
    topo = Topology.build(layout)
    token_spec = token_spec_from_hf_config(hf_cfg)
    dataset = build_dataset(job.data, token_spec)
    rank_models, optim, pool, norm_group = build.build_rank(job, topo, hf_cfg, device)
    frozen = job.model.freeze_encoder
    cost_model = CostModel.from_config(job.packing, spec, frozen_encoder=frozen)

    writer_rank = topo.backbone_rank(dp=0, pp=layout.part("backbone").pp - 1) if layout.mode == "decoupled" else 0
    is_writer = rank == writer_rank
    metrics_group = dist.new_group(backend="gloo")
    peak_total, peak_desc = machine_peak_flops(acc, job, world)
    if is_writer:
        print(f"[mindspeed-flow] {layout.describe()} on {world} x {acc.device_name}; "
              f"MFU = model FLOPs per step (DESIGN §5, padding excluded) / step seconds / peak of all devices "
              f"({peak_desc})", flush=True)
        # What the installed torch lacks and how this run works around it (nothing on a current torch). The writer
        # is a backbone rank of the last stage, so it has met every adaptation the layout needs (FSDP, pipeline).
        compat = torch_compat.startup_line()
        if compat:
            print(compat, flush=True)

    engine = StepEngine(topo=topo, models=rank_models, pool=pool, dataset=dataset,
                        token_budget=job.packing.token_budget, optim=optim,
                        norm_group=norm_group, grad_clip=job.trainer.grad_clip, base_lr=job.trainer.lr,
                        warmup_steps=job.trainer.warmup_steps,
                        prefetch_depth=job.data.prefetch_depth,
                        keep_encoder_activations=job.flow.keep_encoder_activations)
    batches = iter_global_batches(dataset, job.trainer.global_batch_size, seed=job.seed,
                                  max_bad=job.data.max_bad_samples)
    needs_labels = not topo.is_encoder
    checkpointer, start_step = _maybe_resume(job, rank_models, optim, batches, is_writer)
    gatherer = MetricsGatherer(metrics_group, world, is_writer, Path(job.run_dir), 1, peak_total, peak_desc,
                               append=start_step > 0)
    progress = _progress(job, is_writer, start_step)
    for step in range(start_step, job.trainer.steps):
        sample_ids = next(batches)
        shapes = [dataset.shape(i) for i in sample_ids]
        work = plan_for_step(job, topo, step, shapes, cost_model)
        # Only ranks that compute the loss need the normaliser: the step's label tokens. They read the text of the
        # whole global batch once (cheap, no pixels) and the engine reuses it for their own microbatches.
        texts = {i: dataset.sample(i, with_pixels=False) for i in sample_ids} if needs_labels else {}
        n_labels = label_normalizer({i: t.label_tokens for i, t in texts.items()}, sample_ids,
                                    work.plan.oversize) if needs_labels else 0
        record = StepRecord()
        record["is_encoder"], record["is_backbone"] = float(topo.is_encoder), float(not topo.is_encoder)
        record["is_writer"] = float(is_writer)
        engine.run_step(work, n_labels, record, texts)
        record["peak_rss_bytes"] = acc.memory_stats()["peak_bytes"]
        gatherer.post(step_static(work, spec, shapes, frozen, batches.guard.num_bad, optim), record)
        for line in gatherer.drain(block=is_writer):
            progress.update(line)
        last = step == job.trainer.steps - 1
        every = job.trainer.checkpoint_every
        if checkpointer is not None and ((every and (step + 1) % every == 0) or (last and job.trainer.save_final)):
            checkpointer.save(step, rank_models.named_params, optim.optimizer,
                              {"step": step, "sampler": batches.state_dict()})
    if checkpointer is not None:
        checkpointer.wait()
    for line in gatherer.drain(block=True):
        progress.update(line)
    progress.close()
    if pool is not None:
        pool.close()
    dist.barrier(group=metrics_group)
    torch_compat.destroy_process_groups()  # a plain destroy can deadlock on torch 2.7's gloo (see there)


def _maybe_resume(job: FlowJobConfig, models: Any, optim: Any, batches: Any, verbose: bool
                  ) -> tuple[Optional[Checkpointer], int]:
    t = job.trainer
    if not (t.checkpoint_every or t.save_final or t.resume):
        return None, 0
    checkpointer = Checkpointer(Path(job.run_dir) / "checkpoints", keep_last=t.keep_checkpoints,
                                async_save=t.async_checkpoint)
    if not t.resume:
        return checkpointer, 0
    # DCP loads into the structure it is given: the sampler's own state is the template for its fields.
    extra = checkpointer.load_latest(models.named_params, optim.optimizer,
                                     {"step": -1, "sampler": batches.state_dict()})
    if extra is None:
        if verbose:
            print(f"[mindspeed-flow] trainer.resume=true but {checkpointer.root} holds no valid checkpoint: "
                  "starting at step 0", flush=True)
        return checkpointer, 0
    batches.load_state_dict(extra["sampler"])
    if verbose:
        print(f"[mindspeed-flow] resumed from {checkpointer.root}/step-{extra['step']}", flush=True)
    return checkpointer, int(extra["step"]) + 1


class _progress:
    """tqdm bar on the writer rank; one short line per step elsewhere is noise, so other ranks print nothing."""

    def __init__(self, job: FlowJobConfig, enabled: bool, start_step: int = 0) -> None:
        self.bar = None
        if enabled and job.trainer.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=job.trainer.steps, initial=start_step, desc=f"train {job.experiment_name}",
                            unit="step", dynamic_ncols=True, file=sys.stdout)

    def update(self, line: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{line['loss']:.4f}" if line["loss"] is not None else "-",
                                 s=f"{line['step_seconds']:.2f}", pad=f"{line['padding_fraction']:.1%}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":
    run_worker(sys.argv[1])


def _recorded() -> "Any":
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(run_worker)


def run_worker_recorded(config_path: str) -> None:
    """Entry for the elastic agent: `record` writes the root-cause traceback the launcher prints."""
    _recorded()(config_path)
