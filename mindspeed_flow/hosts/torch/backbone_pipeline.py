"""The backbone as a pipeline (pp > 1) inside the step engine: torch.distributed.pipelining stages built by the
torch host, fed on stage 0 through a narrow `EmbeddingSource` (fetch microbatch k's embeddings of every encoder
part, return their gradients; the engine backs it with the pool), with the same loss normalisation as the flat
path.

Every rank of one pipeline knows the step plan, so each builds the same packed microbatches itself (position
ids, segment ids, labels) and only activations travel between stages.

Streaming through the pipeline: stage 0's feed pulls microbatch k's embeddings from the source when the
schedule runs that forward (schedules run forwards in microbatch order),
so the pipeline starts on microbatch 0 while the encoder still encodes later samples. Each embedding leaf has
a gradient hook that returns d(loss)/d(embedding) to its producer the moment the schedule's backward computes
it, so the encoder can start its backward before the pipeline has drained.

Per-step shapes: a step's microbatches are padded to the step's sequence length (`StepPlan.seq_len`: the longest
pack rounded up to `packing.pad_multiple`, or the token budget when that is 0), as on the flat path. A
PipelineStage fixes its activation shapes on its first step and a schedule is bound to its microbatch count, so
(stage, schedule) pairs are cached by (sequence length, microbatch count), a few at a time; every rank of the
pipeline knows the plan, so all of them build a new pair on the same step. The loss scale (1 / the step's label
tokens) is read at loss time, not baked into the cached schedule.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional

import torch

from mindspeed_flow.hosts.torch.data_parallel import apply_ddp, apply_fsdp
from mindspeed_flow.hosts.torch.engine import EmbeddingSource, PartEmbeds, model_embeds
from mindspeed_flow.hosts.torch.pipeline import BackboneStage, build_backbone_stage, make_schedule, pipeline_step
from mindspeed_flow.hosts.torch.split import BackbonePart, token_loss_sum
from mindspeed_flow.step.timer import Timer

if TYPE_CHECKING:
    from mindspeed_flow.data.sample import VLMSample
    from mindspeed_flow.telemetry.metrics import StepRecord


class BackbonePipeline:
    # (sequence length, microbatch count) pairs kept: pad_multiple gives a bounded set of lengths, and each
    # entry holds the stage's receive buffers for its shape.
    MAX_CACHED_SHAPES = 4

    def __init__(self, backbone: BackbonePart, stage_module: BackboneStage, stage: Any, kind: str) -> None:
        self.backbone, self.stage_module, self.stage = backbone, stage_module, stage
        self.kind = kind
        self._schedules: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._loss_scale = 1.0
        self.schedules_built = 0

    @staticmethod
    def build(job, topo, backbone: BackbonePart, device: torch.device,
              encoder: Optional[torch.nn.Module] = None) -> "BackbonePipeline":
        """This rank's stage of the part's pipeline (layers per stage from the layout's layer_split); `encoder`:
        a coupled pipeline's ViT, held by stage 0 (coupled pipelines wrap DP with DDP)."""
        layout = topo.part_layout
        fsdp = job.parallel.backbone_dp_impl == "fsdp" and encoder is None
        dp_wrap = apply_fsdp if fsdp else apply_ddp
        wrap = (lambda m: dp_wrap(m, topo.dp_group)) if layout.dp > 1 else None
        stage_module, stage = build_backbone_stage(backbone, topo.pp_rank, layout.pp, topo.pp_group, device,
                                                   layer_split=layout.layer_split, wrap=wrap,
                                                   encoder=encoder if topo.pp_rank == 0 else None)
        return BackbonePipeline(backbone, stage_module, stage, job.parallel.pp_schedule)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.stage_module.parameters())

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) * self._loss_scale

    def _schedule(self, seq_len: int, n_micro: int) -> Any:
        """The schedule for this shape: the first one built reuses the PipelineStage made at build time, later
        shapes get a fresh PipelineStage over the same (wrapped) stage module."""
        key = (seq_len, n_micro)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        stage = self.stage
        if self.schedules_built:
            stage = type(stage)(stage.submod, stage.stage_index, stage.num_stages, stage.device, group=stage.group)
        self._schedules[key] = make_schedule(stage, n_micro, self._loss, self.kind)
        self.schedules_built += 1
        while len(self._schedules) > self.MAX_CACHED_SHAPES:
            self._schedules.popitem(last=False)
        return self._schedules[key]

    def run(self, samples: list[list["VLMSample"]], seq_len: int, loss_scale: float,
            source: Optional[EmbeddingSource], timer: Timer, record: "StepRecord") -> float:
        """One step over this rank's microbatches (`samples`, without pixels), padded to `seq_len`; returns the
        summed token loss on the last stage (nan elsewhere). `source` (stage 0 only) gives microbatch k's
        embeddings and takes their gradients back; the loss is multiplied by `loss_scale` at loss time."""
        self._loss_scale = loss_scale
        packs = [self.backbone.pack(s, None, seq_len) for s in samples]
        schedule = self._schedule(seq_len, len(packs))
        feed_timer = type(timer)()
        first = self.stage_module.is_first
        if first:
            if source is None:
                raise ValueError("pipeline stage 0 needs an EmbeddingSource")
            fetched: dict[int, PartEmbeds] = {}
            self.stage_module.feed = lambda k: self._feed(k, samples, packs, source, feed_timer, record, fetched)
        else:
            record["backbone_first_mb_start_t"] = time.time()
        try:
            total = timer.timed("busy", lambda: pipeline_step(schedule, self.stage_module, packs))
        finally:
            self.stage_module.feed = None  # the step's samples and source are not kept past the step
        # Time spent inside the schedule waiting for embeddings is waiting, not compute.
        timer.busy -= feed_timer.wait
        timer.wait += feed_timer.wait
        if total is None:
            return float("nan")
        return float(sum(float(x.detach()) for x in total)) / loss_scale

    def _feed(self, k: int, samples: list, packs: list, source: EmbeddingSource, timer: Timer,
              record: "StepRecord", fetched: dict[int, PartEmbeds]) -> torch.Tensor:
        leaves = fetched.get(k)
        if leaves is None:  # first request for microbatch k: take it from the source (a repeat reuses it)
            leaves = fetched[k] = source.fetch(k, timer)
            if k == 0:
                record["backbone_first_mb_start_t"] = time.time()
            for part, got in leaves.items():
                for sid, leaf in got.items():
                    if leaf.requires_grad and source.return_grad is not None:
                        # d(loss)/d(embedding) goes back the moment the schedule's backward computes it
                        # (a copy: autograd may reuse the hook's tensor)
                        leaf.register_hook(lambda grad, part=part, sid=sid: source.return_grad(part, sid,
                                                                                             grad.clone()))
        return self.backbone.image_dense(packs[k], model_embeds(leaves, samples[k]))
