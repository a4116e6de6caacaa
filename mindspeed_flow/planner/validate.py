"""Predicted vs measured step time: plan a layout, train it with `mindspeed-flow train`, compare.

    python -m mindspeed_flow.planner.validate [--profile runs/profile/profile.json] [--steps 6]
        [--layouts e1-b2,e1-b1p2,e2-b1,e1-b1] [--global-batch 12] [--model tiny_qwen2_vl] [--data infovqa_tiny]
        [--calibrate-first] [--out runs/validate/table.json] [--timelines runs/validate/]

A layout `eA-bBpP@T` is encoder dp=A, backbone dp=B, pp=P, token budget T (optional; tp = cp = 1: what the
CPU runtime runs). For each:
the planner prices exactly that layout (pinned, devices = its world size, calibrated by the profile table),
writes it as an experiment recipe into a private copy of the recipe tree ($MSF_RECIPES), and the runtime
trains it for --steps steps in a subprocess; measured = the fastest `step_seconds` of metrics.jsonl after the
first (warm-up) step. With --calibrate-first the first layout's residual becomes the planner's fixed per-step
overhead (`planner.step_overhead_s`) and the others are predicted with it (calibrate on one, validate on the
rest). The runtime is not imported: everything goes through the command line, as a user would run it.
Beside the analytic prediction, the step simulator (`simulate.py`) replays the measured step (the same batch and
step plan, read back from the run's config) on the core share the ranks got, and its error is printed too.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mindspeed_flow.config import load as config_load
from mindspeed_flow.planner.hardware import recipes_dir
from mindspeed_flow.planner.measure import core_share
from mindspeed_flow.planner.inputs import build_problem, data_recipe_fields, parse_kv
from mindspeed_flow.planner.plan import make_plan
from mindspeed_flow.planner.report import recipe_yaml
from mindspeed_flow.planner.simulate import simulate_job, write_timeline

_LAYOUT = re.compile(r"^e(\d+)-b(\d+)(?:p(\d+))?(?:@(\d+))?$")


def runtime_available() -> bool:
    return (Path(__file__).resolve().parents[1] / "runtime" / "launch.py").exists()


def parse_layout(text: str) -> dict[str, int]:
    m = _LAYOUT.match(text)
    if not m:
        raise ValueError(f"layout {text!r}: expected eA-bB[pP][@T] (encoder dp A, backbone dp B, pp P, "
                         "token budget T)")
    return {"enc_dp": int(m.group(1)), "bb_dp": int(m.group(2)), "bb_pp": int(m.group(3) or 1),
            "budget": int(m.group(4) or 0)}


def plan_layout(layout: dict[str, int], model: str, data: str, global_batch: int, profile: str | None,
                step_overhead_s: float = 0.0, token_budget: int | None = None):
    """The planner's prediction for exactly this layout (and the objects needed to write its recipe)."""
    world = layout["enc_dp"] + layout["bb_dp"] * layout["bb_pp"]
    kv = [f"model={model}", f"data={data}", "cluster=cpu", f"devices={world}", f"global_batch={global_batch}",
          f"encoder.dp={layout['enc_dp']}", f"backbone.dp={layout['bb_dp']}", f"backbone.pp={layout['bb_pp']}",
          "backbone.rc=0", "encoder.rc=0", f"planner.step_overhead_s={step_overhead_s}", "samples=512"]
    budget = layout.get("budget") or token_budget
    if budget:
        kv.append(f"backbone.b={budget}")
    if profile:
        kv.append(f"planner.profile={profile}")
    problem, ref = build_problem(parse_kv(kv))
    return make_plan(problem, with_baselines=False), ref


def run_training(recipes: Path, name: str, steps: int, run_dir: Path, timeout_s: float = 600) -> list[dict]:
    env = dict(os.environ, MSF_RECIPES=str(recipes))
    cmd = [sys.executable, "-m", "mindspeed_flow.cli", "train", f"experiment={name}", f"trainer.steps={steps}",
           f"run_dir={run_dir}", "trainer.progress=false"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def measured_step_seconds(metrics: list[dict]) -> float:
    """The fastest step after the first (warm-up): on a shared machine the least disturbed by other jobs, and
    comparable with the profile, which also keeps the fastest of its repeats."""
    return float(metrics[measured_step_index(metrics)]["step_seconds"])


def measured_step_index(metrics: list[dict]) -> int:
    """Index of the step `measured_step_seconds` takes (the simulator replays that step)."""
    first = 1 if len(metrics) > 1 else 0
    return min(range(first, len(metrics)), key=lambda i: metrics[i]["step_seconds"])


def compare(layouts: list[str], model: str, data: str, global_batch: int, steps: int, profile: str | None,
            calibrate_first: bool, workdir: Path, token_budget: int | None = None,
            timeline_dir: str | None = None) -> list[dict[str, Any]]:
    """Plan, train and compare each layout; see the module docstring. Each row also records the core share
    `world` concurrent busy processes got around the run (`measure.core_share`): how loaded the machine was."""
    recipes = workdir / "recipes"
    if not recipes.exists():
        shutil.copytree(recipes_dir(), recipes)
    rows: list[dict[str, Any]] = []
    overhead = sim_overhead = 0.0
    # One fresh folder of runs per invocation: a reused --workdir keeps earlier runs (run directories are never
    # overwritten) and this invocation's runs sit beside them.
    runs = workdir / "runs" / time.strftime("%Y%m%d-%H%M%S")
    for k, text in enumerate(layouts):
        layout = parse_layout(text)
        plan, ref = plan_layout(layout, model, data, global_batch, profile, overhead, token_budget)
        name = "validate_" + re.sub(r"[^A-Za-z0-9]", "_", text)
        data_recipe, data_inline = data_recipe_fields(data)
        (recipes / "experiment" / f"{name}.yaml").write_text(
            recipe_yaml(plan, name, ref.recipe, data_recipe, ref.inline, data_inline))
        share = core_share(plan.devices)
        try:
            metrics = run_training(recipes, name, steps, runs / name)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one broken layout must not hide the others
            print(f"validate: layout {text} did not train: {str(e)[-400:]}", file=sys.stderr)
            continue
        share = (share + core_share(plan.devices)) / 2
        measured = measured_step_seconds(metrics)
        step = measured_step_index(metrics)
        # the simulator replays that very step (same batch, same step plan)
        job = config_load.load(runs / name / "config.yaml")
        # the fastest step is the one the other jobs on the machine disturbed least: the host's own cores
        simulated = simulate_job(job, plan.problem.ctx, [step], cores=min(plan.devices, os.cpu_count() or 1),
                                 step_overhead_s=sim_overhead)[step]
        row = {"layout": text, "world": plan.devices, "token_budget": plan.parts[-1].layout["b"],
               "predicted_s": plan.step_seconds, "measured_s": measured, "error": plan.step_seconds / measured - 1,
               "simulated_s": simulated.step_seconds, "sim_error": simulated.step_seconds / measured - 1,
               "sim_bubble_fraction": simulated.bubble_fraction, "step": step,
               "core_share": share, "calibration": k == 0 and calibrate_first}
        if k == 0 and calibrate_first:  # the residual per step, in seconds of an unshared core
            overhead = max(0.0, measured - plan.step_seconds)
            sim_overhead = max(0.0, measured - simulated.step_seconds)
            row["step_overhead_s"] = overhead
            row["sim_step_overhead_s"] = sim_overhead
        if timeline_dir is not None:
            write_timeline(simulated, str(Path(timeline_dir) / f"{name}.png"),
                           f"{text}: simulated {simulated.step_seconds:.3g} s, measured {measured:.3g} s (step {step})")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mindspeed_flow.planner.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="e1-b2,e1-b1p2,e2-b1,e1-b1")
    ap.add_argument("--model", default="tiny_qwen2_vl")
    ap.add_argument("--data", default="infovqa_tiny")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--token-budget", type=int, default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--calibrate-first", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timelines", default=None, help="folder for the simulated step timelines (PNG)")
    args = ap.parse_args(argv)
    if not runtime_available():
        print("validate: mindspeed_flow/runtime/launch.py is not there yet; nothing to compare with", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="msf-validate-"))
    rows = compare(args.layouts.split(","), args.model, args.data, args.global_batch, args.steps, args.profile,
                   args.calibrate_first, workdir, args.token_budget, args.timelines)
    print(f"predicted vs measured step time ({args.model}, {args.data}, global batch {args.global_batch}, "
          f"fastest of steps 1..{args.steps - 1}; load average {os.getloadavg()[0]:.1f})")
    for r in rows:
        tag = ("  (calibration: step_overhead_s = %.3f analytic, %.3f simulated)"
               % (r["step_overhead_s"], r["sim_step_overhead_s"]) if r["calibration"] else "")
        print(f"  {r['layout']:<11} world {r['world']} budget {r['token_budget']:>5}: measured {r['measured_s']:.3f} s; "
              f"simulated {r['simulated_s']:.3f} s ({100 * r['sim_error']:+.1f}%), "
              f"analytic {r['predicted_s']:.3f} s ({100 * r['error']:+.1f}%) (core share {r['core_share']:.2f}){tag}")
    checked = [r for r in rows if not r["calibration"]]
    if checked:
        sim = sum(abs(r["sim_error"]) for r in checked) / len(checked)
        ana = sum(abs(r["error"]) for r in checked) / len(checked)
        print(f"mean |error| over the {len(checked)} validated layouts: simulator {100 * sim:.1f}%, "
              f"analytic model {100 * ana:.1f}%")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
