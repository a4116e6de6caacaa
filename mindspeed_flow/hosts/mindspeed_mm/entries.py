"""Which flow job a MindSpeed-MM entry script runs, and its whole check before launch, in one place (the launcher
and `mindspeed-flow emulate` both route through it):

    mindspeed_mm/fsdp/train/trainer.py CONFIG.yaml    fsdp2.fsdp2_parts_for_job
    pretrain_transformers.py CONFIG.yaml              transformers_entry.transformers_parts_for_job
    pretrain_vlm.py <Megatron flags>                  recipe.parts_for_job (which names every other script refused)
"""
from __future__ import annotations

from pathlib import Path

from mindspeed_flow.hosts.mindspeed_mm import FSDP2_TRAINER_SCRIPT, TRANSFORMERS_SCRIPT
from mindspeed_flow.hosts.mindspeed_mm.recipe import SUPPORTED_SCRIPTS, parts_for_job


def is_fsdp2_trainer(script: str) -> bool:
    path = Path(script).as_posix()
    return path == FSDP2_TRAINER_SCRIPT or path.endswith("/" + FSDP2_TRAINER_SCRIPT)


def is_transformers_entry(script: str) -> bool:
    return Path(script).name == TRANSFORMERS_SCRIPT


def is_flow_entry(script: str) -> bool:
    """Whether `script` is an entry a flow job runs (whatever its job then turns out to hold)."""
    return is_fsdp2_trainer(script) or is_transformers_entry(script) or Path(script).name in SUPPORTED_SCRIPTS


def check_flow_entry(recipe_path: str | Path, script: str, argv: list[str], world_size: int) -> object:
    """The launcher's whole check of a flow job for the entry `script` runs; returns that entry's parts (raises
    FlowRecipeError with one line naming the field and the rule)."""
    if is_fsdp2_trainer(script):
        from mindspeed_flow.hosts.mindspeed_mm import fsdp2  # lazy: torch

        return fsdp2.fsdp2_parts_for_job(recipe_path, argv, world_size)
    if is_transformers_entry(script):
        from mindspeed_flow.hosts.mindspeed_mm import transformers_entry  # lazy: torch

        return transformers_entry.transformers_parts_for_job(recipe_path, argv, world_size)
    return parts_for_job(recipe_path, argv, world_size, script=script)
