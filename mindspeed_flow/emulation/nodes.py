"""`mindspeed-flow emulate --nodes N --shell SCRIPT`: a multi-node launch script rehearsed on one machine.

The script runs once per node rank, all at once, each with the variables a cluster gives it (NODE_RANK=i,
NNODES=N, MASTER_ADDR=localhost, a free MASTER_PORT shared by all, NPUS_PER_NODE = ranks per node), so the
torchrun agents meet at one local rendezvous as the nodes of a cluster would. Each node's output goes to
LOG_DIR/node<i>.out and, prefixed `[node i]`, to this process's stdout. The first node to fail stops the others
(their process groups get SIGTERM, then SIGKILL) and its first error line is the result.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

# the header line `mindspeed-flow launch-script --from` writes: "... with R.yaml (4 ranks = ...)"
_TWIN_WORLD = re.compile(r"^# The flow twin of .*? \((\d+) ranks = ", re.M)
_ERROR_LINE = re.compile(r"\berror\b|\w+Error\b|\bException\b|^mindspeed-flow\S*: ", re.I)
STOP_GRACE_S = 10.0


class NodesError(ValueError):
    """The rehearsal cannot be set up as asked."""


@dataclass
class NodeResult:
    node: int
    rc: int
    log: Path


def script_world(script: Path) -> Optional[int]:
    """The ranks a launch script written by `launch-script --from` needs (None for other scripts)."""
    m = _TWIN_WORLD.search(script.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def ranks_per_node(script: Path, nodes: int, nproc: Optional[int]) -> int:
    if nodes < 1:
        raise NodesError(f"--nodes {nodes}: must be >= 1")
    if nproc:
        return nproc
    world = script_world(script)
    if world is None:
        raise NodesError(f"{script.name} does not say how many ranks it launches (it was not written by "
                         "`mindspeed-flow launch-script --from`): give --nproc, the ranks per node")
    if world % nodes:
        raise NodesError(f"{script.name} launches {world} ranks, which {nodes} nodes cannot share evenly; "
                         f"use --nodes dividing {world}")
    return world // nodes


def node_env(base: dict[str, str], node: int, nodes: int, per_node: int, port: int) -> dict[str, str]:
    return dict(base, NODE_RANK=str(node), NNODES=str(nodes), NPUS_PER_NODE=str(per_node), MASTER_ADDR="localhost",
                MASTER_PORT=str(port))


def first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if _ERROR_LINE.search(line):
            return line
    return lines[-1] if lines else "(no output)"


def _pump(stream: IO[bytes], log: IO[bytes], prefix: bytes, echo: bool) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the process groups still running, then SIGKILL what is left after the grace period."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run_nodes(script: Path, nodes: int, per_node: int, env: dict[str, str], cwd: Path, log_dir: Path,
              port: int, echo: bool = True) -> tuple[list[NodeResult], Optional[int]]:
    """Run `bash script` once per node rank, concurrently: (each node's result, the node that failed first or None).
    The first failure stops the rest."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    logs = [log_dir / f"node{i}.out" for i in range(nodes)]
    handles = [open(path, "wb") for path in logs]
    try:
        for i in range(nodes):
            proc = subprocess.Popen(["bash", str(script)], cwd=str(cwd), env=node_env(env, i, nodes, per_node, port),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            procs.append(proc)
            t = threading.Thread(target=_pump, args=(proc.stdout, handles[i], f"[node {i}] ".encode(), echo),
                                 daemon=True)
            t.start()
            pumps.append(t)
        failed = None
        while failed is None and any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is None:
                time.sleep(0.2)
        failed = failed if failed is not None else next((i for i, p in enumerate(procs) if p.returncode), None)
        if failed is not None:
            _stop(procs)
    except BaseException:
        _stop(procs)
        raise
    finally:
        for t in pumps:
            t.join(timeout=30)
        for h in handles:
            h.close()
    return [NodeResult(i, p.returncode, logs[i]) for i, p in enumerate(procs)], failed


def report(results: list[NodeResult], first_failed: Optional[int]) -> tuple[int, str]:
    """(exit code, the line to print) for the rehearsal."""
    if first_failed is None:
        return 0, f"all {len(results)} nodes finished (logs: {results[0].log.parent})"
    r = results[first_failed]
    line = first_error_line(r.log.read_text(errors="replace"))
    return (r.rc if r.rc > 0 else 1), (f"node {r.node} of {len(results)} failed (exit {r.rc}): {line}  "
                                       f"(its output: {r.log})")
