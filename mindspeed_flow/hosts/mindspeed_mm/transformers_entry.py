"""MindSpeed-MM's `pretrain_transformers.py` as a flow job (Megatron's loop over an HF-style model that MindSpeed's
torch FSDP2 shards): `CONFIG.yaml` (its Qwen3-VL 8B/32B and 30B-A3B full fine-tuning examples) or the arguments on
the command line with `--mm-model model.json --mm-data data.json` (its GLM-4.5V example).

    torchrun ... -m mindspeed_flow_patches.launch --flow-recipe FLOW.yaml pretrain_transformers.py CONFIG.yaml
    torchrun ... -m mindspeed_flow_patches.launch --flow-recipe FLOW.yaml pretrain_transformers.py $GPT_ARGS $MM_ARGS ...

The vision tower (`model.visual`: its blocks, merger and deepstack mergers) trains on the encoder part's ranks, the
LLM on the backbone part's ranks. Each part is a Megatron job of its own size: the Megatron flow patch gives each
part its own parallel state (`context.FlowContext`: world size, data-parallel group), so MindSpeed's FSDP2 adaptor,
which shards over Megatron's data-parallel group, shards each part over its own ranks only. What this module adds
to MindSpeed-MM's providers (`TransformersHost`):

- `model_provider`: the job's own `TransformersModel`, then the other part's weights dropped before MindSpeed's
  adaptor shards, initialises (meta device) or loads them; the module tree stays (MindSpeed-MM's `_fully_shard`
  names every block and layer), its leaves hold no values;
- the data: MindSpeed-MM's provider unchanged on every rank, over each part's data-parallel group, so each backbone
  rank reads what the unpatched job's rank of the same DP index reads; encoder ranks build their loaders too (the
  build holds world-wide barriers around the preprocessing, and Megatron broadcasts whether to train from global
  rank 0, an encoder rank) and never iterate them;
- `forward_step` (backbone): before the model sees a micro-batch, its images and videos go to their encoder ranks and
  the rows come back (the FSDP2 trainer's flow exchange, `fsdp2.FlowFsdp2`: per image the merged embedding and the
  deepstack maps side by side); `get_image_features` (and GLM-4.5V's `get_video_features`) answers from them, so
  the model's forward and loss run unchanged;
- `forward_backward_func` (encoder): one encoder micro-step per backbone micro-batch (encode, send, backward the
  returned gradients scaled by encoder ranks / backbone ranks: each part's FSDP2 averages over its own ranks), then
  Megatron's gradient finalisation;
- the gradient norm is one norm over both parts (the Megatron flow patch's `get_grad_norm_fp32` wrapper).

Checked before launch (`transformers_parts_for_job`): the model family, FSDP2 on, no TP/PP/CP inside a part, the
global batch divisible over both parts, no validation split or text-only dynamic batching, the loss type, the
sampler.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from omegaconf import OmegaConf

from mindspeed_flow.config.schema import PackingConfig
from mindspeed_flow.hosts.mindspeed_mm import fsdp2
from mindspeed_flow.hosts.mindspeed_mm.context import FlowContext
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowParts, FlowRecipeError, load_flow_job
from mindspeed_flow.step.layout import BACKBONE, ENCODER, Layout

SCRIPT = "pretrain_transformers.py"
# CONFIG.yaml model.model_id -> the vision tower's path inside MindSpeed-MM's TransformersModel (its HF model is
# `.model`, whose `.model.visual` is the tower: merger and deepstack mergers included).
VISION_PATHS: dict[str, str] = {"qwen3_vl": "model.model.visual", "qwen3_vl_moe": "model.model.visual",
                                "glm4v_moe": "model.model.visual"}
# Models whose MindSpeed-MM forward runs the tower under no_grad when tower and projector are both frozen.
NO_GRAD_WHEN_FROZEN = ("qwen3_vl", "qwen3_vl_moe")
# Models whose tower takes a video as its frames, each an image of grid (1, h, w) (GLM-4.5V's `get_video_features`
# flattens the grid so and calls the tower itself; Qwen3-VL's passes (t, h, w) to `get_image_features`).
FRAMES_AS_IMAGES = ("glm4v_moe",)
# MindSpeed-MM loss types the flow job is tested with (the examples': Qwen3-VL default, GLM-4.5V per token).
LOSS_TYPES = ("default", "per_token_loss")
# gpt_args the flow job cannot honour: (key, the value it needs, why).
_REFUSED_GPT_ARGS: tuple[tuple[str, Any, str], ...] = (
    ("tensor_model_parallel_size", 1, "MindSpeed-MM's transformers path shards with FSDP2, not TP"),
    ("pipeline_model_parallel_size", 1, "MindSpeed-MM's transformers path shards with FSDP2, not PP"),
    ("context_parallel_size", 1, "context parallelism inside a part is not supported by the flow job yet"),
    ("use_torch_fsdp2", True, "the flow job splits the FSDP2 model of this entry (each part its own FSDP2 mesh)"),
    ("use_txt_dynamic_batching", False, "text-only dynamic batching is not supported by the flow job yet"),
)


@dataclass(frozen=True)
class TransformersParts:
    """The flow layout of a `pretrain_transformers.py` job: the Megatron side (per-part parallel state, flow groups,
    global norm) and the rows' exchange (plan and transport, shared with the FSDP2 trainer's flow job)."""

    flow: FlowParts
    exchange: fsdp2.Fsdp2Parts

    @property
    def layout(self) -> Layout:
        return self.flow.layout

    @property
    def micro_steps(self) -> int:
        """Micro-batches per step: the backbone part's (the encoder part follows them, whatever its own DP)."""
        return self.exchange.grad_accumulation

    def describe(self) -> str:
        return self.exchange.describe()


def _gpt_args(cfg: Any) -> dict[str, Any]:
    """gpt_args as MindSpeed-MM reads them: nested sections flattened, the last occurrence of a key winning."""
    out: dict[str, Any] = {}

    def walk(node: Any) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value)
            else:
                out[str(key)] = value

    walk(OmegaConf.to_container(cfg.get("gpt_args") or {}, resolve=True))
    return out


def _flag_value(word: str) -> Any:
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    return word


def _command_line_args(argv: Sequence[str]) -> dict[str, Any]:
    """Megatron-style `--some-flag [value]` words as {some_flag: value} (a flag without a value: True)."""
    out: dict[str, Any] = {}
    for i, word in enumerate(argv):
        if not word.startswith("--"):
            continue
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        out[word[2:].replace("-", "_")] = True if nxt is None or nxt.startswith("--") else _flag_value(nxt)
    return out


@dataclass(frozen=True)
class EntryJob:
    """What the flow job reads of a `pretrain_transformers.py` job, in either of its forms: `CONFIG.yaml` (gpt_args,
    model and data sections in one file: the Qwen3-VL examples) or the arguments on the command line with
    `--mm-model model.json --mm-data data.json` (the GLM-4.5V and InternVL3.5 examples)."""

    source: str  # CONFIG.yaml, or the model.json the command line names
    gpt: dict[str, Any]
    model: Any  # OmegaConf node of the model section / model.json
    data: Any  # ... of the data section / data.json
    lora: bool

    def model_key(self, key: str) -> str:
        return f"model.{key}" if self.source.endswith((".yaml", ".yml")) else key

    def data_key(self, key: str) -> str:
        return f"data.{key}" if self.source.endswith((".yaml", ".yml")) else key


def read_entry_job(script_argv: Sequence[str]) -> EntryJob:
    if script_argv and str(script_argv[0]).endswith((".yaml", ".yml")):
        config_path = str(script_argv[0])
        if not Path(config_path).is_file():
            raise FlowRecipeError(f"{config_path}: no such file")
        cfg = OmegaConf.load(config_path)
        return EntryJob(config_path, _gpt_args(cfg), cfg.get("model") or OmegaConf.create({}),
                        cfg.get("data") or OmegaConf.create({}), "lora_args" in cfg)
    gpt = _command_line_args(list(script_argv))
    files = {}
    for flag in ("mm_model", "mm_data"):
        path = gpt.get(flag)
        if not isinstance(path, str):
            raise FlowRecipeError(f"{SCRIPT}: --{flag.replace('_', '-')} FILE.json is missing (the flow job reads the "
                                  "model and data description it names; or give CONFIG.yaml as the first argument)")
        if not Path(path).is_file():
            raise FlowRecipeError(f"--{flag.replace('_', '-')} {path}: no such file")
        files[flag] = path
    return EntryJob(files["mm_model"], gpt, OmegaConf.load(files["mm_model"]), OmegaConf.load(files["mm_data"]),
                    any(k.startswith("lora_") for k in gpt))


def transformers_parts_for_job(recipe_path: str | Path, script_argv: Sequence[str], world_size: int) -> TransformersParts:
    """Check FLOW.yaml against the job (CONFIG.yaml, or the command line and its model / data files) and the
    launched world before MindSpeed is imported."""
    name = Path(recipe_path).name
    job = load_flow_job(recipe_path)
    entry = read_entry_job(script_argv)
    src, gpt = entry.source, entry.gpt
    data_src = src if src.endswith((".yaml", ".yml")) else str(gpt["mm_data"])
    model_id = str(OmegaConf.select(entry.model, "model_id", default=""))
    if model_id not in VISION_PATHS:
        raise FlowRecipeError(f"{src}: {entry.model_key('model_id')}={model_id!r}: the {SCRIPT} flow job splits "
                              f"{', '.join(sorted(VISION_PATHS))} (a vision tower whose features it can move); "
                              "other models run unpatched")
    for key, needed, why in _REFUSED_GPT_ARGS:
        value = gpt.get(key, needed if key != "use_torch_fsdp2" else False)
        if value != needed:
            where = f"{src}: gpt_args.{key}" if src.endswith((".yaml", ".yml")) else f"--{key.replace('_', '-')}"
            raise FlowRecipeError(f"{where}={value!r}: {why} (set {needed!r})")
    if entry.lora:
        what = "lora_args" if src.endswith((".yaml", ".yml")) else "--lora-* arguments"
        raise FlowRecipeError(f"{src}: {what}: LoRA adapters of a decoupled model are not supported yet")
    val_rate = OmegaConf.select(entry.data, "dataset_param.basic_parameters.val_rate", default=0.0) or 0.0
    if float(val_rate) > 0:
        raise FlowRecipeError(f"{data_src}: {entry.data_key('dataset_param.basic_parameters.val_rate')}={val_rate}: "
                              "validation of a decoupled model is not supported yet (set 0)")
    loss_type = OmegaConf.select(entry.model, "loss_cfg.loss_type", default="default") or "default"
    if loss_type not in LOSS_TYPES:
        raise FlowRecipeError(f"{src}: {entry.model_key('loss_cfg.loss_type')}={loss_type!r}: the flow job is tested "
                              f"with {' and '.join(LOSS_TYPES)} only")
    sampler = OmegaConf.select(entry.data, "dataloader_param.sampler_type", default="BaseRandomBatchSampler")
    if sampler != "BaseRandomBatchSampler":
        raise FlowRecipeError(f"{data_src}: {entry.data_key('dataloader_param.sampler_type')}={sampler!r}: the flow "
                              "job is tested with BaseRandomBatchSampler only")
    videos = OmegaConf.select(entry.data, "dataset_param.attr.videos", default=None)
    if model_id in FRAMES_AS_IMAGES and videos and not video_metadata_takes_total_frames():
        import transformers  # only here: the check of a GLM-4.5V job with videos

        raise FlowRecipeError(
            f"{data_src}: {entry.data_key('dataset_param.attr.videos')}={videos!r}: MindSpeed-MM's {model_id} data "
            f"plugin describes a video with `total_frames`, which transformers {transformers.__version__}'s "
            "VideoMetadata rejects (the unpatched job fails on it too); install the transformers commit MindSpeed-MM's "
            "GLM-4.5V README names, or train on images")
    par = job.parallel
    layout = fsdp2.sharded_parts_layout(job, name, world_size)
    mbs = int(gpt.get("micro_batch_size", 1))
    gbs = int(gpt.get("global_batch_size", 0) or 0)
    if gbs < 1:
        raise FlowRecipeError(f"{src}: global_batch_size is missing: a flow job plans each global batch")
    stated = OmegaConf.select(OmegaConf.load(str(recipe_path)), "trainer.global_batch_size")
    if stated is not None and int(stated) != gbs:
        raise FlowRecipeError(f"{name}: trainer.global_batch_size={stated} but the job's global batch size is {gbs}; "
                              "make them agree")
    for part_name, dp in ((ENCODER, par.encoder.dp), (BACKBONE, par.backbone.dp)):
        # Megatron derives each part's micro-batch count from its own DP size and checks it divides.
        if gbs % (mbs * dp):
            raise FlowRecipeError(f"{name}: parallel.{part_name}.dp={dp}: the job's global batch size {gbs} must be "
                                  f"divisible by micro batch size {mbs} x dp")
    # MindSpeed-MM's Qwen3-VL runs the whole vision tower under no_grad when both the tower and the projector are
    # frozen (the examples' setting): the deepstack mergers, which `freeze` leaves trainable, then get no gradient
    # either, so the encoder part runs forward only. GLM-4.5V's `freeze` leaves the tower's position embedding,
    # downsampling and norms trainable and runs the tower with gradients: whether it trains is what its values say.
    frozen = model_id in NO_GRAD_WHEN_FROZEN and all(
        bool(OmegaConf.select(entry.model, f"image_encoder.{m}.freeze", default=False))
        for m in ("vision_encoder", "vision_projector"))
    flow = FlowParts(layout, PackingConfig(), float(job.flow.timeout_s), encoder_trainable=not frozen)
    exchange = fsdp2.Fsdp2Parts(layout, float(job.flow.timeout_s), mbs, gbs, 1, VISION_PATHS[model_id],
                                os.path.abspath(src), frames_as_images=model_id in FRAMES_AS_IMAGES)
    return TransformersParts(flow, exchange)


def video_metadata_takes_total_frames() -> bool:
    """Whether the installed transformers takes the video metadata MindSpeed-MM's GLM plugin gives it
    (`{"fps", "duration", "total_frames"}`): released transformers 4.56+ names the count `total_num_frames`."""
    try:
        from transformers.video_utils import VideoMetadata
    except ImportError:  # a transformers without the dataclass passes the plain dict on
        return True
    try:
        VideoMetadata(fps=2, duration=1, total_frames=1)
    except TypeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------- the host

class _ExchangingIterator:
    """The backbone's data iterator as the job's forward step sees it: each micro-batch's images are exchanged
    (sent to their encoder ranks, the rows received) when the forward step takes it."""

    def __init__(self, inner: Iterator[Any], host: "TransformersHost") -> None:
        self.inner, self.host = inner, host

    def __iter__(self) -> "_ExchangingIterator":
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.host.exchange(batch)
        return batch


class TransformersHost:
    """What a flow rank hands MindSpeed-MM's `pretrain` instead of `pretrain_transformers.py`'s providers."""

    def __init__(self, ctx: FlowContext, rows: fsdp2.FlowFsdp2, parts: TransformersParts) -> None:
        self.ctx, self.rows, self.parts = ctx, rows, parts
        self._finalize: Optional[Callable[..., Any]] = None

    @property
    def vision_path(self) -> str:
        return self.parts.exchange.vision_module

    def model_provider(self, original: Callable[..., Any]) -> Callable[..., Any]:
        ctx, rows = self.ctx, self.rows

        def flow_model_provider(*args: Any, **kwargs: Any) -> Any:
            model = original(*args, **kwargs)
            rows.take_model(model, self.vision_path, model.transformer_config.vision_config, keep_layers=True,
                            encoder_may_train=ctx.parts.encoder_trainable)
            return model

        return flow_model_provider

    def forward_step(self, original: Callable[..., Any]) -> Callable[..., Any]:

        def flow_forward_step(data_iterator: Any, model: Any) -> Any:
            return original(_ExchangingIterator(data_iterator, self), model)

        return flow_forward_step

    def exchange(self, batch: dict[str, Any]) -> None:
        """Send a loader micro-batch's images and videos to their encoder ranks and take back the rows. The loader
        gives host tensors; the entry's forward step casts the pixels to the FSDP2 compute dtype on the device, and
        so does this (the transfers run on the device backend)."""
        rows = self.rows
        on_device = dict(batch)
        for key in ("pixel_values", "pixel_values_videos"):
            if isinstance(batch.get(key), torch.Tensor):
                on_device[key] = batch[key].to(rows.transport.device, rows.transport.dtype)
        rows.backbone_exchange(on_device, rows.merge, rows.encoder_trainable)

    def _ensure_transport(self, model: list) -> None:
        rows = self.rows
        if rows.transport is not None:
            return
        # Where the job's tensors live: the current NPU (transfer_to_npu maps .cuda() to it).
        device = torch.zeros(1).cuda().device
        self.ctx.device = device
        rows.build_groups(device, _param_dtype(model[0]))
        # Whether the vision tower trains is the encoder ranks' to know: one broadcast from the first encoder rank.
        flag = torch.tensor([1 if rows.encoder_trainable else 0], dtype=torch.int64)
        torch.distributed.broadcast(flag, src=self.parts.layout.offset(ENCODER), group=rows.groups["plan"])
        rows.encoder_trainable = bool(flag.item())

    def forward_backward_func(self, megatron_fbf: Callable[..., Any]) -> Callable[..., Any]:

        def run(*args: Any, forward_step_func: Any = None, data_iterator: Any = None, model: Any = None,
                num_microbatches: int = 1, forward_only: bool = False, **kwargs: Any) -> Any:
            model_list = model if isinstance(model, list) else [model]
            self._ensure_transport(model_list)
            if not self.ctx.is_encoder:
                return megatron_fbf(*args, forward_step_func=forward_step_func, data_iterator=data_iterator,
                                    model=model, num_microbatches=num_microbatches, forward_only=forward_only,
                                    **kwargs)
            return self._encoder_step(model_list, forward_only)

        return run

    def _encoder_step(self, model: list, forward_only: bool) -> list[dict]:
        from megatron.core.utils import get_model_config  # optional: megatron

        rows = self.rows
        visual = fsdp2.module_at(_unwrap(model[0]), self.vision_path)
        trainable = rows.encoder_trainable and not forward_only
        # As many micro-steps as the backbone part runs (Megatron's count on this rank follows the encoder's DP).
        for _ in range(self.parts.micro_steps):
            rows.encoder_micro_step(visual, rows.merge, rows.patch_dim, rows.transport.dtype, rows.transport.device,
                                    trainable)
        config = get_model_config(model[0])
        if trainable and config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(model, None)
        return [{}]  # no loss on encoder ranks: train_step's loss reduction is a no-op


def _unwrap(module: Any) -> Any:
    """The TransformersModel under Megatron's wrappers (`.module` chains)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def _param_dtype(chunk: Any) -> torch.dtype:
    """The FSDP2 compute dtype (MindSpeed's fsdp2 config `param_dtype`), as pretrain_transformers.py's forward
    step reads it; bf16 when the policy leaves it unset (the entry's own default)."""
    inner = _unwrap(chunk).model
    state = getattr(inner, "_get_fsdp_state", None)
    dtype = state()._mp_policy.param_dtype if state is not None else None
    return dtype if dtype is not None else torch.bfloat16


_CURRENT: Optional[TransformersHost] = None


def current() -> Optional[TransformersHost]:
    return _CURRENT


def install(host: Optional[TransformersHost]) -> None:
    global _CURRENT
    _CURRENT = host


def for_this_process(parts: TransformersParts) -> TransformersHost:
    """This rank's flow context (Megatron side), rows' exchange and host."""
    ctx = FlowContext.for_this_process(parts.flow)
    rows = fsdp2.for_this_process(parts.exchange)
    return TransformersHost(ctx, rows, parts)
