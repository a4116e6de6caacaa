"""Checkpoints: a manifest written last makes a folder valid; a truncated `.distcp` or `.metadata`, an unfinished
save or another run's folder is skipped with one line; keep-last deletes only this run's checkpoints; ENOSPC
during a save (sync or async) leaves the previous checkpoint intact; a failed delete does not stop training.
Real DCP saves on real gloo groups (2 ranks)."""
from __future__ import annotations

import os
from pathlib import Path
from shutil import rmtree as shutil_rmtree
from typing import Optional

import pytest
import torch

from mindspeed_flow.resilience.checkpoint import (Checkpointer, CheckpointSaveError, load_flat, read_manifest,
                                                  valid_steps, verify)
from mindspeed_flow.utils.multiproc import run_ranks


def _params(seed: int) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {"encoder.w": torch.nn.Parameter(torch.randn(4, 3, generator=g)),
            "backbone.b": torch.nn.Parameter(torch.randn(5, generator=g))}


def _train(ck: Checkpointer, steps: range, seed: int = 0) -> tuple[dict, torch.optim.Optimizer]:
    params = _params(seed)
    opt = torch.optim.AdamW(params.values(), lr=0.1)
    for step in steps:
        for p in params.values():
            p.grad = torch.full_like(p, float(step + 1))
        opt.step()
        ck.save(step, params, opt, {"step": step, "note": "x"})
    ck.wait()
    return params, opt


def _save_and_reload(rank: int, world: int, root: str, async_save: bool) -> list[int]:
    ck = Checkpointer(Path(root), run_id="run-a", keep_last=2, async_save=async_save)
    params, opt = _train(ck, range(3))
    # A save of step 3 that died halfway: files but no manifest.
    if rank == 0:
        broken = Path(root) / "step-3"
        broken.mkdir()
        (broken / "__0_0.distcp").write_bytes(b"partial")
    torch.distributed.barrier()
    fresh = _params(1)
    opt2 = torch.optim.AdamW(fresh.values(), lr=0.1)
    extra = Checkpointer(Path(root), run_id="run-a").load_latest(fresh, opt2, {"step": -1, "note": ""})
    assert extra["step"] == 2
    for k in params:
        assert torch.equal(fresh[k], params[k])
        assert torch.equal(opt2.state[fresh[k]]["exp_avg"], opt.state[params[k]]["exp_avg"])
    return valid_steps(Path(root), "run-a")


def test_sync_save_keeps_last_good(tmp_path: Path, capfd) -> None:
    out = run_ranks(_save_and_reload, 2, str(tmp_path), False, timeout_s=60)
    assert out[0] == [1, 2]  # step-0 purged, the broken step-3 ignored
    assert "skipped step-3 (no manifest.json (the save did not finish)); using" in capfd.readouterr().out
    flat = load_flat(tmp_path / "step-2")
    assert set(flat) == {"encoder.w", "backbone.b"}
    manifest = read_manifest(tmp_path / "step-2")
    assert manifest["run_id"] == "run-a" and manifest["step"] == 2 and manifest["world_size"] == 2
    assert ".metadata" in manifest["files"] and any(n.endswith(".distcp") for n in manifest["files"])
    assert set(manifest["rng"]) == {"0", "1"} and manifest["extra"] == {"step": 2, "note": "x"}


def test_async_save_loads_back(tmp_path: Path) -> None:
    out = run_ranks(_save_and_reload, 2, str(tmp_path), True, timeout_s=60)
    assert out[1] == [1, 2]


def _resume_after_damage(rank: int, world: int, root: str) -> int:
    ck = Checkpointer(Path(root), run_id="r", keep_last=3)
    fresh = _params(7)
    opt = torch.optim.AdamW(fresh.values(), lr=0.1)
    return ck.load_latest(fresh, opt, {"step": -1, "note": ""})["step"]


def _save_three(rank: int, world: int, root: str) -> None:
    _train(Checkpointer(Path(root), run_id="r", keep_last=3), range(3))


@pytest.mark.parametrize("victim", [".distcp", ".metadata"])
def test_truncated_newest_checkpoint_falls_back_in_one_line(tmp_path: Path, capfd, victim: str) -> None:
    run_ranks(_save_three, 2, str(tmp_path), timeout_s=60)
    newest = tmp_path / "step-2"
    path = sorted(p for p in newest.iterdir() if p.name.endswith(victim))[0]
    size = path.stat().st_size
    os.truncate(path, size // 2)
    capfd.readouterr()
    assert run_ranks(_resume_after_damage, 2, str(tmp_path), timeout_s=60) == [1, 1]
    lines = [x for x in capfd.readouterr().out.splitlines() if "resume:" in x]
    assert len(lines) == 1, lines
    assert f"skipped step-2 ({path.name} has {size // 2} bytes, the manifest says {size} (truncated))" in lines[0]
    assert f"using {tmp_path / 'step-1'}" in lines[0]


def test_keep_last_deletes_only_its_own_run(tmp_path: Path) -> None:
    """Another run's checkpoints (higher steps) in the same folder: never deleted, never loaded."""
    def both(rank: int, world: int, root: str) -> tuple[list[int], list[int], int]:
        _train(Checkpointer(Path(root), run_id="old", keep_last=5), range(10, 13), seed=3)
        _train(Checkpointer(Path(root), run_id="new", keep_last=1), range(3))
        fresh = _params(9)
        step = Checkpointer(Path(root), run_id="new", verbose=False).load_latest(
            fresh, torch.optim.AdamW(fresh.values()), {"step": -1, "note": ""})["step"]
        return valid_steps(Path(root), "old"), valid_steps(Path(root), "new"), step

    old, new, step = run_ranks(both, 2, str(tmp_path), timeout_s=60)[0]
    assert old == [10, 11, 12] and new == [2] and step == 2
    assert "belongs to run new" in verify(tmp_path / "step-2", "old")


def _enospc(rank: int, world: int, root: str, async_save: bool) -> tuple[str, int]:
    ck = Checkpointer(Path(root), run_id="r", keep_last=2, async_save=async_save)
    params, opt = _train(ck, range(1))
    ck.fail_next_with_enospc = True
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    message = ""
    try:
        ck.save(1, params, opt, {"step": 1, "note": "x"})
        ck.wait()
    except CheckpointSaveError as exc:
        message = str(exc)
    fresh = _params(5)
    step = Checkpointer(Path(root), run_id="r", verbose=False).load_latest(
        fresh, torch.optim.AdamW(fresh.values()), {"step": -1, "note": ""})["step"]
    return message, step


@pytest.mark.parametrize("async_save", [False, True])
def test_enospc_during_save_keeps_previous_checkpoint(tmp_path: Path, async_save: bool) -> None:
    out = run_ranks(_enospc, 2, str(tmp_path), async_save, timeout_s=60)
    for message, step in out:
        assert "No space left on device" in message and "previous checkpoint step-0 is intact" in message, message
        assert step == 0
    assert verify(tmp_path / "step-0", "r") is None
    assert "no manifest.json" in verify(tmp_path / "step-1", "r")


def test_failed_delete_does_not_stop(tmp_path: Path, monkeypatch, capsys) -> None:
    import shutil

    def refuse(path, *a, **k):
        raise OSError("read-only file system")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    _train(Checkpointer(tmp_path, run_id="r", keep_last=1), range(3))
    assert valid_steps(tmp_path, "r") == [0, 1, 2]
    assert "could not delete old checkpoint step-0" in capsys.readouterr().out


def _fallback_then_save(rank: int, world: int, root: str) -> tuple[Optional[int], list[int]]:
    """Both of this run's checkpoints are corrupt: the resume starts over, and the next saves must be kept."""
    ck = Checkpointer(Path(root), run_id="r", keep_last=2)
    fresh = _params(3)
    opt = torch.optim.AdamW(fresh.values(), lr=0.1)
    extra = ck.load_latest(fresh, opt, {"step": -1, "note": ""})
    _train(ck, range(1))  # the restarted run saves step-0
    return (None if extra is None else extra["step"]), valid_steps(Path(root), "r")


def test_corrupt_checkpoints_are_moved_aside_and_never_count_for_keep_last(tmp_path: Path, capfd) -> None:
    """Issue 25 item 1: after a fallback past corrupt checkpoints, keep-last deleted every new valid save (the
    corrupt ones were still this run's newest). They are renamed `<name>.corrupt`, kept byte for byte."""
    run_ranks(_save_three, 2, str(tmp_path), timeout_s=60)  # keep_last=3: step-0, step-1, step-2
    truncated = sorted(p for p in (tmp_path / "step-2").iterdir() if p.name.endswith(".distcp"))[0]
    os.truncate(truncated, truncated.stat().st_size // 2)
    flipped = tmp_path / "step-1" / ".metadata"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, another byte: only the SHA-256 tells
    flipped.write_bytes(bytes(data))
    shutil_rmtree(tmp_path / "step-0")  # nothing valid left: the resume starts at step 0
    before = {p.relative_to(tmp_path): p.read_bytes() for d in ("step-1", "step-2") for p in (tmp_path / d).iterdir()}
    capfd.readouterr()
    out = run_ranks(_fallback_then_save, 2, str(tmp_path), timeout_s=60)
    assert out[0] == (None, [0]), out  # the new step-0 survives its own purge
    line = [x for x in capfd.readouterr().out.splitlines() if "resume:" in x]
    assert len(line) == 1 and "moved aside" in line[0] and "step-2.corrupt" in line[0], line
    for rel, content in before.items():  # moved, never deleted nor changed
        assert (tmp_path / f"{rel.parts[0]}.corrupt" / rel.name).read_bytes() == content
    assert not (tmp_path / "step-1").exists() and not (tmp_path / "step-2").exists()


def _short_write_message(rank: int, world: int, root: str) -> str:
    ck = Checkpointer(Path(root), run_id="r")
    # what torch's zip writer (torch.save inside DCP) raises when the disk fills mid-file, instead of ENOSPC
    exc = RuntimeError("[enforce fail at inline_container.cc:659] . unexpected pos 704 vs 598")
    return str(ck._save_error(1, Path(root) / "step-1", exc))


def test_a_short_write_is_named_as_a_full_disk(tmp_path: Path) -> None:
    """A full disk that torch reports as a short write still reaches the user as one: the failed save's message
    says "No space left on device" (the launcher's one line and the recipe's advice key on it)."""
    [message] = run_ranks(_short_write_message, 1, str(tmp_path), timeout_s=60)
    assert "unexpected pos 704 vs 598 (No space left on device, a short write" in message
    assert "there is no earlier checkpoint" in message
