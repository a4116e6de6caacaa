"""`mindspeed-flow convert-checkpoint`: a coupled MindSpeed-MM checkpoint to a flow job's part folders and back.

    mindspeed-flow convert-checkpoint --to decoupled --load COUPLED --save FLOW --mm-model model.json \\
        --flow-recipe FLOW.yaml [--swiglu]
    mindspeed-flow convert-checkpoint --to coupled --load FLOW --save COUPLED --mm-model model.json \\
        --flow-recipe FLOW.yaml --tp T --pp P [--swiglu]

Only model tensors move (Megatron `--ckpt-format torch`, the latest iteration of --load); optimizer state and RNG
belong to one layout and are not carried over, so continue a converted run with `--finetune` or
`--no-load-optim --no-load-rng`. The LLM layers per stage follow the flow job's rule (`recipe.decoder_split`):
with `--to decoupled`, the recipe's `parallel.backbone.layer_split`, else model.json's
`text_decoder.pipeline_num_layers` when it has one entry per decoder stage, else an even split; with `--to coupled`
(no recipe split applies), model.json's `text_decoder.pipeline_num_layers` when it has `--pp` entries, else an even
split. The ViT goes on stage 0 (the layout of MindSpeed-MM's examples).
`--save` must not exist yet: a conversion never overwrites a checkpoint. The saved args are unpickled, so
Megatron must be importable: on a machine without it, point MINDSPEED_MM_HOME, MINDSPEED_HOME and MEGATRON_HOME
at the sources (the CPU emulation is then used for the imports).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from mindspeed_flow.hosts.mindspeed_mm import checkpoint as ck
from mindspeed_flow.hosts.mindspeed_mm.recipe import (FlowRecipeError, ModelShape, decoder_split, decoder_split_for,
                                                      load_flow_job)
from mindspeed_flow.step.layout import PartLayout


def _namespace(obj: Any) -> Any:
    if isinstance(obj, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in obj.items()})
    return obj


def _write(save: Path, iteration: int, release: bool, folder: str, model: dict, args: Any) -> None:
    d = save / ("release" if release else f"iter_{iteration:07d}") / folder
    d.mkdir(parents=True, exist_ok=False)
    torch.save({"model": model, "args": args, "iteration": iteration, "checkpoint_version": 3.0},
               str(d / "model_optim_rng.pt"))


def _folder(module: str | None, tp_rank: int, pp_rank: int, pp: int) -> str:
    base = "mp_" + (f"{module}_" if module else "") + f"rank_{tp_rank:02d}"
    return base + (f"_{pp_rank:03d}" if pp > 1 else "")


def convert(*, to: str, load: Path, save: Path, model_json: Path, recipe: Path, swiglu: bool,
            tp: int = 1, pp: int = 1, untie: bool = False) -> list[str]:
    """Convert; returns the folders written. Raises CheckpointError / FlowRecipeError with the reason."""
    if to not in ("decoupled", "coupled"):
        raise ck.CheckpointError(f"--to {to!r}: 'decoupled' or 'coupled'")
    if save.exists():
        raise ck.CheckpointError(f"--save {save} exists: a conversion never writes over an earlier checkpoint")
    model_cfg = _namespace(json.loads(model_json.read_text()))
    gated = ck.gated_prefixes_of(model_cfg, swiglu)
    tied = ck.embeddings_tied(model_cfg, untie)
    shape = ModelShape.from_model_json(model_json)
    job = load_flow_job(recipe)
    if job.parallel.encoders:
        # A flow job loads a coupled checkpoint into any layout by itself (`--load DIR --finetune`).
        raise ck.CheckpointError(f"{recipe}: parallel.encoders: the converter writes the two-part layout "
                                 "(parallel.encoder, parallel.backbone) only; a flow job with an audio part loads the "
                                 "coupled checkpoint itself (--load DIR --finetune)")
    # Layouts only: the batch rules of build_parts belong to a job, not to checkpoint files.
    layouts = {"encoder": PartLayout("encoder", job.parallel.encoder.dp, job.parallel.encoder.tp, 1, 1),
               "backbone": PartLayout("backbone", job.parallel.backbone.dp, job.parallel.backbone.tp,
                                      job.parallel.backbone.pp, 1)}
    iteration, release = ck.read_iteration(load)
    iter_dir = load / ("release" if release else f"iter_{iteration:07d}")
    # The LLM split of the target layout, checked before anything is written.
    if to == "decoupled":
        text_layers = list(decoder_split_for(job, shape, recipe.name).layers)
    else:
        text_layers = list(decoder_split(pp, shape.llm_layers, model_split=shape.llm_split,
                                         model_name=shape.source).layers)
    written = []
    save.mkdir(parents=True)
    if to == "decoupled":
        whole, args = ck.read_whole(iter_dir, None, gated)
        for part, module in (("encoder", "image_encoder"), ("backbone", "text_decoder")):
            lay = layouts[part]
            layers = [shape.vit_layers] if part == "encoder" else text_layers
            for pp_rank in range(lay.pp):
                for tp_rank in range(lay.tp):
                    state = ck.part_state(whole, part, tp=lay.tp, tp_rank=tp_rank, layers=layers, pp_rank=pp_rank,
                                          gated_prefixes=gated, tied=tied)
                    folder = _folder(module, tp_rank, pp_rank, lay.pp)
                    _write(save, iteration, release, folder, state, args)
                    written.append(folder)
    else:
        whole: dict[str, Any] = {}
        args = None
        for module in ("image_encoder", "text_decoder"):
            part_whole, part_args = ck.read_whole(iter_dir, module, gated)
            whole.update(part_whole)
            args = args if args is not None else part_args
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                state = ck.part_state(whole, "backbone", tp=tp, tp_rank=tp_rank, layers=text_layers,
                                      pp_rank=pp_rank, gated_prefixes=gated, tied=tied)
                if pp_rank == 0:
                    state.update(ck.part_state(whole, "encoder", tp=tp, tp_rank=tp_rank, layers=[shape.vit_layers],
                                               pp_rank=0, gated_prefixes=gated))
                folder = _folder(None, tp_rank, pp_rank, pp)
                _write(save, iteration, release, folder, state, args)
                written.append(folder)
    (save / ck.TRACKER).write_text("release" if release else str(iteration))
    return written


def main(argv: list[str], prepare: Callable[[], None] = lambda: None) -> int:
    """`prepare` runs once the arguments parse, before anything unpickles Megatron's args (the command's entry,
    `emulation/convert_command.py`, makes Megatron importable there)."""
    p = argparse.ArgumentParser(prog="mindspeed-flow convert-checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--to", required=True, choices=("decoupled", "coupled"))
    p.add_argument("--load", required=True, type=Path)
    p.add_argument("--save", required=True, type=Path)
    p.add_argument("--mm-model", required=True, type=Path)
    p.add_argument("--flow-recipe", required=True, type=Path)
    p.add_argument("--swiglu", action="store_true", help="the job's LLM MLP is gated (the job runs --swiglu)")
    p.add_argument("--untie-embeddings-and-output-weights", dest="untie", action="store_true",
                   help="the job runs with untied embeddings (model.json's text_decoder key wins when present)")
    p.add_argument("--tp", type=int, default=1, help="coupled target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="coupled target pipeline-parallel size")
    a = p.parse_args(argv)
    prepare()
    try:
        written = convert(to=a.to, load=a.load, save=a.save, model_json=a.mm_model, recipe=a.flow_recipe,
                          swiglu=a.swiglu, tp=a.tp, pp=a.pp, untie=a.untie)
    except (ck.CheckpointError, FlowRecipeError, OSError) as err:
        print(f"mindspeed-flow convert-checkpoint: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} rank folders to {a.save}: {', '.join(written)}")
    return 0
