"""Receive buffers the pool reuses once nothing views them any more.

Why: a buffer fresh from the allocator costs a page fault per 4 KiB page the first time its bytes are written, and
large ones come fresh every time (the C allocator maps and unmaps them). Measured with `bench pool` at 4 MiB
items, the consumer took 8,000-16,000 page faults per 64 MiB step, a large share of the step, where a hand-written
isend/irecv loop that receives into buffers the allocator had just freed took none. So the pool keeps its host
receive buffers (payloads and gloo staging buffers) and hands one out again once every tensor viewing it is gone.

"Gone" is read from the buffer's storage reference count: the items get() returns are views of their message's
buffer, and anything that keeps one alive (the caller, autograd, a communication work) keeps a reference to the
storage, so a buffer whose storage only the cache references is free. Buffers come in power-of-two size classes
(from `MIN_CACHED_BYTES`), so batches of varying sizes find one; the cache holds at most `limit_bytes` of them and
allocates past that as before (nothing is ever waited for). A consumer that keeps every item it got alive
forever therefore costs at most `limit_bytes` more than it would without the cache.

Host buffers only: a device buffer may still be read by work queued on a stream after its last reference drops.
"""
from __future__ import annotations

import threading

import torch

MIN_CACHED_BYTES = 64 << 10  # below this the allocator reuses its own free memory without faulting anyway


def _storage_refs(tensor: torch.Tensor) -> int:
    """The reference count of `tensor`'s storage. Compared only with the same buffer's count when nothing viewed it:
    whether the storage object this call makes counts itself differs between torch versions (2.7: no, 2.13: yes)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


# The count is a private torch function (present in 2.x, torch 2.7 included); without it nothing is ever reused.
_CAN_COUNT = hasattr(torch._C, "_storage_Use_Count")


class ReceiveBuffers:
    """A bounded cache of host uint8 buffers, reused once nothing views them (thread-safe)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes if _CAN_COUNT else 0
        self.cached_bytes = 0
        self.reused = 0    # take() served from the cache
        self.allocated = 0  # take() that allocated
        self._classes: dict[int, list[tuple[torch.Tensor, int]]] = {}  # size -> (buffer, its count when unviewed)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of `nbytes`, a view of a reused buffer where one of its size class is free."""
        if nbytes < MIN_CACHED_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = 1 << (nbytes - 1).bit_length()
        with self._lock:
            buffers = self._classes.setdefault(size, [])
            for buffer, unviewed in buffers:
                if _storage_refs(buffer) == unviewed:  # only this cache holds it
                    self.reused += 1
                    return buffer[:nbytes]
            self.allocated += 1
            if self.cached_bytes + size > self.limit_bytes:
                return torch.empty(nbytes, dtype=torch.uint8)
            buffer = torch.empty(size, dtype=torch.uint8)
            buffers.append((buffer, _storage_refs(buffer)))
            self.cached_bytes += size
            return buffer[:nbytes]

    def clear(self) -> None:
        """Forget every cached buffer (their memory goes back once the last view of each is gone)."""
        with self._lock:
            self._classes.clear()
            self.cached_bytes = 0
