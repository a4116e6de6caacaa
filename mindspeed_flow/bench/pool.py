"""`mindspeed-flow bench pool`: embedding-pool throughput against raw isend/irecv, side by side.

Two local gloo ranks (forked, as in the tests): rank 0 produces `--items` embeddings of `--tokens` x `--hidden`
fp32 per size, rank 1 consumes them. Four ways to move the same bytes, each timed from the producer starting to
send (after a barrier) to the consumer holding the last item, on the host's monotonic clock that both ranks share
(the pool's planned mode, `pool/planned.py`, is measured on the flow job itself: docs/measurements.md):

- "pool": the runtime's way: the step's items are per-image views of one contiguous [items x tokens, hidden]
  tensor, as an encoder's batched forward yields them, and the producer sends them with `put_many` (one header
  for up to `--max-batch-items` items and one payload transfer of their region, no copy); the consumer expects
  them without specs (header path: a message's payload receive is posted once its header lands) and gets them
  one by one, credits going back;
- "hdr": the same pool item by item (`put` per item, the general header path): items queued behind a send
  share one header and one payload transfer (copied into one buffer);
- "raw": what a skilled user writes by hand with the same sizes agreed in advance: one isend/irecv per item,
  all posted at once on the same process group, the receives posted before the barrier into buffers allocated
  then (no header, no credit, no thread, no allocation on the clock). The goal of the pool is stated against it;
- "raw1": one isend/irecv of the whole contiguous tensor, receive posted before the barrier (the floor of any
  per-item scheme: one transfer per step).

The pools live for the whole bench, as in training (one pool per run): an untimed warm-up step per size starts
their threads, then every repeat runs all variants back to back in a rotating order, so a burst of load on the
shared machine hits each variant alike. Reported: GB/s from the median seconds per variant, and the ratios as the
median of the per-repeat ratios (each repeat's pool time against the raw time of the same repeat). (Timing on the
consumer's clock alone, from its own barrier exit, as this bench once did, misses whatever arrived while the
consumer was still leaving the barrier, which on a loaded machine flattered whichever variant received ahead.)
The capacity defaults to the job's `flow.pool_capacity_mb`.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from mindspeed_flow.config.schema import FlowConfig
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.pool.wire import MAX_BATCH
from mindspeed_flow.utils.multiproc import run_ranks

VARIANTS = ("pool", "hdr", "raw", "raw1")
_RAW_TAG = 7


# A run's (start, end) on this rank, in time.perf_counter() seconds: the two ranks share this host's monotonic clock,
# so a run is timed from the producer starting to send to the consumer holding the last item (the barrier releases
# the ranks up to a scheduler slice apart on a loaded machine; neither rank's own clock alone would be fair).
Span = tuple[float, float]


def _pool_step(pool: EmbeddingPool, rank: int, items: list[torch.Tensor], step: int, many: bool) -> Span:
    """One step through `pool`: the consumer expects the step's items before the barrier; `many`: the producer
    sends them with one `put_many`, else one `put` per item."""
    if rank == 1:
        pool.expect(producer=0, items=[(i, step) for i in range(len(items))])
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        if many:
            pool.put_many(items, sample_ids=range(len(items)), step=step, consumer=1)
        else:
            for i, tensor in enumerate(items):
                pool.put(tensor, sample_id=i, step=step, consumer=1)
    elif many:  # the runtime's consumer: a microbatch's embeddings with one get_many
        pool.get_many([(i, step, 0) for i in range(len(items))])
    else:
        for i in range(len(items)):
            pool.get(sample_id=i, step=step, producer=0)
    end = time.perf_counter()
    pool.flush()  # credits and sends settle off the clock, so the next variant starts on a quiet link
    dist.barrier()
    return start, end


def _raw_step(rank: int, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> Span:
    """Every isend/irecv of the step posted at once, the receives posted into buffers allocated before the
    barrier, as the pool's consumer posts its receives at expect()."""
    works: list[dist.Work] = []
    if rank == 1:
        works = [dist.irecv(torch.empty_like(t), 0, group=group, tag=_RAW_TAG) for t in tensors]
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        works = [dist.isend(t, 1, group=group, tag=_RAW_TAG) for t in tensors]
    for w in works:
        w.wait()
    end = time.perf_counter()
    dist.barrier()
    return start, end


def _bench_rank(rank: int, world: int, sizes: list[int], n_items: int, hidden: int, repeats: int,
                capacity_bytes: int, max_batch_items: int) -> list[dict]:
    # The runtime's pool and raw share the world group (the same group, as the comparison requires); the other pools
    # get groups of their own, so no two pools' tags can meet.
    groups = {"pool": None, "hdr": dist.new_group(backend="gloo")}
    pools = {name: EmbeddingPool(rank=rank, group=group, capacity_bytes=capacity_bytes, timeout_s=120.0,
                                 device=torch.device("cpu"), return_grads=False, max_batch_items=max_batch_items)
             for name, group in groups.items()}
    steps = iter(range(1 << 30))  # a fresh step number per pool step: (sample, step) keys are never reused
    batch = torch.empty(0)
    items: list[torch.Tensor] = []
    run: dict[str, Callable[[], Span]] = {
        "pool": lambda: _pool_step(pools["pool"], rank, items, next(steps), many=True),
        "hdr": lambda: _pool_step(pools["hdr"], rank, items, next(steps), many=False),
        "raw": lambda: _raw_step(rank, items, group=None),
        "raw1": lambda: _raw_step(rank, [batch], group=None),
    }
    rows = []
    for tokens in sizes:
        # One encoder forward's output, split per image (views, no copies); every variant moves these bytes.
        batch = torch.randn(n_items * tokens, hidden)
        items = list(batch.split(tokens))
        nbytes = batch.numel() * batch.element_size()
        for name in VARIANTS:  # warm-up, untimed: threads started, allocator and sockets warm for this size
            run[name]()
        messages = {name: pools[name].stats().embedding_messages for name in pools}
        spans: dict[str, list[Span]] = {name: [] for name in VARIANTS}
        for r in range(repeats):
            for k in range(len(VARIANTS)):  # rotating order: no variant always runs first after the warm-up
                name = VARIANTS[(r + k) % len(VARIANTS)]
                spans[name].append(run[name]())
        row: dict = {"tokens": tokens, "item_bytes": nbytes // n_items, "bytes": nbytes, "spans": spans}
        for name in pools:  # messages per step, from the producer's counters
            row[f"{name}_messages"] = (pools[name].stats().embedding_messages - messages[name]) / repeats
        rows.append(row)
    for pool in pools.values():
        pool.close()
    return rows


def _paired_ratio(times: dict[str, list[float]], name: str, base: str) -> float:
    """Median over repeats of (base seconds / name seconds): above 1 means `name` was faster in that repeat."""
    return statistics.median(b / t for t, b in zip(times[name], times[base]))


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench pool", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,1024,4096", help="image tokens per item, comma-separated sizes")
    p.add_argument("--hidden", type=int, default=1024, help="embedding width (fp32)")
    p.add_argument("--items", type=int, default=16, help="items per step")
    p.add_argument("--repeats", type=int, default=25,
                   help="timed steps per variant and size (medians reported; fewer move by +-0.1 on a busy 2-core host)")
    p.add_argument("--capacity-mb", type=float, default=FlowConfig.pool_capacity_mb,
                   help="pool capacity in MiB (default: the job default, flow.pool_capacity_mb)")
    p.add_argument("--max-batch-items", type=int, default=MAX_BATCH,
                   help=f"items per header message of both pool columns (1..{MAX_BATCH})")
    args = p.parse_args(argv)
    for field, value, low in (("--items", args.items, 1), ("--repeats", args.repeats, 1),
                              ("--hidden", args.hidden, 1)):
        if value < low:
            p.error(f"{field} must be >= {low}, got {value}")
    if not 1 <= args.max_batch_items <= MAX_BATCH:
        p.error(f"--max-batch-items must be in 1..{MAX_BATCH}, got {args.max_batch_items}")
    if args.capacity_mb <= 0:
        p.error(f"--capacity-mb must be > 0, got {args.capacity_mb}")
    try:
        args.sizes = [int(s) for s in args.tokens.split(",") if s]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if not args.sizes or min(args.sizes) < 1:
        p.error(f"--tokens must name at least one size, each >= 1, got {args.tokens!r}")
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    capacity = int(args.capacity_mb * 2**20)
    producer_rows, rows = run_ranks(_bench_rank, 2, args.sizes, args.items, args.hidden, args.repeats, capacity,
                                    args.max_batch_items, timeout_s=1800)
    print(f"embedding pool vs raw isend/irecv: 2 gloo ranks on this host, fp32, hidden {args.hidden}, "
          f"{args.items} items per step, capacity {args.capacity_mb:g} MiB, pool: put_many (the runtime's way), hdr: put per item, up to "
          f"{args.max_batch_items} items per message; raw: isend/irecv per item, raw1: one per step; medians of "
          f"{args.repeats} interleaved repeats")
    print(f"{'tokens':>7} {'item MiB':>9} {'pool GB/s':>10} {'msgs':>5} {'hdr GB/s':>9} "
          f"{'msgs':>5} {'raw GB/s':>9} {'raw1 GB/s':>10} {'pool/raw':>9} {'hdr/raw':>8} "
          f"{'pool/raw1':>10}")
    for r, p in zip(rows, producer_rows):  # messages: the producer's counters
        # the producer's start to the consumer's end, on the clock both ranks share
        times = {k: [end - start for (start, _), (_, end) in zip(p["spans"][k], r["spans"][k])] for k in VARIANTS}
        gbs = {k: r["bytes"] / statistics.median(times[k]) / 1e9 for k in VARIANTS}
        print(f"{r['tokens']:>7} {r['item_bytes'] / 2**20:>9.3f} {gbs['pool']:>10.2f} {p['pool_messages']:>5.1f} "
              f"{gbs['hdr']:>9.2f} {p['hdr_messages']:>5.1f} {gbs['raw']:>9.2f} "
              f"{gbs['raw1']:>10.2f} {_paired_ratio(times, 'pool', 'raw'):>9.2f} "
              f"{_paired_ratio(times, 'hdr', 'raw'):>8.2f} "
              f"{_paired_ratio(times, 'pool', 'raw1'):>10.2f}")
    return 0
