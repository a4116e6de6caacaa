"""Fault drills from the recipe (`faults.*`): the failures a long run meets, on demand, in a real job.

Each drill fires in the first attempt only (`restart_count() == 0`), so a job with
`trainer.max_restarts >= 1` shows the recovery: the launcher restarts the workers and they resume from the
newest verified checkpoint. Kill and hang act on the process itself (SIGKILL, SIGSTOP), exactly as an OOM kill or
a wedged device would; the slow-step drill makes every step long (for the stop-on-signal bound); the loader drill raises where the step reads its batch; NaN multiplies one rank's gradients by NaN for one step; ENOSPC swaps DCP's file system for one whose writes fail as a full disk does; truncation
cuts a finished checkpoint's file in half, as a crash of the storage layer would.
"""
from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from mindspeed_flow.resilience.restarts import restart_count


class StepHooks:
    """The one place a trainer lets something act on its step loop; every hook does nothing here. The loop calls,
    per step: `at_step_start`, the step inside `during_step`, `before_save` / `after_save` around a checkpoint,
    then `after_step`."""

    def at_step_start(self, step: int, watchdog: Any = None) -> None:
        """Before the step reads its batch."""

    @contextlib.contextmanager
    def during_step(self, step: int, params: Iterable[Any]) -> Iterator[None]:
        """Around the step's forward, backward and update (`params`: the rank's parameters)."""
        yield

    def before_save(self, step: int, checkpointer: Any) -> None:
        """Before a checkpoint of `step` is written."""

    def after_save(self, step: int, checkpointer: Any) -> None:
        """After a checkpoint of `step` was written (or its save failed and training goes on)."""

    def after_step(self, step: int) -> None:
        """At the end of the step, after any save."""


class FaultDrills(StepHooks):
    """The recipe's fault drills as the trainer's step hooks."""

    def __init__(self, cfg: Any, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.armed = restart_count() == 0

    def _fires(self, rank: int, step: int, now: int) -> bool:
        return self.armed and step >= 0 and step == now and rank == self.rank

    def at_step_start(self, step: int, watchdog: Any = None) -> None:
        c = self.cfg
        if c.slow_step_s > 0:
            time.sleep(c.slow_step_s)
        if self._fires(c.kill_rank, c.kill_step, step):
            print(f"[mindspeed-flow] fault drill: SIGKILL rank {self.rank} at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        hung = [r for r in (c.hang_rank, *c.hang_ranks) if r >= 0]
        if any(self._fires(r, c.hang_step, step) for r in hung):
            print(f"[mindspeed-flow] fault drill: SIGSTOP rank {self.rank} at step {step}", flush=True)
            if watchdog is not None:
                watchdog.flush()  # a real hang strikes mid-step, after the heartbeat has told where it is
            self._stop_together(hung, step)
            os.kill(os.getpid(), signal.SIGSTOP)
        self._loader_error(step)

    def _stop_together(self, ranks: list[int], step: int) -> None:
        """Ranks that stop together (a whole node) meet before they stop: on a busy machine one of them could
        otherwise reach the step seconds after another, long enough to watch it stop and report it, which a node
        stopping at once never shows. They meet through files in the attempt's own temporary folder (the launcher
        gives each attempt one; the ranks share a host here), with their heartbeats still running."""
        if len(ranks) < 2:
            return
        folder = Path(tempfile.gettempdir())
        (folder / f"msf-drill-hang-{step}-{self.rank}").touch()
        deadline = time.monotonic() + 300  # a rank listed that never comes (not in the world) stops the wait
        while not all((folder / f"msf-drill-hang-{step}-{r}").exists() for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.02)

    @contextlib.contextmanager
    def during_step(self, step: int, params: Iterable[Any]) -> Iterator[None]:
        """This rank's gradients turn NaN during step `nan_step`."""
        if not self._fires(self.cfg.nan_rank, self.cfg.nan_step, step):
            yield
            return
        print(f"[mindspeed-flow] fault drill: NaN gradients on rank {self.rank} at step {step}", flush=True)
        hooks = [p.register_hook(lambda g: g * float("nan")) for p in params if p.requires_grad]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def _loader_error(self, step: int) -> None:
        """Raise in this rank's data loading at step `loader_error_step` (a reader bug, a vanished mount)."""
        if self._fires(self.cfg.loader_error_rank, self.cfg.loader_error_step, step):
            print(f"[mindspeed-flow] fault drill: data loader error on rank {self.rank} at step {step}", flush=True)
            raise RuntimeError(f"fault drill: the data loader of rank {self.rank} failed at step {step}")

    def after_step(self, step: int) -> None:
        """SIGTERM this rank after step `sigterm_step` (a preemption notice reaching one rank first)."""
        if self._fires(self.cfg.sigterm_rank, self.cfg.sigterm_step, step):
            print(f"[mindspeed-flow] fault drill: SIGTERM rank {self.rank} after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def before_save(self, step: int, checkpointer: Any) -> None:
        """The save of step `enospc_step` meets a full disk."""
        checkpointer.fail_next_with_enospc = self.armed and self.cfg.enospc_step == step

    def after_save(self, step: int, checkpointer: Any) -> None:
        """Truncate a file of the checkpoint of `step` once it is complete (manifest written)."""
        if not (self.armed and self.cfg.truncate_step == step):
            return
        checkpointer.wait()
        if self.rank != 0:
            return
        folder = Path(checkpointer.root) / f"step-{step}"
        names = sorted(p for p in folder.iterdir() if p.name.endswith(".distcp")) \
            if self.cfg.truncate_file == "distcp" else [folder / ".metadata"]
        victim = names[0]
        size = victim.stat().st_size
        os.truncate(victim, size // 2)
        print(f"[mindspeed-flow] fault drill: truncated {victim} from {size} to {size // 2} bytes", flush=True)
