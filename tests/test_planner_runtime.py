"""A plan for the CPU-sized cluster, written as a recipe by `mindspeed-flow plan --out`, trains unchanged
through `mindspeed-flow train` (subprocess, as a user runs it), and the run records the planned layout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mindspeed_flow.planner.validate import runtime_available

ROOT = Path(__file__).parents[1]
CLI = [sys.executable, "-m", "mindspeed_flow.cli"]


def _plan_recipe(tmp_path: Path, name: str, *argv: str) -> tuple[dict, Path]:
    """`mindspeed-flow plan ... --job torch --out` into a copy of recipes/: (its --json output, the recipes dir)."""
    recipes = tmp_path / "recipes"
    if not recipes.exists():
        shutil.copytree(ROOT / "recipes", recipes)
    out = recipes / "experiment" / f"{name}.yaml"
    plan = subprocess.run(CLI + ["plan", "cluster=cpu", *argv, "--job", "torch", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    return json.loads(plan.stdout), recipes


def _train(recipes: Path, name: str, run_dir: Path, steps: int) -> list[dict]:
    """`mindspeed-flow train experiment=NAME` from those recipes; its metrics, one dict per step."""
    train = subprocess.run(CLI + ["train", f"experiment={name}", f"trainer.steps={steps}", f"run_dir={run_dir}",
                                  "trainer.progress=false"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT,
                           env={**os.environ, "MSF_RECIPES": str(recipes)})
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(metrics) == steps and all(m["step_seconds"] > 0 for m in metrics)
    return metrics


@pytest.mark.skipif(not runtime_available(), reason="mindspeed_flow/runtime/launch.py is not there yet")
def test_cpu_plan_recipe_trains(tmp_path) -> None:
    # the decoupled plan itself (--no-baselines: a faster baseline would otherwise be the recipe)
    obj, recipes = _plan_recipe(tmp_path, "planned", "model=tiny_qwen2_vl", "data=infovqa_tiny", "global_batch=6",
                                "samples=256", "--no-baselines")
    planned = {p["name"]: p for p in obj["parts"]}
    run_dir = tmp_path / "run"
    _train(recipes, "planned", run_dir, 1)
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    for name in ("encoder", "backbone"):
        for dim in ("dp", "tp", "pp", "cp"):
            assert ran["parallel"][name][dim] == planned[name][dim], (name, dim)
    assert ran["trainer"]["global_batch_size"] == 6


def test_cpu_recommended_recipe_trains(tmp_path) -> None:
    """Whatever `plan --job torch` recommends (the decoupled plan or a faster baseline's layout), the recipe it
    writes trains on the torch host."""
    _, recipes = _plan_recipe(tmp_path, "recommended", "model=tiny_qwen2_vl", "data=infovqa_tiny", "global_batch=6",
                              "samples=256")
    _train(recipes, "recommended", tmp_path / "run", 1)


@pytest.mark.parametrize("which", ["decoupled", "recommended"])
def test_cpu_omni_plan_recipe_trains(tmp_path, which: str) -> None:
    """The Qwen2.5-Omni thinker planned for the torch host from its audio + image data recipe: the decoupled plan
    (three parts, one recompute level for both encoders) and the recommended layout (here the coupled one, DP
    only) both train as written."""
    obj, recipes = _plan_recipe(tmp_path, "omni_planned", "model=tiny_qwen2_5_omni", "data=omni_tiny", "devices=3",
                                "global_batch=6", "samples=64", *(["--no-baselines"] if which == "decoupled" else []))
    recipe = yaml.safe_load((recipes / "experiment" / "omni_planned.yaml").read_text())
    if which == "decoupled":
        parts = {p["name"]: p for p in obj["parts"]}
        assert set(parts) == {"encoder", "audio", "backbone"}
        assert parts["encoder"]["recompute_level"] == parts["audio"]["recompute_level"]
        assert set(recipe["parallel"]["encoders"]) == {"vision", "audio"}
    else:
        assert obj["recommended"]["name"] != "decoupled" and recipe["flow"]["mode"] == "coupled"
    run_dir = tmp_path / "run"
    _train(recipes, "omni_planned", run_dir, 2)
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert ran["parallel"]["world_size"] == 3 and ran["trainer"]["global_batch_size"] == 6
