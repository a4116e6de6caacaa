"""`mindspeed-flow profile`: measure the encoder and the backbone on the devices at hand and calibrate the planner.

    mindspeed-flow profile [model=tiny_qwen2_vl] [data=infovqa_tiny] [cluster=cpu] [--out profile.json]
                           [--csv profile.csv] [--repeats 3] [--budgets 512,1024,2048]

It builds the model with the torch host (`hosts/torch`: the same encoder/backbone split the runtime trains),
then times, single process, one thread:
- encoder forward + backward per sample, for samples of different patch counts;
- backbone forward + backward per packed microbatch, at several token budgets (padded, as the runtime does).
Each row records the FLOPs the cost model charges for that call and its thread CPU time (the fastest of
--repeats; wall time is recorded too but not fitted: on a shared machine it counts other jobs' time), and a
least-squares fit of
seconds = overhead + seconds_per_flop x FLOPs per part gives the calibration the planner reads with
`planner.profile=profile.json` (`seconds_per_flop`, `item_overhead_s`, `microbatch_overhead_s`), and each fit's
largest relative residual (`spread`), from which the plan reports its predictions as ranges. Then two ranks on
the process-group backend at hand time all-reduces of several sizes; a fit of t = bytes / bandwidth + 2 x
latency (a 2-rank ring) replaces the cluster preset's link figures (`link`). The CSV holds the raw rows
(part, size, flops, seconds).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from mindspeed_flow.planner.inputs import build_problem, parse_kv, resolve_model
from mindspeed_flow.planner.measure import time_call
from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.planner.workload import _data_config
from mindspeed_flow.specs import VLMSpec


def _fit(flops: list[float], seconds: list[float]) -> tuple[float, float]:
    """(overhead_s, seconds_per_flop) by least squares, both clipped at >= 0."""
    x, y = np.asarray(flops, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0, float(np.sum(y) / max(np.sum(x), 1e-30))
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:  # fall back to a line through the origin
        return 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(intercept), float(slope)


def encoder_call_flops(part: PartSpec, patches_per_image: list[int], spec: Any) -> float:
    """FLOPs the cost model charges for encoding one sample with these images (fwd + bwd when trainable)."""
    return float(sum(spec.vision.image_flops(p, part.trainable) for p in patches_per_image))


def backbone_call_flops(part: PartSpec, budget: int, flash: bool, seq_lens: list[int]) -> float:
    """FLOPs the cost model charges for one packed microbatch of `budget` tokens (see cost.py)."""
    coef = part.attn_flops_per_sample / max(part.sq_tokens_per_sample, 1.0)
    attn = coef * (sum(s * s for s in seq_lens) if flash else budget * budget)
    return part.linear_flops_per_token * budget + attn


def _greedy_pack(lengths: list[int], budget: int) -> list[int]:
    chosen, used = [], 0
    for i, n in enumerate(lengths):
        if used + n <= budget:
            chosen.append(i)
            used += n
    return chosen


def measure(model_name: str, data: str, cluster: str, budgets: list[int], repeats: int,
            n_encoder_samples: int = 6, links: bool = True, device: str = "cpu") -> dict[str, Any]:
    """The profile table. `device` (cpu | cuda | npu | auto): where the model runs. On the CPU each call is
    charged its thread CPU time; on an accelerator its wall time between two device synchronisations (the
    device is this process's alone, and host CPU time says nothing of the kernels)."""
    import torch  # lazy: torch

    from mindspeed_flow.accelerator import Accelerator  # lazy: torch
    from mindspeed_flow.data.synthetic import SyntheticInfoVQA, SyntheticParams  # lazy: torch
    from mindspeed_flow.data.tokens import token_spec_from_hf_config  # lazy: torch
    from mindspeed_flow.hosts.torch.build import build_vlm  # lazy: torch
    from mindspeed_flow.hosts.torch.split import split_vlm  # lazy: torch

    torch.set_num_threads(int(os.environ.get("MSF_THREADS_PER_RANK", "1")))
    ref = resolve_model(model_name)
    problem, _ = build_problem(parse_kv([f"model={model_name}", f"data={data}", f"cluster={cluster}",
                                         "samples=256"]))
    enc_part, bb_part = problem.parts
    flash = problem.cfg.flash_attention
    spec = VLMSpec.from_hf_config(ref.hf_config)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[ref.dtype]
    acc = Accelerator.detect(device)
    model = build_vlm(ref.hf_config["model_type"], ref.hf_config, seed=0, dtype=dtype).to(acc.device())
    encoder, backbone = split_vlm(model)
    on_device = acc.device_type != "cpu"

    def timed(fn: Any) -> tuple[float, float]:
        """(wall, charged) seconds: the charged figure is what the fit uses (see the docstring)."""
        if not on_device:
            return time_call(fn, repeats=repeats)

        def synced() -> None:
            fn()
            acc.synchronize()
        acc.synchronize()
        wall, _ = time_call(synced, repeats=repeats)
        return wall, wall
    dc = _data_config(data)
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=min(dc.num_samples, 256), seed=dc.seed,
                                          min_pixels=dc.min_pixels, max_pixels=dc.max_pixels),
                          token_spec_from_hf_config(ref.hf_config))
    samples = [ds.sample(i) for i in range(64)]
    rows: list[dict[str, Any]] = []

    # encoder: a spread of sizes (sorted by patches, evenly picked)
    with_images = sorted((s for s in samples if s.pixel_values is not None),
                         key=lambda s: ds.shape(s.sample_id).vit_patches)
    picks = [with_images[int(i)] for i in np.linspace(0, len(with_images) - 1, n_encoder_samples)]
    for s in picks:
        def enc_step(s=s) -> None:
            out = encoder(s.pixel_values, s.image_grid_thw)
            if enc_part.trainable:
                out.float().sum().backward()
        wall, cpu = timed(enc_step)
        shape = ds.shape(s.sample_id)
        rows.append({"part": "encoder", "size": shape.vit_patches,
                     "flops": encoder_call_flops(enc_part, list(shape.vit_patches_per_image), spec),
                     "seconds": cpu, "wall_seconds": wall})

    # backbone: packed microbatches at each budget
    with torch.no_grad():
        embeds = [encoder(s.pixel_values, s.image_grid_thw) if s.pixel_values is not None else None for s in samples]
    lengths = [s.llm_tokens for s in samples]
    for budget in budgets:
        idx = _greedy_pack(lengths, budget)
        packed = backbone.pack([samples[i] for i in idx], [embeds[i] for i in idx], token_budget=budget)

        def bb_step(packed=packed, idx=idx) -> None:
            loss, _ = backbone(packed, [embeds[i] for i in idx])
            loss.backward()
        wall, cpu = timed(bb_step)
        rows.append({"part": "backbone", "size": budget,
                     "flops": backbone_call_flops(bb_part, budget, flash, [lengths[i] for i in idx]),
                     "seconds": cpu, "wall_seconds": wall})
    model.zero_grad(set_to_none=True)
    enc_rows = [r for r in rows if r["part"] == "encoder"]
    bb_rows = [r for r in rows if r["part"] == "backbone"]
    item_oh, enc_spf = _fit([r["flops"] for r in enc_rows], [r["seconds"] for r in enc_rows])
    mb_oh, bb_spf = _fit([r["flops"] for r in bb_rows], [r["seconds"] for r in bb_rows])
    spread = {"encoder": _spread(enc_rows, item_oh, enc_spf), "backbone": _spread(bb_rows, mb_oh, bb_spf)}
    calibration: dict[str, Any] = {"seconds_per_flop": {"encoder": enc_spf, "backbone": bb_spf},
                                   "item_overhead_s": item_oh, "microbatch_overhead_s": mb_oh, "spread": spread}
    if links and not on_device:  # two ranks on one accelerator would share it: the link needs two devices
        link_rows = measure_links()
        rows += link_rows
        calibration["link"] = fit_link(link_rows)
    return {
        "model": model_name, "data": data, "cluster": cluster,
        "device": acc.device_name if on_device else platform.processor() or platform.machine(),
        "clock": "device wall (synchronised)" if on_device else "thread CPU",
        "threads": torch.get_num_threads(), "dtype": ref.dtype, "rows": rows, "calibration": calibration,
    }


def _spread(rows: list[dict[str, Any]], overhead: float, rate: float, x: str = "flops") -> float:
    """Largest |measured / fitted - 1| over a part's rows: how far the one-rate model misses its own samples."""
    return float(max((abs(r["seconds"] / max(overhead + rate * r[x], 1e-30) - 1) for r in rows), default=0.0))


def _allreduce_times(rank: int, world: int, sizes: list[int], repeats: int) -> list[float]:
    import torch  # lazy: torch
    import torch.distributed as dist  # lazy: torch

    out = []
    for n in sizes:
        x = torch.ones(n // 4, dtype=torch.float32)
        dist.all_reduce(x)  # warm-up (connection set-up)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            best = min(best, time.perf_counter() - t0)
        out.append(best)
    return out


def measure_links(sizes: tuple[int, ...] = (1 << 12, 1 << 18, 1 << 21, 1 << 23), repeats: int = 5
                  ) -> list[dict[str, Any]]:
    """All-reduce times between two local ranks (the fastest of `repeats` per size, the slower rank's)."""
    from mindspeed_flow.utils.multiproc import run_ranks  # lazy: torch

    times = run_ranks(_allreduce_times, 2, list(sizes), repeats, timeout_s=120.0)
    return [{"part": "link", "size": n, "flops": 0.0, "seconds": max(t[i] for t in times),
             "wall_seconds": max(t[i] for t in times)} for i, n in enumerate(sizes)]


def fit_link(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Bandwidth (GB/s) and latency (us) from 2-rank all-reduces: t = bytes / bw + 2 latency."""
    lat2, inv_bw = _fit([float(r["size"]) for r in rows], [r["seconds"] for r in rows])
    return {"gbps": 1.0 / max(inv_bw, 1e-30) / 1e9, "latency_us": lat2 / 2.0 * 1e6,
            "spread": _spread(rows, lat2, inv_bw, x="size")}


def write_outputs(table: dict[str, Any], out: str, csv_path: str | None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["part", "size", "flops", "seconds", "wall_seconds"])
            w.writeheader()
            w.writerows(table["rows"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="mindspeed-flow profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("kv", nargs="*", help="model=..., data=..., cluster=...")
    ap.add_argument("--out", default="runs/profile/profile.json")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default="512,1024,2048")
    ap.add_argument("--no-links", action="store_true", help="skip the 2-rank collective measurement")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | npu | auto: where the model is timed (an "
                    "accelerator is timed by synchronised wall clock; the 2-rank link needs two devices and is "
                    "skipped on one)")
    args = ap.parse_args(argv)
    kv = dict(a.split("=", 1) for a in args.kv)
    table = measure(kv.get("model", "tiny_qwen2_vl"), kv.get("data", "infovqa_tiny"), kv.get("cluster", "cpu"),
                    [int(b) for b in args.budgets.split(",")], args.repeats, links=not args.no_links,
                    device=args.device)
    write_outputs(table, args.out, args.csv)
    cal = table["calibration"]
    for r in table["rows"]:
        print(f"  {r['part']:<8} size {r['size']:>6}: {r['flops'] / 1e9:8.3f} GFLOP in {r['seconds'] * 1e3:7.2f} ms "
              f"charged ({r['wall_seconds'] * 1e3:7.2f} ms wall)")
    print(f"clock: {table['clock']} on {table['device']}")
    spf = cal["seconds_per_flop"]
    print(f"calibration: encoder {1 / spf['encoder'] / 1e9:.2f} GFLOP/s + {cal['item_overhead_s'] * 1e3:.2f} ms/sample;"
          f" backbone {1 / spf['backbone'] / 1e9:.2f} GFLOP/s + {cal['microbatch_overhead_s'] * 1e3:.2f} ms/microbatch")
    sp = cal["spread"]
    print(f"fit spread (largest relative residual): encoder {100 * sp['encoder']:.1f}%, backbone "
          f"{100 * sp['backbone']:.1f}%")
    if "link" in cal:
        print(f"link (2-rank all-reduce): {cal['link']['gbps']:.3g} GB/s, {cal['link']['latency_us']:.3g} us latency")
    print(f"profile written to {args.out}  (plan with planner.profile={args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
