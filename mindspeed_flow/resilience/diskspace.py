"""A full disk (or a quota, or an I/O error) while a run writes its own files: one error that names the file, the
free space and what is still safe, instead of the secondary failures it causes on other ranks.

A write into the run directory that fails (metrics.jsonl, its resume rewrite) is raised as `RunDirWriteError`; the
launcher prints it as the job's cause in one line, even when a peer's "connection closed" has an earlier timestamp.
A failed checkpoint save removes its own partial folder (it never had a manifest, so it never counted) so that a
full disk is not kept full by the save that failed. A resume is refused at launch, before any process starts, when
the run directory's file system has less room than the newest checkpoint takes and the run saves checkpoints: the
next save would fail there, after the restore and the redone steps.
"""
from __future__ import annotations

import shutil
from pathlib import Path


class RunDirWriteError(RuntimeError):
    """Writing one of the run's own files failed (no space left, quota, I/O error); what was written before is
    intact."""


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the file system holding `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def write_failed(path: Path, exc: OSError, after: str) -> RunDirWriteError:
    """The error for a failed write of `path`; `after` says what is intact and how to continue."""
    why = exc.strerror or str(exc)
    return RunDirWriteError(f"cannot write {path}: {why} ({mib(free_bytes(path))} free on its file system); {after}")


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def check_room_for_save(run_dir: Path, checkpoint: Path) -> None:
    """Launcher side of a resume that will save: refuse when the next save cannot fit beside `checkpoint`."""
    need, free = tree_bytes(checkpoint), free_bytes(run_dir)
    if free < need:
        raise RunDirWriteError(
            f"run_dir='{run_dir}' has {mib(free)} free, and the next checkpoint needs about {mib(need)} (the size of "
            f"{checkpoint.name}); the save would fail after the restore and the redone steps. Free space there (the "
            "checkpoints of this run are intact), then launch again")
