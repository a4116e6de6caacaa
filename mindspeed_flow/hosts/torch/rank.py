"""Build what one rank runs, by small ordered steps (torchtitan style): model -> split -> freeze -> tensor
parallel -> place -> parallelize (DDP / FSDP2 / pipeline) -> optimizer -> pool.

Each rank materialises only the part it runs (the other parts' parameters stay on the meta device: an encoder
rank never allocates the LLM, an audio rank never the ViT); a coupled rank runs them all. A part's weights depend
only on the seed and the part (or come from the same local checkpoint), so all layouts and both modes start from
identical parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from mindspeed_flow.config.schema import FlowJobConfig
from mindspeed_flow.hosts.torch import apply_ddp, apply_fsdp, build_vlm, dp_loss_scale, split_vlm
from mindspeed_flow.hosts.torch.backbone_pipeline import BackbonePipeline
from mindspeed_flow.hosts.torch.engine import CoupledModel, RankModels
from mindspeed_flow.hosts.torch.omni import split_omni
from mindspeed_flow.hosts.torch.optim import ParamShare, PartOptimizer, build_optimizer
from mindspeed_flow.hosts.torch.tensor_parallel import apply_tensor_parallel, is_tp_sharded
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.specs import encoder_parts
from mindspeed_flow.step.layout import BACKBONE, ENCODER
from mindspeed_flow.topology import Topology

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def freeze_(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.requires_grad_(False)


def param_shares(params: list[torch.nn.Parameter], dp: int, tp: int) -> list[ParamShare]:
    """Gradient-norm shares: a TP-sharded parameter's gradient lives on its DP replicas; a replicated one (norms,
    embeddings, biases after an all-reduce) identically on every rank of the DP x TP block."""
    sharded = [p for p in params if is_tp_sharded(p)]
    replicated = [p for p in params if not is_tp_sharded(p)]
    shares = [ParamShare(replicated, replicas=dp * tp)]
    return shares + [ParamShare(sharded, replicas=dp)] if sharded else shares


def apply_tp(part: torch.nn.Module, job: FlowJobConfig, topo: Topology) -> None:
    """Split the part over its TP group; the part's TP leader prints each overlap choice (and why) once."""
    if topo.part_layout.tp > 1:
        def announce(line: str) -> None:
            print(f"[mindspeed-flow] {topo.part} tp={topo.part_layout.tp} (rank {topo.rank}): {line}", flush=True)

        apply_tensor_parallel(part, topo.tp_group, impl=job.parallel.tp_overlap,
                              chunks=job.parallel.tp_overlap_chunks,
                              announce=announce if topo.rank == topo.tp_leader and topo.dp_rank == 0 else None)


def split_parts(model: torch.nn.Module, family: str) -> dict[str, torch.nn.Module]:
    """The model's parts by name: every encoder part (one, "encoder", for a VLM; "audio" and "vision" for the
    Omni thinker) and "backbone"."""
    if len(encoder_parts(family)) > 1:
        return split_omni(model)
    encoder, backbone = split_vlm(model)
    return {ENCODER: encoder, BACKBONE: backbone}


@dataclass
class RankParts:
    """What `build_rank` gives a rank: its models, its optimizer over its parameter shares, the pool (decoupled
    ranks), and the group its gradient norm spans (None: the world, every rank trains)."""

    models: RankModels
    optim: PartOptimizer
    pool: Optional[EmbeddingPool] = None
    norm_group: Optional[dist.ProcessGroup] = None


def build_rank(job: FlowJobConfig, topo: Topology, hf_cfg: dict, device: torch.device) -> RankParts:
    dtype = DTYPES[job.model.dtype]
    t = job.trainer
    opt_kwargs = dict(lr=t.lr, betas=(float(t.betas[0]), float(t.betas[1])), weight_decay=t.weight_decay, eps=t.adam_eps)
    names = encoder_parts(job.model.family)
    model = build_vlm(job.model.family, hf_cfg, seed=job.seed, dtype=dtype, pretrained_path=job.model.pretrained_path,
                      parts=(*names, BACKBONE) if topo.is_coupled else (topo.part,))
    parts = split_parts(model, job.model.family)
    frozen = job.model.freeze_encoder  # one switch for every encoder part
    if frozen:
        for name in names:
            freeze_(parts[name])
    models = RankModels(frozen_encoder=frozen)
    optim = PartOptimizer()

    if topo.is_coupled and topo.part_layout.pp > 1:
        return _build_coupled_pipeline(job, topo, parts[ENCODER], parts[BACKBONE], device, models, optim, opt_kwargs)
    if topo.is_coupled:
        coupled = CoupledModel({n: parts[n].to(device) for n in names}, parts[BACKBONE].to(device), frozen)
        # several encoder parts: a rank's samples may hold no audio (or no image) in a step, that encoder is then
        # unused there
        models.coupled_dp = apply_ddp(coupled, topo.dp_group, find_unused_parameters=len(names) > 1) \
            if topo.world_size > 1 else coupled
        models.dp_loss_scale = dp_loss_scale(topo.dp_group) if topo.world_size > 1 else 1.0
        optim.shares = [ParamShare([p for p in coupled.parameters() if p.requires_grad], replicas=topo.world_size)]
        optim.optimizer = build_optimizer(optim.shares[0].params, **opt_kwargs)
        models.named_params = dict(coupled.named_parameters())
        return RankParts(models, optim)  # default (world) group for the norm

    pool = EmbeddingPool(rank=topo.rank, group=topo.pool_group, data_groups=topo.pool_data_groups,
                         capacity_bytes=int(job.flow.pool_capacity_mb * 2**20), timeout_s=job.flow.timeout_s,
                         device=device, return_grads=not frozen, receive_ahead=job.flow.prefetch_embeddings)
    tp = topo.part_layout.tp
    if topo.is_encoder:
        encoder = parts[topo.part]
        apply_tp(encoder, job, topo)
        models.encoder = encoder.to(device)
        params = [p for p in encoder.parameters() if p.requires_grad]
        optim.shares = param_shares(params, topo.part_layout.dp, tp)
        optim.optimizer = build_optimizer(params, **opt_kwargs)
        models.named_params = {f"{topo.part}.{n}": p for n, p in encoder.named_parameters()}
    else:
        backbone = parts[BACKBONE]
        apply_tp(backbone, job, topo)
        backbone = backbone.to(device)
        models.backbone_part = backbone
        bb = topo.part_layout
        if bb.pp > 1:
            models.pipeline = BackbonePipeline.build(job, topo, backbone, device)
            stage_params = models.pipeline.parameters()
            # the stage module holds the FSDP units (if any): their measured reduction sets the scale
            models.dp_loss_scale = dp_loss_scale(topo.dp_group, models.pipeline.stage_module) if bb.dp > 1 else 1.0
            optim.shares = param_shares(stage_params, bb.dp, tp)
        else:
            if bb.dp > 1 and job.parallel.backbone_dp_impl == "fsdp":
                models.backbone = apply_fsdp(backbone, topo.dp_group)
                optim.shares = [ParamShare(list(models.backbone.parameters()))]
            else:
                models.backbone = apply_ddp(backbone, topo.dp_group) if bb.dp > 1 else backbone
                optim.shares = param_shares(list(backbone.parameters()), bb.dp, tp)
            models.dp_loss_scale = dp_loss_scale(topo.dp_group, models.backbone) if bb.dp > 1 else 1.0
        optim.optimizer = build_optimizer(optim.params, **opt_kwargs)
        # Name each parameter this rank holds by its place in the whole backbone (a pipeline stage holds a slice).
        held = {id(p) for p in optim.params}
        models.named_params = {f"backbone.{n}": p for n, p in backbone.named_parameters() if id(p) in held}
    # A frozen encoder has no gradients: the norm is the backbone's alone, reduced over the backbone ranks, and
    # the encoder never joins that collective (so it can run ahead).
    norm_group = topo.part_group if frozen else None
    return RankParts(models, optim, pool, norm_group)


def _build_coupled_pipeline(job: FlowJobConfig, topo: Topology, encoder: torch.nn.Module, backbone: torch.nn.Module,
                            device: torch.device, models: RankModels, optim: PartOptimizer, opt_kwargs: dict
                            ) -> RankParts:
    """Coupled pipeline: stage 0 holds the ViT (+ merger) and its LLM layers, the last stage the LM head; the same
    torch.distributed.pipelining path as a decoupled backbone, DDP over each stage's DP group."""
    backbone = backbone.to(device)
    first = topo.pp_rank == 0
    models.encoder = encoder.to(device) if first else None
    models.backbone_part = backbone
    models.pipeline = BackbonePipeline.build(job, topo, backbone, device, encoder=models.encoder)
    layout = topo.part_layout
    models.dp_loss_scale = dp_loss_scale(topo.dp_group, models.pipeline.stage_module) if layout.dp > 1 else 1.0
    params = [p for p in models.pipeline.parameters() if p.requires_grad]
    optim.shares = param_shares(params, layout.dp, 1)
    optim.optimizer = build_optimizer(params, **opt_kwargs)
    # the layout-independent names of the coupled DP path (`encoder.*`, `backbone.*`) for what this stage holds
    held = {id(p) for p in models.pipeline.parameters()}
    models.named_params = {f"backbone.{n}": p for n, p in backbone.named_parameters() if id(p) in held}
    if models.encoder is not None:
        models.named_params.update({f"encoder.{n}": p for n, p in models.encoder.named_parameters()})
    return RankParts(models, optim)  # default (world) group for the norm
