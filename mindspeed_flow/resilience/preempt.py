"""Triggered save: SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) saves a checkpoint and exits with
`EXIT_SAVED_ON_SIGNAL`.

A signal reaches ranks at different moments, and a DCP save is collective, so the ranks must agree on the step
after which they all save. The handler only records the signal; at the end of every step each rank posts an
async all_reduce(MAX) of its flag on its own gloo group and reads the result of the one posted `LAG` steps
earlier (long complete by then, so a rank running ahead, such as a frozen encoder, is held back by at most
`LAG` steps and never waits on the current one). Every rank reads the same reduced value at the same step, so
all save the same step and exit together.

The bound: a rank signalled during step s saves after step s + LAG at the latest, so the save ends within
(LAG + 1) step times plus one save after the signal (`stop_bound_s`). The launcher gives the workers
`trainer.stop_grace_s` seconds after it passes a signal on before it kills them (torchrun's default is 30 s); the
writer rank warns once when the bound, measured on this run's steps and saves, exceeds it. If a save is killed,
the previous periodic checkpoint is still the newest valid one (a save is only valid once its manifest is written).
"""
from __future__ import annotations

import signal
import time
from collections import deque
from typing import Any, Optional

import torch
import torch.distributed as dist

EXIT_SAVED_ON_SIGNAL = 75  # EX_TEMPFAIL: stopped on request, state saved, resume continues it
LAG = 2


class StopRequests:
    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.signum = 0
        self.signalled_at: Optional[float] = None  # time.monotonic() of the first signal this rank received
        self._posted: deque[tuple[torch.Tensor, Any]] = deque()
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopRequests":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def agreed(self) -> int:
        """Call once per step on every rank: the signal number all ranks agree to stop on now, or 0."""
        flag = torch.tensor([self.signum], dtype=torch.int64)
        self._posted.append((flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)))
        if len(self._posted) <= LAG:
            return 0
        flag, work = self._posted.popleft()
        work.wait()
        return int(flag.item())

    def close(self) -> None:
        """Complete what was posted (every rank posted the same number) and restore the previous handlers."""
        while self._posted:
            self._posted.popleft()[1].wait()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def stop_bound_s(step_seconds: float, save_seconds: float) -> float:
    """The longest a stop on a signal can take, from the signal to the saved checkpoint (see the module docstring)."""
    return (LAG + 1) * step_seconds + save_seconds
