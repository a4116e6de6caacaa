"""Backbone pipeline parallelism with torch.distributed.pipelining (PipelineStage + GPipe / 1F1B).

Layout of a stage (`BackboneStage`): a contiguous range of decoder layers; stage 0 also owns embed_tokens and
the last stage owns the final norm and lm_head, so DDP/FSDP wrapping a stage covers every backbone parameter
exactly once over the pipeline.

Inputs per microbatch, all with the microbatch as dim 0 so that `schedule.step` chunks them:
- stage 0's positional input is the microbatch index as a [1, 1] tensor (the schedule needs a tensor to chunk,
  and the index survives the extra forward torch runs on meta inputs to infer shapes). Its forward asks
  `BackboneStage.feed(k)` for microbatch k's *dense image tensor* [1, T, H] (zeros except the image embeddings
  at the placeholder positions, `BackbonePart.image_dense`) when the schedule runs that forward, and merges it
  with its own token embeddings (`embed_dense`: the same values and gradients as scattering). The dense tensor
  stays attached to the embeddings, so the schedule's backward reaches them (and an encoder's graph behind
  them) directly; a caller can stream: feed(k) may block until microbatch k's embeddings exist.
- keyword inputs reach EVERY stage: torch.distributed.pipelining passes `step(**kwargs)` chunks to the local
  stage's forward on every rank (2.13 documents "kwargs can be passed to all stages via respective step
  calls"; 2.7's forward_one_chunk does the same), so each rank calls `pipeline_step` with the same packed
  microbatches (every rank knows the step plan) and the position ids / segment ids never travel between stages.
- the last stage returns logits and the schedule's loss_fn is the summed token cross entropy; gradient
  scaling by the number of microbatches is switched off (`scale_grads=False`), the runtime divides by the
  global label-token count itself.

A PipelineStage fixes its activation shapes on its first step (its receive buffers), so all microbatches of one
schedule share one length; a caller that changes the length builds a new PipelineStage over the same stage
module (`hosts.torch.backbone_pipeline.BackbonePipeline` keeps one per (length, microbatch count)).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mindspeed_flow import torch_compat
from mindspeed_flow.hosts.torch.attention import Segments
from mindspeed_flow.hosts.torch.packed import PackedBatch, stack_position_ids, unstack_position_ids
from mindspeed_flow.hosts.torch.split import BackbonePart, token_loss_sum

SCHEDULE_KINDS = ("1f1b", "gpipe")


def split_layers(n_layers: int, pp_size: int, layer_split: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """[start, stop) layer range per stage: `layer_split` (layers per stage) or an even split, extra layers to
    the middle stages first (stage 0 also embeds and the last stage also runs lm_head)."""
    if pp_size < 1 or pp_size > n_layers:
        raise ValueError(f"parallel.backbone.pp={pp_size} must be between 1 and the number of layers ({n_layers})")
    if layer_split is None:
        counts = [n_layers // pp_size] * pp_size
        order = list(range(1, pp_size - 1)) + [0, pp_size - 1] if pp_size > 2 else list(range(pp_size))
        for k in range(n_layers % pp_size):
            counts[order[k]] += 1
    else:
        counts = list(layer_split)
        if len(counts) != pp_size or sum(counts) != n_layers or min(counts) < 1:
            raise ValueError(f"parallel.backbone.layer_split={counts} must give >= 1 layer to each of the "
                             f"{pp_size} stages and sum to {n_layers} layers")
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


class BackboneStage(nn.Module):
    """Decoder layers [start, stop) of a BackbonePart; embeddings on the first stage, norm + lm_head on the last."""

    def __init__(self, backbone: BackbonePart, start: int, stop: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.layer_range = (start, stop)
        self.layers = nn.ModuleList(list(backbone.layers[start:stop]))
        self.rotary_emb = backbone.rotary_emb  # buffers only
        if is_first:
            self.embed_tokens = backbone.embed_tokens
        if is_last:
            self.norm = backbone.norm
            self.lm_head = backbone.lm_head
        self._backbone = (backbone,)  # helpers (masks, image id); not a submodule: its other layers are not ours
        # first stage: microbatch index -> dense image tensor [1, T, H] (set by the caller for each step)
        self.feed: Optional[Callable[[int], torch.Tensor]] = None

    def forward(self, x: torch.Tensor, input_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        backbone = self._backbone[0]
        if self.is_first:
            x = torch.where(backbone.image_mask(input_ids), self._dense(x, input_ids), self.embed_tokens(input_ids))
        x = backbone.run_layers(x, unstack_position_ids(position_ids, backbone.mrope),
                                Segments.from_segment_ids(segment_ids), self.layers)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x

    def _dense(self, index: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if index.device.type == "meta":
            # Shape inference on the first step runs on meta copies of the inputs: a meta image tensor of the
            # real shape, and the feed is not asked.
            return torch.empty(*input_ids.shape, self.embed_tokens.embedding_dim,
                               dtype=self.embed_tokens.weight.dtype, device="meta")
        if self.feed is None:
            raise RuntimeError("pipeline stage 0 has no feed: set BackboneStage.feed before pipeline_step")
        return self.feed(int(index.reshape(-1)[0].item()))


def build_backbone_stage(backbone: BackbonePart, pp_rank: int, pp_size: int, pp_group: Optional[dist.ProcessGroup],
                         device: torch.device, layer_split: Optional[Sequence[int]] = None,
                         wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
                         encoder: Optional[nn.Module] = None) -> tuple[BackboneStage, "PipelineStage"]:
    """(stage module, PipelineStage) for this rank's stage of `pp_size`.

    `wrap`: data parallelism for the stage, e.g. `lambda m: apply_ddp(m, dp_group)` or `apply_fsdp`; the
    PipelineStage then drives the wrapper (no_sync / deferred reduce until the last microbatch). The returned
    stage module is the unwrapped one (for `pipeline_step` and parameter lists). Activation shapes are inferred
    on the PipelineStage's first step (2.13's static mode needs gradient shapes too, which 2.7 lacks).

    `encoder` (stage 0 of a coupled pipeline): the ViT (+ merger) becomes a submodule of the stage, so the DP
    wrapper reduces its gradients and `parameters()` lists them; `feed` runs it inside the stage's forward.
    """
    from torch.distributed.pipelining import PipelineStage  # lazy: pipelining

    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{pp_size - 1}")
    if pp_size > 1 and backbone.tied_embeddings:
        raise ValueError("tie_word_embeddings=True with parallel.backbone.pp > 1: embed_tokens (stage 0) and lm_head "
                         "(last stage) would be one parameter on two ranks; untie it in the model config")
    start, stop = split_layers(len(backbone.layers), pp_size, layer_split)[pp_rank]
    torch_compat.prepare_pipelining()  # at build time, so the start-up line names what this torch lacks
    module = BackboneStage(backbone, start, stop, is_first=pp_rank == 0, is_last=pp_rank == pp_size - 1).to(device)
    if encoder is not None:
        if pp_rank != 0:
            raise ValueError(f"the encoder belongs to pipeline stage 0, not stage {pp_rank}")
        module.encoder = encoder.to(device)
    wrapped = wrap(module) if wrap is not None else module
    return module, PipelineStage(wrapped, pp_rank, pp_size, device, group=pp_group)


def make_schedule(stage: "PipelineStage", n_microbatches: int,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
                  kind: str = "1f1b"):
    """A "gpipe" or "1f1b" schedule over one stage per rank, bound to `n_microbatches` (a schedule object
    serves one microbatch count)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe  # lazy: pipelining

    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"parallel.backbone.pp_schedule={kind!r} is not supported; choose one of {SCHEDULE_KINDS}")
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[kind]
    torch_compat.ensure_pipeline_p2p_waits_all()  # torch 2.7 on gloo: 1F1B would deadlock otherwise
    return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, **torch_compat.schedule_kwargs(cls))


def pipeline_step(schedule, stage_module: BackboneStage, packs: Sequence[PackedBatch]
                  ) -> Optional[list[torch.Tensor]]:
    """One forward+backward of all microbatches through this rank's stage.

    Every pipeline rank calls this with the same `packs` (in order); stage 0's `feed` gives the image inputs.
    Returns the per-microbatch summed losses on the rank holding the last stage, None elsewhere.
    """
    is_first, is_last = stage_module.is_first, stage_module.is_last
    n = getattr(schedule, "_n_microbatches", len(packs))
    if len(packs) != n:
        raise ValueError(f"schedule is bound to {n} microbatches but the step has {len(packs)} packed microbatches")
    device = next(stage_module.parameters()).device
    # kwargs reach every local stage; non-first stages ignore input_ids
    kwargs = {"position_ids": stack_position_ids(packs).to(device),
              "segment_ids": torch.cat([p.segment_ids for p in packs]).to(device)}
    args: tuple = ()
    if is_first:
        if stage_module.feed is None:
            raise ValueError("pipeline stage 0 needs BackboneStage.feed (microbatch index -> dense image tensor)")
        args = (torch.arange(len(packs), dtype=torch.float32, device=device).view(-1, 1),)
        kwargs["input_ids"] = torch.cat([p.input_ids for p in packs]).to(device)
    step_kwargs = torch_compat.step_kwargs(schedule)
    if is_last:
        losses: list[torch.Tensor] = []
        target = torch.cat([p.labels for p in packs]).to(device)
        schedule.step(*args, target=target, losses=losses, **step_kwargs, **kwargs)
        return losses
    schedule.step(*args, **step_kwargs, **kwargs)
    return None
