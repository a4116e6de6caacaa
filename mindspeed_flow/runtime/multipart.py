"""Several encoder parts feeding one backbone (`parallel.encoders`, e.g. the Qwen2.5-Omni thinker's audio and
vision encoders): what one rank builds, the backbone's step, and the coupled baseline.

The encoder ranks run the ordinary producer loop (`StepEngine._produce`): each part encodes its own samples in
the order the backbone consumes them and puts one embedding per sample into the pool. A backbone rank gets, for
every microbatch, each part's embeddings from that part's producers (the pool keys items by producer, so two
parts' embeddings of one sample never collide), scatters all of them into the packed microbatch, and returns each
embedding's gradient to the rank that produced it. The global gradient norm spans every part (one all_reduce over
the world), as in the two-part runtime.

Limits (checked with a clear error before any group exists): every part runs data parallel only (no TP, no
pipeline backbone), and the encoders are trained (no frozen encoder).
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from mindspeed_flow.config.schema import FlowJobConfig
from mindspeed_flow.data.sample import VLMSample
from mindspeed_flow.hosts.torch import build_vlm, dp_loss_scale
from mindspeed_flow.hosts.torch.data_parallel import apply_ddp, grad_sync
from mindspeed_flow.hosts.torch.omni import split_omni
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.runtime.engine import RankModels, StepEngine, encode_samples
from mindspeed_flow.step.timer import Timer
from mindspeed_flow.telemetry.metrics import StepRecord
from mindspeed_flow.runtime.optim import ParamShare, PartOptimizer, build_optimizer
from mindspeed_flow.step.plan import StepWork
from mindspeed_flow.specs import encoder_parts
from mindspeed_flow.topology import Topology


def is_multipart(job: FlowJobConfig) -> bool:
    """The job's model has several encoder parts (then `parallel.encoders` names them)."""
    return len(encoder_parts(job.model.family)) > 1


def has_input(part: str, sample: VLMSample) -> bool:
    """Whether `part` has something to encode for `sample`."""
    if part == "audio":
        return bool(getattr(sample, "audio_token_counts", None))
    return bool(sample.image_token_counts)


def part_costs(dataset: Any, cost_model: Any) -> dict:
    """Per encoder part, sample id -> encoder work (0: nothing to encode): ViT cost for vision, mel frames for
    audio."""
    return {"vision": lambda sid: cost_model.encoder_cost(dataset.shape(sid))
            if dataset.shape(sid).num_images else 0.0,
            "audio": lambda sid: dataset.audio_cost(sid)}


class CoupledParts(torch.nn.Module):
    """Every encoder part + the backbone on one rank (the coupled baseline), one module under one DP wrapper.
    Parameter names are `<part>.<name>`, as the decoupled ranks name theirs."""

    def __init__(self, encoders: dict[str, torch.nn.Module], backbone: torch.nn.Module) -> None:
        super().__init__()
        self.encoder_names = list(encoders)
        for name, module in encoders.items():
            self.add_module(name, module)
        self.backbone = backbone

    def forward(self, samples: list[VLMSample], token_budget: int) -> tuple[torch.Tensor, int]:
        embeds = {name: [encode_samples(getattr(self, name), [s], True)[0] if has_input(name, s) else None
                         for s in samples] for name in self.encoder_names}
        packed = self.backbone.pack(samples, embeds, token_budget)
        return self.backbone(packed, embeds)


def build_multipart_rank(job: FlowJobConfig, topo: Topology, hf_cfg: dict, device: torch.device, dtype: torch.dtype,
                         opt_kwargs: dict) -> tuple[RankModels, PartOptimizer, Optional[Any], None]:
    """As `build.build_rank` for a model with several encoder parts: this rank's part only (all of them when
    coupled), DDP over the part's DP group, and the pool on decoupled ranks."""
    names = encoder_parts(job.model.family)
    wanted = (*names, "backbone") if topo.is_coupled else (topo.part,)
    model = build_vlm(job.model.family, hf_cfg, seed=job.seed, dtype=dtype, pretrained_path=job.model.pretrained_path,
                      parts=wanted)
    parts = split_omni(model)
    models, optim = RankModels(), PartOptimizer()
    if topo.is_coupled:
        coupled = CoupledParts({n: parts[n].to(device) for n in names}, parts["backbone"].to(device))
        # a rank's samples may hold no audio (or no image) in a step: that encoder is then unused there
        models.coupled_dp = apply_ddp(coupled, topo.dp_group, find_unused_parameters=True) \
            if topo.world_size > 1 else coupled
        models.dp_loss_scale = dp_loss_scale(topo.dp_group) if topo.world_size > 1 else 1.0
        optim.shares = [ParamShare([p for p in coupled.parameters() if p.requires_grad], replicas=topo.world_size)]
        optim.optimizer = build_optimizer(optim.shares[0].params, **opt_kwargs)
        models.named_params = dict(coupled.named_parameters())
        return models, optim, None, None
    pool = EmbeddingPool(rank=topo.rank, group=topo.pool_group, data_groups=topo.pool_data_groups,
                         capacity_bytes=int(job.flow.pool_capacity_mb * 2**20), timeout_s=job.flow.timeout_s,
                         device=device, return_grads=True, receive_ahead=job.flow.prefetch_embeddings)
    dp = topo.part_layout.dp
    part = parts[topo.part].to(device)
    trainable = [p for p in part.parameters() if p.requires_grad]
    optim.shares = [ParamShare(trainable, replicas=dp)]
    optim.optimizer = build_optimizer(trainable, **opt_kwargs)
    models.named_params = {f"{topo.part}.{n}": p for n, p in part.named_parameters()}
    if topo.is_encoder:
        models.encoder = part  # gradients summed over the part's DP group by the producer loop
    else:
        models.backbone_part = part
        models.backbone = apply_ddp(part, topo.dp_group) if dp > 1 else part
        models.dp_loss_scale = dp_loss_scale(topo.dp_group, models.backbone) if dp > 1 else 1.0
    return models, optim, pool, None  # None: the norm's group is the world (every part trains)


class MultiPartEngine(StepEngine):
    """`StepEngine` whose backbone takes every encoder part's embeddings (encoder and coupled ranks: unchanged)."""

    def _consume(self, work: StepWork, n_labels: int, record: StepRecord) -> None:
        timer = Timer()
        row = self._row(work)
        self.expect_embeds(work)  # every producer of every part, in its send order
        part, model = self.m.backbone_part, self.m.backbone
        seq_len = work.plan.seq_len or self.token_budget
        scale = self.m.dp_loss_scale / max(n_labels, 1)
        total = 0.0
        for k, mb in enumerate(row):
            leaves = {name: self._fetch_part(work, name, mb.sample_ids, timer) for name in work.producers}
            if k == 0:
                record["backbone_first_mb_start_t"] = time.time()
            samples = timer.timed("busy", lambda: self.load_samples(mb.sample_ids, with_pixels=False))
            with grad_sync(model, enabled=k == len(row) - 1):
                def fwd_bwd() -> float:
                    embeds = {name: [got.get(s.sample_id) for s in samples] for name, got in leaves.items()}
                    loss_sum, _ = model(part.pack(samples, embeds, seq_len), embeds)
                    (loss_sum * scale).backward()
                    return float(loss_sum.detach())
                total += timer.timed("busy", fwd_bwd)
            for name, got in leaves.items():
                producer_of = work.producers[name]
                for sid, leaf in got.items():
                    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    # the DP loss-scale compensation undone: the producer sums its DP group's gradients
                    grad = grad / self.m.dp_loss_scale if self.m.dp_loss_scale != 1.0 else grad
                    timer.timed("wait", lambda: self.pool.return_grad(grad.detach(), sample_id=sid, step=work.step,
                                                                      producer=producer_of[sid]))
        timer.timed("wait", self.pool.flush)
        record["loss_sum"], record["label_tokens"] = total, n_labels
        record["backbone_busy_s"], record["backbone_wait_s"] = timer.busy, timer.wait
        self._pool_stats(record)

    def _fetch_part(self, work: StepWork, name: str, sample_ids: list[int], timer: Timer) -> dict[int, torch.Tensor]:
        """One part's embeddings of a microbatch (blocking gets), as leaves that collect d(loss)/d(embedding)."""
        producer_of = work.producers[name]
        ids = work.in_put_order([sid for sid in sample_ids if sid in producer_of])
        embs = timer.timed("wait", lambda: self.pool.get_many([(sid, work.step, producer_of[sid]) for sid in ids]))
        got = {sid: emb.detach().requires_grad_(True) for sid, emb in zip(ids, embs)}
        return {sid: got[sid] for sid in sample_ids if sid in got}  # the microbatch's own order, as before

