"""One training process: init the world, build the topology, the model half this rank runs, the pool and the
data, then run the step loop. Launched by `mindspeed-flow train` (torchrun's elastic agent) or by an outer
torchrun (`torchrun --nproc-per-node N -m mindspeed_flow.hosts.torch.trainer RUN_DIR/config.yaml`).
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from mindspeed_flow import torch_compat
from mindspeed_flow.accelerator import Accelerator
from mindspeed_flow.config import load as config_load
from mindspeed_flow.config.load import model_hf_config
from mindspeed_flow.config.schema import FlowJobConfig
from mindspeed_flow.data import build_dataset, iter_global_batches, token_spec_from_hf_config
from mindspeed_flow.data.guard import SampleGuard
from mindspeed_flow.data.sampler import GlobalBatchSampler, resume_mismatch
from mindspeed_flow.hosts.torch.engine import EngineSettings, RankModels, StepEngine
from mindspeed_flow.hosts.torch.optim import PartOptimizer
from mindspeed_flow.hosts.torch.packed_steps import PackedSteps, step_geometry
from mindspeed_flow.hosts.torch.rank import build_rank
from mindspeed_flow.packing import CostModel
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.resilience.checkpoint import Checkpointer, CheckpointSaveError
from mindspeed_flow.resilience.faults import FaultDrills, StepHooks
from mindspeed_flow.resilience.preempt import EXIT_SAVED_ON_SIGNAL, LAG, StopRequests, stop_bound_s
from mindspeed_flow.resilience.restarts import record_cause, restart_count, tell_launcher
from mindspeed_flow.resilience.resume import accept_config, has_previous_run, mismatch, no_checkpoint, sampler_state
from mindspeed_flow.resilience.rundir import new_run_id, read_run_id, write_run_id
from mindspeed_flow.resilience.watchdog import FAILURE_FILE, Watchdog
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


# What a rank of each side is doing during a step, for the watchdog's report of a hang.
DOING = {"encoder": "encoding and sending its embeddings", "backbone": "waiting for embeddings and training",
         "coupled": "forward/backward and gradient all-reduce"}


@dataclass
class Trainer:
    """One rank's training run: its typed parts, built once by `Trainer.build`, then `train()`, whose step
    (`run_step`) reads top to bottom. Fault drills reach the loop through one hook object (`hooks`)."""

    job: FlowJobConfig
    config_path: Path
    acc: Accelerator
    rank: int
    world: int
    layout: Layout
    topo: Topology
    spec: VLMSpec
    dataset: Any  # the recipe's data set (data.build.build_dataset): samples and their shapes by id
    models: RankModels
    optim: PartOptimizer
    pool: Optional[EmbeddingPool]
    engine: StepEngine
    cost_model: CostModel
    batches: Union[GlobalBatchSampler, PackedSteps]
    checkpointer: Checkpointer
    start_step: int
    metrics: MetricsGatherer
    metrics_group: dist.ProcessGroup
    progress: "_progress"
    watchdog: Watchdog
    stops: StopRequests
    hooks: StepHooks
    memory: Optional[LiveTensorBytes]
    is_writer: bool
    side: str

    @property
    def part_index(self) -> int:
        """This rank's part as its index in the layout's parts (-1 for a coupled rank)."""
        names = [p.name for p in self.layout.parts]
        return names.index(self.topo.part) if self.topo.part in names else -1

    @staticmethod
    def build(config_path: str) -> "Trainer":
        """Join the world and build everything the run uses, in the order the ranks must agree on."""
        job = config_load.load(config_path)
        memory = _memory_tracker()
        torch.set_num_threads(int(os.environ.get("MSF_THREADS_PER_RANK", "1")))
        acc = Accelerator.detect(os.environ.get("MSF_DEVICE", "auto"))
        rank, world = init_distributed(acc, job.flow.timeout_s)
        device = acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))

        hf_cfg = model_hf_config(job)
        spec = VLMSpec.from_hf_config(hf_cfg)
        layout = Layout.from_config(job.parallel, job.flow.mode)
        layout.validate(world_size=world, limits=ModelLimits.of(spec),
                        global_batch_size=job.trainer.global_batch_size, expected_world=job.parallel.world_size)
        topo = Topology.build(layout)
        dataset = build_dataset(job.data, token_spec_from_hf_config(hf_cfg), hf_config=hf_cfg)
        built = build_rank(job, topo, hf_cfg, device)
        models, optim, pool = built.models, built.optim, built.pool
        cost_model = CostModel.from_config(job.packing, spec, frozen_encoder=job.model.freeze_encoder)

        writer_rank = topo.backbone_rank(dp=0, pp=layout.part("backbone").pp - 1) \
            if layout.mode == "decoupled" else 0
        is_writer = rank == writer_rank
        metrics_group = dist.new_group(backend="gloo")
        # every rank together: on CPU the ranks time a matmul at the same moment
        peak_total, peak_desc = machine_peak_flops(acc.device_name, acc.device_type == "cpu",
                                                   "bf16" if job.model.dtype != "float32" else "fp32", world)
        if is_writer:
            print(f"[mindspeed-flow] {layout.describe()} on {world} x {acc.device_name}; "
                  f"{MFU_FORMULA} ({peak_desc})", flush=True)
            # What the installed torch lacks and how this run works around it (nothing on a current torch). The
            # writer is a backbone rank of the last stage: it has met every adaptation the layout needs.
            compat = torch_compat.startup_line()
            if compat:
                print(compat, flush=True)

        engine = StepEngine(topo=topo, models=models, pool=pool, dataset=dataset, optim=optim,
                            norm_group=built.norm_group, settings=EngineSettings.from_job(job))
        batches = _global_batches(job, topo, dataset, cost_model, is_writer)
        run_id = _run_id(job, rank, metrics_group)
        checkpointer, start_step = _maybe_resume(job, models, optim, batches, is_writer, run_id,
                                                 {"describe": layout.describe(), "world_size": world})
        if rank == 0:  # accepted: this launch's recipe becomes the run's config.yaml
            accept_config(Path(job.run_dir), Path(config_path))
        # A resumed run continues metrics.jsonl without the lines of steps it is about to redo.
        metrics = MetricsGatherer(metrics_group, world, is_writer, Path(job.run_dir), 1, peak_total, peak_desc,
                                  append=start_step > 0, resume_step=start_step,
                                  on_write_error=job.trainer.on_save_error,
                                  part_names=[p.name for p in layout.parts] if layout.mode == "decoupled" else ())
        sink = open_sink(Path(job.run_dir) / "tensorboard", start_step) \
            if is_writer and job.trainer.tensorboard else None
        if sink is not None:  # None: tensorboard is not installed (said once by open_sink)
            metrics.sinks.append(sink)
        if job.trainer.trace:
            trace.install(trace.Tracer(rank, topo.part, Path(job.run_dir) / "trace"))
        side = "coupled" if layout.mode != "decoupled" else "encoder" if topo.is_encoder else "backbone"
        if rank == 0:  # a hang a restart recovered from is no longer the cause of anything
            (Path(job.run_dir) / FAILURE_FILE).unlink(missing_ok=True)
        watchdog = Watchdog(rank, world, side, job.flow.timeout_s, attempt=restart_count(),
                            report_path=Path(job.run_dir) / FAILURE_FILE).start()
        return Trainer(job=job, config_path=Path(config_path), acc=acc, rank=rank, world=world, layout=layout,
                       topo=topo, spec=spec, dataset=dataset, models=models, optim=optim, pool=pool, engine=engine,
                       cost_model=cost_model, batches=batches, checkpointer=checkpointer, start_step=start_step,
                       metrics=metrics, metrics_group=metrics_group,
                       progress=_progress(job, is_writer, start_step), watchdog=watchdog,
                       stops=StopRequests().install(), hooks=FaultDrills(job.faults, rank), memory=memory,
                       is_writer=is_writer, side=side)

    def train(self) -> None:
        """Every step from `start_step`, then the final save and metrics; exits with EXIT_SAVED_ON_SIGNAL after
        a stop on a signal."""
        stopped_on, saved, grace_warned = 0, True, False
        step = self.start_step
        for step in range(self.start_step, self.job.trainer.steps):
            stopped_on, step_saved = self.run_step(step)
            saved = saved if step_saved is None else step_saved  # the newest save decides
            if stopped_on:
                break
            if self.is_writer and not grace_warned and self.checkpointer.last_save_s is not None \
                    and self.metrics.lines:
                grace_warned = _warn_if_stop_outlasts_grace(self.job, self.metrics.lines,
                                                            self.checkpointer.last_save_s)
        self.finish(step, stopped_on, saved)

    def run_step(self, step: int) -> tuple[int, Optional[bool]]:
        """One step: plan it, run it, record it, save when due. Returns (the signal a stop was agreed on, 0 for
        none; whether this step's save succeeded, None when it saved nothing)."""
        self.watchdog.activity = f"step {step} ({DOING[self.side]})"
        if self.memory is not None and step > self.start_step:  # after the first update: optimizer states exist
            self.memory.marks["between steps"] = max(self.memory.marks.get("between steps", 0), self.memory.live)
        self.hooks.at_step_start(step, self.watchdog)
        shapes = [self.dataset.shape(i) for i in next(self.batches)]
        work = plan_job_step(self.job, self.layout, self.topo.bridges, step, shapes, self.cost_model,
                             audio_cost=getattr(self.dataset, "audio_cost", None),
                             plan=getattr(self.batches, "plan", None))
        record = self._record(step)
        with self.hooks.during_step(step, self.models.named_params.values()):
            self.engine.run_step(work, record)
        if self.engine.skipped_nonfinite and self.is_writer:
            print(f"[mindspeed-flow] step {step}: non-finite gradient norm, update skipped "
                  f"({self.engine.nonfinite_in_a_row} in a row; trainer.nan_policy=skip stops after "
                  f"{self.job.trainer.max_nonfinite_steps})", flush=True)
        record["peak_rss_bytes"] = self.acc.memory_stats()["peak_bytes"]
        self.metrics.post(step_static(work, self.spec, shapes, self.job.model.freeze_encoder,
                                      self.batches.guard.num_bad, self.optim), record)
        for line in self.metrics.drain(block=self.is_writer):
            self.progress.update(line)
        stopped_on = self.stops.agreed()
        saved = None
        if stopped_on or self._save_due(step):
            saved = self.save(step)
        self.hooks.after_step(step)
        return stopped_on, saved

    def _record(self, step: int) -> StepRecord:
        record = StepRecord()
        trace.set_step(step)
        record["is_encoder"], record["is_backbone"] = float(self.topo.is_encoder), float(not self.topo.is_encoder)
        record["is_writer"] = float(self.is_writer)
        record["part_index"] = float(self.part_index)
        return record

    def _save_due(self, step: int) -> bool:
        t = self.job.trainer
        return bool(t.checkpoint_every and (step + 1) % t.checkpoint_every == 0) \
            or (step == t.steps - 1 and t.save_final)

    def save(self, step: int) -> bool:
        """Checkpoint `step` (weights, optimizer, the sampler's position); False when the save failed and the
        recipe goes on (`trainer.on_save_error=continue`)."""
        self.hooks.before_save(step, self.checkpointer)
        saved = _guarded_save(self.job, self.checkpointer, self.rank, lambda: self.checkpointer.save(
            step, self.models.named_params, self.optim.optimizer,
            {"step": step, "sampler": self.batches.state_dict()}))
        self.hooks.after_save(step, self.checkpointer)
        return saved

    def finish(self, step: int, stopped_on: int, saved: bool) -> None:
        """Wait for the last save, write the last metrics, close what the run opened."""
        self.watchdog.activity = "the final checkpoint and metrics"
        self.stops.close()
        saved = _guarded_save(self.job, self.checkpointer, self.rank, self.checkpointer.wait) and saved
        if stopped_on and self.is_writer and saved:  # the save (async too) has landed: say so, and how long
            name = signal.Signals(stopped_on).name
            after = f" {time.monotonic() - self.stops.signalled_at:.1f} s after it reached this rank" \
                if self.stops.signalled_at is not None else ""
            tell_launcher(f"saved {self.checkpointer.root}/step-{step} on {name}{after}")
            print(f"[mindspeed-flow] {name}: saved {self.checkpointer.root}/step-{step}{after}; "
                  f"exiting with code {EXIT_SAVED_ON_SIGNAL} (continue with trainer.resume=true)", flush=True)
        for line in self.metrics.drain(block=True):
            self.progress.update(line)
        self.progress.close()
        if self.pool is not None:
            self.pool.close()
        if self.metrics.file is not None:
            self.metrics.file.close()
        trace.finish(Path(self.job.run_dir), self.metrics_group, self.is_writer, self.world)
        self.watchdog.stop()
        if self.memory is not None:
            self.memory.__exit__(None, None, None)
            print(f"[mindspeed-flow] rank {self.rank} ({self.side}) tensor memory: peak {self.memory.peak} bytes, "
                  f"between steps {self.memory.marks.get('between steps', 0)} bytes", flush=True)
        torch_compat.destroy_process_groups()  # a plain destroy can deadlock on torch 2.7's gloo (see there)
        if stopped_on:
            sys.exit(EXIT_SAVED_ON_SIGNAL)


def run_worker(config_path: str) -> None:
    """One training process, start to end."""
    # torch 2.13 deprecates DDP's broadcast_buffers in favour of a flag 2.7 lacks; the old one is the portable one.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    Trainer.build(config_path).train()


def _global_batches(job: FlowJobConfig, topo: Topology, dataset: Any, cost_model: CostModel,
                    is_writer: bool) -> Union[GlobalBatchSampler, PackedSteps]:
    """The sampler's global batches (every rank judges every sample alike, see data/guard.py; one rank says which
    it skipped and why), through the streaming packer when `packing.step_mode` is packs or window."""
    guard = SampleGuard(job.data.max_bad_samples, job.data.max_bad_fraction, log_skips=is_writer)
    batches = iter_global_batches(dataset, job.trainer.global_batch_size, seed=job.seed, guard=guard)
    if job.packing.step_mode not in ("packs", "window"):
        return batches
    p = job.packing
    dp, num_encoders, pp = step_geometry(topo)
    return PackedSteps(batches, dataset, token_budget=p.token_budget, cost_model=cost_model,
                       lookahead=p.lookahead or job.trainer.global_batch_size, oversize_policy=p.oversize_policy,
                       dp=dp, num_encoders=num_encoders, packs_per_rank=p.packs_per_rank, pp=pp,
                       global_batch_size=job.trainer.global_batch_size if p.step_mode == "window" else 0,
                       pad_multiple=p.pad_multiple)


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
            from tqdm import tqdm  # optional: tqdm

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


def _recorded() -> "Any":
    from torch.distributed.elastic.multiprocessing.errors import record  # lazy: launcher only

    return record(run_worker)


def run_worker_recorded(config_path: str) -> None:
    """Entry for the elastic agent: `record` writes the root-cause traceback the launcher prints; a failure that
    says it all (resilience/restarts.py CLEAR_ERRORS) is also noted at once as the job's cause."""
    try:
        _recorded()(config_path)
    except Exception as exc:
        record_cause(exc, int(os.environ.get("RANK", "0")))
        raise


if __name__ == "__main__":
    run_worker(sys.argv[1])
