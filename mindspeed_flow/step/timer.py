"""Busy and wait seconds of one rank over one step, the figures both hosts report per part.

"Wait" is time blocked on the other parts (a pool transfer, an embedding not yet produced); "busy" is the rest.
The torch host times its own compute (`timed("busy", ...)`); the MindSpeed-MM host does not run the compute
itself (Megatron's schedule does), so it times only its waits and counts the rest of the step as busy
(`busy_and_wait`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mindspeed_flow.telemetry.trace import span


@dataclass
class Timer:
    busy: float = 0.0
    wait: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        """Run `fn`, add its seconds to `kind` ("busy" or "wait") and record a trace span of that name."""
        t0 = time.perf_counter()
        try:
            with span(kind):
                return fn()
        finally:
            dt = time.perf_counter() - t0
            setattr(self, kind, getattr(self, kind) + dt)

    def waited(self, since: float) -> None:
        """Add the seconds from `since` (a `time.perf_counter()` reading) to now as waiting."""
        self.wait += time.perf_counter() - since

    def busy_and_wait(self) -> tuple[float, float]:
        """(busy, wait) with everything since the start that was not waiting counted as busy."""
        total = time.perf_counter() - self.start
        return max(total - self.wait, 0.0), self.wait
