"""`mindspeed-flow bench train`: the same recipe trained decoupled and coupled in one run, side by side.

Both modes use the same ranks, data, packing and seed; the table reports samples/s, step time, MFU, padding
and the loss reached, plus the decoupled/coupled ratio. CPU numbers on a shared 2-core machine are noisy:
compare ratios within one invocation, not absolute figures across machines.

    mindspeed-flow bench train [--steps 20] [--warmup 3] [--json] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def _summarize(lines: list[dict], warmup: int) -> dict:
    steady = lines[warmup:] or lines
    secs = [x["step_seconds"] for x in steady]
    samples = sum(x["samples"] for x in steady)
    return {
        "samples_per_s": samples / sum(secs),
        "median_step_s": statistics.median(secs),
        "mfu": statistics.mean(x["mfu"] for x in steady if x["mfu"] is not None),
        "padding_fraction": statistics.mean(x["padding_fraction"] for x in steady),
        "encoder_busy_s": statistics.mean(x["encoder_busy_s"] for x in steady),
        "backbone_wait_s": statistics.mean(x["backbone_wait_s"] for x in steady),
        "final_loss": lines[-1]["loss"],
    }


def main(argv: list[str]) -> int:
    from mindspeed_flow.runtime import launch

    ap = argparse.ArgumentParser(prog="mindspeed-flow bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded from the averages")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--modes", default="decoupled,coupled")
    args, overrides = ap.parse_known_args(argv)
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=default", *overrides]
    results = {}
    with tempfile.TemporaryDirectory(prefix="msf-bench-") as tmp:
        for mode in args.modes.split(","):
            run_dir = Path(tmp) / mode
            rc = launch.main([*overrides, f"run_dir={run_dir}", f"trainer.steps={args.steps}", f"flow.mode={mode}",
                              "trainer.progress=false"])
            if rc != 0:
                return rc
            lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            results[mode] = _summarize(lines, args.warmup)
    out: dict = {"modes": results, "overrides": overrides, "steps": args.steps, "warmup": args.warmup}
    if "decoupled" in results and "coupled" in results:
        out["speedup_samples_per_s"] = results["decoupled"]["samples_per_s"] / results["coupled"]["samples_per_s"]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    cols = ["samples_per_s", "median_step_s", "mfu", "padding_fraction", "encoder_busy_s", "backbone_wait_s",
            "final_loss"]
    print(f"{'mode':<10}" + "".join(f"{c:>18}" for c in cols))
    for mode, r in results.items():
        print(f"{mode:<10}" + "".join(f"{r[c]:>18.4g}" for c in cols))
    if "speedup_samples_per_s" in out:
        print(f"decoupled / coupled samples/s: {out['speedup_samples_per_s']:.3f}")
    return 0
