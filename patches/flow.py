"""The flow patch set: a MindSpeed-MM job trains with the image encoder and the text decoder on separate ranks.

Each entry of `REGISTRY` names a real MindSpeed-MM / MindSpeed / Megatron-LM function, how it is patched (a
`wrapper` stacks over whatever MindSpeed already put there; nothing here replaces a function outright) and why.
`tests/test_patch_registry.py` checks every target exists with a compatible signature in the pinned sources.
All wrappers are inert when no flow recipe was given (`context.current()` is None): the job is then the
unpatched job.
"""
from __future__ import annotations

import functools
import importlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from mindspeed_flow.hosts.mindspeed_mm import context as flow_context
from mindspeed_flow.hosts.mindspeed_mm import host, packed
from mindspeed_flow.hosts.mindspeed_mm.checkpoint import (complete_param_groups, is_flow_iteration, load_for_part,
                                                          part_checkpoint_name)
from mindspeed_flow.hosts.mindspeed_mm.schedule import global_grad_norm
from mindspeed_flow.telemetry.trace import span


@dataclass(frozen=True)
class PatchTarget:
    """A function the flow job wraps (every patch keeps the original and calls it), why, and the leading
    parameters the wrapper relies on (checked against the pinned sources by the registry test)."""

    target: str
    why: str
    parameters: tuple[str, ...]  # leading parameters the wrapper relies on


REGISTRY: tuple[PatchTarget, ...] = (
    PatchTarget("megatron.training.arguments.validate_args",
                "each rank's args describe its own part (world size, TP/PP/CP) before Megatron derives DP",
                ("args", "defaults")),
    PatchTarget("megatron.training.initialize._initialize_distributed",
                "init_process_group over the whole world while the args describe the part",
                ("get_embedding_ranks", "get_position_embedding_ranks")),
    PatchTarget("megatron.core.parallel_state.initialize_model_parallel",
                "one pass per part over an offset sub-world; the rank keeps its own part's groups; flow groups",
                ("tensor_model_parallel_size", "pipeline_model_parallel_size")),
    PatchTarget("mindspeed_mm.training.pretrain",
                "swap in the flow model provider (modules= per part), data provider and forward step",
                ("train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func")),
    PatchTarget("megatron.core.pipeline_parallel.schedules.get_forward_backward_func",
                "encoder ranks get the streaming encoder step; decoder ranks Megatron's schedule over the plan",
                ()),
    PatchTarget("megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
                "one global gradient norm over every trainable part (dist-train clips per part)",
                ("grads_for_norm", "norm_type", "grad_stats_parallel_group")),
    PatchTarget("megatron.core.optimizer.optimizer.MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan",
                "one found-inf decision over every trainable part (fp16 loss scaling skips a step everywhere "
                "or nowhere)", ("self",)),
    PatchTarget("megatron.core.optimizer.get_megatron_optimizer",
                "a frozen part's dummy optimizer group gets the keys the distributed optimizer's loader matches on "
                "(wd_mult, lr_mult), so the job resumes from its own checkpoint", ("config", "model_chunks")),
    PatchTarget("megatron.training.checkpointing.get_checkpoint_name",
                "per-part checkpoint folders (mp_<part>_rank_TT[_PPP]) in Megatron's format",
                ("checkpoints_path", "iteration", "release", "pipeline_parallel", "tensor_rank", "pipeline_rank")),
    PatchTarget("megatron.training.checkpointing._get_checkpoint_format",
                "a flow job's own iteration folders (mp_<part>_rank_*) are Megatron's torch format, so the same "
                "command resumes from them", ("checkpoint_name",)),
    PatchTarget("megatron.training.checkpointing._load_base_checkpoint",
                "a coupled checkpoint loads into a decoupled run: each part takes, re-splits and renames its tensors",
                ("load_dir", "args", "rank0")),
    PatchTarget("mindspeed_mm.training.training_log",
                "per-part busy/wait seconds after Megatron's iteration line; the iteration's metrics.jsonl line from "
                "the values the log reads (loss, learning rate, gradient norm)",
                ("loss_dict", "total_loss_dict", "learning_rate", "decoupled_learning_rate", "iteration", "loss_scale",
                 "report_memory_flag", "skipped_iter", "grad_norm")),
    PatchTarget("mindspeed_mm.models.vision.vlm_attentionmask_for_llm.prepare_positionsids_mask_for_llm",
                "a packed (THD) decoder microbatch brings its per-sample position ids and needs no dense [s, s] mask "
                "(VLMModel builds one for every forward)", ("config", "input_ids", "inference_params",
                                                            "attention_mask", "position_ids")),
    PatchTarget("mindspeed_mm.models.common.mm_gpt_model.MMGPTModel.forward",
                "VLMModel never passes packed_seq_params to its text decoder; a packed microbatch's reach it",
                ("self", "input_ids", "position_ids", "attention_mask")),
    PatchTarget("mindspeed_mm.models.vision.vision_encoders.qwen2vl_vit_model.apply_multimodal_rotary_pos_emb",
                "fix: Qwen2vlSelfAttention squeezes packed q/k to [t, heads, dim] before mrope, whose cos/sin "
                "are [t, 1, 1, dim], so the product broadcasts to [t, t, heads, dim]; the rope runs on [t, 1, heads, "
                "dim]", ("q", "k", "cos", "sin")),
    PatchTarget("mindspeed_mm.models.vlm_model.VLMModel.process_multimodal_embeddings",
                "flow.fix_sp_embedding_grad: its gather of the text embeddings out of the sequence-parallel region "
                "splits the gradient instead of summing the TP ranks' copies (else the word embedding gets TP "
                "times its gradient); inert unless the recipe asks", ("self", "input_embeds", "input_ids",
                                                                       "vit_embeds", "audio_embeds")),
    PatchTarget("megatron.core.pipeline_parallel.schedules.backward_step",
                "the trace's decoder.backward span per microbatch (trainer.trace: true); the step is unchanged",
                ("input_tensor", "output_tensor", "output_tensor_grad", "model_type", "config")),
)

def module_of(target: str) -> str:
    """The importable module of a dotted target: the segments before the function, or before a Class.method."""
    parts = target.split(".")[:-1]
    while parts and parts[-1][:1].isupper():
        parts.pop()
    return ".".join(parts)


TARGET_MODULES = tuple(sorted({module_of(t.target) for t in REGISTRY}))


# ------------------------------------------------------------------------------------------- wrappers


def validate_args_wrapper(validate_args: Callable) -> Callable:
    @functools.wraps(validate_args)
    def wrapped(args: Any, defaults: Any = None) -> Any:
        ctx = flow_context.current()
        if ctx is not None:
            ctx.apply_part_args(args)
        return validate_args(args, {} if defaults is None else defaults)

    return wrapped


def initialize_distributed_wrapper(initialize_distributed: Callable) -> Callable:
    @functools.wraps(initialize_distributed)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ctx = flow_context.current()
        if ctx is None:
            return initialize_distributed(*args, **kwargs)
        from megatron.training import get_args  # optional: megatron

        margs = get_args()
        part_world = margs.world_size
        margs.world_size = ctx.parts.layout.world_size
        try:
            out = initialize_distributed(*args, **kwargs)
        finally:
            margs.world_size = part_world
        ctx.start_watchdog()
        return out

    return wrapped


def initialize_model_parallel_wrapper(initialize: Callable) -> Callable:
    @functools.wraps(initialize)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ctx = flow_context.current()
        if ctx is None:
            return initialize(*args, **kwargs)
        if len(args) < 2:
            args = (kwargs.pop("tensor_model_parallel_size", 1), kwargs.pop("pipeline_model_parallel_size", 1)) + args
        ctx.initialize_parts(initialize, args, kwargs)
        return None

    return wrapped


def pretrain_wrapper(pretrain: Callable) -> Callable:
    @functools.wraps(pretrain)
    def wrapped(train_valid_test_dataset_provider: Callable, model_provider: Callable, model_type: Any,
                forward_step_func: Callable, *args: Any, **kwargs: Any) -> Any:
        ctx = flow_context.current()
        if ctx is None:
            return pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                            *args, **kwargs)
        flow = host.FlowHost(ctx)
        out = pretrain(flow.dataset_provider(train_valid_test_dataset_provider), flow.model_provider(model_provider),
                       model_type, flow.forward_step(forward_step_func), *args, **kwargs)
        flow.finish()
        return out

    return wrapped


def get_forward_backward_func_wrapper(get_fbf: Callable) -> Callable:
    @functools.wraps(get_fbf)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fbf = get_fbf(*args, **kwargs)
        ctx = flow_context.current()
        if ctx is None:
            return fbf
        return host.active().forward_backward_func(fbf)

    return wrapped


def get_grad_norm_fp32_wrapper(get_norm: Callable) -> Callable:
    @functools.wraps(get_norm)
    def wrapped(grads_for_norm: Any, norm_type: Any = 2, grad_stats_parallel_group: Any = None) -> float:
        ctx = flow_context.current()
        if ctx is None:
            return get_norm(grads_for_norm, norm_type, grad_stats_parallel_group)
        # Megatron's distributed optimizer passes no group ("all ranks"): the part's ranks here. Over the world,
        # every part's norm would already hold the others', and the global norm below would count them twice.
        norm = get_norm(grads_for_norm, norm_type,
                        ctx.part_group if grad_stats_parallel_group is None else grad_stats_parallel_group)
        return global_grad_norm(ctx, norm, float(norm_type))

    return wrapped


def check_for_nan_wrapper(check: Callable) -> Callable:
    @functools.wraps(check)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> bool:
        found_inf = check(self, *args, **kwargs)
        ctx = flow_context.current()
        if ctx is None or not ctx.part_trainable:
            return found_inf
        # On the device: the reduce group runs on the job's backend (HCCL takes device tensors only).
        flag = torch.tensor([1.0 if found_inf else 0.0], dtype=torch.float32).to(ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.reduce_group)
        return bool(flag.item() > 0)

    return wrapped


def get_megatron_optimizer_wrapper(get_optimizer: Callable) -> Callable:
    @functools.wraps(get_optimizer)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        optimizer = get_optimizer(*args, **kwargs)
        if flow_context.current() is not None:
            complete_param_groups(optimizer)
        return optimizer

    return wrapped


def get_checkpoint_name_wrapper(get_name: Callable) -> Callable:
    @functools.wraps(get_name)
    def wrapped(checkpoints_path: Any, iteration: Any, *args: Any, **kwargs: Any) -> Any:
        name = get_name(checkpoints_path, iteration, *args, **kwargs)
        ctx = flow_context.current()
        if ctx is None:
            return name
        return part_checkpoint_name(name, ctx.part)

    return wrapped


def get_checkpoint_format_wrapper(get_format: Callable) -> Callable:
    @functools.wraps(get_format)
    def wrapped(checkpoint_name: Any) -> str:
        if flow_context.current() is not None and is_flow_iteration(checkpoint_name):
            return "torch"
        return get_format(checkpoint_name)

    return wrapped


def load_base_checkpoint_wrapper(load: Callable) -> Callable:
    @functools.wraps(load)
    def wrapped(load_dir: Any, args: Any, rank0: bool = False, *more: Any, **kwargs: Any) -> Any:
        ctx = flow_context.current()
        if ctx is None:
            return load(load_dir, args, rank0, *more, **kwargs)
        return load_for_part(ctx, load, load_dir, args, rank0, *more, **kwargs)

    return wrapped


def training_log_wrapper(training_log: Callable) -> Callable:
    names = ("loss_dict", "total_loss_dict", "learning_rate", "decoupled_learning_rate", "iteration", "loss_scale",
             "report_memory_flag", "skipped_iter", "grad_norm")

    @functools.wraps(training_log)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        entered_at = time.time()
        out = training_log(*args, **kwargs)
        ctx = flow_context.current()
        if ctx is not None:
            given = dict(zip(names, args), **kwargs)
            host.active().log_iteration(given.get("iteration"), entered_at, loss_dict=given.get("loss_dict"),
                                        lr=given.get("learning_rate"), grad_norm=given.get("grad_norm"))
        return out

    return wrapped


def backward_step_wrapper(backward_step: Callable) -> Callable:
    @functools.wraps(backward_step)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if flow_context.current() is None:
            return backward_step(*args, **kwargs)
        with span("decoder.backward", "busy"):  # costs one global lookup when tracing is off
            return backward_step(*args, **kwargs)

    return wrapped


VLM_MODEL_MODULE = "mindspeed_mm.models.vlm_model"
GATHER = "gather_from_sequence_parallel_region"


def process_multimodal_embeddings_wrapper(process: Callable) -> Callable:
    """With flow.fix_sp_embedding_grad and sequence parallelism, run VLMModel's embedding merge with its module's
    gather defaulting to `tensor_parallel_output_grad=False`: every TP rank then holds the whole sequence and the
    same gradient of it, so the backward takes this rank's slice (Megatron's split) rather than summing the
    ranks' identical copies (its default reduce-scatter, TP times the gradient). The function looks the name up
    in its module at call time, so it is swapped for the call only; the deepstack gather passes False already."""
    @functools.wraps(process)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = flow_context.current()
        if ctx is None or not ctx.parts.fix_sp_embedding_grad or not getattr(self.config, "sequence_parallel", False):
            return process(self, *args, **kwargs)
        module = importlib.import_module(VLM_MODEL_MODULE)
        gather = getattr(module, GATHER)
        setattr(module, GATHER, functools.partial(gather, tensor_parallel_output_grad=False))
        try:
            return process(self, *args, **kwargs)
        finally:
            setattr(module, GATHER, gather)

    return wrapped


_WRAPPERS: dict[str, Callable] = {
    "megatron.training.arguments.validate_args": validate_args_wrapper,
    "megatron.training.initialize._initialize_distributed": initialize_distributed_wrapper,
    "megatron.core.parallel_state.initialize_model_parallel": initialize_model_parallel_wrapper,
    "mindspeed_mm.training.pretrain": pretrain_wrapper,
    "megatron.core.pipeline_parallel.schedules.get_forward_backward_func": get_forward_backward_func_wrapper,
    "megatron.core.optimizer.clip_grads.get_grad_norm_fp32": get_grad_norm_fp32_wrapper,
    "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan":
        check_for_nan_wrapper,
    "megatron.core.optimizer.get_megatron_optimizer": get_megatron_optimizer_wrapper,
    "megatron.training.checkpointing.get_checkpoint_name": get_checkpoint_name_wrapper,
    "megatron.training.checkpointing._get_checkpoint_format": get_checkpoint_format_wrapper,
    "megatron.training.checkpointing._load_base_checkpoint": load_base_checkpoint_wrapper,
    "mindspeed_mm.training.training_log": training_log_wrapper,
    "mindspeed_mm.models.vision.vlm_attentionmask_for_llm.prepare_positionsids_mask_for_llm":
        packed.positions_and_mask_wrapper,
    "mindspeed_mm.models.common.mm_gpt_model.MMGPTModel.forward": packed.decoder_forward_wrapper,
    "mindspeed_mm.models.vision.vision_encoders.qwen2vl_vit_model.apply_multimodal_rotary_pos_emb":
        packed.multimodal_rope_wrapper,
    "mindspeed_mm.models.vlm_model.VLMModel.process_multimodal_embeddings": process_multimodal_embeddings_wrapper,
    "megatron.core.pipeline_parallel.schedules.backward_step": backward_step_wrapper,
}
assert set(_WRAPPERS) == {t.target for t in REGISTRY}


def register(patch_manager: Any) -> None:
    """Register every wrapper (their names end in `wrapper`, so MindSpeed stacks them as decorators)."""
    for target in REGISTRY:
        patch_manager.register_patch(target.target, _WRAPPERS[target.target])


def enabled() -> bool:
    return bool(os.environ.get("MSF_FLOW_RECIPE"))
