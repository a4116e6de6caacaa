"""Stop on a signal vs the launcher's grace period (issue 25 item 7), through a real `mindspeed-flow train`
process that receives SIGTERM as a scheduler sends it: the launcher passes it on and kills the workers
`trainer.stop_grace_s` seconds later. Steps are made long with the slow-step drill (1.5 s each), so that a save
3 steps after the signal needs well over a 2 s grace and well under a 120 s one, whatever the machine's load."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mindspeed_flow.resilience.checkpoint import valid_steps
from mindspeed_flow.resilience.rundir import read_run_id


def _train_until_step(run: Path, grace: int, steps_before_signal: int = 3) -> tuple[int, str, str]:
    """Start a 30-step run, SIGTERM the launcher once `steps_before_signal` metrics lines exist; (rc, out, err)."""
    cmd = [sys.executable, "-m", "mindspeed_flow.cli", "train", f"run_dir={run}", "experiment=parity_dp2",
           "trainer.progress=false", "trainer.steps=30", "trainer.tensorboard=false", "trainer.checkpoint_every=2",
           "faults.slow_step_s=1.5", f"trainer.stop_grace_s={grace}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = run / "metrics.jsonl"
    # Waiting for the run to reach a step, not timing anything: the deadline only stops a broken run.
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps_before_signal:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


def test_sigterm_save_lands_within_a_long_enough_grace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rc, out, err = _train_until_step(run, grace=120)
    verdict = [x for x in err.splitlines() if x.startswith("mindspeed-flow train:")]
    assert rc == 75 and len(verdict) == 1, err[-3000:]
    assert "stopped: saved" in verdict[0] and "on SIGTERM" in verdict[0] and "s after it reached" in verdict[0]
    saved = int(verdict[0].split("/step-")[1].split()[0])
    assert valid_steps(run / "checkpoints", read_run_id(run))[-1] == saved
    assert "warning: a stop on SIGTERM" not in out  # 3 steps of ~1.5-2 s and a save fit in 120 s


def test_sigterm_save_killed_by_a_short_grace_is_said_and_warned_before(tmp_path: Path) -> None:
    """A 2 s grace cannot hold 3 steps of 1.5 s: the writer warned after the first periodic save, the launcher
    kills the workers 2 s after passing SIGTERM on, says no save was made and names the checkpoint a resume uses,
    and exits 128 + SIGTERM; that checkpoint is intact."""
    run = tmp_path / "run"
    rc, out, err = _train_until_step(run, grace=2)
    verdict = [x for x in err.splitlines() if x.startswith("mindspeed-flow train:")]
    assert rc == 128 + signal.SIGTERM and len(verdict) == 1, err[-3000:]
    assert "warning: a stop on SIGTERM would save up to" in out and "trainer.stop_grace_s=2" in out, out[-3000:]
    newest = valid_steps(run / "checkpoints", read_run_id(run))[-1]
    assert "did not save within trainer.stop_grace_s=2 s" in verdict[0], verdict
    assert f"the newest valid checkpoint, step-{newest}" in verdict[0], verdict
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][:newest + 1] == \
        list(range(newest + 1))
