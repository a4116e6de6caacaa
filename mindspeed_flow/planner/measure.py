"""Measuring on the devices at hand what the cost model predicts: saved-activation bytes, static memory, times.

Activation memory is measured as the bytes of the distinct tensor storages autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`), excluding parameters: exactly what a forward pass keeps alive
until its backward, independent of allocator caching and of other processes (RSS deltas on a shared CPU are too
noisy for models of a few MB). Static memory is parameters + gradients + optimizer states, summed over tensors
after one real AdamW step. A whole job's peak on the CPU is the peak of its live tensor storages
(`telemetry.tensor_bytes.LiveTensorBytes`, which the torch host's ranks enter with MSF_MEMORY_TRACK=1).

Imports torch lazily: the planner itself stays importable without it.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Callable, Iterable

import torch


def saved_activation_bytes(fn: Callable[[], Any], params: Iterable[Any]) -> tuple[int, Any]:
    """(bytes of distinct non-parameter storages saved for backward during fn(), fn's result)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def static_bytes_after_step(module: Any, lr: float = 1e-3) -> dict[str, int]:
    """Parameters, gradients and AdamW states (bytes) of `module` after one optimizer step on a dummy loss."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    loss = sum((p.float() ** 2).sum() for p in params)
    loss.backward()
    opt.step()
    states = [v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    return {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optim": sum(t.numel() * t.element_size() for t in states),
    }


def time_call(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> tuple[float, float]:
    """(wall, cpu) seconds of fn(): the fastest of `repeats` (after `warmup` calls) for each clock.

    CPU time of the calling thread is what the work costs on a core of its own; wall time also counts the time
    other processes held the core, so on a shared machine only the CPU time calibrates the model.
    """
    for _ in range(warmup):
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return min(walls), min(cpus)


def _busy_share(seconds: float, queue: Any) -> None:
    t0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - t0 < seconds:
        x += 1
    queue.put((time.thread_time() - c0) / (time.perf_counter() - t0))


def core_share(processes: int, seconds: float = 0.5) -> float:
    """Mean fraction of a core each of `processes` concurrent busy processes gets on this machine right now
    (1.0 on an idle machine with enough cores; less when they share cores with each other or other jobs)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_busy_share, args=(seconds, q)) for _ in range(processes)]
    for p in procs:
        p.start()
    shares = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    return sum(shares) / len(shares)
