"""Checkpoints of a flow job in Megatron's format, and the bridge to and from coupled MindSpeed-MM checkpoints.

Layout on disk (`--ckpt-format torch`): a flow job saves each part into its own rank folders beside each other,
`iter_NNNNNNN/mp_<module>_rank_TT[_PPP]/model_optim_rng.pt` (`<module>` = image_encoder or text_decoder), with the
one tracker file Megatron writes. A coupled job's folders are `mp_rank_TT[_PPP]`.

Loading a coupled checkpoint into a flow job (`--load DIR --finetune`) needs no conversion step, and a rank reads
only what holds its tensors (`read_for_rank`): the coupled pipeline-stage folders that hold its module's layers of
its own stage (the coupled split comes from the checkpoint's saved args, i.e. the coupled job's model.json
`pipeline_num_layers`, else from the layer keys each folder holds), memory-mapped, so the bytes of tensors it never
touches are not read; only its module's keys are merged across the tensor-parallel shards (none when the coupled TP
equals the part's: it takes its own shard) and only its own slice is kept. Each rank logs the tensor bytes it read
against the size of the checkpoint's rank files. `convert()` works offline in both directions on whole tensors
(`read_whole`; `mindspeed-flow convert-checkpoint`).

Tensor-parallel rules are Megatron's: column-parallel weights (`linear_qkv`, `linear_fc1`, `word_embeddings`,
`output_layer`) split along dim 0, row-parallel ones (`linear_proj`, `linear_fc2` weights) along dim 1, all else
is replicated. A gated MLP's `linear_fc1` holds [gate; up] per rank, so its halves are split and joined apart.
Fused QKV stays grouped by query group, so an even dim-0 split is exact whenever tp divides the groups.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

# The tensors each part holds, by key prefix: the decoder part also runs the audio encoder (Qwen2.5-Omni), whole on
# its first stage (`split_pp` keeps non-layer tensors there), unless the audio encoder is its own part
# (`prefixes_of`).
PREFIX = {"encoder": ("image_encoder.",), "audio": ("audio_encoder.",),
          "backbone": ("text_decoder.", "audio_encoder.")}


def prefixes_of(part: str, audio_part: bool = False) -> tuple[str, ...]:
    """The key prefixes of the tensors `part` holds; with an audio part the decoder holds no audio tensor."""
    if part == "backbone" and audio_part:
        return ("text_decoder.",)
    return PREFIX[part]
_LAYER_RE = re.compile(r"^(image_encoder\.encoder\.blocks\.layers|text_decoder\.decoder\.layers)\.(\d+)\.(.*)$")
_RANK_DIR_RE = re.compile(r"^mp_(?:(?P<part>[a-z_]+?)_)?rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?$")
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
           "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
TRACKER = "latest_checkpointed_iteration.txt"


# Megatron's distributed optimizer (through MindSpeed's load_state_dict) matches a checkpoint's param groups to the
# live ones by these keys. MindSpeed-MM's dummy optimizer, which gives a frozen part's ranks one empty parameter,
# sets none of the multipliers, so such a part could save its optimizer but never load it back. The values are
# the ones Megatron's scheduler assumes when a key is absent, so filling them in changes no step.
PARAM_GROUP_KEYS = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


def _complete(groups: Iterable[Any]) -> None:
    for group in groups:
        if isinstance(group, dict):
            for key, value in PARAM_GROUP_KEYS.items():
                group.setdefault(key, value)


def complete_param_groups(optimizer: Any) -> None:
    """Give a live Megatron optimizer's param groups (each chained one's) the keys its loader matches on."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is not None and hasattr(inner, "param_groups"):
            _complete(inner.param_groups)


def complete_saved_param_groups(state: Any) -> None:
    """The same for a loaded checkpoint's optimizer state: every `param_groups` list in its nested dicts (the
    distributed optimizer's, each chained optimizer's)."""
    if isinstance(state, dict):
        if isinstance(state.get("param_groups"), list):
            _complete(state["param_groups"])
        for value in state.values():
            complete_saved_param_groups(value)


def module_of(part: str) -> str:
    """The MindSpeed-MM module a flow part holds (its checkpoint folders' name): image_encoder or text_decoder."""
    return PREFIX[part][0].rstrip(".")


def weights_only(finetune: bool, no_load_optim: bool, no_load_rng: bool) -> bool:
    """A load that takes weights only: --finetune, or --no-load-optim with --no-load-rng (Megatron keeps the
    iteration); only such a load can re-split a checkpoint saved in another layout."""
    return finetune or (no_load_optim and no_load_rng)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or converted; the message names the folder and the rule."""


def part_checkpoint_name(name: str, part: str) -> str:
    """Megatron's `.../mp_rank_TT[_PPP]/file` -> `.../mp_<module>_rank_TT[_PPP]/file` for a flow part."""
    module = module_of(part)
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
        elif last if _on_last_stage(key) else first:
            out[key] = value
    return out


def _on_last_stage(key: str) -> bool:
    """Whether a module's non-layer tensor belongs to its last pipeline stage (final norm, output layer, projector:
    Megatron's and MindSpeed-MM's post_process) rather than its first (embeddings and anything else)."""
    if ".embedding." in key or key.startswith("image_encoder.encoder.patch_embed"):
        return False
    return "final_layernorm" in key or "output_layer" in key or key.startswith("image_encoder.projector")


def _load(path: Path, mmap: bool = False) -> dict[str, Any]:
    # mmap: tensor storages stay in the file and are paged in when touched (torch >= 2.1; zip-format files, which
    # is what torch.save and Megatron write).
    return torch.load(str(path / "model_optim_rng.pt"), map_location="cpu", weights_only=False, mmap=mmap)


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


# Each part's pipelined layer stack (the audio encoder's layers are not renumbered: a flow job runs it whole, and a
# coupled job keeps it on its first stage).
STACK = {"encoder": "image_encoder.encoder.blocks.layers", "audio": "audio_encoder.encoder.blocks.layers",
         "backbone": "text_decoder.decoder.layers"}


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if torch.is_tensor(value) else 0


@dataclass
class ReadStats:
    """What one rank read of a coupled checkpoint: tensor bytes touched, rank files opened, and their totals."""

    read_bytes: int = 0
    total_bytes: int = 0  # every coupled rank file on disk (what each rank read before: all of it)
    files_opened: int = 0
    files_total: int = 0
    split_from: str = ""
    source: str = "coupled"  # or "<module> saved": a flow part's folders of another TP/PP

    def line(self) -> str:
        return (f"read {self.read_bytes} bytes of tensor data from {self.files_opened} of {self.files_total} "
                f"{self.source} rank files ({self.read_bytes / max(self.total_bytes, 1):.1%} of their "
                f"{self.total_bytes} bytes; {self.source} split from {self.split_from})")


def _saved_split(saved_args: Any, part: str, stages: int) -> Optional[list[int]]:
    """The coupled job's layers per pipeline stage of a module, from its saved args (its model.json)."""
    node = getattr(getattr(saved_args, "mm", None), "model", None)
    if part == "audio":  # the audio encoder is not pipelined in a flow job
        return None
    for key in ("image_encoder", "vision_encoder") if part == "encoder" else ("text_decoder",):
        node = getattr(node, key, None)
    split = getattr(node, "pipeline_num_layers", None)
    if isinstance(split, (list, tuple)) and len(split) == stages and all(isinstance(n, int) for n in split):
        return list(split)
    return None


def _split_from_keys(stage_models: list[dict[str, Any]], stack: str) -> list[int]:
    """Layers per stage as the folders hold them (their pickled key lists: no tensor bytes are read)."""
    counts = []
    for model in stage_models:
        idx = [int(m.group(2)) for m in map(_LAYER_RE.match, model) if m and m.group(1) == stack]
        counts.append(max(idx) + 1 if idx else 0)
    return counts


def read_for_rank(iter_dir: Path, part: str, *, tp: int, tp_rank: int, layers: list[int], pp_rank: int,
                  gated_prefixes: Iterable[str], tied: bool = False, source: Optional[str] = None,
                  prefix: Optional[tuple[str, ...]] = None) -> tuple[dict[str, Any], Any, ReadStats]:
    """`part_state(read_whole(coupled), ...)` for one flow rank, reading only the folders and tensors it needs.

    `source`: None reads a coupled checkpoint's `mp_rank_*` folders; a module name (image_encoder, text_decoder)
    reads a flow checkpoint's folders of that part saved in another TP/PP. Returns its model tensors (equal to the
    whole-merge path's), the saved args, and what was read."""
    folders = {(k[1], k[2]): v for k, v in rank_folders(iter_dir).items() if k[0] == source}
    if not folders:
        raise CheckpointError(f"{iter_dir}: no mp_{source + '_' if source else ''}rank_* folders")
    tps, pps = sorted({t for t, _ in folders}), sorted({s for _, s in folders})
    for t in tps:
        for s in pps:
            if (t, s) not in folders:
                raise CheckpointError(f"{iter_dir}: shard tp={t} pp={s} is missing")
    stats = ReadStats(total_bytes=sum((d / "model_optim_rng.pt").stat().st_size for d in folders.values()),
                      files_total=len(folders), source="coupled" if source is None else f"{source} saved")
    opened: dict[tuple[int, int], dict[str, Any]] = {}

    def model(t: int, s: int) -> dict[str, Any]:
        if (t, s) not in opened:
            opened[(t, s)] = _load(folders[(t, s)], mmap=True)
            stats.files_opened += 1
        return opened[(t, s)]["model"]

    model(tps[0], pps[0])
    saved_args = opened[(tps[0], pps[0])].get("args")
    stack, prefix = STACK[part], prefix or PREFIX[part]
    # The coupled module's layers per coupled stage, to find the stages that hold this rank's layers.
    if len(pps) == 1:
        counts, stats.split_from = None, "a single stage"
    else:
        # A flow part's saved split is its recipe's, not model.json's: its folders' keys say it.
        counts = _saved_split(saved_args, part, len(pps)) if source is None else None
        stats.split_from = "the saved args' pipeline_num_layers"
        if counts is None:
            counts = _split_from_keys([model(tps[0], s) for s in pps], stack)
            stats.split_from = "the folders' layer keys"
    start, end = sum(layers[:pp_rank]), sum(layers[:pp_rank + 1])
    first, last = pp_rank == 0, pp_rank == len(layers) - 1
    tied_last = tied and part == "backbone" and last and len(layers) > 1
    needed: set[int] = {pps[0]}
    offsets = {pps[0]: 0}
    if counts is not None:
        offsets = {s: sum(counts[:i]) for i, s in enumerate(pps)}
        holding = [s for i, s in enumerate(pps) if counts[i] > 0]
        needed = {s for i, s in enumerate(pps) if counts[i] > 0 and offsets[s] < end and offsets[s] + counts[i] > start}
        # Embeddings live on the module's first coupled stage (MindSpeed-MM's pre_process), the final norm, output
        # layer and projector on its last (post_process); a tied last stage takes the word embeddings too.
        if holding and (first or tied_last):
            needed.add(holding[0])
        if holding and last:
            needed.add(holding[-1])
        if not holding:  # the module has no layers in any folder: read them all, part_state says what is missing
            needed = set(pps)
    # Same TP as the coupled job: each sharded tensor is this rank's own coupled shard (merging the shards and
    # cutting the same slice out again gives exactly it, gated fc1 included), so no other shard is read.
    own_shard = len(tps) == tp
    partial: dict[str, Any] = {}
    for s in sorted(needed):
        for key, value in model(tps[0], s).items():
            if not key.startswith(prefix):
                continue
            m = _LAYER_RE.match(key)
            if m and m.group(1) == stack:
                idx = offsets[s] + int(m.group(2))
                if counts is not None and int(m.group(2)) >= counts[pps.index(s)]:
                    raise CheckpointError(f"{folders[(tps[0], s)]}: holds {key} but the coupled split "
                                          f"{counts} ({stats.split_from}) gives that stage {counts[pps.index(s)]} "
                                          "layers")
                if not start <= idx < end:
                    continue
                out_key = f"{stack}.{idx}.{m.group(3)}"
            elif not (last if _on_last_stage(key) else first) and not (key == WORD_EMBEDDINGS and tied_last):
                continue  # another stage's non-layer tensor
            elif key == OUTPUT_LAYER and tied and part == "backbone":
                continue  # tied: part_state gives the last stage the word embeddings instead
            else:
                out_key = key
            if _tp_dim(key) is None or not torch.is_tensor(value) or len(tps) == 1:
                partial[out_key] = value
                stats.read_bytes += _nbytes(value)
            elif own_shard:
                partial[out_key] = model(tps[tp_rank], s)[key]
                stats.read_bytes += _nbytes(partial[out_key])
            else:
                shards = [model(t, s) for t in tps]
                partial[out_key] = merge_tp([{key: sh[key]} for sh in shards], gated_prefixes)[key]
                stats.read_bytes += sum(_nbytes(sh[key]) for sh in shards)
    state = part_state(partial, part, tp=1 if own_shard else tp, tp_rank=0 if own_shard else tp_rank, layers=layers,
                       pp_rank=pp_rank, gated_prefixes=gated_prefixes, tied=tied, prefix=prefix)
    return state, saved_args, stats


OUTPUT_LAYER = "text_decoder.output_layer.weight"
WORD_EMBEDDINGS = "text_decoder.embedding.word_embeddings.weight"


def part_state(whole: dict[str, Any], part: str, *, tp: int, tp_rank: int, layers: list[int], pp_rank: int,
               gated_prefixes: Iterable[str], tied: bool = False,
               prefix: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """The tensors one rank of a flow part loads: its module, its stage, its tensor-parallel shard.

    Tied embeddings (`untie_embeddings_and_output_weights: false`) follow Megatron: a single-stage decoder holds
    no output layer (the embedding serves both), and with pipeline stages the last one holds its own copy of the
    word embeddings as `output_layer.weight` (Megatron initialises it from the first stage's and keeps the two
    equal by reducing their gradients over the embedding group)."""
    prefix = prefix or PREFIX[part]
    mine = {k: v for k, v in whole.items() if k.startswith(prefix)}
    if not mine:
        raise CheckpointError(f"the checkpoint has no {' or '.join(p + '*' for p in prefix)} tensors")
    stage = split_pp(mine, STACK[part], layers, pp_rank)
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


def loaded_iteration(load_dir: str | Path, ckpt_step: Optional[int] = None) -> tuple[int, bool]:
    """The iteration Megatron loads: `--ckpt-step` when given, else the tracker's."""
    return (int(ckpt_step), False) if ckpt_step else read_iteration(load_dir)


def saved_layouts(load_dir: str | Path, ckpt_step: Optional[int] = None) -> dict[str, tuple[int, int]]:
    """{module: (TP, PP)} of the flow part folders in the iteration `load_dir` loads; {} when it holds none (no
    tracker, or a coupled checkpoint)."""
    if not (Path(load_dir) / TRACKER).is_file():
        return {}
    iteration, release = loaded_iteration(load_dir, ckpt_step)
    folders = rank_folders(Path(load_dir) / ("release" if release else f"iter_{iteration:07d}"))
    return {module: (len({k[1] for k in folders if k[0] == module}), len({k[2] for k in folders if k[0] == module}))
            for module in sorted({k[0] for k in folders if k[0] is not None})}


RESPLIT_HINT = ("its optimizer state and RNG are per saved rank: resume with the layout it was saved with, or load "
                "only its weights, re-split, with --no-load-optim --no-load-rng (iteration and data position kept) "
                "or --finetune (from iteration 0)")


def load_for_part(ctx: Any, load: Callable[..., Any], load_dir: Any, args: Any, rank0: bool, *more: Any,
                  **kwargs: Any) -> Any:
    """Megatron's `_load_base_checkpoint` for a flow rank: its own part folders as saved (a resume), its own part
    folders of another TP/PP re-split (weights only), or its share of a coupled checkpoint (weights only)."""
    tracker = Path(str(load_dir)) / TRACKER
    if rank0 or not tracker.is_file():
        return load(load_dir, args, rank0, *more, **kwargs)
    from megatron.core import parallel_state as ps  # optional: megatron
    from megatron.training.checkpointing import read_metadata  # optional: megatron

    iteration, release = loaded_iteration(load_dir, getattr(args, "ckpt_step", None))
    iter_dir = Path(str(load_dir)) / ("release" if release else f"iter_{iteration:07d}")
    folders = rank_folders(iter_dir)
    module = module_of(ctx.part)

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    saved = saved_layouts(load_dir, getattr(args, "ckpt_step", None)).get(module)
    coupled = any(k[0] is None for k in folders)
    if saved == (tp, pp) or (saved is None and not coupled):  # a resume (or nothing to read: Megatron says so)
        loaded = load(load_dir, args, rank0, *more, **kwargs)
        if isinstance(loaded, tuple) and loaded and isinstance(loaded[0], dict):
            complete_saved_param_groups(loaded[0].get("optimizer"))  # saved before the keys were filled in
        return loaded
    what = (f"{load_dir} holds {module} at TP {saved[0]} PP {saved[1]} and this job runs it at TP {tp} PP {pp}"
            if saved else f"{load_dir} is a coupled checkpoint")
    if getattr(args, "ckpt_format", "torch") != "torch":
        raise CheckpointError(f"{what}: it loads into a flow job in --ckpt-format torch only")
    if not weights_only(bool(getattr(args, "finetune", False)), bool(getattr(args, "no_load_optim", False)),
                        bool(getattr(args, "no_load_rng", False))):
        hint = RESPLIT_HINT if saved else ("its optimizer state and RNG do not carry over to separate parts; load it "
                                           "with --finetune (or --no-load-optim --no-load-rng), or convert it with "
                                           "`mindspeed-flow convert-checkpoint --to decoupled`")
        raise CheckpointError(f"{what}: {hint}")
    # Megatron's loader reads the tracker with a MAX all-reduce over the world; a part resuming as saved runs it,
    # so a part re-splitting here must too (the collective is matched rank for rank).
    read_metadata(str(tracker))
    gated = gated_prefixes_of(args.mm.model, bool(getattr(args, "swiglu", False)))
    model_cfg = args.mm.model
    layers = ([int(model_cfg.audio_encoder.audio_encoder.num_layers)] if ctx.part == "audio"
              else [int(model_cfg.image_encoder.vision_encoder.num_layers)] if ctx.is_encoder
              else list(ctx.parts.decoder_layers))
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    model, saved_args, stats = read_for_rank(
        iter_dir, ctx.part, tp=tp, tp_rank=tp_rank, layers=layers, pp_rank=pp_rank, gated_prefixes=gated,
        tied=embeddings_tied(args.mm.model, bool(getattr(args, "untie_embeddings_and_output_weights", False))),
        source=module if saved else None, prefix=prefixes_of(ctx.part, ctx.parts.audio_part))
    if saved_args is not None:
        # What this rank hands Megatron is in its own layout now, which Megatron's argument check compares.
        saved_args = copy.copy(saved_args)
        saved_args.tensor_model_parallel_size, saved_args.pipeline_model_parallel_size = tp, pp
    from megatron.training.checkpointing import CheckpointType  # optional: megatron

    if ctx.is_part_leader:
        source = (f"{iter_dir} (saved at TP {saved[0]} PP {saved[1]}, re-split)" if saved
                  else f"the coupled checkpoint {iter_dir}")
        print(f"[mindspeed-flow] {ctx.part}: loading its tensors of {source}", flush=True)
    print(f"[mindspeed-flow] rank {ctx.rank} ({ctx.part} tp{tp_rank} pp{pp_rank}): {stats.line()}", flush=True)
    state = {"model": model, "args": saved_args, "iteration": iteration, "checkpoint_version": 3.0}
    return state, str(iter_dir), release, CheckpointType.LEGACY
