"""Measuring on the machine at hand what the cost model's time calibration needs: the seconds of a call
(`time_call`, wall and CPU) and the share of a core that concurrent processes get right now (`core_share`).
Needs no torch: the planner stays importable without it.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Callable


def time_call(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> tuple[float, float]:
    """(wall, cpu) seconds of fn(): the fastest of `repeats` (after `warmup` calls) for each clock.

    CPU time of the calling thread is what the work costs on a core of its own; wall time also counts the time
    other processes held the core, so on a shared machine only the CPU time calibrates the model.
    """
    for _ in range(warmup):
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return min(walls), min(cpus)


def _busy_share(seconds: float, queue: Any) -> None:
    t0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - t0 < seconds:
        x += 1
    queue.put((time.thread_time() - c0) / (time.perf_counter() - t0))


def core_share(processes: int, seconds: float = 0.5) -> float:
    """Mean fraction of a core each of `processes` concurrent busy processes gets on this machine right now
    (1.0 on an idle machine with enough cores; less when they share cores with each other or other jobs)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_busy_share, args=(seconds, q)) for _ in range(processes)]
    for p in procs:
        p.start()
    shares = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    return sum(shares) / len(shares)
