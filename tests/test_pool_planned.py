"""The pool's planned mode (`pool/planned.py`), and why the discovered mode cannot carry the flow job's payloads.

On the strict emulated NPU each HCCL communicator runs its operations in issue order, a send completing only when
the peer's stream reaches the matching receive; with `P2P_HCCL_BUFFSIZE=0` (torch_npu's setting that puts a group's
point-to-point operations on the group communicator instead of one per pair) every operation of a communicator shares
one stream. Two producers and two consumers, in the flow job's pattern (each producer's items of one microbatch slot
go to both consumers, in its encode order), are run through both modes:

- `EmbeddingPool` with device payload groups posts a consumer's payload receives in the order its per-producer
  threads see the headers land. When the consumers see them in opposite producer orders (forced here by expecting
  the producers in opposite orders and waiting until the first one's device receive is posted; the threads can
  produce it on their own), the four streams wait on each other in a cycle and every rank times out;
- `PlannedTransport` posts the same plan in one global order per direction and finishes.

With one stream per pair (torch_npu's default), the pool finishes the same crossed pattern: the deadlock needs shared
streams, which is exactly what the planned mode's global order makes safe.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.pool import PlannedItem, PlannedTransport, PoolProtocolError
from mindspeed_flow.pool.wire import CHANNEL_EMBEDDING, CHANNEL_GRAD
from mindspeed_flow.utils.multiproc import run_ranks

HIDDEN = 8
PRODUCERS, CONSUMERS = [0, 1], [2, 3]
# One microbatch slot of the flow job's plan: sample -> (producer, consumer, tokens). Producer 0 encodes samples 0
# (for consumer 3) then 1 (consumer 2); producer 1 encodes 2 (consumer 2) then 3 (consumer 3). Each consumer's
# microbatch takes its samples in this (row) order.
PLAN = {0: (0, 3, 3), 1: (0, 2, 4), 2: (1, 2, 5), 3: (1, 3, 6)}
DEADLOCK_TIMEOUT_S = 5.0  # how long the pool waits before it reports the cycle (a real cycle never resolves)


# ------------------------------------------------------------------------------------------ planned mode on gloo
def _transfer(rank: int, world: int, expected_sample: int) -> object:
    t = PlannedTransport(rank=rank, embedding_group=dist.new_group([0, 1]), gradient_group=dist.new_group([0, 1]),
                         header_group=dist.new_group([0, 1], backend="gloo"), device=torch.device("cpu"),
                         timeout_s=20)
    if rank == 0:  # producer: two embeddings in its order, then the gradient of the first
        t.post_receives(CHANNEL_GRAD, [PlannedItem(1, 0, 7, 3)], hidden=4)
        t.send(CHANNEL_EMBEDDING, 1, 0, 7, torch.full((3, 1, 4), 1.5))
        t.send(CHANNEL_EMBEDDING, 1, 0, 8, torch.full((2, 1, 4), 2.5))
        grad = t.receive(CHANNEL_GRAD, 1, 0, 7)
        t.flush()
        return grad.float().sum().item()
    t.post_receives(CHANNEL_EMBEDDING, [PlannedItem(0, 0, 7, 3), PlannedItem(0, 0, expected_sample, 2)], hidden=4)
    first = t.receive(CHANNEL_EMBEDDING, 0, 0, 7)
    t.send(CHANNEL_GRAD, 0, 0, 7, torch.ones(3, 1, 4))
    try:
        second = t.receive(CHANNEL_EMBEDDING, 0, 0, expected_sample)
    except PoolProtocolError as err:
        t.flush()
        return str(err)
    t.flush()
    return (first.float().mean().item(), second.float().mean().item())


def test_planned_transport_moves_items_in_plan_order() -> None:
    producer, consumer = run_ranks(_transfer, 2, 8, timeout_s=60)
    assert producer == 12.0 and consumer == (1.5, 2.5)


def test_planned_transport_stops_when_plans_differ() -> None:
    _, message = run_ranks(_transfer, 2, 9, timeout_s=60)
    assert "expected the embedding of sample 9 (iteration 1) from rank 0" in message
    assert "sent embedding of sample 8" in message and "plans differ" in message


# ------------------------------------------------------------------------------------------ the strict emulated NPU
@pytest.fixture(scope="module")
def built_extension() -> None:
    """Build (or find) the npu extension in a throwaway interpreter before any rank needs it."""
    code = "from mindspeed_flow.emulation import npu_ext; npu_ext.load()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _npu_groups(one_stream: bool) -> tuple[Any, Any, Any]:
    """Strict emulation in this forked rank; (embedding group, gradient group) on hccl and the header group."""
    if one_stream:
        os.environ["P2P_HCCL_BUFFSIZE"] = "0"
    from mindspeed_flow import emulation

    assert emulation.activate(mode="strict") == "strict"
    ranks = PRODUCERS + CONSUMERS
    return (dist.new_group(ranks, backend="hccl"), dist.new_group(ranks, backend="hccl"),
            dist.new_group(ranks, backend="gloo"))


def _emb(sample_id: int) -> torch.Tensor:
    return torch.full((PLAN[sample_id][2], HIDDEN), float(sample_id), device="npu")


class _DevicePosts:
    """Records the peers of this rank's device receives, in posting order (wraps torch.distributed.irecv in a
    forked rank), so the test can wait until a receive is posted rather than for some time."""

    def __init__(self, groups: tuple[Any, Any]) -> None:
        self.groups = groups
        self.peers: list[int] = []
        self.cond = threading.Condition()
        original = dist.irecv

        def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
            work = original(tensor, src, group=group, tag=tag, **kw)
            if any(group is g for g in self.groups):
                with self.cond:
                    self.peers.append(src)
                    self.cond.notify_all()
            return work

        dist.irecv = irecv

    def wait_for(self, peer: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: peer in self.peers)


def _pool_crossed(rank: int, world: int, one_stream: bool) -> dict[str, Any]:
    """The pool with device payload groups; consumer 2 sees producer 0's header first, consumer 3 producer 1's."""
    from mindspeed_flow.pool import EmbeddingPool, PoolError

    emb_group, grad_group, gloo = _npu_groups(one_stream)
    posts = _DevicePosts((emb_group, grad_group))
    pool = EmbeddingPool(rank=rank, group=gloo, capacity_bytes=1 << 20, timeout_s=DEADLOCK_TIMEOUT_S,
                         device=torch.device("npu:0"), data_groups=(emb_group, grad_group))
    mine = [sid for sid, (p, c, _) in PLAN.items() if rank in (p, c)]
    try:
        if rank in PRODUCERS:
            for sid in mine:  # put_many posts on this thread: the device sends go out in encode order
                pool.put_many([_emb(sid)], sample_ids=[sid], step=0, consumer=PLAN[sid][1])
            grads = [float(pool.wait_grad(sample_id=sid, step=0, consumer=PLAN[sid][1])[0, 0]) for sid in mine]
        else:
            for producer in ([0, 1] if rank == 2 else [1, 0]):
                pool.expect(producer=producer, items=[(sid, 0) for sid in mine if PLAN[sid][0] == producer])
                posts.wait_for(producer)
            grads = []
            for sid in mine:
                emb = pool.get(sample_id=sid, step=0, producer=PLAN[sid][0])
                pool.return_grad(emb * 2, sample_id=sid, step=0, producer=PLAN[sid][0])
        pool.flush()
        outcome = "finished"
    except PoolError as err:
        outcome, grads = f"{type(err).__name__}: {err}", []
    dist.barrier(group=gloo)  # leave together; the stuck streams' threads are detached and die with the process
    return {"outcome": outcome, "grads": grads, "posts": posts.peers}


def _planned(rank: int, world: int, one_stream: bool) -> dict[str, Any]:
    """The same plan through the planned mode: receives posted in the global order (slot, producer, position)."""
    emb_group, grad_group, gloo = _npu_groups(one_stream)
    t = PlannedTransport(rank=rank, embedding_group=emb_group, gradient_group=grad_group, header_group=gloo,
                         device=torch.device("npu:0"), timeout_s=DEADLOCK_TIMEOUT_S, dtype=torch.float32)
    embedding_order = sorted(PLAN)  # slot 0, producer 0's samples in its encode order, then producer 1's
    gradient_order = sorted(PLAN, key=lambda sid: (PLAN[sid][1], sid))  # slot 0, consumer, row
    grads = []
    if rank in PRODUCERS:
        t.post_receives(CHANNEL_GRAD, [PlannedItem(PLAN[s][1], 0, s, PLAN[s][2]) for s in gradient_order
                                       if PLAN[s][0] == rank], HIDDEN)
        mine = [sid for sid in embedding_order if PLAN[sid][0] == rank]
        for sid in mine:
            t.send(CHANNEL_EMBEDDING, PLAN[sid][1], 0, sid, _emb(sid))
        grads = [float(t.receive(CHANNEL_GRAD, PLAN[sid][1], 0, sid)[0, 0]) for sid in mine]
    else:
        t.post_receives(CHANNEL_EMBEDDING, [PlannedItem(PLAN[s][0], 0, s, PLAN[s][2]) for s in embedding_order
                                            if PLAN[s][1] == rank], HIDDEN)
        for sid in [s for s in PLAN if PLAN[s][1] == rank]:
            emb = t.receive(CHANNEL_EMBEDDING, PLAN[sid][0], 0, sid)
            t.send(CHANNEL_GRAD, PLAN[sid][0], 0, sid, emb * 2)
    t.flush()
    dist.barrier(group=gloo)
    return {"outcome": "finished", "grads": grads}


def _producer_grads() -> list[list[float]]:
    return [[2.0 * sid for sid in PLAN if PLAN[sid][0] == p] for p in PRODUCERS]


@pytest.mark.usefixtures("built_extension")
def test_pool_device_payloads_deadlock_on_one_stream_per_communicator() -> None:
    results = run_ranks(_pool_crossed, 4, True, timeout_s=120)
    # Consumer 2 posted producer 0's payload receive first, consumer 3 producer 1's: crossed against the producers'
    # send orders (0: to consumer 3 first; 1: to consumer 2 first), so no stream's head can ever complete.
    assert results[2]["posts"][:2] == [0, 1] and results[3]["posts"][:2] == [1, 0]
    for rank, got in enumerate(results):
        assert got["outcome"].startswith("PoolTimeout: "), (rank, got["outcome"])
        assert f"rank {rank} waited {DEADLOCK_TIMEOUT_S:.1f} s for the " in got["outcome"], got["outcome"]


@pytest.mark.usefixtures("built_extension")
def test_pool_device_payloads_finish_the_same_pattern_with_a_stream_per_pair() -> None:
    results = run_ranks(_pool_crossed, 4, False, timeout_s=120)
    assert [r["outcome"] for r in results] == ["finished"] * 4
    assert [r["grads"] for r in results[:2]] == _producer_grads()


@pytest.mark.usefixtures("built_extension")
@pytest.mark.parametrize("one_stream", [True, False], ids=["one stream per communicator", "a stream per pair"])
def test_planned_mode_moves_the_plan_on_in_order_device_streams(one_stream: bool) -> None:
    results = run_ranks(_planned, 4, one_stream, timeout_s=120)
    assert [r["outcome"] for r in results] == ["finished"] * 4
    assert [r["grads"] for r in results[:2]] == _producer_grads()
