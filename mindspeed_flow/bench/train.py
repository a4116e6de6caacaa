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

and the encoder's bound on held activations (`flow.encoder_inflight`, in consumer microbatch slots) against
the whole step, with the peak samples / slots / saved-activation MiB an encoder rank held beside the step time:

    mindspeed-flow bench train --modes decoupled --encoder-inflight 0,1,2 experiment=parity_dp2 \
        trainer.global_batch_size=24

Ratios are against the first row (samples/s).

--ranking: the three ways to run one job on 2 ranks (`experiment=heavy_encoder_2rank` unless given: a heavy
encoder share), measured side by side and ranked beside the planner's prediction for the same layouts:
coupled DP2, coupled PP2 with the ViT on stage 0 (its LLM layers per stage: the split the planner balances
around the ViT, as a tuned MindSpeed-MM job sets pipeline_num_layers), and decoupled 1 encoder + 1 backbone
rank. The rows run in interleaved rounds (--repeats) so that load from other jobs hits all three alike; the
table gives each row's median samples/s over the rounds, its spread, and the planner's predicted samples/s.
Before each round two busy processes measure the core share they get (`planner.measure.core_share`): 1.0 on
an idle 2-core machine, less when other jobs load it. --min-core-share waits (up to --max-wait seconds) for a
machine that quiet before each round, so the three are compared without oversubscription:

    mindspeed-flow bench train --ranking [--repeats 3] [--steps 8] [--profile runs/profile/profile.json]
        [--min-core-share 0.8 --max-wait 900]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from mindspeed_flow.config.load import compose, to_job_config
from mindspeed_flow.planner.baselines import megatron_coupled
from mindspeed_flow.planner.inputs import build_problem, parse_kv
from mindspeed_flow.planner.measure import core_share
from mindspeed_flow.planner.plan import make_plan
from mindspeed_flow.runtime import launch

# --ranking: row -> the overrides that make the layout from the 2-rank (1 encoder + 1 backbone) recipe
RANKING_ROWS = {
    "coupled_dp2": ["flow.mode=coupled"],
    "coupled_pp2": ["flow.mode=coupled", "parallel.coupled.pp=2"],  # + the planner's layer_split
    "decoupled_1+1": ["flow.mode=decoupled"],
}
RANKING_MODEL, RANKING_DATA = "tiny_qwen2_vl_big_vit", "infovqa_tiny_large"


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
        # the most an encoder rank held at once between forward and backward in any step (flow.encoder_inflight)
        "encoder_held_peak": max(x.get("encoder_held_peak") or 0.0 for x in steady),
        "encoder_held_slots_peak": max(x.get("encoder_held_slots_peak") or 0.0 for x in steady),
        "encoder_held_mb": max(x.get("encoder_held_bytes_peak") or 0.0 for x in steady) / 2**20,
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
    ap = argparse.ArgumentParser(prog="mindspeed-flow bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded from the averages")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--modes", default="decoupled,coupled")
    ap.add_argument("--variant", action="append", default=[], metavar='NAME="k=v ..."',
                    help="an extra set of overrides, run for every mode (repeatable)")
    ap.add_argument("--encoder-inflight", default="", metavar="N,N,...",
                    help="one variant per flow.encoder_inflight value (0: the whole step), beside any --variant")
    ap.add_argument("--ranking", action="store_true",
                    help="coupled DP2 / coupled PP2 / decoupled 1+1 on 2 ranks, measured and predicted")
    ap.add_argument("--repeats", type=int, default=3, help="--ranking: interleaved rounds (medians reported)")
    ap.add_argument("--profile", default=None, help="--ranking: a `mindspeed-flow profile` table for the planner")
    ap.add_argument("--min-core-share", type=float, default=0.0,
                    help="--ranking: before each round wait until 2 busy processes get this share of a core each")
    ap.add_argument("--max-wait", type=float, default=600.0, help="--ranking: longest wait per round (seconds)")
    args, overrides = ap.parse_known_args(argv)
    if args.ranking:
        return ranking_main(args, overrides)
    variants = _parse_variants(ap, args.variant)
    if args.encoder_inflight:
        bounds = _parse_bounds(ap, args.encoder_inflight)
        named = [(f"inflight{b}", [f"flow.encoder_inflight={b}"]) for b in bounds]
        variants = [(f"{n}+{name}" if name else n, [*extra, *o]) for name, extra in variants for n, o in named]
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
    if args.encoder_inflight:
        cols += ["encoder_held_peak", "encoder_held_slots_peak", "encoder_held_mb"]
    width = max(10, *(len(m) + 2 for m in results))
    print(f"{'mode':<{width}}" + "".join(f"{c:>24}" for c in cols))
    for mode, r in results.items():
        print(f"{mode:<{width}}" + "".join(f"{r[c]:>24.4g}" for c in cols))
    if "speedup_samples_per_s" in out:
        print(f"decoupled / coupled samples/s: {out['speedup_samples_per_s']:.3f}")
    return 0


def _parse_bounds(ap: argparse.ArgumentParser, spec: str) -> list[int]:
    """--encoder-inflight "0,1,2" -> [0, 1, 2] (each an integer >= 0)."""
    try:
        bounds = [int(x) for x in spec.split(",")]
    except ValueError:
        bounds = []
    if not bounds or min(bounds) < 0:
        ap.error(f"--encoder-inflight {spec!r}: expected integers >= 0 separated by commas (0: the whole step)")
    return bounds


def _train_once(launch, overrides: list[str], run_dir: Path, steps: int, warmup: int) -> Optional[dict]:
    rc = launch.main([*overrides, f"run_dir={run_dir}", f"trainer.steps={steps}", "trainer.progress=false"])
    if rc != 0:
        return None
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = _summarize(lines, warmup)
    steady = lines[warmup:] or lines
    # per step, not per run: a burst of load from other jobs slows a few steps, and the median step (or the
    # fastest, the one least disturbed) ignores it where the run's mean does not
    samples = statistics.mean(x["samples"] for x in steady)
    out["median_step_samples_per_s"] = samples / out["median_step_s"]
    out["fastest_step_samples_per_s"] = samples / min(x["step_seconds"] for x in steady)
    return out


def predict_ranking(model: str, data: str, global_batch: int, token_budget: int,
                    profile: Optional[str]) -> dict[str, dict]:
    """The planner's samples/s for the three 2-rank layouts, each priced exactly as it runs: no recompute (the
    runtime keeps activations), the recipe's token budget, and for coupled PP2 the stage split the planner
    balances around the ViT (returned as `layers`, which the run then uses)."""
    kv = [f"model={model}", f"data={data}", "cluster=cpu", "devices=2", f"global_batch={global_batch}",
          "samples=512", "planner.recompute=[false]"] + ([f"planner.profile={profile}"] if profile else [])
    problem, _ = build_problem(parse_kv(kv + ["encoder.dp=1", "backbone.dp=1", "backbone.pp=1",
                                              f"backbone.b={token_budget}"]))
    dec = make_plan(problem, with_baselines=False)
    out = {"decoupled_1+1": {"samples_per_s": dec.samples_per_s, "step_s": dec.step_seconds, "layers": None}}
    enc, bb = problem.parts
    for row, pins in (("coupled_dp2", {"dp": 2, "pp": 1}), ("coupled_pp2", {"dp": 1, "pp": 2})):
        # the coupled baselines' own cost model (ViT on stage 0), pinned to this layout
        res = megatron_coupled(enc, bb, problem.baseline_ctx, 2, fixed={**pins, "tp": 1, "cp": 1, "b": token_budget})
        if res is None:
            raise RuntimeError(f"the planner finds no coupled layout {pins} that fits (model={model}, data={data})")
        out[row] = {"samples_per_s": res.samples_per_s, "step_s": res.step_seconds,
                    "layers": res.layout["coupled"].get("layers")}
    return out


def _quiet_share(min_share: float, max_wait: float) -> float:
    """The core share 2 busy processes get now; with min_share > 0, polled until it reaches min_share or
    max_wait seconds have passed (then the last reading is returned and the round runs anyway)."""
    deadline = time.monotonic() + max_wait
    share = core_share(2)
    while share < min_share and time.monotonic() < deadline:
        time.sleep(5.0)
        share = core_share(2)
    return share


def _order(values: dict[str, float]) -> list[str]:
    return sorted(values, key=lambda k: -values[k])


def ranking_main(args: argparse.Namespace, overrides: list[str]) -> int:
    """`bench train --ranking`: see the module docstring."""
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=heavy_encoder_2rank", *overrides]
    if not any(o.startswith("model=") for o in overrides):
        overrides.append(f"model={RANKING_MODEL}")
    if not any(o.startswith("data=") for o in overrides):
        overrides.append(f"data={RANKING_DATA}")
    model = next(o.split("=", 1)[1] for o in overrides if o.startswith("model="))
    data = next(o.split("=", 1)[1] for o in overrides if o.startswith("data="))
    job = to_job_config(compose(overrides))
    p = job.parallel
    if (p.encoder.dp, p.encoder.tp, p.backbone.dp, p.backbone.tp, p.backbone.pp) != (1, 1, 1, 1, 1):
        raise SystemExit("bench train --ranking: the recipe must be 1 encoder + 1 backbone rank (parallel.encoder and "
                         "parallel.backbone all 1), got " f"encoder {p.encoder} backbone {p.backbone}")
    predicted = predict_ranking(model, data, job.trainer.global_batch_size, job.packing.token_budget, args.profile)
    layers = predicted["coupled_pp2"]["layers"]
    rows = {name: list(extra) for name, extra in RANKING_ROWS.items()}
    rows["coupled_pp2"].append(f"parallel.coupled.layer_split=[{','.join(str(n) for n in layers)}]")
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    shares: list[tuple[float, float]] = []  # per round: the core share before and after it
    with tempfile.TemporaryDirectory(prefix="msf-bench-rank-") as tmp:
        for r in range(args.repeats):  # interleaved: each round runs every row once
            before = _quiet_share(args.min_core_share, args.max_wait)
            for name, extra in rows.items():
                res = _train_once(launch, [*overrides, *extra], Path(tmp) / f"{name}-{r}", args.steps, args.warmup)
                if res is None:
                    return 1
                runs[name].append(res)
            shares.append((before, _quiet_share(0.0, 0.0)))
    # a row's figure: the median over rounds of each run's median-step samples/s
    measured = {n: statistics.median(x["median_step_samples_per_s"] for x in rs) for n, rs in runs.items()}
    fastest = {n: max(x["fastest_step_samples_per_s"] for x in rs) for n, rs in runs.items()}
    first = next(iter(measured.values()))
    table = {n: {"samples_per_s_median": measured[n], "vs_first": measured[n] / first,
                 "samples_per_s_runs": [x["median_step_samples_per_s"] for x in runs[n]],
                 "samples_per_s_fastest_step": fastest[n],
                 "median_step_s": statistics.median(x["median_step_s"] for x in runs[n]),
                 "predicted_samples_per_s": predicted[n]["samples_per_s"],
                 "predicted_vs_first": predicted[n]["samples_per_s"] / predicted["coupled_dp2"]["samples_per_s"],
                 "layers": predicted[n]["layers"], "final_loss": runs[n][-1]["final_loss"]} for n in rows}
    m_order, p_order = _order(measured), _order({n: predicted[n]["samples_per_s"] for n in rows})
    # the same ranking in each round on its own, as a measure of how settled the measured order is
    per_round = [_order({n: runs[n][r]["median_step_samples_per_s"] for n in rows}) for r in range(args.repeats)]
    out = {"rows": table, "measured_ranking": m_order, "predicted_ranking": p_order, "match": m_order == p_order,
           "fastest_step_ranking": _order(fastest),
           "rounds_matching_prediction": sum(o == p_order for o in per_round), "repeats": args.repeats,
           "core_share_per_round": shares, "ranking_per_round": per_round,
           "steps": args.steps, "warmup": args.warmup, "overrides": overrides, "profile": args.profile}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"2 ranks, {model} on {data}, global batch {job.trainer.global_batch_size}, {args.repeats} interleaved "
          f"rounds of {args.steps} steps (first {args.warmup} excluded); planner: cluster=cpu"
          + (f", profile {args.profile}" if args.profile else ", uncalibrated"))
    print("samples/s: median over rounds of each run's median step (runs: each round's), fastest step of all "
          "rounds, planner")
    print(f"{'layout':<15}{'measured/s':>12}{'vs first':>10}{'runs':>26}{'fastest/s':>11}{'predicted/s':>13}"
          f"{'vs first':>10}  layers")
    for n, t in table.items():
        spread = "/".join(f"{x:.2f}" for x in t["samples_per_s_runs"])
        print(f"{n:<15}{t['samples_per_s_median']:>12.3f}{t['vs_first']:>10.3f}{spread:>26}"
              f"{t['samples_per_s_fastest_step']:>11.3f}{t['predicted_samples_per_s']:>13.3f}"
              f"{t['predicted_vs_first']:>10.3f}  {t['layers'] or ''}")
    for r, ((before, after), order) in enumerate(zip(shares, per_round)):
        print(f"  round {r}: core share {before:.2f} before, {after:.2f} after; measured {' > '.join(order)}")
    print(f"measured ranking:  {' > '.join(m_order)}  (by fastest step: {' > '.join(out['fastest_step_ranking'])})")
    print(f"predicted ranking: {' > '.join(p_order)}  -> {'match' if out['match'] else 'MISMATCH'} "
          f"({out['rounds_matching_prediction']} of {args.repeats} rounds alone match)")
    return 0
