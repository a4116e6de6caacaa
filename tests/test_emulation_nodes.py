"""`mindspeed-flow emulate --nodes N --shell SCRIPT`: one launch of the script per node rank, all at once, with the
variables each node of a cluster would have; the first node to fail stops the others and is reported with its
first error line."""
from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_flow.emulation import nodes


def _script(tmp_path: Path, body: str, header: str = "") -> Path:
    script = tmp_path / "launch.sh"
    script.write_text(f"#!/bin/bash\n{header}{body}")
    return script


def test_every_node_runs_with_its_cluster_variables(tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo "node $NODE_RANK of $NNODES x $NPUS_PER_NODE at $MASTER_ADDR:$MASTER_PORT '
                               'in $PWD"\n')
    results, failed = nodes.run_nodes(script, 3, 2, {"PATH": "/usr/bin:/bin"}, tmp_path, tmp_path / "logs", 1234,
                                      echo=False)
    assert failed is None and [r.rc for r in results] == [0, 0, 0]
    for r in results:
        assert r.log.read_text() == f"node {r.node} of 3 x 2 at localhost:1234 in {tmp_path}\n"
    assert nodes.report(results, failed) == (0, f"all 3 nodes finished (logs: {tmp_path / 'logs'})")


def test_first_failing_node_stops_the_others(tmp_path: Path) -> None:
    # node 1 fails at once; node 0 would wait (as a torchrun agent waits for a missing node) until it is stopped
    script = _script(tmp_path, 'if [ "$NODE_RANK" = 1 ]; then echo "starting"; echo "ValueError: bad recipe" >&2; '
                               'echo "later: RuntimeError"; exit 3; fi\nexec sleep 600\n')
    results, failed = nodes.run_nodes(script, 2, 1, {"PATH": "/usr/bin:/bin"}, tmp_path, tmp_path / "logs", 1,
                                      echo=False)
    assert failed == 1 and results[1].rc == 3 and results[0].rc != 0  # node 0 was stopped, not left waiting
    rc, line = nodes.report(results, failed)
    assert rc == 3 and line.startswith("node 1 of 2 failed (exit 3): ValueError: bad recipe  (its output: ")


def test_ranks_per_node_from_a_twin_or_nproc(tmp_path: Path) -> None:
    twin = _script(tmp_path, "", "# The flow twin of x.sh: the same job trained decoupled with r.yaml (4 ranks = "
                                 "encoder dp2 tp1 pp1 cp1, backbone dp1 tp2 pp1 cp1), 2 node(s) x 2.\n")
    assert nodes.ranks_per_node(twin, 2, None) == 2 and nodes.ranks_per_node(twin, 1, None) == 4
    assert nodes.ranks_per_node(twin, 2, 3) == 3  # --nproc: ranks per node, as given
    with pytest.raises(nodes.NodesError, match="4 ranks, which 3 nodes cannot share evenly"):
        nodes.ranks_per_node(twin, 3, None)
    with pytest.raises(nodes.NodesError, match="give --nproc"):
        nodes.ranks_per_node(_script(tmp_path, "torchrun x.py\n"), 2, None)
