"""`mindspeed-flow bench train`: the same recipe trained decoupled and coupled in one run, side by side.

Both modes use the same ranks, data, packing and seed; the table reports samples/s, step time, MFU, padding
and the loss reached, plus the decoupled/coupled ratio. CPU numbers on a shared 2-core machine are noisy:
compare ratios within one invocation, not absolute figures across machines.

    mindspeed-flow bench train [--steps 20] [--warmup 3] [--json] [--variant NAME="k=v k=v" ...]
        [hydra overrides...]

--variant runs every mode once more per variant, with that variant's overrides on top of the common ones
(rows are "mode/variant"), e.g. a pipeline padded to the token budget against one padded per step:

    mindspeed-flow bench train --modes decoupled --variant "pp2_budget=parallel=enc1_bb_pp2" \
        --variant "pp2_per_step=parallel=enc1_bb_pp2 packing.pad_multiple=64" \
        --variant "flat_per_step=packing.pad_multiple=64"

and the embedding transfer time exposed per step with and without receiving ahead:

    mindspeed-flow bench train --modes decoupled --variant "prefetch=flow.prefetch_embeddings=true" \
        --variant "no_prefetch=flow.prefetch_embeddings=false"

Ratios are against the first row (samples/s).
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
        # per step, summed over backbone ranks: embedding transfer time a get() was blocked on, and the rest
        "transfer_exposed_s": statistics.mean(x.get("transfer_exposed_s") or 0.0 for x in steady),
        "transfer_hidden_s": statistics.mean(x.get("transfer_hidden_s") or 0.0 for x in steady),
        "final_loss": lines[-1]["loss"],
    }


def _parse_variants(ap: argparse.ArgumentParser, specs: list[str]) -> list[tuple[str, list[str]]]:
    """[(name, overrides)]; no --variant gives one unnamed variant with no extra overrides."""
    out = []
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip() or not rest.strip() or "=" not in rest:
            ap.error(f"--variant {spec!r}: expected NAME=\"key=value [key=value ...]\"")
        out.append((name.strip(), rest.split()))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        ap.error(f"--variant names must differ, got {names}")
    return out or [("", [])]


def main(argv: list[str]) -> int:
    from mindspeed_flow.runtime import launch

    ap = argparse.ArgumentParser(prog="mindspeed-flow bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded from the averages")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--modes", default="decoupled,coupled")
    ap.add_argument("--variant", action="append", default=[], metavar='NAME="k=v ..."',
                    help="an extra set of overrides, run for every mode (repeatable)")
    args, overrides = ap.parse_known_args(argv)
    variants = _parse_variants(ap, args.variant)
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=default", *overrides]
    results = {}
    with tempfile.TemporaryDirectory(prefix="msf-bench-") as tmp:
        for name, extra in variants:
            for mode in args.modes.split(","):
                row = f"{mode}/{name}" if name else mode
                run_dir = Path(tmp) / row.replace("/", "-")
                rc = launch.main([*overrides, *extra, f"run_dir={run_dir}", f"trainer.steps={args.steps}",
                                  f"flow.mode={mode}", "trainer.progress=false"])
                if rc != 0:
                    return rc
                lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                results[row] = _summarize(lines, args.warmup)
    first = next(iter(results.values()))
    for r in results.values():
        r["samples_per_s_vs_first"] = r["samples_per_s"] / first["samples_per_s"]
    out: dict = {"modes": results, "overrides": overrides, "variants": dict(variants), "steps": args.steps,
                 "warmup": args.warmup}
    if "decoupled" in results and "coupled" in results:
        out["speedup_samples_per_s"] = results["decoupled"]["samples_per_s"] / results["coupled"]["samples_per_s"]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    cols = ["samples_per_s", "samples_per_s_vs_first", "median_step_s", "mfu", "padding_fraction",
            "encoder_busy_s", "backbone_wait_s", "transfer_exposed_s", "transfer_hidden_s", "final_loss"]
    width = max(10, *(len(m) + 2 for m in results))
    print(f"{'mode':<{width}}" + "".join(f"{c:>24}" for c in cols))
    for mode, r in results.items():
        print(f"{mode:<{width}}" + "".join(f"{r[c]:>24.4g}" for c in cols))
    if "speedup_samples_per_s" in out:
        print(f"decoupled / coupled samples/s: {out['speedup_samples_per_s']:.3f}")
    return 0
