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
import json
import multiprocessing as mp
import tempfile
from typing import Any, Sequence

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
    import torch

    from mindspeed_flow.hosts.torch.build import build_vlm, part_parameters
    from mindspeed_flow.model_presets import hf_config_dict

    cfg = hf_config_dict(family, "tiny", {"text_config": {"intermediate_size": text_intermediate}})
    model = build_vlm(family, cfg, seed=0, dtype=torch.float32)
    model.save_pretrained(path)
    return {part: sum(p.numel() * p.element_size() for p in params)
            for part, params in part_parameters(model, family).items()}


def _build(family: str, path: str, parts: tuple[str, ...], out: Any) -> None:
    from mindspeed_flow.hosts.torch.build import build_vlm

    baseline = rss.reset_peak()
    model = build_vlm(family, {}, seed=0, pretrained_path=path, parts=parts)
    real = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    out.put({"peak_bytes": rss.peak_bytes() - baseline, "materialized_bytes": real})


def measure(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # fresh processes: the transformers import is paid before the baseline
    with tempfile.TemporaryDirectory(prefix="msf-bench-build-") as tmp:
        part_bytes = checkpoint(args.family, args.text_intermediate, tmp)
        builds = {}
        for name in args.build_list:
            parts = BUILDS[name]
            queue = ctx.Queue()
            proc = ctx.Process(target=_warm_then_build, args=(args.family, tmp, parts, queue))
            proc.start()
            builds[name] = queue.get()
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"bench build: the {name!r} build exited with {proc.exitcode}")
    return {"family": args.family, "text_intermediate": args.text_intermediate, "part_bytes": part_bytes,
            "builds": builds}


def _warm_then_build(family: str, path: str, parts: tuple[str, ...], out: Any) -> None:
    import transformers  # noqa: F401  (library import and its lazy modules are not the build's memory)

    from mindspeed_flow.hosts.torch import hf_compat

    hf_compat.family_classes(family)
    _build(family, path, parts, out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    report = measure(args)
    if args.json:
        print(json.dumps(report))
        return 0
    mib = 2.0 ** 20
    pb = report["part_bytes"]
    print(f"{args.family}, LLM MLP width {args.text_intermediate}: encoder {pb['encoder'] / mib:,.1f} MiB, "
          f"backbone {pb['backbone'] / mib:,.1f} MiB of parameters (fp32)")
    for name, b in report["builds"].items():
        print(f"  build {name:>8}: peak {b['peak_bytes'] / mib:,.1f} MiB above start, "
              f"{b['materialized_bytes'] / mib:,.1f} MiB of parameters materialised")
    return 0
