"""Hang watchdog: a peer that stops answering becomes an error naming it, within `flow.timeout_s`.

A dead rank is found by the elastic agent at once (its process exits), but a hung one (a wedged device, a
SIGSTOPped or swapped-out process) keeps its sockets open: its peers block in a collective or a pool receive
until their own timeouts, and the agent then waits another 30 s for the stuck process to obey SIGTERM. Here
every rank's background thread bumps a heartbeat in the job's TCPStore (its own client connection, so it never
shares a socket with the process groups) with its side (encoder/backbone) and what it is doing (`activity`,
set by the step loop). Ranks 0 and 1 watch everyone: a heartbeat that has not changed for half of `timeout_s`
by the watcher's own clock (no cross-host clock needed) is a hang; half, so the report comes before the peers'
own receive timeouts (`timeout_s`), which could only say that something did not arrive. Every other rank watches
the two watchers only (two store reads per interval, whatever the world size); when both have stopped (a whole
first node), it watches the ranks below it too, and the lowest rank whose lower ranks all stopped reports: so
exactly one rank reports, whichever ranks stop. The reporting rank prints one line naming each stopped rank, its
side, where it stopped and what the reporting rank is waiting for, then SIGKILLs the stuck processes on its host
(a stopped process ignores SIGTERM) or exits itself with `EXIT_HANG`, so the job ends (or, with
`trainer.max_restarts`, restarts). The line also goes to
`RUN_DIR/failure.txt`: the peers then fail on a connection the kill reset, and the launcher reports the hang as
the job's cause rather than their consequential errors.
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

EXIT_HANG = 3
FAILURE_FILE = "failure.txt"
WATCHERS = (0, 1)


class Watchdog:
    def __init__(self, rank: int, world: int, side: str, timeout_s: float, *, attempt: int = 0,
                 report_path: Optional[Path] = None, watchers: tuple[int, ...] = WATCHERS) -> None:
        self.rank, self.world, self.side = rank, world, side
        self.watchers = tuple(sorted(set(watchers)))
        self.report_path = report_path
        self.timeout_s = float(timeout_s)
        self.interval = max(0.05, min(1.0, self.timeout_s / 10))
        self.prefix = f"msf_heartbeat/{attempt}/"
        self._activity = "starting"
        self._last_beat = 0.0
        self.stale_after = max(3 * self.interval, self.timeout_s / 2)
        self._seq = 0
        self._reported = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def activity(self) -> str:
        return self._activity

    @activity.setter
    def activity(self, value: str) -> None:
        """What this rank does now. A change is published early (at most every quarter second, so a job of many
        ranks does not flood the store), so a rank that stops between two heartbeats is reported doing what it
        did when it stopped, not what it did up to a heartbeat interval before."""
        self._activity = value
        if time.monotonic() - self._last_beat > 0.25:
            self._wake.set()

    def start(self) -> "Watchdog":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=max(30.0, self.timeout_s)))
        self._beat(store)
        self._thread = threading.Thread(target=self._run, args=(store,), name="mindspeed-flow-watchdog",
                                        daemon=True)
        self._thread.start()
        # A job that never calls stop() (the MindSpeed-MM flow job ends inside Megatron's own loop) must still not
        # leave the thread inside a store call when the interpreter finalizes: a daemon thread that comes back from
        # C++ with the GIL released after finalization is ended by pthread_exit, whose unwinding through pybind11's
        # noexcept GIL guard aborts the process ("terminate called without an active exception", exit -6) after
        # a run that succeeded. atexit runs before finalization, while the thread can still be joined.
        atexit.register(self.stop)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the heartbeat thread and wait for it (it is between store calls within one interval; a store call
        to a live store returns in milliseconds, to a dead one it fails at once)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout_s)
        atexit.unregister(self.stop)

    def flush(self) -> None:
        """Publish the current activity now (waits for the heartbeat thread, at most a few intervals)."""
        seq, deadline = self._seq, time.monotonic() + 5 * self.interval
        self._wake.set()
        while self._seq == seq and time.monotonic() < deadline and self._thread is not None \
                and self._thread.is_alive():
            time.sleep(0.01)

    def _beat(self, store: object) -> None:
        self._last_beat = time.monotonic()
        self._seq += 1
        store.set(self.prefix + str(self.rank),  # type: ignore[attr-defined]
                  f"{self._seq}|{self.side}|{os.getpid()}|{socket.gethostname()}|{self.activity}")

    def _run(self, store: object) -> None:
        seen: dict[int, tuple[bytes, float]] = {}
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat(store)
                if not self._reported:
                    self._watch(store, seen)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending; the watchdog ends with it
                return

    def _watch(self, store: object, seen: dict[int, tuple[bytes, float]]) -> None:
        now = time.monotonic()
        watchers = [w for w in self.watchers if w < self.world]

        def stale(r: int) -> bool:
            return r in seen and now - seen[r][1] > self.stale_after

        if self.rank in watchers:
            ranks: list[int] = list(range(self.world))
        elif watchers and all(stale(w) for w in watchers):
            ranks = list(range(self.rank))  # the watchers stopped: is every rank below this one stopped too?
        else:
            ranks = watchers
        for r in ranks:
            if r == self.rank or not store.check([self.prefix + str(r)]):  # type: ignore[attr-defined]
                continue
            value = store.get(self.prefix + str(r))  # type: ignore[attr-defined]
            if r not in seen or seen[r][0] != value:
                seen[r] = (value, now)
        stopped = sorted(r for r in seen if stale(r))
        if self.rank in watchers:  # the lowest watcher that is itself alive reports
            alive_watchers = [w for w in watchers if w not in stopped]
            mine = bool(stopped) and alive_watchers[0] == self.rank
        else:  # both watchers stopped: the lowest rank still alive reports
            mine = bool(watchers) and all(stale(r) for r in range(self.rank))
        if mine:
            self._report({r: seen[r] for r in stopped}, now)

    def _report(self, hung: dict[int, tuple[bytes, float]], now: float) -> None:
        self._reported = True
        parts, procs = [], []
        for r, (value, since) in sorted(hung.items()):
            _, side, pid, host, activity = value.decode().split("|", 4)
            parts.append(f"rank {r} ({side}) stopped answering {now - since:.1f} s ago during {activity}")
            procs.append((int(pid), host))
        them = "it" if len(hung) == 1 else "them"
        line = (f"hang: {'; '.join(parts)} (flow.timeout_s={self.timeout_s:g}); rank {self.rank} ({self.side}) is "
                f"waiting for {them} in {self.activity}. "
                + (f"The process (pid {procs[0][0]} on {procs[0][1]}) is" if len(procs) == 1 else
                   f"The processes ({', '.join(f'pid {p} on {h}' for p, h in procs)}) are")
                + " alive but stuck, not dead: stopping the job")
        print(f"[mindspeed-flow] {line}", file=sys.stderr, flush=True)
        if self.report_path is not None:  # the launcher prints it as the job's cause, not the peers' errors
            try:
                self.report_path.write_text(line + "\n")
            except OSError:
                pass
        killed_all = True
        for pid, host in procs:
            try:
                if host != socket.gethostname():
                    raise OSError("on another host")
                os.kill(pid, signal.SIGKILL)
            except OSError:
                killed_all = False
        if not killed_all:  # a stuck process out of reach: this rank's exit ends the job
            os._exit(EXIT_HANG)
