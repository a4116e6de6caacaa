"""The step engine: producer loop on encoder ranks, consumer loop on backbone ranks, and the
coupled baseline, sharing the plan, the loss normalisation and the optimizer code.

Loss: the global per-token mean over the step's label tokens. Each backbone microbatch contributes
loss_sum / N (N known to every rank from the plan), so how samples are grouped into microbatches, ranks or
modes never changes the loss or the gradients (up to float summation order).

DP wrappers (DDP / FSDP2) average gradients over their group, so the backward loss is multiplied by the group
size and the embedding gradients returned to encoders are divided by it again.

Encoder parts: a VLM has one ("encoder"); the Qwen2.5-Omni thinker has two ("audio", "vision"). Every encoder rank
runs one part's producer loop; a backbone rank (a pipeline's first stage) takes, for each microbatch, every part's
embeddings from that part's producers (the pool keys items by producer, so two parts' embeddings of one sample never
collide) and returns each embedding's gradient to the rank that produced it.

Tensor parallelism: only TP rank 0 of a part (the leader) talks to the pool. Its TP peers compute the same
thing on replicated activations: a backbone peer receives the leader's embeddings by broadcast, an encoder peer
encodes the leader's samples and receives the returned gradients by broadcast; only the leader returns gradients
and reports the loss.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.config.schema import FlowJobConfig
from mindspeed_flow.data.base import VLMDataset
from mindspeed_flow.data.prefetch import prefetch_samples
from mindspeed_flow.data.sample import VLMSample
from mindspeed_flow.hosts.torch.data_parallel import allreduce_grads_, grad_sync
from mindspeed_flow.hosts.torch.optim import PartOptimizer, lr_at
from mindspeed_flow.hosts.torch.tensor_parallel import broadcast_like, broadcast_rows
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.step.held import HeldPeak, SavedBytes
from mindspeed_flow.step.layout import AUDIO, ENCODER
from mindspeed_flow.step.plan import StepWork
from mindspeed_flow.step.timer import Timer
from mindspeed_flow.telemetry.metrics import StepRecord
from mindspeed_flow.telemetry.trace import traced
from mindspeed_flow.topology import Topology

# encoder part -> sample id -> that part's embedding of the sample (samples the part encodes something for)
PartEmbeds = Mapping[str, Mapping[int, torch.Tensor]]


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm is NaN/Inf: the optimizer step is refused."""


@dataclass
class RankModels:
    """What one rank runs. Decoupled encoder: its encoder part; decoupled backbone: backbone (+ pipeline);
    coupled: every part, wrapped together in one DP module (`coupled_dp`)."""

    encoder: Optional[torch.nn.Module] = None  # this rank's encoder part (a coupled pipeline's stage 0: the ViT)
    backbone: Optional[torch.nn.Module] = None  # the (possibly DDP/FSDP-wrapped) backbone part, pp == 1
    backbone_part: Optional[Any] = None  # unwrapped BackbonePart (pack/embed helpers)
    coupled_dp: Optional[torch.nn.Module] = None
    pipeline: Optional[Any] = None  # hosts.torch.backbone_pipeline.BackbonePipeline when pp > 1
    # the loss multiplier that makes the DP wrapper's reduction a SUM of gradients: the DP size where it averages,
    # 1 where it sums (FSDP2 on gloo in torch 2.7.1); returned embedding gradients are divided by it again
    dp_loss_scale: float = 1.0
    frozen_encoder: bool = False  # model.freeze_encoder: every encoder part
    # this rank's parameters under the layout-independent names `<part>.<name>` (`encoder.*` / `audio.*`,
    # `vision.*`, and `backbone.*`)
    named_params: dict = field(default_factory=dict)


@dataclass
class EmbeddingSource:
    """What a pipeline's first stage needs from the step, and nothing more: `fetch(k, timer)` gives microbatch
    k's embeddings of every encoder part by sample id (blocking on the pool), `return_grad(part, sample_id, grad)`
    sends d(loss)/d(embedding) back to the producer of that part's embedding of the sample."""

    fetch: Callable[[int, "Timer"], PartEmbeds]
    # None: the embeddings are computed on this rank (coupled pipeline) and their gradients stay in the graph
    return_grad: Optional[Callable[[str, int, torch.Tensor], None]]


def model_embeds(per_part: PartEmbeds, samples: Sequence[VLMSample]) -> Any:
    """A microbatch's embeddings as a backbone part takes them: one tensor (or None) per sample, as a list for a
    VLM's one part, as a part -> list mapping for several (the Omni backbone scatters each at its own token)."""
    embeds = {part: [got.get(s.sample_id) for s in samples] for part, got in per_part.items()}
    if set(embeds) <= {ENCODER}:
        return embeds.get(ENCODER, [None] * len(samples))
    return embeds


def has_input(part: str, sample: VLMSample) -> bool:
    """Whether encoder part `part` has something to encode for `sample` (audio clips for an audio part, images
    otherwise)."""
    if part == AUDIO:
        return bool(getattr(sample, "audio_token_counts", None))
    return bool(sample.image_token_counts)


@traced("encoder.forward")
def encode_samples(encoder: Any, samples: list[VLMSample], trainable: bool) -> list[torch.Tensor]:
    """One encoder forward over the samples' images; one embedding tensor per sample."""
    with torch.set_grad_enabled(trainable):
        return encoder.encode_many(samples)


def encode_groups(sample_ids: list[int], patches: list[int], budget: int,
                  slots: Optional[list[int]] = None) -> list[list[int]]:
    """Consecutive runs of `sample_ids` of at most `budget` encoder input positions each (`patches`: ViT patches,
    or mel frames for an audio part; order kept; a sample over the budget alone); budget 0: one sample per group.
    `slots` (each sample's consumer microbatch slot): a group
    never spans two slots, so a slot's embeddings never wait for a later slot's encoding and the encoder's bound
    (`flow.encoder_inflight`, in slots) can free a group with its slot."""
    groups: list[list[int]] = []
    load = 0
    for i, (sid, n) in enumerate(zip(sample_ids, patches)):
        same_slot = slots is None or (i > 0 and slots[i] == slots[i - 1])
        if groups and budget and load + n <= budget and same_slot:
            groups[-1].append(sid)
            load += n
        else:
            groups.append([sid])
            load = n
    return groups


@dataclass
class _HeldGroup:
    """One encoder forward whose gradients have not come back yet."""

    sample_ids: list[int]
    slot: int  # the consumer microbatch slot of its samples (a group never spans two)
    kept: Any  # graph-holding embeddings, or the samples to recompute them from
    likes: list[tuple]  # (shape, dtype, device) per embedding: what a TP peer's gradient broadcast receives
    nbytes: int  # saved-activation bytes of its graph (0 when recomputing)


@dataclass(frozen=True)
class EngineSettings:
    """The step engine's knobs, from the recipe (`EngineSettings.from_job`)."""

    token_budget: int  # packing.token_budget: tokens per packed backbone microbatch
    grad_clip: float  # trainer.grad_clip: the global gradient norm's bound (0: none)
    base_lr: float
    warmup_steps: int
    prefetch_depth: int = 2  # data.prefetch_depth: steps of pixels read ahead
    # flow.keep_encoder_activations: hold each sample's encoder graph until its gradient returns (else recompute)
    keep_encoder_activations: bool = True
    encoder_batch_tokens: int = 0  # flow.encoder_batch_tokens: samples encoded together up to this many patches
    # flow.encoder_inflight: consumer microbatch slots whose encoder graphs this rank holds at once (0: the whole
    # step); see StepEngine._produce for why the unit is a slot and which bound cannot deadlock.
    encoder_inflight: int = 0
    # trainer.nan_policy: "stop" raises at the first non-finite gradient norm; "skip" drops that step's update and
    # raises only after more than `max_nonfinite_steps` such steps in a row.
    nan_policy: str = "stop"
    max_nonfinite_steps: int = 0

    @staticmethod
    def from_job(job: FlowJobConfig) -> "EngineSettings":
        t = job.trainer
        return EngineSettings(token_budget=job.packing.token_budget, grad_clip=t.grad_clip, base_lr=t.lr,
                              warmup_steps=t.warmup_steps, prefetch_depth=job.data.prefetch_depth,
                              keep_encoder_activations=job.flow.keep_encoder_activations,
                              encoder_batch_tokens=job.flow.encoder_batch_tokens,
                              encoder_inflight=job.flow.encoder_inflight, nan_policy=t.nan_policy,
                              max_nonfinite_steps=t.max_nonfinite_steps)


class StepEngine:
    """Runs one step on this rank: the producer, consumer or coupled path, then the optimizer step."""

    def __init__(self, *, topo: Topology, models: RankModels, pool: Optional[EmbeddingPool], dataset: VLMDataset,
                 optim: PartOptimizer, norm_group: Optional[dist.ProcessGroup], settings: EngineSettings) -> None:
        self.topo, self.m, self.pool, self.dataset = topo, models, pool, dataset
        self.optim, self.norm_group = optim, norm_group
        self.settings = settings
        self.nonfinite_in_a_row = 0
        self.skipped_nonfinite = False
        self._texts: dict[int, VLMSample] = {}

    @property
    def tp(self) -> int:
        return self.topo.part_layout.tp

    @property
    def is_tp_leader(self) -> bool:
        """TP rank 0 of this rank's part: the rank that puts to / gets from the pool."""
        return self.topo.rank == self.topo.tp_leader

    # ------------------------------------------------------------------------------------------------------
    @traced("step")
    def run_step(self, work: StepWork, record: StepRecord) -> None:
        record["step_start_t"] = time.time()
        if self.topo.is_encoder:
            self._produce(work, record)
        else:
            n_labels = self._load_texts(work)
            if self.topo.is_backbone:
                self._consume(work, n_labels, record)
            else:
                self._coupled(work, n_labels, record)
        self._optimizer_step(work.step, record)
        record["step_end_t"] = time.time()

    def _row(self, work: StepWork) -> list:
        """This rank's microbatches: its DP replica's row (backbone and coupled ranks alike)."""
        return work.plan.microbatches[self.topo.dp_rank]

    def _load_texts(self, work: StepWork) -> int:
        """Load this rank's own samples without pixels (kept for the step) and return the step's label tokens,
        the loss normaliser: each DP replica counts its own row, one all-reduce adds them up (no rank reads the
        whole global batch; samples the plan skipped as oversize are in no row)."""
        self._texts = {sid: self.dataset.sample(sid, with_pixels=False)
                       for mb in self._row(work) for sid in mb.sample_ids}
        count = torch.tensor([sum(t.label_tokens for t in self._texts.values())], dtype=torch.int64,
                             device=self._device())
        if len(self.topo.dp_ranks) > 1:
            dist.all_reduce(count, group=self.topo.dp_group)
        return int(count.item())

    def _device(self) -> torch.device:
        p = next(iter(self.m.named_params.values()), None)
        return p.device if p is not None else torch.device("cpu")

    # --- encoder ranks ---------------------------------------------------------------------------------------
    # A frozen encoder never waits for gradients and does not flush per step: it runs ahead into the next
    # steps, bounded by the pool's capacity (credits), and the pool is drained once at the end (close()).
    #
    # The bound (flow.encoder_inflight = B > 0) counts consumer microbatch slots: a trainable encoder holds the
    # graphs (or, recomputing, the inputs) of samples from at most B consecutive slots of the step plan; before it
    # encodes a group of slot t it retires (waits for the gradients of, runs the backward of, frees) every held
    # group of a slot <= t - B, oldest first. Why slots, not samples or groups: a consumer returns a sample's
    # gradient only after the backward of that sample's microbatch, which needs every embedding of that
    # microbatch (from every producer) and, under 1F1B on a backbone pipeline of depth pp, the embeddings of the
    # next pp - 1 microbatches as well (stage 0 forwards pp microbatches before its first backward). A bound in
    # samples or groups could make an encoder wait for a gradient whose microbatch still needs a sample that the
    # same encoder has not encoded. In slots it cannot, once B >= W (W = pp, 1 without a pipeline; GPipe needs the
    # whole step, so config refuses a bound there): let s be the lowest slot any encoder waits on. Every encoder
    # puts every sample of slots < s + B without waiting for a gradient (one that waits on slot s' >= s is about
    # to encode slot >= s' + B), so all of slots s .. s + W - 1 reach the pool; a put that waits for pool credits waits
    # for an item of a lower slot, which its consumer takes when it forwards that slot; the DP gradient
    # reductions are collectives at the same slot on every consumer (the plan gives every DP rank the same
    # number of microbatches), so the backward of slot s runs everywhere and its gradients come back. Encoder TP
    # peers retire at the same points (the rule reads only the plan), so their broadcasts pair up with the
    # leader's. Groups (flow.encoder_batch_tokens) never span two slots, for the same reason.
    @traced("encoder.produce")
    def _produce(self, work: StepWork, record: StepRecord) -> None:
        timer, trainable = Timer(), not self.m.frozen_encoder
        # keep: hold each sample's autograd graph until its gradient returns (memory grows with the samples in
        # flight); recompute: forward without a graph now, forward again with one when the gradient arrives
        # (one extra ViT forward per sample; the ViT has no dropout, so the recomputed forward is identical).
        keep = trainable and self.settings.keep_encoder_activations
        leader = self.is_tp_leader
        order = work.encode_order.get(self.topo.tp_leader, [])  # TP peers encode their leader's samples
        slot_of = work.slot_of()
        # Several samples per forward (flow.encoder_batch_tokens), in encode order and within one consumer
        # microbatch slot: each group's embeddings go to the pool as soon as the group is encoded, and its
        # backward runs once all its gradients are back.
        patches = [self._input_positions(sid) if self.settings.encoder_batch_tokens else 0 for sid in order]
        groups = encode_groups(order, patches, self.settings.encoder_batch_tokens, slots=[slot_of[sid] for sid in order])
        held: deque[_HeldGroup] = deque()
        peak = HeldPeak()
        peak_slots = 0
        bound = self.settings.encoder_inflight if trainable else 0
        # Pixels are decoded/generated in a background thread while the encoder computes.
        loader = iter(prefetch_samples(self.dataset, order, with_pixels=True, depth=self.settings.prefetch_depth))
        for group in groups:
            slot = slot_of[group[0]]
            while bound and held and slot - held[0].slot >= bound:
                self._retire(work, held.popleft(), peak, timer)
            samples = [timer.timed("wait", lambda: next(loader)) for _ in group]
            saved = SavedBytes()
            with saved.counting() if keep else contextlib.nullcontext():
                embs = timer.timed("busy", lambda: encode_samples(self.m.encoder, samples, keep))
            if leader:
                # One put_many per consumer: the forward's output (per-sample views of one tensor) leaves as one
                # message, uncopied when its samples go to one consumer. The graph (if kept) stays here.
                for consumer in dict.fromkeys(work.consumer_of[sid] for sid in group):
                    mine = [(sid, emb.detach()) for sid, emb in zip(group, embs) if work.consumer_of[sid] == consumer]
                    timer.timed("wait", lambda: self.pool.put_many([e for _, e in mine], sample_ids=[
                        sid for sid, _ in mine], step=work.step, consumer=consumer))
            if trainable:
                held.append(_HeldGroup(group, slot, embs if keep else samples,
                                       [(e.shape, e.dtype, e.device) for e in embs], saved.total))
                peak.add(saved.total, len(group))
                peak_slots = max(peak_slots, slot - held[0].slot + 1)
        record["encoder_last_sample_done_t"] = time.time()
        record["encoder_samples"] = len(order)
        record["encoder_forwards"] = len(groups)
        while held:  # gradients come back in consumption order, as they are computed
            self._retire(work, held.popleft(), peak, timer)
        if trainable:
            timer.timed("wait", self.pool.flush)
            # Encoder DP ranks encoded different samples: their gradients add up (the loss normalisation
            # is already global), so sum rather than average.
            timer.timed("wait", lambda: allreduce_grads_(self.optim.params, self.topo.dp_group, average=False))
        record["encoder_busy_s"], record["encoder_wait_s"] = timer.busy, timer.wait
        # What the encoder held at once this step: samples, consumer microbatch slots (<= flow.encoder_inflight
        # when it is set) and saved-activation bytes (0 when recomputing: no graph is held).
        record["encoder_held_peak"] = peak.peak_samples
        record["encoder_held_slots_peak"] = peak_slots
        record["encoder_held_bytes_peak"] = peak.peak_bytes
        self._pool_stats(record)

    def _input_positions(self, sid: int) -> int:
        """What flow.encoder_batch_tokens counts of one sample: the encoder's input length, ViT patches for an
        image part, mel frames for an audio part (the Omni dataset's audio cost)."""
        if self.topo.part == AUDIO:
            return int(self.dataset.audio_cost(sid))
        return self.dataset.shape(sid).vit_patches

    def _retire(self, work: StepWork, entry: "_HeldGroup", peak: HeldPeak, timer: Timer) -> None:
        """The held group's gradients (the leader from the pool, TP peers by broadcast from it), then its
        backward; its graph is freed with it."""
        grads: list = [None] * len(entry.sample_ids)
        if self.is_tp_leader:
            grads = [timer.timed("wait", lambda: self.pool.wait_grad(sample_id=sid, step=work.step,
                                                                     consumer=work.consumer_of[sid]))
                     for sid in entry.sample_ids]
        if self.tp > 1:  # TP peers run the same backward with the leader's gradients
            grads = [timer.timed("wait", lambda: broadcast_like(g, like, self.topo.tp_group))
                     for g, like in zip(grads, entry.likes)]
        keep = self.settings.keep_encoder_activations

        def backward() -> None:
            embs = entry.kept if keep else encode_samples(self.m.encoder, entry.kept, True)
            torch.autograd.backward(embs, [g.to(e.dtype) for g, e in zip(grads, embs)])

        timer.timed("busy", backward)
        entry.kept = None  # the graph (or the samples to recompute) goes now, not when the step ends
        peak.drop(entry.nbytes, len(entry.sample_ids))

    # --- backbone ranks ---------------------------------------------------------------------------------------
    @traced("backbone.consume")
    def _consume(self, work: StepWork, n_labels: int, record: StepRecord) -> None:
        timer = Timer()
        row = self._row(work)
        if self.topo.is_first_stage and self.is_tp_leader:  # only the first stage's TP leader uses the pool
            self.expect_embeds(work)
        if self.m.pipeline is not None:
            samples = [timer.timed("busy", lambda mb=mb: self.load_samples(mb.sample_ids, with_pixels=False))
                       for mb in row]
            source = None
            if self.topo.is_first_stage:
                source = EmbeddingSource(fetch=lambda k, t: self.fetch_embeds(work, row[k].sample_ids, t),
                                         return_grad=lambda part, sid, g: self.return_grad(work, part, sid, g))
            loss_sum = self.m.pipeline.run(samples, work.plan.seq_len or self.settings.token_budget,
                                           self.m.dp_loss_scale / max(n_labels, 1), source, timer, record)
            if source is not None and self.is_tp_leader:
                timer.timed("wait", self.pool.flush)
        else:
            loss_sum = self._consume_flat(work, row, n_labels, timer, record)
        # TP peers computed the same loss: one of them reports it (the metrics sum it over ranks).
        record["loss_sum"] = loss_sum if self.topo.tp_rank == 0 else float("nan")
        record["label_tokens"] = n_labels
        record["backbone_busy_s"], record["backbone_wait_s"] = timer.busy, timer.wait
        self._pool_stats(record)

    def expect_embeds(self, work: StepWork) -> None:
        """Tell the pool what each producer will send this rank, in the producer's send (encode) order, so it can
        receive ahead (prefetch) and check that both sides agree on the plan."""
        me = self.topo.rank
        for producer, order in work.encode_order.items():
            items = [(sid, work.step) for sid in order if work.consumer_of[sid] == me]
            if items:
                self.pool.expect(producer=producer, items=items)

    def fetch_embeds(self, work: StepWork, sample_ids: list[int], timer: Timer) -> dict[str, dict[int, torch.Tensor]]:
        """Every encoder part's embeddings of these samples, part by part: blocking gets from the pool (TP peers:
        the leader's, by broadcast), as leaves that collect d(loss)/d(embedding)."""
        out: dict[str, dict[int, torch.Tensor]] = {}
        for part_name, producer_of in work.producers.items():
            ids = work.in_put_order([sid for sid in sample_ids if sid in producer_of])
            got: Optional[list[torch.Tensor]] = None
            if self.is_tp_leader:
                got = timer.timed("wait", lambda: self.pool.get_many([(sid, work.step, producer_of[sid])
                                                                      for sid in ids]))
            if self.tp > 1:
                part = self.m.backbone_part
                weight = part.embed_tokens.weight
                got = timer.timed("wait", lambda: broadcast_rows(got, len(ids), self.topo.tp_group,
                                                                 width=part.embed_width, dtype=weight.dtype,
                                                                 device=weight.device))
            leaves = {sid: emb.detach().requires_grad_(not self.m.frozen_encoder) for sid, emb in zip(ids, got or [])}
            out[part_name] = {sid: leaves[sid] for sid in sample_ids if sid in leaves}  # the microbatch's order
        return out

    def return_grads(self, work: StepWork, leaves: PartEmbeds, timer: Timer) -> None:
        if self.m.frozen_encoder or not self.is_tp_leader:  # TP peers hold the same gradients
            return
        for part, got in leaves.items():
            for sid, leaf in got.items():
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                timer.timed("wait", lambda: self.return_grad(work, part, sid, grad))

    def return_grad(self, work: StepWork, part: str, sid: int, grad: torch.Tensor) -> None:
        """Send d(loss)/d(embedding) of one sample's `part` embedding to its producer (the DP loss-scale
        compensation undone); TP peers of the leader hold the same gradient and send nothing."""
        if not self.is_tp_leader:
            return
        if self.m.dp_loss_scale != 1.0:
            grad = grad / self.m.dp_loss_scale
        self.pool.return_grad(grad.detach(), sample_id=sid, step=work.step, producer=work.producers[part][sid])

    def load_samples(self, sample_ids: list[int], with_pixels: bool) -> list[VLMSample]:
        if not with_pixels:
            return [self._texts.get(sid) or self.dataset.sample(sid, with_pixels=False) for sid in sample_ids]
        return [self.dataset.sample(sid, with_pixels=True) for sid in sample_ids]

    def _consume_flat(self, work: StepWork, row, n_labels: int, timer: Timer, record: StepRecord) -> float:
        part, model = self.m.backbone_part, self.m.backbone
        seq_len = work.plan.seq_len or self.settings.token_budget
        scale = self.m.dp_loss_scale / max(n_labels, 1)
        total = 0.0
        for k, mb in enumerate(row):
            leaves = self.fetch_embeds(work, mb.sample_ids, timer)
            if k == 0:
                record["backbone_first_mb_start_t"] = time.time()
            samples = timer.timed("busy", lambda: self.load_samples(mb.sample_ids, with_pixels=False))
            with grad_sync(model, enabled=k == len(row) - 1):
                def fwd_bwd() -> float:
                    embeds = model_embeds(leaves, samples)
                    packed = part.pack(samples, embeds, seq_len)
                    loss_sum, _ = model(packed, embeds)
                    (loss_sum * scale).backward()
                    return float(loss_sum.detach())
                total += timer.timed("busy", fwd_bwd)
            self.return_grads(work, leaves, timer)
        timer.timed("wait", self.pool.flush)
        return total

    # --- coupled baseline ------------------------------------------------------------------------------------
    @traced("coupled.step")
    def _coupled(self, work: StepWork, n_labels: int, record: StepRecord) -> None:
        timer = Timer()
        row = self._row(work)
        if self.m.pipeline is not None:
            return self._coupled_pipeline(work, row, n_labels, timer, record)
        model = self.m.coupled_dp
        scale = self.m.dp_loss_scale / max(n_labels, 1)
        total = 0.0
        record["backbone_first_mb_start_t"] = time.time()
        # Pixels are prepared in a background thread a microbatch ahead, as a tuned coupled job's data loader does
        # (the decoupled encoder prefetches too): the baseline is not charged for loading on its critical path.
        order = [sid for mb in row for sid in mb.sample_ids]
        depth = max(self.settings.prefetch_depth, max((len(mb.sample_ids) for mb in row), default=1))
        with prefetch_samples(self.dataset, order, with_pixels=True, depth=depth) as prefetched:
            loader = iter(prefetched)
            for k, mb in enumerate(row):
                samples = [timer.timed("wait", lambda: next(loader)) for _ in mb.sample_ids]
                with grad_sync(model, enabled=k == len(row) - 1):
                    def fwd_bwd() -> float:
                        loss_sum, _ = model(samples, work.plan.seq_len or self.settings.token_budget)
                        (loss_sum * scale).backward()
                        return float(loss_sum.detach())
                    total += timer.timed("busy", fwd_bwd)
        record["encoder_last_sample_done_t"] = time.time()
        record["loss_sum"], record["label_tokens"] = total, n_labels
        record["backbone_busy_s"], record["backbone_wait_s"] = timer.busy, timer.wait
        record["encoder_busy_s"] = 0.0

    def _coupled_pipeline(self, work: StepWork, row: list, n_labels: int, timer: Timer, record: StepRecord) -> None:
        """Coupled pipeline (MindSpeed-MM's layout): stage 0 encodes microbatch k's images itself when the schedule
        runs that forward; the embeddings stay in the autograd graph, so the schedule's backward reaches the ViT
        and no gradient travels (nothing to return)."""
        samples = [timer.timed("busy", lambda mb=mb: self.load_samples(mb.sample_ids, with_pixels=False))
                   for mb in row]
        source = None
        if self.topo.is_first_stage:
            trainable = not self.m.frozen_encoder

            def fetch(k: int, _: Timer) -> PartEmbeds:
                pixels = self.load_samples(row[k].sample_ids, with_pixels=True)
                # one forward per sample, as the coupled DP path (the same float summation order)
                return {ENCODER: {s.sample_id: encode_samples(self.m.encoder, [s], trainable)[0]
                                  for s in pixels if s.image_token_counts}}

            source = EmbeddingSource(fetch=fetch, return_grad=None)
        loss_sum = self.m.pipeline.run(samples, work.plan.seq_len or self.settings.token_budget,
                                       self.m.dp_loss_scale / max(n_labels, 1), source, timer, record)
        record["encoder_last_sample_done_t"] = time.time()
        record["loss_sum"], record["label_tokens"] = loss_sum, n_labels
        record["backbone_busy_s"], record["backbone_wait_s"] = timer.busy, timer.wait
        record["encoder_busy_s"] = 0.0

    # --- optimizer ------------------------------------------------------------------------------------------------
    @traced("optimizer")
    def _optimizer_step(self, step: int, record: StepRecord) -> None:
        opt = self.optim.optimizer
        if opt is None:  # frozen encoder rank: nothing to update
            return
        # Norm and clip run on the device (no host sync while gradients are produced); the norm is read once per
        # step, here, after the last backward, where the optimizer has to wait for the gradients anyway, so a
        # non-finite step is caught BEFORE it spoils the parameters.
        norm = self.optim.global_norm(self.norm_group)
        value = float(norm)
        record["grad_norm"] = value
        # The norm is global (one all_reduce over every trained rank), so every rank takes the same decision.
        self.skipped_nonfinite = not math.isfinite(value)
        record["update_skipped"] = float(self.skipped_nonfinite)
        if self.skipped_nonfinite:
            self.nonfinite_in_a_row += 1
            if self.settings.nan_policy != "skip" or self.nonfinite_in_a_row > self.settings.max_nonfinite_steps:
                raise NonFiniteLoss(f"step {step}: the global gradient norm is {value} ({self.nonfinite_in_a_row} "
                                    f"such step(s) in a row, trainer.nan_policy={self.settings.nan_policy}, "
                                    f"trainer.max_nonfinite_steps={self.settings.max_nonfinite_steps}); refusing the "
                                    "optimizer step")
            opt.zero_grad(set_to_none=True)
            return
        self.nonfinite_in_a_row = 0
        self.optim.clip(norm, self.settings.grad_clip)
        lr = lr_at(step, self.settings.base_lr, self.settings.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)

    def _pool_stats(self, record: StepRecord) -> None:
        if self.pool is None:
            return
        stats = self.pool.stats()
        record["pool_peak_bytes"] = stats.occupancy_peak_bytes
        record["pool_bytes_sent"] = stats.bytes_sent
        record["pool_bytes_received"] = stats.bytes_received
        record["pool_grad_bytes_sent"] = stats.grad_bytes_sent
        record["pool_grad_bytes_received"] = stats.grad_bytes_received
        record["pool_transfer_s"] = stats.transfer_s
        record["pool_transfer_exposed_s"] = stats.transfer_exposed_s
        if hasattr(self.pool, "reset_step_stats"):
            self.pool.reset_step_stats()


class CoupledModel(torch.nn.Module):
    """Every encoder part + the backbone on one rank (the coupled baseline), one module so one DP wrapper covers
    them all. Parameter names are `<part>.<name>`, as the decoupled ranks name theirs."""

    def __init__(self, encoders: dict[str, torch.nn.Module], backbone: Any, frozen_encoder: bool) -> None:
        torch.nn.Module.__init__(self)
        self.encoder_names = list(encoders)
        for name, module in encoders.items():
            self.add_module(name, module)
        self.backbone = backbone
        self.frozen_encoder = frozen_encoder

    def forward(self, samples: list[VLMSample], token_budget: int) -> tuple[torch.Tensor, int]:
        # one forward per sample and part, as the decoupled encoders without batching
        per_part = {name: {s.sample_id: encode_samples(getattr(self, name), [s], not self.frozen_encoder)[0]
                           for s in samples if has_input(name, s)} for name in self.encoder_names}
        embeds = model_embeds(per_part, samples)
        packed = self.backbone.pack(samples, embeds, token_budget)
        return self.backbone(packed, embeds)
