"""The flow patch set of `pretrain_transformers.py CONFIG.yaml`: MindSpeed-MM's Megatron loop over an HF-style model
sharded by MindSpeed's torch FSDP2, with the vision tower and the LLM on separate ranks.

The Megatron side is the Megatron flow patch's (`mindspeed_flow_patches.flow`): each part's own parallel state
(`validate_args`, `_initialize_distributed`, `initialize_model_parallel`) and one gradient norm over both parts
(`get_grad_norm_fp32`); those wrappers are reused as they are. What this entry adds: MindSpeed-MM's `pretrain`
gets the flow providers (`mindspeed_flow.hosts.mindspeed_mm.transformers_entry.TransformersHost`), encoder ranks get
their own step from `get_forward_backward_func`, and Qwen3-VL's `get_image_features` answers from the received rows
(and GLM-4.5V's `get_image_features` and `get_video_features`) on backbone ranks. Every entry of `REGISTRY` names a
real function at the pinned commits (checked by `tests/test_patch_registry.py`), each wrapper keeps and calls the
original, and all are inert without a flow context.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import torch

from mindspeed_flow.hosts.mindspeed_mm import transformers_entry
from mindspeed_flow_patches import flow
from mindspeed_flow_patches.flow import PatchTarget

_QWEN3VL = "mindspeed_mm.models.transformers.qwen3vl.modeling_qwen3_vl"
# GLM-4.5V: MindSpeed-MM's fused model replaces transformers' tower and LLM and keeps transformers' Glm4vMoeModel.
_GLM4V_MOE = "transformers.models.glm4v_moe.modeling_glm4v_moe"


def pretrain_wrapper(pretrain: Callable) -> Callable:
    @functools.wraps(pretrain)
    def wrapped(train_valid_test_dataset_provider: Callable, model_provider: Callable, model_type: Any,
                forward_step_func: Callable, *args: Any, **kwargs: Any) -> Any:
        host = transformers_entry.current()
        if host is None:
            return pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                            *args, **kwargs)
        return pretrain(train_valid_test_dataset_provider, host.model_provider(model_provider),
                        model_type, host.forward_step(forward_step_func), *args, **kwargs)

    return wrapped


def get_forward_backward_func_wrapper(get_fbf: Callable) -> Callable:
    @functools.wraps(get_fbf)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fbf = get_fbf(*args, **kwargs)
        host = transformers_entry.current()
        return fbf if host is None else host.forward_backward_func(fbf)

    return wrapped


def _features_from_rows(embeddings_only: bool) -> Callable[[Callable], Callable]:
    """A wrapper of a model's `get_image_features` / `get_video_features`: backbone ranks answer from the rows the
    encoder ranks sent (per-item embeddings, and the deepstack maps unless `embeddings_only`), other ranks and jobs
    call the original."""

    def wrapper(original: Callable) -> Callable:
        signature = inspect.signature(original)
        grid_name = list(signature.parameters)[2]  # (self, pixel_values[_videos], image/video_grid_thw)

        @functools.wraps(original)
        def features(*args: Any, **kwargs: Any) -> Any:
            host = transformers_entry.current()
            if host is None or host.ctx.is_encoder:
                return original(*args, **kwargs)
            embeds, deepstack = host.rows.image_features(signature.bind(*args, **kwargs).arguments.get(grid_name))
            return embeds if embeddings_only else (embeds, deepstack)

        return features

    return wrapper


# Qwen3-VL: embeddings and deepstack maps (its `get_video_features` calls this one).
get_image_features_wrapper = _features_from_rows(embeddings_only=False)
# GLM-4.5V: the merged embeddings alone; its videos' rows come from the tower run on their frames as images
# (`Fsdp2Parts.frames_as_images`, as its `get_video_features` runs it).
glm_image_features_wrapper = _features_from_rows(embeddings_only=True)
glm_video_features_wrapper = _features_from_rows(embeddings_only=True)


def cal_gradient_accumulation_size_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def cal_gradient_accumulation_size() -> int:
        if transformers_entry.current() is None:
            return original()
        # MindSpeed-MM divides the global batch by the whole world's size; a part's micro-batches per step are
        # Megatron's count on its ranks (its own data-parallel size; the unpatched job's value on the LLM part).
        from megatron.core.num_microbatches_calculator import get_num_microbatches  # optional: megatron

        return int(get_num_microbatches())

    return cal_gradient_accumulation_size


@contextlib.contextmanager
def _world_reductions_over(group: Any) -> Iterator[None]:
    """`torch.distributed.all_reduce` without a group (the world's) reduces over `group` for the duration."""
    dist = torch.distributed
    original = dist.all_reduce

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        return original(tensor, op=op, group=part if group is None or group is dist.group.WORLD else group,
                        async_op=async_op)

    part = group
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def build_loss_ctx_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def build_loss_ctx(self: Any, labels: Any, *args: Any, **kwargs: Any) -> Any:
        if transformers_entry.current() is None:
            return original(self, labels, *args, **kwargs)
        # The per-token loss averages the step's token count over the world: the unpatched job's world is its
        # data-parallel ranks, the flow job's LLM part is (the encoder part runs no loss).
        from megatron.core import mpu  # optional: megatron

        with _world_reductions_over(mpu.get_data_parallel_group(with_context_parallel=True)):
            return original(self, labels, *args, **kwargs)

    return build_loss_ctx


REGISTRY: tuple[PatchTarget, ...] = (
    PatchTarget("megatron.training.arguments.validate_args",
                "each rank's args describe its own part (world size, so the data-parallel size and the FSDP2 "
                "shards are the part's)", ("args", "defaults")),
    PatchTarget("megatron.training.initialize._initialize_distributed",
                "init_process_group over the whole world while the args describe the part",
                ("get_embedding_ranks", "get_position_embedding_ranks")),
    PatchTarget("megatron.core.parallel_state.initialize_model_parallel",
                "one pass per part over an offset sub-world; the rank keeps its own part's groups (MindSpeed's "
                "FSDP2 adaptor shards over the part's data-parallel group)",
                ("tensor_model_parallel_size", "pipeline_model_parallel_size")),
    PatchTarget("mindspeed_mm.training.pretrain",
                "the flow providers: each part builds its own modules; backbone ranks exchange each micro-batch's "
                "images before the model sees it", ("train_valid_test_dataset_provider", "model_provider", "model_type",
                                              "forward_step_func")),
    PatchTarget("megatron.core.pipeline_parallel.schedules.get_forward_backward_func",
                "encoder ranks: one encoder micro-step per backbone micro-batch; backbone ranks: Megatron's", ()),
    PatchTarget("megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
                "one gradient norm over both parts (clipping scales both alike)",
                ("grads_for_norm", "norm_type", "grad_stats_parallel_group")),
    PatchTarget(f"{_QWEN3VL}.Qwen3VLModel.get_image_features",
                "backbone ranks answer from the received rows (embeddings and deepstack maps; Qwen3-VL-MoE's model "
                "inherits it)", ("self", "pixel_values", "image_grid_thw")),
    PatchTarget("mindspeed_mm.data.data_utils.utils.cal_gradient_accumulation_size",
                "micro-batches per step over the part's data-parallel ranks, not the whole world's (the per-token "
                "loss's prefetching loader groups a step's micro-batches by it)", ()),
    PatchTarget("mindspeed_mm.models.transformers_model.TransformersModel.build_loss_ctx",
                "the loss's token-count reductions over the world (per-token loss) run over the LLM part's "
                "data-parallel ranks", ("self", "labels")),
    PatchTarget(f"{_GLM4V_MOE}.Glm4vMoeModel.get_image_features",
                "backbone ranks answer from the received rows (GLM-4.5V: the merged embeddings)",
                ("self", "pixel_values", "image_grid_thw")),
    PatchTarget(f"{_GLM4V_MOE}.Glm4vMoeModel.get_video_features",
                "backbone ranks answer from the received rows (GLM-4.5V's videos: the tower ran on their frames)",
                ("self", "pixel_values_videos", "video_grid_thw")),
)

_WRAPPERS: dict[str, Callable] = {
    "megatron.training.arguments.validate_args": flow.validate_args_wrapper,
    "megatron.training.initialize._initialize_distributed": flow.initialize_distributed_wrapper,
    "megatron.core.parallel_state.initialize_model_parallel": flow.initialize_model_parallel_wrapper,
    "mindspeed_mm.training.pretrain": pretrain_wrapper,
    "megatron.core.pipeline_parallel.schedules.get_forward_backward_func": get_forward_backward_func_wrapper,
    "megatron.core.optimizer.clip_grads.get_grad_norm_fp32": flow.get_grad_norm_fp32_wrapper,
    f"{_QWEN3VL}.Qwen3VLModel.get_image_features": get_image_features_wrapper,
    "mindspeed_mm.data.data_utils.utils.cal_gradient_accumulation_size": cal_gradient_accumulation_size_wrapper,
    "mindspeed_mm.models.transformers_model.TransformersModel.build_loss_ctx": build_loss_ctx_wrapper,
    f"{_GLM4V_MOE}.Glm4vMoeModel.get_image_features": glm_image_features_wrapper,
    f"{_GLM4V_MOE}.Glm4vMoeModel.get_video_features": glm_video_features_wrapper,
}
assert set(_WRAPPERS) == {t.target for t in REGISTRY}

TARGET_MODULES = tuple(sorted({flow.module_of(t.target) for t in REGISTRY}))


def register(patch_manager: Any) -> None:
    """Register every wrapper (their names end in `wrapper`, so MindSpeed stacks them as decorators)."""
    for target in REGISTRY:
        patch_manager.register_patch(target.target, _WRAPPERS[target.target])
