"""Protected run directories: one run per directory, identified by a run id.

`RUN_DIR/run.json` names the run that owns the directory. The launcher claims the directory before it writes
anything: a directory that already holds a run's state (config.yaml, metrics.jsonl, run.json or checkpoints) is
refused unless the user continues that run (`trainer.resume=true`, which keeps its run id) or starts over on
purpose (`trainer.overwrite=true`, which gives a new run id and moves the old run's files, unchanged, under
`RUN_DIR/replaced/<old run id>/`). Checkpoints carry the run id in their manifest, so keep-last deletes only its
own run's checkpoints and a resume never loads another run's weights.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Optional

RUN_FILE = "run.json"
# What a run leaves in its directory; any of these means "another run's state is here".
STATE_NAMES = ("run.json", "config.yaml", "metrics.jsonl", "checkpoints", "checkpoints.jsonl", "failure.txt",
               "tensorboard", "trace", "trace.json", "curves.png", "timeline.png")
REPLACED = "replaced"


class RunDirInUse(RuntimeError):
    """The run directory holds another run's state and the recipe neither resumes nor overwrites it."""


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def read_run_id(run_dir: Path) -> Optional[str]:
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        return None
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RunDirInUse(f"{path} is not a valid run file ({exc}); it names the run that owns {run_dir}. "
                          "Restore it or choose another run_dir") from None


def write_run_id(run_dir: Path, run_id: str, **info: object) -> None:
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"run_id": run_id, **info}, indent=2) + "\n")
    os.replace(tmp, path)  # never a half-written run file


def existing_state(run_dir: Path) -> list[str]:
    """The names of a previous run's files in `run_dir` (an empty checkpoints/ folder does not count)."""
    found = []
    for name in STATE_NAMES:
        p = Path(run_dir) / name
        if p.is_dir():
            if any(p.iterdir()):
                found.append(f"{name}/")
        elif p.exists():
            found.append(name)
    return found


def archive(run_dir: Path, old_id: Optional[str]) -> Path:
    """Move a previous run's state under RUN_DIR/replaced/<its run id>/: overwriting never deletes a file."""
    dest = Path(run_dir) / REPLACED / (old_id or f"unnamed-{new_run_id()}")
    dest.mkdir(parents=True, exist_ok=False)
    for name in STATE_NAMES:
        if (Path(run_dir) / name).exists():
            os.replace(Path(run_dir) / name, dest / name)
    print(f"[mindspeed-flow] trainer.overwrite=true: the previous run in {run_dir} was moved to {dest}", flush=True)
    return dest


def claim(run_dir: Path, *, resume: bool, overwrite: bool, experiment: str = "") -> str:
    """Take `run_dir` for this run and return the run id (see the module docstring); nothing is written on refusal."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirInUse(f"run_dir={str(run_dir)!r} exists and is not a directory")
    state = existing_state(run_dir) if run_dir.is_dir() else []
    old_id = read_run_id(run_dir)
    if state and resume:
        if old_id is not None:
            return old_id
        run_id = new_run_id()  # a directory from before run ids: its checkpoints carry none and are ignored
    elif state and not overwrite:
        raise RunDirInUse(
            f"run_dir={str(run_dir)!r} already holds a run ({', '.join(state)}"
            f"{f'; run id {old_id}' if old_id else ''}). Continue it with trainer.resume=true, or start a new run "
            f"there with trainer.overwrite=true (the old run is moved to {run_dir / REPLACED}/), "
            "or choose another run_dir")
    else:
        run_id = new_run_id()
        if state:
            archive(run_dir, old_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_id(run_dir, run_id, experiment=experiment, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 replaces=old_id if state and old_id else None)
    return run_id


class RunDirLock:
    """An exclusive lock on RUN_DIR/.lock held by the launch that uses the directory, for as long as it runs: a second
    launch on the same run directory (two `trainer.resume=true` after one failure, from two shells) is refused
    before it reads or writes anything of the run. `flock` locks belong to the open file, so the lock goes with
    the process that holds it, even when it is killed (no stale lock to clean up); the forked workers share it.
    The file holds who took it, for the refusal message. On NFS, flock is served by the lock manager (NFSv4, or
    v3 with `lockd`)."""

    NAME = ".lock"

    def __init__(self) -> None:
        self._file: Optional[Any] = None

    def acquire(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise RunDirInUse(f"run_dir={str(run_dir)!r} exists and is not a directory")
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(run_dir / self.NAME, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise RunDirInUse(f"run_dir={str(run_dir)!r} is in use by another launch ({holder}); wait for it to end "
                              "(or stop it), or choose another run_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()  # nobody holds it now (an empty file is a free directory)
            self._file.close()  # closing the last descriptor of the open file releases the lock
            self._file = None
