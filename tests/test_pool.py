"""The embedding pool on real gloo ranks: exact round trips, gradients, plans, backpressure, timeouts, dead peers."""
from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.pool import (EmbeddingPool, PoolError, PoolPeerError, PoolProtocolError, PoolShapeError,
                                 PoolTimeout)
from mindspeed_flow.pool.wire import CHANNEL_EMBEDDING, CHANNEL_GRAD, MAX_BATCH
from mindspeed_flow.utils.multiproc import RankFailure, run_ranks

HIDDEN = 8
CPU = torch.device("cpu")


def _embedding(sample_id: int, step: int, tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The embedding every rank can recompute for (sample, step), so receivers check bytes exactly."""
    gen = torch.Generator().manual_seed(1000 * step + sample_id)
    return torch.randn(tokens, HIDDEN, generator=gen).to(dtype)


def _grad_of(emb: torch.Tensor, sample_id: int) -> torch.Tensor:
    return emb * 2 + sample_id


def _wait_all_credited(pool: EmbeddingPool, leave: int = 0) -> None:
    """Wait until every item this rank sent but `leave` has been credited back (run_ranks' timeout catches a
    hang). Credits are delivered asynchronously: a consumer's flush() returns once the producer has the bytes."""
    while pool.stats().inflight_items > leave:
        time.sleep(0.01)


def _settle_and_close(pool: EmbeddingPool) -> dict:
    """Flush, wait until every item is credited on both ranks, close; the rank's pool stats."""
    pool.flush()
    dist.barrier()
    _wait_all_credited(pool)
    stats = asdict(pool.stats())
    pool.close()
    return stats


GO_TAG = 0x60  # the tests' own "go on" message between ranks, far from the pool's tags


def _signal(peers: list[int]) -> None:
    for peer in peers:
        dist.send(torch.ones(1), dst=peer, tag=GO_TAG)


def _await_signal(src: int) -> None:
    dist.recv(torch.empty(1), src=src, tag=GO_TAG)


def _signal_once_a_put_blocks(pool: EmbeddingPool, peers: list[int]) -> threading.Thread:
    """From a side thread: tell `peers` to start consuming once a put of this rank is waiting for credits.

    Consumers that hold back until then make "the producer blocked on a full pool" an event, not a race.
    """
    def run() -> None:
        while pool.stats().put_blocks == 0:
            time.sleep(0.005)
        _signal(peers)

    thread = threading.Thread(target=run, name="test-go-when-blocked", daemon=True)
    thread.start()
    return thread


def _pool(rank: int, **kw: object) -> EmbeddingPool:
    kw.setdefault("capacity_bytes", 1 << 20)
    kw.setdefault("timeout_s", 20.0)
    return EmbeddingPool(rank=rank, group=None, device=CPU, **kw)


# ---------------------------------------------------------------- round trip, dtypes, shapes, gradients

ROUND_TRIP = [  # sample_id, shape, dtype
    (0, (5, HIDDEN), torch.float32),
    (1, (17, HIDDEN), torch.bfloat16),
    (2, (1, HIDDEN), torch.float32),
    (3, (0, HIDDEN), torch.float32),      # a sample whose image yields no tokens: header only
    (4, (3, 4, 2), torch.bfloat16),
    (5, (64, HIDDEN), torch.float16),
]


def _round_trip(rank: int, world: int) -> dict:
    pool = _pool(rank)
    step = 3
    if rank == 0:
        for sid, shape, dtype in ROUND_TRIP:
            h = pool.put(_embedding(sid, step, shape[0], dtype).reshape(shape), sample_id=sid, step=step, consumer=1)
            assert (h.producer, h.consumer, h.shape, h.dtype) == (0, 1, shape, dtype)
        for sid, shape, dtype in reversed(ROUND_TRIP):
            grad = pool.wait_grad(sample_id=sid, step=step, consumer=1)
            expected = _grad_of(_embedding(sid, step, shape[0], dtype).reshape(shape), sid)
            assert grad.dtype == dtype and torch.equal(grad, expected), f"gradient of sample {sid} differs"
        pool.put(_embedding(9, step, 4), sample_id=9, step=step, consumer=1)
    else:
        pool.expect(producer=0, items=[(sid, step) for sid, _, _ in ROUND_TRIP])
        for sid, shape, dtype in reversed(ROUND_TRIP):  # out of send order: served from the prefetch buffer
            emb = pool.get(sample_id=sid, step=step, producer=0, expected_shape=shape)
            assert emb.dtype == dtype and torch.equal(emb, _embedding(sid, step, shape[0], dtype).reshape(shape))
            pool.return_grad(_grad_of(emb, sid), sample_id=sid, step=step, producer=0)
        try:
            pool.get(sample_id=9, step=step, producer=0, expected_shape=(5, HIDDEN))
            raise AssertionError("a shape mismatch was not reported")
        except PoolShapeError as exc:
            msg = str(exc)
            for part in ("sample 9", "producer rank 0", "[4, 8]", "[5, 8]"):
                assert part in msg, f"{part!r} missing from: {msg}"
    pool.flush()
    dist.barrier()
    _wait_all_credited(pool, leave=1 if rank == 0 else 0)  # sample 9 is never taken
    stats = pool.stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool.close(wait=False)  # sample 9 stays in the pool, its credit and gradient never come
    closing = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if rank == 0:
        assert closing and "still waiting for messages from rank(s) [1]" in closing[0], closing
    return asdict(stats)


def test_round_trip_dtypes_shapes_and_gradients():
    producer, consumer = run_ranks(_round_trip, 2, timeout_s=40)
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in ROUND_TRIP)
    assert producer["puts"] == len(ROUND_TRIP) + 1 and producer["grads_received"] == len(ROUND_TRIP)
    assert producer["bytes_sent"] == total + 4 * HIDDEN * 4
    assert consumer["gets"] == len(ROUND_TRIP) and consumer["grads_sent"] == len(ROUND_TRIP)
    assert consumer["bytes_received"] == producer["bytes_sent"]
    assert consumer["buffered_items"] == 1  # sample 9: refused by the shape check, still in the pool
    assert producer["inflight_items"] == 1 and producer["inflight_bytes"] == 4 * HIDDEN * 4


def _bad_arguments(rank: int, world: int) -> list[str]:
    messages = []
    for kwargs in ({"rank": 1}, {"capacity_bytes": 0}, {"timeout_s": 0}, {"host_tier_bytes": -1},
                   {"max_batch_bytes": 0}):
        try:
            EmbeddingPool(**{"rank": rank, "group": None, "capacity_bytes": 1, "timeout_s": 1.0, "device": CPU,
                             **kwargs})
            messages.append(f"accepted {kwargs}")
        except ValueError as exc:
            messages.append(str(exc))
    pool = _pool(rank)
    for call in (lambda: pool.put(torch.ones(2), sample_id=0, step=0, consumer=0),
                 lambda: pool.get(sample_id=0, step=0, producer=3)):
        try:
            call()
            messages.append("accepted a bad peer")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_bad_arguments_are_named():
    messages = run_ranks(_bad_arguments, 1, timeout_s=20)[0]
    assert "rank=1 but this process is global rank 0" in messages[0]
    assert "capacity_bytes must be > 0" in messages[1] and "timeout_s must be > 0" in messages[2]
    assert "host_tier_bytes must be >= 0" in messages[3]
    assert "max_batch_bytes must be > 0" in messages[4]
    assert "the consumer rank is this rank" in messages[5]
    assert "producer rank 3 is not in the pool's process group (ranks [0])" in messages[6]


# ---------------------------------------------------------------- plans with several producers/consumers

# (sample_id, producer, consumer, tokens); every rank derives its own part, as the runtime's step plan does.
PLANS = {
    "2p_to_1c": (3, [(s, s % 2, 2, 3 + 5 * s % 11) for s in range(10)]),
    "1p_to_2c": (3, [(s, 0, 1 + (s * 7) % 2, 2 + 3 * s % 13) for s in range(10)]),
    "2p_to_2c": (4, [(s, s % 2, 2 + (s // 3) % 2, 1 + 7 * s % 9) for s in range(12)]),
    # on a group that leaves rank 1 out (global ranks in the API): rank 2 feeds rank 0
    "subgroup_0_2": (3, [(s, 2, 0, 1 + s) for s in range(6)]),
}


def _consumption_order(items: list[tuple]) -> list[tuple]:
    """Interleave producers and take some items ahead of their send order (swap neighbours)."""
    order = list(items)
    for i in range(0, len(order) - 1, 3):
        order[i], order[i + 1] = order[i + 1], order[i]
    return order


def _run_plan(rank: int, world: int, plan_name: str) -> dict:
    _, plan = PLANS[plan_name]
    step = 1
    group = dist.new_group([0, 2]) if plan_name.startswith("subgroup") else None  # every rank must call it
    if group is not None and rank == 1:
        return {"puts": 0, "gets": 0, "inflight": 0, "buffered": 0}
    pool = EmbeddingPool(rank=rank, group=group, capacity_bytes=1 << 20, timeout_s=20.0, device=CPU)
    mine_out = [p for p in plan if p[1] == rank]
    mine_in = [p for p in plan if p[2] == rank]
    for producer in sorted({p[1] for p in mine_in}):
        pool.expect(producer=producer, items=[(s, step) for s, pr, _, _ in mine_in if pr == producer])
    for sid, _, consumer, tokens in mine_out:
        pool.put(_embedding(sid, step, tokens), sample_id=sid, step=step, consumer=consumer)
    for sid, producer, _, tokens in _consumption_order(mine_in):
        emb = pool.get(sample_id=sid, step=step, producer=producer, expected_shape=(tokens, HIDDEN))
        assert torch.equal(emb, _embedding(sid, step, tokens)), f"sample {sid} from rank {producer} differs"
        pool.return_grad(_grad_of(emb, sid), sample_id=sid, step=step, producer=producer)
    for sid, _, consumer, tokens in mine_out:
        grad = pool.wait_grad(sample_id=sid, step=step, consumer=consumer)
        assert torch.equal(grad, _grad_of(_embedding(sid, step, tokens), sid)), f"gradient of sample {sid} differs"
    pool.flush()
    dist.barrier(group=group)
    _wait_all_credited(pool)
    stats = pool.stats()
    pool.close()
    return {"puts": stats.puts, "gets": stats.gets, "inflight": stats.inflight_items,
            "buffered": stats.buffered_items}


@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_plans_with_several_producers_and_consumers(plan_name: str):
    world, plan = PLANS[plan_name]
    results = run_ranks(_run_plan, world, plan_name, timeout_s=40)
    for rank, r in enumerate(results):
        assert r["puts"] == sum(1 for p in plan if p[1] == rank)
        assert r["gets"] == sum(1 for p in plan if p[2] == rank)
        assert r["inflight"] == 0 and r["buffered"] == 0  # every credit came back, nothing left behind


def _back_to_back_pools(rank: int, world: int) -> int:
    """Several pools in a row on one group, the producer flushing while credits still come back."""
    done = 0
    for step in range(3):
        pool = _pool(rank, capacity_bytes=3 * 4 * HIDDEN * 4, timeout_s=5.0, return_grads=False)
        if rank == 0:
            for sid in range(8):
                pool.put(_embedding(sid, step, 4), sample_id=sid, step=step, consumer=1)
        else:
            pool.expect(producer=0, items=[(sid, step) for sid in range(8)])
            for sid in range(8):
                assert torch.equal(pool.get(sample_id=sid, step=step, producer=0), _embedding(sid, step, 4))
                done += 1
        pool.flush()
        _wait_all_credited(pool)
        dist.barrier()
        pool.close()
    return done


def test_back_to_back_pools_and_flush_racing_credits():
    """A receive posted beyond the plan would steal the next pool's first header; a send waited twice (by flush
    and by the credit thread) would never return. Both hang or mismatch here."""
    assert run_ranks(_back_to_back_pools, 2, timeout_s=40)[1] == 24


def _with_collectives(rank: int, world: int) -> list[float]:
    """Pool traffic on the world group while the same group runs all_reduce (as DDP does between steps)."""
    pool = _pool(rank)
    sums = []
    for step in range(4):
        if rank == 0:
            for sid in range(3):
                pool.put(_embedding(sid, step, 2 + sid), sample_id=sid, step=step, consumer=1)
        else:
            pool.expect(producer=0, items=[(sid, step) for sid in range(3)])
        total = torch.tensor([float(rank + step)])
        dist.all_reduce(total)  # while the pool's threads are receiving
        sums.append(total.item())
        if rank == 1:
            for sid in range(3):
                emb = pool.get(sample_id=sid, step=step, producer=0)
                assert torch.equal(emb, _embedding(sid, step, 2 + sid))
                pool.return_grad(_grad_of(emb, sid), sample_id=sid, step=step, producer=0)
        else:
            for sid in range(3):
                grad = pool.wait_grad(sample_id=sid, step=step, consumer=1)
                assert torch.equal(grad, _grad_of(_embedding(sid, step, 2 + sid), sid))
        pool.flush()
    pool.close()
    return sums


def test_pool_traffic_beside_collectives_on_the_same_group():
    assert run_ranks(_with_collectives, 2, timeout_s=40) == [[1.0, 3.0, 5.0, 7.0]] * 2


# ---------------------------------------------------------------- coalescing: items queued behind a send leave together

COALESCED = [(sid, step, (3 + (5 * sid) % 7, HIDDEN), dtype)  # odd byte sizes: offsets in a batch must be aligned
             for step in (0, 1) for sid, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16] * 3)]


def _coalesced(rank: int, world: int) -> dict:
    pool = _pool(rank)
    if rank == 0:
        for sid, step, shape, dtype in COALESCED:  # both steps before the consumer expects anything
            pool.put(_embedding(sid, step, shape[0], dtype), sample_id=sid, step=step, consumer=1)
        _signal([1])
        for sid, step, shape, dtype in COALESCED:
            grad = pool.wait_grad(sample_id=sid, step=step, consumer=1)
            assert torch.equal(grad, _grad_of(_embedding(sid, step, shape[0], dtype), sid)), (sid, step)
    else:
        _await_signal(0)
        for step in (0, 1):  # step 1's plan is learnt only after step 0: its first items may already be here
            items = [(sid, t) for sid, t, _, _ in COALESCED if t == step]
            pool.expect(producer=0, items=items)
            for sid, t, shape, dtype in reversed([c for c in COALESCED if c[1] == step]):
                emb = pool.get(sample_id=sid, step=t, producer=0, expected_shape=shape)
                assert emb.dtype == dtype and torch.equal(emb, _embedding(sid, t, shape[0], dtype)), (sid, t)
                pool.return_grad(_grad_of(emb, sid), sample_id=sid, step=t, producer=0)
    return _settle_and_close(pool)


def test_items_queued_behind_a_send_are_coalesced_exactly():
    producer, consumer = run_ranks(_coalesced, 2, timeout_s=60)
    n = len(COALESCED)
    # A send completes only once the consumer has posted its receive, which it does after the signal, i.e. after
    # every put: the first two messages (the window) may leave with one item each, everything else queues behind
    # them and leaves in full batches.
    assert producer["puts"] == n and producer["embedding_messages"] <= 2 + -(-(n - 2) // MAX_BATCH)
    assert consumer["gets"] == n and consumer["grads_sent"] == n and producer["grads_received"] == n
    assert producer["inflight_items"] == 0 and consumer["buffered_items"] == 0


# (sample_id, tokens, dtype): mixed dtypes and odd byte counts (aligned offsets inside one payload buffer), an empty
# item (no bytes in the buffer) and one over SPLIT_BATCH_BYTES (it must travel alone).
SPLIT_ITEMS = [(0, 3, torch.float32), (1, 9, torch.bfloat16), (2, 1, torch.float16), (3, 0, torch.float32),
               (4, 5, torch.float64), (5, 2, torch.int64), (6, 7, torch.float32), (7, 11, torch.bfloat16),
               (8, 19, torch.float32), (9, 33, torch.uint8), (10, 13, torch.float16), (11, 6, torch.bool),
               (12, 4, torch.int32), (13, 1, torch.float64)]
SPLIT_CAPACITY = 800  # bytes: the producer blocks at sample 6 (96 + 144 + 16 + 0 + 320 + 128 + 224 > 800)
SPLIT_BATCH_BYTES = 512  # payload bytes per message: samples 2-5 (464 B) fit one message, sample 8 (608 B) not


def _coalesced_split(rank: int, world: int) -> dict:
    pool = _pool(rank, capacity_bytes=SPLIT_CAPACITY, max_batch_bytes=SPLIT_BATCH_BYTES)
    if rank == 0:
        go = _signal_once_a_put_blocks(pool, [1])
        for sid, tokens, dtype in SPLIT_ITEMS:
            pool.put(_embedding(sid, 0, tokens, dtype), sample_id=sid, step=0, consumer=1)
        go.join()
        for sid, tokens, dtype in SPLIT_ITEMS:
            grad = pool.wait_grad(sample_id=sid, step=0, consumer=1)
            want = _grad_of(_embedding(sid, 0, tokens, dtype), sid)
            assert grad.dtype == want.dtype and grad.shape == want.shape and torch.equal(grad, want), sid
    else:
        _await_signal(0)  # nothing is received before the producer is blocked: the queued items share a message
        pool.expect(producer=0, items=[(sid, 0) for sid, _, _ in SPLIT_ITEMS])
        got = {}
        for sid, tokens, dtype in SPLIT_ITEMS:
            emb = pool.get(sample_id=sid, step=0, producer=0, expected_shape=(tokens, HIDDEN))
            want = _embedding(sid, 0, tokens, dtype)
            assert emb.dtype == dtype and torch.equal(emb, want), sid
            got[sid] = emb
        for sid, emb in got.items():  # items of one batch are views of one buffer: writing one leaves the rest
            emb.zero_()
            for other, _, dtype in SPLIT_ITEMS[sid + 1:]:
                assert torch.equal(got[other], _embedding(other, 0, got[other].shape[0], dtype)), (sid, other)
        for sid, tokens, dtype in reversed(SPLIT_ITEMS):  # gradients leave in another order, batched as they queue
            pool.return_grad(_grad_of(_embedding(sid, 0, tokens, dtype), sid), sample_id=sid, step=0, producer=0)
    return _settle_and_close(pool)


def test_a_coalesced_batch_split_by_capacity_round_trips_exactly():
    producer, consumer = run_ranks(_coalesced_split, 2, timeout_s=60)
    n = len(SPLIT_ITEMS)
    assert producer["put_blocks"] >= 1, "the capacity never split the stream"
    # Samples 0 and 1 leave alone (the window of two messages), samples 2-5 queue behind them and leave in one
    # message; whatever follows depends on when credits come back.
    assert producer["embedding_messages"] <= n - 3, producer["embedding_messages"]
    assert producer["inflight_peak_bytes"] <= SPLIT_CAPACITY
    assert producer["puts"] == consumer["gets"] == n and producer["grads_received"] == consumer["grads_sent"] == n
    assert consumer["bytes_received"] == producer["bytes_sent"] == sum(
        tokens * HIDDEN * torch.empty((), dtype=dtype).element_size() for _, tokens, dtype in SPLIT_ITEMS)


# ---------------------------------------------------------------- put_many (one message per encoder forward)

MANY_CAPACITY = 2048  # bytes: group D below splits into 3 messages, its 80-token item (2560 B) is oversize


def _many_groups() -> list[tuple[int, str, list[tuple[int, int, torch.dtype]]]]:
    """(step, kind, items (sample_id, tokens, dtype)) of each put_many call: "views": adjacent views of one encoder
    output (sent uncopied), "strided": non-contiguous tensors of one dtype (one staging copy), "mixed": mixed dtypes
    (aligned offsets)."""
    return [(0, "views", [(0, 3, torch.float32), (1, 9, torch.float32), (2, 0, torch.float32), (3, 5, torch.float32)]),
            (0, "strided", [(4, 4, torch.float32), (5, 6, torch.float32)]),
            (0, "mixed", [(6, 9, torch.bfloat16), (7, 2, torch.float16), (8, 5, torch.int64), (9, 6, torch.bool)]),
            (1, "views", [(0, 20, torch.float32), (1, 20, torch.float32), (2, 20, torch.float32),
                          (3, 80, torch.float32), (4, 10, torch.float32)])]


def _many_leaf(step: int, sid: int, tokens: int) -> torch.Tensor:
    """The encoder's input of one group item, a leaf whose gradient the producer checks."""
    return _embedding(sid, step, tokens).requires_grad_(True)


def _put_many_round_trip(rank: int, world: int) -> dict:
    """The consumer knows each item's shape and dtype (expect with specs), as a step plan gives them."""
    pool = _pool(rank, capacity_bytes=MANY_CAPACITY)
    out: dict = {}
    if rank == 0:
        graphs = []
        for step, kind, items in _many_groups():
            if kind == "views":  # one "forward" over the group: a contiguous output, split per image
                leaves = [_many_leaf(step, sid, tokens) for sid, tokens, _ in items]
                output = torch.cat(leaves) * 3.0
                tensors = list(output.split([tokens for _, tokens, _ in items]))
                graphs.append((step, items, leaves, tensors))
                sent = [t.detach() for t in tensors]
            elif kind == "strided":
                sent = [_embedding(sid, step, tokens).t().contiguous().t() for sid, tokens, _ in items]
                assert not any(t.is_contiguous() for t in sent)
            else:
                sent = [_embedding(sid, step, tokens, dtype) for sid, tokens, dtype in items]
            hs = pool.put_many(sent, sample_ids=[sid for sid, _, _ in items], step=step, consumer=1)
            assert [(h.sample_id, h.step, h.shape, h.dtype) for h in hs] == [
                (sid, step, (tokens, HIDDEN), dtype) for sid, tokens, dtype in items]
        grads = {}
        for step, kind, items in _many_groups():
            for sid, tokens, dtype in items:
                grad = pool.wait_grad(sample_id=sid, step=step, consumer=1)
                want = _grad_of(_embedding(sid, step, tokens, dtype), sid)
                assert grad.dtype == want.dtype and torch.equal(grad, want), (step, sid)
                grads[(step, sid)] = grad
        for step, items, leaves, tensors in graphs:  # the returned gradients go back through the producer's graph
            torch.autograd.backward(tensors, [grads[(step, sid)] for sid, _, _ in items])
            for (sid, _, _), leaf in zip(items, leaves):
                assert torch.equal(leaf.grad, grads[(step, sid)] * 3.0), (step, sid)
    else:
        for step in (0, 1):
            items = [(sid, tokens, dtype) for st, _, group in _many_groups() if st == step
                     for sid, tokens, dtype in group]
            pool.expect(producer=0, items=[(sid, step) for sid, _, _ in items],
                        specs=[((tokens, HIDDEN), dtype) for _, tokens, dtype in items])
            got = {}
            # step 0 out of send order (views of landed batches); step 1 in order: its capacity split means a
            # later batch leaves only once earlier items are taken
            for sid, tokens, dtype in (reversed(items) if step == 0 else items):
                emb = pool.get(sample_id=sid, step=step, producer=0, expected_shape=(tokens, HIDDEN))
                want = _embedding(sid, step, tokens, dtype) * (3.0 if step == 1 or sid < 4 else 1.0)
                assert emb.dtype == dtype and torch.equal(emb, want.to(dtype)), (step, sid)
                got[sid] = (emb, want)
                pool.return_grad(_grad_of(_embedding(sid, step, tokens, dtype), sid), sample_id=sid, step=step,
                                 producer=0)
            for sid, (emb, _) in sorted(got.items()):  # items of one batch share its buffer: writing one leaves
                emb.zero_()                            # the others
                for other, (o_emb, o_want) in got.items():
                    if other > sid:
                        assert torch.equal(o_emb, o_want.to(o_emb.dtype)), (step, sid, other)
    pool.flush()
    dist.barrier()
    _wait_all_credited(pool)
    out.update(asdict(pool.stats()))
    pool.close()
    return out


def test_put_many_round_trips_exactly_views_copies_mixed_dtypes_and_a_capacity_split():
    producer, consumer = run_ranks(_put_many_round_trip, 2, timeout_s=90)
    n = sum(len(items) for _, _, items in _many_groups())
    # one message per group of step 0; step 1's group splits at the capacity: [20, 20, 20] tokens, [80], [10]
    assert producer["embedding_messages"] == 3 + 3
    assert producer["puts"] == consumer["gets"] == n and producer["grads_received"] == consumer["grads_sent"] == n
    assert producer["oversize_puts"] == 1 and producer["inflight_peak_bytes"] <= max(MANY_CAPACITY, 80 * HIDDEN * 4)
    assert consumer["bytes_received"] == producer["bytes_sent"] == sum(
        tokens * HIDDEN * dtype.itemsize for _, _, items in _many_groups() for _, tokens, dtype in items)
    assert consumer["buffered_items"] == 0 and producer["inflight_items"] == 0


# What put_many sends (sample ids in order, shapes) against what the consumer planned (expect with specs), and the
# words the consumer's error must contain. Sample 0 always matches: it must not be handed out either, since its
# message carries a refused item.
MANY_MISMATCH = {
    "shape": ([0, 1], [(4, HIDDEN), (4, HIDDEN)], [0, 1], [(4, HIDDEN), (HIDDEN, 4)],
              ["sample 1 (step 0) from producer rank 0", "planned as [8, 4]", "sent [4, 8]"]),
    "order": ([1, 0], [(4, HIDDEN), (4, HIDDEN)], [0, 1], [(4, HIDDEN), (4, HIDDEN)],
              ["expected sample 0 (step 0) next from producer rank 0", "sent sample 1 (step 0)"]),
}


def _many_mismatch(rank: int, world: int, case: str) -> str:
    sent_ids, sent_shapes, planned_ids, planned_shapes, _ = MANY_MISMATCH[case]
    pool = _pool(rank, timeout_s=30.0, return_grads=False)
    message = ""
    if rank == 0:
        batch = torch.ones(sum(s[0] for s in sent_shapes), HIDDEN)
        views = [v.reshape(s) for v, s in zip(batch.split([s[0] for s in sent_shapes]), sent_shapes)]
        pool.put_many(views, sample_ids=sent_ids, step=0, consumer=1)
    else:
        pool.expect(producer=0, items=[(sid, 0) for sid in planned_ids],
                    specs=[(shape, torch.float32) for shape in planned_shapes])
        try:
            pool.get(sample_id=0, step=0, producer=0)
        except PoolProtocolError as exc:
            message = str(exc)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the refused message's payload and credits never move
        pool.close(wait=False)
    return message


@pytest.mark.parametrize("case", sorted(MANY_MISMATCH))
def test_a_put_many_batch_against_the_plan_is_refused_before_hand_out(case: str):
    message = run_ranks(_many_mismatch, 2, case, timeout_s=60)[1]
    assert message, "the consumer handed out an item of a batch that does not match its plan"
    for part in MANY_MISMATCH[case][-1]:
        assert part in message, f"{part!r} missing from: {message}"


def _bad_specs_and_calls(rank: int, world: int) -> list[str]:
    messages = []
    pool = _pool(rank)
    calls = ([lambda: pool.put_many([torch.ones(2, HIDDEN)] * 2, sample_ids=[0], step=0, consumer=1),
              lambda: pool.put_many([torch.ones(2, HIDDEN)] * 2, sample_ids=[3, 3], step=0, consumer=1),
              lambda: pool.put_many([torch.ones(2, HIDDEN, dtype=torch.complex64)], sample_ids=[4], step=0,
                                    consumer=1)]
             if rank == 0 else
             [lambda specs=specs: pool.expect(producer=0, items=[(0, 0), (1, 0)], specs=specs)
              for specs in ([((4, HIDDEN), torch.float32)],  # two items, one spec
                            [((4, HIDDEN), torch.complex64)] * 2,
                            [((4, -1), torch.float32)] * 2)])
    for call in calls:
        try:
            call()
            messages.append("accepted")
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    pool.close()
    dist.barrier()
    return messages


def test_bad_specs_and_put_many_calls_are_named():
    producer, consumer = run_ranks(_bad_specs_and_calls, 2, timeout_s=60)
    assert "2 tensors for 1 sample_ids" in producer[0]
    assert "name a sample twice" in producer[1] and "[3, 3]" in producer[1]
    assert "put_many of sample 4 (step 0)" in producer[2] and "complex64" in producer[2]
    assert "specs has 1 entries for 2 items" in consumer[0]
    assert "sample 0 (step 0)" in consumer[1] and "complex64" in consumer[1]
    assert "each >= 0" in consumer[2]


# ---------------------------------------------------------------- backpressure and the oversize rule

ITEM_TOKENS = [4, 6, 3, 5, 40, 4, 2, 6, 5, 3]  # 40 tokens = 1280 B > capacity: the oversize item
CAPACITY = 512  # bytes: about 3 ordinary items


def _backpressure(rank: int, world: int) -> dict:
    pool = _pool(rank, capacity_bytes=CAPACITY)
    items = [(sid, 1 + sid % 2, tokens) for sid, tokens in enumerate(ITEM_TOKENS)]
    over_capacity_seen = []
    if rank == 0:
        go = _signal_once_a_put_blocks(pool, [1, 2])
        for sid, consumer, tokens in items:
            h = pool.put(_embedding(sid, 0, tokens), sample_id=sid, step=0, consumer=consumer)
            inflight = pool.inflight_handles()
            if sum(x.nbytes for x in inflight) > CAPACITY:
                over_capacity_seen.append([x.sample_id for x in inflight])
            if h.nbytes > CAPACITY:  # it waited for an empty pipe, and nothing may join it
                assert [x.sample_id for x in inflight] in ([sid], []), inflight
        go.join()
    else:
        pool.expect(producer=0, items=[(sid, 0) for sid, c, _ in items if c == rank])
        _await_signal(0)  # a slow backbone: nothing is taken before the producer has hit the capacity
        for sid, consumer, tokens in items:
            if consumer == rank:
                assert torch.equal(pool.get(sample_id=sid, step=0, producer=0), _embedding(sid, 0, tokens))
    pool.flush()
    dist.barrier()
    _wait_all_credited(pool)
    stats = asdict(pool.stats())
    pool.close()
    return {**stats, "over_capacity_seen": over_capacity_seen}


def test_backpressure_bounds_inflight_bytes_and_lets_one_oversize_item_through():
    producer, c1, c2 = run_ranks(_backpressure, 3, timeout_s=40)
    oversize = 40 * HIDDEN * 4
    assert producer["put_blocks"] >= 1, "the producer never blocked on a full pool"
    assert producer["oversize_puts"] == 1
    assert producer["inflight_peak_bytes"] <= oversize
    assert producer["occupancy_peak_bytes"] == producer["inflight_peak_bytes"]  # a pure producer holds nothing else
    # Over capacity only ever because of the oversize item, alone.
    assert all(ids == [4] for ids in producer["over_capacity_seen"]), producer["over_capacity_seen"]
    assert producer["inflight_items"] == 0
    for consumer in (c1, c2):
        assert consumer["device_peak_bytes"] <= CAPACITY
    assert c1["host_tier_items"] == 1 and c1["host_to_device_bytes"] == oversize  # sample 4 went to rank 1's host


def _host_tier(rank: int, world: int) -> dict:
    pool = _pool(rank, host_tier_bytes=200)
    sizes = [2, 10, 3, 20]  # 64, 320, 96, 640 bytes: two above host_tier_bytes
    if rank == 0:
        for sid, tokens in enumerate(sizes):
            pool.put(_embedding(sid, 0, tokens), sample_id=sid, step=0, consumer=1)
    else:
        pool.expect(producer=0, items=[(sid, 0) for sid in range(len(sizes))])
        while len(pool.buffered_handles()) < len(sizes) or pool.stats().bytes_received < 1120:
            time.sleep(0.01)  # all four land without a get (run_ranks' timeout catches a hang)
        tiers = {h.sample_id: h.tier for h in pool.buffered_handles()}
        assert tiers == {0: "device", 1: "host", 2: "device", 3: "host"}, tiers
        for sid, tokens in enumerate(sizes):
            assert torch.equal(pool.get(sample_id=sid, step=0, producer=0), _embedding(sid, 0, tokens))
    pool.flush()
    dist.barrier()
    return asdict(pool.stats())


def test_host_tier_takes_large_items_and_counts_them():
    _, consumer = run_ranks(_host_tier, 2, timeout_s=30)
    assert consumer["host_tier_items"] == 2 and consumer["host_to_device_bytes"] == 320 + 640
    assert consumer["host_peak_bytes"] == 960 and consumer["device_peak_bytes"] == 160
    assert consumer["host_bytes"] == 0 and consumer["device_bytes"] == 0
    assert consumer["occupancy_peak_bytes"] == 1120 and consumer["occupancy_bytes"] == 0  # all four were buffered


# ---------------------------------------------------------------- frozen encoder: run-ahead bounded by capacity

STEPS, PER_STEP, TOKENS = 3, 3, 4
ITEM_BYTES = TOKENS * HIDDEN * 4


def _frozen(rank: int, world: int) -> dict:
    pool = _pool(rank, capacity_bytes=2 * ITEM_BYTES, return_grads=False)
    ran_ahead = 0
    max_inflight = 0
    if rank == 0:
        for step in range(STEPS):
            for sid in range(PER_STEP):
                pool.put(_embedding(sid, step, TOKENS), sample_id=sid, step=step, consumer=1)
                inflight = pool.inflight_handles()
                # An earlier step still being consumed. The consumer may already have taken everything sent (empty:
                # no run-ahead); at each step's first put it cannot have, it waits for the signal sent below.
                ran_ahead += int(bool(inflight) and min(h.step for h in inflight) < step)
                max_inflight = max(max_inflight, len(inflight))
                if step > 0 and sid == 0:
                    _signal([1])  # the consumer takes the last item of the previous step only after this put
            if step == 0:
                pool.reset_step_stats()
        try:
            pool.wait_grad(sample_id=0, step=0, consumer=1)
            raise AssertionError("wait_grad worked without a gradient channel")
        except PoolError as exc:
            assert "return_grads=False" in str(exc)
    else:
        for step in range(STEPS):  # the consumer learns each step's plan only when it starts the step
            pool.expect(producer=0, items=[(sid, step) for sid in range(PER_STEP)])
            for sid in range(PER_STEP):
                if step < STEPS - 1 and sid == PER_STEP - 1:
                    _await_signal(0)
                assert torch.equal(pool.get(sample_id=sid, step=step, producer=0), _embedding(sid, step, TOKENS))
    pool.flush()
    dist.barrier()
    stats = pool.stats()
    return {"ran_ahead": ran_ahead, "max_inflight": max_inflight, "puts": stats.puts,
            "peak": stats.inflight_peak_bytes}


def test_frozen_encoder_runs_ahead_bounded_by_capacity():
    producer, _ = run_ranks(_frozen, 2, timeout_s=40)
    assert producer["ran_ahead"] >= 2, "the producer never put a later step while an earlier one was in flight"
    assert producer["max_inflight"] <= 2 and producer["peak"] <= 2 * ITEM_BYTES  # bounded by credits, not steps
    assert producer["puts"] == (STEPS - 1) * PER_STEP  # reset_step_stats() after step 0


# ---------------------------------------------------------------- failures: timeouts, plan mismatch, dead peer

def _timeouts(rank: int, world: int) -> dict:
    pool = _pool(rank, capacity_bytes=ITEM_BYTES, timeout_s=1.0)
    result: dict = {}
    start = time.monotonic()
    try:
        if rank == 0:  # rank 1 never takes anything: the second put must give up
            pool.put(_embedding(0, 2, TOKENS), sample_id=0, step=2, consumer=1)
            pool.put(_embedding(17, 2, TOKENS), sample_id=17, step=2, consumer=1)
        elif rank == 2:  # rank 0 never sends sample 99 to rank 2
            pool.get(sample_id=99, step=3, producer=0)
    except PoolTimeout as exc:
        result = {"message": str(exc), "elapsed": time.monotonic() - start}
    dist.barrier()
    return result


def test_blocking_calls_time_out_naming_the_peer_and_the_item():
    put, _, get = run_ranks(_timeouts, 3, timeout_s=30)
    assert put["elapsed"] >= 1.0 and get["elapsed"] >= 1.0  # never gives up before timeout_s (no upper bound)
    assert "rank 0 waited 1.0 s to put sample 17 (step 2)" in put["message"] and "consumer rank 1" in put["message"]
    assert "rank 2 waited 1.0 s for the embedding of sample 99 (step 3) from producer rank 0" in get["message"]


def _plan_mismatch(rank: int, world: int) -> str:
    pool = _pool(rank, timeout_s=10.0)
    message = ""
    if rank == 0:
        for sid in (1, 0):  # this rank's plan differs from the consumer's
            pool.put(_embedding(sid, 0, TOKENS), sample_id=sid, step=0, consumer=1)
    else:
        pool.expect(producer=0, items=[(0, 0), (1, 0)])
        try:
            pool.get(sample_id=0, step=0, producer=0)
        except PoolProtocolError as exc:
            message = str(exc)
    dist.barrier()
    return message


def test_plan_mismatch_is_reported():
    _, message = run_ranks(_plan_mismatch, 2, timeout_s=30)
    assert "expected sample 0 (step 0) next from producer rank 0" in message and "sent sample 1" in message


def _die_when_idle(pool: EmbeddingPool) -> None:
    """SIGKILL this rank once its pool has nothing in flight (so the peer sees a death, not a protocol error)."""
    pool.flush()
    _wait_all_credited(pool)
    os.kill(os.getpid(), signal.SIGKILL)


def _dead_peer(rank: int, world: int, dead: str) -> None:
    pool = _pool(rank, timeout_s=3600.0)  # only the transport, never the clock, can end the wait below
    if rank == 0:
        pool.put(_embedding(0, 0, TOKENS), sample_id=0, step=0, consumer=1)
        if dead == "producer":
            _die_when_idle(pool)
        what, call = "gradient of sample 0 (step 0)", lambda: pool.wait_grad(sample_id=0, step=0, consumer=1)
    else:
        pool.expect(producer=0, items=[(0, 0), (1, 0)])
        assert torch.equal(pool.get(sample_id=0, step=0, producer=0), _embedding(0, 0, TOKENS))
        if dead == "consumer":
            _die_when_idle(pool)
        what, call = "embedding of sample 1 (step 0)", lambda: pool.get(sample_id=1, step=0, producer=0)
    try:
        call()
    except PoolPeerError as exc:
        peer = 1 - rank
        assert what in str(exc) and f"from rank {peer}" in str(exc), str(exc)
        return
    raise AssertionError(f"waiting for the {what} from a dead peer returned")


@pytest.mark.parametrize("dead", ["producer", "consumer"])
def test_dead_peer_is_reported_fast(dead: str):
    with pytest.raises(RankFailure) as info:
        run_ranks(_dead_peer, 2, dead, timeout_s=30)
    text = str(info.value)
    dead_rank = 0 if dead == "producer" else 1
    assert "1 of 2 ranks failed" in text and f"rank {dead_rank} exited with code -9" in text, text


# ---------------------------------------------------------------- device groups (HCCL under emulation)

def _pool_on_emulated_hccl(rank: int, world: int) -> dict:
    """Topology's pool groups on an 'hccl' job: headers and credits on gloo, payloads on two HCCL groups."""
    from mindspeed_flow import emulation
    from mindspeed_flow.config.schema import ParallelConfig, PartParallelConfig
    from mindspeed_flow.topology import Topology
    from mindspeed_flow.step.layout import Layout

    emulation.activate()  # fake NPU: npu tensors live in host memory, 'hccl' groups run on gloo underneath
    layout = Layout.from_config(ParallelConfig(encoder=PartParallelConfig(dp=1), backbone=PartParallelConfig(dp=1)),
                                "decoupled")
    topo = Topology.build(layout, backend="hccl")
    emb_group, grad_group = topo.pool_data_groups
    # HCCL plumbing: each payload group has a communicator name, distinct from the other's
    names = [g._get_backend(torch.device("npu")).get_hccl_comm_name(rank) for g in (emb_group, grad_group)]
    pool = EmbeddingPool(rank=rank, group=topo.pool_group, data_groups=topo.pool_data_groups, device=torch.device(
        "npu", 0), capacity_bytes=1 << 20, timeout_s=60.0)
    shapes = [(5, HIDDEN), (0, HIDDEN), (33, HIDDEN)]
    if rank == 0:
        # one batch: its dense payload (one staging copy) rides the embedding HCCL group
        pool.put_many([_embedding(sid, 0, shape[0]) for sid, shape in enumerate(shapes)],
                      sample_ids=range(len(shapes)), step=0, consumer=1)
        for sid, shape in enumerate(shapes):
            grad = pool.wait_grad(sample_id=sid, step=0, consumer=1)
            assert torch.equal(grad.cpu(), _grad_of(_embedding(sid, 0, shape[0]), sid))  # device result, host check
        routed = pool._outboxes[(1, CHANNEL_EMBEDDING)].payload_group is emb_group
        routed &= pool._grad_streams[1].payload_group is grad_group
    else:
        pool.expect(producer=0, items=[(sid, 0) for sid in range(len(shapes))],
                    specs=[(shape, torch.float32) for shape in shapes])
        for sid, shape in enumerate(shapes):
            emb = pool.get(sample_id=sid, step=0, producer=0, expected_shape=shape)
            assert torch.equal(emb.cpu(), _embedding(sid, 0, shape[0]))
            pool.return_grad(_grad_of(emb, sid), sample_id=sid, step=0, producer=0)
        routed = pool._embedding_streams[0].payload_group is emb_group
        routed &= pool._outboxes[(0, CHANNEL_GRAD)].payload_group is grad_group
    pool.flush()
    dist.barrier(group=topo.pool_group)
    stats = pool.stats()
    pool.close()
    return {"names": names, "control": str(dist.get_backend(topo.pool_group)), "gets": stats.gets,
            "grads": stats.grads_received, "routed": routed}


def test_pool_payloads_ride_the_topology_hccl_groups_under_emulation():
    producer, consumer = run_ranks(_pool_on_emulated_hccl, 2, timeout_s=120)
    assert producer["control"] == "gloo" and producer["routed"] and consumer["routed"]
    assert len(set(producer["names"])) == 2 and all(n.startswith("fakehccl_") for n in producer["names"])
    assert consumer["gets"] == 3 and producer["grads"] == 3


# ------------------------------------------------------------------------------------------------ receive ahead
def _transfer_rank(rank: int, world: int, receive_ahead: bool) -> dict[str, float]:
    """Rank 0 puts 6 embeddings for rank 1. With receive_ahead, rank 1 lets them all land before its first get
    (as if it were computing earlier microbatches): no transfer time is exposed. Without it, nothing is received
    before get() asks, so the transfers happen while a get() is blocked: exposed."""
    n = 6
    pool = EmbeddingPool(rank=rank, group=None, capacity_bytes=1 << 24, timeout_s=60, device=CPU,
                         return_grads=False, receive_ahead=receive_ahead)
    out: dict[str, float] = {}
    if rank == 0:
        for sid in range(n):
            pool.put(_embedding(sid, 0, 64), sample_id=sid, step=0, consumer=1)
        _signal([1])
        pool.flush()
    else:
        pool.expect(producer=0, items=[(sid, 0) for sid in range(n)])
        _await_signal(0)  # every put was issued
        if receive_ahead:
            while pool.stats().bytes_received < n * 64 * HIDDEN * 4:
                time.sleep(0.005)
        out["received_before_get"] = float(pool.stats().bytes_received)
        for sid in range(n):
            assert torch.equal(pool.get(sample_id=sid, step=0, producer=0), _embedding(sid, 0, 64))
        s = pool.stats()
        out.update(transfer_s=s.transfer_s, exposed_s=s.transfer_exposed_s)
    pool.close()
    return out


@pytest.mark.parametrize("receive_ahead", [True, False])
def test_receiving_ahead_hides_the_transfer_and_on_demand_exposes_it(receive_ahead: bool) -> None:
    r = run_ranks(_transfer_rank, 2, receive_ahead, timeout_s=120)[1]
    assert r["transfer_s"] > 0
    if receive_ahead:
        assert r["received_before_get"] == 6 * 64 * HIDDEN * 4 and r["exposed_s"] == 0.0
    else:
        # nothing moved before get() asked; the first message's transfer happened while get() was blocked (later
        # payloads of the same message may land between two gets: those count as hidden)
        assert r["received_before_get"] == 0 and 0 < r["exposed_s"] <= r["transfer_s"]


# Payload sizes around the staged-receive rules of gloo channels (wire.staged_bytes: the previous payload of the
# channel rounded up to a power of two, 4-32 MiB): tokens x HIDDEN fp32.
STAGED_CASES = [  # (put kind, [(sample_id, tokens)])
    ("put", [(0, 100)]),                          # 3.2 KB: copied out of the 4 MiB staging buffer into its own
    ("put", [(1, 40_000)]),                       # 1.28 MB: viewed in place in the staging buffer
    ("put", [(2, 0)]),                            # no payload: the staged message is empty
    ("put", [(3, 200_000)]),                      # 6.4 MB: over the 4 MiB staged size, on the payload tag
    ("many", [(4, 40_000), (5, 40_000), (6, 40_000)]),  # one 3.84 MB message, in place in an 8 MiB staging buffer
    ("many", [(7, 10), (8, 20)]),                 # one small message, copied out
    ("put", [(9, 200_000)]),                      # 6.4 MB over 4 MiB again: payload tag
    ("put", [(11, 200_000)]),                     # 6.4 MB after 6.4 MB: staged in 8 MiB, in place
    ("put", [(10, 50)]),                          # small after large: copied out of the 8 MiB staging buffer
]


def _staged_round_trip(rank: int, world: int) -> dict:
    # The capacity lets one 6.4 MB item through at a time: items behind it need the credits get_many holds back.
    pool = _pool(rank, capacity_bytes=8 << 20)
    if rank == 0:
        for kind, items in STAGED_CASES:
            tensors = [_embedding(sid, 0, tokens) for sid, tokens in items]
            if kind == "put":
                pool.put(tensors[0], sample_id=items[0][0], step=0, consumer=1)
            else:
                pool.put_many(tensors, sample_ids=[sid for sid, _ in items], step=0, consumer=1)
        for _, items in STAGED_CASES:
            for sid, tokens in items:
                grad = pool.wait_grad(sample_id=sid, step=0, consumer=1)
                assert torch.equal(grad, _grad_of(_embedding(sid, 0, tokens), sid)), sid
    else:
        keys = [(sid, 0, 0) for _, items in STAGED_CASES for sid, _ in items]
        got = pool.get_many(keys)
        for (sid, _, _), emb in zip(keys, got):
            tokens = dict(t for _, items in STAGED_CASES for t in items)[sid]
            assert emb.shape == (tokens, HIDDEN) and torch.equal(emb, _embedding(sid, 0, tokens)), sid
            pool.return_grad(_grad_of(emb, sid), sample_id=sid, step=0, producer=0)
    return _settle_and_close(pool)


def test_staged_payloads_and_get_many_round_trip_at_every_size_class():
    """Every size class of the staged gloo path (copied out, viewed in place, empty, over the staged size) carries
    exact bytes both ways (embeddings and gradients), and get_many's held-back credits never starve the producer."""
    producer, consumer = run_ranks(_staged_round_trip, 2, timeout_s=90)
    n = sum(len(items) for _, items in STAGED_CASES)
    assert consumer["gets"] == n and producer["inflight_items"] == 0
