"""Resume admission: a launch with `trainer.resume=true` continues a run or is refused before it changes anything.

A resume that cannot continue the run is refused with `ResumeRefused` (exit code 2, one line), never turned into
a silent start over: a start over would truncate metrics.jsonl and overwrite config.yaml, the run's history.
Refused: a run directory holding a previous run but no checkpoint of it that verifies (the line names the run
directory and lists what it found), and a checkpoint saved with another seed / global batch size / dataset size
(resuming would replay different batches; the line names the field, the old and the new value). A run directory
with no previous run starts a new run, as without `resume`.

The launcher checks here before it claims the directory or writes config.yaml (sizes only, no hashing); the
workers check again on what they actually load (SHA-256 verified) and raise the same error, which the launcher
never restarts. A resumed launch writes its recipe to `config.resume.yaml`; rank 0 installs it as config.yaml only
once the workers accepted the resume (`accept_config`).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

from mindspeed_flow.data.sampler import resume_mismatch
from mindspeed_flow.resilience.checkpoint import _step_dirs, read_manifest, verify
from mindspeed_flow.resilience.rundir import RUN_FILE, existing_state, read_run_id

PENDING_CONFIG = "config.resume.yaml"


class ResumeRefused(RuntimeError):
    """trainer.resume=true cannot continue the run in run_dir; nothing of it was changed."""


def _checkpoint_findings(root: Path, run_id: Optional[str], skipped: Optional[list[str]] = None) -> list[str]:
    """What checkpoints/ holds: each step folder with why it cannot be loaded, then the folders moved aside."""
    found = list(skipped) if skipped is not None else \
        [f"{d.name} ({verify(d, run_id, hashes=False) or 'valid'})" for _, d in _step_dirs(root)]
    if root.is_dir():
        said = " ".join(found)  # a worker's skip list already names the folders it moved aside
        found += sorted(d.name for d in root.iterdir() if d.is_dir() and ".corrupt" in d.name and d.name not in said)
    return found


def no_checkpoint(run_dir: Path, run_id: Optional[str], skipped: Optional[list[str]] = None) -> ResumeRefused:
    """The refusal of a resume with nothing to continue, naming the run directory and what it holds."""
    run_dir = Path(run_dir)
    found = _checkpoint_findings(run_dir / "checkpoints", run_id, skipped)
    return ResumeRefused(
        f"trainer.resume=true but run_dir='{run_dir}' holds no valid checkpoint of run {run_id} to continue "
        f"(found {', '.join(existing_state(run_dir)) or 'nothing'}; checkpoints: {'; '.join(found) or 'none'}); "
        f"nothing of the run was deleted or overwritten. Start a new run there with trainer.overwrite=true (the old "
        f"run is moved to {run_dir / 'replaced'}/), or choose another run_dir")


def has_previous_run(run_dir: Path) -> bool:
    """Whether `run_dir` held a run before this launch: the launcher wrote the pending recipe (it does so only when
    continuing a run), or a run's files other than the two a new launch writes (run.json, config.yaml) exist."""
    return (Path(run_dir) / PENDING_CONFIG).exists() or \
        any(n not in (RUN_FILE, "config.yaml") for n in existing_state(run_dir))


def sampler_state(extra: dict[str, Any]) -> dict[str, Any]:
    """The plain sampler's state inside a checkpoint's `extra` (the streaming packer nests it one level down)."""
    state = extra.get("sampler", {})
    return state if "global_batch_size" in state else state.get("sampler", {})


def mismatch(run_dir: Path, folder: Path, why: str) -> ResumeRefused:
    return ResumeRefused(f"trainer.resume=true refused for run_dir='{run_dir}': {why} (checkpoint {folder.name}); "
                         "resume with the old value, or start a new run with trainer.overwrite=true or another run_dir")


def check_resume(run_dir: Path, *, seed: int, global_batch_size: int) -> Optional[Path]:
    """Launcher side, before anything is written: raise `ResumeRefused` when `run_dir` holds a previous run with no
    checkpoint that verifies (sizes only), or its newest one was saved with another seed or global batch size.
    Returns the checkpoint the resume will continue from (None: no previous run)."""
    run_dir = Path(run_dir)
    if not existing_state(run_dir):
        return None  # no previous run: a resume starts one
    run_id = read_run_id(run_dir)
    for _, d in _step_dirs(run_dir / "checkpoints"):
        if verify(d, run_id, hashes=False) is None:
            saved = sampler_state((read_manifest(d) or {}).get("extra", {}))
            why = resume_mismatch(saved, {"seed": seed, "global_batch_size": global_batch_size})
            if why is not None:
                raise mismatch(run_dir, d, why)
            return d
    raise no_checkpoint(run_dir, run_id)


def accept_config(run_dir: Path, config_path: Path) -> None:
    """Rank 0, once the resume is accepted: the launch's recipe becomes the run's config.yaml (atomically)."""
    if Path(config_path).name != PENDING_CONFIG:
        return
    tmp = Path(run_dir) / "config.yaml.tmp"
    shutil.copyfile(config_path, tmp)
    os.replace(tmp, Path(run_dir) / "config.yaml")
