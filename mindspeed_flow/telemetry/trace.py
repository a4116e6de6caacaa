"""Step timelines in Chrome trace JSON (opens in Perfetto / chrome://tracing) when `trainer.trace=true`.

One process-wide `Tracer` per rank, installed by the worker; the engine and the pool mark their work with
`@traced("name")` and `span("name")`, which cost one global lookup when tracing is off. Events are complete
("X") events on wall-clock time (time.time(), so the ranks of one host line up), with the part as the trace
process (encoder / backbone / coupled tracks) and the rank as its thread, and the step in `args`. Each rank writes
RUN_DIR/trace/rank-NNNNN.json; the metrics writer merges them into RUN_DIR/trace.json at the end of the run.
"""
from __future__ import annotations

import contextlib
import functools
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

F = TypeVar("F", bound=Callable[..., Any])
PART_PIDS = {"encoder": 1, "backbone": 2, "coupled": 3}
_TRACER: Optional["Tracer"] = None


class Tracer:
    """Collects one rank's events in memory (a few per sample and microbatch) and writes them once."""

    def __init__(self, rank: int, part: str, out_dir: Path) -> None:
        self.rank, self.part, self.pid = rank, part, PART_PIDS.get(part, 0)
        self.path = out_dir / f"rank-{rank:05d}.json"
        self.step: Optional[int] = None
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": self.pid, "args": {"name": part}},
            {"ph": "M", "name": "process_sort_index", "pid": self.pid, "args": {"sort_index": self.pid}},
            {"ph": "M", "name": "thread_name", "pid": self.pid, "tid": rank, "args": {"name": f"rank {rank}"}},
        ]

    def complete(self, name: str, start: float, end: float, cat: str = "") -> None:
        """An event from `start` to `end` (time.time() seconds)."""
        self.events.append({"ph": "X", "name": name, "cat": cat or name.split(".")[0], "ts": start * 1e6,
                            "dur": max(end - start, 0.0) * 1e6, "pid": self.pid, "tid": self.rank,
                            "args": {"step": self.step}})

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        return self.path


def install(tracer: Optional[Tracer]) -> None:
    global _TRACER
    _TRACER = tracer


def current() -> Optional[Tracer]:
    return _TRACER


def set_step(step: int) -> None:
    if _TRACER is not None:
        _TRACER.step = step


@contextlib.contextmanager
def span(name: str, cat: str = "") -> Iterator[None]:
    tracer = _TRACER
    if tracer is None:
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        tracer.complete(name, start, time.time(), cat)


def traced(name: str) -> Callable[[F], F]:
    """Decorator: the call becomes a `name` event while a tracer is installed."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if _TRACER is None:
                return fn(*args, **kwargs)
            with span(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def merge(trace_dir: Path, out: Path, world_size: Optional[int] = None) -> Path:
    """One trace of every rank's file in `trace_dir` (the per-rank files stay); with `world_size`, only the files
    of ranks 0..world_size-1 (an earlier, larger run's files in the same folder are not this run's)."""
    events: list[dict[str, Any]] = []
    for path in sorted(trace_dir.glob("rank-*.json")):
        if world_size is None or int(path.stem.split("-")[1]) < world_size:
            events.extend(json.loads(path.read_text())["traceEvents"])
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


def finish(run_dir: Path, group: Any, merger: bool, world_size: int) -> Optional[Path]:
    """End of a run, on every rank of `group` (all ranks), traced or not: each rank saves its events, and once
    every rank has (a barrier over `group`) the `merger` rank writes RUN_DIR/trace.json. Returns its path there."""
    if _TRACER is not None:
        _TRACER.save()
    dist.barrier(group=group)
    if merger and _TRACER is not None:
        return merge(run_dir / "trace", run_dir / "trace.json", world_size)
    return None
