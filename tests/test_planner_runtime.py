"""A plan for the CPU-sized cluster, written as a recipe by `mindspeed-flow plan --out`, trains unchanged
through `mindspeed-flow train` (subprocess, as a user runs it), and the run records the planned layout."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mindspeed_flow.planner.validate import runtime_available

ROOT = Path(__file__).parents[1]


@pytest.mark.skipif(not runtime_available(), reason="mindspeed_flow/runtime/launch.py is not there yet")
def test_cpu_plan_recipe_trains(tmp_path) -> None:
    recipes = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    out = recipes / "experiment" / "planned.yaml"
    env_py = [sys.executable, "-m", "mindspeed_flow.cli"]
    # the decoupled plan itself (--no-baselines: a faster baseline would otherwise be the recipe)
    plan = subprocess.run(env_py + ["plan", "cluster=cpu", "model=tiny_qwen2_vl", "data=infovqa_tiny",
                                    "global_batch=6", "samples=256", "--job", "torch", "--no-baselines",
                                    "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    planned = {p["name"]: p for p in json.loads(plan.stdout)["parts"]}
    run_dir = tmp_path / "run"
    train = subprocess.run(env_py + ["train", "experiment=planned", "trainer.steps=1", f"run_dir={run_dir}",
                                     "trainer.progress=false"],
                           capture_output=True, text=True, timeout=240, cwd=ROOT,
                           env={**__import__("os").environ, "MSF_RECIPES": str(recipes)})
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(metrics) == 1 and metrics[0]["step_seconds"] > 0
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    for name in ("encoder", "backbone"):
        for dim in ("dp", "tp", "pp", "cp"):
            assert ran["parallel"][name][dim] == planned[name][dim], (name, dim)
    assert ran["trainer"]["global_batch_size"] == 6


def test_cpu_recommended_recipe_trains(tmp_path) -> None:
    """Whatever `plan --job torch` recommends (the decoupled plan or a faster baseline's layout), the recipe it
    writes trains on the torch host."""
    recipes = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    out = recipes / "experiment" / "recommended.yaml"
    env_py = [sys.executable, "-m", "mindspeed_flow.cli"]
    plan = subprocess.run(env_py + ["plan", "cluster=cpu", "model=tiny_qwen2_vl", "data=infovqa_tiny",
                                    "global_batch=6", "samples=256", "--job", "torch", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    recommended = json.loads(plan.stdout)["recommended"]
    run_dir = tmp_path / "run"
    train = subprocess.run(env_py + ["train", "experiment=recommended", "trainer.steps=1", f"run_dir={run_dir}",
                                     "trainer.progress=false"],
                           capture_output=True, text=True, timeout=240, cwd=ROOT,
                           env={**__import__("os").environ, "MSF_RECIPES": str(recipes)})
    assert train.returncode == 0, (recommended, train.stderr[-3000:])
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
