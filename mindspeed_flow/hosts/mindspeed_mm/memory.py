"""Device memory around each forward-backward, and the step's shapes, for the planner's memory check.

With MSF_FLOW_MEMORY=1 every flow rank prints, after each forward-backward, the device bytes it held when the
step started (weights, gradient buffers, optimizer states and caches: what stays between steps), the peak before
the step (the previous update included) and the peak at its end, and the shapes the step ran: each decoder
microbatch's segments (tokens per packed sequence) and each encoder group's image grids (t, h, w patches). The
planner's memory model is evaluated on those shapes (`mindspeed-flow bench memory`). The device peak is never
reset, so the emulator's exit summary still reports the job's peak. Off (the default), nothing is recorded and
no device statistic is read.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

MEMORY_ENV = "MSF_FLOW_MEMORY"


def enabled() -> bool:
    return os.environ.get(MEMORY_ENV) == "1"


def record(shapes: dict[str, list], kind: str, value: Any) -> None:
    """Note one shape of the running step in `shapes` (the rank's `FlowContext.shapes`): "segments" (a decoder
    microbatch) or "images" (an encoder group)."""
    if enabled():
        shapes[kind].append(value)


def point() -> Optional[tuple[int, int]]:
    """(allocated, peak so far) device bytes when enabled, else None."""
    if not enabled():
        return None
    return int(torch.cuda.memory_allocated()), int(torch.cuda.max_memory_allocated())


def report(rank: int, part: str, step: int, before: Optional[tuple[int, int]], model: list,
           recorded: dict[str, list]) -> None:
    """The rank's line for one forward-backward (see the module docstring), with the parameters its model chunks
    hold (trainable, frozen: what the static memory is made of); clears the recorded shapes."""
    after = point()
    if before is None or after is None:
        return
    params = [p for chunk in model for p in chunk.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    shapes = {k: list(v) for k, v in recorded.items() if v}
    for v in recorded.values():
        v.clear()
    print(f"[flow] rank {rank} ({part}) memory step {step}: at start {before[0]} bytes, peak before {before[1]} "
          f"bytes, peak after forward-backward {after[1]} bytes, at end {after[0]} bytes, parameters {trainable} "
          f"trainable {frozen} frozen, shapes "
          f"{json.dumps(shapes, separators=(',', ':'))}", flush=True)
