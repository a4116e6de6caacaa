"""`mindspeed-flow bench pool`: embedding-pool throughput against raw isend/irecv, side by side.

Two local gloo ranks (forked, as in the tests): rank 0 produces `--items` embeddings of `--tokens` x `--hidden`
fp32 per size, rank 1 consumes them. "pool" is put/expect/get with headers, credits and the receiving threads;
"raw" is the lower bound: the same bytes as pre-agreed isend/irecv pairs with no header, no credit, no thread.
Each figure is bytes moved / seconds from a barrier to the consumer holding the last item, best of `--repeats`.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.utils.multiproc import run_ranks


def _pool_seconds(rank: int, items: list[torch.Tensor], capacity_bytes: int, step: int) -> float:
    pool = EmbeddingPool(rank=rank, group=None, capacity_bytes=capacity_bytes, timeout_s=60.0,
                         device=torch.device("cpu"), return_grads=False)
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
    pool.close()
    return elapsed


def _raw_seconds(rank: int, items: list[torch.Tensor]) -> float:
    buffers = items if rank == 0 else [torch.empty_like(t) for t in items]
    dist.barrier()
    start = time.perf_counter()
    op = dist.isend if rank == 0 else dist.irecv
    works = [op(t, 1 - rank, tag=7) for t in buffers]
    for w in works:
        w.wait()
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed


def _bench_rank(rank: int, world: int, sizes: list[int], n_items: int, hidden: int, repeats: int,
                capacity_items: int) -> list[dict]:
    rows = []
    for tokens in sizes:
        items = [torch.randn(tokens, hidden) for _ in range(n_items)]
        nbytes = sum(t.numel() * t.element_size() for t in items)
        capacity = capacity_items * items[0].numel() * items[0].element_size()
        pool_s = min(_pool_seconds(rank, items, capacity, step=r) for r in range(repeats))
        raw_s = min(_raw_seconds(rank, items) for _ in range(repeats))
        rows.append({"tokens": tokens, "item_bytes": nbytes // n_items, "pool_s": pool_s, "raw_s": raw_s,
                     "bytes": nbytes})
    return rows


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench pool", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,1024,4096", help="image tokens per item, comma-separated sizes")
    p.add_argument("--hidden", type=int, default=1024, help="embedding width (fp32)")
    p.add_argument("--items", type=int, default=16, help="items per size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--capacity-items", type=int, default=4, help="pool capacity, in items")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    sizes = [int(s) for s in args.tokens.split(",") if s]
    consumer_rows = run_ranks(_bench_rank, 2, sizes, args.items, args.hidden, args.repeats, args.capacity_items,
                              timeout_s=600)[1]
    print(f"embedding pool vs raw isend/irecv: 2 gloo ranks on this host, fp32, hidden {args.hidden}, "
          f"{args.items} items per size, capacity {args.capacity_items} items, best of {args.repeats}")
    print(f"{'tokens':>8} {'item MiB':>9} {'pool GB/s':>10} {'raw GB/s':>9} {'pool/raw':>9}")
    for r in consumer_rows:
        pool_gbs = r["bytes"] / r["pool_s"] / 1e9
        raw_gbs = r["bytes"] / r["raw_s"] / 1e9
        print(f"{r['tokens']:>8} {r['item_bytes'] / 2**20:>9.3f} {pool_gbs:>10.2f} {raw_gbs:>9.2f} "
              f"{pool_gbs / raw_gbs:>9.2f}")
    return 0
