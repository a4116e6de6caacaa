"""Peak resident memory of this process on Linux, resettable: what bounds a CPU rank, and the CPU stand-in for
a device allocator's peak in the memory benches (`bench attention`, `bench build`).

`reset_peak()` writes 5 to /proc/self/clear_refs, which resets VmHWM to the current resident set (Linux >= 4.0),
so `peak_bytes() - baseline` is the peak growth of whatever ran in between. Run each measured piece in a fresh
process: pages freed by an earlier piece may be reused without the resident set growing.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable


def _status_kb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (peak-memory figures on the CPU need Linux)")


def current_bytes() -> float:
    return _status_kb("VmRSS") * 1024.0


def peak_bytes() -> float:
    return _status_kb("VmHWM") * 1024.0


def reset_peak() -> float:
    """Reset the peak to the current resident set; returns that baseline in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return current_bytes()


def _call_and_put(fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    queue.put(fn(*args))


def in_fresh_process(fn: Callable[..., Any], *args: Any, what: str) -> Any:
    """`fn(*args)` in a newly spawned process (no pages freed by earlier work to reuse); returns its result.
    `fn` must be importable (module level) and its result picklable."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_call_and_put, args=(fn, args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{what}: the measuring process exited with {proc.exitcode}")
    return result
