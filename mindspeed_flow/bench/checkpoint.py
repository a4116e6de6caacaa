"""`mindspeed-flow bench checkpoint`: how long a checkpoint save blocks the training loop, sync vs async, and
how long a restore takes, on one recipe in one invocation.

Each mode trains the recipe through the real launcher with a DCP checkpoint every `--every` steps; rank 0 logs
each save's blocked time (the time `save()` held the loop: for async, the staging copy plus any wait for the
previous save) to RUN_DIR/checkpoints.jsonl. Then the run is resumed for one more step, which logs the time to
verify the manifest and to load the checkpoint. CPU numbers on a shared machine are noisy: read the ratio.

    mindspeed-flow bench checkpoint [--steps 8] [--every 2] [--json] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from mindspeed_flow.runtime import launch


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "checkpoints.jsonl").read_text().splitlines() if x.strip()]


def measure(overrides: list[str], steps: int, every: int, mode: str, tmp: Path) -> dict:
    run_dir = tmp / mode
    common = [*overrides, f"run_dir={run_dir}", "trainer.progress=false", f"trainer.checkpoint_every={every}",
              f"trainer.async_checkpoint={'true' if mode == 'async' else 'false'}"]
    if launch.main([*common, f"trainer.steps={steps}"]) != 0:
        raise RuntimeError(f"bench checkpoint: the {mode} run failed (see above)")
    if launch.main([*common, f"trainer.steps={steps + 1}", "trainer.resume=true"]) != 0:
        raise RuntimeError(f"bench checkpoint: the {mode} resume failed (see above)")
    events = _events(run_dir)
    saves = [e["blocked_s"] for e in events if e["event"] == "save"]
    written = [e for e in events if e["event"] == "saved"]
    restore = [e for e in events if e["event"] == "restore"][-1]
    return {"saves": len(saves), "median_blocked_s": statistics.median(saves), "max_blocked_s": max(saves),
            "median_save_total_s": statistics.median(e["total_s"] for e in written),
            "checkpoint_mb": written[-1]["bytes"] / 2**20, "verify_s": restore["verify_s"],
            "restore_s": restore["restore_s"]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mindspeed-flow bench checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    ap.add_argument("--json", action="store_true")
    args, overrides = ap.parse_known_args(argv)
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=default", *overrides]
    with tempfile.TemporaryDirectory(prefix="msf-bench-ckpt-") as tmp:
        results = {mode: measure(overrides, args.steps, args.every, mode, Path(tmp)) for mode in ("sync", "async")}
    ratio = results["sync"]["median_blocked_s"] / max(results["async"]["median_blocked_s"], 1e-9)
    if args.json:
        print(json.dumps({"results": results, "sync_over_async_blocked": ratio}, indent=2))
        return 0
    keys = ["saves", "checkpoint_mb", "median_blocked_s", "max_blocked_s", "median_save_total_s", "verify_s",
            "restore_s"]
    print(f"{'':22s}{'sync':>12s}{'async':>12s}")
    for k in keys:
        print(f"{k:22s}" + "".join(f"{results[m][k]:12.4f}" for m in ("sync", "async")))
    print(f"loop blocked per save, sync / async: {ratio:.1f}x")
    return 0
