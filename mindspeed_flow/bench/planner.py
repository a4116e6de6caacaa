"""`mindspeed-flow bench planner`: how long the allocator takes to plan at 1,024 and 16,384 devices.

Plans Qwen2.5-VL-72B on InfoVQA-like data on Atlas 800T A2 nodes (8 NPUs a node) scaled to each size, and
prints the median wall time of `make_plan` (pricing every layout + the three CP-SAT solves + the binding
constraint analysis; baselines excluded, workload loading excluded) against the goals: < 100 ms at 1,024
devices and < 1 s at 16,384.

    mindspeed-flow bench planner [--sizes 1024,16384] [--repeats 5] [--model qwen2_5_vl_72b]
                                 [--cluster atlas_800t_a2]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from mindspeed_flow.planner.inputs import build_problem, parse_kv
from mindspeed_flow.planner.plan import make_plan

GOALS_S = {1024: 0.1, 16384: 1.0}


def time_plan(model: str, cluster: str, devices: int, repeats: int) -> tuple[float, dict]:
    problem, _ = build_problem(parse_kv([f"model={model}", f"cluster={cluster}", f"devices={devices}",
                                         "samples=512"]))
    make_plan(problem, with_baselines=False)  # warm caches (OR-Tools, numpy)
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = make_plan(dataclasses.replace(problem), with_baselines=False)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    layout = {p.name: (p.devices, p.layout) for p in plan.parts}
    return statistics.median(times), {"layout": layout, "samples_per_s": plan.samples_per_s, "mfu": plan.mfu,
                                      "options": plan.options_priced}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mindspeed-flow bench planner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="qwen2_5_vl_72b")
    ap.add_argument("--cluster", default="atlas_800t_a2")
    args = ap.parse_args(argv)
    print(f"planner solve time: {args.model} on {args.cluster} nodes, InfoVQA-like data, median of {args.repeats}")
    ok = True
    for n in (int(s) for s in args.sizes.split(",")):
        sec, info = time_plan(args.model, args.cluster, n, args.repeats)
        goal = GOALS_S.get(n)
        verdict = "" if goal is None else (f"goal < {goal * 1000:.0f} ms: " + ("met" if sec < goal else "MISSED"))
        ok &= goal is None or sec < goal
        parts = ", ".join(f"{k} {d} dev {lay['dp']}/{lay['tp']}/{lay['pp']}/{lay['cp']}"
                          for k, (d, lay) in info["layout"].items())
        print(f"  {n:>6} devices: {sec * 1000:8.1f} ms  ({info['options']} layouts priced; {parts}; "
              f"{info['samples_per_s']:.4g} samples/s, MFU {100 * info['mfu']:.1f}%)  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
