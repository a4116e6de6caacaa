"""The hang watchdog's heartbeat thread never outlives the interpreter's finalization.

A job that ends without calling `Watchdog.stop()` (the MindSpeed-MM flow job ends inside Megatron's loop) used to
leave the daemon thread in a TCPStore call as Python finalized; coming back from C++ then ends the thread with
pthread_exit, and the unwinding through pybind11's noexcept GIL guard aborts a run that had succeeded
("terminate called without an active exception", exit -6): without the exit hook, the script below (a fast
heartbeat and a long finalization) aborted in 8 of 15 runs. Whether one run aborts depends on timing, so the tests
check the mechanism that prevents it, which does not: the thread is joined at exit, before finalization.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from mindspeed_flow.utils.multiproc import free_port

_SCRIPT = textwrap.dedent("""
    import atexit, datetime, os, sys
    import torch.distributed as dist
    from mindspeed_flow.resilience.watchdog import Watchdog

    server = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True,
                           timeout=datetime.timedelta(seconds=30))
    holder = {}

    def check() -> None:  # registered first, so it runs after the watchdog's own exit hook
        print("alive at finalization:", holder["wd"]._thread.is_alive(), flush=True)

    atexit.register(check)
    wd = Watchdog(0, 1, "encoder", timeout_s=0.5).start()
    holder["wd"] = wd
    wd.activity = "step 1"
    print("started:", wd._thread.is_alive(), flush=True)
    junk = [[object() for _ in range(50)] for _ in range(20000)]  # a finalization long enough to matter
    if sys.argv[1] == "stop":
        wd.stop()
        print("after stop:", wd._thread.is_alive(), flush=True)
""")


def _run(mode: str) -> str:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_heartbeat_thread_is_joined_at_exit_when_the_job_never_stops_it() -> None:
    out = _run("exit")
    assert "started: True" in out
    assert "alive at finalization: False" in out


def test_stop_waits_for_the_heartbeat_thread() -> None:
    out = _run("stop")
    assert "after stop: False" in out
    assert "alive at finalization: False" in out
