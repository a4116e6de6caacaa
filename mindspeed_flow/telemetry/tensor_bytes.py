"""Live and peak bytes of the tensor storages a process creates: the CPU's stand-in for a device allocator's
statistics, which the torch host's ranks enter with MSF_MEMORY_TRACK=1 and `mindspeed-flow bench memory` compares
with the planner's memory model."""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes:
    """Live and peak bytes of the tensor storages this thread's torch ops create (a TorchDispatchMode).

    Torch's CPU allocator keeps no statistics, so the torch host's memory is measured one level up: every op's
    output storages are counted once while any tensor viewing them is alive (a weakref finalizer per tensor; torch
    keeps a tensor's Python object alive as long as its C++ tensor, so the finalizer runs when the storage's last
    user goes). This is what a device allocator would count, without its rounding or caching. Not counted:
    tensors made by other threads (the pool's transfer threads: the embedding buffers in flight) and storages
    resized in place (FSDP2 frees its gathered parameters that way, so measure FSDP2 layouts elsewhere).

    Use as a context manager around the whole job (parameters included); `marks` holds the live bytes a caller
    records under a name (the torch host's worker keeps the peak between steps there).
    """

    def __init__(self) -> None:
        owner = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                owner._track(out)
                return out

        self._mode = _Mode()
        # re-entrant: a finalizer may run (garbage collection) while this thread holds the lock in _track
        self._lock = threading.RLock()
        self._storages: dict[tuple[int, int], list[int]] = {}  # (data_ptr, nbytes) -> [nbytes, tensors alive]
        self.live = 0
        self.peak = 0
        self.marks: dict[str, int] = {}

    def _free(self, key: tuple[int, int]) -> None:
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self._storages[key]

    def _track(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if not storage.data_ptr():
                continue
            key = (storage.data_ptr(), storage.nbytes())
            with self._lock:
                entry = self._storages.get(key)
                if entry is None:
                    entry = self._storages[key] = [storage.nbytes(), 0]
                    self.live += entry[0]
                    self.peak = max(self.peak, self.live)
                entry[1] += 1
            weakref.finalize(t, self._free, key)

    def __enter__(self) -> "LiveTensorBytes":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
