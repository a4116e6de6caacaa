"""`mindspeed-flow bench packing`: the packing scheduler side by side with its baselines on one workload.

    mindspeed-flow bench packing --workload infovqa|near_budget|PATH.csv --budget T --dp D --pp P --steps S
        [--global-batch G] [--max-pixels PX] [--pad-multiple M] [--encoders E] [--model FAMILY:PRESET]
        [--json] [--emit PATH.json] [--trl] [--scaling]

Each step takes the next G samples; every method (naive, sorted, first_fit, flow) plans the same steps with
`plan_step(..., min_microbatches=P)`. Reported per method: padding fraction (1 - real tokens / tokens the
backbone computes over, over all steps), DP imbalance (mean over steps of max/mean per-rank cost), slot
imbalance (mean over steps and slots of max/mean cost across DP ranks) and samples/s of the planner itself
(CPU time of `plan_step` only, best of --repeats runs per step, so other jobs on a shared machine count as
little as possible). `--emit` writes the flow assignment for `scripts/check_packing_emit.py`.

`--stream` adds `flow_stream`: the bounded look-ahead streaming packer over the same samples, in steps of a fixed
number of full-budget packs (dp x the flow plan's microbatches per rank) instead of a fixed number of samples: what
the runtime runs with `packing.step_mode=packs` (hosts/torch/packed_steps.py). `flow` is `step_mode=samples`.
It also adds `flow_window`: steps of exactly G samples chosen from a pool of G + min(--lookahead, G) samples of
packs (packing/window.py; `step_mode=window`), timed the same way (whole passes, choice + packing + plan).

`--trl` packs the same lengths with TRL's `pack_dataset(strategy="bfd")` (optional dev extra) and compares fill
(real tokens / (bins x budget)) and time with `best_fit_pack`. Padding is measured one way for everyone: the share
of the tokens the backbone computes over that are padding. Three references sit beside flow's padding, in points:
- `trl_bfd`: TRL's bfd over all samples at once, every pack padded to the budget (1 - fill): no step boundary, no
  DP, one shape. This is the figure flow is asked to come within 0.5 points of;
- `trl_bfd_same_constraints`: TRL's bfd run in the runtime's shoes: per step (the step's samples only), its packs
  rounded up to a multiple of DP (>= dp x pp, the added packs empty), all padded to the step's longest pack rounded
  to --pad-multiple (the budget at 0). This is the apples-to-apples comparison;
- `floor_same_constraints`: a lower bound on the padding of *any* packer under those constraints, per step: at least
  `bins_lower_bound` packs (rounded up to a multiple of DP, >= dp x pp), padded to at least the longest sample and
  the even share, rounded to --pad-multiple.
`--scaling` times `best_fit_pack` from 10^3 to 10^6 samples and at several budgets, and fits the exponent of time
vs N (1.0 = linear; the budget rows show how it grows with B).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from mindspeed_flow.data.shapes import LengthTableError, SampleShape, read_length_table
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.packing import SCHEDULERS, CostModel, PackingError, StepPlan, best_fit_pack, check_budget, plan_step
from mindspeed_flow.packing.schedulers import packed_seq_len, round_up
from mindspeed_flow.packing.streaming import StreamingPacker
from mindspeed_flow.packing.window import WindowPacker
from mindspeed_flow.packing.workloads import FACTOR, infovqa_arrays, near_budget_shapes
from mindspeed_flow.specs import VLMSpec

METHODS = ("naive", "sorted", "first_fit", "flow")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench packing", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="infovqa",
                   help="'infovqa' or 'near_budget' (synthetic; see packing/workloads.py) or a length table PATH.csv")
    p.add_argument("--budget", type=int, default=16384, help="tokens per backbone microbatch")
    p.add_argument("--dp", type=int, default=8, help="backbone data-parallel size")
    p.add_argument("--pp", type=int, default=4, help="pipeline size: at least this many microbatches per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=1024, help="samples per step")
    p.add_argument("--max-pixels", type=int, default=1280 * FACTOR * FACTOR, help="infovqa resize cap (pixels)")
    p.add_argument("--min-pixels", type=int, default=4 * FACTOR * FACTOR)
    p.add_argument("--pad-multiple", type=int, default=128,
                   help="pad packed microbatches to the step's longest pack rounded to this (0: to the budget)")
    p.add_argument("--encoders", type=int, default=4, help="encoder data-parallel size")
    p.add_argument("--model", default="qwen2_vl:7b", help="FAMILY:PRESET for the cost model (model_presets)")
    p.add_argument("--frozen-encoder", action="store_true")
    p.add_argument("--oversize", choices=("error", "skip"), default="error", help="oversize_policy")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=3, help="time each step's plan this many times, keep the best")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--emit", metavar="PATH.json", help="write the flow assignment for check_packing_emit.py")
    p.add_argument("--stream", action="store_true",
                   help="also run the streaming packer: flow_stream (token-defined steps of dp x M full-budget packs) "
                        "and flow_window (G-sample steps chosen from a look-ahead pool of packs)")
    p.add_argument("--lookahead", type=int, default=1024, help="streaming look-ahead buffer (samples)")
    p.add_argument("--trl", action="store_true", help="compare best_fit_pack with TRL's bfd on the same lengths")
    p.add_argument("--scaling", action="store_true", help="time best_fit_pack from 10^3 to 10^6 samples")
    p.add_argument("--scaling-max", type=int, default=10**6, help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    for name in ("budget", "dp", "pp", "steps", "global_batch", "encoders", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.pad_multiple < 0:
        p.error(f"--pad-multiple={args.pad_multiple}: must be >= 0")
    return args


def cost_model_for(model: str, frozen_encoder: bool) -> CostModel:
    family, _, preset = model.partition(":")
    spec = VLMSpec.from_hf_config(hf_config_dict(family, preset or "7b"), name=model)
    return CostModel.from_spec(spec, frozen_encoder=frozen_encoder)


def load_shapes(args: argparse.Namespace) -> list[SampleShape]:
    if args.workload == "infovqa":
        n = args.steps * args.global_batch
        return infovqa_arrays(n, seed=args.seed, max_pixels=args.max_pixels, min_pixels=args.min_pixels).shapes()
    if args.workload == "near_budget":
        return near_budget_shapes(args.steps * args.global_batch, args.budget, seed=args.seed)
    return read_length_table(args.workload)


def steps_of(shapes: list[SampleShape], global_batch: int, steps: int) -> list[list[SampleShape]]:
    """Consecutive steps of `global_batch` samples (the last may be short when the table runs out)."""
    out = [shapes[i:i + global_batch] for i in range(0, len(shapes), global_batch)]
    return out[:steps]


def run_method(method: str, steps: list[list[SampleShape]], args: argparse.Namespace,
               cost_model: CostModel) -> tuple[dict[str, Any], list[StepPlan]]:
    plans: list[StepPlan] = []
    elapsed = 0.0
    for shapes in steps:
        best = float("inf")
        for _ in range(args.repeats):  # best of N: other jobs on a shared machine only ever add time
            start = time.process_time()
            plan = plan_step(shapes, dp=args.dp, num_encoders=args.encoders, token_budget=args.budget,
                             cost_model=cost_model, scheduler=method, min_microbatches=args.pp,
                             oversize_policy=args.oversize, pad_multiple=args.pad_multiple)
            best = min(best, time.process_time() - start)
        elapsed += best
        plans.append(plan)
    return summarize(plans, sum(len(s) for s in steps), elapsed), plans


def summarize(plans: list[StepPlan], samples: int, elapsed: float) -> dict[str, Any]:
    """The benchmark's figures over a list of step plans (see the module docstring)."""
    real = sum(p.real_tokens for p in plans)
    padded = sum(p.padded_tokens for p in plans)
    packed_at_budget = sum(p.dp * p.num_slots * p.token_budget for p in plans)
    return {
        "padding_fraction": 1.0 - real / padded if padded else 0.0,
        "dp_imbalance": float(np.mean([p.dp_imbalance for p in plans])),
        "slot_imbalance": float(np.mean([p.slot_imbalance for p in plans])),
        "samples_per_s": samples / elapsed if elapsed > 0 else float("inf"),
        # Extra columns: padding if every microbatch were padded to the full budget (one static shape),
        # microbatches per DP rank, empty microbatches, encoder-rank imbalance, oversize samples left out.
        "padding_at_budget": 1.0 - real / packed_at_budget if packed_at_budget else 0.0,
        "microbatches_per_rank": float(np.mean([p.num_slots for p in plans])),
        "empty_microbatches": int(sum(p.empty_microbatches for p in plans)),
        "encoder_imbalance": float(np.mean([p.encoder_imbalance for p in plans])),
        "oversize": int(sum(len(p.oversize) for p in plans)),
    }


def run_streaming(shapes: list[SampleShape], args: argparse.Namespace, cost_model: CostModel,
                  per_rank: int) -> dict[str, Any]:
    """The streaming packer over the same samples: every pack padded to the full budget (one static shape).

    Timed like the other methods, best of --repeats (here: whole passes over the stream, which has state).
    """
    elapsed = float("inf")
    for _ in range(args.repeats):
        start = time.process_time()
        packer = StreamingPacker(iter(shapes), token_budget=args.budget, cost_model=cost_model,
                                 lookahead=args.lookahead, oversize_policy=args.oversize)
        plans = list(packer.steps(dp=args.dp, num_encoders=args.encoders, microbatches_per_rank=per_rank))
        elapsed = min(elapsed, time.process_time() - start)
    # The last step of a finite stream is completed with empty packs (an endless stream has no last step):
    # report it apart so the figures describe the steady state.
    tail = plans.pop() if len(plans) > 1 and plans[-1].empty_microbatches else None
    stats = summarize(plans, len(shapes), elapsed)
    stats.update({
        "oversize": len(packer.oversize),
        "steps": len(plans),
        "last_step_samples": len(tail.sample_ids()) if tail else 0,
        "last_step_empty_microbatches": tail.empty_microbatches if tail else 0,
    })
    return stats


def run_window(shapes: list[SampleShape], args: argparse.Namespace, cost_model: CostModel) -> dict[str, Any]:
    """Window steps over the same samples: exactly --global-batch samples each, padded like `flow` (--pad-multiple).

    Timed like `run_streaming` (best of --repeats whole passes); every step counts, the last one included.
    """
    elapsed = float("inf")
    for _ in range(args.repeats):
        start = time.process_time()
        window = WindowPacker(iter(shapes), global_batch_size=args.global_batch, token_budget=args.budget,
                              cost_model=cost_model, lookahead=min(args.lookahead, args.global_batch),
                              oversize_policy=args.oversize)
        plans = list(window.steps(dp=args.dp, num_encoders=args.encoders, min_microbatches=args.pp,
                                  pad_multiple=args.pad_multiple))
        elapsed = min(elapsed, time.process_time() - start)
    stats = summarize(plans, len(shapes), elapsed)
    stats.update({"oversize": len(window.packer.oversize), "steps": len(plans),
                  "whole_pack_steps": window.whole_pack_steps, "oldest_sample_steps": window.oldest_steps,
                  "max_wait_steps": window.max_age})
    return stats


def emit(path: str, plans: list[StepPlan], shapes: list[SampleShape], budget: int) -> None:
    doc = {
        "budget": budget,
        "steps": [[[mb.sample_ids for mb in rank] for rank in p.microbatches] for p in plans],
        "lengths": {str(s.sample_id): s.llm_tokens for s in shapes},
        "oversize": [[sid, tokens] for p in plans for sid, tokens in p.oversize],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)


# ---- TRL side by side -------------------------------------------------------------------------------------------
def trl_compare(lengths: np.ndarray, budget: int) -> dict[str, Any]:
    """Fill and time of TRL's bfd (end to end and its core) vs best_fit_pack on the same lengths."""
    out: dict[str, Any] = {"samples": int(lengths.size), "budget": budget}
    start = time.process_time()
    ours = best_fit_pack(lengths, budget)
    out["flow_best_fit"] = {"seconds": time.process_time() - start, "bins": len(ours.bins),
                            "fill": float(lengths.sum()) / (len(ours.bins) * budget)}
    try:
        from trl import __version__ as trl_version  # optional: trl
    except ImportError as exc:
        out["trl"] = f"not installed ({exc}); pip install -c scripts/constraints.txt trl"
        return out
    out["trl_version"] = trl_version
    start = time.process_time()
    packed_lengths, table = trl_pack_loads(lengths, budget)
    seconds = time.process_time() - start
    out["trl_pack_dataset"] = {"seconds": seconds, "bins": len(packed_lengths),
                               "fill": float(sum(packed_lengths)) / (len(packed_lengths) * budget),
                               "tokens_kept": int(sum(packed_lengths))}
    try:  # TRL's core (private name; may move between versions): the same algorithm without datasets overhead
        from trl.data_utils import _pack_bfd  # optional: trl

        start = time.process_time()
        core = _pack_bfd(table, budget)
        out["trl_core_pack_bfd"] = {"seconds": time.process_time() - start, "bins": core.num_rows}
    except (ImportError, TypeError, AttributeError) as exc:  # pragma: no cover - depends on the TRL version
        out["trl_core_pack_bfd"] = f"unavailable: {exc}"
    return out


def trl_pack_loads(lengths: np.ndarray, budget: int) -> tuple[list[int], Any]:
    """Token load of every pack TRL's `pack_dataset(strategy="bfd")` makes of these lengths (and its input table)."""
    import pyarrow as pa  # optional: trl
    from datasets import Dataset  # optional: trl
    from trl.data_utils import pack_dataset  # optional: trl

    try:
        from datasets import disable_progress_bars  # optional: trl

        disable_progress_bars()
    except ImportError:  # pragma: no cover - older datasets
        pass
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int32))
    table = pa.table({"input_ids": pa.LargeListArray.from_arrays(pa.array(offsets), values)})
    # One map batch holding every sample, so TRL's bins may use the whole set (its default batch is 1000).
    packed = pack_dataset(Dataset(table), budget, strategy="bfd", map_kwargs={"batch_size": max(1, int(lengths.size))})
    return [int(sum(x)) for x in packed["seq_lengths"]], table


def trl_same_constraints(step_lengths: Sequence[np.ndarray], budget: int, dp: int, min_microbatches: int,
                         pad_multiple: int) -> float:
    """Padding of TRL's bfd packs made per step, then placed as the runtime must (see the module docstring)."""
    real = padded = 0
    for lengths in step_lengths:
        loads = trl_pack_loads(lengths, budget)[0] if lengths.size else []
        count = round_up(max(len(loads), dp * min_microbatches), dp)
        real += int(lengths.sum())
        padded += count * packed_seq_len(loads, budget, pad_multiple)
    return 1.0 - real / padded if padded else 0.0


def bins_lower_bound(lengths: np.ndarray, capacity: int) -> int:
    """A lower bound on the bins of `capacity` any packing of `lengths` needs; the largest of three counts.

    - tokens: ceil(total / capacity);
    - count: a bin holds at most m samples, m the most of the shortest samples that fit together; so n / m bins;
    - large samples: for every threshold k <= capacity / 2 (0 and each length up to half the capacity), samples
      longer than half the capacity each need their own bin (no two share one); the samples from k to half the
      capacity cannot join those longer than capacity - k and fit with the others only in those bins' free space,
      so whatever of their tokens exceeds that free space needs further bins.
    Vectorised over the thresholds (sorted lengths, prefix sums).
    """
    lengths = np.sort(np.asarray(lengths, dtype=np.int64))
    if not lengths.size:
        return 0
    prefix = np.r_[0, np.cumsum(lengths)]
    n, half = int(lengths.size), capacity // 2  # "longer than half" is length > capacity / 2, i.e. > capacity // 2
    per_bin = int(np.searchsorted(prefix, capacity, side="right")) - 1
    k = np.unique(np.r_[0, lengths[lengths <= half]])
    upto_half = int(np.searchsorted(lengths, half, side="right"))
    upto_hi = np.searchsorted(lengths, capacity - k, side="right")  # samples <= capacity - k
    below_k = np.searchsorted(lengths, k, side="left")
    own = n - upto_half  # samples longer than half: one bin each
    mid = upto_hi - upto_half  # longer than half but at most capacity - k: their bins have free space
    free = mid * capacity - (prefix[upto_hi] - prefix[upto_half])
    rest = (prefix[upto_half] - prefix[below_k]) - free  # tokens of samples in [k, half] beyond that free space
    large = int(np.max(own + np.maximum(0, -(-rest // capacity))))
    return max(-(-int(prefix[-1]) // capacity), -(-n // max(per_bin, 1)), large)


def padding_floor(step_lengths: Sequence[np.ndarray], budget: int, dp: int, min_microbatches: int,
                  pad_multiple: int) -> float:
    """Least padding any packer can reach under the runtime's step constraints (see the module docstring).

    Per step: for each pack count (a multiple of DP, from the least that `bins_lower_bound` allows at the budget),
    the shortest padded length (a multiple of --pad-multiple, at least the longest sample) at which
    `bins_lower_bound` allows that count; the least count x length over the counts is the step's floor.
    """
    real = padded = 0
    for lengths in step_lengths:
        if not lengths.size:
            continue
        total, longest = int(lengths.sum()), int(lengths.max())
        count = round_up(max(bins_lower_bound(lengths, budget), dp * min_microbatches, 1), dp)
        best = count * budget
        # More packs than the least may allow a shorter padded length: try counts until even the longest sample
        # alone would make count x length exceed the best so far.
        while pad_multiple and count * min(budget, round_up(longest, pad_multiple)) < best:
            seq_len = min(budget, round_up(max(longest, -(-total // count)), pad_multiple))
            while count * seq_len < best and seq_len < budget and bins_lower_bound(lengths, seq_len) > count:
                seq_len += pad_multiple
            best = min(best, count * min(seq_len, budget))
            count += dp
        real += total
        padded += best
    return 1.0 - real / padded if padded else 0.0


# ---- scaling ----------------------------------------------------------------------------------------------------
def scaling(max_n: int, budget: int, seed: int, max_pixels: int) -> dict[str, Any]:
    """Seconds per sample of best_fit_pack for N = 10^3..max_n (InfoVQA-like and uniform lengths) and budgets."""
    rows = []
    sizes = [10**k for k in range(3, 7) if 10**k <= max_n]
    for kind in ("infovqa", "uniform"):
        for n in sizes:
            lengths = _lengths(kind, n, budget, seed, max_pixels)
            seconds = _best_time(lambda: best_fit_pack(lengths, budget), repeats=3 if n <= 10**5 else 1)
            rows.append({"lengths": kind, "n": n, "budget": budget, "seconds": seconds,
                         "us_per_sample": 1e6 * seconds / n})
    out: dict[str, Any] = {"rows": rows, "exponent": {}}
    for kind in ("infovqa", "uniform"):
        pts = [(r["n"], r["seconds"]) for r in rows if r["lengths"] == kind]
        if len(pts) >= 2:
            slope = np.polyfit(np.log([n for n, _ in pts]), np.log([s for _, s in pts]), 1)[0]
            out["exponent"][kind] = float(slope)
    n = min(10**5, max_n)
    budget_rows = []
    for b in (1024, 4096, 16384, 65536, 262144):
        lengths = _lengths("uniform", n, b, seed, max_pixels)
        seconds = _best_time(lambda: best_fit_pack(lengths, b), repeats=2)
        budget_rows.append({"budget": b, "n": n, "us_per_sample": 1e6 * seconds / n,
                            "ns_per_sample_per_log2B": 1e9 * seconds / n / math.log2(b)})
    out["budgets"] = budget_rows
    return out


def _lengths(kind: str, n: int, budget: int, seed: int, max_pixels: int) -> np.ndarray:
    if kind == "infovqa":
        return np.minimum(infovqa_arrays(n, seed=seed, max_pixels=max_pixels).llm_tokens, budget)
    return np.random.default_rng(seed).integers(1, budget // 2 + 1, n)


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


# ---- output -----------------------------------------------------------------------------------------------------
def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    w = result["workload"]
    print(f"workload {w['name']}: {w['samples']} samples in {w['steps']} steps of {args.global_batch}, mean "
          f"{w['mean_llm_tokens']:.0f} LLM tokens; budget {args.budget}, dp {args.dp}, pp {args.pp}, "
          f"pad multiple {args.pad_multiple}, cost model {args.model}")
    print(f"{'method':<11} {'padding':>8} {'pad@budget':>10} {'dp_imb':>7} {'slot_imb':>8} {'mb/rank':>7} "
          f"{'empty':>5} {'enc_imb':>7} {'samples/s':>10}")
    for name, m in result["methods"].items():
        print(f"{name:<11} {m['padding_fraction']:>8.4f} {m['padding_at_budget']:>10.4f} {m['dp_imbalance']:>7.4f} "
              f"{m['slot_imbalance']:>8.4f} {m['microbatches_per_rank']:>7.1f} {m['empty_microbatches']:>5d} "
              f"{m['encoder_imbalance']:>7.4f} {m['samples_per_s']:>10.0f}")
    if "trl" in result:
        points = result["trl"].get("padding_points")
        if points:
            print(f"padding in points: TRL bfd (all samples, unconstrained) {points['trl_bfd']:.3f}; TRL bfd under the "
                  f"runtime's step constraints {points['trl_bfd_same_constraints']:.3f}; floor of any packer under "
                  f"them {points['floor_same_constraints']:.3f}")
            for name in ("flow", "flow_stream", "flow_window"):
                if name in points:
                    print(f"  {name:<11} {points[name]:.3f}, {points[name + '_minus_trl_bfd']:+.3f} vs TRL bfd")
        print("TRL side by side:", json.dumps({k: v for k, v in result["trl"].items() if k != "padding_points"},
                                              indent=1))
    if "scaling" in result:
        s = result["scaling"]
        for r in s["rows"]:
            print(f"scaling {r['lengths']:<8} N={r['n']:>8} {r['us_per_sample']:.3f} us/sample")
        print("fitted exponent of time vs N:", {k: round(v, 3) for k, v in s["exponent"].items()})
        for r in s["budgets"]:
            print(f"budget {r['budget']:>7}: {r['us_per_sample']:.3f} us/sample, "
                  f"{r['ns_per_sample_per_log2B']:.1f} ns per sample per log2(B)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cost_model = cost_model_for(args.model, args.frozen_encoder)
        shapes = load_shapes(args)
        check_budget(shapes, args.budget, field="--budget")
    except (LengthTableError, PackingError, ValueError) as exc:
        print(f"bench packing: {exc}", file=sys.stderr)
        return 2
    steps = steps_of(shapes, args.global_batch, args.steps)
    used = [s for step in steps for s in step]
    result: dict[str, Any] = {
        "workload": {"name": args.workload, "samples": len(used), "steps": len(steps),
                     "mean_llm_tokens": float(np.mean([s.llm_tokens for s in used])) if used else 0.0},
        "methods": {},
    }
    flow_plans: list[StepPlan] = []
    try:
        for method in METHODS:
            result["methods"][method], plans = run_method(method, steps, args, cost_model)
            if method == "flow":
                flow_plans = plans
    except PackingError as exc:
        print(f"bench packing: {exc}", file=sys.stderr)
        return 2
    if args.stream:
        per_rank = max(args.pp, round(result["methods"]["flow"]["microbatches_per_rank"]))
        result["methods"]["flow_stream"] = run_streaming(used, args, cost_model, per_rank)
        result["methods"]["flow_window"] = run_window(used, args, cost_model)
    if args.emit:
        emit(args.emit, flow_plans, used, args.budget)
    if args.trl:
        step_lengths = [np.array([s.llm_tokens for s in step if s.llm_tokens <= args.budget], dtype=np.int64)
                        for step in steps]
        lengths = np.concatenate(step_lengths) if step_lengths else np.zeros(0, np.int64)
        result["trl"] = trl_compare(lengths, args.budget)
        trl = result["trl"].get("trl_pack_dataset")
        if isinstance(trl, dict):
            constraints = (args.budget, args.dp, args.pp, args.pad_multiple)
            unconstrained = 1 - trl["fill"]
            points = {"trl_bfd": 100 * unconstrained,
                      "trl_bfd_same_constraints": 100 * trl_same_constraints(step_lengths, *constraints),
                      "floor_same_constraints": 100 * padding_floor(step_lengths, *constraints)}
            for name in ("flow", "flow_stream", "flow_window"):
                if name in result["methods"]:
                    padding = result["methods"][name]["padding_fraction"]
                    points[name] = 100 * padding
                    points[f"{name}_minus_trl_bfd"] = 100 * (padding - unconstrained)
            result["trl"]["padding_points"] = points
    if args.scaling:
        result["scaling"] = scaling(args.scaling_max, args.budget, args.seed, args.max_pixels)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result, args)
    return 0


assert set(METHODS) == set(SCHEDULERS)

if __name__ == "__main__":
    sys.exit(main())
