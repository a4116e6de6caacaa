"""Run a function on N local ranks (fork start method, gloo, one thread per rank, a free port).

Used by the tests and by benchmarks that need a real process group without torchrun. Each rank initialises
gloo through a TCPStore on a free port; an exception on any rank is re-raised in the parent with the rank and
the remote traceback, and a rank that does not finish in time is killed and reported by number.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from mindspeed_flow import torch_compat
from mindspeed_flow.utils import free_port  # noqa: F401  (re-exported: the tests' and benches' import)


class RankFailure(RuntimeError):
    """One or more ranks raised or timed out; the message holds each failing rank's traceback."""


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout_s: float,
               args: tuple, kwargs: dict, queue: "mp.Queue") -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    store = None
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0),
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        _wait_for_peers(store, rank, world_size, timeout_s)
        if dist.is_initialized():
            try:
                torch_compat.destroy_process_groups()  # torch 2.7's gloo could deadlock in a plain destroy
            except Exception:  # noqa: BLE001
                pass


def _wait_for_peers(store: "object", rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 0 hosts the TCPStore: if it exits while slower ranks still create groups or talk, they fail with
    'Broken pipe'. Every rank checks in, finished or failed, and rank 0 leaves only when all have (or at the
    deadline), so a fast rank never takes the store down under a slow one."""
    if store is None:
        return

    try:
        store.add("msf_ranks_done", 1)
        deadline = time.monotonic() + timeout_s
        while rank == 0 and store.add("msf_ranks_done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - a dead store means there is nobody left to wait for
        pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
              **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked ranks; return results by rank.

    `fn` must be picklable-free (fork inherits it) and its return value picklable.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, timeout_s, args, kwargs, queue),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = timeout_s + 30.0

    start = time.monotonic()
    while len(results) + len(errors) < world_size:
        left = deadline - (time.monotonic() - start)
        if left <= 0:
            break
        try:
            rank, status, payload = queue.get(timeout=min(left, 1.0))
        except queue_mod.Empty:
            # A rank that died without reporting (segfault, os._exit) is reported instead of waited for.
            for r, p in enumerate(procs):
                if not p.is_alive() and r not in results and r not in errors and p.exitcode not in (0, None):
                    errors[r] = f"rank {r} exited with code {p.exitcode} without reporting"
            continue
        (results if status == "ok" else errors)[rank] = payload
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    for r in missing:
        errors[r] = f"rank {r} did not finish within {deadline:.0f}s"
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{msg}")
    return [results[r] for r in range(world_size)]
