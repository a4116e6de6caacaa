"""The MindSpeed-MM host: what a flow rank hands MindSpeed-MM's `pretrain` instead of `pretrain_vlm.py`'s providers.

- `model_provider`: the job's own provider with `modules=` the part's modules (encoder ranks build ViT +
  projector only, an audio part's ranks Qwen2.5-Omni's audio encoder only, decoder ranks the text decoder (with
  the audio encoder on its first stage when that is not a part); no rank materialises another part), after the model
  config's pipeline splits are set to the part's own PP: the ViT whole, the LLM as `recipe.decoder_split` chose
  (recipe layer_split, else model.json's split when it has one entry per decoder stage, else even); each decoder
  stage prints the layers its built model holds.
- `dataset_provider`: MindSpeed-MM's dataset and sampler over whole global batches, planned per step from the
  metadata index, each rank loading only what its side uses (`data.FlowStepSource`, `index.py`).
- `forward_step`: the job's forward step, fed a collated decoder microbatch with its image embeddings.
- `forward_backward_func`: `schedule.EncoderStep` on encoder ranks (image or audio), `schedule.DecoderStep` around Megatron's
  schedule on decoder ranks.
- what the job writes for its users (`metrics`): metrics.jsonl and `flow/` TensorBoard scalars from the log line's
  values (`log_iteration`), the trace (`finish`).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from mindspeed_flow.hosts.mindspeed_mm import context as flow_context
from mindspeed_flow.hosts.mindspeed_mm import memory as flow_memory
from mindspeed_flow.hosts.mindspeed_mm.context import FlowContext, PartFigures
from mindspeed_flow.hosts.mindspeed_mm.data import (LAYOUT_PACKED, LAYOUT_ROWS, OMNI_SECONDS_KEY, SECONDS_KEY,
                                                    FlowStepSource, IndexedReads, ReplicaView, SideNeeds,
                                                    WholeBatchReads, sample_meta)
from mindspeed_flow.hosts.mindspeed_mm.index import index_folder, index_inputs, load_or_build
from mindspeed_flow.hosts.mindspeed_mm.metrics import FlowMetrics, loss_value
from mindspeed_flow.hosts.mindspeed_mm.schedule import DecoderStep, EncoderStep, finalize_with_global_tokens, loss_mode
from mindspeed_flow.packing import CostModel
from mindspeed_flow.pool.planned import PlannedTransport
from mindspeed_flow.skus import EMULATED_NPU_NAME
from mindspeed_flow.specs import LLMSpec, VisionSpec, VLMSpec
from mindspeed_flow.step.layout import Bridge
from mindspeed_flow.telemetry import trace
from mindspeed_flow.telemetry.metrics import machine_peak_flops


def active() -> "FlowHost":
    """The rank's flow host (its FlowContext holds it once MindSpeed-MM's pretrain started through the patch)."""
    ctx = flow_context.current()
    if ctx is None or ctx.host is None:
        raise RuntimeError("mindspeed-flow: the flow host is not set up (mindspeed_mm.training.pretrain was not "
                           "called through the flow patch)")
    return ctx.host


def _cfg(node: Any, key: str, default: Any = None) -> Any:
    return getattr(node, key, default) if node is not None else default


def model_spec(model_cfg: Any) -> VLMSpec:
    """model.json's dimensions as the spec the cost model reads (MindSpeed-MM's Qwen2/Qwen2.5-VL: its `qwen2vit`
    ViT with the patch merger, windowed attention when `window_attn_size` is set, and a Qwen2 LLM)."""
    llm, vit = model_cfg.text_decoder, model_cfg.image_encoder.vision_encoder
    heads = int(llm.num_attention_heads)
    windowed = bool(_cfg(vit, "window_attn_size", 0))
    vision = VisionSpec(
        kind="qwen2_5_vl" if windowed else "qwen2_vl", depth=int(vit.num_layers), hidden_size=int(vit.hidden_size),
        intermediate_size=int(vit.ffn_hidden_size), num_heads=int(vit.num_attention_heads),
        out_hidden_size=int(llm.hidden_size), patch_size=int(_cfg(vit, "patch_size", 14)),
        temporal_patch_size=int(_cfg(vit, "temporal_patch_size", 2)), in_channels=int(_cfg(vit, "in_channels", 3)),
        spatial_merge_size=int(_cfg(vit, "spatial_merge_size", 2)),
        window_size=int(_cfg(vit, "window_attn_size", 0) or 0),
        fullatt_block_indexes=tuple(_cfg(vit, "fullatt_block_indexes", None) or ()))
    text = LLMSpec(
        num_layers=int(llm.num_layers), hidden_size=int(llm.hidden_size), ffn_hidden_size=int(llm.ffn_hidden_size),
        num_heads=heads,
        num_kv_heads=int(_cfg(llm, "num_query_groups", None) or heads) if _cfg(llm, "group_query_attention") else heads,
        vocab_size=int(llm.vocab_size),
        tie_embeddings=not _cfg(llm, "untie_embeddings_and_output_weights", False),
        qkv_bias=bool(_cfg(llm, "add_qkv_bias", False)))
    return VLMSpec(name=str(_cfg(model_cfg, "model_id", "mindspeed_mm")), vision=vision, llm=text)


def vit_frozen(model_cfg: Any) -> bool:
    """MindSpeed-MM freezes the ViT unless model.json says otherwise; a frozen ViT runs forward only."""
    return bool(_cfg(model_cfg.image_encoder.vision_encoder, "freeze", True))


def side_needs(ctx: FlowContext, audio: bool = False) -> SideNeeds:
    """What this rank's side uses of each step (Megatron's parallel state is the part's own here). `audio`: the
    model has an audio encoder, which reads clips on the decoder's first stage unless it is a part of its own."""
    if ctx.is_encoder:
        return SideNeeds(encoder_leader=ctx.replica_leader(), encoder_part=ctx.part)
    from megatron.core import parallel_state as ps  # optional: megatron

    return SideNeeds(decoder_dp=ps.get_data_parallel_rank(), labels=ps.is_pipeline_last_stage(ignore_virtual=True),
                     clip_features=audio and not ctx.parts.audio_part and ps.is_pipeline_first_stage())


def build_reads(ctx: FlowContext, args: Any, data_cfg: Any, *, vision_start_id: int, image_token_id: int,
                merge_size: int) -> Any:
    """MindSpeed-MM's data set and one loader per decoder DP replica (`ReplicaView`), read per side from the
    metadata index (`data.IndexedReads`), or whole through the loaders where the data set is streamed or
    MSF_FLOW_DATA_READS=whole (`data.WholeBatchReads`)."""
    from mindspeed_mm.data import build_mm_dataloader, build_mm_dataset  # optional: mindspeed_mm

    datasets = build_mm_dataset(data_cfg.dataset_param)
    train = datasets[0] if isinstance(datasets, (tuple, list)) else datasets
    replicas = ctx.parts.layout.part("backbone").dp
    whole = os.environ.get("MSF_FLOW_DATA_READS", "") == "whole" or isinstance(train, torch.utils.data.IterableDataset)
    workers = args.num_workers
    loaders = []
    try:  # whole reads: each replica's loader gets its share of the job's loader processes; else none iterates
        args.num_workers = -(-workers // replicas) if workers and whole else 0
        for r in range(replicas):
            loaders.append(build_mm_dataloader(train, data_cfg.dataloader_param, process_group=ReplicaView(replicas, r),
                                               dataset_param=data_cfg.dataset_param,
                                               consumed_samples=args.consumed_train_samples))
    finally:
        args.num_workers = workers
    samplers = [getattr(loader, "batch_sampler", None) for loader in loaders]
    collate = getattr(loaders[0], "collate_fn", None)
    ids = (vision_start_id, image_token_id, merge_size)
    if not whole and (any(s is None for s in samplers) or collate is None):
        whole = True
    if whole:
        if ctx.rank == 0:
            why = "MSF_FLOW_DATA_READS=whole" if os.environ.get("MSF_FLOW_DATA_READS") == "whole" else \
                "the data set is streamed (no indices to plan from)"
            print(f"[mindspeed-flow] data: every rank reads whole global batches, pixels included ({why})", flush=True)
        return WholeBatchReads(loaders, *ids)
    inputs = index_inputs(data_cfg.dataset_param, args.seq_length, train,
                          {"vision_start_id": vision_start_id, "image_token_id": image_token_id,
                           "merge_size": merge_size})
    index = load_or_build(index_folder(data_cfg.dataset_param), inputs,
                          functools.partial(sample_meta, train, collate, *ids), len(train), workers=workers,
                          log=lambda line: print(f"[mindspeed-flow] {ctx.describe(ctx.rank)} {line}", flush=True))
    return IndexedReads(train, collate, samplers, index, side_needs(ctx, has_audio(args.mm.model)), *ids)


def report_reads(ctx: FlowContext, source: FlowStepSource, audio: bool = False) -> None:
    """At exit, one line per rank: what it read through the loaders (with `audio`, the bytes of audio features
    too) and its peak host memory (resident set)."""
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    clips = f", {source.reads.clip_bytes} bytes of audio features" if audio else ""
    print(f"[mindspeed-flow] {ctx.describe(ctx.rank)} read {source.samples_read} samples, "
          f"{source.pixel_bytes_read} bytes of pixels{clips}; peak host memory {peak_mib:.0f} MiB", flush=True)


def has_audio(model_cfg: Any) -> bool:
    """Whether model.json has an audio encoder (Qwen2.5-Omni); it runs on the decoder's ranks."""
    return _cfg(model_cfg, "audio_encoder") is not None


def decoder_layout(ctx: FlowContext, args: Any) -> str:
    """The decoder microbatch layout: `packing.layout`, with auto = packed when the job runs flash attention (the
    TND varlen kernel) and the model has no audio encoder (a packed row restarts each sample's rope positions,
    which Qwen2.5-Omni's rope index computes from the row's audio too), else rows. The recipe check refuses
    packed without flash attention, and packed with an audio encoder."""
    layout = ctx.parts.packing.layout
    if layout == "auto":
        packed = getattr(args, "use_flash_attn", False) and not has_audio(args.mm.model)
        return LAYOUT_PACKED if packed else LAYOUT_ROWS
    return layout


def sequence_pad_multiple(ctx: FlowContext, args: Any) -> int:
    """Sequence parallelism splits each microbatch's sequence over the TP ranks: lengths pad to a multiple of TP."""
    tp = ctx.layout.tp
    return tp if tp > 1 and getattr(args, "sequence_parallel", False) else 1


def _device_name(device: torch.device) -> tuple[str, bool]:
    """(the device's name for the SKU table, whether it is host CPU: a CPU run or the emulated NPU)."""
    if device.type == "cpu":
        return "cpu", True
    module = getattr(torch, device.type)
    name = str(module.get_device_name(device))
    return name, name == EMULATED_NPU_NAME


@contextlib.contextmanager
def plain_linears_unless(use_mc2: bool) -> Iterator[None]:
    """Build with Megatron's own parallel linears unless this part runs MC2.

    MindSpeed decides MC2 once per process, at import, from the command line, by replacing Megatron's
    Column/RowParallelLinear classes everywhere (spec modules included). In a flow job that decision is per part:
    the launcher lets MindSpeed install the MC2 classes when any part can use them, and a part that cannot (TP 1,
    or no sequence parallel) constructs its model with the original classes put back for the duration.
    """
    from megatron.core.tensor_parallel import layers  # optional: megatron

    swaps = []
    if not use_mc2:
        for name in ("ColumnParallelLinear", "RowParallelLinear"):
            current = getattr(layers, name)
            original = next((c for c in current.__mro__[1:] if c.__name__ == name and
                             c.__module__ == "megatron.core.tensor_parallel.layers"), None)
            if original is None or "MC2" not in current.__name__:
                continue
            for mod in list(sys.modules.values()):
                # the module's own names only: getattr would call a module-level __getattr__ (the emulated
                # torch_npu's records every name asked of it as a missing NPU op)
                if getattr(mod, "__dict__", {}).get(name) is current:
                    swaps.append((mod, name, current))
                    setattr(mod, name, original)
    try:
        yield
    finally:
        for mod, name, current in swaps:
            setattr(mod, name, current)


def report_decoder_stage(model: Any, split: tuple[int, ...], source: str) -> None:
    """One line per decoder pipeline stage (its first TP and DP rank) with the layers the built model holds.

    Counted from the module itself, not from the config, so a split that did not reach the model shows here."""
    from megatron.core import parallel_state as ps  # optional: megatron

    if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
        return
    layers = getattr(getattr(getattr(model, "text_decoder", None), "decoder", None), "layers", None)
    built = "?" if layers is None else len(layers)
    print(f"[mindspeed-flow] text_decoder stage {ps.get_pipeline_model_parallel_rank()}: built {built} layers "
          f"(split {list(split)} from {source})", flush=True)


class FlowHost:
    def __init__(self, ctx: FlowContext) -> None:
        self.ctx = ctx
        self._step: Any = None
        self.metrics: Optional[FlowMetrics] = None  # on the writer rank, when the job has a run folder
        self.fbf_done_at = 0.0  # time.time() when this rank's forward-backward of the running step returned
        self._memory_steps = 0  # forward-backwards run (the step number of the memory line, MSF_FLOW_MEMORY=1)
        self._finalize_wrapped = False  # Megatron's finalize_model_grads_func wrapped (once per model config)
        ctx.host = self

    @property
    def is_writer(self) -> bool:
        """The global last rank: a decoder last-stage rank, where Megatron prints its iteration line."""
        return self.ctx.rank == self.ctx.parts.layout.world_size - 1

    # ------------------------------------------------------------------------------ providers

    def model_provider(self, original: Callable[..., Any]) -> Callable[..., Any]:
        ctx = self.ctx

        def flow_model_provider(pre_process: bool = True, post_process: bool = True, modules: Any = None) -> Any:
            from megatron.training import get_args  # optional: megatron

            model_cfg = get_args().mm.model
            if ctx.is_audio:
                enc = model_cfg.audio_encoder.audio_encoder
                enc.pipeline_num_layers = [int(enc.num_layers)]
            elif ctx.is_encoder:
                vit = model_cfg.image_encoder.vision_encoder
                vit.pipeline_num_layers = [int(vit.num_layers)]
            else:
                model_cfg.text_decoder.pipeline_num_layers = list(ctx.parts.decoder_layers)
                audio = _cfg(model_cfg, "audio_encoder")
                if audio is not None and not ctx.parts.audio_part:
                    # The audio encoder runs whole on the decoder's first stage, where its rows are scattered
                    # into the input embeddings (MindSpeed-MM's own example splits it [32, 0] over two stages).
                    enc = audio.audio_encoder
                    enc.pipeline_num_layers = [int(enc.num_layers)] + [0] * (len(ctx.parts.decoder_layers) - 1)
            with plain_linears_unless(ctx.uses_mc2(get_args())):
                model = original(pre_process, post_process, modules=ctx.modules)
            if not ctx.is_encoder:
                report_decoder_stage(model, ctx.parts.decoder_layers, ctx.parts.decoder_layers_from)
            return model

        return flow_model_provider

    def dataset_provider(self, original: Callable[..., Any]) -> Callable[..., Any]:
        ctx = self.ctx

        def flow_dataset_provider(train_val_test_num_samples: Any) -> tuple[Any, None, None]:
            from megatron.training import get_args  # optional: megatron

            args = get_args()
            data_cfg, model_cfg = args.mm.data, args.mm.model
            ids = dict(vision_start_id=int(model_cfg.vision_start_token_id),
                       image_token_id=int(model_cfg.img_context_token_id),
                       merge_size=int(_cfg(model_cfg.image_encoder.vision_encoder, "spatial_merge_size", 2)))
            reads = build_reads(ctx, args, data_cfg, **ids)
            spec, frozen = model_spec(model_cfg), vit_frozen(model_cfg)
            # After a resume Megatron has set args.iteration (and the sampler starts at consumed_train_samples).
            first_step = int(getattr(args, "iteration", 0) or 0)
            packing = ctx.parts.packing
            source = FlowStepSource(
                reads, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                bridges={part: Bridge.build(ctx.producers(part), ctx.consumers())
                         for part in ctx.parts.layout.encoder_parts},
                token_budget=packing.token_budget,
                # the scheduler's costs: the recipe's profiled coefficients where it has them, else model FLOPs;
                # MFU always counts model FLOPs
                cost_model=CostModel.from_config(packing, spec, frozen),
                flops_model=CostModel.from_spec(spec, frozen),
                scheduler=packing.scheduler,
                min_microbatches=ctx.parts.layout.part("backbone").pp, oversize_policy=packing.oversize_policy,
                merge_size=ids["merge_size"], first_step=first_step, layout=decoder_layout(ctx, args),
                pad_multiple=sequence_pad_multiple(ctx, args))
            atexit.register(report_reads, ctx, source, has_audio(model_cfg))
            return source, None, None

        flow_dataset_provider.is_distributed = True  # every rank builds it (MindSpeed-MM sets the same)
        return flow_dataset_provider

    def forward_step(self, original: Callable[..., Any]) -> Callable[..., Any]:

        def flow_forward_step(data_iterator: Any, model: Any) -> Any:
            return self._decoder_step().forward_step(original)(data_iterator, model)

        return flow_forward_step

    # ------------------------------------------------------------------------------ schedule

    def _transport_factory(self, device: torch.device) -> Callable[[str], PlannedTransport]:
        ctx = self.ctx

        def make(part: str) -> PlannedTransport:
            groups = ctx.bridge_groups[part]
            return PlannedTransport(rank=ctx.rank, embedding_group=groups.embedding, gradient_group=groups.gradient,
                                    header_group=groups.header, device=device, timeout_s=ctx.parts.timeout_s,
                                    describe=ctx.describe)

        return make

    def _decoder_step(self) -> DecoderStep:
        assert isinstance(self._step, DecoderStep), "decoder forward step outside the decoder schedule"
        return self._step

    def forward_backward_func(self, megatron_fbf: Callable[..., Any]) -> Callable[..., Any]:
        if self._step is None:
            from megatron.training import get_args  # optional: megatron

            args = get_args()
            # Where the job's tensors live: the current NPU (transfer_to_npu maps .cuda() to it), chosen by
            # Megatron's initialisation before the first step.
            device = torch.zeros(1).cuda().device
            self.ctx.device = device
            self._start_outputs(args)
            factory = self._transport_factory(device)
            # The projector maps the ViT into the LLM's hidden size: that is the embedding width on the wire.
            hidden = int(args.mm.model.text_decoder.hidden_size)
            if self.ctx.is_encoder:
                self._step = EncoderStep(self.ctx, factory, hidden, args.params_dtype, part=self.ctx.part)
            else:
                audio = has_audio(args.mm.model)  # Qwen2.5-Omni: its rope index reads its own batch keys
                self._step = DecoderStep(
                    self.ctx, megatron_fbf, factory, hidden, args.params_dtype, loss=loss_mode(args),
                    pad_multiple=sequence_pad_multiple(self.ctx, args),
                    loader_batches=args.global_batch_size // args.micro_batch_size, layout=decoder_layout(self.ctx, args),
                    seconds_key=OMNI_SECONDS_KEY if audio else SECONDS_KEY, audio=audio)
        step = self._step  # Megatron's schedule function is fixed by the pipeline size: the one given first

        def run(*args: Any, **kwargs: Any) -> Any:
            from megatron.core.utils import get_model_config  # optional: megatron

            config = get_model_config(kwargs["model"][0])
            if not self._finalize_wrapped:
                config.finalize_model_grads_func = finalize_with_global_tokens(self.ctx,
                                                                               config.finalize_model_grads_func)
                self._finalize_wrapped = True
            before = flow_memory.point()
            out = step(*args, **kwargs)
            self.fbf_done_at = time.time()
            self._memory_steps += 1
            flow_memory.report(self.ctx.rank, "encoder" if self.ctx.is_encoder else "decoder", self._memory_steps,
                               before, kwargs["model"], self.ctx.shapes)
            return out

        return run

    # ------------------------------------------------------------------------------ what users look at

    def _start_outputs(self, args: Any) -> None:
        """On every rank at its first step: the tracer, and (for MFU) the peak of all devices, then the writer's
        metrics. On a host CPU (the emulated NPU) every rank times a matmul at once, so this waits for every rank
        once, before the first step; on a device the peak is the SKU table's."""
        ctx = self.ctx
        parts = ctx.parts
        if parts.run_dir is None:
            if self.is_writer:
                print("[mindspeed-flow] no metrics.jsonl: the job has no run folder (set run_dir in the flow recipe, "
                      "or give the job --tensorboard-dir or --save)", flush=True)
            return
        run_dir = Path(parts.run_dir)
        if parts.trace:
            trace.install(trace.Tracer(ctx.rank, "encoder" if ctx.is_encoder else "backbone", run_dir / "trace"))
        name, host_cpu = _device_name(ctx.device)
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(args.params_dtype, "fp32")
        peak, desc = machine_peak_flops(name, host_cpu, dtype, parts.layout.world_size, group=ctx.metrics_group)
        if self.is_writer:
            self.metrics = FlowMetrics(run_dir, getattr(args, "tensorboard_dir", None), peak, desc,
                                       parts.encoder_trainable)

    def finish(self) -> None:
        """After MindSpeed-MM's pretrain returns, on every rank: wait for this rank's sends to be received; close
        the metrics; merge the trace."""
        if self._step is not None:
            # A frozen encoder runs ahead of the decoder (it waits for no gradient) and can finish while its last
            # embeddings are still on the wire: gloo moves a message only once the receiver has posted its receive,
            # and a process that exits with a send pending aborts ("terminate called without an active exception").
            self.ctx.doing("waiting for the last sends to be received")
            self._step.flush()
        if self.metrics is not None:
            self.metrics.close()
        parts = self.ctx.parts
        if parts.trace and parts.run_dir is not None:
            path = trace.finish(Path(parts.run_dir), self.ctx.metrics_group, self.is_writer, parts.layout.world_size)
            if path is not None:
                print(f"[mindspeed-flow] trace: {path} (open it in Perfetto; `mindspeed-flow report "
                      f"{parts.run_dir}` draws a step)", flush=True)

    def log_iteration(self, iteration: Any, entered_at: float, loss_dict: Any = None, lr: Optional[float] = None,
                      grad_norm: Optional[float] = None) -> None:
        """After Megatron's iteration line: on every rank the trace's optimizer span (from the forward-backward's
        return to Megatron's log: the optimizer step and the LR update); on the rank that prints the line, the
        per-part busy/wait seconds, and the iteration's metrics line."""
        tracer = trace.current()
        if tracer is not None and self.fbf_done_at:
            tracer.complete("optimizer", self.fbf_done_at, entered_at, "optimizer")
        if not self.is_writer:
            return
        stats = self.ctx.stats
        stats.read_pending()
        if self.metrics is not None:
            self.metrics.write(int(iteration), stats, loss=loss_value(loss_dict), lr=lr,
                               grad_norm=None if grad_norm is None else float(grad_norm), logged_at=entered_at,
                               step_started_at=self.ctx.step_started_at)
        f = stats.reduced or PartFigures()
        parts = []
        if self.ctx.parts.encoder_trainable:
            parts.append(f"encoder busy {f.encoder_busy_s:.3f} s wait {f.encoder_wait_s:.3f} s")
        parts.append(f"decoder busy {f.decoder_busy_s:.3f} s wait {f.decoder_wait_s:.3f} s")
        extra = f" | global tokens {stats.global_tokens}" if stats.global_tokens is not None else ""
        if stats.grad_norm_global is not None:
            extra += f" | grad norm global {stats.grad_norm_global:.4f} (decoder part {stats.grad_norm_part:.4f})"
        if stats.reduced is not None and self.ctx.parts.audio_part:
            extra += (f" | gradient bytes sent {int(f.grad_bytes_sent)} (decoder, this step: image encoder "
                      f"{int(f.grad_bytes_sent - f.grad_bytes_audio)}, audio encoder {int(f.grad_bytes_audio)})")
        elif stats.reduced is not None:
            extra += f" | gradient bytes sent {int(f.grad_bytes_sent)} (decoder, this step)"
        if stats.reduced is not None and self.ctx.parts.encoder_trainable:
            # The peak of decoder microbatch groups whose ViT activations encoder dp0 held at once, and their bytes.
            extra += (f" | encoder held {int(f.encoder_held_groups)} groups {int(f.encoder_held_bytes)} bytes "
                      f"(peak, encoder dp0, bound {self.ctx.parts.encoder_inflight})")
        c = stats.counts
        pad = f" | padding {1 - c.real_tokens / c.padded_tokens:.1%}" if c.padded_tokens else ""
        pad += f" | microbatches {c.microbatches_per_rank}"
        print(f" [flow] iteration {iteration} | " + " | ".join(parts) + pad + extra, flush=True)
