"""`mindspeed-flow train [overrides...]`: compose the recipe, check it, write RUN_DIR/config.yaml, then start
the local workers through torchrun's own machinery (the elastic agent), or run as one worker when already
inside an outer torchrun.

Errors in the recipe, the layout, the run directory or the data are reported here, before any process starts,
in one message (exit code 2): the field or file, and the rule. The run directory is claimed here (see
resilience/rundir.py); `trainer.max_restarts` goes to the elastic agent, whose restarted workers resume by
themselves from the newest verified checkpoint.
"""
from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from mindspeed_flow.config.load import (RecipeError, check_rules, compose, load, model_hf_config, model_limits,
                                        save, to_job_config)
from mindspeed_flow.data.preflight import DataError, preflight
from mindspeed_flow.resilience.preempt import EXIT_SAVED_ON_SIGNAL
from mindspeed_flow.resilience.rundir import RunDirInUse, claim
from mindspeed_flow.resilience.watchdog import FAILURE_FILE
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.topology import Layout, LayoutError
from mindspeed_flow.utils.multiproc import free_port


def _inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def prepare(overrides: list[str], *, owner: bool = True) -> tuple[Path, int]:
    """Compose + validate + check the data + claim the run directory + write the run's config; returns (config
    path, world size the layout needs). Only the `owner` (the launcher, or rank 0 under an outer torchrun)
    claims RUN_DIR; the others validate the same recipe and write their copy of it to a private file."""
    cfg = compose(overrides)
    job = to_job_config(cfg)
    check_rules(job)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    spec = VLMSpec.from_hf_config(model_hf_config(job))
    layout.validate(limits=model_limits(spec), global_batch_size=job.trainer.global_batch_size,
                    expected_world=job.parallel.world_size)
    if not owner:
        import tempfile

        fd, name = tempfile.mkstemp(prefix="msf-config-", suffix=".yaml")
        os.close(fd)
        save(cfg, name)
        return Path(name), layout.world_size
    preflight(job.data, job.trainer.global_batch_size)
    run_dir = Path(job.run_dir)
    # Under an outer torchrun that restarted its workers, this is the same run continuing, not a rerun.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    claim(run_dir, resume=job.trainer.resume or restarted, overwrite=job.trainer.overwrite and not restarted,
          experiment=job.experiment_name)
    path = run_dir / "config.yaml"
    save(cfg, path)
    load(path)  # exactly what every worker will read must validate here, before any process starts
    return path, layout.world_size


def launch_local(config_path: Path, nproc: int, max_restarts: int = 0) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mindspeed_flow.accelerator import detect_type
    from mindspeed_flow.runtime.worker import run_worker_recorded

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
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
        monitor_interval=0.1, start_method=start_method,
    )
    elastic_launch(config, run_worker_recorded)(str(config_path))


# Errors the workers raise on purpose, with a message that says it all: the launcher prints that message alone,
# not the elastic agent's page of tracebacks (which it keeps for anything unexpected).
CLEAR_ERRORS = ("CheckpointSaveError", "TooManyBadSamples", "DataError", "PeerHang", "NonFiniteLoss")


def _failure_summary(exc: Exception) -> str:
    first = getattr(exc, "get_first_failure", None)
    if first is None:
        return str(exc)
    rank, failure = first()
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
    if message.split(":", 1)[0].rsplit(".", 1)[-1] in CLEAR_ERRORS:
        return f"rank {rank}: {message}"
    return str(exc)


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


def main(argv: list[str]) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    inside = _inside_torchrun()
    try:
        config_path, nproc = prepare(argv, owner=not inside or os.environ.get("RANK", "0") == "0")
    except DataError as e:
        print(f"mindspeed-flow train: bad data: {e}", file=sys.stderr)
        return 2
    except RunDirInUse as e:
        print(f"mindspeed-flow train: {e}", file=sys.stderr)
        return 2
    except (RecipeError, LayoutError, ValueError, FileNotFoundError, HydraException, OmegaConfBaseException) as e:
        print(f"mindspeed-flow train: invalid recipe: {e}", file=sys.stderr)
        return 2
    if inside:
        from mindspeed_flow.runtime.worker import run_worker

        run_worker(str(config_path))
        return 0
    failure = config_path.parent / FAILURE_FILE
    failure.unlink(missing_ok=True)
    try:
        launch_local(config_path, nproc, max_restarts=load(config_path).trainer.max_restarts)
    except Exception as e:  # ChildFailedError carries each failed rank's root cause
        codes = {f.exitcode for f in getattr(e, "failures", {}).values()}
        if codes == {EXIT_SAVED_ON_SIGNAL} or type(e).__name__ == "SignalException":
            print(f"mindspeed-flow train: stopped by a signal ({e if not codes else 'SIGTERM/SIGINT'}); the workers "
                  f"saved a checkpoint when they could: continue with trainer.resume=true", file=sys.stderr)
            return EXIT_SAVED_ON_SIGNAL
        # A hang found by the watchdog is the cause; the peers' errors (a reset connection) are its consequence.
        cause = failure.read_text().strip() if failure.exists() else _failure_summary(e)
        print(f"mindspeed-flow train: training failed: {cause}", file=sys.stderr)
        return 1
    summary = summarize(config_path.parent)
    print(json.dumps(summary, indent=2))
    return 0
