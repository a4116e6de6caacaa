"""`mindspeed-flow bench pool`: embedding-pool throughput against raw isend/irecv, side by side.

Two local gloo ranks (forked, as in the tests): rank 0 produces `--items` embeddings of `--tokens` x `--hidden`
fp32 per size, rank 1 consumes them. "pool" is put/expect/get with headers, credits and the pool's threads, items
coalesced as they queue behind a send (the default); "1/msg" is the same pool sending one item per message
(`max_batch_items=1`, what the pool did before coalescing); "raw" is the lower bound: the same bytes as pre-agreed
isend/irecv pairs into pre-allocated buffers, with no header, no credit, no thread. Each figure is bytes moved /
seconds from a barrier to the consumer holding the last item, best of `--repeats`; the ratios are what to read
(this machine is shared and noisy). The capacity defaults to the job's `flow.pool_capacity_mb`.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from mindspeed_flow.config.schema import FlowConfig
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.pool.wire import MAX_BATCH
from mindspeed_flow.utils.multiproc import run_ranks


def _pool_seconds(rank: int, items: list[torch.Tensor], capacity_bytes: int, step: int,
                  max_batch_items: int) -> tuple[float, int]:
    pool = EmbeddingPool(rank=rank, group=None, capacity_bytes=capacity_bytes, timeout_s=60.0,
                         device=torch.device("cpu"), return_grads=False,
                         max_batch_items=max_batch_items)
    if rank == 1:
        pool.expect(producer=0, items=[(i, step) for i in range(len(items))])
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        for i, tensor in enumerate(items):
            pool.put(tensor, sample_id=i, step=step, consumer=1)
    else:
        for i in range(len(items)):
            pool.get(sample_id=i, step=step, producer=0)
    elapsed = time.perf_counter() - start
    pool.flush()
    dist.barrier()
    messages = pool.stats().embedding_messages
    pool.close()
    return elapsed, messages


def _raw_seconds(rank: int, items: list[torch.Tensor], allocate: bool) -> float:
    """Pre-agreed isend/irecv; `allocate`: the receiver allocates its buffers inside the timed region, as any
    receiver that hands out fresh tensors (the pool included) must."""
    buffers = items if rank == 0 or allocate else [torch.empty_like(t) for t in items]
    dist.barrier()
    start = time.perf_counter()
    if rank == 1 and allocate:
        buffers = [torch.empty_like(t) for t in items]
    op = dist.isend if rank == 0 else dist.irecv
    works = [op(t, 1 - rank, tag=7) for t in buffers]
    for w in works:
        w.wait()
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed


def _bench_rank(rank: int, world: int, sizes: list[int], n_items: int, hidden: int, repeats: int,
                capacity_bytes: int) -> list[dict]:
    rows = []
    step = 0
    for tokens in sizes:
        items = [torch.randn(tokens, hidden) for _ in range(n_items)]
        nbytes = sum(t.numel() * t.element_size() for t in items)
        row: dict = {"tokens": tokens, "item_bytes": nbytes // n_items, "bytes": nbytes}
        # Interleaved repeats: a burst of load on the shared machine hits every variant alike.
        runs: dict[str, list[float]] = {"pool": [], "one": [], "raw": [], "alloc": []}
        for _ in range(repeats):
            for name, batch_items in (("pool", MAX_BATCH), ("one", 1)):
                seconds, messages = _pool_seconds(rank, items, capacity_bytes, step, batch_items)
                runs[name].append(seconds)
                row[f"{name}_messages"] = messages
                step += 1
            runs["raw"].append(_raw_seconds(rank, items, allocate=False))
            runs["alloc"].append(_raw_seconds(rank, items, allocate=True))
        row.update({f"{name}_s": min(v) for name, v in runs.items()})
        rows.append(row)
    return rows


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench pool", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,1024,4096", help="image tokens per item, comma-separated sizes")
    p.add_argument("--hidden", type=int, default=1024, help="embedding width (fp32)")
    p.add_argument("--items", type=int, default=16, help="items per size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--capacity-mb", type=float, default=FlowConfig.pool_capacity_mb,
                   help="pool capacity in MiB (default: the job default, flow.pool_capacity_mb)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    sizes = [int(s) for s in args.tokens.split(",") if s]
    capacity = int(args.capacity_mb * 2**20)
    producer_rows, rows = run_ranks(_bench_rank, 2, sizes, args.items, args.hidden, args.repeats, capacity,
                                    timeout_s=1200)
    for r, p in zip(rows, producer_rows):  # times: the consumer's (it holds the last item); messages: the producer's
        r.update({k: v for k, v in p.items() if k.endswith("_messages")})
    print(f"embedding pool vs raw isend/irecv: 2 gloo ranks on this host, fp32, hidden {args.hidden}, "
          f"{args.items} items per size, capacity {args.capacity_mb:g} MiB, best of {args.repeats}")
    print(f"{'tokens':>8} {'item MiB':>9} {'pool GB/s':>10} {'msgs':>5} {'1/msg GB/s':>11} {'raw GB/s':>9} "
          f"{'raw+alloc':>10} {'pool/raw':>9} {'1/msg/raw':>10} {'pool/raw+alloc':>15}")
    for r in rows:
        gbs = {k: r["bytes"] / r[f"{k}_s"] / 1e9 for k in ("pool", "one", "raw", "alloc")}
        print(f"{r['tokens']:>8} {r['item_bytes'] / 2**20:>9.3f} {gbs['pool']:>10.2f} {r['pool_messages']:>5} "
              f"{gbs['one']:>11.2f} {gbs['raw']:>9.2f} {gbs['alloc']:>10.2f} {gbs['pool'] / gbs['raw']:>9.2f} "
              f"{gbs['one'] / gbs['raw']:>10.2f} {gbs['pool'] / gbs['alloc']:>15.2f}")
    return 0
