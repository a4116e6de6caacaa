"""The FSDP2 flow patch set: MindSpeed-MM's FSDP2 trainer with the vision tower and the LLM on separate ranks.

Each entry of `REGISTRY` names a real MindSpeed-MM function (at the pinned commit), how the flow job wraps it (the
original is kept and called) and why; `tests/test_patch_registry.py` checks every target and its leading
parameters against the pinned sources. The host logic lives in `mindspeed_flow.hosts.mindspeed_mm.fsdp2`. These
jobs run without Megatron (`NON_MEGATRON=true`), so the wrappers are installed with setattr, not through
MindSpeed's patch manager (whose import pulls Megatron's adaptor in).
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable

import torch

from mindspeed_flow.hosts.mindspeed_mm import fsdp2
from mindspeed_flow.step.layout import BACKBONE, ENCODER
from mindspeed_flow_patches.flow import PatchTarget

_PS = "mindspeed_mm.fsdp.distributed.parallel_state"
_ENGINE = "mindspeed_mm.fsdp.train.train_engine"
_QWEN3VL = "mindspeed_mm.fsdp.models.qwen3vl.modeling_qwen3_vl_moe"
_DCP = "mindspeed_mm.fsdp.checkpoint.dcp_checkpointer"

REGISTRY: tuple[PatchTarget, ...] = (
    PatchTarget("mindspeed_mm.config.config_manager.ConfigManager.load_and_parse",
                "each rank's arguments describe its own part: WORLD_SIZE is the part's size while they are derived "
                "(data-parallel and FSDP sizes), the part's gradient accumulation and expert parallelism",
                ("self",)),
    PatchTarget(f"{_PS}.init_device_mesh",
                "ParallelState's meshes over the part's ranks, each group created by its members only",
                ()),  # torch.distributed.device_mesh.init_device_mesh, imported by the module
    PatchTarget(f"{_PS}.get_last_mesh_dim", "the expert data-parallel size from the part's size, not the world's",
                ("mesh_shape",)),
    PatchTarget("mindspeed_mm.fsdp.distributed.torch_parallelize.ParallelApplier.apply_ep_modules",
                "expert gradients divided by the part's size (MindSpeed-MM's default is the world size)",
                ("self", "model")),
    PatchTarget("mindspeed_mm.fsdp.models.modelhub.ModelHub.build",
                "each part builds and trains its own modules: the other part's weights are dropped here (before "
                "they are sharded, initialised or loaded) and what remains of it frozen",
                ("model_args", "feature_args", "training_args")),
    PatchTarget("mindspeed_mm.fsdp.optimizer.optimizer.build_optimizer",
                "a part with nothing to train (the example's frozen vision tower, `model.freeze: [model.visual]`) "
                "gets an optimizer over no values, so the shared loop (LR schedule, step, zero_grad) runs unchanged",
                ("model", "lr")),
    PatchTarget(f"{_ENGINE}.TrainEngine.get_batch",
                "backbone ranks: the micro-batch's images go to their encoder ranks and the rows come back",
                ("self", "data_iterator")),
    PatchTarget(f"{_ENGINE}.TrainEngine.train_step",
                "encoder ranks: per micro-step, encode the images the plan gives them, send the rows, backward "
                "the gradients that come back", ("self", "train_dataloader_iter")),
    PatchTarget(f"{_ENGINE}.clip_grad_norm", "one gradient norm over both parts (clipping scales both alike)",
                ("model", "max_norm")),
    PatchTarget(f"{_ENGINE}.print_rank", "the iteration line (loss, grad norm) from the backbone's first rank",
                ("log", "message")),
    PatchTarget(f"{_DCP}.DistributedCheckpointer.save",
                "each part saves its own modules under SAVE/<part>/ (MindSpeed-MM's iter_* layout and tracker file "
                "inside), over the part's ranks", ("cls", "path", "state")),
    PatchTarget(f"{_DCP}.DistributedCheckpointer.load",
                "each part resumes from LOAD/<part>/ over the part's ranks (the same command: training.load at the "
                "save directory, as MindSpeed-MM resumes)", ("cls", "path", "state", "process_group")),
    PatchTarget(f"{_DCP}.dcp", "torch DCP's save / async_save / load over the part's ranks (MindSpeed-MM passes "
                               "none, or a gloo group over the world: metadata that would mix both parts)", ()),
    PatchTarget(f"{_DCP}.ModelState.state_dict", "a part's checkpoint holds its own modules only", ("self",)),
    PatchTarget(f"{_DCP}.ModelState.load_state_dict",
                "loading a part's modules leaves the rest as they are", ("self", "state_dict")),
    PatchTarget(f"{_QWEN3VL}.Qwen3VLMoeModel.get_image_features",
                "backbone ranks answer from the received rows (embeddings and deepstack maps): the forward, loss "
                "and auxiliary loss run unchanged", ("self", "pixel_values", "image_grid_thw")),
)

TARGET_MODULES: tuple[str, ...] = ("mindspeed_mm.config.config_manager", _PS,
                                   "mindspeed_mm.fsdp.distributed.torch_parallelize",
                                   "mindspeed_mm.fsdp.optimizer.optimizer",
                                   "mindspeed_mm.fsdp.models.modelhub", _ENGINE, _QWEN3VL, _DCP)


def _ctx() -> fsdp2.FlowFsdp2:
    ctx = fsdp2.current()
    if ctx is None:
        raise RuntimeError("mindspeed-flow: the FSDP2 flow patches are applied but no flow context is installed")
    return ctx


def _wrap_load_and_parse(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_and_parse(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = _ctx()
        read_yaml = self._load_yaml_config

        def part_yaml() -> dict:
            config = read_yaml()
            for section, values in ctx.parts.overrides(ctx.part).items():
                config.setdefault(section, {}).update(values)
            return config

        world = os.environ.get("WORLD_SIZE")
        os.environ["WORLD_SIZE"] = str(ctx.parts.part_size(ctx.part))
        self._load_yaml_config = part_yaml
        try:
            return original(self, *args, **kwargs)
        finally:
            del self._load_yaml_config
            if world is not None:
                os.environ["WORLD_SIZE"] = world

    return load_and_parse


def _init_device_mesh(device_type: str, mesh_shape: Any, *args: Any, mesh_dim_names: Any = None, **kw: Any) -> Any:
    return _ctx().device_mesh(device_type, mesh_shape, mesh_dim_names)


def _get_last_mesh_dim(mesh_shape: Any) -> int:
    ctx = _ctx()
    last = ctx.parts.part_size(ctx.part)
    for shape in mesh_shape:
        if last % shape:
            raise AssertionError(f"the {ctx.part} part's {ctx.parts.part_size(ctx.part)} ranks are not divisible by "
                                 f"mesh group {mesh_shape}")
        last //= shape
    return last


def _wrap_apply_ep(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_ep_modules(self: Any, model: Any) -> Any:
        ctx = _ctx()
        if self.config.ep_plan._gradient_divide_factor is None:
            self.config.ep_plan._gradient_divide_factor = ctx.parts.part_size(ctx.part)
        return original(self, model)

    return apply_ep_modules


def _wrap_build(original: Callable) -> Callable:
    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:
        model = original(*args, **kwargs)
        _ctx().take_model(model, _ctx().parts.vision_module, model.config.vision_config)
        return model

    return build


def _wrap_build_optimizer(original: Callable) -> Callable:
    @functools.wraps(original)
    def build_optimizer(model: Any, lr: float = 1e-3, *args: Any, **kwargs: Any) -> Any:
        if any(p.requires_grad for p in model.parameters()):
            return original(model, lr, *args, **kwargs)
        # AdamW refuses an empty parameter list; SGD over one empty tensor steps nothing and keeps a param group
        # for the LR scheduler.
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(0))], lr=lr)

    return build_optimizer


def _ensure_transport(engine: Any) -> None:
    ctx = _ctx()
    if ctx.transport is not None:
        return
    from mindspeed_mm.fsdp.utils.device import get_device_type  # optional: mindspeed_mm
    from mindspeed_mm.fsdp.utils.dtype import get_dtype  # optional: mindspeed_mm

    param_dtype = engine.args.parallel.fsdp_plan.param_dtype
    dtype = get_dtype(param_dtype) if param_dtype else torch.float32
    device = torch.device(get_device_type(), torch.accelerator.current_device_index())
    # Whether the encoder part trains is the encoder ranks' to know: one broadcast from the first encoder rank.
    flag = torch.tensor([1 if ctx.encoder_trainable else 0], dtype=torch.int64)
    ctx.build_groups(device, dtype)
    torch.distributed.broadcast(flag, src=ctx.layout.offset(ENCODER), group=ctx.groups["plan"])
    ctx.encoder_trainable = bool(flag.item())


def _wrap_get_batch(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_batch(self: Any, data_iterator: Any) -> Any:
        batch = original(self, data_iterator)
        ctx = _ctx()
        if not ctx.is_encoder:
            _ensure_transport(self)
            ctx.backbone_exchange(batch, ctx.merge, ctx.encoder_trainable)
        return batch

    return get_batch


def _wrap_train_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def train_step(self: Any, train_dataloader_iter: Any) -> Any:
        ctx = _ctx()
        if not ctx.is_encoder:
            return original(self, train_dataloader_iter)
        _ensure_transport(self)
        visual = fsdp2.module_at(self.model, ctx.parts.vision_module)
        device = ctx.transport.device
        for _ in range(self.args.training.gradient_accumulation_steps):
            ctx.encoder_micro_step(visual, ctx.merge, ctx.patch_dim, ctx.transport.dtype, device,
                                   ctx.encoder_trainable)
        return {}

    return train_step


def _wrap_clip_grad_norm(original: Callable) -> Callable:
    @functools.wraps(original)
    def clip_grad_norm(model: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                       foreach: Any = None) -> Any:
        ctx = _ctx()
        part_norm = original(model, 0.0, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        total = ctx.global_norm(torch.as_tensor(part_norm), float(norm_type))
        if max_norm > 0.0:
            groups = getattr(model, "_ep_param_groups", None)
            lists = [groups.get("ep", []), groups.get("non_ep", [])] if groups else [list(model.parameters())]
            for params in lists:
                params = [p for p in params if p.grad is not None]
                if params:
                    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].grad.device),
                                                         foreach=foreach)
        return total

    return clip_grad_norm


def _wrap_print_rank(original: Callable) -> Callable:
    @functools.wraps(original)
    def print_rank(log: Callable, message: str, ranks: Any = 0) -> Any:
        ctx = _ctx()
        if ranks == 0 and torch.distributed.is_initialized():
            if torch.distributed.get_rank() == ctx.layout.offset(BACKBONE):
                log(message)
            return None
        return original(log, message, ranks)

    return print_rank


def _wrap_get_image_features(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_image_features(self: Any, pixel_values: Any, image_grid_thw: Any = None) -> Any:
        ctx = fsdp2.current()
        if ctx is None or ctx.is_encoder:
            return original(self, pixel_values, image_grid_thw)
        return ctx.image_features(image_grid_thw)

    return get_image_features


def _part_group() -> Any:
    from mindspeed_mm.fsdp.distributed.parallel_state import get_parallel_state  # optional: mindspeed_mm

    return get_parallel_state().device_mesh.get_group("dp_cp")  # every rank of the part (tp is 1)


def _part_dir(path: str) -> str:
    return os.path.join(path, _ctx().part)


def _wrap_dcp_save(original: Callable) -> Callable:
    @functools.wraps(original)
    def save(path: str, state: Any, *args: Any, iteration: Any = None, **kwargs: Any) -> Any:
        ctx = _ctx()
        part_path = _part_dir(path)
        out = original(part_path, state, *args, iteration=iteration, **kwargs)
        # MindSpeed-MM's tracker file is written by global rank 0 only, i.e. in the encoder part's folder.
        if ctx.rank == ctx.layout.offset(ctx.part) and ctx.rank != 0:
            from mindspeed_mm.fsdp.checkpoint.utils import get_checkpoint_tracker_filename  # optional: mindspeed_mm

            with open(get_checkpoint_tracker_filename(part_path), "w", encoding="utf-8") as fh:
                fh.write(str(iteration))
        return out

    return save


def _wrap_dcp_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def load(path: str, state: Any, process_group: Any = None, *args: Any, **kwargs: Any) -> Any:
        part_path = _part_dir(path)
        if not os.path.isdir(part_path):
            raise RuntimeError(f"mindspeed-flow: training.load={path} holds no {_ctx().part}/ folder: it is not a "
                               "checkpoint of a flow job (an unpatched job's DCP checkpoint does not load into "
                               "separate parts yet; HF weights do, with load_format hf)")
        return original(part_path, state, process_group, *args, **kwargs)  # the part's group: _PartDCP.load

    return load


def _dcp_broadcast_from_group_rank() -> None:
    """torch 2.7's DCP broadcasts its plan from `src=coordinator_rank`, a rank of the checkpoint's group used as a
    global rank (`_DistWrapper.broadcast_object`; its gather and scatter already convert it): a part that does not
    hold global rank 0 fails with "Global rank 0 is not part of group". From a part's first save or load on, the
    broadcast names the group's rank (`group_src`; for the world group, the same rank). It stays installed: an
    asynchronous save plans in a background thread, after `async_save` has returned."""
    from torch.distributed.checkpoint import utils as dcp_utils

    wrapper = getattr(dcp_utils, "_DistWrapper", None)
    original = getattr(wrapper, "broadcast_object", None)
    if original is None or getattr(original, "_msf_group_src", False):
        return

    def broadcast_object(self: Any, obj: Any) -> Any:
        if not (getattr(self, "use_dist", False) and getattr(self, "group", None) is not None):
            return original(self, obj)
        objects = [obj]
        torch.distributed.broadcast_object_list(objects, group=self.group, group_src=self.coordinator_rank)
        return objects[0]

    broadcast_object._msf_group_src = True  # type: ignore[attr-defined]
    wrapper.broadcast_object = broadcast_object


class _PartDCP:
    """torch.distributed.checkpoint as MindSpeed-MM's checkpointer sees it: saves over the part's ranks."""

    def __init__(self, dcp: Any) -> None:
        self._dcp = dcp
        self._async_group: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dcp, name)

    def save(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("process_group", _part_group())
        _dcp_broadcast_from_group_rank()
        return self._dcp.save(*args, **kwargs)

    def async_save(self, *args: Any, **kwargs: Any) -> Any:
        # MindSpeed-MM hands async_save a gloo group over the whole world (`training.save_async`): one part's
        # coordinator would then write both parts' metadata into its own folder. The part's own group instead, on
        # MindSpeed-MM's host backend ("cpu:gloo,npu:hccl": the default group is bound to the device), created by
        # its members only.
        if self._async_group is None:
            from mindspeed_mm.fsdp.utils.device import get_dist_comm_backend  # optional: mindspeed_mm

            ctx = _ctx()
            self._async_group = torch.distributed.new_group(ranks=ctx.layout.part_ranks(ctx.part),
                                                            backend=get_dist_comm_backend(cpu=True),
                                                            use_local_synchronization=True)
        kwargs["process_group"] = self._async_group
        _dcp_broadcast_from_group_rank()
        return self._dcp.async_save(*args, **kwargs)

    def load(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["process_group"] = kwargs.get("process_group") or _part_group()
        _dcp_broadcast_from_group_rank()
        return self._dcp.load(*args, **kwargs)


def _owned(key: str) -> bool:
    ctx = _ctx()
    return key.startswith(ctx.parts.vision_module + ".") == ctx.is_encoder


def _wrap_model_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def state_dict(self: Any) -> Any:
        return {k: v for k, v in original(self).items() if _owned(k)}

    return state_dict


def _wrap_model_load_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # torch's set_model_state_dict is strict: the other part's modules keep their current values.
        full = {k: v for k, v in get_model_state_dict(model=self.model).items() if not _owned(k)}
        full.update(state_dict)
        return original(self, full)

    return load_state_dict


_WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    f"{_PS}.init_device_mesh": lambda original: functools.wraps(original)(_init_device_mesh),
    f"{_PS}.get_last_mesh_dim": lambda original: functools.wraps(original)(_get_last_mesh_dim),
    "mindspeed_mm.config.config_manager.ConfigManager.load_and_parse": _wrap_load_and_parse,
    "mindspeed_mm.fsdp.distributed.torch_parallelize.ParallelApplier.apply_ep_modules": _wrap_apply_ep,
    "mindspeed_mm.fsdp.models.modelhub.ModelHub.build": _wrap_build,
    "mindspeed_mm.fsdp.optimizer.optimizer.build_optimizer": _wrap_build_optimizer,
    f"{_ENGINE}.TrainEngine.get_batch": _wrap_get_batch,
    f"{_ENGINE}.TrainEngine.train_step": _wrap_train_step,
    f"{_ENGINE}.clip_grad_norm": _wrap_clip_grad_norm,
    f"{_ENGINE}.print_rank": _wrap_print_rank,
    f"{_DCP}.DistributedCheckpointer.save": _wrap_dcp_save,
    f"{_DCP}.DistributedCheckpointer.load": _wrap_dcp_load,
    f"{_DCP}.dcp": _PartDCP,
    f"{_DCP}.ModelState.state_dict": _wrap_model_state_dict,
    f"{_DCP}.ModelState.load_state_dict": _wrap_model_load_state_dict,
    f"{_QWEN3VL}.Qwen3VLMoeModel.get_image_features": _wrap_get_image_features,
}


def _owner(target: str) -> tuple[Any, str]:
    """(the module or class holding the target's name, the name)."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            holder: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:-1]:
            holder = getattr(holder, name)
        return holder, parts[-1]
    raise ImportError(target)


def apply() -> list[str]:
    """Install every wrapper (targets imported first); returns the patched targets."""
    for module in TARGET_MODULES:
        importlib.import_module(module)
    done = []
    for target in REGISTRY:
        holder, name = _owner(target.target)
        original = getattr(holder, name)
        wrapped = _WRAPPERS[target.target](original)
        if isinstance(holder, type) and isinstance(holder.__dict__.get(name), staticmethod):
            wrapped = staticmethod(wrapped)
        elif isinstance(holder, type) and isinstance(holder.__dict__.get(name), classmethod):
            # getattr gave the bound method: the wrapper receives the arguments after cls
            wrapped = classmethod(lambda cls, *a, __w=wrapped, **k: __w(*a, **k))
        setattr(holder, name, wrapped)
        done.append(target.target)
    return done
