"""What strictness costs: the same ops and small jobs on plain CPU, the lenient emulation and the strict one.

    python -m mindspeed_flow.emulation.bench_strict [--repeats 5]

Each configuration runs in its own interpreter (an activated emulation cannot be undone): `--worker MODE` measures
and prints one JSON line, the parent prints the table with each mode's ratio to plain CPU. Measured:

- per op: a 64x64 float add and a 256x256 float matmul (microseconds per call, median of the repeats);
- per job: 50 forward+backward passes of a 4-layer MLP (hidden 256, batch 32), one rank;
- per job: 20 MC2 steps on 2 forked ranks (npu_all_gather_base_mm forward+backward, [64, 256] x [256, 256] per
  rank) plus one 1 MiB all_reduce each, over gloo (plain CPU: the reference ops on a gloo group; lenient: an "hccl"
  group that is gloo; strict: npu tensors on the HCCL backend).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from mindspeed_flow import emulation
from mindspeed_flow.utils.multiproc import run_ranks

MODES = ("cpu", "lenient", "strict")


def _activate(mode: str) -> str:
    """The device the mode's tensors live on ("cpu" for plain CPU, "npu" for both emulations)."""
    if mode == "cpu":
        return "cpu"
    emulation.activate(mode=mode)
    return "npu"


def _median_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def _ops(device: str, repeats: int) -> dict[str, float]:
    a, b = torch.randn(64, 64).to(device), torch.randn(64, 64).to(device)
    m, n = torch.randn(256, 256).to(device), torch.randn(256, 256).to(device)
    for _ in range(20):  # warm-up: first calls allocate, fault pages in, fill dispatch caches
        a + b
        m @ n
    return {"add 64x64 (us)": _median_us(lambda: a + b, 2000, repeats),
            "matmul 256x256 (us)": _median_us(lambda: m @ n, 200, repeats)}


def _mlp(device: str, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(32, 256).to(device)

    def job() -> None:
        for _ in range(50):
            model(x).square().mean().backward()

    job()  # warm-up
    return {"MLP 50 fwd+bwd (ms)": _median_us(job, 1, repeats) / 1000}


def _mc2_rank(rank: int, world: int, mode: str, repeats: int) -> float:
    device = _activate(mode)
    from mindspeed_flow.emulation import hccl, ops  # lazy: after activate

    group = dist.new_group(list(range(world)), backend="gloo" if mode == "cpu" else "hccl")
    name = hccl.comm_name(group) if mode == "cpu" else \
        group._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_global_rank(group, rank))
    x = torch.randn(64, 256).to(device).requires_grad_()
    w = torch.randn(256, 256).to(device).requires_grad_()
    big = torch.ones(1 << 18).to(device)  # 1 MiB of float32

    def job() -> None:
        for _ in range(20):
            out, _ = ops.npu_all_gather_base_mm(x, w, name, world)
            out.sum().backward()
        dist.all_reduce(big, group=group)

    job()
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        job()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def worker(mode: str, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    # The MC2 ranks fork first, before this process activates anything or runs a backward pass.
    mc2 = max(run_ranks(_mc2_rank, 2, mode, repeats, timeout_s=600))
    device = _activate(mode)
    result = _ops(device, repeats)
    result.update(_mlp(device, repeats))
    result["MC2 20 steps + all_reduce, 2 ranks (ms)"] = mc2
    return result


def _table(results: dict[str, dict[str, float]]) -> str:
    rows = [f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
            f"| measure | {' | '.join(MODES)} | lenient/cpu | strict/cpu | strict/lenient |",
            "|---|" + "---:|" * (len(MODES) + 3)]
    for key in results["cpu"]:
        cpu, lenient, strict = (results[m][key] for m in MODES)
        rows.append(f"| {key} | {cpu:.1f} | {lenient:.1f} | {strict:.1f} | {lenient / cpu:.2f} | {strict / cpu:.2f} | "
                    f"{strict / lenient:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_flow.emulation.bench_strict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measure (median reported)")
    parser.add_argument("--worker", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.repeats)), flush=True)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("MSF_EMULATION_MODE", None)  # each worker names its own mode
    results = {}
    for mode in MODES:
        proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.emulation.bench_strict", "--worker", mode,
                               "--repeats", str(args.repeats)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        line = next(li for li in proc.stdout.splitlines() if li.startswith("RESULT "))
        results[mode] = json.loads(line[len("RESULT "):])
    print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
