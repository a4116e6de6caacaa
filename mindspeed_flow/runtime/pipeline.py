"""The backbone as a pipeline (pp > 1) inside the step engine: torch.distributed.pipelining stages built by the
torch host, fed from the pool on stage 0, with the same loss normalisation as the flat path.

Every rank of one pipeline knows the step plan, so each builds the same packed microbatches itself (position
ids, segment ids, labels) and only activations travel between stages. Stage 0 receives the step's embeddings
from the pool, runs the schedule, then routes d(loss)/d(input) back to each sample's embedding and returns it
to the producer. Shapes are static (every microbatch padded to `packing.token_budget`); one schedule object
per microbatch count is cached, since a schedule is bound to its count.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from mindspeed_flow.hosts.torch.data_parallel import apply_ddp, apply_fsdp
from mindspeed_flow.hosts.torch.pipeline import (BackboneStage, build_backbone_stage, finish_stage0_backward,
                                                 make_schedule, pipeline_step, stage0_input)
from mindspeed_flow.hosts.torch.split import BackbonePart, token_loss_sum

if TYPE_CHECKING:
    from mindspeed_flow.runtime.engine import StepEngine, Timer
    from mindspeed_flow.runtime.metrics import StepRecord
    from mindspeed_flow.runtime.plan import StepWork


class BackbonePipeline:
    def __init__(self, backbone: BackbonePart, stage_module: BackboneStage, stage: Any, kind: str,
                 token_budget: int) -> None:
        self.backbone, self.stage_module, self.stage = backbone, stage_module, stage
        self.kind, self.token_budget = kind, token_budget
        self._schedules: dict[tuple[int, float], Any] = {}

    @staticmethod
    def build(job, topo, backbone: BackbonePart, device: torch.device) -> "BackbonePipeline":
        layout = topo.part_layout
        wrap = None
        if layout.dp > 1:
            dp_wrap = apply_fsdp if job.parallel.backbone_dp_impl == "fsdp" else apply_ddp
            wrap = lambda m: dp_wrap(m, topo.dp_group)  # noqa: E731
        stage_module, stage = build_backbone_stage(backbone, topo.pp_rank, layout.pp, topo.pp_group, device,
                                                   job.packing.token_budget, wrap=wrap)
        return BackbonePipeline(backbone, stage_module, stage, job.parallel.pp_schedule, job.packing.token_budget)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.stage_module.parameters())

    def _schedule(self, n_micro: int, scale: float) -> Any:
        key = (n_micro, scale)
        if key not in self._schedules:
            def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return token_loss_sum(logits, labels) * scale

            self._schedules = {k: v for k, v in self._schedules.items() if k[0] != n_micro}
            self._schedules[key] = make_schedule(self.stage, n_micro, loss_fn, self.kind)
        return self._schedules[key]

    def run(self, work: "StepWork", row: list, n_labels: int, engine: "StepEngine", timer: "Timer",
            record: "StepRecord") -> float:
        scale = engine.m.dp_size / max(n_labels, 1)
        samples = [timer.timed("busy", lambda mb=mb: engine.load_samples(mb.sample_ids, with_pixels=False))
                   for mb in row]
        leaves_per_mb: list[dict[int, torch.Tensor]] = []
        leaf: Optional[torch.Tensor] = None
        dense: list[torch.Tensor] = []
        if self.stage_module.is_first:
            leaves_per_mb = [engine.fetch_embeds(work, mb.sample_ids, timer) for mb in row]
        packs = [self.backbone.pack(s, None, self.token_budget) for s in samples]
        if self.stage_module.is_first:
            embeds = [[leaves.get(x.sample_id) for x in s] for leaves, s in zip(leaves_per_mb, samples)]
            leaf, dense = stage0_input(self.backbone, packs, embeds)
        record["backbone_first_mb_start_t"] = time.time()
        schedule = self._schedule(len(packs), scale)
        losses = timer.timed("busy", lambda: pipeline_step(schedule, self.stage_module, packs, leaf))
        if self.stage_module.is_first and leaf is not None:
            timer.timed("busy", lambda: finish_stage0_backward(leaf, dense))
            for leaves in leaves_per_mb:
                engine.return_grads(work, leaves, timer)
            timer.timed("wait", engine.pool.flush)
        if losses is None:
            return float("nan")
        return float(sum(float(x.detach()) for x in losses)) / scale
