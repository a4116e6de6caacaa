"""Fixtures for the MindSpeed-MM integration tests: real sources, the tiny assets, and a job runner.

The tests run real `pretrain_vlm.py` jobs through `mindspeed-flow emulate` and are skipped (with the reason)
unless MINDSPEED_MM_HOME, MINDSPEED_HOME and MEGATRON_HOME point at the sources and the interpreter has
MindSpeed-MM's dependencies (transformers 4.57.x, the `emulate` extra). Set MSF_EMULATION_RECORD=<file> to
append one JSON line per job (layout, losses, per-iteration times, source commits, package versions).
"""
from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import pytest

from mindspeed_flow.emulation.jobs import JobResult, emulate_job
from mindspeed_flow.emulation.quickstart import dependency_problem
from mindspeed_flow.emulation.sources import SourceError, Sources, find_sources

JOB_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def mm_sources() -> Sources:
    try:
        sources = find_sources()
    except SourceError as err:
        pytest.skip(f"MindSpeed-MM sources absent: {err}")
    problem = dependency_problem()
    if problem:
        pytest.skip(problem)
    return sources


@pytest.fixture(scope="session")
def tiny_assets(mm_sources: Sources, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mindspeed_flow.emulation import tiny

    root = Path(os.environ.get("MSF_TINY_WORKDIR") or tmp_path_factory.mktemp("tiny"))
    paths = tiny.prepare_workdir(root, n_samples=64)
    paths["model_pp2_json"], _ = tiny.write_configs(root, [2, 0], [1, 1], name="model_pp2.json")
    return paths


def _record(name: str, nproc: int, result: JobResult, sources: Sources) -> None:
    path = os.environ.get("MSF_EMULATION_RECORD")
    if not path:
        return
    versions = {d: metadata.version(d) for d in ("torch", "transformers", "torchvision", "numpy", "datasets",
                                                  "peft", "huggingface_hub", "pandas")}
    row = {"job": name, "nproc": nproc, "rc": result.rc, "iterations": result.iterations, "losses": result.losses,
           "times_ms": result.times_ms, "called": sorted(result.log.get("CALLED", ())),
           "missing": sorted(result.log.get("MISSING", ())),
           "sources": {t.name: t.commit for t in sources.trees()}, "versions": versions}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


@pytest.fixture
def run_job(mm_sources: Sources, tmp_path: Path):
    """run_job(name, argv, nproc=2, patches=False, flow_recipe=None) -> JobResult, via `mindspeed-flow emulate`."""

    def run(name: str, argv: list[str], nproc: int = 2, patches: bool = False,
            flow_recipe: Path | None = None) -> JobResult:
        result = emulate_job(name, argv, log_dir=tmp_path, nproc=nproc, patches=patches, flow_recipe=flow_recipe)
        _record(name, nproc, result, mm_sources)
        return result

    return run
