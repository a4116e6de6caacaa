"""Measuring on the devices at hand what the cost model predicts: saved-activation bytes, static memory, times.

Activation memory is measured as the bytes of the distinct tensor storages autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`), excluding parameters: exactly what a forward pass keeps alive
until its backward, independent of allocator caching and of other processes (RSS deltas on a shared CPU are too
noisy for models of a few MB). Static memory is parameters + gradients + optimizer states, summed over tensors
after one real AdamW step.

Imports torch lazily: the planner itself stays importable without it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable


def saved_activation_bytes(fn: Callable[[], Any], params: Iterable[Any]) -> tuple[int, Any]:
    """(bytes of distinct non-parameter storages saved for backward during fn(), fn's result)."""
    import torch

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
    import torch

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


def time_call(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Fastest wall seconds of fn() over `repeats` (after `warmup` calls): the minimum is the least disturbed
    by other processes on a shared machine."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
