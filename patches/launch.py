"""Run a MindSpeed-MM entry script with the mindspeed-flow patch set applied.

    torchrun <launcher args> -m mindspeed_flow_patches.launch [--flow-recipe FLOW.yaml] pretrain_vlm.py <args...>
    torchrun <launcher args> -m mindspeed_flow_patches.launch --flow-recipe FLOW.yaml \
        mindspeed_mm/fsdp/train/trainer.py CONFIG.yaml [key=value ...]
    torchrun <launcher args> -m mindspeed_flow_patches.launch --flow-recipe FLOW.yaml pretrain_transformers.py CONFIG.yaml

The second form is MindSpeed-MM's FSDP2 trainer (`mindspeed_flow.hosts.mindspeed_mm.fsdp2`, patches in
`mindspeed_flow_patches.fsdp2_flow`): it runs without Megatron, so nothing below about MindSpeed's adaptor applies
to it; its patches are installed before the script runs. The third is MindSpeed-MM's Megatron loop over an
HF-style model sharded by MindSpeed's torch FSDP2 (`mindspeed_flow.hosts.mindspeed_mm.transformers_entry`, patches
in `mindspeed_flow_patches.transformers_flow`): CONFIG.yaml's gpt_args become the command line (MindSpeed-MM's own
reader) before MindSpeed is imported, then the steps below apply.

Without `--flow-recipe` only the fixes (MC2 2-D input) are applied and the job behaves exactly as before. With it,
the job trains decoupled: the image encoder and the text decoder on their own ranks, each with the layout of
FLOW.yaml (see `mindspeed_flow.hosts.mindspeed_mm`); the recipe is checked against the launched world and the
job's model.json before MindSpeed is imported, so a wrong recipe fails with one message naming the field.

Order matters and follows MindSpeed's own rules:
1. `sys.argv` becomes the script's argv first: `import mindspeed.megatron_adaptor` parses feature flags from it.
2. `import mindspeed.megatron_adaptor` (torch_npu transfer + MindSpeed feature patches).
3. Import `mindspeed_mm` and every patch target module BEFORE `apply_patches()`: a target imported inside the
   patch loop runs MindSpeed-MM's import-time `register_patch` calls while MindSpeed iterates its patch dict
   (`RuntimeError: dictionary changed size during iteration`).
4. Register each patch module's patches, `apply_patches()`, then run the script as `__main__`.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
from types import ModuleType
from typing import Any, Callable, Optional

# Patch modules of this package, applied in order; each exposes TARGET_MODULES and register(patch_manager).
FIX_MODULES: tuple[str, ...] = ("mindspeed_flow_patches.mc2",)
FLOW_MODULES: tuple[str, ...] = ("mindspeed_flow_patches.flow",)
# `pretrain_transformers.py CONFIG.yaml` (Megatron's loop over MindSpeed's torch FSDP2): its own flow patch set.
TRANSFORMERS_FLOW_MODULES: tuple[str, ...] = ("mindspeed_flow_patches.transformers_flow",)
APPLIED_ENV = "MSF_PATCHES_APPLIED"
RECIPE_ENV = "MSF_FLOW_RECIPE"


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def apply_flow_patches(flow_modules: tuple[str, ...] = ()) -> list[str]:
    """Import the targets, register every patch (the fixes, then `flow_modules`), apply them; returns the applied
    patch module names."""
    import mindspeed.megatron_adaptor  # optional: mindspeed  # noqa: F401  (step 2)
    from mindspeed.patch_utils import MindSpeedPatchesManager  # optional: mindspeed

    importlib.import_module("mindspeed_mm")
    modules: list[ModuleType] = [importlib.import_module(n) for n in FIX_MODULES + tuple(flow_modules)]
    for mod in modules:
        for target in mod.TARGET_MODULES:
            importlib.import_module(target)
    for mod in modules:
        mod.register(MindSpeedPatchesManager)
    MindSpeedPatchesManager.apply_patches()
    names = [mod.__name__ for mod in modules]
    os.environ[APPLIED_ENV] = ",".join(names)
    return names


def _split_recipe(argv: list[str]) -> tuple[Optional[str], list[str]]:
    if argv[:1] == ["--flow-recipe"]:
        if len(argv) < 2:
            raise SystemExit("mindspeed_flow_patches.launch: --flow-recipe needs a file")
        return argv[1], argv[2:]
    if argv[:1] and argv[0].startswith("--flow-recipe="):
        return argv[0].split("=", 1)[1], argv[1:]
    return os.environ.get(RECIPE_ENV) or None, argv


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            argv[i + 1] = value
        elif a.startswith(flag + "="):
            argv[i] = f"{flag}={value}"
    if not any(a == flag or a.startswith(flag + "=") for a in argv):
        argv += [flag, value]


def setup_flow(recipe: str, script: str, script_argv: list[str]) -> None:
    """Validate the recipe and install this rank's flow context (before any process group exists)."""
    from mindspeed_flow.hosts.mindspeed_mm import context  # lazy: flow jobs only
    from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError, parts_for_job  # lazy: flow jobs only

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        parts = parts_for_job(recipe, script_argv, world, script=script)
    except FlowRecipeError as err:
        if _is_rank0():
            print(f"mindspeed-flow: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    context.install(context.FlowContext.for_this_process(parts))
    # MindSpeed makes its import-time feature decisions (MC2's class replacement among them) from the command line's
    # TP; the per-part TP is applied later, rank by rank. So the command line carries the largest part TP.
    _set_flag(script_argv, "--tensor-model-parallel-size", str(max(p.tp for p in parts.layout.parts)))
    if parts.frozen_parts and "--enable-dummy-optimizer" not in script_argv:
        # A frozen encoder part has no trainable parameter; MindSpeed-MM's dummy optimizer gives its ranks one
        # (its flag is read at import time, so it must be on the command line before MindSpeed is imported).
        script_argv.append("--enable-dummy-optimizer")
    os.environ[RECIPE_ENV] = os.path.abspath(recipe)
    if _is_rank0():
        print(f"[mindspeed-flow] decoupled layout from {recipe}: {parts.describe()}; decoder pipeline layers "
              f"{list(parts.decoder_layers)} (from {parts.decoder_layers_from}); "
              f"encoder {'trainable' if parts.encoder_trainable else 'frozen'}; "
              + (f"audio encoder {'trainable' if parts.audio_trainable else 'frozen'}; " if parts.audio_part else "") +
              f"packing {parts.packing.scheduler} (token budget {parts.packing.token_budget})"
              + ("; sequence-parallel embedding gradient split, not summed (flow.fix_sp_embedding_grad)"
                 if parts.fix_sp_embedding_grad and "--sequence-parallel" in script_argv else ""), flush=True)


def _checked(check: Callable[..., Any], recipe: str, script_argv: list[str]) -> Any:
    """An FSDP2 entry's parts from `check(recipe, script_argv, world)`, or exit 2 with its one-line reason."""
    from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError  # lazy: flow jobs only

    try:
        return check(recipe, script_argv, int(os.environ.get("WORLD_SIZE", "1")))
    except FlowRecipeError as err:
        if _is_rank0():
            print(f"mindspeed-flow: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def is_fsdp2_trainer(script: str) -> bool:
    from mindspeed_flow.hosts.mindspeed_mm import entries  # lazy: the launcher's start-up

    return entries.is_fsdp2_trainer(os.path.abspath(script))


def setup_fsdp2_flow(recipe: str, script_argv: list[str]) -> list[str]:
    """Validate FLOW.yaml against CONFIG.yaml, install this rank's context, add its part's overrides; returns the
    patched targets."""
    from mindspeed_flow.hosts.mindspeed_mm import fsdp2  # lazy: flow jobs only

    parts = _checked(fsdp2.fsdp2_parts_for_job, recipe, script_argv)
    ctx = fsdp2.for_this_process(parts)
    fsdp2.install(ctx)
    os.environ[RECIPE_ENV] = os.path.abspath(recipe)
    if _is_rank0():
        print(f"[mindspeed-flow] decoupled FSDP2 layout from {recipe}: {parts.describe()}", flush=True)
    from mindspeed_flow_patches import fsdp2_flow  # lazy: imports MindSpeed-MM

    return fsdp2_flow.apply()


def is_transformers_entry(script: str) -> bool:
    from mindspeed_flow.hosts.mindspeed_mm import entries  # lazy: the launcher's start-up

    return entries.is_transformers_entry(script)


def setup_transformers_flow(recipe: str, script_argv: list[str]) -> None:
    """Validate FLOW.yaml against CONFIG.yaml and install this rank's flow host (before any process group)."""
    from mindspeed_flow.hosts.mindspeed_mm import context, fsdp2, transformers_entry  # lazy: flow jobs only

    parts = _checked(transformers_entry.transformers_parts_for_job, recipe, script_argv)
    host = transformers_entry.for_this_process(parts)
    context.install(host.ctx)
    fsdp2.install(host.rows)
    transformers_entry.install(host)
    os.environ[RECIPE_ENV] = os.path.abspath(recipe)
    if _is_rank0():
        print(f"[mindspeed-flow] decoupled layout from {recipe}: {parts.describe()}", flush=True)


def read_yaml_arguments(script: str) -> None:
    """`pretrain_transformers.py CONFIG.yaml` turns CONFIG.yaml's gpt_args into its command line in its first lines,
    with MindSpeed-MM's own reader (`mindspeed_mm/configs/read_yaml_config.py`), before it imports MindSpeed. The
    patches are applied before the script runs, and MindSpeed decides its features from the command line when it is
    imported, so the same reader runs here first; the script's own call then finds the command line already read."""
    reader = os.path.join(os.path.dirname(script), "mindspeed_mm", "configs", "read_yaml_config.py")
    if len(sys.argv) > 1 and sys.argv[1].endswith(".yaml") and os.path.isfile(reader):
        runpy.run_path(reader, run_name="config_loader")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe, argv = _split_recipe(argv)
    if not argv or not argv[0].endswith(".py"):
        print("usage: python -m mindspeed_flow_patches.launch [--flow-recipe FLOW.yaml] SCRIPT.py [args...]",
              file=sys.stderr)
        return 2
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"mindspeed_flow_patches.launch: script {argv[0]!r} not found (cwd {os.getcwd()})", file=sys.stderr)
        return 2
    script_argv = argv[1:]
    if is_fsdp2_trainer(script):
        names = setup_fsdp2_flow(recipe, script_argv) if recipe else []
        sys.argv = [script] + script_argv
        sys.path.insert(0, os.path.dirname(script))
        if _is_rank0() and names:
            print(f"[mindspeed_flow_patches] applied {len(names)} FSDP2 flow patches", flush=True)
        runpy.run_path(script, run_name="__main__")
        return 0
    transformers = is_transformers_entry(script)
    if recipe and transformers:
        setup_transformers_flow(recipe, script_argv)
    elif recipe:
        setup_flow(recipe, script, script_argv)
    sys.argv = [script] + script_argv  # step 1
    sys.path.insert(0, os.path.dirname(script))
    if transformers:
        read_yaml_arguments(script)
    flow_modules = (TRANSFORMERS_FLOW_MODULES if transformers else FLOW_MODULES) if recipe else ()
    names = apply_flow_patches(flow_modules)
    if _is_rank0():
        print(f"[mindspeed_flow_patches] applied: {', '.join(names)}", flush=True)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
