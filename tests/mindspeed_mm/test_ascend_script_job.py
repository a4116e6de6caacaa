"""The A2 launch script, unchanged, runs a real flow-patched MindSpeed-MM job: under the emulated NPU on CPU
(`mindspeed-flow emulate --shell`), one node of 3 ranks (encoder 1 + decoder DP 2), the tiny Qwen2.5-VL."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.emulation.jobs import parse_iterations
from mindspeed_flow.utils.multiproc import free_port

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]


def test_a2_script_trains_a_flow_job(mm_sources, tiny_assets, tmp_path: Path) -> None:
    cann = tmp_path / "set_env.sh"
    cann.write_text("# stands in for CANN's set_env.sh on a machine without CANN\n")
    env = os.environ | {
        "CANN_ENV": str(cann), "NNODES": "1", "NPUS_PER_NODE": "3", "PARTS": "encoder:1x1x1x1 backbone:2x1x1x1",
        "FLOW_RECIPE": str(REPO / "recipes/mindspeed_mm/tiny_enc1_dec_dp2.yaml"), "GLOBAL_BATCH": "4",
        "MM_DATA": str(tiny_assets["data_json"]), "MM_MODEL": str(tiny_assets["model_json"]), "VOCAB_SIZE": "384",
        "SEQ_LENGTH": "128", "TRAIN_ITERS": "3", "LR": "1e-3", "SAVE_PATH": str(tmp_path / "save"),
        "EXTRA_ARGS": "--num-workers 0", "MASTER_PORT": str(free_port()), "LOG_DIR": str(tmp_path / "logs"),
    }
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "emulate", "--shell",
                           str(REPO / "scripts/ascend/train_a2.sh")], env=env, capture_output=True, text=True,
                          timeout=1500)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "[Atlas 800T A2] node 0 of 1: ranks encoder 0-0, backbone 1-2" in output
    iterations, losses, _ = parse_iterations(output)
    assert iterations[:3] == [1, 2, 3] and losses[2] < losses[0], (iterations, losses)
    assert "[flow] iteration 3 |" in output  # trained decoupled, not as the plain job
    assert "[flow] iteration 3 |" in next((tmp_path / "logs").glob("train_*_node0.log")).read_text()
    assert (tmp_path / "save/latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # the script's --tensorboard-dir is SAVE_PATH/tensorboard, so the flow job's RUN_DIR is SAVE_PATH
    metrics = (tmp_path / "save/metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics] == [1, 2, 3]
    assert list((tmp_path / "save/tensorboard/flow").glob("events.out.tfevents.*"))
