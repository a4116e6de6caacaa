"""MindSpeed-MM's FSDP2 trainer (`mindspeed_mm/fsdp/train/trainer.py CONFIG.yaml`) as a flow job.

    torchrun ... -m mindspeed_flow_patches.launch --flow-recipe FLOW.yaml mindspeed_mm/fsdp/train/trainer.py CONFIG.yaml

The vision tower (`model.visual`, its merger and deepstack mergers) trains on the encoder part's ranks, the LLM on
the backbone part's ranks; each part is its own FSDP2 job: MindSpeed-MM's `ParallelState` builds its device meshes
over the part's ranks only (expert parallelism inside the backbone part), its `ParallelApplier` shards the model
over them, its optimizer, LR schedule, gradient clipping, HF loader and `TrainEngine` loop run unchanged on every
rank. Each part builds only its own weights (`drop_other_part`, right after the model is built on the meta
device). What the flow job adds, per micro-step of a step:

1. the backbone ranks load the data exactly as the unpatched job's ranks do (MindSpeed-MM's sampler over the
   backbone's data-parallel group), so every backbone rank sees the unpatched job's batches;
2. every rank learns every backbone rank's image grids (two small gloo all-gathers) and so the same plan: which
   encoder rank encodes which image (`assign_images`: heaviest first onto the least-loaded encoder rank); a video
   is one more item (its grid has t > 1), after the micro-batch's images;
3. the planned transport (`mindspeed_flow.pool.planned`) moves the images' patch rows to their encoder ranks, the
   encoder rows back (per image `[tokens, H x (1 + D)]`: the merged embedding and the D deepstack maps side by side,
   one item per encoder/backbone pair), and, after the backbone's backward, their gradients;
4. on the backbone, `get_image_features` answers from the received rows (for the images, then, through
   `get_video_features`, for the videos), so the model's own forward (scatter into
   the text embeddings, deepstack added after the first D layers, loss, router auxiliary loss) runs unchanged;
5. the gradient norm is one norm over both parts (each part's sum of squares, added across parts), so clipping
   scales both parts by the same factor, as in the unpatched job.

A step therefore has the unpatched job's batches, loss and gradients (`tests/mindspeed_mm/test_fsdp2_flow.py`
compares per-iteration losses). Checkpoints: MindSpeed-MM's DCP checkpointer, per part (SAVE/encoder/,
SAVE/backbone/, each with MindSpeed-MM's iter_* folders and tracker file, written over the part's ranks); the job
resumes when training.load points at SAVE, as MindSpeed-MM resumes. Each encoder rank runs the vision tower once per
micro-step whatever its images and videos (a blank image when it has none), so the flow job trains mixes of
image-only, video-only and mixed samples, which MindSpeed-MM's own FSDP2 job on several ranks cannot (a rank with no
image skips the collectives of the tower's FSDP forward). Saves may be asynchronous (`training.save_async`, over
each part's own gloo group). Not yet: loading an unpatched job's DCP checkpoint, and per-side data loading (the
encoder ranks get pixels over the wire instead of loading them).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mindspeed_flow.hosts.mindspeed_mm import FSDP2_TRAINER_SCRIPT
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError, load_flow_job
from mindspeed_flow.step.layout import BACKBONE, ENCODER, Layout, PartLayout

TRAINER_SCRIPT = FSDP2_TRAINER_SCRIPT
# CONFIG.yaml model ids the FSDP2 flow job splits, with the module path of the vision tower (trained on the encoder
# part) inside the model MindSpeed-MM builds; everything else is the backbone's.
VISION_MODULES: dict[str, str] = {"qwen3_vl_moe": "model.visual"}
# CONFIG.yaml values the flow job cannot honour (dotted key -> (allowed test, why)).
_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("parallel.tensor_parallel_size", 1, "MindSpeed-MM's FSDP2 path has no tensor parallelism"),
    ("parallel.ulysses_parallel_size", 1, "context parallelism inside a part is not supported by the flow job yet"),
    ("parallel.ring_attention_size", 1, "context parallelism inside a part is not supported by the flow job yet"),
    ("training.lora.enable", False, "LoRA adapters of a decoupled model are not supported yet"),
    ("training.val_interval", 0, "validation of a decoupled model is not supported yet"),
)


@dataclass(frozen=True)
class Fsdp2Parts:
    """The layout of an FSDP2 flow job and what each part's MindSpeed-MM arguments become."""

    layout: Layout
    timeout_s: float
    micro_batch_size: int
    global_batch_size: int
    expert_parallel_size: int  # inside the backbone part
    vision_module: str
    config_path: str = ""
    # The tower takes a video as its frames, each an image of grid (1, h, w) (GLM-4.5V's `get_video_features`
    # flattens the grid so: its position embedding reads one grid per frame); Qwen3-VL's takes (t, h, w) whole.
    frames_as_images: bool = False

    def part_size(self, name: str) -> int:
        return self.layout.part(name).size

    @property
    def grad_accumulation(self) -> int:
        """Micro-steps per step: the backbone's DP ranks share the global batch (the encoder part follows them)."""
        return self.global_batch_size // (self.micro_batch_size * self.layout.part(BACKBONE).dp)

    def overrides(self, part: str) -> dict[str, dict[str, int]]:
        """What one part's ranks change in CONFIG.yaml as MindSpeed-MM's ConfigManager reads it (its own
        `key=value` command-line overrides reject nested keys at the pinned commit)."""
        size = self.part_size(part)
        ep = self.expert_parallel_size if part == BACKBONE else 1
        return {"training": {"gradient_accumulation_steps": self.grad_accumulation},
                "parallel": {"fully_shard_parallel_size": size, "expert_parallel_size": ep,
                             "expert_fully_shard_parallel_size": size // ep}}

    def describe(self) -> str:
        rows = []
        for p in self.layout.parts:
            r = self.layout.part_ranks(p.name)
            what = self.vision_module if p.name == ENCODER else f"everything but {self.vision_module}"
            ep = f", expert parallel {self.expert_parallel_size}" if p.name == BACKBONE and \
                self.expert_parallel_size > 1 else ""
            rows.append(f"{p.name} ({what}): ranks {r[0]}-{r[-1]}, FSDP over {p.size}{ep}")
        steps = f"{self.grad_accumulation} micro-step(s) of {self.micro_batch_size} per backbone rank"
        return "; ".join(rows) + "; " + steps


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(cfg, key)
    return default if value is None else value


def sharded_parts_layout(job: Any, name: str, world_size: int) -> Layout:
    """The layout of two FSDP2 parts from FLOW.yaml (each part sharded data parallel: tp, pp, cp 1), checked against
    the launched world."""
    par = job.parallel
    for part_name, p in ((ENCODER, par.encoder), (BACKBONE, par.backbone)):
        for dim in ("tp", "pp", "cp"):
            if getattr(p, dim) != 1:
                raise FlowRecipeError(f"{name}: parallel.{part_name}.{dim}={getattr(p, dim)}: an FSDP2 part is "
                                      "sharded data parallel only (its dp is its FSDP size)")
        if not isinstance(p.dp, int) or p.dp < 1:
            raise FlowRecipeError(f"{name}: parallel.{part_name}.dp={p.dp!r}: must be an integer >= 1")
    layout = Layout((PartLayout(ENCODER, dp=par.encoder.dp), PartLayout(BACKBONE, dp=par.backbone.dp)))
    if layout.world_size != world_size:
        raise FlowRecipeError(f"{name}: the parts need encoder {par.encoder.dp} + backbone {par.backbone.dp} = "
                              f"{layout.world_size} ranks but the job was launched with {world_size}")
    return layout


def fsdp2_parts_for_job(recipe_path: str | Path, script_argv: Sequence[str], world_size: int) -> Fsdp2Parts:
    """Check FLOW.yaml against CONFIG.yaml and the launched world before any process group exists."""
    name = Path(recipe_path).name
    job = load_flow_job(recipe_path)
    configs = [a for a in script_argv if a.endswith((".yaml", ".yml"))]
    if not configs:
        raise FlowRecipeError(f"{TRAINER_SCRIPT} needs its CONFIG.yaml argument")
    config_path = configs[0]
    if not Path(config_path).is_file():
        raise FlowRecipeError(f"{config_path}: no such file")
    cfg = OmegaConf.load(config_path)
    for a in script_argv:  # MindSpeed-MM's own key=value overrides apply to the checks too
        if "=" in a and not a.startswith("-"):
            key, value = a.split("=", 1)
            OmegaConf.update(cfg, key, OmegaConf.create({"v": value})["v"] if value else value, force_add=True)
    model_id = _select(cfg, "model.model_id", "")
    if model_id not in VISION_MODULES:
        raise FlowRecipeError(f"{config_path}: model.model_id={model_id!r}: the FSDP2 flow job splits "
                              f"{', '.join(sorted(VISION_MODULES))} (a vision tower whose features it can move); "
                              "other models run unpatched")
    for key, allowed, why in _REFUSED:
        value = _select(cfg, key, allowed)
        if value != allowed:
            raise FlowRecipeError(f"{config_path}: {key}={value!r}: {why} (set {allowed!r})")
    if _select(cfg, "training.train_epochs") is not None:
        raise FlowRecipeError(f"{config_path}: training.train_epochs: the parts would count epochs over different "
                              "data-parallel groups; give training.train_iters")
    load = _select(cfg, "training.load")
    if load:
        # Weights from an HF folder, or a flow job's own checkpoint (one folder per part); not an unpatched job's.
        where = Path(load)
        flow_ckpt = all((where / part).is_dir() for part in (ENCODER, BACKBONE))
        hf = any(where.glob("*.safetensors")) or any(where.glob("*.bin"))
        if where.is_dir() and not (flow_ckpt or hf):
            raise FlowRecipeError(f"{config_path}: training.load={load}: neither HF weights nor a flow job's "
                                  f"checkpoint ({ENCODER}/ and {BACKBONE}/ folders); an unpatched job's DCP "
                                  "checkpoint does not load into separate parts yet")
    par = job.parallel
    layout = sharded_parts_layout(job, name, world_size)
    mbs = int(_select(cfg, "training.micro_batch_size", 1))
    ga = int(_select(cfg, "training.gradient_accumulation_steps", 1) or 1)
    stated = OmegaConf.select(OmegaConf.load(str(recipe_path)), "trainer.global_batch_size")
    # Without trainer.global_batch_size the backbone part is the job's data-parallel world.
    gbs = int(stated) if stated is not None else mbs * par.backbone.dp * ga
    if gbs % (mbs * par.backbone.dp):
        raise FlowRecipeError(f"{name}: trainer.global_batch_size={gbs} must be divisible by "
                              f"training.micro_batch_size {mbs} x parallel.backbone.dp {par.backbone.dp}")
    ep = int(_select(cfg, "parallel.expert_parallel_size", 1))
    if par.backbone.dp % ep:
        raise FlowRecipeError(f"{config_path}: parallel.expert_parallel_size={ep} must divide the backbone part's "
                              f"{par.backbone.dp} ranks (experts are sharded inside the LLM's part)")
    if _select(cfg, "data.dataloader_param.sampler_type", "BaseRandomBatchSampler") != "BaseRandomBatchSampler":
        raise FlowRecipeError(f"{config_path}: data.dataloader_param.sampler_type: the flow job is tested with "
                              "BaseRandomBatchSampler only")
    return Fsdp2Parts(layout, float(job.flow.timeout_s), mbs, gbs, ep, VISION_MODULES[model_id],
                      os.path.abspath(config_path))


# ---------------------------------------------------------------------------------------------------- the plan

def assign_images(patches: Sequence[int], encoders: int) -> list[int]:
    """The encoder rank (0..encoders-1) of each image: heaviest first onto the least-loaded rank (ties: lowest)."""
    loads = [0] * encoders
    owner = [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        e = min(range(encoders), key=lambda r: (loads[r], r))
        owner[i] = e
        loads[e] += patches[i]
    return owner


class _Dropped(torch.nn.Module):
    """Stands in for a module of the other part: its parameter names stay (as None, so code that re-ties or looks
    them up by name still finds them), their values are gone."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__()
        for name in names:
            self.register_parameter(name, None)


def _dropped_copy(module: torch.nn.Module) -> torch.nn.Module:
    """`module` as `_Dropped` stand-ins: the same names down the tree, no values."""
    dropped = _Dropped([n for n, _ in module.named_parameters(recurse=False)])
    for name, child in module.named_children():
        dropped.add_module(name, _dropped_copy(child))
    return dropped


def _drop_values(module: torch.nn.Module, keep: str = "", keep_layers: bool = False) -> None:
    """Drop every parameter value under `module` but those under its child `keep`, keeping the module tree (FSDP
    plans and hooks name its modules). Lists of blocks / decoder layers are emptied, unless `keep_layers` (code
    that indexes them, such as a model's own sharding function, then finds every layer, holding nothing)."""
    for name, child in list(module.named_children()):
        if name == keep:
            continue
        if isinstance(child, torch.nn.ModuleList) and not keep_layers:
            setattr(module, name, torch.nn.ModuleList())  # the blocks / decoder layers: the bulk of the values
        elif not any(True for _ in child.children()) or \
                (keep_layers and any(v is not None for v in child._parameters.values())):
            # A leaf, or a module holding values of its own (MoE experts' stacked weights): its class goes too, so
            # a model's weight initialisation, which matches on classes, passes it by.
            setattr(module, name, _dropped_copy(child))
        else:
            _drop_values(child, keep_layers=keep_layers)
    for name, value in list(module._parameters.items()):
        if value is not None:
            module._parameters[name] = None


def module_at(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The submodule at a dotted path (`model.visual`)."""
    for name in path.split("."):
        model = getattr(model, name)
    return model


def drop_other_part(model: torch.nn.Module, vision_path: str, is_encoder: bool,
                    keep_layers: bool = False) -> tuple[int, int]:
    """Free this rank of the other part's weights before they are sharded, initialised or loaded: an encoder rank
    keeps only the vision tower (not the LLM's layers, embeddings, head: most of a 30B-A3B or 235B-A22B model), a
    backbone rank everything but the vision tower. Returns (values kept, values dropped).

    Safe because the flow job never runs the other part's modules on this rank: encoder ranks call the vision tower
    alone, backbone ranks answer `get_image_features` from the received rows. The module tree above the dropped
    values stays, so MindSpeed-MM's FSDP, recompute and prefetch plans find the modules they name (holding nothing),
    and the HF loader reports the other part's keys as not in the model and skips them."""
    before = sum(p.numel() for p in model.parameters())
    node = model
    for step in vision_path.split("."):
        if is_encoder:  # everything beside the path down to the vision tower
            _drop_values(node, keep=step, keep_layers=keep_layers)
        node = getattr(node, step)
    if not is_encoder:
        _drop_values(node, keep_layers=keep_layers)
    kept = sum(p.numel() for p in model.parameters())
    return kept, before - kept


@dataclass(frozen=True)
class MicroStepPlan:
    """Every backbone rank's images of one micro-step and the encoder rank of each (the same on every rank)."""

    grids: list[torch.Tensor]  # per backbone rank: [n_images, 3] (t, h, w)
    owners: list[list[int]]  # per backbone rank: encoder rank (part-local) of each image
    merge: int  # spatial merge size: an image of grid (t, h, w) gives t*h*w // merge**2 rows

    @property
    def any_images(self) -> bool:
        return any(g.shape[0] for g in self.grids)

    def pair_images(self, enc: int, bb: int) -> list[int]:
        """Indices (in the backbone rank's order) of the images encoder rank `enc` encodes for backbone rank `bb`."""
        return [j for j, e in enumerate(self.owners[bb]) if e == enc]

    def patches(self, bb: int, images: Sequence[int]) -> int:
        g = self.grids[bb]
        return int(sum(int(g[j].prod()) for j in images))

    def rows(self, bb: int, images: Sequence[int]) -> int:
        return self.patches(bb, images) // self.merge ** 2


@dataclass
class FlowFsdp2:
    """This rank's side of the FSDP2 flow job (installed once per process by the launcher)."""

    parts: Fsdp2Parts
    rank: int
    part: str
    groups: dict[str, Any] = field(default_factory=dict)
    transport: Any = None
    micro_step: int = 0  # micro-steps so far (the transport's step counter)
    stash: Optional[dict[str, Any]] = None  # the backbone's received rows of the current micro-step
    text_hidden: int = 0  # the LLM's hidden size: the width of each map in a row
    deepstack_count: int = 0  # deepstack maps beside the embedding in each row
    merge: int = 2  # the vision tower's spatial merge size (patches per row: merge**2)
    patch_dim: int = 0  # values per patch row of pixel_values (channels x temporal patch x patch x patch)
    encoder_trainable: bool = True  # whether the vision tower trains (gradients come back)

    @property
    def layout(self) -> Layout:
        return self.parts.layout

    @property
    def is_encoder(self) -> bool:
        return self.part == ENCODER

    def global_rank(self, part: str, local: int) -> int:
        return self.layout.offset(part) + local

    def local_rank(self) -> int:
        return self.rank - self.layout.offset(self.part)

    def take_model(self, model: torch.nn.Module, vision_path: str, vision_config: Any, *, keep_layers: bool = False,
                   encoder_may_train: bool = True) -> None:
        """Make a freshly built (meta-device) model this rank's part of it: drop the other part's values, freeze
        what this part does not train, and read the row shapes from the vision config (the LLM's hidden size: each
        map's width; the deepstack count; the merge size; values per patch row of pixel_values).

        `encoder_may_train=False` when the job runs the tower without gradients even where its values would train
        (MindSpeed-MM's `pretrain_transformers.py` with tower and projector both frozen)."""
        kept, dropped = drop_other_part(model, vision_path, self.is_encoder, keep_layers=keep_layers)
        if self.rank == self.layout.offset(self.part):
            print(f"[flow] {self.part} ranks hold {kept:,} parameter values of the model's {kept + dropped:,} "
                  "(the other part's are not built here)", flush=True)
        vision = module_at(model, vision_path)
        vision_ids = {id(p) for p in vision.parameters()}
        for p in model.parameters():
            if (id(p) in vision_ids) != self.is_encoder:
                p.requires_grad_(False)
        self.text_hidden = int(vision_config.out_hidden_size)
        self.deepstack_count = len(getattr(vision_config, "deepstack_visual_indexes", []) or [])
        self.merge = int(vision_config.spatial_merge_size)
        self.patch_dim = int(vision_config.in_channels * vision_config.temporal_patch_size
                             * vision_config.patch_size ** 2)
        if self.is_encoder:
            self.encoder_trainable = encoder_may_train and any(p.requires_grad for p in vision.parameters())

    # ------------------------------------------------------------------ process groups

    @staticmethod
    def mesh_groups_by_members() -> None:
        """Every DeviceMesh group from now on (MindSpeed-MM's ParallelState meshes, their `_flatten`ed dims) is
        created by its own members only (`use_local_synchronization`, hashed names), so one part builds its meshes
        without the other part joining; all of this job's meshes are part-local. Idempotent."""
        import torch.distributed.device_mesh as dm

        original = dm.new_group
        if getattr(original, "_mindspeed_flow_local", False):
            return

        def local_new_group(*args: Any, **kwargs: Any) -> Any:
            kwargs["use_local_synchronization"] = True
            return original(*args, **kwargs)

        local_new_group._mindspeed_flow_local = True  # type: ignore[attr-defined]
        dm.new_group = local_new_group

    def device_mesh(self, device_type: str, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str]) -> Any:
        """`init_device_mesh` over this part's ranks (MindSpeed-MM's calls it over the world)."""
        from torch.distributed.device_mesh import DeviceMesh

        self.mesh_groups_by_members()
        start, size = self.layout.offset(self.part), self.parts.part_size(self.part)
        ranks = torch.arange(start, start + size, dtype=torch.int).reshape(tuple(mesh_shape))
        return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(mesh_dim_names))

    def build_groups(self, device: torch.device, dtype: torch.dtype) -> None:
        """World groups of the transfers (every rank creates them, in this order): gloo for the plan and headers,
        the device backend for payloads, one communicator per direction (see `pool.planned`)."""
        from mindspeed_flow.pool.planned import PlannedTransport

        world = list(range(self.layout.world_size))
        # The plan and the headers are host tensors (gloo). With the default group bound to a device (MindSpeed-MM
        # passes device_id to init_process_group), torch 2.7 asks every new group for that device's backend, so
        # the host group carries the device backend too.
        host = "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:{dist.get_backend()}"
        self.groups = {"plan": dist.new_group(world, backend=host),
                       "forward": dist.new_group(world), "backward": dist.new_group(world)}
        self.transport = PlannedTransport(rank=self.rank, embedding_group=self.groups["forward"],
                                          gradient_group=self.groups["backward"], header_group=self.groups["plan"],
                                          device=device, timeout_s=self.parts.timeout_s, dtype=dtype,
                                          describe=self.describe_rank)

    def describe_rank(self, rank: int) -> str:
        part = self.layout.part_of(rank).name
        return f"rank {rank} ({part} {rank - self.layout.offset(part)})"

    # ------------------------------------------------------------------ the plan of a micro-step

    def exchange_plan(self, grids: Optional[torch.Tensor], merge: int) -> MicroStepPlan:
        """All ranks: every backbone rank's image grids (encoder ranks give none), then the same assignment."""
        group = self.groups["plan"]
        world = self.layout.world_size
        mine = torch.zeros((0, 3), dtype=torch.int64) if grids is None else grids.detach().to("cpu", torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([mine.shape[0]], dtype=torch.int64), group=group)
        width = max(int(c.item()) for c in counts)
        padded = torch.zeros((max(width, 1), 3), dtype=torch.int64)
        padded[:mine.shape[0]] = mine
        gathered = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        bb_ranks = self.layout.part_ranks(BACKBONE)
        per_bb = [gathered[r][:int(counts[r].item())] for r in bb_ranks]
        patches = [int(g.prod()) for grid in per_bb for g in grid]
        flat = assign_images(patches, self.parts.part_size(ENCODER))
        owners, k = [], 0
        for grid in per_bb:
            owners.append(flat[k:k + grid.shape[0]])
            k += grid.shape[0]
        return MicroStepPlan(per_bb, owners, merge)

    # ------------------------------------------------------------------ the backbone side

    def backbone_exchange(self, batch: dict[str, Any], merge: int, trainable: bool) -> None:
        """Send this micro-batch's images and videos to their encoder ranks, take back their rows (kept for
        `get_image_features`); their gradients go back from a hook during the backward."""
        from mindspeed_flow.pool.wire import CHANNEL_EMBEDDING, CHANNEL_GRAD, CHANNEL_PIXELS

        step, self.micro_step = self.micro_step, self.micro_step + 1
        # Images, then videos (a video is one more item whose grid has t > 1): one list, one plan, one ViT call per
        # encoder rank; `image_features` hands each kind back when the model asks for it.
        kinds = [(kind, batch[key], batch[grid_key]) for kind, key, grid_key in
                 (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))
                 if batch.get(key) is not None]
        pixels = torch.cat([p for _, p, _ in kinds]) if kinds else None
        grids = torch.cat([g for _, _, g in kinds]) if kinds else None
        plan = self.exchange_plan(grids, merge)
        self.stash = None
        if not plan.any_images or pixels is None:
            return
        me = self.local_rank()
        encoders = self.parts.part_size(ENCODER)
        starts = torch.cumsum(torch.tensor([0] + [int(g.prod()) for g in plan.grids[me]]), 0).tolist()
        pairs = [(e, plan.pair_images(e, me)) for e in range(encoders)]
        pairs = [(e, imgs) for e, imgs in pairs if imgs]
        for e, imgs in pairs:  # the global order of this direction: backbone rank, then encoder rank
            rows = torch.cat([pixels[starts[j]:starts[j + 1]] for j in imgs])
            self.transport.send(CHANNEL_PIXELS, self.global_rank(ENCODER, e), step, e, rows)
        from mindspeed_flow.pool.planned import PlannedItem

        hidden = self.text_hidden * (1 + self.deepstack_count)
        items = [PlannedItem(self.global_rank(ENCODER, e), step, me, plan.rows(me, imgs)) for e, imgs in pairs]
        self.transport.post_receives(CHANNEL_EMBEDDING, items, hidden)
        got = {e: self.transport.receive(CHANNEL_EMBEDDING, self.global_rank(ENCODER, e), step, me)
               for e, _ in pairs}
        # Back into this rank's image order.
        sizes = [int(g.prod()) // merge ** 2 for g in plan.grids[me]]
        per_image: list[Optional[torch.Tensor]] = [None] * len(sizes)
        for e, imgs in pairs:
            for j, part in zip(imgs, torch.split(got[e], [sizes[j] for j in imgs])):
                per_image[j] = part
        rows = torch.cat(per_image).to(pixels.device)  # type: ignore[arg-type]
        if trainable:
            rows.requires_grad_(True)

            def send_grads(grad: torch.Tensor) -> None:
                parts = list(torch.split(grad, sizes))
                for e, imgs in pairs:
                    self.transport.send(CHANNEL_GRAD, self.global_rank(ENCODER, e), step, me,
                                        torch.cat([parts[j] for j in imgs]))

            rows.register_hook(send_grads)
        segments, first = [], 0
        for kind, _, grid in kinds:
            segments.append((kind, grid.detach().to("cpu", torch.int64), first, first + grid.shape[0]))
            first += grid.shape[0]
        self.stash = {"rows": rows, "sizes": sizes, "segments": segments}

    def image_features(self, grid_thw: Optional[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        """What `get_image_features` returns on a backbone rank for `grid_thw` (the micro-batch's images, or its
        videos: Qwen3-VL's `get_video_features` calls `get_image_features`): per-item embeddings and the deepstack
        maps, cut from the received rows."""
        if self.stash is None or not self.stash["segments"]:
            raise RuntimeError("mindspeed-flow: the model asked for image features of a micro-batch whose images "
                               "were not exchanged (get_image_features outside the training step?)")
        kind, grid, start, stop = self.stash["segments"].pop(0)  # the model asks for images first, then videos
        if grid_thw is None or not torch.equal(grid_thw.detach().to("cpu", torch.int64), grid):
            raise RuntimeError(f"mindspeed-flow: the model asked for visual features of grids "
                               f"{None if grid_thw is None else grid_thw.tolist()}, but the next exchanged items are "
                               f"the micro-batch's {kind}s with grids {grid.tolist()}")
        sizes = self.stash["sizes"]
        lo, hi = sum(sizes[:start]), sum(sizes[:stop])
        rows, h = self.stash["rows"][lo:hi], self.text_hidden
        embeds = torch.split(rows[:, :h], sizes[start:stop])
        deepstack = [rows[:, h * (i + 1):h * (i + 2)] for i in range(self.deepstack_count)]
        if os.environ.get("MSF_FLOW_ZERO_DEEPSTACK", "") == "1":
            # A probe for tests: the deepstack maps arrive zeroed, and the loss must move (they reach the decoder).
            deepstack = [torch.zeros_like(d) for d in deepstack]
        return embeds, deepstack

    # ------------------------------------------------------------------ the encoder side

    def encoder_micro_step(self, visual: torch.nn.Module, merge: int, patch_dim: int, dtype: torch.dtype,
                           device: torch.device, trainable: bool) -> None:
        """One micro-step of an encoder rank: take its images, encode them, send the rows, backward their grads."""
        from mindspeed_flow.pool.planned import PlannedItem
        from mindspeed_flow.pool.wire import CHANNEL_EMBEDDING, CHANNEL_GRAD, CHANNEL_PIXELS

        step, self.micro_step = self.micro_step, self.micro_step + 1
        plan = self.exchange_plan(None, merge)
        if not plan.any_images:
            return
        me = self.local_rank()
        backbones = self.layout.part(BACKBONE).size
        pairs = [(b, plan.pair_images(me, b)) for b in range(backbones)]
        pairs = [(b, imgs) for b, imgs in pairs if imgs]
        items = [PlannedItem(self.global_rank(BACKBONE, b), step, me, plan.patches(b, imgs)) for b, imgs in pairs]
        self.transport.post_receives(CHANNEL_PIXELS, items, patch_dim)
        pixels = [self.transport.receive(CHANNEL_PIXELS, self.global_rank(BACKBONE, b), step, me) for b, _ in pairs]
        grids = [plan.grids[b][imgs] for b, imgs in pairs]
        if not pairs:
            # An FSDP2 forward is a collective over the encoder part: a rank without images encodes one blank
            # image of the smallest grid (one merged row) and sends nothing.
            pixels = [torch.zeros((merge * merge, patch_dim), dtype=dtype, device=device)]
            grids = [torch.tensor([[1, merge, merge]], dtype=torch.int64)]
        grid = torch.cat(grids)
        if self.parts.frames_as_images:
            grid = frames_as_images(grid)
        grid = grid.to(device)
        with contextlib.nullcontext() if trainable else torch.no_grad():
            out = visual(torch.cat(pixels).to(device, dtype), grid_thw=grid)
            # Qwen3-VL's tower returns (embeddings, deepstack maps); GLM-4.5V's the embeddings alone.
            embeds, deepstack = (out, []) if isinstance(out, torch.Tensor) else out
            rows = torch.cat([embeds, *deepstack], dim=-1)
        if not pairs:
            if trainable:
                (rows.sum() * 0.0).backward()
            return
        sizes = [plan.rows(b, imgs) for b, imgs in pairs]
        chunks = torch.split(rows, sizes)
        for (b, _), chunk in zip(pairs, chunks):
            self.transport.send(CHANNEL_EMBEDDING, self.global_rank(BACKBONE, b), step, b, chunk)
        if not trainable:
            return
        hidden = rows.shape[-1]
        items = [PlannedItem(self.global_rank(BACKBONE, b), step, b, n) for (b, _), n in zip(pairs, sizes)]
        self.transport.post_receives(CHANNEL_GRAD, items, hidden)
        grads = [self.transport.receive(CHANNEL_GRAD, self.global_rank(BACKBONE, b), step, b) for b, _ in pairs]
        # The unpatched job's gradient is the mean over its data-parallel ranks (FSDP2 reduce-scatters with
        # ReduceOp.AVG; HCCL runs it as a sum divided by the group size), and the backbone part's is the mean over
        # its B ranks. The rows coming back carry each backbone rank's own gradient, so the vision tower's gradient
        # must be their sum over the B ranks divided by B; the encoder part's FSDP2 reduction averages over its E
        # ranks, which divides the sum by E, so each rank scales what it backpropagates by E / B.
        scale = self.layout.part(ENCODER).size / backbones
        torch.autograd.backward(rows, torch.cat(grads).to(rows.device, rows.dtype) * scale)
        self.transport.flush()

    # ------------------------------------------------------------------ one gradient norm

    def global_norm(self, part_norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """A part's gradient norm (the same on each of its ranks) -> the norm over every part: each part's first
        rank contributes its p-th power, every rank of the world takes part (one all-reduce per step)."""
        value = part_norm.detach().to(torch.float32).reshape(())
        if norm_type == float("inf"):
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            return value
        is_first = self.rank == self.layout.offset(self.part)
        power = value ** norm_type if is_first else torch.zeros_like(value)
        dist.all_reduce(power)
        return power ** (1.0 / norm_type)


_CURRENT: Optional[FlowFsdp2] = None


def frames_as_images(grid_thw: torch.Tensor) -> torch.Tensor:
    """Each item's (t, h, w) as t rows of (1, h, w), in order: the same patches and merged rows, one grid per frame."""
    frames = grid_thw.repeat_interleave(grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def current() -> Optional[FlowFsdp2]:
    return _CURRENT


def install(ctx: Optional[FlowFsdp2]) -> None:
    global _CURRENT
    _CURRENT = ctx


def for_this_process(parts: Fsdp2Parts) -> FlowFsdp2:
    rank = int(os.environ.get("RANK", "0"))
    return FlowFsdp2(parts, rank, parts.layout.part_of(rank).name)
