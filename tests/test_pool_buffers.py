"""The pool's reused receive buffers: a buffer comes back only once nothing views it (a returned item, a view of an
item, a posted receive), within the cache's byte limit."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_flow.pool.buffers import MIN_CACHED_BYTES, ReceiveBuffers
from mindspeed_flow.utils.multiproc import run_ranks

MIB = 1 << 20


def test_a_buffer_is_reused_only_once_every_view_of_it_is_gone():
    cache = ReceiveBuffers(limit_bytes=64 * MIB)
    first = cache.take(3 * MIB)  # the 4 MiB class
    first_ptr = first.data_ptr()
    item = first[100:200]  # what get() hands out: a view of the message's buffer
    del first
    second = cache.take(4 * MIB)
    assert second.data_ptr() != first_ptr, "reused while an item still viewed it"
    del item
    third = cache.take(3 * MIB + 1)
    assert third.data_ptr() == first_ptr and third.numel() == 3 * MIB + 1
    assert (cache.reused, cache.allocated) == (1, 2)
    del second, third
    assert cache.take(2 * MIB).data_ptr() != first_ptr  # another size class: its own buffer


def test_small_requests_and_requests_past_the_limit_are_plain_allocations():
    cache = ReceiveBuffers(limit_bytes=2 * MIB)
    small = cache.take(MIN_CACHED_BYTES - 1)
    assert small.numel() == MIN_CACHED_BYTES - 1 and cache.cached_bytes == 0
    held = [cache.take(MIB), cache.take(MIB)]
    assert cache.cached_bytes == 2 * MIB
    extra = cache.take(MIB)  # both cached buffers are in use and the limit is reached: a fresh one, not kept
    assert cache.cached_bytes == 2 * MIB and all(extra.data_ptr() != h.data_ptr() for h in held)
    ptrs = {h.data_ptr() for h in held}
    del held, extra
    assert cache.take(MIB).data_ptr() in ptrs
    cache.clear()
    assert cache.cached_bytes == 0


def _posted_receive_keeps_its_buffer(rank: int, world: int) -> bool:
    if rank == 0:
        dist.barrier()
        dist.send(torch.full((MIB,), 7, dtype=torch.uint8), 1, tag=5)
        return True
    cache = ReceiveBuffers(limit_bytes=16 * MIB)
    target = cache.take(MIB)
    ptr = target.data_ptr()
    work = dist.irecv(target, 0, tag=5)
    del target  # only the posted receive references it now
    other = cache.take(MIB)
    assert other.data_ptr() != ptr, "a buffer a posted receive writes into was handed out again"
    dist.barrier()
    work.wait()
    del work
    again = cache.take(MIB)
    assert again.data_ptr() == ptr and bool((again == 7).all())
    return True


def test_a_buffer_a_posted_receive_writes_into_is_not_handed_out():
    """Counts of storage references differ between torch versions (2.7 vs 2.13); the cache must be right on both."""
    assert run_ranks(_posted_receive_keeps_its_buffer, 2, timeout_s=60) == [True, True]
