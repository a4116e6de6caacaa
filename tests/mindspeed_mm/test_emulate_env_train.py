"""`mindspeed-flow train` in the `emulate` extra's environment (transformers 4.57 with PyPI's torchvision, a CUDA
build whose compiled ops do not load next to CPU torch): transformers' Qwen2-VL imports torchvision, and the train
path applies the same compatibility fix as `emulate` (`mindspeed_flow.utils.torchvision_compat`). Runs where
torchvision is installed (`bash scripts/run_mindspeed_mm_tests.sh`); no MindSpeed-MM sources needed."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mindspeed_mm,
              pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                 reason="torchvision is not installed (the `emulate` extra installs it)")]


def test_train_runs_in_the_emulate_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "train", f"run_dir={run_dir}",
                           "experiment=default", "trainer.steps=2", "trainer.progress=false"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1] and all(x["loss"] > 0 for x in lines)
