"""`mindspeed-flow bench pool`: embedding-pool throughput against raw isend/irecv, side by side.

Two local gloo ranks (forked, as in the tests): rank 0 produces `--items` embeddings of `--tokens` x `--hidden`
fp32 per size, rank 1 consumes them. Three ways to move the same tensors, each timed from the producer starting
to send (after a barrier) to the consumer holding the last item, on the host's monotonic clock that both ranks
share:

- "pool": put/expect/get as the runtime uses it, with the step's items planned on both sides (the consumer
  expects them with their shapes and dtypes, the producer puts them with `planned=True`): each payload's receive
  is posted at expect() and its bytes leave at put(); headers (up to `--max-batch-items` per message) and credits
  still travel and are checked;
- "hdr": the same pool without plans (the general header path): a payload's receive is posted once its header
  lands; items queued behind a send share one header and one payload transfer;
- "raw": what a skilled user writes by hand with the same sizes agreed in advance: every isend/irecv of the step
  posted at once on the same process group, the receives posted before the barrier into buffers allocated then
  (the lower bound: no header, no credit, no thread, no allocation on the clock); "raw+alloc" allocates and posts
  the receives after the barrier, as a receiver that hands out fresh tensors each step would.

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

VARIANTS = ("pool", "hdr", "raw", "alloc")
_RAW_TAG = 7


# A run's (start, end) on this rank, in time.perf_counter() seconds: the two ranks share this host's monotonic clock,
# so a run is timed from the producer starting to send to the consumer holding the last item (the barrier releases
# the ranks up to a scheduler slice apart on a loaded machine; neither rank's own clock alone would be fair).
Span = tuple[float, float]


def _pool_step(pool: EmbeddingPool, rank: int, items: list[torch.Tensor], step: int, planned: bool) -> Span:
    """One step through `pool`: the consumer expects the step's items (its receives go out) before the barrier;
    `planned`: both sides know the items' shapes and dtypes (the step plan)."""
    if rank == 1:
        specs = [(t.shape, t.dtype) for t in items] if planned else None
        pool.expect(producer=0, items=[(i, step) for i in range(len(items))], specs=specs)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        for i, tensor in enumerate(items):
            pool.put(tensor, sample_id=i, step=step, consumer=1, planned=planned)
    else:
        for i in range(len(items)):
            pool.get(sample_id=i, step=step, producer=0)
    end = time.perf_counter()
    pool.flush()  # credits and sends settle off the clock, so the next variant starts on a quiet link
    dist.barrier()
    return start, end


def _raw_step(rank: int, items: list[torch.Tensor], allocate: bool, group: dist.ProcessGroup | None) -> Span:
    """Every isend/irecv of the step posted at once. Without `allocate` the receiver posts its receives into
    buffers allocated before the barrier, as the pool's consumer posts its receives at expect(); with `allocate`
    it allocates and posts after it."""
    works: list[dist.Work] = []
    if rank == 1 and not allocate:
        works = [dist.irecv(torch.empty_like(t), 0, group=group, tag=_RAW_TAG) for t in items]
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        works = [dist.isend(t, 1, group=group, tag=_RAW_TAG) for t in items]
    elif allocate:
        works = [dist.irecv(torch.empty_like(t), 0, group=group, tag=_RAW_TAG) for t in items]
    for w in works:
        w.wait()
    end = time.perf_counter()
    dist.barrier()
    return start, end


def _bench_rank(rank: int, world: int, sizes: list[int], n_items: int, hidden: int, repeats: int,
                capacity_bytes: int, max_batch_items: int) -> list[dict]:
    # The planned pool and raw share the world group (the same group, as the comparison requires); the header-path
    # pool gets its own group, so the two pools' tags can never meet.
    hdr_group = dist.new_group(backend="gloo")
    pools = {name: EmbeddingPool(rank=rank, group=group, capacity_bytes=capacity_bytes, timeout_s=120.0,
                                 device=torch.device("cpu"), return_grads=False, max_batch_items=max_batch_items)
             for name, group in (("pool", None), ("hdr", hdr_group))}
    steps = iter(range(1 << 30))  # a fresh step number per pool step: (sample, step) keys are never reused
    run: dict[str, Callable[[list[torch.Tensor]], Span]] = {
        "pool": lambda items: _pool_step(pools["pool"], rank, items, next(steps), planned=True),
        "hdr": lambda items: _pool_step(pools["hdr"], rank, items, next(steps), planned=False),
        "raw": lambda items: _raw_step(rank, items, allocate=False, group=None),
        "alloc": lambda items: _raw_step(rank, items, allocate=True, group=None),
    }
    rows = []
    for tokens in sizes:
        items = [torch.randn(tokens, hidden) for _ in range(n_items)]
        nbytes = sum(t.numel() * t.element_size() for t in items)
        for name in VARIANTS:  # warm-up, untimed: threads started, allocator and sockets warm for this size
            run[name](items)
        messages = {name: pools[name].stats().embedding_messages for name in pools}
        spans: dict[str, list[Span]] = {name: [] for name in VARIANTS}
        for r in range(repeats):
            for k in range(len(VARIANTS)):  # rotating order: no variant always runs first after the warm-up
                name = VARIANTS[(r + k) % len(VARIANTS)]
                spans[name].append(run[name](items))
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
    p.add_argument("--repeats", type=int, default=9, help="timed steps per variant and size (medians reported)")
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
          f"{args.items} items per step, capacity {args.capacity_mb:g} MiB, pool: up to {args.max_batch_items} "
          f"items per message; medians of {args.repeats} interleaved repeats")
    print(f"{'tokens':>7} {'item MiB':>9} {'pool GB/s':>10} {'msgs':>5} {'hdr GB/s':>11} {'msgs':>5} "
          f"{'raw GB/s':>9} {'raw+alloc':>10} {'pool/raw':>9} {'hdr/raw':>10} {'pool/raw+alloc':>15}")
    for r, p in zip(rows, producer_rows):  # messages: the producer's counters
        # the producer's start to the consumer's end, on the clock both ranks share
        times = {k: [end - start for (start, _), (_, end) in zip(p["spans"][k], r["spans"][k])] for k in VARIANTS}
        gbs = {k: r["bytes"] / statistics.median(times[k]) / 1e9 for k in VARIANTS}
        print(f"{r['tokens']:>7} {r['item_bytes'] / 2**20:>9.3f} {gbs['pool']:>10.2f} {p['pool_messages']:>5.1f} "
              f"{gbs['hdr']:>11.2f} {p['hdr_messages']:>5.1f} {gbs['raw']:>9.2f} {gbs['alloc']:>10.2f} "
              f"{_paired_ratio(times, 'pool', 'raw'):>9.2f} {_paired_ratio(times, 'hdr', 'raw'):>10.2f} "
              f"{_paired_ratio(times, 'pool', 'alloc'):>15.2f}")
    return 0
