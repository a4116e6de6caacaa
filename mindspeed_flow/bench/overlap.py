"""`mindspeed-flow bench overlap`: plain vs chunked TP+SP linears, forward + backward, on local gloo ranks.

    mindspeed-flow bench overlap [--world 2] [--m 4096 --k 1024 --n 1024] [--chunks 1,2,4]
        [--iters 5] [--warmup 1] [--kinds column,row] [--json]

--m is the full sequence (rows gathered over the TP group), --k the input and --n the output features of the
full (unsharded) layer. Each rank runs one layer step (forward + backward to x and W) per iteration; an
iteration's time is the slowest rank's, and the report gives the median per implementation and the ratio
plain / chunked (> 1 means chunking helped).

On CPU/gloo a speedup is not expected and the figures do not predict NPU/GPU behaviour: gloo runs collectives
on host threads that compete with the matmuls for the same cores (some overlap can still show, e.g. the
column backward's async reduce-scatter under the weight-gradient matmul, and more chunks add per-call overhead).
The real overlap needs separate compute and communication engines (HCCL/NCCL streams).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.overlap import OverlapContext, column_parallel_linear_sp, row_parallel_linear_sp
from mindspeed_flow.utils.multiproc import run_ranks

CPU_NOTE = ("CPU/gloo: no speedup is expected and these ratios do not predict NPU/GPU: gloo collectives run on "
            "host threads sharing the cores with the matmuls; the overlap needs separate compute and "
            "communication engines (HCCL or NCCL streams).")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench overlap", description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="tensor-parallel ranks (local gloo processes)")
    p.add_argument("--m", type=int, default=4096, help="full sequence rows (gathered over the TP group)")
    p.add_argument("--k", type=int, default=1024, help="input features of the full layer")
    p.add_argument("--n", type=int, default=1024, help="output features of the full layer")
    p.add_argument("--chunks", default="1,2,4", help="comma-separated chunk counts for 'chunked'")
    p.add_argument("--kinds", default="column,row", help="which linears: column, row or both")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per implementation")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(list(argv))
    args.chunk_list = [int(c) for c in args.chunks.split(",") if c.strip()]
    args.kind_list = [k.strip() for k in args.kinds.split(",") if k.strip()]
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.world < 1 or args.m % args.world or args.k % args.world or args.n % args.world:
        p.error(f"--m {args.m}, --k {args.k} and --n {args.n} must all be multiples of --world {args.world}")
    if not args.chunk_list or min(args.chunk_list) < 1:
        p.error(f"--chunks {args.chunks!r}: expected positive integers such as 1,2,4")
    bad = [k for k in args.kind_list if k not in ("column", "row")]
    if bad or not args.kind_list:
        p.error(f"--kinds {args.kinds!r}: expected column, row or column,row")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")


def _variants(chunk_list: list[int]) -> list[tuple[str, str, int]]:
    return [("plain", "plain", 1)] + [(f"chunked x{c}", "chunked", c) for c in chunk_list]


def _layer_inputs(kind: str, rank: int, world: int, m: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
    """Local shards of one layer: column takes the sequence shard, row the full sequence of a feature shard."""
    g = torch.Generator().manual_seed(1000 + rank)
    if kind == "column":
        x, w, grad = torch.randn(m // world, k, generator=g), torch.randn(n // world, k, generator=g), \
            torch.randn(m, n // world, generator=g)
    else:
        x, w, grad = torch.randn(m, k // world, generator=g), torch.randn(n, k // world, generator=g), \
            torch.randn(m // world, n, generator=g)
    return x.requires_grad_(), w.requires_grad_(), grad


def _time_step(kind: str, ctx: OverlapContext, impl: str, chunks: int, x: torch.Tensor, w: torch.Tensor,
               grad: torch.Tensor) -> float:
    fn = column_parallel_linear_sp if kind == "column" else row_parallel_linear_sp
    x.grad = w.grad = None
    dist.barrier()  # every rank starts together, so a rank's time is not another's straggling
    start = time.perf_counter()
    fn(x, w, ctx=ctx, impl=impl, chunks=chunks).backward(grad)
    return time.perf_counter() - start


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    ctx = OverlapContext()  # the world group is the TP group here
    for kind in args.kind_list:
        x, w, grad = _layer_inputs(kind, rank, world, args.m, args.k, args.n)
        for label, impl, chunks in _variants(args.chunk_list):
            runs = [_time_step(kind, ctx, impl, chunks, x, w, grad) for _ in range(args.warmup + args.iters)]
            times[f"{kind} {label}"] = runs[args.warmup:]
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_rank = run_ranks(_bench_rank, args.world, args, timeout_s=600)
    rows = []
    for kind in args.kind_list:
        plain = None
        for label, _, chunks in _variants(args.chunk_list):
            key = f"{kind} {label}"
            slowest = [max(ranks) for ranks in zip(*(r[key] for r in per_rank))]
            median = statistics.median(slowest)
            plain = median if plain is None else plain
            rows.append({"kind": kind, "impl": label, "chunks": chunks, "median_s": median,
                         "plain_over_this": plain / median})
    return {"world": args.world, "m": args.m, "k": args.k, "n": args.n, "iters": args.iters,
            "backend": "gloo", "torch": torch.__version__, "rows": rows, "note": CPU_NOTE}


def _print_table(result: dict[str, Any]) -> None:
    print(f"overlap bench: world={result['world']} m={result['m']} k={result['k']} n={result['n']} "
          f"(fp32, gloo, forward+backward, median of {result['iters']}, slowest rank)")
    print(f"{'linear':<8} {'impl':<12} {'median ms':>10} {'plain/this':>11}")
    for r in result["rows"]:
        print(f"{r['kind']:<8} {r['impl']:<12} {r['median_s'] * 1e3:>10.1f} {r['plain_over_this']:>11.2f}")
    print(result["note"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv or [])
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0
