"""Checkpoints of a flow job in Megatron's format, and the bridge to and from coupled MindSpeed-MM checkpoints.

Layout on disk (`--ckpt-format torch`): a flow job saves each part into its own rank folders beside each other,
`iter_NNNNNNN/mp_<module>_rank_TT[_PPP]/model_optim_rng.pt` (`<module>` = image_encoder or text_decoder), with the
one tracker file Megatron writes. A coupled job's folders are `mp_rank_TT[_PPP]`.

Loading a coupled checkpoint into a flow job (`--load DIR --finetune`) needs no conversion step: every rank reads
the coupled shards, merges them into whole tensors (global layer numbers, tensor-parallel shards concatenated),
takes the tensors of its own module, and cuts them for its own pipeline stage and tensor-parallel rank.
`convert()` does the same offline in both directions (`mindspeed-flow convert-checkpoint`).

Tensor-parallel rules are Megatron's: column-parallel weights (`linear_qkv`, `linear_fc1`, `word_embeddings`,
`output_layer`) split along dim 0, row-parallel ones (`linear_proj`, `linear_fc2` weights) along dim 1, all else
is replicated. A gated MLP's `linear_fc1` holds [gate; up] per rank, so its halves are split and joined apart.
Fused QKV stays grouped by query group, so an even dim-0 split is exact whenever tp divides the groups.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

PREFIX = {"encoder": "image_encoder.", "backbone": "text_decoder."}
_LAYER_RE = re.compile(r"^(image_encoder\.encoder\.blocks\.layers|text_decoder\.decoder\.layers)\.(\d+)\.(.*)$")
_RANK_DIR_RE = re.compile(r"^mp_(?:(?P<part>[a-z_]+?)_)?rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?$")
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
           "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or converted; the message names the folder and the rule."""


def part_checkpoint_name(name: str, part: str) -> str:
    """Megatron's `.../mp_rank_TT[_PPP]/file` -> `.../mp_<module>_rank_TT[_PPP]/file` for a flow part."""
    module = PREFIX[part].rstrip(".")
    folder = os.path.basename(os.path.dirname(name))
    if not folder.startswith("mp_rank_"):
        return name
    return os.path.join(os.path.dirname(os.path.dirname(name)), folder.replace("mp_", f"mp_{module}_", 1),
                        os.path.basename(name))


def is_flow_iteration(iter_dir: str | Path) -> bool:
    """Whether an iteration folder holds a flow job's per-part folders (`mp_<module>_rank_*`) and no coupled ones."""
    keys = rank_folders(Path(str(iter_dir)))
    return bool(keys) and all(k[0] is not None for k in keys)


def read_iteration(load_dir: str | Path) -> tuple[int, bool]:
    text = (Path(load_dir) / TRACKER).read_text().strip()
    return (0, True) if text == "release" else (int(text), False)


def rank_folders(iter_dir: Path) -> dict[tuple[Optional[str], int, int], Path]:
    """{(module or None for coupled, tp, pp): folder} of one iteration."""
    out = {}
    for d in sorted(iter_dir.iterdir()) if iter_dir.is_dir() else []:
        m = _RANK_DIR_RE.match(d.name)
        if m and (d / "model_optim_rng.pt").is_file():
            out[(m.group("part"), int(m.group("tp")), int(m.group("pp") or 0))] = d
    return out


def _tp_dim(key: str) -> Optional[int]:
    if key.endswith(_COLUMN):
        return 0
    if key.endswith(_ROW):
        return 1
    return None


def _is_gated_fc1(key: str, gated_prefixes: Iterable[str]) -> bool:
    return key.endswith(("linear_fc1.weight", "linear_fc1.bias")) and any(key.startswith(p) for p in gated_prefixes)


def merge_tp(shards: list[dict[str, Any]], gated_prefixes: Iterable[str]) -> dict[str, Any]:
    """Whole tensors from the tensor-parallel shards of one pipeline stage."""
    out: dict[str, Any] = {}
    for key, first in shards[0].items():
        dim = _tp_dim(key)
        if dim is None or not torch.is_tensor(first) or len(shards) == 1:
            out[key] = first
        elif _is_gated_fc1(key, gated_prefixes):
            halves = [s[key].chunk(2, dim=0) for s in shards]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[key] = torch.cat([s[key] for s in shards], dim=dim)
    return out


def split_tp(state: dict[str, Any], tp: int, rank: int, gated_prefixes: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        dim = _tp_dim(key)
        if dim is None or not torch.is_tensor(value) or tp == 1:
            out[key] = value
            continue
        if value.shape[dim] % tp:
            raise CheckpointError(f"{key}: dim {dim} of shape {list(value.shape)} is not divisible by tp={tp}")
        if _is_gated_fc1(key, gated_prefixes):
            gate, up = value.chunk(2, dim=0)
            out[key] = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0).clone()
        else:
            out[key] = value.chunk(tp, dim=dim)[rank].clone()
    return out


def merge_pp(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Whole model from its pipeline stages in order: local layer numbers become global ones."""
    out: dict[str, Any] = {}
    offsets: dict[str, int] = {}
    for stage in stages:
        seen: dict[str, int] = {}
        for key, value in stage.items():
            m = _LAYER_RE.match(key)
            if m:
                stack, idx, rest = m.group(1), int(m.group(2)), m.group(3)
                seen[stack] = max(seen.get(stack, 0), idx + 1)
                key = f"{stack}.{offsets.get(stack, 0) + idx}.{rest}"
            out[key] = value
        for stack, n in seen.items():
            offsets[stack] = offsets.get(stack, 0) + n
    return out


def split_pp(state: dict[str, Any], stack: str, layers: list[int], stage: int) -> dict[str, Any]:
    """The keys of one pipeline stage of a module whose layer stack is `stack`, renumbered from 0."""
    start, end = sum(layers[:stage]), sum(layers[:stage + 1])
    first, last = stage == 0, stage == len(layers) - 1
    out: dict[str, Any] = {}
    for key, value in state.items():
        m = _LAYER_RE.match(key)
        if m and m.group(1) == stack:
            idx = int(m.group(2))
            if start <= idx < end:
                out[f"{stack}.{idx - start}.{m.group(3)}"] = value
        elif ".embedding." in key or key.startswith("image_encoder.encoder.patch_embed"):
            if first:
                out[key] = value
        elif "final_layernorm" in key or "output_layer" in key or key.startswith("image_encoder.projector"):
            if last:
                out[key] = value
        elif first:
            out[key] = value
    return out


def _load(path: Path) -> dict[str, Any]:
    return torch.load(str(path / "model_optim_rng.pt"), map_location="cpu", weights_only=False)


def read_whole(iter_dir: Path, module: Optional[str], gated_prefixes: Iterable[str]) -> tuple[dict[str, Any], Any]:
    """Whole tensors of the coupled checkpoint (module None) or of one part's folders, plus the saved args."""
    folders = {k: v for k, v in rank_folders(iter_dir).items() if k[0] == module}
    if not folders:
        raise CheckpointError(f"{iter_dir}: no {'mp_rank_*' if module is None else f'mp_{module}_rank_*'} folders")
    tps = sorted({k[1] for k in folders})
    pps = sorted({k[2] for k in folders})
    stages, args = [], None
    for pp in pps:
        shards = []
        for tp in tps:
            if (module, tp, pp) not in folders:
                raise CheckpointError(f"{iter_dir}: shard tp={tp} pp={pp} is missing")
            sd = _load(folders[(module, tp, pp)])
            args = args if args is not None else sd.get("args")
            shards.append(sd["model"])
        stages.append(merge_tp(shards, gated_prefixes))
    return merge_pp(stages), args


OUTPUT_LAYER = "text_decoder.output_layer.weight"
WORD_EMBEDDINGS = "text_decoder.embedding.word_embeddings.weight"


def part_state(whole: dict[str, Any], part: str, *, tp: int, tp_rank: int, layers: list[int], pp_rank: int,
               gated_prefixes: Iterable[str], tied: bool = False) -> dict[str, Any]:
    """The tensors one rank of a flow part loads: its module, its stage, its tensor-parallel shard.

    Tied embeddings (`untie_embeddings_and_output_weights: false`) follow Megatron: a single-stage decoder holds
    no output layer (the embedding serves both), and with pipeline stages the last one holds its own copy of the
    word embeddings as `output_layer.weight` (Megatron initialises it from the first stage's and keeps the two
    equal by reducing their gradients over the embedding group)."""
    prefix = PREFIX[part]
    mine = {k: v for k, v in whole.items() if k.startswith(prefix)}
    if not mine:
        raise CheckpointError(f"the checkpoint has no {prefix}* tensors")
    stack = "image_encoder.encoder.blocks.layers" if part == "encoder" else "text_decoder.decoder.layers"
    stage = split_pp(mine, stack, layers, pp_rank)
    if part == "backbone" and tied:
        stage.pop(OUTPUT_LAYER, None)
        if len(layers) > 1 and pp_rank == len(layers) - 1:
            if WORD_EMBEDDINGS not in mine:
                raise CheckpointError(f"tied embeddings: the checkpoint has no {WORD_EMBEDDINGS} for the last "
                                      "pipeline stage's output layer")
            stage[OUTPUT_LAYER] = mine[WORD_EMBEDDINGS]
    return split_tp(stage, tp, tp_rank, gated_prefixes)


def embeddings_tied(model_cfg: Any, untie_flag: bool = False) -> bool:
    """Whether the LLM shares its word embeddings with its output layer: model.json's text_decoder key wins (as
    MindSpeed-MM's model config does), else the job's --untie-embeddings-and-output-weights (Megatron: tied)."""
    value = getattr(model_cfg.text_decoder, "untie_embeddings_and_output_weights", None)
    return not (untie_flag if value is None else bool(value))


def gated_prefixes_of(model_cfg: Any, swiglu: bool) -> tuple[str, ...]:
    """Which modules' MLPs are gated (their fc1 holds [gate; up]), from model.json and the job's --swiglu."""
    out = []
    vit = model_cfg.image_encoder.vision_encoder
    if getattr(vit, "gated_linear_unit", False):
        out.append("image_encoder.encoder.")
    if getattr(model_cfg.image_encoder.vision_projector, "gated_linear_unit", False):
        out.append("image_encoder.projector.")
    if getattr(model_cfg.text_decoder, "gated_linear_unit", swiglu):
        out.append("text_decoder.")
    return tuple(out)


def load_for_part(ctx: Any, load: Callable[..., Any], load_dir: Any, args: Any, rank0: bool, *more: Any,
                  **kwargs: Any) -> Any:
    """Megatron's `_load_base_checkpoint` for a flow rank: its own part folders, or its share of a coupled one."""
    tracker = Path(str(load_dir)) / TRACKER
    if rank0 or not tracker.is_file():
        return load(load_dir, args, rank0, *more, **kwargs)
    iteration, release = read_iteration(load_dir)
    iter_dir = Path(str(load_dir)) / ("release" if release else f"iter_{iteration:07d}")
    folders = rank_folders(iter_dir)
    module = PREFIX[ctx.part].rstrip(".")
    if any(k[0] == module for k in folders) or not any(k[0] is None for k in folders):
        return load(load_dir, args, rank0, *more, **kwargs)
    if getattr(args, "ckpt_format", "torch") != "torch":
        raise CheckpointError(f"{load_dir}: a coupled checkpoint loads into a flow job in --ckpt-format torch only")
    if not (getattr(args, "finetune", False) or (getattr(args, "no_load_optim", False)
                                                 and getattr(args, "no_load_rng", False))):
        raise CheckpointError(f"{load_dir} is a coupled checkpoint: its optimizer state and RNG do not carry over to "
                              "separate parts; load it with --finetune (or --no-load-optim --no-load-rng), or convert "
                              "it with `mindspeed-flow convert-checkpoint --to decoupled`")
    from megatron.core import parallel_state as ps

    gated = gated_prefixes_of(args.mm.model, bool(getattr(args, "swiglu", False)))
    whole, saved_args = read_whole(iter_dir, None, gated)
    layers = ([int(args.mm.model.image_encoder.vision_encoder.num_layers)] if ctx.is_encoder
              else list(ctx.parts.decoder_layers))
    model = part_state(whole, ctx.part, tp=ps.get_tensor_model_parallel_world_size(),
                       tp_rank=ps.get_tensor_model_parallel_rank(), layers=layers,
                       pp_rank=ps.get_pipeline_model_parallel_rank(), gated_prefixes=gated,
                       tied=embeddings_tied(args.mm.model, bool(getattr(args, "untie_embeddings_and_output_weights",
                                                                         False))))
    from megatron.training.checkpointing import CheckpointType

    if ctx.is_part_leader:
        print(f"[mindspeed-flow] {ctx.part}: loading its tensors of the coupled checkpoint {iter_dir}", flush=True)
    state = {"model": model, "args": saved_args, "iteration": iteration, "checkpoint_version": 3.0}
    return state, str(iter_dir), release, CheckpointType.LEGACY
