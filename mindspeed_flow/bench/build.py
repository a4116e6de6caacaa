"""`mindspeed-flow bench build`: peak memory of building one rank's part vs the whole model, from a checkpoint.

    mindspeed-flow bench build [--family qwen2_vl] [--text-intermediate 131072] [--builds whole,encoder,backbone]
        [--json]

Saves a tiny-preset model whose LLM MLPs are widened to --text-intermediate (so the backbone dominates, as in
a real VLM) as a local safetensors checkpoint, then builds it three ways, each in a fresh spawned process:
the whole model, the encoder part only and the backbone part only (`build_vlm(..., parts=...)`, what the
runtime does per rank). It reports each build's peak resident-memory growth next to the parameter bytes of
each part: an encoder rank's peak should sit near the encoder's bytes, with no backbone parameter in it.
"""
from __future__ import annotations

import argparse
import tempfile
from typing import Any, Sequence

import torch

from mindspeed_flow.bench import bench_main
from mindspeed_flow.hosts.torch import hf_compat
from mindspeed_flow.hosts.torch.build import build_vlm, part_parameters
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.utils import rss

BUILDS = {"whole": ("encoder", "backbone"), "encoder": ("encoder",), "backbone": ("backbone",)}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench build", description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl", "llava"])
    p.add_argument("--text-intermediate", type=int, default=131072,
                   help="LLM MLP width (the tiny preset's is 128): makes the backbone the bulk of the model")
    p.add_argument("--builds", default=",".join(BUILDS), help=f"which builds to measure, of {list(BUILDS)}")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(list(argv))
    args.build_list = [b.strip() for b in args.builds.split(",") if b.strip()]
    if not args.build_list or any(b not in BUILDS for b in args.build_list):
        p.error(f"--builds {args.builds!r}: choose from {list(BUILDS)}")
    if args.text_intermediate < 1:
        p.error(f"--text-intermediate {args.text_intermediate} must be positive")
    return args


def checkpoint(family: str, text_intermediate: int, path: str) -> dict[str, int]:
    """Save the widened tiny model to `path`; returns the parameter bytes of each part."""
    cfg = hf_config_dict(family, "tiny", {"text_config": {"intermediate_size": text_intermediate}})
    model = build_vlm(family, cfg, seed=0, dtype=torch.float32)
    model.save_pretrained(path)
    return {part: sum(p.numel() * p.element_size() for p in params)
            for part, params in part_parameters(model, family).items()}


def _build(family: str, path: str, parts: tuple[str, ...]) -> dict[str, float]:
    baseline = rss.reset_peak()
    model = build_vlm(family, {}, seed=0, pretrained_path=path, parts=parts)
    real = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    return {"peak_bytes": rss.peak_bytes() - baseline, "materialized_bytes": real}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="msf-bench-build-") as tmp:
        part_bytes = checkpoint(args.family, args.text_intermediate, tmp)
        builds = {}
        for name in args.build_list:
            builds[name] = rss.in_fresh_process(_warm_then_build, args.family, tmp, BUILDS[name],
                                                what=f"bench build {name}")
    return {"family": args.family, "text_intermediate": args.text_intermediate, "part_bytes": part_bytes,
            "builds": builds}


def _warm_then_build(family: str, path: str, parts: tuple[str, ...]) -> dict[str, float]:
    hf_compat.family_classes(family)  # the library import and its lazy modules are not the build's memory
    return _build(family, path, parts)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(argv, parse_args, measure, _table)


def _table(report: dict[str, Any], args: argparse.Namespace) -> str:
    mib = 2.0 ** 20
    out: list[str] = []
    pb = report["part_bytes"]
    out.append(f"{args.family}, LLM MLP width {args.text_intermediate}: encoder {pb['encoder'] / mib:,.1f} MiB, "
               f"backbone {pb['backbone'] / mib:,.1f} MiB of parameters (fp32)")
    for name, b in report["builds"].items():
        out.append(f"  build {name:>8}: peak {b['peak_bytes'] / mib:,.1f} MiB above start, "
                   f"{b['materialized_bytes'] / mib:,.1f} MiB of parameters materialised")
    return "\n".join(out)
