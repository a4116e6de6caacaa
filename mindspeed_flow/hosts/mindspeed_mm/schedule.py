"""One flow training step inside MindSpeed-MM's own train loop, on encoder and decoder ranks.

MindSpeed-MM's `train_step` calls `get_forward_backward_func()(...)`, then `optimizer.step()`. The flow patches
hand each part its own forward-backward function:

- encoder ranks (`EncoderStep`): take the step's plan, cut their images' encode order (the decoder's consumption
  order) into decoder microbatch groups (`slot_groups`), run the ViT + projector once per group (images
  concatenated, moved to the device in the job's dtype as MindSpeed-MM's `get_batch` does) and send each sample's
  embedding (the pool's planned mode, `pool.planned.PlannedTransport`) as soon as its group exists (the decoder
  starts while later groups are still encoding). At most `flow.encoder_inflight` groups' graphs are held: at the bound the encoder waits for the
  oldest group's gradients, runs its backward and frees it before encoding the next (the recipe refuses a bound
  below the decoder's pipeline depth, which 1F1B's warm-up needs); the rest are retired after the last forward. A
  frozen encoder sends nothing back and waits for no gradient; its bound counts groups sent but not yet received.
  Every backward but the last runs under the model's `no_sync` (as Megatron's schedules do for all but the last
  microbatch), so `--overlap-grad-reduce` launches each bucket's reduction once. Tensor-parallel peers get each
  group's gradient by a TP broadcast. The peak of groups and saved-activation bytes held goes to `ctx.stats`.
- audio encoder ranks (Qwen2.5-Omni with `parallel.encoders.audio`): the same `EncoderStep` over the clips of
  their samples (MindSpeed-MM's audio encoder, one call per group), each sample's `<|AUDIO|>` rows sent on the
  audio part's own groups.
- decoder ranks (`DecoderStep`): Megatron's own schedule (1F1B when PP > 1) over this DP rank's planned
  microbatches, each collated as one packed (THD) row (`packed.py`) or as padded rows (`packing.layout`); before each first-stage forward the microbatch's embeddings are taken from the receives posted
  at the step's start (TP rank 0 receives, TP peers get a broadcast) and become `VLMModel.input_tensor`, the
  `vit_embeds` input path (with an audio part, the audio rows and the vision rows go in through the model's
  `audio_embedings` / `vit_embedings` keywords); a gradient hook returns d(loss)/d(embedding) to each producer the
  moment autograd computes it.
- the loss: the planner regroups samples into new microbatches, so each sample's loss is weighed to give the
  unpatched job's objective whatever the grouping: with `--calculate-per-token-loss` the token count is summed over
  the decoder's last stage across parts (`reduce_group`) and every part scales by the global count; otherwise
  (MindSpeed-MM's default, the mean of each loader micro-batch's token mean, or `--calculate-per-sample-loss`)
  the model returns per-token losses and `weighted_loss` sums them with the per-sample weights the unpatched
  job's definition gives (`loss_weights`).
- both: `finalize_model_grads` reduces each part over its own DP group; the optimizer's gradient norm is the
  global norm over every trainable part (see patches).

Every tensor that meets a device collective or the model lives on the device (`ctx.device`); host tensors carry
only plan metadata and the gloo headers.

With the recipe's `trainer.trace: true` each rank records host-side spans (`telemetry/trace.py`), named by what they
are and grouped by category for the timeline: `busy` (encoder.forward / encoder.backward per sample,
decoder.forward / decoder.backward per microbatch), `wait` (wait.embedding, wait.gradient, wait.grad_norm) and
`optimizer`. On a device they show when the host issued the work and where it blocked, not the kernels' own time.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from mindspeed_flow.hosts.mindspeed_mm import memory as flow_memory
from mindspeed_flow.hosts.mindspeed_mm.context import FlowContext, PartFigures
from mindspeed_flow.hosts.mindspeed_mm.data import (LAYOUT_PACKED, SECONDS_KEY, FlowSample, FlowStep, collate_rows,
                                                    microbatch_seconds, part_tokens)
from mindspeed_flow.hosts.mindspeed_mm.packed import pack_samples, packed_forward, rope_positions_fn
from mindspeed_flow.pool.planned import PlannedItem, PlannedTransport
from mindspeed_flow.pool.wire import CHANNEL_EMBEDDING, CHANNEL_GRAD
from mindspeed_flow.step.held import HeldPeak, SavedBytes
from mindspeed_flow.step.layout import AUDIO, ENCODER
from mindspeed_flow.step.timer import Timer
from mindspeed_flow.telemetry import trace
from mindspeed_flow.telemetry.trace import span

LOSS_TOKEN, LOSS_MICROBATCH, LOSS_SAMPLE = "token", "microbatch", "sample"
# VLMModel.forward's keywords for rows encoded elsewhere (MindSpeed-MM's hetero pipeline uses them), as spelled there.
AUDIO_ROWS_KEY, VISION_ROWS_KEY = "audio_embedings", "vit_embedings"


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def _tp_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps  # optional: megatron

    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=ps.get_tensor_model_parallel_src_rank(),
                       group=ps.get_tensor_model_parallel_group())
    return tensor


# ------------------------------------------------------------------------------------------ plan orders


def _part_samples(step: FlowStep, ids: list[int], part: str = ENCODER) -> list[int]:
    """The samples of `ids` that encoder part `part` has rows for (images for the image encoder, clips for an
    audio part)."""
    return [sid for sid in ids if part_tokens(step.samples[sid], part) > 0]


def slot_positions(step: FlowStep) -> dict[int, tuple[int, int, int]]:
    """sample id -> (microbatch slot, decoder DP rank, row in the microbatch)."""
    return {sid: (k, d, row) for d, row_mbs in enumerate(step.work.plan.microbatches)
            for k, mb in enumerate(row_mbs) for row, sid in enumerate(mb.sample_ids)}


def embedding_order(step: FlowStep, producers: list[int], part: str = ENCODER) -> list[int]:
    """Every embedding of one encoder part in the step, in one global order: slot, then producer, then the
    producer's own order.

    Each producer's encode order is slot-major, so it is this order restricted to the producer; a consumer posts
    its receives in this order restricted to itself (see pool.planned: one global order per direction; each
    encoder part has its own groups)."""
    slots = slot_positions(step)
    key = {}
    for p_index, producer in enumerate(producers):
        for pos, sid in enumerate(_part_samples(step, step.work.encode_order.get(producer, []), part)):
            key[sid] = (slots[sid][0], p_index, pos)
    return sorted(key, key=key.__getitem__)


def gradient_order(step: FlowStep, consumers: list[int], part: str = ENCODER) -> list[int]:
    """Every embedding gradient of one encoder part in the step, in one global order: slot, then consumer, then
    row.

    A consumer returns a microbatch's gradients in row order during that microbatch's backward, and every
    schedule runs the backward of its microbatches in order, so each consumer sends in this order."""
    slots = slot_positions(step)
    index = {c: i for i, c in enumerate(consumers)}
    ids = [sid for sid in slots if part_tokens(step.samples[sid], part) > 0]
    return sorted(ids, key=lambda sid: (slots[sid][0], index[step.work.consumer_of[sid]], slots[sid][2]))


# ------------------------------------------------------------------------------------------ encoder


def slot_groups(step: FlowStep, order: list[int]) -> list[list[int]]:
    """An encoder replica's encode order cut into decoder microbatch groups: consecutive samples of one slot.

    The encode order is slot-major (see `embedding_order`), so a group is every sample of the replica that the
    decoders consume in one microbatch slot, and the groups keep the order (and the sends) sample by sample."""
    slots = slot_positions(step)
    groups: list[list[int]] = []
    last = None
    for sid in order:
        if not groups or slots[sid][0] != last:
            groups.append([])
            last = slots[sid][0]
        groups[-1].append(sid)
    return groups


@dataclass
class HeldGroup:
    """One decoder microbatch group an encoder replica still holds: its graph (trainable) or its sends (frozen)."""

    step: int
    index: int  # the group's place among the replica's groups of its step
    sample_ids: list[int]
    consumers: list[int]  # the decoder rank that consumes each sample (and returns its gradient)
    out: Optional[torch.Tensor]  # the graph-holding output; None for a frozen encoder's sent group
    nbytes: int  # saved activation bytes (trainable) or embedding bytes in flight (frozen)


class EncoderStep:
    """An encoder part's forward-backward function (Megatron's fbf signature): the image encoder's, or (`part`
    audio) Qwen2.5-Omni's audio encoder's on its own ranks, whose rows go to the decoder's `<|AUDIO|>` tokens."""

    def __init__(self, ctx: FlowContext, transport_factory: Callable[[str], PlannedTransport], hidden: int,
                 dtype: torch.dtype, part: str = ENCODER) -> None:
        self.ctx = ctx
        self.part = part
        self._transport_factory = transport_factory
        self.transport: Optional[PlannedTransport] = None
        self.hidden = hidden
        self.dtype = dtype
        # The recipe's bound (flow.encoder_inflight, resolved): decoder microbatch groups held at once.
        self.inflight = max(int(ctx.parts.encoder_inflight), 1)
        # A frozen encoder's groups sent but not yet received; kept across steps, since it runs ahead of the
        # decoder (it waits for no gradient) and its sends of one step may still be in flight in the next.
        self.sent: collections.deque[HeldGroup] = collections.deque()

    def encode(self, model: Any, step: FlowStep, group: list[int]) -> torch.Tensor:
        """One ViT + projector call for a group of samples: their images concatenated ([tokens, 1, hidden] out).

        MindSpeed-MM's Qwen2(.5) ViT takes any number of images with their grids, as in the unpatched job's
        microbatch: full attention (cu_seqlens) and the Qwen2.5 windows are built per image from image_grid_thw,
        so each sample's rows equal its own call's (tests/mindspeed_mm/test_encoder_inflight.py).

        An audio part calls MindSpeed-MM's audio encoder on the group's clips ([rows, hidden] out): it cuts each
        clip into windows and attends within each, so a clip's rows do not depend on the others in the call."""
        samples = [step.samples[sid] for sid in group]
        if self.part == AUDIO:
            features = torch.cat([s.audio_features for s in samples]).to(device=self.ctx.device, dtype=self.dtype)
            mask = torch.cat([s.audio_mask for s in samples]).to(device=self.ctx.device)
            return _unwrap(model).audio_encoder(features, mask)
        # Concatenated on the host, then one copy to the device in the job's dtype (as MindSpeed-MM's get_batch).
        pixels = torch.cat([s.pixel_values for s in samples]).to(device=self.ctx.device, dtype=self.dtype)
        grid = torch.cat([s.image_grid_thw for s in samples])
        if flow_memory.enabled():
            flow_memory.record(self.ctx.shapes, "images", grid.tolist())  # host tensor: no device read
        grid = grid.to(device=self.ctx.device)
        return model(input_ids=None, pixel_values=pixels, image_grid_thw=grid)

    def __call__(self, *, forward_step_func: Any = None, data_iterator: Any, model: list, num_microbatches: int,
                 forward_only: bool = False, **_: Any) -> list[dict]:
        from megatron.core.utils import get_model_config  # optional: megatron

        ctx = self.ctx
        ctx.doing("reading the next global batch")
        step: FlowStep = next(data_iterator)
        timer = ctx.timer = Timer()
        ctx.step_started_at = time.time()
        trace.set_step(step.step + 1)  # Megatron's iteration number, as in metrics.jsonl
        leader = ctx.replica_leader()
        is_leader = ctx.rank == leader
        if is_leader and self.transport is None:
            self.transport = self._transport_factory(self.part)
        config = get_model_config(model[0])
        trainable = ctx.part_trainable and not forward_only
        part = self.part
        groups = slot_groups(step, _part_samples(step, step.work.encode_order.get(leader, []), part))
        if trainable and is_leader:
            # Every gradient this replica will get, posted now in the step's global gradient order.
            items = [PlannedItem(step.work.consumer_of[sid], step.step, sid, part_tokens(step.samples[sid], part))
                     for sid in gradient_order(step, ctx.consumers(), part)
                     if step.work.producers[part].get(sid) == leader]
            self.transport.post_receives(CHANNEL_GRAD, items, self.hidden)
        no_sync = _no_sync_context(config)
        # Oldest first: graphs of this step (trainable), or sent groups of this and earlier steps (frozen).
        held: collections.deque[HeldGroup] = collections.deque() if trainable else self.sent
        peak = HeldPeak()
        for g in held:
            peak.add(g.nbytes)
        check = _grouped_check_enabled()
        for index, group in enumerate(groups):
            while len(held) >= self.inflight:
                # At the bound: the oldest group's gradients, its backward, its graph freed (only the encoder
                # waits here; the decoder has every embedding it needs to return them, see recipe.encoder_inflight).
                self._retire(held.popleft(), len(groups), peak, is_leader, no_sync, timer)
            ctx.doing(f"iteration {step.step + 1}: encoding samples {group}")
            saved = SavedBytes()
            with torch.set_grad_enabled(trainable), saved.counting(), span("encoder.forward", "busy"):
                out = self.encode(model[0], step, group)
            if check and part == ENCODER:
                self._check_grouped(model[0], step, group, out, is_leader)
            sizes = [part_tokens(step.samples[sid], part) for sid in group]
            if is_leader:
                for sid, emb in zip(group, torch.split(out, sizes, dim=0)):
                    self.transport.send(CHANNEL_EMBEDDING, step.work.consumer_of[sid], step.step, sid, emb)
            if trainable or is_leader:
                # Frozen (leader only: it sends): the bound counts groups of embeddings sent but not yet received.
                entry = HeldGroup(step.step, index, group, [step.work.consumer_of[sid] for sid in group],
                                  out if trainable else None,
                                  saved.total if trainable else out.numel() * out.element_size())
                held.append(entry)
                peak.add(entry.nbytes)
        while trainable and held:
            self._retire(held.popleft(), len(groups), peak, is_leader, no_sync, timer)
        ctx.stats.own.encoder_held_groups = float(peak.peak_groups)
        ctx.stats.own.encoder_held_bytes = float(peak.peak_bytes)
        if trainable and config.finalize_model_grads_func is not None:
            ctx.doing(f"iteration {step.step + 1}: gradient reduction over the encoder part and the global token count")
            num_tokens = torch.zeros((), dtype=torch.int, device=ctx.device) if config.calculate_per_token_loss \
                else None
            config.finalize_model_grads_func(model, num_tokens)
        # No loss on encoder ranks: one empty dict per step keeps train_step's loss reduction a no-op.
        return [{}]

    def flush(self) -> None:
        """Wait until every embedding this rank sent has been received (see FlowHost.finish)."""
        if self.transport is not None:
            self.transport.flush()

    def _retire(self, entry: HeldGroup, n_groups: int, peak: HeldPeak, is_leader: bool,
                no_sync: Callable[[], Any], timer: Timer) -> None:
        """Free the oldest held group: its gradients, then its backward (trainable) or its sends' receipt."""
        ctx = self.ctx
        group, out, step_no = entry.sample_ids, entry.out, entry.step
        since = time.perf_counter()
        if out is None:  # frozen: wait until the decoder has received the group's embeddings
            ctx.doing(f"iteration {step_no + 1}: waiting for the decoder to receive samples {group}")
            self.transport.wait_sent(CHANNEL_EMBEDDING, step_no, group)
            timer.waited(since)
            peak.drop(entry.nbytes)
            return
        if is_leader:
            parts = []
            with span("wait.gradient", "wait"):
                for sid, consumer in zip(group, entry.consumers):
                    ctx.doing(f"iteration {step_no + 1}: waiting for the gradient of sample {sid} from "
                              f"{ctx.describe(consumer)}")
                    parts.append(self.transport.receive(CHANNEL_GRAD, consumer, step_no, sid))
            timer.waited(since)
            grad = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        else:
            grad = torch.empty((out.numel() // out.shape[-1], out.shape[-1]), dtype=torch.bfloat16,
                               device=ctx.device)
        grad = _tp_broadcast(grad.contiguous())
        # Megatron's schedules run every microbatch but the last under no_sync: with --overlap-grad-reduce a
        # parameter's gradient may be registered ready only once per step.
        with (no_sync() if entry.index < n_groups - 1 else contextlib.nullcontext()), span("encoder.backward", "busy"):
            torch.autograd.backward(out, grad.reshape(out.shape).to(out.dtype))
        peak.drop(entry.nbytes)

    def _check_grouped(self, model: Any, step: FlowStep, group: list[int], out: torch.Tensor,
                       is_leader: bool) -> None:
        """MSF_FLOW_CHECK_GROUPED_ENCODER=1 (tests): print how far the group's call is from one call per sample.

        The extra calls run without a graph and draw no random numbers, so training is unchanged."""
        with torch.no_grad():  # every TP rank runs them (the ViT's TP collectives); the leader prints
            single = torch.cat([self.encode(model, step, [sid]) for sid in group], dim=0)
        if not is_leader:
            return
        diff = (out.detach().float() - single.float()).abs().max().item()
        scale = single.float().abs().max().item()
        print(f"[flow] grouped encoder check: iteration {step.step + 1} samples {group} images "
              f"{sum(int(step.samples[sid].image_grid_thw.shape[0]) for sid in group)} max abs diff {diff:.3e} "
              f"(max abs {scale:.3e})", flush=True)


def _grouped_check_enabled() -> bool:
    return os.environ.get("MSF_FLOW_CHECK_GROUPED_ENCODER", "") == "1"


def _no_sync_context(config: Any) -> Callable[[], Any]:
    fn = config.no_sync_func
    if fn is None:
        return contextlib.nullcontext
    if isinstance(fn, list):
        def all_chunks() -> Any:
            stack = contextlib.ExitStack()
            for f in fn:
                stack.enter_context(f())
            return stack

        return all_chunks
    return fn


# ------------------------------------------------------------------------------------------ decoder


def loss_mode(args: Any) -> str:
    if getattr(args, "calculate_per_token_loss", False):
        return LOSS_TOKEN
    return LOSS_SAMPLE if getattr(args, "calculate_per_sample_loss", False) else LOSS_MICROBATCH


def loss_weights(samples: list[FlowSample], mode: str, loader_batches: int) -> list[float]:
    """Per sample, the weight of one of its token losses in the unpatched job's objective for one global batch.

    The unpatched job averages the loss of its `loader_batches` loader micro-batches (each divided by the number
    of microbatches, then averaged over DP). Default mode: a micro-batch's loss is its token mean, so a token of
    sample s weighs 1 / (tokens of s's micro-batch x loader_batches). Per-sample mode: a micro-batch's loss is the
    mean over its samples of each sample's token mean, so 1 / (tokens of s x samples of s's micro-batch x
    loader_batches)."""
    out = []
    for s in samples:
        if mode == LOSS_SAMPLE:
            denom = max(s.loss_tokens, 1) * s.batch_samples * loader_batches
        else:
            denom = max(s.batch_loss_tokens, 1) * loader_batches
        out.append(1.0 / denom)
    return out


class DecoderStep:
    """The decoder part's forward-backward function: Megatron's schedule over the planned microbatches."""

    def __init__(self, ctx: FlowContext, megatron_fbf: Callable[..., Any],
                 transport_factory: Callable[[str], PlannedTransport], embed_dim: int, dtype: torch.dtype,
                 *, loss: str, pad_multiple: int, loader_batches: int, layout: str,
                 seconds_key: str = SECONDS_KEY, audio: bool = False) -> None:
        self.ctx = ctx
        self.megatron_fbf = megatron_fbf
        self._transport_factory = transport_factory
        # encoder part -> this consumer's transport from it (the image encoder; an audio part when there is one)
        self.transports: dict[str, PlannedTransport] = {}
        self.embed_dim = embed_dim
        self.dtype = dtype
        self.loss = loss
        self.pad_multiple = pad_multiple
        self.loader_batches = loader_batches
        self.layout = layout
        self.seconds_key = seconds_key  # the batch key the model's rope index reads videos' seconds from
        self.audio = audio  # the model has an audio encoder (on this part's first stage, or its own part)
        self.audio_part = AUDIO in ctx.parts.layout.encoder_parts  # ... its own part: its rows come on the wire
        self._positions: Optional[Callable[..., torch.Tensor]] = None
        self.timer: Optional[Timer] = None
        self.num_microbatches = 1
        self.last_embedding_at = 0.0  # perf_counter() when this step's latest embedding was taken

    def __call__(self, *, forward_step_func: Any, data_iterator: Any, model: list, num_microbatches: int,
                 **kwargs: Any) -> list[dict]:
        from megatron.core import parallel_state as ps  # optional: megatron

        ctx = self.ctx
        ctx.doing("reading the next global batch")
        step: FlowStep = next(data_iterator)
        ctx.step_started_at = time.time()
        trace.set_step(step.step + 1)
        dp_rank = ps.get_data_parallel_rank()
        microbatches = step.microbatches(dp_rank)
        if ctx.rank in ctx.consumers():
            for part in ctx.parts.layout.encoder_parts:
                if part not in self.transports:
                    self.transports[part] = self._transport_factory(part)
                # Every embedding of this step, posted at once in the part's global embedding order: each lands
                # as soon as it is encoded, while the decoder works on earlier microbatches.
                producer_of = step.work.producers[part]
                items = [PlannedItem(producer_of[sid], step.step, sid, part_tokens(step.samples[sid], part))
                         for sid in embedding_order(step, ctx.producers(part), part)
                         if step.work.consumer_of.get(sid) == ctx.rank]
                self.transports[part].post_receives(CHANNEL_EMBEDDING, items, self.embed_dim)
        self.timer = ctx.timer = Timer()
        self.num_microbatches = len(microbatches)
        ctx.step_transfer = self._transfer_stats(self.timer)
        batches = iter([(step, ids) for ids in microbatches])
        losses = self.megatron_fbf(forward_step_func=forward_step_func, data_iterator=batches, model=model,
                                   num_microbatches=len(microbatches), **kwargs)
        ctx.stats.counts = step.counts
        return losses

    def flush(self) -> None:
        """Wait until every gradient this rank sent has been received (see FlowHost.finish)."""
        for transport in self.transports.values():
            transport.flush()

    def _transfer_stats(self, timer: Timer) -> Callable[[PartFigures], None]:
        """What finalize (inside Megatron's schedule, after the last backward) adds to the step's stats for this
        rank: gradient bytes sent, embedding bytes taken (over every encoder part), the seconds it was blocked on
        embeddings (exposed) and the seconds from posting the step's receives to taking its last embedding (the
        streaming window: the part of it not blocked was hidden behind this rank's compute). Zero on ranks that
        receive nothing."""
        transports = list(self.transports.values())
        if not transports:
            return lambda figures: None

        audio = self.transports.get(AUDIO)

        def moved() -> tuple[int, int, int]:
            return (sum(t.bytes_sent[CHANNEL_GRAD] for t in transports),
                    sum(t.bytes_received[CHANNEL_EMBEDDING] for t in transports),
                    audio.bytes_sent[CHANNEL_GRAD] if audio is not None else 0)

        sent, received, audio_sent = moved()
        self.last_embedding_at = timer.start

        def add(figures: PartFigures) -> None:
            now_sent, now_received, now_audio = moved()
            figures.grad_bytes_sent = float(now_sent - sent)
            figures.grad_bytes_audio = float(now_audio - audio_sent)
            figures.embedding_bytes = float(now_received - received)
            figures.transfer_exposed_s = timer.wait
            figures.transfer_window_s = max(self.last_embedding_at - timer.start, 0.0)

        return add

    def embeddings(self, step: FlowStep, sample_ids: list[int], part: str = ENCODER) -> Optional[torch.Tensor]:
        """This microbatch's rows from encoder part `part` in row order ([rows, 1, hidden] image embeddings, the
        model's `vit_embeds`; [rows, hidden] audio rows), as a leaf whose gradient flows back to the producers."""
        ctx = self.ctx
        with_rows = _part_samples(step, sample_ids, part)
        if not with_rows:
            return None
        sizes = [part_tokens(step.samples[sid], part) for sid in with_rows]
        producers = [step.work.producers[part][sid] for sid in with_rows]
        transport = self.transports.get(part)
        if transport is not None:
            since = time.perf_counter()
            parts = []
            with span("wait.embedding", "wait"):
                for sid, p in zip(with_rows, producers):
                    ctx.doing(f"iteration {step.step + 1}: waiting for the embedding of sample {sid} from "
                              f"{ctx.describe(p)}")
                    parts.append(transport.receive(CHANNEL_EMBEDDING, p, step.step, sid))
            if self.timer is not None:
                self.timer.waited(since)
            self.last_embedding_at = time.perf_counter()
            embeds = torch.cat(parts, dim=0).reshape(-1, self.embed_dim).to(self.dtype)
        else:
            embeds = torch.empty((sum(sizes), self.embed_dim), dtype=self.dtype, device=ctx.device)
        embeds = _tp_broadcast(embeds.contiguous())
        if part == ENCODER:
            embeds = embeds.reshape(-1, 1, self.embed_dim)
        if not ctx.parts.trainable(part):
            return embeds
        embeds = embeds.detach().requires_grad_(True)
        if transport is not None:
            step_no = step.step

            def return_grads(grad: torch.Tensor) -> None:
                for sid, producer, g in zip(with_rows, producers, torch.split(grad, sizes, dim=0)):
                    transport.send(CHANNEL_GRAD, producer, step_no, sid, g)

            embeds.register_hook(return_grads)
        return embeds

    def collate(self, samples: list[FlowSample], vlm: Any) -> tuple[dict, Callable[[list[float]], torch.Tensor],
                                                                    Any]:
        """The microbatch MindSpeed-MM's forward step takes, a map from per-sample loss weights to the weight of
        each of its token losses, and the context its forward runs in (packed: the row's PackedSeqParams)."""
        if self.layout != LAYOUT_PACKED:
            batch = collate_rows(samples, pad_multiple=self.pad_multiple, seconds_key=self.seconds_key,
                                 audio=self.audio)
            return (batch, lambda w: torch.tensor(w, dtype=torch.float32).reshape(-1, 1),
                    contextlib.nullcontext())
        if self._positions is None:
            from megatron.training import get_args  # optional: megatron

            self._positions = rope_positions_fn(get_args().mm.model)
        for s in samples:  # each sample's own rope positions, once (every pipeline stage needs them)
            if s.position_ids is None:
                s.position_ids = self._positions(vlm.config, s.input_ids, s.image_grid_thw, s.second_per_grid_ts)
        row = pack_samples([s.input_ids for s in samples], [s.labels_or_ignored() for s in samples],
                           [s.position_ids for s in samples], pad_multiple=self.pad_multiple)
        flow_memory.record(self.ctx.shapes, "segments", list(row.segments))
        grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
        if grids:
            row.batch["image_grid_thw"] = torch.cat(grids, dim=0)
        seconds = microbatch_seconds(samples)
        if seconds is not None:
            row.batch[SECONDS_KEY] = seconds
        return row.batch, row.token_weights, packed_forward(self.ctx, row.packed_seq_params())

    def forward_step(self, original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """Wrap MindSpeed-MM's `forward_step(data_iterator, model)`: feed it a collated microbatch and the embeds."""

        def flow_forward_step(data_iterator: Iterator, model: Any) -> Any:
            step, sample_ids = next(data_iterator)
            self.ctx.doing(f"iteration {step.step + 1}: decoder forward of samples {sample_ids}")
            vlm = _unwrap(model)
            samples = [step.samples[sid] for sid in sample_ids]
            audio_rows = None
            if vlm.add_text_decoder and vlm.text_decoder.pre_process:
                vlm.input_tensor = self.embeddings(step, sample_ids)
                if self.audio_part:
                    audio_rows = self.embeddings(step, sample_ids, AUDIO)
                if vlm.input_tensor is None and self.audio and any(s.audio_mask is not None for s in samples):
                    # MindSpeed-MM scatters audio rows only inside its branch for vision rows: without any, a
                    # microbatch of clip-only samples would train on the bare <|AUDIO|> embeddings. An empty set
                    # of vision rows opens that branch, so every clip reaches the LLM whatever the microbatch holds
                    # (MindSpeed-MM's collator adds a blank image instead, which then fails to scatter).
                    vlm.input_tensor = torch.zeros((0, 1, self.embed_dim), dtype=self.dtype, device=self.ctx.device)
            batch, token_weights, forward_context = self.collate(samples, vlm)
            if self.audio_part:
                # The audio encoder is its own part: this model has none. Its rows enter through VLMModel.forward's
                # own keywords for embeddings computed elsewhere (`audio_embedings`, which then takes the vision
                # rows from `vit_embedings` too); the scatter runs where `input_features` is a key (its value is
                # unused).
                batch.pop("input_features", None)
                if audio_rows is not None:
                    batch.update({AUDIO_ROWS_KEY: audio_rows, VISION_ROWS_KEY: vlm.input_tensor,
                                  "input_features": None})
            if self.loss == LOSS_TOKEN:
                with forward_context, span("decoder.forward", "busy"):
                    output, loss_func = original(iter([batch]), model)
                return _sendable(output), loss_func
            with per_token_losses(), forward_context, span("decoder.forward", "busy"):
                output, original_loss = original(iter([batch]), model)
            output = _sendable(output)
            weights = token_weights(loss_weights(samples, self.loss, self.loader_batches)) if samples else None
            scale = float(self.num_microbatches * self.ctx.parts.layout.part("backbone").dp)
            return output, lambda out: weighted_loss(out, weights, scale, original_loss)

        return flow_forward_step


def _sendable(output: Any) -> Any:
    """A stage's output as Megatron's pipeline send takes it: contiguous. Qwen2.5-Omni's audio scatter hands the
    decoder a transposed view of its input embeddings, which stays a view through a stage when a microbatch holds
    more than one row (the unpatched job's one-sample microbatches never show it)."""
    if torch.is_tensor(output) and not output.is_contiguous():
        return output.contiguous()
    return output


@contextlib.contextmanager
def per_token_losses() -> Iterator[None]:
    """Inside: MindSpeed-MM's model returns per-token losses (its `--calculate-per-token-loss` branch)."""
    from megatron.training import get_args  # optional: megatron

    args = get_args()
    saved = (args.calculate_per_token_loss, getattr(args, "calculate_per_sample_loss", False))
    args.calculate_per_token_loss, args.calculate_per_sample_loss = True, False
    try:
        yield
    finally:
        args.calculate_per_token_loss, args.calculate_per_sample_loss = saved


def weighted_loss(output: dict, weights: Optional[torch.Tensor], scale: float,
                  original_loss: Callable[[Any], Any]) -> tuple[torch.Tensor, dict]:
    """The microbatch's share of the unpatched job's objective, in Megatron's two-value loss protocol.

    Megatron divides a microbatch's loss by the number of microbatches and averages gradients over DP; `scale` (
    microbatches x decoder DP) undoes both, so the sum over every microbatch of every replica is exactly
    sum(weight x token loss). `weights` (host) has one row per microbatch row: [rows, 1] (a weight per sample
    row) or [1, tokens - 1] (packed: a weight per token position); None for an empty microbatch. The reported value is the same quantity averaged over DP, which MindSpeed-MM's
    train_step then averages over microbatches: the unpatched job's reported loss."""
    from megatron.core import parallel_state as ps  # optional: megatron
    from megatron.training import get_args  # optional: megatron

    loss_dict = output["loss_dict"]
    mask = loss_dict["loss_mask"]
    rows = weights.shape[0] if weights is not None else 1
    token_losses = loss_dict["loss"].float().reshape(rows, -1)
    mask = mask.reshape(rows, -1).to(token_losses.dtype)
    if weights is not None:
        w = weights.to(device=token_losses.device, non_blocking=True)
        loss = (token_losses * mask * w).sum() * scale
    else:  # an empty microbatch: a padding row with no loss token
        loss = (token_losses * mask).sum()
    reported = loss.detach().clone().view(1)
    dp_group = ps.get_data_parallel_group()
    dist.all_reduce(reported, group=dp_group)
    reported = reported / dist.get_world_size(group=dp_group)
    extra: dict = {}
    if getattr(get_args(), "log_tps", False):
        with per_token_losses():
            _, _, extra = original_loss(output)
    extra = dict(extra)
    extra["loss"] = reported[0]
    # A tensor of its own, not a view: with a pipelined decoder Megatron frees each stage's output after use
    # (`deallocate_output_tensor`, the last stage's being this loss) and refuses a view of another tensor.
    return loss.reshape(1).clone(), extra


def finalize_with_global_tokens(ctx: FlowContext, finalize: Callable[..., Any]) -> Callable[..., Any]:
    """`finalize_model_grads` per part, with per-token scaling by the token count summed over every part.

    Megatron scales by the tokens of the part's own last stage (broadcast over PP, all-reduced over DP); the
    encoder has no loss, so the count is summed across the trainable parts instead (the decoder's last stage
    contributes, everyone else adds zero) and each part scales by it. Without per-token loss Megatron averages
    over DP inside each part; the encoder's gradients came from the decoder's DP replicas, so they are rescaled
    by encoder_dp / decoder_dp to average over the decoder's DP like the coupled job. Everything stays on the
    device: no host synchronisation is added to the step (the busy/wait seconds for the log line ride along and
    are read when Megatron's log line reads its own values).
    """
    from megatron.core import parallel_state as ps  # optional: megatron

    def flow_finalize(model: list, num_tokens: Optional[torch.Tensor] = None) -> None:
        ctx.doing("gradient reduction over the part's data-parallel group")
        finalize(model, None)
        own = ctx.stats.own
        if ctx.timer is not None:
            busy_wait = ctx.timer.busy_and_wait()
            if ctx.is_encoder:
                own.encoder_busy_s, own.encoder_wait_s = busy_wait
            else:
                own.decoder_busy_s, own.decoder_wait_s = busy_wait
        contributes = (not ctx.is_encoder and ps.is_pipeline_last_stage(ignore_virtual=True)
                       and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
        # One all-reduce carries the token count and the step's PartFigures (for the log line): each part leader's
        # busy/wait seconds (the encoder leader's held peak too), every decoder rank's transfers.
        # float32: MindSpeed wraps torch.distributed.all_reduce so that a float64 tensor is reduced on a float32
        # copy whose result is dropped (HCCL has no float64); the original would silently stay unreduced.
        mine = dataclasses.replace(own) if ctx.is_part_leader else PartFigures()  # `own` holds its part's only
        if not ctx.is_encoder:
            ctx.step_transfer(mine)
        stats = torch.tensor([0.0] + mine.as_list(), dtype=torch.float32).to(ctx.device)
        if num_tokens is not None and contributes:
            stats[0] = num_tokens.to(device=ctx.device, dtype=torch.float32)
        ctx.doing("the global token count over every trainable part")
        dist.all_reduce(stats, group=ctx.reduce_group)
        ctx.stats.pending = stats
        if num_tokens is not None:
            # Gradients scale by 1 / the global token count on the device (a step with no loss token keeps them).
            scaling = torch.where(stats[0] > 0, 1.0 / stats[0].clamp(min=1.0), torch.ones_like(stats[0]))
            for chunk in model:
                chunk.scale_gradients(scaling)
        elif ctx.is_encoder:
            enc_dp, dec_dp = ctx.layout.dp, ctx.parts.layout.part("backbone").dp
            if enc_dp != dec_dp:
                for chunk in model:
                    chunk.scale_gradients(enc_dp / dec_dp)

    return flow_finalize


def global_grad_norm(ctx: FlowContext, part_norm: float, norm_type: float) -> float:
    """The norm over every trainable part, from each part's own norm (one value per part, from its leader).

    Megatron's `get_grad_norm_fp32` has already read the part's norm on the host; one device all-reduce over the
    trainable parts and one read combine them (per step, not per microbatch)."""
    if not ctx.part_trainable or ctx.reduce_group is None:
        # A frozen part's norm, as a number: MindSpeed-MM's asynchronous clipping (`clip_grad_async`) leaves a
        # one-element device tensor there when a rank has no gradient, which its log line cannot format.
        return float(part_norm)
    inf = norm_type == math.inf
    value = float(part_norm) if inf else float(part_norm) ** norm_type
    # float32 on the device: see flow_finalize (not float64), and HCCL groups take device tensors only.
    t = torch.tensor([value if ctx.is_part_leader else 0.0], dtype=torch.float32).to(ctx.device)
    ctx.doing("the global gradient norm over every trainable part")
    with span("wait.grad_norm", "wait"):  # the host blocks here until every trainable part has its norm
        dist.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=ctx.reduce_group)
        total = float(t[0]) if inf else float(t[0]) ** (1.0 / norm_type)
    ctx.doing("optimizer step")
    ctx.stats.grad_norm_part = float(part_norm)
    ctx.stats.grad_norm_global = total
    return total
