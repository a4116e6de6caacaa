"""`mindspeed-flow launch-script RECIPE.yaml`: the Ascend cluster launch script of a plan.

    mindspeed-flow launch-script RECIPE.yaml [--cluster a2|a3] [--job mm|train] [--npus-per-node N] [--out FILE]
    mindspeed-flow plan ... --out RECIPE.yaml --launch-script FILE [--cluster a2|a3] [--job mm|train]
    mindspeed-flow launch-script RECIPE.yaml --from YOUR_SCRIPT.sh [--npus-per-node N | --cluster a2|a3]
        [--mm-root MINDSPEED_MM] [--out FILE]

The script is `scripts/ascend/train_a2.sh` (Atlas 800T A2: 8 NPUs per node) or `train_a3.sh` (Atlas 900 A3
SuperPoD: 16 devices per node, one per die) with its plan block filled in from the recipe (nodes, the parts in
rank order, the global batch, the recipe) and the shared body inlined, so the one file can be copied to every node.
`--job mm` (default) launches the flow-patched MindSpeed-MM `pretrain_vlm.py` with the recipe as its flow recipe;
A coupled recipe (`flow.mode: coupled`, the layout in `parallel.coupled`: what `plan` writes when a coupled
baseline beats the decoupled plan) launches the unpatched MindSpeed-MM job with `--job mm`.
`--job train` launches `mindspeed-flow train experiment=NAME` (the recipe must sit in recipes/experiment/). The
recipe is checked first against what the chosen job supports, so a plan the job would refuse at start-up is refused
here, with the field. Run the script with `--dry-run` to see every node's command.

`--from YOUR_SCRIPT.sh` writes instead the flow twin of the MindSpeed-MM launch script you run today: your flags,
model, data and paths kept, only the lines the plan needs changed (see `mindspeed_flow.runtime.flow_twin`). Its
entry may be any the flow job runs (`pretrain_vlm.py`, `pretrain_transformers.py`, `mindspeed_mm/fsdp/train/
trainer.py`). The twin's command is then checked as the launcher will check it at start-up, against the job's own
model / data / CONFIG files read from the MindSpeed-MM folder it runs in (`--mm-root`, else $MINDSPEED_MM_HOME, else
the folder above the script that holds pretrain_vlm.py, else the current one): a job the flow launcher would refuse
is refused here, with its one-line reason, before anything reaches the cluster.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from mindspeed_flow.config.load import RecipeError, check_rules, compose, recipes_dir, to_job_config
from mindspeed_flow.hosts.mindspeed_mm.recipe import SUPPORTED_SCRIPTS, FlowRecipeError, _unsupported, load_flow_job
from mindspeed_flow.resources import data_path
from mindspeed_flow.runtime.flow_twin import RecipeLaunch, Twin, TwinError, entry_of, job_command, make_twin
from mindspeed_flow.runtime.shell_words import UNKNOWN
from mindspeed_flow.step.layout import Layout, LayoutError
from mindspeed_flow.utils import working_dir

SCRIPTS_DIR = data_path("scripts/ascend")
# script, devices per node the runtime sees (A3: each 910C package is two devices, one per die; MindSpeed-MM's
# examples/qwen2.5vl/finetune_qwen2_5_vl_72b.sh sets NPUS_PER_NODE=16 on A3)
CLUSTERS: dict[str, tuple[str, int]] = {"a2": ("train_a2.sh", 8), "a3": ("train_a3.sh", 16)}
# cluster presets (recipes/cluster/) -> script
PRESET_CLUSTERS: dict[str, str] = {"atlas_800t_a2": "a2", "atlas_900_a3_384": "a3"}
_PLAN_BLOCK = re.compile(r"^# >>> plan.*?^# <<< plan\n", re.S | re.M)
_LIB_LINES = re.compile(r"^# @lib\n(?:#.*\n)*source .*lib\.sh.*\n", re.M)
_HEADER = re.compile(r"\A#!.*\n(?:#.*\n)+")


class LaunchScriptError(ValueError):
    """The recipe cannot be launched as asked (names the field and the rule)."""


@dataclass(frozen=True)
class ScriptPlan:
    cluster: str  # a2 | a3
    job: str  # mm | train
    recipe: Path
    nnodes: int
    npus_per_node: int
    parts: tuple[tuple[str, int, int, int, int], ...]  # (name, dp, tp, pp, cp) in rank order
    global_batch: int
    experiment: str
    notes: tuple[str, ...] = ()
    mm_configs: tuple[str, str] | None = None  # (MM_MODEL, MM_DATA) for the recipe's model (mm)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.npus_per_node

    def parts_spec(self) -> str:
        return " ".join(f"{n}:{dp}x{tp}x{pp}x{cp}" for n, dp, tp, pp, cp in self.parts)


def _preset_of(raw: object, group: str = "cluster") -> str | None:
    """The preset a recipe's Hydra defaults list picks for `group` (`- override /cluster: NAME`)."""
    container = OmegaConf.to_container(raw)  # type: ignore[arg-type]
    for entry in (container.get("defaults") if isinstance(container, dict) else None) or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                if key.split()[-1].strip("/") == group:
                    return str(value)
    return None


def mm_configs(model_preset: str | None) -> tuple[str, str] | None:
    """MindSpeed-MM's example model.json and data.json (relative to its root) for a planner model preset."""
    m = re.fullmatch(r"qwen2_5_vl_(\d+b)", model_preset or "")
    if not m:
        return None
    return f"./examples/qwen2.5vl/model_{m.group(1)}.json", f"./examples/qwen2.5vl/data_{m.group(1)}.json"


def plan_from_recipe(recipe: str | Path, cluster: str | None = None, job: str = "mm",
                     npus_per_node: int | None = None) -> ScriptPlan:
    path = Path(recipe).expanduser().resolve()
    if job not in ("mm", "train"):
        raise LaunchScriptError(f"--job {job!r}: must be mm (flow-patched MindSpeed-MM) or train (mindspeed-flow)")
    if job == "train":
        # what `train experiment=NAME` composes (its defaults list may choose the parallel group, the cluster...)
        if path.parent != recipes_dir() / "experiment":
            raise LaunchScriptError(f"--job train runs `mindspeed-flow train experiment=NAME`: put the recipe in "
                                    f"{recipes_dir() / 'experiment'} (plan --out there), not {path.parent}")
        cfg = to_job_config(compose([f"experiment={path.stem}"]))
        try:
            check_rules(cfg)  # the torch host's own cross-field rules, as `train` checks them
        except RecipeError as err:
            raise LaunchScriptError(f"{path.name} cannot run as a mindspeed-flow train job: {err}") from None
        preset = cfg.cluster.name
    else:
        cfg, preset = _mm_recipe(path)
    cluster = cluster or PRESET_CLUSTERS.get(preset or "")
    if cluster not in CLUSTERS:
        raise LaunchScriptError(f"{path.name}: cluster preset {preset!r} is not an Ascend cluster this command knows "
                                f"({', '.join(PRESET_CLUSTERS)}); pass --cluster a2 or --cluster a3")
    layout = _checked_layout(path, cfg, job)
    experiment = path.stem
    per_node = npus_per_node or CLUSTERS[cluster][1]
    world = layout.world_size
    if world <= per_node:
        nnodes, per_node = 1, world
    elif world % per_node:
        raise LaunchScriptError(f"{path.name}: the plan's {world} ranks do not fill nodes of {per_node} devices "
                                f"({cluster.upper()}); plan with devices= a multiple of {per_node}")
    else:
        nnodes = world // per_node
    parts = tuple((p.name, p.dp, p.tp, p.pp, p.cp) for p in layout.parts)
    notes = []
    preset_per_node = _preset_devices_per_node(preset)
    if preset_per_node and preset_per_node != per_node:
        # e.g. atlas_900_a3_384 prices 910C packages (8 per node, 128 GB each) while the A3 runtime gives one rank per
        # die (16 per node, 64 GB each): the plan's memory and FLOPs per rank are then twice what a rank has.
        notes.append(f"the plan's cluster preset {preset!r} counts {preset_per_node} devices per node, the script "
                     f"launches {per_node} ranks per node: each plan device becomes one rank, which has "
                     f"{preset_per_node}/{per_node} of the memory and FLOPs the plan assumed per device; re-plan with "
                     f"a per-die preset before trusting its memory fit")
    configs = None
    if job == "mm":
        model = _preset_of(OmegaConf.load(str(path)), "model")
        configs = mm_configs(model)
        if configs is None:
            notes.append(f"the recipe's model ({model or 'none named'}) has no MindSpeed-MM example config this "
                         "command knows: launch with MM_MODEL and MM_DATA set")
    return ScriptPlan(cluster, job, path, nnodes, per_node, parts, cfg.trainer.global_batch_size, experiment,
                      tuple(notes), configs)


def _mm_recipe(path: Path):
    """(the flow job config, its cluster preset or None) of a MindSpeed-MM flow recipe."""
    try:
        cfg = load_flow_job(path)
    except FlowRecipeError as err:
        raise LaunchScriptError(str(err)) from None
    return cfg, _preset_of(OmegaConf.load(str(path)))


def _checked_layout(path: Path, cfg, job: str, global_batch: int | None = -1):
    """The recipe's layout, checked as the launcher checks it before any rank starts (and, for mm, what the
    MindSpeed-MM flow host on `pretrain_vlm.py` supports; `fsdp2`: an FSDP2 entry, whose own check decides the rest)."""
    if job == "mm" and cfg.flow.mode == "coupled":
        # the unpatched MindSpeed-MM job: Megatron's own TP / CP / PP over every rank (no flow launcher)
        try:
            layout = Layout.from_config(cfg.parallel, "coupled")
        except LayoutError as err:
            raise LaunchScriptError(f"{path.name}: {err}") from None
        batch = cfg.trainer.global_batch_size if global_batch == -1 else global_batch
        dp = layout.parts[0].dp
        if batch is not None and batch % dp:
            raise LaunchScriptError(f"{path.name}: trainer.global_batch_size={batch} is not divisible by the coupled "
                                    f"job's data-parallel size {dp}")
        return layout
    try:
        layout = Layout.from_config(cfg.parallel, cfg.flow.mode)
        layout.validate(expected_world=cfg.parallel.world_size,
                        global_batch_size=cfg.trainer.global_batch_size if global_batch == -1 else global_batch)
    except LayoutError as err:
        raise LaunchScriptError(f"{path.name}: {err}") from None
    if job == "mm":
        problems = _unsupported(cfg)
        if problems:
            raise LaunchScriptError(f"{path.name} cannot run as a MindSpeed-MM flow job: " + "; ".join(problems))
    return layout


@dataclass
class CheckedTwin:
    """A flow twin and what checking its command against the job found."""
    twin: Twin
    mm_root: Path | None  # where the job's files were read (None: not found, not checked)
    notes: list[str] = field(default_factory=list)


def mm_root_of(user_script: Path, given: str | Path | None = None) -> Path | None:
    """The MindSpeed-MM folder the script runs in: `given`, else $MINDSPEED_MM_HOME, else the nearest folder above
    the script holding pretrain_vlm.py, else the current folder when it holds it."""
    if given is not None:
        root = Path(given).expanduser().resolve()
        if not (root / "pretrain_vlm.py").is_file():
            raise LaunchScriptError(f"--mm-root {given}: no pretrain_vlm.py there (give MindSpeed-MM's own folder)")
        return root
    candidates = [Path(os.environ["MINDSPEED_MM_HOME"])] if os.environ.get("MINDSPEED_MM_HOME") else []
    candidates += list(user_script.resolve().parents) + [Path.cwd()]
    return next((c.resolve() for c in candidates if (c / "pretrain_vlm.py").is_file()), None)


def check_twin_job(recipe: Path, twin: Twin, name: str, mm_root: Path | None) -> list[str]:
    """Check the twin's own command as the flow launcher checks it at start-up; returns notes on what could not be
    checked (raises LaunchScriptError with the launcher's one-line reason)."""
    from mindspeed_flow.hosts.mindspeed_mm.entries import check_flow_entry  # lazy: may import torch

    if mm_root is None:
        return [f"{name}: the job's own files were not checked (no MindSpeed-MM folder found: pass --mm-root); the "
                "flow launcher checks them at start-up"]
    # node 0's command, with the caller's environment (the variables the script reads from it) under the launch
    # variables the twin sets
    entry, args = job_command(twin.text, name, {**os.environ, **twin.node_env()})
    unknown = [a for a in args if UNKNOWN in a]
    if unknown or UNKNOWN in entry:
        return [f"{name}: the job was not checked: {len(unknown) or 1} of its arguments come from a command the "
                "script runs; the flow launcher checks them at start-up"]
    try:
        with working_dir(mm_root):  # the job's ./examples/... paths
            check_flow_entry(recipe, str(mm_root / entry), args, twin.nnodes * twin.per_node)
    except FlowRecipeError as err:
        raise LaunchScriptError(f"{name} cannot run as a flow job (read in {mm_root}): {err}") from None
    return []


def twin_of_script(recipe: str | Path, user_script: str | Path, cluster: str | None = None,
                   npus_per_node: int | None = None, mm_root: str | Path | None = None) -> CheckedTwin:
    """The flow twin of the user's MindSpeed-MM launch script for a flow recipe, its command checked against the
    job's own files (`mm_root_of`)."""
    path = Path(recipe).expanduser().resolve()
    user = Path(user_script)
    text = user.read_text()
    root = mm_root_of(user, mm_root)
    cfg, preset = _mm_recipe(path)
    raw = OmegaConf.load(str(path))
    stated_batch = OmegaConf.select(raw, "trainer.global_batch_size")
    try:
        megatron_entry = Path(entry_of(text, user.name)).name in SUPPORTED_SCRIPTS
    except TwinError as err:
        raise LaunchScriptError(str(err)) from None
    if cfg.flow.mode != "decoupled":
        raise LaunchScriptError(f"{path.name}: flow.mode={cfg.flow.mode!r}: a coupled plan is the unpatched job "
                                "itself; run your script as it is (its twin launches decoupled parts)")
    # a batch the recipe does not state is the user's script's, checked against the parts by the twin; the
    # Megatron flow host's own rules apply to its entry only (an FSDP2 entry's check is its own)
    layout = _checked_layout(path, cfg, "mm" if megatron_entry else "fsdp2",
                             None if stated_batch is None else int(stated_batch))
    per_node = npus_per_node or (CLUSTERS[cluster][1] if cluster else None) or \
        (CLUSTERS[PRESET_CLUSTERS[preset]][1] if preset in PRESET_CLUSTERS else None)
    stated_run_dir = OmegaConf.select(raw, "run_dir")
    plan = RecipeLaunch(path, tuple((p.name, p.dp, p.tp, p.pp, p.cp) for p in layout.parts),
                        None if stated_batch is None else int(stated_batch),
                        None if stated_run_dir is None else str(stated_run_dir), per_node)
    try:
        twin = make_twin(text, user.name, plan)
    except TwinError as err:
        raise LaunchScriptError(str(err)) from None
    return CheckedTwin(twin, root, check_twin_job(path, twin, user.name, root))


def _preset_devices_per_node(preset: str | None) -> int | None:
    path = recipes_dir() / "cluster" / f"{preset}.yaml"
    if not preset or not path.is_file():
        return None
    value = OmegaConf.load(str(path)).get("devices_per_node")
    return int(value) if value else None


def render(plan: ScriptPlan, scripts_dir: Path = SCRIPTS_DIR) -> str:
    """The template of the plan's cluster with its plan block filled in and lib.sh inlined."""
    template = (scripts_dir / CLUSTERS[plan.cluster][0]).read_text()
    lib = (scripts_dir / "lib.sh").read_text().split("\n", 1)[1]  # without its `# shellcheck shell=bash`
    q = shlex.quote
    desc = ", ".join(f"{n} dp{dp} tp{tp} pp{pp} cp{cp}" for n, dp, tp, pp, cp in plan.parts)
    block = "\n".join([
        f"# >>> plan: {plan.world_size} ranks = {desc} (from {plan.recipe.name}; each value can be overridden "
        "from the environment)",
        f"JOB=${{JOB:-{plan.job}}}",
        f"FLOW_RECIPE=${{FLOW_RECIPE:-{q(str(plan.recipe))}}}",
        f"EXPERIMENT=${{EXPERIMENT:-{q(plan.experiment)}}}",
        f"NNODES=${{NNODES:-{plan.nnodes}}}",
        f"NPUS_PER_NODE={plan.npus_per_node}",
        f"PARTS=${{PARTS:-{q(plan.parts_spec())}}}",
        f"GLOBAL_BATCH=${{GLOBAL_BATCH:-{plan.global_batch}}}",
        *([f"MM_MODEL=${{MM_MODEL:-{plan.mm_configs[0]}}}", f"MM_DATA=${{MM_DATA:-{plan.mm_configs[1]}}}"]
          if plan.mm_configs else []),
        "# <<< plan", ""])
    header = (f"#!/usr/bin/env bash\n# NODE_RANK=<i> MASTER_ADDR=<node-0 ip> bash THIS_SCRIPT [--dry-run]   (on each of "
              f"the {plan.nnodes} nodes; or HOSTFILE=...)\n# Written by `mindspeed-flow launch-script {plan.recipe.name} "
              f"--cluster {plan.cluster} --job {plan.job}` from {plan.recipe}.\n")
    text = _HEADER.sub(lambda _: header, template, count=1)
    text = _PLAN_BLOCK.sub(lambda _: block, text, count=1)
    text = _LIB_LINES.sub(lambda _: "# --- shared body (scripts/ascend/lib.sh) ---\n" + lib + "# ---\n", text, count=1)
    return text


def write_script(plan: ScriptPlan, out: str | Path, force: bool = False) -> Path:
    out = Path(out)
    if out.exists() and not force:
        raise LaunchScriptError(f"{out} already exists: not overwriting it (pass --force, or another --out)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(plan))
    out.chmod(out.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", choices=sorted(CLUSTERS), default=None,
                   help="a2 (Atlas 800T A2) or a3 (Atlas 900 A3 SuperPoD); default: from the recipe's cluster preset")
    p.add_argument("--job", choices=("mm", "train"), default="mm",
                   help="mm: flow-patched MindSpeed-MM pretrain_vlm.py (default); train: mindspeed-flow train")
    p.add_argument("--npus-per-node", type=int, default=None, help="devices per node (default: 8 on A2, 16 on A3)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mindspeed-flow launch-script", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="a recipe written by `mindspeed-flow plan --out` (or any flow recipe)")
    p.add_argument("--out", default=None, help="write the script here (default: print it)")
    p.add_argument("--from", dest="user_script", default=None, metavar="USER_SCRIPT.sh",
                   help="write the flow twin of this MindSpeed-MM launch script (the one you run today) instead of "
                        "a stock script: its flags, model, data and paths kept, the entry, launch size and parallel "
                        "sizes the recipe needs changed")
    p.add_argument("--mm-root", default=None, metavar="MINDSPEED_MM",
                   help="with --from: the MindSpeed-MM folder the script runs in, where the twin's command is checked "
                        "against the job's own files (default: $MINDSPEED_MM_HOME, else the folder above the script "
                        "holding pretrain_vlm.py, else the current one)")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.user_script:
        return _main_twin(args)
    try:
        plan = plan_from_recipe(args.recipe, args.cluster, args.job, args.npus_per_node)
        for note in plan.notes:
            print(f"mindspeed-flow launch-script: note: {note}", file=sys.stderr)
        if args.out:
            out = write_script(plan, args.out, args.force)
            print(f"{plan.cluster.upper()} launch script for {plan.nnodes} node(s) x {plan.npus_per_node} written to "
                  f"{out}; check it with: bash {out} --dry-run", file=sys.stderr)
        else:
            sys.stdout.write(render(plan))
    except (LaunchScriptError, OSError) as err:
        print(f"mindspeed-flow launch-script: {err}", file=sys.stderr)
        return 2
    return 0


def _main_twin(args: argparse.Namespace) -> int:
    try:
        if args.job != "mm":
            raise LaunchScriptError("--from writes the flow twin of a MindSpeed-MM script (--job mm)")
        checked = twin_of_script(args.recipe, args.user_script, args.cluster, args.npus_per_node, args.mm_root)
        twin = checked.twin
        for note in checked.notes:
            print(f"mindspeed-flow launch-script: note: {note}", file=sys.stderr)
        if not args.out:
            sys.stdout.write(twin.text)
            return 0
        out = Path(args.out)
        if out.exists() and not args.force:
            raise LaunchScriptError(f"{out} already exists: not overwriting it (pass --force, or another --out)")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(twin.text)
        out.chmod(out.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except (LaunchScriptError, OSError) as err:
        print(f"mindspeed-flow launch-script: {err}", file=sys.stderr)
        return 2
    changes = ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in twin.changed.items())
    print(f"flow twin of {args.user_script} written to {out}: {twin.nnodes} node(s) x {twin.per_node} ranks; changed: "
          f"{changes or 'nothing but the entry'}; see bash {out} --help", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
