"""A flow job under faults: a killed rank, a hung rank, and the same command resuming from the last checkpoint.

Every run uses the command a user restarts with: `--load DIR --save DIR` (empty the first time), saving every 4
iterations, 10 iterations in all, on the user-like data set (30 samples, global batch 4: the resumed part crosses
the epoch boundary). A decoder rank is killed (SIGKILL) once iteration 6 is logged, so the last checkpoint is
iteration 4 (ranks never run more than one iteration apart: the global gradient norm is reduced every step).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from flow_helpers import nranks, write_recipe

from mindspeed_flow.emulation.jobs import TinyJob, emulate_command, emulate_job
from mindspeed_flow.emulation.scaled import write_user_like_data_json

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]

ITERS, SAVE_EVERY, KILL_AFTER = 10, 4, 6
LAYOUTS = {
    "dec_dp2": ({"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1}),
    "dec_pp2": ({"dp": 1, "tp": 1}, {"dp": 1, "tp": 1, "pp": 2}),
}


def rank_processes(root_pid: int) -> dict[int, "psutil.Process"]:
    """{global rank: process} of the workers under a launcher process (read from each worker's RANK)."""

    def rank_of(proc: "psutil.Process") -> int | None:
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            return None
        return int(env["RANK"]) if "RANK" in env and "TORCHELASTIC_RUN_ID" in env else None

    out = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        rank = rank_of(child)
        # A worker's own children (a compiler, a data-loader worker) inherit RANK: keep the topmost process.
        if rank is not None and rank_of(child.parent()) is None:
            out[rank] = child
    return out


@pytest.fixture(scope="module")
def user_data(tiny_assets) -> Path:
    return write_user_like_data_json(Path(tiny_assets["workdir"]))


def _job(tiny_assets, data: Path, ckpt: Path) -> TinyJob:
    # The project's tiny model: a trainable ViT, so the encoder part's optimizer state is in the checkpoint too.
    return TinyJob(tiny_assets["model_json"], data, train_iters=ITERS, global_batch_size=4, seq_length=256,
                   save=ckpt, load=ckpt, save_interval=SAVE_EVERY,
                   extra=["--calculate-per-token-loss", "--variable-seq-lengths"])


class WatchedJob:
    """A job started in the background whose output is read line by line while it runs."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._queue: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        """Read output until a line contains `text` (True) or the job ends / the time is up (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                return False
            self.lines.append(line)
            if text in line:
                return True
        return False

    def finish(self, timeout_s: float) -> tuple[int, float]:
        """Wait for the job to end; (return code, seconds waited)."""
        start = time.monotonic()
        rc = self.proc.wait(timeout=timeout_s)
        while True:
            line = self._queue.get()
            if line is None:
                break
            self.lines.append(line)
        return rc, time.monotonic() - start

    def kill_tree(self) -> None:
        if self.proc.poll() is not None:
            return
        import psutil

        try:
            for proc in rank_processes(self.proc.pid).values():
                proc.send_signal(signal.SIGCONT)  # a stopped rank would not die of the launcher's SIGTERM
        except psutil.Error:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_killed_rank_ends_the_job_and_the_same_command_resumes_exactly(layout, tiny_assets, user_data, run_job,
                                                                      tmp_path) -> None:
    enc, dec = LAYOUTS[layout]
    recipe = write_recipe(tmp_path / f"{layout}.yaml", enc, dec)
    n = nranks(enc, dec)
    whole = run_job(f"{layout}_uninterrupted", _job(tiny_assets, user_data, tmp_path / "whole").argv(), nproc=n,
                    flow_recipe=recipe)
    whole.assert_trained(ITERS)

    ckpt = tmp_path / "resumed"
    argv = _job(tiny_assets, user_data, ckpt).argv()
    log_path = tmp_path / f"{layout}_killed.emulation.log"
    job = WatchedJob(emulate_command(argv, log_path=log_path, nproc=n, flow_recipe=recipe))
    victim = n - 1  # the last decoder rank: a last pipeline stage, or the second DP replica
    try:
        assert job.wait_for(f"iteration        {KILL_AFTER}/", 600), job.output[-4000:]
        rank_processes(job.proc.pid)[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        rc, _ = job.finish(timeout_s=120)
        ended_after = time.monotonic() - killed_at
    finally:
        job.kill_tree()
    out = job.output
    assert rc != 0
    assert ended_after < 30, f"the job took {ended_after:.0f} s to end after rank {victim} was killed"
    assert f"rank: {victim}" in out and "SIGKILL" in out, out[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_EVERY)

    again = run_job(f"{layout}_restarted", argv, nproc=n, flow_recipe=recipe)  # the very same command
    again.assert_trained(ITERS - SAVE_EVERY, first=SAVE_EVERY + 1)
    want = whole.losses[SAVE_EVERY:]
    rel = [abs(a - b) / abs(b) for a, b in zip(again.losses, want)]
    print(f"{layout}: resumed {again.losses}\n{layout}: uninterrupted {want}\n{layout}: max rel {max(rel):.2e}; "
          f"job ended {ended_after:.1f} s after the kill")
    assert max(rel) <= 1e-4, (rel, again.losses, want)
    # metrics.jsonl (RUN_DIR: the folder holding --save): the killed run moved the uninterrupted run's file aside,
    # and its restart continued the file without the iterations it redid: each iteration once, the resumed losses.
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == list(range(1, ITERS + 1)), [ln["step"] for ln in lines]
    assert [ln["loss"] for ln in lines[SAVE_EVERY:]] == pytest.approx(again.losses, rel=1e-5)
    (earlier,) = (tmp_path / "replaced").glob("*/metrics.jsonl")
    assert [json.loads(x)["loss"] for x in earlier.read_text().splitlines()] == pytest.approx(whole.losses, rel=1e-5)


def test_hung_rank_is_reported_with_its_part_and_what_was_awaited(tiny_assets, user_data, tmp_path) -> None:
    """The encoder stops (SIGSTOP) wherever it is; within flow.timeout_s a watcher names it, its part, what it was
    doing and what the watcher waits for, and the job ends."""
    enc, dec = {"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1}
    timeout_s = 20
    recipe = write_recipe(tmp_path / "hang.yaml", enc, dec, flow=f"{{timeout_s: {timeout_s}}}")
    argv = _job(tiny_assets, user_data, tmp_path / "ckpt").argv()
    job = WatchedJob(emulate_command(argv, log_path=tmp_path / "hang.emulation.log", nproc=nranks(enc, dec),
                                     flow_recipe=recipe))
    try:
        assert job.wait_for("iteration        2/", 600), job.output[-4000:]
        rank_processes(job.proc.pid)[0].send_signal(signal.SIGSTOP)  # the encoder stops answering
        stopped_at = time.monotonic()
        assert job.wait_for("[mindspeed-flow] hang: rank 0 (encoder dp0)", 3 * timeout_s), job.output[-4000:]
        reported_after = time.monotonic() - stopped_at
        rc, _ = job.finish(timeout_s=120)
    finally:
        job.kill_tree()
    line = next(x for x in job.lines if "hang: rank 0 (encoder dp0)" in x)
    assert "stopped answering" in line and " during " in line, line
    assert "is waiting for it in " in line and "(decoder dp" in line, line
    assert rc != 0
    print(f"reported {reported_after:.1f} s after the encoder stopped: {line.strip()}")
    assert reported_after < timeout_s


def test_refused_launch_is_one_line(tiny_assets, tmp_path, mm_sources) -> None:
    """A refusal reaches the user as one message and exit code 2, before any process group exists."""
    recipe = write_recipe(tmp_path / "r.yaml", {"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1})
    argv = TinyJob(tiny_assets["model_json"], tiny_assets["data_json"]).argv(script="pretrain_omni.py")
    proc = emulate_job("refused", argv, log_dir=tmp_path, nproc=3, flow_recipe=recipe, timeout_s=300)
    assert proc.rc == 2, proc.output[-3000:]
    lines = [x for x in proc.output.strip().splitlines() if x]
    assert len(lines) == 1 and "pretrain_omni.py: MindSpeed-MM's OmniModel entry is not a flow entry" in \
        lines[0], proc.output

