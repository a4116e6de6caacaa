"""`mindspeed-flow bench memory`: the planner's memory model against each host's tiny job, peak per part.

    mindspeed-flow bench memory [--host torch|mm|both] [--steps 3] [--workdir DIR] [--json]

Per part (rank) it prints the peak the planner's model predicts (the same functions `plan` prices layouts with,
evaluated on the shapes the job ran; `planner/memory.py`) beside the peak the job measured, and the predicted
terms:

- torch: `mindspeed-flow train` (the default recipe: tiny Qwen2-VL, fp32, encoder 1 + backbone DP 2 with DDP) with
  MSF_MEMORY_TRACK=1: each rank's peak of live tensor bytes (`telemetry.tensor_bytes.LiveTensorBytes`);
- mm: MindSpeed-MM's `pretrain_vlm.py` under the emulated NPU as a flow job (`MM_ENC` + `MM_DEC`: encoder 1,
  decoder PP 2 split [1, 2]) on MindSpeed-MM's Qwen2.5-VL 72B example config scaled down, its ViT trainable,
  bf16 with the distributed optimizer, run with MSF_FLOW_MEMORY=1: each rank's npu allocator peak (the
  emulator's exit summary). Needs the emulation environment and the pinned sources (MINDSPEED_MM_HOME etc.).
The goal is every part within `planner.memory.TOLERANCE` (15%).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from mindspeed_flow.bench import bench_main
from mindspeed_flow.hosts.mindspeed_mm.memory import MEMORY_ENV
from mindspeed_flow.planner import memory

# The MindSpeed-MM job: encoder 1 + decoder PP 2 ([1, 2] of the scaled model's 3 layers), the encoder's bound at
# its default (decoder pp + 1), 8 samples a step packed into 256-token microbatches.
MM_ENC = {"dp": 1, "tp": 1}
MM_DEC = {"dp": 1, "tp": 1, "pp": 2, "layer_split": [1, 2]}
MM_GLOBAL_BATCH = 8
MM_BOUND = MM_DEC["pp"] + 1


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench memory", description=__doc__.split("\n")[0])
    p.add_argument("--host", choices=("torch", "mm", "both"), default="both")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workdir", default=None, help="run folders and the tiny MindSpeed-MM assets (default: temp)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(list(argv))


def mm_job(workdir: Path, mindspeed_mm_root: Path, steps: int) -> dict[str, Any]:
    """The MindSpeed-MM job's files and command line: {"argv", "recipe", "model_json", "nproc"}."""
    from mindspeed_flow.emulation import tiny  # lazy: emulation
    from mindspeed_flow.emulation.jobs import TinyJob  # lazy: emulation
    from mindspeed_flow.emulation.scaled import scaled_model_json, write_user_like_data_json  # lazy: emulation

    tiny.prepare_workdir(workdir)
    data = write_user_like_data_json(workdir)
    model = scaled_model_json(mindspeed_mm_root, "72b", workdir, **{"image_encoder.vision_encoder.freeze": False})
    recipe = workdir / "memory.yaml"
    recipe.write_text("# mindspeed-flow bench memory\nparallel:\n"
                      f"  encoder: {{dp: {MM_ENC['dp']}, tp: {MM_ENC['tp']}, pp: 1, cp: 1}}\n"
                      f"  backbone: {{dp: {MM_DEC['dp']}, tp: {MM_DEC['tp']}, pp: {MM_DEC['pp']}, cp: 1, "
                      f"layer_split: {MM_DEC['layer_split']}}}\n"
                      "packing:\n  token_budget: 256\n  layout: auto\n")
    argv = TinyJob(model, data, train_iters=steps, global_batch_size=MM_GLOBAL_BATCH, seq_length=256,
                   extra=["--variable-seq-lengths", "--calculate-per-token-loss",
                          "--use-distributed-optimizer"]).argv()
    nproc = MM_ENC["dp"] * MM_ENC["tp"] + MM_DEC["dp"] * MM_DEC["tp"] * MM_DEC["pp"]
    return {"argv": argv, "recipe": recipe, "model_json": model, "nproc": nproc}


def compare_mm_output(output: str, model_json: Path) -> list[memory.PartMemory]:
    return memory.compare_mm(output, model_json, MM_ENC["dp"], MM_DEC["dp"], MM_DEC["layer_split"], MM_BOUND,
                             MM_GLOBAL_BATCH)


def run_torch(run_dir: Path, steps: int) -> tuple[str, list[memory.PartMemory]]:
    """`mindspeed-flow train` (default recipe) with live-tensor counting; its output and the comparison."""
    env = dict(os.environ, MSF_MEMORY_TRACK="1")
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "train", f"run_dir={run_dir}",
                           "trainer.progress=false", f"trainer.steps={steps}"],
                          capture_output=True, text=True, env=env, timeout=900)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"bench memory: mindspeed-flow train failed (rc={proc.returncode}):\n{output[-3000:]}")
    return output, memory.compare_torch(output, run_dir)


def run_mm(workdir: Path, steps: int) -> tuple[str, list[memory.PartMemory]]:
    from mindspeed_flow.emulation.jobs import emulate_job  # lazy: emulation
    from mindspeed_flow.emulation.sources import find_sources  # lazy: emulation

    job = mm_job(workdir, find_sources().mindspeed_mm.root, steps)
    os.environ[MEMORY_ENV] = "1"  # the job's ranks inherit it
    result = emulate_job("memory", job["argv"], log_dir=workdir, nproc=job["nproc"], flow_recipe=job["recipe"])
    if result.rc != 0:
        raise SystemExit(f"bench memory: the MindSpeed-MM job failed (rc={result.rc}):\n{result.output[-3000:]}")
    return result.output, compare_mm_output(result.output, job["model_json"])


def measure(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="msf-bench-memory-")).resolve()
    report: dict[str, Any] = {}
    if args.host in ("torch", "both"):
        _, rows = run_torch(workdir / "torch_run", args.steps)
        report["torch"] = memory.as_json(rows)
    if args.host in ("mm", "both"):
        mm_dir = workdir / "mm"
        mm_dir.mkdir(parents=True, exist_ok=True)
        _, rows = run_mm(mm_dir, args.steps)
        report["mm"] = memory.as_json(rows)
    return report


def _rows(items: list[dict]) -> list[memory.PartMemory]:
    return [memory.PartMemory(r["rank"], r["part"], r["measured"], r["terms"]) for r in items]


def table(report: dict, args: argparse.Namespace) -> str:
    titles = {"torch": "torch host (mindspeed-flow train, default recipe, fp32): peak live tensor bytes per rank",
              "mm": "MindSpeed-MM flow job (emulated NPU, bf16, distributed optimizer): npu peak per rank"}
    return "\n\n".join(memory.table(titles[k], _rows(v)) for k, v in report.items())


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(argv, parse_args, measure, table)
