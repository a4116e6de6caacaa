"""Checkpoints: a save that dies halfway never replaces the last good one, old ones are purged only after a newer
one is complete, async saves (own gloo group) load back exactly, and a failed delete does not stop training."""
from __future__ import annotations

from pathlib import Path

import torch

from mindspeed_flow.resilience.checkpoint import Checkpointer, load_flat, valid_steps
from mindspeed_flow.utils.multiproc import run_ranks


def _params(seed: int) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {"encoder.w": torch.nn.Parameter(torch.randn(4, 3, generator=g)),
            "backbone.b": torch.nn.Parameter(torch.randn(5, generator=g))}


def _save_and_reload(rank: int, world: int, root: str, async_save: bool) -> list[int]:
    ck = Checkpointer(Path(root), keep_last=2, async_save=async_save)
    params = _params(0)
    opt = torch.optim.AdamW(params.values(), lr=0.1)
    for step in range(3):
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
        ck.save(step, params, opt, {"step": step, "note": "x"})
    ck.wait()
    # A save of step 3 that died halfway: files but no .metadata.
    if rank == 0:
        broken = Path(root) / "step-3"
        broken.mkdir()
        (broken / "__0_0.distcp").write_bytes(b"partial")
    torch.distributed.barrier()
    fresh = _params(1)
    opt2 = torch.optim.AdamW(fresh.values(), lr=0.1)
    extra = Checkpointer(Path(root)).load_latest(fresh, opt2, {"step": -1, "note": ""})
    assert extra["step"] == 2
    for k in params:
        assert torch.equal(fresh[k], params[k])
        assert torch.equal(opt2.state[fresh[k]]["exp_avg"], opt.state[params[k]]["exp_avg"])
    return valid_steps(Path(root))


def test_sync_save_keeps_last_good(tmp_path: Path) -> None:
    out = run_ranks(_save_and_reload, 2, str(tmp_path), False, timeout_s=60)
    assert out[0] == [1, 2]  # step-0 purged, the broken step-3 ignored
    flat = load_flat(tmp_path / "step-2")
    assert set(flat) == {"encoder.w", "backbone.b"}


def test_async_save_loads_back(tmp_path: Path) -> None:
    out = run_ranks(_save_and_reload, 2, str(tmp_path), True, timeout_s=60)
    assert out[1] == [1, 2]


def test_failed_delete_does_not_stop(tmp_path: Path, monkeypatch, capsys) -> None:
    import shutil

    for s in (0, 1, 2):
        d = tmp_path / f"step-{s}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"")

    def refuse(path, *a, **k):
        raise OSError("read-only file system")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    Checkpointer(tmp_path, keep_last=1)._purge()
    assert valid_steps(tmp_path) == [0, 1, 2]
    assert "could not delete old checkpoint step-0" in capsys.readouterr().out
