"""A full disk and a busy run directory, end to end through `mindspeed-flow train` (torchrun's elastic agent, fork,
gloo), on a real small file system: a tmpfs mounted for the test (skipped where this process may not mount one).

Each test reproduces what a full disk did before: a failed save left its partial folder (keeping the disk full),
the next metrics write then failed and the launcher blamed a secondary "connection closed by peer" with a page of
traceback, and a resume on a still-full disk failed the same way and left an empty metrics.jsonl.tmp."""
from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from mindspeed_flow.resilience.diskspace import RunDirWriteError
from mindspeed_flow.resilience.rundir import RunDirLock
from mindspeed_flow.runtime import launch
from mindspeed_flow.telemetry.metrics import MetricsFile
from test_resilience import _tree  # tests/ is on sys.path (pytest's default import mode)

def _run(run_dir: Path, *overrides: str) -> int:
    return launch.main([f"run_dir={run_dir}", "experiment=parity_dp2", "trainer.progress=false", "trainer.steps=6",
                        "trainer.tensorboard=false", *overrides])


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator:
    """mount(size) -> a folder on a fresh tmpfs of `size` (e.g. '3m'), unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode})")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(disk: Path, leave: int = 0) -> Path:
    """Fill `disk` up to `leave` free bytes with a filler file (tmpfs counts whole pages)."""
    import shutil

    filler = disk / "filler"
    with open(filler, "wb") as f:
        while shutil.disk_usage(disk).free > leave:
            try:
                f.write(b"\0" * max(4096, min(1 << 20, shutil.disk_usage(disk).free - leave)))
                f.flush()
            except OSError:
                break
    return filler


def _verdict(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("mindspeed-flow train:")]


def test_failed_save_frees_its_partial_folder_so_training_goes_on(small_disk, capfd) -> None:
    """A 3 MiB disk where no checkpoint fits: with on_save_error=continue every save fails, and each failure
    removes its own partial folder, so the metrics lines still land: all 6 steps, exit 0."""
    run = small_disk("3m") / "run"
    assert _run(run, "trainer.checkpoint_every=2", "trainer.on_save_error=continue") == 0
    out = capfd.readouterr().out
    # The full disk surfaces as ENOSPC or, when torch's zip writer hits it first, as a short write ("unexpected pos
    # A vs B"): which one depends on where the 3 MiB run out, so either wording names it.
    failures = [x for x in out.splitlines() if "checkpoint" in x and " failed: " in x]
    assert failures and all("No space left on device" in x and "its partial folder was removed" in x
                            for x in failures), out[-3000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(6))
    assert not any((run / "checkpoints").iterdir())


def test_failed_save_on_full_disk_stops_with_one_line_naming_it(small_disk, capfd) -> None:
    run = small_disk("3m") / "run"
    assert _run(run, "trainer.checkpoint_every=2") == 1
    err = capfd.readouterr().err
    verdict = _verdict(err)
    assert len(verdict) == 1 and "Traceback" not in err, err[-3000:]
    assert "CheckpointSaveError: checkpoint" in verdict[0] and "No space left on device" in verdict[0], verdict
    assert "there is no earlier checkpoint" in verdict[0], verdict


def test_metrics_write_on_full_disk_names_the_cause_not_a_peer(small_disk, capfd) -> None:
    """A 16 KiB disk: the run's config and run file fit, metrics.jsonl fills the rest after a few lines. The writer
    rank's failure is the job's cause, in one line (its peers' reset connections are not), and every line written
    before it is intact."""
    run = small_disk("16k") / "run"
    assert _run(run) == 1
    err = capfd.readouterr().err
    verdict = _verdict(err)
    assert len(verdict) == 1 and "Traceback" not in err and "Connection" not in verdict[0], err[-3000:]
    assert "RunDirWriteError: cannot write" in verdict[0] and "metrics.jsonl: No space left" in verdict[0], verdict
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert 0 < len(lines) < 6 and [x["step"] for x in lines] == list(range(len(lines)))


def test_resume_on_a_still_full_disk_is_refused_at_launch_and_changes_nothing(small_disk, capfd) -> None:
    disk = small_disk("16m")
    run = disk / "run"
    assert _run(run, "trainer.steps=4", "trainer.checkpoint_every=2") == 0
    _fill(disk, leave=64 << 10)
    before = _tree(run)
    capfd.readouterr()
    assert _run(run, "trainer.resume=true", "trainer.checkpoint_every=2") == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "free, and the next checkpoint needs about" in err, err[-3000:]
    assert f"run_dir='{run}'" in err and "step-3" in err, err
    assert _tree(run) == before and not (run / "metrics.jsonl.tmp").exists()


def test_metrics_resume_rewrite_on_full_disk_leaves_the_file_and_no_tmp(small_disk) -> None:
    disk = small_disk("64k")
    (disk / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "pad": "x" * 900}) + "\n" for i in range(4)))
    before = (disk / "metrics.jsonl").read_bytes()
    _fill(disk)
    with pytest.raises(RunDirWriteError, match="metrics.jsonl: No space left on device.*it is unchanged"):
        MetricsFile(disk, append=True, resume_step=2)
    assert (disk / "metrics.jsonl").read_bytes() == before and not (disk / "metrics.jsonl.tmp").exists()


def test_metrics_lines_are_kept_through_a_full_disk_with_continue(small_disk, capsys) -> None:
    """trainer.on_save_error=continue: lines that cannot be written are kept and appended with the next write that
    succeeds, so none is lost once space returns; without space at the end, close() says how many are lost."""
    disk = small_disk("64k")
    metrics = MetricsFile(disk, on_write_error="continue")
    metrics.write({"step": 0})
    filler = _fill(disk)
    metrics.write({"step": 1, "pad": "x" * 8192})
    metrics.write({"step": 2, "pad": "x" * 8192})
    assert capsys.readouterr().out.count("metrics.jsonl: No space left on device") == 1  # warned once
    filler.unlink()
    metrics.write({"step": 3})
    metrics.close()
    assert [json.loads(x)["step"] for x in (disk / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    stuck = MetricsFile(disk / "again", on_write_error="continue")
    _fill(disk)
    stuck.write({"step": 0, "pad": "x" * 8192})
    with pytest.raises(RunDirWriteError, match="1 step lines could not be written"):
        stuck.close()
    with pytest.raises(RunDirWriteError, match="No space left"):
        MetricsFile(disk / "again").write({"step": 0, "pad": "x" * 8192})


def test_a_second_launch_on_a_run_dir_in_use_is_refused_and_changes_nothing(tmp_path: Path, capfd) -> None:
    """Issue 25 item 7: two launches with trainer.resume=true on one run directory were not locked against each
    other. A launch holds RUN_DIR/.lock while it runs; a second one is refused with one line naming the holder."""
    run = tmp_path / "run"
    assert _run(run, "trainer.steps=2", "trainer.save_final=true") == 0
    before = _tree(run)
    capfd.readouterr()
    other = RunDirLock()  # what a running launch holds (the lock is per open file, so this process counts too)
    other.acquire(run)
    try:
        assert _run(run, "trainer.resume=true", "trainer.steps=4") == 2
    finally:
        other.release()
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is in use by another launch (pid" in err, err
    assert _tree(run) == before
    assert _run(run, "trainer.resume=true", "trainer.steps=4") == 0  # free again once the holder has gone
