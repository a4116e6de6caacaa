"""`mindspeed-flow bench msmm`: the MindSpeed-MM flow job at a larger tiny scale, decoder layouts and encoder bound
side by side.

    mindspeed-flow bench msmm [--size 72b] [--samples 96] [--global-batch 32] [--iters 3] [--workdir DIR] [--json]

Runs MindSpeed-MM's own `pretrain_vlm.py` (the pinned sources, `MINDSPEED_MM_HOME` etc. or the archive
`scripts/run_mindspeed_mm_tests.sh` unpacks) under the emulated NPU as flow jobs (encoder 1 + decoder DP 2) on a
scaled MindSpeed-MM example config (`--size`, its ViT made trainable) and a user-like data set of mixed image sizes
(0-2 images per sample), in three variants on the same samples:

- "rows, whole step, whole reads": padded rows (`packing.layout: rows`), an encoder that keeps every group of the
  step until its gradients return (`flow.encoder_inflight` = 1024) and every rank reading whole global batches,
  pixels included (`MSF_FLOW_DATA_READS=whole`): how the flow job ran before packed microbatches, the bound and
  the metadata index;
- "packed, bounded, whole reads": packed (THD) rows and the default bound (decoder PP + 1 groups), whole reads;
- "packed, bounded, index reads": the same, each rank loading only what its side uses (the default).

Per variant it prints: padding of the decoder's microbatches (mean over iterations), iteration time (median),
the encoder's peak groups and saved-activation bytes held (largest over iterations), and per rank the samples and
bytes of pixels it loaded and its peak resident host memory (each rank's exit line).
Needs the emulation environment (`scripts/setup_emulate_env.sh`); each variant is one job of a few minutes.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

from mindspeed_flow.bench import bench_main

# name: (decoder layout, flow.encoder_inflight, MSF_FLOW_DATA_READS)
VARIANTS = {"rows, whole step, whole reads": ("rows", 1024, "whole"),
            "packed, bounded, whole reads": ("packed", 0, "whole"),
            "packed, bounded, index reads": ("packed", 0, "index")}
WIDTH = 30
ENC = {"dp": 1, "tp": 1}
DEC = {"dp": 2, "tp": 1, "pp": 1}
_READ = re.compile(r"\[mindspeed-flow\] rank (\d+) \((\w+)[^)]*\) read (\d+) samples, (\d+) bytes of pixels; "
                   r"peak host memory (\d+) MiB")
_FLOW = re.compile(r"\[flow\] iteration (\d+) \|(.*)")
_PAD = re.compile(r"padding ([\d.]+)%")
_HELD = re.compile(r"encoder held (\d+) groups (\d+) bytes")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench msmm", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="72b", help="MindSpeed-MM qwen2.5vl example config to scale down")
    p.add_argument("--samples", type=int, default=96, help="samples in the user-like data set")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where the tiny processor, data and configs go (default: temp)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(list(argv))


def _write_recipe(path: Path, layout: str, inflight: int) -> Path:
    path.write_text("# mindspeed-flow bench msmm\n"
                    f"parallel:\n  encoder: {{dp: {ENC['dp']}, tp: {ENC['tp']}, pp: 1, cp: 1}}\n"
                    f"  backbone: {{dp: {DEC['dp']}, tp: {DEC['tp']}, pp: {DEC['pp']}, cp: 1}}\n"
                    f"packing:\n  token_budget: 512\n  layout: {layout}\n"
                    f"flow:\n  encoder_inflight: {inflight}\n")
    return path


def _summary(output: str, times_ms: list[float]) -> dict[str, Any]:
    flow = _FLOW.findall(output)
    padding = [float(_PAD.search(rest).group(1)) for _, rest in flow if _PAD.search(rest)]
    held = [tuple(int(v) for v in _HELD.search(rest).groups()) for _, rest in flow if _HELD.search(rest)]
    ranks = {int(r): {"part": part, "samples": int(n), "pixel_bytes": int(b), "peak_mib": int(m)}
             for r, part, n, b, m in _READ.findall(output)}
    return {"padding_pct": statistics.fmean(padding) if padding else None,
            "iteration_ms": statistics.median(times_ms[1:] or times_ms) if times_ms else None,
            "encoder_held_groups": max((g for g, _ in held), default=None),
            "encoder_held_bytes": max((b for _, b in held), default=None),
            "ranks": ranks}


def measure(args: argparse.Namespace) -> dict:
    from mindspeed_flow.emulation import tiny  # lazy: emulation
    from mindspeed_flow.emulation.jobs import TinyJob, emulate_job  # lazy: emulation
    from mindspeed_flow.emulation.scaled import scaled_model_json, write_user_like_data_json  # lazy: emulation
    from mindspeed_flow.emulation.sources import find_sources  # lazy: emulation

    sources = find_sources()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="msf-bench-msmm-")).resolve()
    tiny.prepare_workdir(workdir)
    data = write_user_like_data_json(workdir, n_samples=args.samples)
    model = scaled_model_json(sources.mindspeed_mm.root, args.size, workdir,
                              **{"image_encoder.vision_encoder.freeze": False})
    report: dict[str, Any] = {"size": args.size, "global_batch": args.global_batch, "iters": args.iters,
                              "layout": "encoder 1 + decoder DP 2", "variants": {}}
    reads_before = os.environ.get("MSF_FLOW_DATA_READS")
    for name, (layout, inflight, reads) in VARIANTS.items():
        tag = f"{layout}_{reads}"
        recipe = _write_recipe(workdir / f"bench_{tag}.yaml", layout, inflight)
        job = TinyJob(model, data, train_iters=args.iters, global_batch_size=args.global_batch, seq_length=512,
                      extra=["--variable-seq-lengths", "--calculate-per-token-loss"])
        os.environ["MSF_FLOW_DATA_READS"] = reads
        try:
            result = emulate_job(f"bench_{tag}", job.argv(), log_dir=workdir, nproc=3, flow_recipe=recipe)
        finally:
            if reads_before is None:
                os.environ.pop("MSF_FLOW_DATA_READS", None)
            else:
                os.environ["MSF_FLOW_DATA_READS"] = reads_before
        if result.rc != 0:
            raise SystemExit(f"bench msmm: the {name!r} job failed (rc={result.rc}):\n{result.output[-3000:]}")
        report["variants"][name] = _summary(result.output, result.times_ms)
    return report


def _mb(n: Any) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.2f}"


def table(report: dict, args: argparse.Namespace) -> str:
    names = list(report["variants"])
    rows = [f"MindSpeed-MM flow job, scaled {report['size']}, {report['layout']}, global batch "
            f"{report['global_batch']}, {report['iters']} iterations (emulated NPU, host CPU)", ""]
    head = f"{'':<34}" + "".join(f"{n:>{WIDTH}}" for n in names)
    rows.append(head)

    def line(label: str, values: list[str]) -> None:
        rows.append(f"{label:<34}" + "".join(f"{v:>{WIDTH}}" for v in values))

    v = [report["variants"][n] for n in names]
    line("decoder padding (mean %)", [f"{x['padding_pct']:.2f}" if x["padding_pct"] is not None else "-" for x in v])
    line("iteration (median ms)", [f"{x['iteration_ms']:.0f}" if x["iteration_ms"] else "-" for x in v])
    line("encoder groups held (peak)", [str(x["encoder_held_groups"]) for x in v])
    line("encoder activations held (MiB)", [_mb(x["encoder_held_bytes"]) for x in v])
    for rank in sorted(v[0]["ranks"]):
        part = v[0]["ranks"][rank]["part"]
        line(f"rank {rank} ({part}) pixels read (MiB)", [_mb(x["ranks"].get(rank, {}).get("pixel_bytes")) for x in v])
        line(f"rank {rank} ({part}) peak host (MiB)", [str(x["ranks"].get(rank, {}).get("peak_mib", "-")) for x in v])
    a, b = v[0], v[-1]
    if a["encoder_held_bytes"] and b["encoder_held_bytes"]:
        rows.append("")
        rows.append(f"encoder activations held: {b['encoder_held_bytes'] / a['encoder_held_bytes']:.2f}x of "
                    f"'{names[0]}'; padding {a['padding_pct']:.2f}% -> {b['padding_pct']:.2f}%")
    if a["ranks"] and b["ranks"]:
        total = [sum(r.get("pixel_bytes", 0) for r in x["ranks"].values()) for x in (a, b)]
        rows.append(f"pixels read, all ranks: {_mb(total[0])} MiB -> {_mb(total[1])} MiB")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(argv, parse_args, measure, table)
