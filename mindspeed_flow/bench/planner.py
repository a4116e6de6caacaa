"""`mindspeed-flow bench planner`: how long the allocator takes to plan at 1,024 and 16,384 devices.

Plans Qwen2.5-VL-72B on InfoVQA-like data on Atlas 800T A2 nodes (8 NPUs a node) scaled to each size, and
prints the median wall time of `make_plan` (pricing every layout + the three CP-SAT solves + the binding
constraint analysis; baselines excluded, workload loading excluded) against the goals: < 100 ms at 1,024
devices and < 1 s at 16,384.

    mindspeed-flow bench planner [--sizes 1024,16384] [--repeats 5] [--model qwen2_5_vl_72b] [--data infovqa]
                                 [--cluster atlas_800t_a2] [--sanity] [--two-rank [--profile P]]
                                 [--encoder-heavy [--devices 256]]

--two-rank prints the step simulator's ranking of the three 2-rank layouts of the default CPU recipe (coupled
DP2, coupled PP2 with the ViT on stage 0, decoupled 1 + 1), calibrated by a `mindspeed-flow profile` table;
`mindspeed-flow bench train` measures two of them (the torch host has no coupled pipeline mode).

--sanity prints, instead, published figures beside the planner's predictions for the nearest job it can price
(same model size and device count; its workload is InfoVQA-like images, so a figure measured on other data is
an order-of-magnitude check, and MFU follows the assumed `planner.efficiency`, printed with it).

--encoder-heavy plans the encoder-heavy presets (`ENCODER_HEAVY`: an InternViT-6B-like encoder with a 7B LLM on
video of 16-64 frames a sample and on InfoVQA-like images in 448 px tiles) for the MindSpeed-MM job on an A3
SuperPoD, and prints what `plan --job mm` recommends beside the decoupled plan and the strongest baseline, with
the gain or loss of each over that baseline and MFU over the devices used and over the cluster's.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from mindspeed_flow.planner.inputs import build_problem, parse_kv
from mindspeed_flow.planner.plan import make_plan
from mindspeed_flow.planner.recommend import recommend
from mindspeed_flow.planner.simulate import two_rank_ranking
from mindspeed_flow.planner.workload import DEFAULT_SAMPLES

GOALS_S = {1024: 0.1, 16384: 1.0}


def time_plan(model: str, cluster: str, devices: int, repeats: int, data: str = "infovqa") -> tuple[float, dict]:
    problem, _ = build_problem(parse_kv([f"model={model}", f"cluster={cluster}", f"devices={devices}",
                                         f"data={data}", "samples=512"]))
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


# Published figures: (what, value, unit, source, planner job, which prediction compares).
SANITY: tuple[tuple[str, float, str, str, tuple[str, ...], str], ...] = (
    ("MindSpeed-MM Qwen2.5-VL-72B, Megatron coupled, A3 128 dies, ViT frozen (video, 128k seq, TP8 PP4 CP4)",
     1105.175, "tokens/s/device",
     "MindSpeed-MM examples/qwen2.5vl/README.md (end-to-end tps table)",
     ("cluster=atlas_900_a3_384", "devices=128", "freeze_encoder=true"), "megatron_coupled:tokens"),
    ("MindSpeed-MM Qwen2.5-VL-72B on the FSDP2 path", 0.30, "MFU (at least)",
     "MindSpeed-MM examples/qwen2.5vl/README.md (\"MFU 30%+\")",
     ("cluster=atlas_900_a3_384", "devices=128"), "megatron_coupled:mfu"),
    ("DistTrain, 72B multimodal model, 1,172 GPUs", 0.547, "MFU",
     "DistTrain, arXiv 2408.04275 (SIGCOMM'25)", ("cluster=h100_8", "devices=1168"), "plan:mfu"),
    ("FlowTrain, 72B VLM, disaggregated", 0.529, "MFU",
     "FlowTrain, arXiv 2606.23087", ("cluster=atlas_900_a3_384", "devices=768"), "plan:mfu"),
    ("FlowTrain's coupled baseline, 72B VLM", 0.312, "MFU",
     "FlowTrain, arXiv 2606.23087", ("cluster=atlas_900_a3_384", "devices=768"), "megatron_coupled:mfu"),
    ("Megatron-LM, large dense GPT on H100", 0.47, "MFU (up to)",
     "Megatron-LM README (github.com/NVIDIA/Megatron-LM)", ("cluster=h100_8", "devices=1024"), "backbone:efficiency"),
)


def sanity_rows(samples: int = 512) -> list[dict]:
    """Each published figure beside the planner's prediction for the nearest job (see the module docstring)."""
    rows = []
    for what, value, unit, source, job, pick in SANITY:
        problem, _ = build_problem(parse_kv(["model=qwen2_5_vl_72b", f"samples={samples}", *job]))
        which, metric = pick.split(":")
        if which == "backbone":
            predicted = float(dict(problem.cfg.efficiency)["backbone"])
            label = "assumed planner.efficiency.backbone (bounds the backbone's MFU)"
        else:
            plan = make_plan(problem, with_baselines=which != "plan")
            if which == "plan":
                tokens, mfu, devices = plan.tokens_per_s, plan.mfu, plan.devices
                label = "mindspeed-flow plan"
            else:
                b = plan.baselines[which]
                if b is None:
                    rows.append(dict(what=what, value=value, unit=unit, source=source, predicted=None, job=job,
                                     label=f"{which}: no fitting layout"))
                    continue
                tokens = b.samples_per_s * problem.parts[-1].tokens_per_sample
                mfu, devices, label = b.mfu, b.devices, f"{which} baseline"
            predicted = tokens / devices if metric == "tokens" else mfu
        rows.append(dict(what=what, value=value, unit=unit, source=source, predicted=predicted, job=job, label=label))
    return rows


# Encoder-heavy presets: (model recipe, planning workload); see planner/workload.py and recipes/model/.
ENCODER_HEAVY: tuple[tuple[str, str], ...] = (("internvit6b_7b", "video"), ("internvit6b_7b", "infovqa_tiles"))


def encoder_heavy_rows(devices: int = 256, cluster: str = "atlas_900_a3_384",
                       samples: int = DEFAULT_SAMPLES) -> list[dict]:
    """Per encoder-heavy preset, what `plan --job mm` recommends, the decoupled plan and the strongest baseline."""
    rows = []
    for model, data in ENCODER_HEAVY:
        problem, _ = build_problem(parse_kv([f"model={model}", f"data={data}", f"cluster={cluster}",
                                             f"devices={devices}", f"samples={samples}", "planner.job=mm"]))
        plan = make_plan(problem)
        rec, strong = recommend(plan), plan.strongest_baseline
        base = strong.samples_per_s if strong is not None else float("nan")
        rows.append(dict(model=model, data=data, cluster=cluster, devices=devices, recommended=rec.name,
                         recommended_samples_per_s=rec.samples_per_s, recommended_gain=rec.samples_per_s / base,
                         recommended_mfu=rec.mfu, recommended_mfu_cluster=rec.mfu * rec.devices / devices,
                         decoupled_samples_per_s=plan.samples_per_s, decoupled_gain=plan.samples_per_s / base,
                         decoupled_mfu=plan.mfu, decoupled_mfu_cluster=plan.mfu_cluster,
                         strongest=None if strong is None else strong.name))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mindspeed-flow bench planner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="qwen2_5_vl_72b")
    ap.add_argument("--data", default="infovqa", help="workload of the timing runs (e.g. video, infovqa_tiles)")
    ap.add_argument("--cluster", default="atlas_800t_a2")
    ap.add_argument("--encoder-heavy", action="store_true", help="plan --job mm on the encoder-heavy presets")
    ap.add_argument("--devices", type=int, default=256, help="A3 devices for --encoder-heavy")
    ap.add_argument("--sanity", action="store_true", help="published figures vs the planner's predictions")
    ap.add_argument("--two-rank", action="store_true", help="simulated ranking of the 2-rank CPU layouts")
    ap.add_argument("--profile", default="", help="profile table for --two-rank")
    args = ap.parse_args(argv)
    if args.two_rank:
        kv = ["model=tiny_qwen2_vl", "data=infovqa_tiny", "cluster=cpu", "devices=2", "samples=64"]
        problem, _ = build_problem(parse_kv(kv + ([f"planner.profile={args.profile}"] if args.profile else [])))
        print("simulated mean step seconds, steps 1-3 of experiment=default on 2 ranks (fastest first):")
        for name, sec in two_rank_ranking(problem.ctx, ["experiment=default"]).items():
            print(f"  {name:<24} {sec:.3f} s  ({12 / sec:.1f} samples/s)")
        return 0
    if args.encoder_heavy:
        print(f"encoder-heavy presets, plan --job mm on atlas_900_a3_384 ({args.devices} devices); gains are over the "
              "strongest baseline that applies; MFU over the devices used / over the cluster's")
        for r in encoder_heavy_rows(args.devices):
            print(f"  model={r['model']} data={r['data']}: recommended {r['recommended']} "
                  f"{r['recommended_samples_per_s']:.4g} samples/s x{r['recommended_gain']:.2f}, MFU "
                  f"{100 * r['recommended_mfu']:.1f}% / {100 * r['recommended_mfu_cluster']:.1f}%; decoupled "
                  f"{r['decoupled_samples_per_s']:.4g} samples/s x{r['decoupled_gain']:.2f}, MFU "
                  f"{100 * r['decoupled_mfu']:.1f}% / {100 * r['decoupled_mfu_cluster']:.1f}% "
                  f"(strongest baseline: {r['strongest']})")
        return 0
    if args.sanity:
        print("published figure vs planner prediction (Qwen2.5-VL-72B, InfoVQA-like data unless noted)")
        for r in sanity_rows():
            pred = "n/a" if r["predicted"] is None else (f"{r['predicted']:.4g}" if r["unit"].startswith("tokens")
                                                          else f"{100 * r['predicted']:.1f}%")
            pub = f"{r['value']:.4g}" if r["unit"].startswith("tokens") else f"{100 * r['value']:.1f}%"
            print(f"  {r['what']}\n      published {pub} {r['unit']}  [{r['source']}]\n"
                  f"      predicted {pred} ({r['label']}; {' '.join(r['job'])})")
        return 0
    print(f"planner solve time: {args.model} on {args.cluster} nodes, data={args.data}, median of {args.repeats}")
    ok = True
    for n in (int(s) for s in args.sizes.split(",")):
        sec, info = time_plan(args.model, args.cluster, n, args.repeats, args.data)
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
