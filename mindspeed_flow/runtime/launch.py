"""`mindspeed-flow train [overrides...]`: compose the recipe, check it, write RUN_DIR/config.yaml, then start
the local workers through torchrun's own machinery (the elastic agent), or run as one worker when already
inside an outer torchrun.

Errors in the recipe, the layout, the run directory or the data are reported here, before any process starts,
in one message (exit code 2): the field or file, and the rule. The run directory is claimed here (see
resilience/rundir.py). `trainer.max_restarts` is the launcher's: after a failure that is not a deliberate stop
(resilience/restarts.py) it launches the workers again and they resume by themselves from the newest verified
checkpoint; a deliberate stop (SIGTERM/SIGINT saved, `nan_policy=stop`, a refused resume) ends the job with its own
exit code and one line. The final summary says how many restarts the run needed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Optional

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mindspeed_flow import torch_compat
from mindspeed_flow.accelerator import detect_type
from mindspeed_flow.config.load import (RecipeError, check_rules, compose, explain_override_error, load,
                                        model_hf_config, save, to_job_config)
from mindspeed_flow.data.preflight import preflight
from mindspeed_flow.data.records import DataError
from mindspeed_flow.hosts.torch.trainer import run_worker, run_worker_recorded
from mindspeed_flow.resilience.checkpoint import valid_steps
from mindspeed_flow.resilience.diskspace import RunDirWriteError, check_room_for_save
from mindspeed_flow.resilience.preempt import EXIT_SAVED_ON_SIGNAL
from mindspeed_flow.resilience.restarts import CAUSE_ENV, CLEAR_ERRORS, RESTART_ENV
from mindspeed_flow.resilience.restarts import error_message as _message
from mindspeed_flow.resilience.restarts import error_type, is_deliberate, restart_count
from mindspeed_flow.resilience.resume import PENDING_CONFIG, ResumeRefused, check_resume
from mindspeed_flow.resilience.rundir import RunDirInUse, RunDirLock, claim, existing_state, read_run_id
from mindspeed_flow.resilience.watchdog import FAILURE_FILE
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.step.layout import Layout, LayoutError, ModelLimits
from mindspeed_flow.utils.multiproc import free_port


def _inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def prepare(overrides: list[str], *, owner: bool = True, lock: Optional[RunDirLock] = None) -> tuple[Path, int]:
    """Compose + validate + check the data + lock and claim the run directory + write the run's config; returns
    (config path, world size the layout needs). Only the `owner` (the launcher, or rank 0 under an outer torchrun)
    claims RUN_DIR, holding `lock` on it; the others validate the same recipe and write their copy of it to a
    private file."""
    cfg = compose(overrides)
    # as every worker will read it (plain YAML): a key added with `+` that the schema lacks fails here, before
    # the run directory is claimed
    job = to_job_config(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))
    check_rules(job)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    spec = VLMSpec.from_hf_config(model_hf_config(job))
    layout.validate(limits=ModelLimits.of(spec), global_batch_size=job.trainer.global_batch_size,
                    expected_world=job.parallel.world_size)
    if not owner:
        fd, name = tempfile.mkstemp(prefix="msf-config-", suffix=".yaml")
        os.close(fd)
        save(cfg, name)
        return Path(name), layout.world_size
    preflight(job.data, job.trainer.global_batch_size)
    run_dir = Path(job.run_dir)
    if lock is not None:  # before anything of the run is read: another launch may be writing it
        lock.acquire(run_dir)
    # Under an outer torchrun that restarted its workers, this is the same run continuing, not a rerun.
    restarted = restart_count() > 0
    # A resume is admitted (or refused, changing nothing) before the directory is claimed or config.yaml written;
    # a restart is the same run continuing and starts over at step 0 if it failed before its first checkpoint.
    continuing = (job.trainer.resume or restarted) and bool(existing_state(run_dir))
    if job.trainer.resume and not restarted:
        newest = check_resume(run_dir, seed=job.seed, global_batch_size=job.trainer.global_batch_size)
        if newest is not None and (job.trainer.checkpoint_every or job.trainer.save_final):
            check_room_for_save(run_dir, newest)
    claim(run_dir, resume=job.trainer.resume or restarted, overwrite=job.trainer.overwrite and not restarted,
          experiment=job.experiment_name)
    # Continuing a run: config.yaml stays the run's own until the workers accept the resume (resilience/resume.py).
    path = run_dir / (PENDING_CONFIG if continuing else "config.yaml")
    save(cfg, path)
    load(path)  # exactly what every worker will read must validate here, before any process starts
    return path, layout.world_size


def launch_local(config_path: Path, nproc: int, max_restarts: int = 0, stop_grace_s: int = 30) -> int:
    """Run the workers, restarting them up to `max_restarts` times after a failure that is not a deliberate stop
    (resilience/restarts.py); returns the restarts used. A failure that ends the job is raised with
    `restarts` set on it. Each attempt is one elastic launch with no restarts of its own, and its log folder is a
    temporary one removed afterwards (the agent's default leaves a `torchelastic_*` folder per launch, and failed
    workers their error files)."""
    saved_tempdir = tempfile.tempdir
    for attempt in range(max_restarts + 1):
        log_dir = tempfile.mkdtemp(prefix="mindspeed-flow-elastic-")
        os.environ[RESTART_ENV] = str(attempt)  # the workers inherit it: resume, drills armed in attempt 0 only
        os.environ[CAUSE_ENV] = cause_file = os.path.join(log_dir, "cause.txt")
        # The agent's per-worker error files (pytorch-errorfile-*.pickle, left behind by a failed worker) go to
        # the temporary directory: this attempt's, removed with it.
        tempfile.tempdir = log_dir
        try:
            _launch_once(config_path, nproc, log_dir, stop_grace_s)
            return attempt
        except Exception as e:
            if os.path.exists(cause_file):  # what a worker said it failed of, before its peers' consequences
                e.cause = Path(cause_file).read_text().strip()  # type: ignore[attr-defined]
            if attempt == max_restarts or is_deliberate(e):
                e.restarts = attempt  # type: ignore[attr-defined]
                raise
            cause = _first_cause(config_path.parent, e, short=True)
            print(f"[mindspeed-flow] restart {attempt + 1} of {max_restarts} (trainer.max_restarts) after: {cause}; "
                  "the workers resume from the newest verified checkpoint", file=sys.stderr, flush=True)
        finally:
            os.environ.pop(RESTART_ENV, None)
            os.environ.pop(CAUSE_ENV, None)
            tempfile.tempdir = saved_tempdir
            shutil.rmtree(log_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def _launch_once(config_path: Path, nproc: int, log_dir: str, stop_grace_s: int = 30) -> None:
    # Workers on CPU are forked (fast start). On a GPU/NPU they are spawned: a forked child cannot initialise
    # CUDA/NPU once anything in this process has (a library import may), and fresh interpreters are what torchrun
    # starts on a real cluster too.
    device_type = detect_type(os.environ.get("MSF_DEVICE", "auto"))
    start_method = "fork" if device_type == "cpu" else "spawn"
    if device_type != "cpu":
        # Microbatches change shape every step (images of every size, per-step padding): without expandable
        # segments the caching allocator keeps mapping new blocks for many steps (MindSpeed's own launch
        # scripts set the same for NPUs). A value the user exported wins.
        os.environ.setdefault(f"PYTORCH_{device_type.upper()}_ALLOC_CONF", "expandable_segments:True")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"msf-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method=start_method, logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        **torch_compat.shutdown_grace(stop_grace_s),
    )
    # The agent logs every failed worker's traceback as it reaps it (a page per rank, mostly the secondary failures
    # of its peers); the launcher prints the job's cause once, and for an unexpected error the agent's summary with
    # the root-cause traceback.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    elastic_launch(config, run_worker_recorded)(str(config_path))


def first_failure(exc: Exception) -> Optional[tuple[int, Any]]:
    """(rank, failure) of the job's cause: the earliest failure that raised one of `CLEAR_ERRORS`, else the earliest.
    A rank that fails on purpose (a full disk, bad data) takes its peers down with secondary errors ("connection
    closed by peer"), and on a busy machine one of those can be recorded first."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return None
    clear = {r: f for r, f in failures.items() if error_type(f) in CLEAR_ERRORS}
    pool = clear or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def _failure_summary(exc: Exception) -> str:
    found = first_failure(exc)
    if found is None:
        return str(exc)
    rank, failure = found
    if error_type(failure) in CLEAR_ERRORS:
        return f"rank {rank}: {_message(failure)}"
    return str(exc)


def _first_cause(run_dir: Path, exc: Exception, short: bool = False) -> str:
    """A hang found by the watchdog is the cause; the peers' errors (a reset connection) are its consequence.
    `short`: one line (the first failed rank and the first line of what it raised, or its exit code)."""
    failure = run_dir / FAILURE_FILE
    if failure.exists():
        return failure.read_text().strip()
    if getattr(exc, "cause", None):
        return exc.cause  # type: ignore[attr-defined]
    found = first_failure(exc)
    if not short or found is None:
        return _failure_summary(exc)
    rank, f = found
    said = _message(f).strip().splitlines()
    return f"rank {rank}: {said[0] if said else f'exit code {f.exitcode}'}"


def summarize(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if not lines:
        return {}
    losses = [x["loss"] for x in lines if x["loss"] is not None]
    secs = [x["step_seconds"] for x in lines[1:]] or [lines[0]["step_seconds"]]
    return {"steps": len(lines), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "mean_step_seconds": sum(secs) / len(secs),
            "samples_per_s": sum(x["samples"] for x in lines[1:]) / max(sum(secs), 1e-9) if len(lines) > 1 else None,
            "mean_padding_fraction": sum(x["padding_fraction"] for x in lines) / len(lines),
            "metrics": str(run_dir / "metrics.jsonl")}


USAGE = """usage: mindspeed-flow train [experiment=NAME] [key=value ...]

Hydra overrides of the recipe tree (recipes/): a group (experiment=, model=, data=, parallel=, packing=, flow=)
or a field (trainer.steps=20, parallel.backbone.dp=2, run_dir=runs/x); `+key=value` adds a key a dict field holds.
An unknown key or a value of the wrong type is a usage error (exit 2) naming the key and the nearest valid one."""


def main(argv: list[str]) -> int:
    lock = RunDirLock()
    try:
        return _main(argv, lock)
    finally:
        lock.release()


def _main(argv: list[str], lock: RunDirLock) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n\n" + (__doc__ or "").strip())
        return 0
    options = [a for a in argv if a.startswith("-")]
    if options:
        print(f"mindspeed-flow train: unknown option {options[0]!r}: train takes key=value overrides only\n{USAGE}",
              file=sys.stderr)
        return 2
    inside = _inside_torchrun()
    try:
        config_path, nproc = prepare(argv, owner=not inside or os.environ.get("RANK", "0") == "0", lock=lock)
    except DataError as e:
        print(f"mindspeed-flow train: bad data: {e}", file=sys.stderr)
        return 2
    except (RunDirInUse, ResumeRefused, RunDirWriteError) as e:
        print(f"mindspeed-flow train: {e}", file=sys.stderr)
        return 2
    except (RecipeError, LayoutError, ValueError, FileNotFoundError, HydraException, OmegaConfBaseException) as e:
        print(f"mindspeed-flow train: invalid recipe: {explain_override_error(e) or e}", file=sys.stderr)
        return 2
    if inside:
        run_worker(str(config_path))
        return 0
    failure = config_path.parent / FAILURE_FILE
    failure.unlink(missing_ok=True)
    try:
        trainer = load(config_path).trainer
        restarts = launch_local(config_path, nproc, max_restarts=trainer.max_restarts,
                                stop_grace_s=trainer.stop_grace_s)
    except Exception as e:  # ChildFailedError carries each failed rank's root cause
        restarts = getattr(e, "restarts", 0)
        after = f" after {restarts} restart(s)" if restarts else ""
        failures = getattr(e, "failures", {})
        codes = {f.exitcode for f in failures.values()}
        if failures and {error_type(f) for f in failures.values()} == {"ResumeRefused"}:
            # the workers refused what they loaded (a checkpoint failing its SHA-256, another dataset size)
            print(f"mindspeed-flow train: {_message(next(iter(failures.values()))).split(': ', 1)[-1]}",
                  file=sys.stderr)
            return 2
        if codes == {EXIT_SAVED_ON_SIGNAL} or type(e).__name__ == "SignalException":
            said = getattr(e, "cause", "") or ""
            if said.startswith("saved "):  # the writer rank's line once the stop's save had landed
                print(f"mindspeed-flow train: stopped{after}: {said}; continue with trainer.resume=true",
                      file=sys.stderr)
                return EXIT_SAVED_ON_SIGNAL
            sigval = getattr(e, "sigval", signal.SIGTERM)
            newest = valid_steps(config_path.parent / "checkpoints", read_run_id(config_path.parent))
            print(f"mindspeed-flow train: stopped by {signal.Signals(sigval).name}{after}; the workers did not save "
                  f"within trainer.stop_grace_s={trainer.stop_grace_s} s; trainer.resume=true continues from "
                  + (f"the newest valid checkpoint, step-{newest[-1]}" if newest else "step 0 (no valid checkpoint)"),
                  file=sys.stderr)
            return 128 + int(sigval)
        print(f"mindspeed-flow train: training failed{after}: {_first_cause(config_path.parent, e)}",
              file=sys.stderr)
        return 1
    finally:
        (config_path.parent / PENDING_CONFIG).unlink(missing_ok=True)  # installed as config.yaml if accepted
    summary = summarize(config_path.parent)
    summary["restarts"] = restarts  # how often trainer.max_restarts was drawn on (0: the run never failed)
    print(json.dumps(summary, indent=2))
    return 0
