"""The launch path rehearsed on CPU: the user's MindSpeed-MM script (scripts/examples/finetune_tiny_qwen2_5_vl.sh,
upstream's shape) + a flow recipe -> `mindspeed-flow launch-script --from` -> `mindspeed-flow emulate --nodes 2
--shell`: the written 2-node script trains the tiny Qwen2.5-VL decoupled (encoder DP 2 on node 0, decoder TP 2 on
node 1), each node logging to its own file, and the loss falls."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.emulation.jobs import parse_iterations
from mindspeed_flow.runtime import launch_script

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 4


def test_user_script_to_two_node_rehearsal(mm_sources, tiny_assets, tmp_path: Path) -> None:
    user = REPO / "scripts/examples/finetune_tiny_qwen2_5_vl.sh"
    twin = tmp_path / "finetune_tiny_flow.sh"
    assert launch_script.main([str(REPO / "recipes/mindspeed_mm/tiny_enc2_dec_tp2.yaml"), "--from", str(user),
                               "--out", str(twin)]) == 0
    text = twin.read_text()
    assert "2 node(s) x 2" in text and "NNODES=${NNODES:-2}" in text and "\nTP=2\n" in text
    logs = tmp_path / "nodes"
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                                                            "NPUS_PER_NODE", "FLOW_LOG_DIR")}
    env |= {"TINY_WORKDIR": str(tiny_assets["workdir"]), "TRAIN_ITERS": str(ITERATIONS)}
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "emulate", "--nodes", "2", "--shell", str(twin),
                           "--log-dir", str(logs)], env=env, capture_output=True, text=True, timeout=840)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "2 nodes x 2 ranks of finetune_tiny_flow.sh" in out and "all 2 nodes finished" in out
    # each node's own log, as the script tees it (FLOW_LOG_DIR/train_<date>_node<rank>.log)
    node_logs = [sorted(logs.glob(f"train_*_node{i}.log")) for i in (0, 1)]
    assert [len(x) for x in node_logs] == [1, 1], sorted(p.name for p in logs.iterdir())
    node0, node1 = (x[0].read_text() for x in node_logs)
    assert "[mindspeed-flow] decoupled layout" in node0
    assert "rank 0 (encoder dp0)" in node0 and "rank 1 (encoder dp1)" in node0
    assert "rank 2 (decoder dp0 tp0)" in node1 and "rank 3 (decoder dp0 tp1)" in node1
    iterations, losses, _ = parse_iterations(node1)  # Megatron's line: the decoder's last rank, on the last node
    assert iterations == list(range(1, ITERATIONS + 1)) and f"[flow] iteration {ITERATIONS} |" in node1
    assert losses[-1] < losses[0], losses
