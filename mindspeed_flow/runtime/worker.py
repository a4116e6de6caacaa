"""One training process: init the world, build the topology, the model half this rank runs, the pool and the
data, then run the step loop. Launched by `mindspeed-flow train` (torchrun's elastic agent) or by an outer
torchrun (`torchrun --nproc-per-node N -m mindspeed_flow.runtime.worker RUN_DIR/config.yaml`).
"""
from __future__ import annotations

import datetime
import os
import signal
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
from mindspeed_flow.config.load import model_hf_config
from mindspeed_flow.config.schema import FlowJobConfig
from mindspeed_flow.data import build_dataset, iter_global_batches, token_spec_from_hf_config
from mindspeed_flow.data.guard import SampleGuard
from mindspeed_flow.data.sampler import resume_mismatch
from mindspeed_flow.packing import CostModel
from mindspeed_flow.resilience.checkpoint import Checkpointer, CheckpointSaveError
from mindspeed_flow.resilience.faults import FaultDrills
from mindspeed_flow.resilience.preempt import EXIT_SAVED_ON_SIGNAL, LAG, StopRequests, stop_bound_s
from mindspeed_flow.resilience.restarts import record_cause, restart_count, tell_launcher
from mindspeed_flow.resilience.resume import accept_config, has_previous_run, mismatch, no_checkpoint, sampler_state
from mindspeed_flow.resilience.rundir import new_run_id, read_run_id, write_run_id
from mindspeed_flow.resilience.watchdog import FAILURE_FILE, Watchdog
from mindspeed_flow.runtime import build
from mindspeed_flow.runtime.engine import StepEngine
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.step.layout import Layout, ModelLimits
from mindspeed_flow.step.plan import StepWork, plan_job_step
from mindspeed_flow.telemetry import trace
from mindspeed_flow.telemetry.metrics import MFU_FORMULA, MetricsGatherer, StepRecord, StepStatic, machine_peak_flops
from mindspeed_flow.telemetry.tensor_bytes import LiveTensorBytes
from mindspeed_flow.telemetry.tensorboard import open_sink
from mindspeed_flow.topology import Topology


def init_distributed(acc: Accelerator, timeout_s: float) -> tuple[int, int]:
    """Join the world. A restarted worker gets a fresh store prefix: under an outer torchrun that restarts its
    workers, a restarted worker's plain init_process_group fails to connect the gloo mesh."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = restart_count()
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


def step_static(work: StepWork, spec: VLMSpec, shapes: list, frozen: bool, bad_samples: int,
                optim: Any) -> StepStatic:
    """What the metrics writer knows about a step without communication."""
    trained = {s.sample_id for s in shapes} - {sid for sid, _ in work.plan.oversize}
    return StepStatic(step=work.step, samples=len(trained), model_flops=step_model_flops(spec, shapes, trained, frozen),
                      oversize_skipped=len(work.plan.oversize), bad_samples_total=bad_samples,
                      lr=optim.optimizer.param_groups[0]["lr"] if optim.optimizer else 0.0, **plan_stats(work))


def plan_stats(work: StepWork) -> dict[str, float]:
    plan = work.plan
    # each encoder part's producers against each other (an audio part's frames never compare with ViT costs)
    by_part = [list(loads.values()) for loads in work.encoder_cost.values()]
    enc_imb = max((max(x) / (sum(x) / len(x)) for x in by_part if x and sum(x) > 0), default=1.0)
    n_mb = sum(len(r) for r in plan.microbatches)
    return dict(microbatches=n_mb, real_tokens=plan.real_tokens, padded_tokens=plan.padded_tokens,
                padding_fraction=float(plan.padding_fraction), dp_imbalance=float(plan.dp_imbalance),
                slot_imbalance=float(plan.slot_imbalance), encoder_imbalance=enc_imb,
                rank_costs=tuple(float(c) for c in plan.rank_costs))


def run_worker(config_path: str) -> None:
    # torch 2.13 deprecates DDP's broadcast_buffers in favour of a flag 2.7 lacks; the old one is the portable one.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    job = config_load.load(config_path)
    memory = _memory_tracker()
    torch.set_num_threads(int(os.environ.get("MSF_THREADS_PER_RANK", "1")))
    acc = Accelerator.detect(os.environ.get("MSF_DEVICE", "auto"))
    rank, world = init_distributed(acc, job.flow.timeout_s)
    device = acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    hf_cfg = model_hf_config(job)
    spec = VLMSpec.from_hf_config(hf_cfg)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    layout.validate(world_size=world, limits=ModelLimits.of(spec), global_batch_size=job.trainer.global_batch_size,
                    expected_world=job.parallel.world_size)
    topo = Topology.build(layout)
    token_spec = token_spec_from_hf_config(hf_cfg)
    dataset = build_dataset(job.data, token_spec, hf_config=hf_cfg)
    rank_models, optim, pool, norm_group = build.build_rank(job, topo, hf_cfg, device)
    frozen = job.model.freeze_encoder
    cost_model = CostModel.from_config(job.packing, spec, frozen_encoder=frozen)

    writer_rank = topo.backbone_rank(dp=0, pp=layout.part("backbone").pp - 1) if layout.mode == "decoupled" else 0
    is_writer = rank == writer_rank
    metrics_group = dist.new_group(backend="gloo")
    # every rank together: on CPU the ranks time a matmul at the same moment
    peak_total, peak_desc = machine_peak_flops(acc.device_name, acc.device_type == "cpu",
                                               "bf16" if job.model.dtype != "float32" else "fp32", world)
    if is_writer:
        print(f"[mindspeed-flow] {layout.describe()} on {world} x {acc.device_name}; "
              f"{MFU_FORMULA} ({peak_desc})", flush=True)
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
                        keep_encoder_activations=job.flow.keep_encoder_activations,
                        encoder_batch_tokens=job.flow.encoder_batch_tokens,
                        encoder_inflight=job.flow.encoder_inflight,
                        nan_policy=job.trainer.nan_policy, max_nonfinite_steps=job.trainer.max_nonfinite_steps)
    # Every rank judges every sample alike (see data/guard.py); one rank says which it skipped and why.
    guard = SampleGuard(job.data.max_bad_samples, job.data.max_bad_fraction, log_skips=is_writer)
    batches = iter_global_batches(dataset, job.trainer.global_batch_size, seed=job.seed, guard=guard)
    if job.packing.step_mode in ("packs", "window"):  # the sampler's ids through the streaming packer
        from mindspeed_flow.runtime.packed_steps import PackedSteps, step_geometry

        dp, num_encoders, pp = step_geometry(topo)
        window = job.packing.step_mode == "window"
        batches = PackedSteps(batches, dataset, token_budget=job.packing.token_budget, cost_model=cost_model,
                              lookahead=job.packing.lookahead or job.trainer.global_batch_size, oversize_policy=job.packing.oversize_policy, dp=dp,
                              num_encoders=num_encoders, packs_per_rank=job.packing.packs_per_rank, pp=pp,
                              global_batch_size=job.trainer.global_batch_size if window else 0,
                              pad_multiple=job.packing.pad_multiple)
    run_id = _run_id(job, rank, metrics_group)
    checkpointer, start_step = _maybe_resume(job, rank_models, optim, batches, is_writer, run_id,
                                             {"describe": layout.describe(), "world_size": world})
    if rank == 0:  # accepted: this launch's recipe becomes the run's config.yaml
        accept_config(Path(job.run_dir), Path(config_path))
    # A resumed run continues metrics.jsonl without the lines of steps it is about to redo.
    gatherer = MetricsGatherer(metrics_group, world, is_writer, Path(job.run_dir), 1, peak_total, peak_desc,
                               append=start_step > 0, resume_step=start_step,
                               on_write_error=job.trainer.on_save_error)
    sink = open_sink(Path(job.run_dir) / "tensorboard", start_step) if is_writer and job.trainer.tensorboard else None
    if sink is not None:
        gatherer.sinks.append(sink)
    if job.trainer.trace:
        trace.install(trace.Tracer(rank, topo.part, Path(job.run_dir) / "trace"))
    progress = _progress(job, is_writer, start_step)
    drills = FaultDrills(job.faults, rank)
    side = "coupled" if layout.mode != "decoupled" else "encoder" if topo.is_encoder else "backbone"
    doing = {"encoder": "encoding and sending its embeddings", "backbone": "waiting for embeddings and training",
             "coupled": "forward/backward and gradient all-reduce"}[side]
    if rank == 0:  # a hang a restart recovered from is no longer the cause of anything
        (Path(job.run_dir) / FAILURE_FILE).unlink(missing_ok=True)
    watchdog = Watchdog(rank, world, side, job.flow.timeout_s,
                        attempt=restart_count(),
                        report_path=Path(job.run_dir) / FAILURE_FILE).start()
    stops = StopRequests().install()
    stopped_on = 0
    grace_warned, saved = False, True
    for step in range(start_step, job.trainer.steps):
        watchdog.activity = f"step {step} ({doing})"
        if memory is not None and step > start_step:  # after the first update: the optimizer states exist
            memory.marks["between steps"] = max(memory.marks.get("between steps", 0), memory.live)
        drills.at_step_start(step, watchdog)
        drills.loader_error(step)
        sample_ids = next(batches)
        shapes = [dataset.shape(i) for i in sample_ids]
        work = plan_job_step(job, layout, topo.bridges, step, shapes, cost_model,
                             audio_cost=getattr(dataset, "audio_cost", None), plan=getattr(batches, "plan", None))
        record = StepRecord()
        trace.set_step(step)
        record["is_encoder"], record["is_backbone"] = float(topo.is_encoder), float(not topo.is_encoder)
        record["is_writer"] = float(is_writer)
        nan_hooks = drills.nan_gradients(step, rank_models.named_params.values())
        engine.run_step(work, record)
        for h in nan_hooks:
            h.remove()
        if engine.skipped_nonfinite and is_writer:
            print(f"[mindspeed-flow] step {step}: non-finite gradient norm, update skipped ({engine.nonfinite_in_a_row}"
                  f" in a row; trainer.nan_policy=skip stops after {job.trainer.max_nonfinite_steps})", flush=True)
        record["peak_rss_bytes"] = acc.memory_stats()["peak_bytes"]
        gatherer.post(step_static(work, spec, shapes, frozen, batches.guard.num_bad, optim), record)
        for line in gatherer.drain(block=is_writer):
            progress.update(line)
        last = step == job.trainer.steps - 1
        every = job.trainer.checkpoint_every
        stopped_on = stops.agreed()
        if stopped_on or (every and (step + 1) % every == 0) or (last and job.trainer.save_final):
            checkpointer.fail_next_with_enospc = drills.enospc(step)
            saved = _guarded_save(job, checkpointer, rank, lambda: checkpointer.save(
                step, rank_models.named_params, optim.optimizer, {"step": step, "sampler": batches.state_dict()}))
            drills.after_save(step, checkpointer, rank)
        drills.signal_self(step)
        if stopped_on:
            break
        if is_writer and not grace_warned and checkpointer.last_save_s is not None and gatherer.lines:
            grace_warned = _warn_if_stop_outlasts_grace(job, gatherer.lines, checkpointer.last_save_s)
    watchdog.activity = "the final checkpoint and metrics"
    stops.close()
    saved = _guarded_save(job, checkpointer, rank, checkpointer.wait) and saved
    if stopped_on and is_writer and saved:  # the save (async too) has landed: say so, and how long the stop took
        name = signal.Signals(stopped_on).name
        after = f" {time.monotonic() - stops.signalled_at:.1f} s after it reached this rank" \
            if stops.signalled_at is not None else ""
        tell_launcher(f"saved {checkpointer.root}/step-{step} on {name}{after}")
        print(f"[mindspeed-flow] {name}: saved {checkpointer.root}/step-{step}{after}; "
              f"exiting with code {EXIT_SAVED_ON_SIGNAL} (continue with trainer.resume=true)", flush=True)
    for line in gatherer.drain(block=True):
        progress.update(line)
    progress.close()
    if pool is not None:
        pool.close()
    if gatherer.file is not None:
        gatherer.file.close()
    trace.finish(Path(job.run_dir), metrics_group, is_writer, world)
    watchdog.stop()
    if memory is not None:
        memory.__exit__(None, None, None)
        print(f"[mindspeed-flow] rank {rank} ({side}) tensor memory: peak {memory.peak} bytes, between steps "
              f"{memory.marks.get('between steps', 0)} bytes", flush=True)
    torch_compat.destroy_process_groups()  # a plain destroy can deadlock on torch 2.7's gloo (see there)
    if stopped_on:
        sys.exit(EXIT_SAVED_ON_SIGNAL)


# Set to 1: each rank counts its live tensor bytes (telemetry.tensor_bytes.LiveTensorBytes) and prints the peak at exit.
MEMORY_ENV = "MSF_MEMORY_TRACK"


def _memory_tracker() -> Optional[LiveTensorBytes]:
    """The rank's tensor-bytes counter, entered before the model is built (MSF_MEMORY_TRACK=1), else None.
    The CPU allocator keeps no peak of its own; `mindspeed-flow bench memory` compares this with the planner."""
    if os.environ.get(MEMORY_ENV) != "1":
        return None
    return LiveTensorBytes().__enter__()


def _warn_if_stop_outlasts_grace(job: FlowJobConfig, lines: list[dict[str, Any]], save_s: float) -> bool:
    """Once a save and a few steps are measured: say so when a stop on SIGTERM could not save within the launcher's
    grace period (resilience/preempt.py). Returns whether it has said it."""
    recent = [x["step_seconds"] for x in lines[-5:] if x.get("step_seconds")]
    if not recent:
        return False
    bound, grace = stop_bound_s(max(recent), save_s), job.trainer.stop_grace_s
    if bound > grace:
        print(f"[mindspeed-flow] warning: a stop on SIGTERM would save up to {bound:.0f} s after the signal "
              f"({LAG + 1} steps of up to {max(recent):.1f} s and a save of {save_s:.1f} s), more than "
              f"trainer.stop_grace_s={grace}: the launcher would kill that save and a resume would continue from the "
              "newest periodic checkpoint. Raise trainer.stop_grace_s (and the scheduler's own grace period).",
              flush=True)
    return True


def _run_id(job: FlowJobConfig, rank: int, group: Any) -> str:
    """The run id of RUN_DIR/run.json (the launcher claimed the directory), the same on every rank. A worker
    started directly by an outer torchrun on a fresh directory names the run itself."""
    box: list[Any] = [None]
    if rank == 0:
        box[0] = read_run_id(Path(job.run_dir))
        if box[0] is None:
            box[0] = new_run_id()
            Path(job.run_dir).mkdir(parents=True, exist_ok=True)
            write_run_id(Path(job.run_dir), box[0], experiment=job.experiment_name)
    dist.broadcast_object_list(box, src=0, group=group)
    return str(box[0])


def _guarded_save(job: FlowJobConfig, checkpointer: Checkpointer, rank: int, save: Any) -> bool:
    """A failed save never damages the previous checkpoint; `trainer.on_save_error` says whether to go on.
    Returns whether the save succeeded."""
    try:
        save()
        return True
    except CheckpointSaveError as exc:
        if job.trainer.on_save_error != "continue":
            raise
        if rank == 0:
            print(f"[mindspeed-flow] warning: {exc}; training goes on (trainer.on_save_error=continue)", flush=True)
        return False


def _maybe_resume(job: FlowJobConfig, models: Any, optim: Any, batches: Any, verbose: bool, run_id: str,
                  layout: dict[str, Any]) -> tuple[Checkpointer, int]:
    t = job.trainer
    # A restarted worker (trainer.max_restarts) resumes whatever the recipe says.
    restarted = restart_count() > 0
    resume = t.resume or restarted
    # Always a checkpointer: a SIGTERM saves even when the recipe saves nothing periodically.
    checkpointer = Checkpointer(Path(job.run_dir) / "checkpoints", run_id=run_id, keep_last=t.keep_checkpoints,
                                async_save=t.async_checkpoint, layout=layout,
                                log_path=Path(job.run_dir) / "checkpoints.jsonl")
    if not resume:
        return checkpointer, 0
    # DCP loads into the structure it is given: the sampler's own state is the template for its fields.
    template = {"step": -1, "sampler": batches.state_dict()}

    def admit(folder: Path, saved: dict[str, Any]) -> None:
        """Refuse another seed / batch size / dataset before the load (nothing restored, nothing logged)."""
        why = resume_mismatch(sampler_state(saved), sampler_state(template))
        if why is not None:
            raise mismatch(Path(job.run_dir), folder, why)

    extra = checkpointer.load_latest(models.named_params, optim.optimizer, template, admit=admit)
    if extra is None:
        # A previous run with nothing to continue is refused, never silently started over (resilience/resume.py).
        # Rank 0 decides while the others wait in the broadcast, before any rank writes metrics.jsonl.
        previous: list[Any] = [has_previous_run(Path(job.run_dir)) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(previous, src=0, group=checkpointer.group)
        if not restarted and previous[0]:
            raise no_checkpoint(Path(job.run_dir), run_id, checkpointer.last_skipped)
        if verbose:
            why = "restarted" if restarted else "trainer.resume=true on a directory without a previous run"
            print(f"[mindspeed-flow] {why}: {checkpointer.root} holds no valid checkpoint of run {run_id}; "
                  "starting at step 0", flush=True)
        return checkpointer, 0
    try:
        batches.load_state_dict(extra["sampler"])
    except ValueError as e:  # another seed / batch size / dataset: refused before anything is written
        raise mismatch(Path(job.run_dir), checkpointer.root / f"step-{extra['step']}", str(e)) from None
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
    """Entry for the elastic agent: `record` writes the root-cause traceback the launcher prints; a failure that
    says it all (resilience/restarts.py CLEAR_ERRORS) is also noted at once as the job's cause."""
    try:
        _recorded()(config_path)
    except Exception as exc:
        record_cause(exc, int(os.environ.get("RANK", "0")))
        raise
