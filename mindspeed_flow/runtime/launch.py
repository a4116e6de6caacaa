"""`mindspeed-flow train [overrides...]`: compose the recipe, check it, write RUN_DIR/config.yaml, then start
the local workers through torchrun's own machinery (the elastic agent), or run as one worker when already
inside an outer torchrun.

Errors in the recipe or the layout are reported here, before any process starts, with the field and the rule.
"""
from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from mindspeed_flow.config.load import (RecipeError, check_rules, compose, load, model_hf_config, model_limits,
                                        save, to_job_config)
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.topology import Layout, LayoutError
from mindspeed_flow.utils.multiproc import free_port


def _inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def prepare(overrides: list[str]) -> tuple[Path, int]:
    """Compose + validate + write the run's config; returns (config path, world size the layout needs)."""
    cfg = compose(overrides)
    job = to_job_config(cfg)
    check_rules(job)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    spec = VLMSpec.from_hf_config(model_hf_config(job))
    layout.validate(limits=model_limits(spec), global_batch_size=job.trainer.global_batch_size,
                    expected_world=job.parallel.world_size)
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    save(cfg, path)
    load(path)  # exactly what every worker will read must validate here, before any process starts
    return path, layout.world_size


def launch_local(config_path: Path, nproc: int, max_restarts: int = 0) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mindspeed_flow.runtime.worker import run_worker_recorded

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"msf-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
        monitor_interval=0.1, start_method="fork",
    )
    elastic_launch(config, run_worker_recorded)(str(config_path))


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

    try:
        config_path, nproc = prepare(argv)
    except (RecipeError, LayoutError, ValueError, FileNotFoundError, HydraException, OmegaConfBaseException) as e:
        print(f"mindspeed-flow train: invalid recipe: {e}", file=sys.stderr)
        return 2
    if _inside_torchrun():
        from mindspeed_flow.runtime.worker import run_worker

        run_worker(str(config_path))
        return 0
    try:
        launch_local(config_path, nproc)
    except Exception as e:  # ChildFailedError carries each failed rank's root cause
        print(f"mindspeed-flow train: training failed: {e}", file=sys.stderr)
        return 1
    summary = summarize(config_path.parent)
    print(json.dumps(summary, indent=2))
    return 0
