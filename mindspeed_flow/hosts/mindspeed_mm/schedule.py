"""One flow training step inside MindSpeed-MM's own train loop, on encoder and decoder ranks.

MindSpeed-MM's `train_step` calls `get_forward_backward_func()(...)`, then `optimizer.step()`. The flow patches
hand each part its own forward-backward function:

- encoder ranks (`EncoderStep`): take the step's plan, run the ViT + projector on their images in the decoder's
  consumption order and send each sample's embedding (`transport.PlannedTransport`) as soon as it exists (the decoder starts while
  later images are still encoding); then wait for each embedding's gradient and run backward with it (a frozen
  encoder sends nothing back and never waits). Tensor-parallel peers get the gradient by a TP broadcast.
- decoder ranks (`DecoderStep`): Megatron's own schedule (1F1B when PP > 1) over this DP rank's planned
  microbatches; before each first-stage forward the microbatch's embeddings are taken from the receives posted
  at the step's start (TP rank 0 receives, TP peers get a broadcast) and become `VLMModel.input_tensor`, the `vit_embeds` input path; a gradient
  hook returns d(loss)/d(embedding) to each producer the moment autograd computes it.
- both: `finalize_model_grads` reduces each part over its own DP group; with `--calculate-per-token-loss` the
  token count is summed over the decoder's last stage across parts (`reduce_group`) so every part scales by the
  global count; the optimizer's gradient norm is the global norm over every trainable part (see patches).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from mindspeed_flow.hosts.mindspeed_mm.context import FlowContext
from mindspeed_flow.hosts.mindspeed_mm.data import FlowStep, collate_rows
from mindspeed_flow.hosts.mindspeed_mm.transport import KIND_EMBEDDING, KIND_GRAD, PlannedTransport


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def _tp_group_and_src() -> tuple[Any, int, int]:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    return group, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_src_rank()


def _tp_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    group, size, src = _tp_group_and_src()
    if size > 1:
        dist.broadcast(tensor, src=src, group=group)
    return tensor


class PartTimer:
    """Busy and wait seconds of one part over one step (wait = blocked on a transfer from the other part)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.wait = 0.0

    def waited(self, since: float) -> None:
        self.wait += time.perf_counter() - since

    def result(self) -> tuple[float, float]:
        total = time.perf_counter() - self.start
        return max(total - self.wait, 0.0), self.wait


def _image_samples(step: FlowStep, ids: list[int]) -> list[int]:
    return [sid for sid in ids if step.samples[sid].image_tokens > 0]


def return_order(step: FlowStep, consumer_dp: int) -> list[int]:
    """The order in which a decoder replica returns gradients: its microbatches in order, rows in order."""
    return _image_samples(step, [sid for ids in step.microbatches(consumer_dp) for sid in ids])


class EncoderStep:
    """The encoder part's forward-backward function (Megatron's fbf signature)."""

    def __init__(self, ctx: FlowContext, transport_factory: Callable[[], PlannedTransport], hidden: int) -> None:
        self.ctx = ctx
        self._transport_factory = transport_factory
        self.transport: Optional[PlannedTransport] = None
        self.hidden = hidden

    def __call__(self, *, forward_step_func: Any = None, data_iterator: Any, model: list, num_microbatches: int,
                 forward_only: bool = False, **_: Any) -> list[dict]:
        from megatron.core.utils import get_model_config

        ctx = self.ctx
        step: FlowStep = next(data_iterator)
        timer = ctx.timer = PartTimer()
        leader = ctx.replica_leader()
        is_leader = ctx.rank == leader
        if is_leader and self.transport is None:
            self.transport = self._transport_factory()
        trainable = ctx.parts.encoder_trainable and not forward_only
        order = _image_samples(step, step.work.encode_order.get(leader, []))
        if trainable and is_leader:
            # Post the gradient receives now, per consumer in the order it will return them.
            for dp, consumer in enumerate(ctx.consumers()):
                items = [(sid, step.samples[sid].image_tokens) for sid in return_order(step, dp)
                         if step.work.producer_of.get(sid) == leader]
                self.transport.post_receives(KIND_GRAD, consumer, step.step, items, self.hidden)
        kept: list[tuple[int, torch.Tensor]] = []
        for sid in order:
            sample = step.samples[sid]
            with torch.set_grad_enabled(trainable):
                out = model[0](input_ids=None, pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw)
            if is_leader:
                self.transport.send(KIND_EMBEDDING, step.work.consumer_of[sid], step.step, sid, out)
            if trainable:
                kept.append((sid, out))
        for sid, out in kept:
            if is_leader:
                since = time.perf_counter()
                grad = self.transport.receive(KIND_GRAD, step.work.consumer_of[sid], step.step, sid)
                timer.waited(since)
            else:
                grad = torch.empty((out.numel() // out.shape[-1], out.shape[-1]), dtype=torch.bfloat16)
            grad = _tp_broadcast(grad.contiguous())
            torch.autograd.backward(out, grad.reshape(out.shape).to(out.dtype))
        if self.transport is not None:
            ctx.counters["embedding_bytes_sent"] = float(self.transport.bytes_sent[KIND_EMBEDDING])
        config = get_model_config(model[0])
        if trainable and config.finalize_model_grads_func is not None:
            num_tokens = torch.zeros((), dtype=torch.int) if config.calculate_per_token_loss else None
            config.finalize_model_grads_func(model, num_tokens)
        # No loss on encoder ranks: one empty dict per step keeps train_step's loss reduction a no-op.
        return [{}]


class DecoderStep:
    """The decoder part's forward-backward function: Megatron's schedule over the planned microbatches."""

    def __init__(self, ctx: FlowContext, megatron_fbf: Callable[..., Any],
                 transport_factory: Callable[[], PlannedTransport], embed_dim: int, dtype: torch.dtype) -> None:
        self.ctx = ctx
        self.megatron_fbf = megatron_fbf
        self._transport_factory = transport_factory
        self.transport: Optional[PlannedTransport] = None
        self.embed_dim = embed_dim
        self.dtype = dtype
        self.timer: Optional[PartTimer] = None

    def __call__(self, *, forward_step_func: Any, data_iterator: Any, model: list, num_microbatches: int,
                 **kwargs: Any) -> list[dict]:
        from megatron.core import parallel_state as ps

        ctx = self.ctx
        step: FlowStep = next(data_iterator)
        dp_rank = ps.get_data_parallel_rank()
        microbatches = step.microbatches(dp_rank)
        if ctx.rank in ctx.consumers():
            if self.transport is None:
                self.transport = self._transport_factory()
            # Every embedding of this step is posted at once, per producer in its send order: each lands as soon as
            # it is encoded, while the decoder works on earlier microbatches.
            for producer, order in step.work.encode_order.items():
                items = [(sid, step.samples[sid].image_tokens) for sid in _image_samples(step, order)
                         if step.work.consumer_of.get(sid) == ctx.rank]
                self.transport.post_receives(KIND_EMBEDDING, producer, step.step, items, self.embed_dim)
        self.timer = ctx.timer = PartTimer()
        batches = iter([(step, ids) for ids in microbatches])
        losses = self.megatron_fbf(forward_step_func=forward_step_func, data_iterator=batches, model=model,
                                   num_microbatches=len(microbatches), **kwargs)
        ctx.counters.update(step.counts)
        if self.transport is not None:
            ctx.counters["grad_bytes_sent"] = float(self.transport.bytes_sent[KIND_GRAD])
        return losses

    def embeddings(self, step: FlowStep, sample_ids: list[int]) -> Optional[torch.Tensor]:
        """This microbatch's image embeddings in row order, as a leaf whose gradient flows back to the producers."""
        ctx = self.ctx
        with_images = _image_samples(step, sample_ids)
        if not with_images:
            return None
        sizes = [step.samples[sid].image_tokens for sid in with_images]
        producers = [step.work.producer_of[sid] for sid in with_images]
        if self.transport is not None:
            since = time.perf_counter()
            parts = [self.transport.receive(KIND_EMBEDDING, p, step.step, sid) for sid, p in zip(with_images, producers)]
            if self.timer is not None:
                self.timer.waited(since)
            embeds = torch.cat(parts, dim=0).reshape(-1, 1, self.embed_dim).to(self.dtype)
        else:
            embeds = torch.empty((sum(sizes), 1, self.embed_dim), dtype=self.dtype)
        embeds = _tp_broadcast(embeds.contiguous())
        if not ctx.parts.encoder_trainable:
            return embeds
        embeds = embeds.detach().requires_grad_(True)
        if self.transport is not None:
            transport, step_no = self.transport, step.step

            def return_grads(grad: torch.Tensor) -> None:
                for sid, producer, g in zip(with_images, producers, torch.split(grad, sizes, dim=0)):
                    transport.send(KIND_GRAD, producer, step_no, sid, g)

            embeds.register_hook(return_grads)
        return embeds

    def forward_step(self, original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """Wrap MindSpeed-MM's `forward_step(data_iterator, model)`: feed it a collated microbatch and the embeds."""

        def flow_forward_step(data_iterator: Iterator, model: Any) -> Any:
            step, sample_ids = next(data_iterator)
            vlm = _unwrap(model)
            if vlm.add_text_decoder and vlm.text_decoder.pre_process:
                vlm.input_tensor = self.embeddings(step, sample_ids)
            batch = collate_rows([step.samples[sid] for sid in sample_ids])
            return original(iter([batch]), model)

        return flow_forward_step


def finalize_with_global_tokens(ctx: FlowContext, finalize: Callable[..., Any]) -> Callable[..., Any]:
    """`finalize_model_grads` per part, with per-token scaling by the token count summed over every part.

    Megatron scales by the tokens of the part's own last stage (broadcast over PP, all-reduced over DP); the
    encoder has no loss, so the count is summed across the trainable parts instead (the decoder's last stage
    contributes, everyone else adds zero) and each part scales by it. Without per-token loss Megatron averages
    over DP inside each part; the encoder's gradients came from the decoder's DP replicas, so they are rescaled
    by encoder_dp / decoder_dp to average over the decoder's DP like the coupled job.
    """
    from megatron.core import parallel_state as ps

    def flow_finalize(model: list, num_tokens: Optional[torch.Tensor] = None) -> None:
        finalize(model, None)
        if ctx.timer is not None:
            prefix = "encoder" if ctx.is_encoder else "decoder"
            ctx.counters[f"{prefix}_busy_s"], ctx.counters[f"{prefix}_wait_s"] = ctx.timer.result()
        contributes = (not ctx.is_encoder and ps.is_pipeline_last_stage(ignore_virtual=True)
                       and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
        # One all-reduce carries the token count and each part leader's busy/wait seconds (for the log line).
        keys = ("encoder_busy_s", "encoder_wait_s", "decoder_busy_s", "decoder_wait_s")
        # float32: MindSpeed wraps torch.distributed.all_reduce so that a float64 tensor is reduced on a float32
        # copy whose result is dropped (HCCL has no float64); the original would silently stay unreduced.
        stats = torch.zeros(1 + len(keys), dtype=torch.float32)
        if num_tokens is not None and contributes:
            stats[0] = float(num_tokens)
        if ctx.is_part_leader:
            own = keys[:2] if ctx.is_encoder else keys[2:]
            for key in own:
                stats[1 + keys.index(key)] = ctx.counters.get(key, 0.0)
        dist.all_reduce(stats, group=ctx.reduce_group)
        for i, key in enumerate(keys, start=1):
            ctx.counters[key] = float(stats[i])
        if num_tokens is not None:
            total = float(stats[0])
            ctx.counters["global_tokens"] = total
            if total > 0:
                for chunk in model:
                    chunk.scale_gradients(1.0 / total)
        elif ctx.is_encoder:
            enc_dp, dec_dp = ctx.parts.part("encoder").dp, ctx.parts.part("backbone").dp
            if enc_dp != dec_dp:
                for chunk in model:
                    chunk.scale_gradients(enc_dp / dec_dp)

    return flow_finalize


def global_grad_norm(ctx: FlowContext, part_norm: float, norm_type: float) -> float:
    """The norm over every trainable part, from each part's own norm (one value per part, from its leader)."""
    if not ctx.part_trainable or ctx.reduce_group is None:
        return part_norm
    inf = norm_type == math.inf
    value = float(part_norm) if inf else float(part_norm) ** norm_type
    t = torch.tensor([value if ctx.is_part_leader else 0.0], dtype=torch.float32)  # see flow_finalize: not float64
    dist.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=ctx.reduce_group)
    total = float(t[0]) if inf else float(t[0]) ** (1.0 / norm_type)
    ctx.counters["grad_norm_part"] = float(part_norm)
    ctx.counters["grad_norm_global"] = total
    return total
