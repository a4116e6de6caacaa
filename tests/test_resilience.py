"""Never lose a run, end to end through `mindspeed-flow train` (torchrun's elastic agent, fork, gloo):
protected run directories, data preflight, automatic restart after a killed encoder or backbone rank with
bitwise-equal losses, checkpoint fault drills (truncation, ENOSPC) and a hang drill."""
from __future__ import annotations

import hashlib
import tempfile
import json
from pathlib import Path

import pytest
import torch

from mindspeed_flow.resilience.checkpoint import valid_steps
from mindspeed_flow.resilience.rundir import read_run_id
from mindspeed_flow.runtime import launch

BASE = ["experiment=parity_dp2", "trainer.progress=false", "trainer.steps=6"]


def _run(run_dir: Path, *overrides: str) -> int:
    return launch.main([f"run_dir={run_dir}", *BASE, *overrides])


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tree(root: Path) -> dict[str, str]:
    """Every file of a run and its hash; RUN_DIR/.lock is the launches' lock, not the run's state (it stays put)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_rerun_into_used_run_dir_is_refused_and_changes_nothing(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert _run(run, "trainer.steps=2", "trainer.save_final=true") == 0
    before = _tree(run)
    capsys.readouterr()
    assert _run(run, "trainer.steps=3", "trainer.save_final=true") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"run_dir='{run}' already holds a run" in err
    assert "trainer.resume=true" in err and "trainer.overwrite=true" in err
    assert _tree(run) == before  # not a byte of the old run changed

    old_id = read_run_id(run)
    assert _run(run, "trainer.steps=3", "trainer.save_final=true", "trainer.overwrite=true") == 0
    assert read_run_id(run) != old_id
    moved = run / "replaced" / old_id
    assert _tree(moved) == {k: v for k, v in before.items()}  # the old run, unchanged, moved aside
    assert [x["step"] for x in _lines(run)] == [0, 1, 2]


def _sharegpt(root: Path, text: bytes, name: str = "train.json") -> Path:
    path = root / name
    path.write_bytes(text)
    return path


@pytest.mark.parametrize("case", ["unset", "missing", "malformed", "not_utf8", "not_a_list", "no_conversations"])
def test_data_errors_exit_2_with_one_message_naming_the_file(tmp_path: Path, capsys, case: str) -> None:
    good = b'[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}'
    content = {
        "malformed": good + b",\n {\"id\": \"b\" \"conversations\": []}]",
        "not_utf8": good + b',\n {"id": "\xff\xfe", "conversations": []}]',
        "not_a_list": b'{"id": "a"}',
        "no_conversations": b'[{"id": "a", "text": "x"}]',
    }
    path = None if case == "unset" else tmp_path / "nowhere.json" if case == "missing" else \
        _sharegpt(tmp_path, content[case])
    args = ["data=sharegpt", "data.num_samples=12"] + ([f"data.path={path}"] if path else [])
    assert _run(tmp_path / "run", *args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("mindspeed-flow train: bad data: ")
    assert ("data.path is not set" in err) if path is None else (str(path) in err), err
    if case in ("malformed", "not_utf8"):
        assert "line 2 column" in err, err
    assert not (tmp_path / "run").exists()  # nothing written before the data is known good


@pytest.mark.parametrize("side, rank", [("encoder", 0), ("backbone", 2)])
def test_killed_rank_restarts_by_itself_and_matches_an_uninterrupted_run(tmp_path: Path, capfd, side: str,
                                                                         rank: int) -> None:
    """SIGKILL one rank at step 4 (checkpoint every 2 steps, async): the elastic agent restarts the job, it
    resumes from step-3, and every step's loss equals the uninterrupted run's bitwise, each step logged once."""
    recipe = ["experiment=drill_restart", "trainer.progress=false", "trainer.steps=6"]  # kill at step 4
    assert launch.main([f"run_dir={tmp_path / 'full'}", *recipe, "faults.kill_step=-1"]) == 0
    assert launch.main([f"run_dir={tmp_path / 'drill'}", *recipe, f"faults.kill_rank={rank}"]) == 0
    out = capfd.readouterr().out
    assert f"fault drill: SIGKILL rank {rank} at step 4" in out
    # step-3 when its async save completed before the kill, else step-1: either way the same losses.
    assert "resumed from" in out
    full, drill = _lines(tmp_path / "full"), _lines(tmp_path / "drill")
    assert [x["step"] for x in drill] == list(range(6))
    assert [x["loss"] for x in drill] == [x["loss"] for x in full]


@pytest.mark.parametrize("victim", ["distcp", "metadata"])
def test_truncation_drill_resume_uses_the_previous_checkpoint(tmp_path: Path, capfd, victim: str) -> None:
    run = tmp_path / "run"
    assert _run(run, "trainer.steps=4", "trainer.checkpoint_every=2", "faults.truncate_step=3",
                f"faults.truncate_file={victim}") == 0
    capfd.readouterr()
    assert _run(run, "trainer.checkpoint_every=2", "trainer.resume=true") == 0
    out = [x for x in capfd.readouterr().out.splitlines() if "resume:" in x]
    assert len(out) == 1 and "skipped step-3 (" in out[0] and "(truncated)); moved aside" in out[0], out
    assert (run / "checkpoints" / "step-3.corrupt").is_dir()  # kept for inspection, out of keep-last's reach
    assert out[0].rstrip().endswith("step-1")
    full = tmp_path / "full"
    assert _run(full, "trainer.checkpoint_every=2") == 0
    assert [x["loss"] for x in _lines(run)] == [x["loss"] for x in _lines(full)]
    assert [x["step"] for x in _lines(run)] == list(range(6))


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_enospc_drill_keeps_the_previous_checkpoint(tmp_path: Path, capfd, policy: str) -> None:
    run = tmp_path / "run"
    rc = _run(run, "trainer.checkpoint_every=2", "faults.enospc_step=3", f"trainer.on_save_error={policy}")
    captured = capfd.readouterr()
    run_id = read_run_id(run)
    if policy == "continue":
        assert rc == 0 and "training goes on" in captured.out
        assert "previous checkpoint step-1 is intact" in captured.out
        assert valid_steps(run / "checkpoints", run_id) == [1, 5]
    else:
        assert rc == 1
        assert "No space left on device" in captured.err and "previous checkpoint step-1 is intact" in captured.err
        assert valid_steps(run / "checkpoints", run_id) == [1]


@pytest.mark.parametrize("rank, side", [(0, "encoder"), (2, "backbone")])
def test_hang_drill_is_reported_as_a_hang_naming_rank_side_and_step(tmp_path: Path, capfd, rank: int,
                                                                    side: str) -> None:
    """SIGSTOP one rank: a watcher names it, its side and where it stopped, and the job ends (no 30 s wait for a
    stopped process to obey SIGTERM: the watcher SIGKILLs it). With max_restarts=1 the job then completes."""
    rc = _run(tmp_path / "hang", "flow.timeout_s=8", f"faults.hang_rank={rank}", "faults.hang_step=2")
    err = capfd.readouterr().err
    assert rc == 1
    lines = [x for x in err.splitlines() if "[mindspeed-flow] hang:" in x]
    assert len(lines) == 1, err[-3000:]
    assert f"rank {rank} ({side}) stopped answering" in lines[0] and "during step 2" in lines[0]
    assert "alive but stuck, not dead" in lines[0]
    final = err.strip().splitlines()[-1]  # the launcher's verdict: the hang, not the peers' reset connections
    assert final.startswith("mindspeed-flow train: training failed: hang: rank"), final
    assert _run(tmp_path / "again", "flow.timeout_s=8", f"faults.hang_rank={rank}", "faults.hang_step=2",
                "trainer.max_restarts=1", "trainer.checkpoint_every=2") == 0
    assert [x["step"] for x in _lines(tmp_path / "again")] == list(range(6))


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nan_drill_skips_the_step_or_stops(tmp_path: Path, capfd, policy: str) -> None:
    """NaN gradients on one backbone rank at step 2: the global norm is NaN on every trained rank, so all skip
    the update together (losses stay finite and training goes on) or all stop with the cause."""
    rc = _run(tmp_path / "nan", "faults.nan_rank=1", "faults.nan_step=2", f"trainer.nan_policy={policy}")
    captured = capfd.readouterr()
    if policy == "skip":
        assert rc == 0 and "step 2: non-finite gradient norm, update skipped (1 in a row" in captured.out
        lines = _lines(tmp_path / "nan")
        assert [x["step"] for x in lines] == list(range(6))
        assert all(x["loss"] == x["loss"] for x in lines)  # the update was dropped: no NaN reached the weights
        assert [x["grad_norm"] is None for x in lines] == [False, False, True, False, False, False]
    else:
        assert rc == 1
        final = captured.err.strip().splitlines()[-1]
        assert "NonFiniteLoss: step 2: the global gradient norm is nan" in final, final


def test_sigterm_saves_exits_75_and_resume_matches(tmp_path: Path, capfd) -> None:
    """SIGTERM reaches one backbone rank after step 1: its flag goes out with step 2 and all ranks read the agreed
    value 2 steps later, save step-4 and exit 75;
    a resume continues to step 5 with losses bitwise equal to an uninterrupted run, each step logged once."""
    run = tmp_path / "run"
    assert _run(run, "faults.sigterm_rank=2", "faults.sigterm_step=1") == 75
    out = capfd.readouterr()
    assert "SIGTERM: saved" in out.out and "step-4; exiting with code 75" in out.out
    assert "continue with trainer.resume=true" in out.err
    assert [x["step"] for x in _lines(run)] == [0, 1, 2, 3, 4]
    assert _run(run, "trainer.resume=true") == 0
    assert _run(tmp_path / "full") == 0
    assert [x["step"] for x in _lines(run)] == list(range(6))
    assert [x["loss"] for x in _lines(run)] == [x["loss"] for x in _lines(tmp_path / "full")]


def test_resume_on_another_dp_size_reshards(tmp_path: Path) -> None:
    """Saved with backbone DP 2, resumed with backbone DP 1 (and, separately, encoder DP 2): DCP reshards the
    checkpoint; training continues from step-3 with losses close to the uninterrupted DP-2 run (same global
    batches; the reduction order differs, so not bitwise)."""
    full = tmp_path / "full"
    assert _run(full) == 0
    for name, layout in (("bb1", ["parallel.backbone.dp=1"]), ("enc2", ["parallel.encoder.dp=2"])):
        run = tmp_path / name
        assert _run(run, "trainer.steps=4", "trainer.checkpoint_every=2") == 0
        assert _run(run, "trainer.checkpoint_every=2", "trainer.resume=true", *layout) == 0
        resumed = _lines(run)
        assert [x["step"] for x in resumed] == list(range(6))
        for a, b in zip(resumed[4:], _lines(full)[4:]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (name, a["step"])


def test_loader_error_drill_restarts_and_resumes(tmp_path: Path, capfd) -> None:
    """An exception in one backbone rank's data loading at step 3: the agent restarts the job (max_restarts=1),
    which resumes from step-1 and logs each step once."""
    run = tmp_path / "run"
    assert _run(run, "trainer.checkpoint_every=2", "trainer.max_restarts=1", "faults.loader_error_rank=1",
                "faults.loader_error_step=3") == 0
    captured = capfd.readouterr()
    assert "fault drill: data loader error on rank 1 at step 3" in captured.out
    assert f"resumed from {run / 'checkpoints'}/step-1" in captured.out
    assert [x["step"] for x in _lines(run)] == list(range(6))
    assert '"restarts": 1' in captured.out  # the final summary says the run needed one restart
    assert "restart 1 of 1 (trainer.max_restarts) after: rank " in captured.err  # one line, then the resume


@pytest.mark.parametrize("stop", ["sigterm", "nan"])
def test_deliberate_stop_is_never_restarted(tmp_path: Path, capfd, monkeypatch, stop: str) -> None:
    """Issue 25 item 4: with trainer.max_restarts=1, a SIGTERM reaching one worker (all save and exit 75) and
    nan_policy=stop (NonFiniteLoss) end the job with their own exit code and one line; the agent used to restart
    them (the drills fire in the first attempt only, so the restarted job ran to the end and exited 0).
    Item 8: no `torchelastic_*` folder is left in the temporary directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    run = tmp_path / "run"
    drill = ["faults.sigterm_rank=2", "faults.sigterm_step=1"] if stop == "sigterm" else \
        ["faults.nan_rank=1", "faults.nan_step=2"]
    rc = _run(run, "trainer.max_restarts=1", "trainer.checkpoint_every=2", *drill)
    captured = capfd.readouterr()
    assert rc == (75 if stop == "sigterm" else 1), captured.err[-2000:]
    assert "resumed from" not in captured.out and "restart" not in captured.err, captured.err[-2000:]
    verdict = [x for x in captured.err.splitlines() if x.startswith("mindspeed-flow train:")]
    assert len(verdict) == 1, captured.err[-2000:]
    if stop == "sigterm":
        assert "stopped: saved" in verdict[0] and "step-4 on SIGTERM" in verdict[0], verdict
        assert "continue with trainer.resume=true" in verdict[0], verdict
        assert [x["step"] for x in _lines(run)] == [0, 1, 2, 3, 4]
    else:
        assert "NonFiniteLoss: step 2: the global gradient norm is nan" in verdict[0], verdict
        assert [x["step"] for x in _lines(run)] == [0, 1]
    assert not list(tmp.glob("torchelastic_*")) and not list(tmp.glob("pytorch-errorfile-*")), list(tmp.iterdir())


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the workers' SHA-256 check sees it
    path.write_bytes(bytes(data))


def test_resume_without_a_valid_checkpoint_is_refused_and_changes_nothing(tmp_path: Path, capfd) -> None:
    """Issue 25 item 2: trainer.resume=true on a run whose only checkpoint is corrupt used to start over at step 0,
    exit 0 and truncate metrics.jsonl. Now the workers refuse (exit 2, one line naming the run dir and what was
    found; max_restarts does not restart it), the corrupt folder is moved aside and nothing else changes; a
    second resume, with nothing valid left, is refused by the launcher before any worker starts."""
    run = tmp_path / "run"
    assert _run(run, "trainer.steps=3", "trainer.save_final=true") == 0  # one checkpoint: step-2
    _flip_a_byte(sorted((run / "checkpoints" / "step-2").glob("*.distcp"))[0])
    before = _tree(run)
    capfd.readouterr()
    assert _run(run, "trainer.resume=true", "trainer.max_restarts=1") == 2
    err = capfd.readouterr().err
    verdict = [x for x in err.splitlines() if x.startswith("mindspeed-flow train:")]
    assert len(verdict) == 1 and "restart" not in err, err[-2000:]
    assert f"run_dir='{run}'" in verdict[0] and "no valid checkpoint" in verdict[0], verdict
    assert "step-2 (" in verdict[0] and "trainer.overwrite=true" in verdict[0], verdict
    moved = {k.replace("checkpoints/step-2/", "checkpoints/step-2.corrupt/"): v for k, v in before.items()}
    assert _tree(run) == moved  # metrics.jsonl, config.yaml, run.json: not a byte changed
    assert _run(run, "trainer.resume=true") == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step-2.corrupt" in err and f"run_dir='{run}'" in err, err
    assert _tree(run) == moved


def test_resume_with_another_global_batch_size_is_refused_before_anything_changes(tmp_path: Path, capfd) -> None:
    """Issue 25 item 6: the refusal came from the workers, after the launcher had overwritten config.yaml, with an
    empty message. Now the launcher refuses first: one line naming the field, the old and the new value."""
    run = tmp_path / "run"
    assert _run(run, "trainer.steps=2", "trainer.save_final=true") == 0
    before = _tree(run)
    capfd.readouterr()
    rc = _run(run, "trainer.resume=true", "trainer.global_batch_size=6")
    err = capfd.readouterr().err.strip()
    assert _tree(run) == before  # config.yaml still the run's own
    assert rc == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "trainer.global_batch_size=6" in err and "trainer.global_batch_size=12" in err, err


def test_skipped_nan_step_records_grad_norm_as_null() -> None:
    """Issue 25 item 8: a step whose update nan_policy=skip dropped recorded grad_norm 0.0 (NaN is "unset" in a
    StepRecord, so the NaN norm aggregated to 0.0). It is null, and the line says the update was skipped."""
    from mindspeed_flow.telemetry.metrics import MetricsGatherer, StepRecord, StepStatic

    gatherer = MetricsGatherer(None, 2, False, Path("."), 1, 1.0, "")
    static = StepStatic(step=2, samples=4, real_tokens=10, padded_tokens=12, microbatches=2, padding_fraction=0.1,
                        dp_imbalance=1.0, slot_imbalance=1.0, encoder_imbalance=1.0, model_flops=1.0,
                        oversize_skipped=0, lr=0.1)

    def line(norms: list[float], skipped: list[float]) -> dict:
        records = []
        for norm, skip in zip(norms, skipped):
            r = StepRecord()
            r["is_encoder"], r["is_backbone"], r["step_start_t"], r["step_end_t"] = 0.0, 1.0, 1.0, 2.0
            r["grad_norm"], r["update_skipped"] = norm, skip
            records.append(r.values)
        return gatherer._line(static, torch.stack(records))

    bad = line([float("nan"), float("nan")], [1.0, 1.0])
    assert bad["grad_norm"] is None and bad["update_skipped"] is True
    good = line([0.5, 0.5], [0.0, 0.0])
    assert good["grad_norm"] == 0.5 and good["update_skipped"] is False


def test_hang_of_both_watchers_is_reported_by_the_next_rank(tmp_path: Path, capfd) -> None:
    """Issue 25 item 5: ranks 0 and 1 (the two watchers, a whole first node) stop together. No hang was reported:
    the job ended after the peers' timeout and the agent's grace with "training failed: " and nothing after it.
    Rank 2, whose lower ranks all stopped, reports both, kills them, and the launcher names the hang."""
    rc = _run(tmp_path / "hang", "flow.timeout_s=8", "faults.hang_rank=0", "faults.hang_ranks=[1]",
              "faults.hang_step=2")
    err = capfd.readouterr().err
    assert rc == 1
    lines = [x for x in err.splitlines() if "[mindspeed-flow] hang:" in x]
    assert len(lines) == 1, err[-3000:]
    assert "rank 0 (encoder) stopped answering" in lines[0] and "rank 1 (backbone) stopped answering" in lines[0]
    assert "during step 2" in lines[0] and "rank 2 (backbone) is waiting for them" in lines[0], lines[0]
    final = err.strip().splitlines()[-1]
    assert final.startswith("mindspeed-flow train: training failed: hang: rank 0 (encoder)"), final
