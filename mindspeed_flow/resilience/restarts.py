"""Which failures a job restarts from, and how many restarts it has had.

`mindspeed-flow train` owns `trainer.max_restarts`: it runs torchrun's elastic agent with no restarts of its own,
one launch per attempt, and decides between attempts. A failure is restarted unless it is a deliberate stop, one
that a restart would only repeat or that the user asked for: workers that saved on SIGTERM/SIGINT and exited
`EXIT_SAVED_ON_SIGNAL`, `trainer.nan_policy=stop` (`NonFiniteLoss`), a refused resume (`ResumeRefused`), too many
bad samples, bad data. Only when every failed rank stopped deliberately is the job a deliberate stop: a rank killed
by a signal makes its peers fail with secondary errors, and those must still lead to a restart.

Workers learn their attempt from `MSF_RESTART_COUNT` (set by the launcher for each launch) or, under an outer
torchrun with its own restarts, from `TORCHELASTIC_RESTART_COUNT`; `restart_count()` adds both.
"""
from __future__ import annotations

import os
from typing import Any

from mindspeed_flow.resilience.preempt import EXIT_SAVED_ON_SIGNAL

RESTART_ENV = "MSF_RESTART_COUNT"
# Where a worker that fails with one of CLEAR_ERRORS writes its one line (the launcher sets it for each attempt, in
# the attempt's own temporary folder: the run directory may be the full disk the error is about).
CAUSE_ENV = "MSF_CAUSE_FILE"
# Error types (the worker's exception class names) that end a job without a restart.
DELIBERATE_ERRORS = ("NonFiniteLoss", "ResumeRefused", "TooManyBadSamples", "DataError")
# Errors the workers raise on purpose, with a message that says it all: the launcher prints that message alone,
# not the elastic agent's page of tracebacks (which it keeps for anything unexpected).
CLEAR_ERRORS = ("CheckpointSaveError", "TooManyBadSamples", "DataError", "PeerHang", "NonFiniteLoss",
                "ResumeRefused", "RunDirWriteError")


def restart_count() -> int:
    """How many times this job's workers were restarted before this attempt (0 in the first attempt)."""
    return int(os.environ.get(RESTART_ENV, "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def error_message(failure: Any) -> str:
    """What a failed worker raised, as `record` stored it: 'module.Class: message' ('' when it died by signal)."""
    return failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message or "")


def error_type(failure: Any) -> str:
    """The exception class name of a failed worker, '' if none."""
    message = error_message(failure)
    return message.split(":", 1)[0].rsplit(".", 1)[-1] if message else ""


def is_deliberate(exc: BaseException) -> bool:
    """True when every failed worker stopped on purpose (see the module docstring), or the launcher itself was
    signalled (the agent's SignalException): the job ends with that cause instead of restarting."""
    if type(exc).__name__ == "SignalException":
        return True
    failures = getattr(exc, "failures", None)
    if not failures:
        return False
    return all(f.exitcode == EXIT_SAVED_ON_SIGNAL or error_type(f) in DELIBERATE_ERRORS for f in failures.values())


def record_cause(exc: BaseException, rank: int) -> None:
    """A worker failing with one of `CLEAR_ERRORS` says so at once, first writer wins: its peers then fail with
    secondary errors (a reset connection) that can reach the elastic agent first, or be all it records when this
    worker is still tearing down as the agent stops the others."""
    if type(exc).__name__ in CLEAR_ERRORS:
        tell_launcher(f"rank {rank}: {type(exc).__name__}: {exc}")


def tell_launcher(line: str) -> None:
    """Leave the launcher the one line that ends this attempt (a clear error, a save on a signal); the first wins."""
    path = os.environ.get(CAUSE_ENV)
    if not path:
        return  # not under `mindspeed-flow train`'s launcher
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return  # another rank's line came first (or the temporary folder is gone)
    with os.fdopen(fd, "w") as f:
        f.write(line.strip() + "\n")
