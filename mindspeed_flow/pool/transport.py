"""Point-to-point transport of the pool: one receiving thread per (peer, channel), and deadline-bounded waits.

Why threads: on gloo (torch 2.13, measured) a send/recv `Work.is_completed()` stays False until `wait()` is
called, even after the bytes have landed, so a receiver cannot poll for arrivals; and `wait(timeout=...)` does
honour the timeout but closes the connection to that peer when it fires ("Application timeout caused pair
closure"), so short timeouts cannot be used to poll either. A receiving thread that blocks in `wait()` on the
next message of one (peer, channel) stream is the portable answer: messages on one (peer, tag) arrive in order,
so the thread never waits on the wrong one, data moves while the training thread computes (prefetch), and the
training thread waits on a condition variable with its own deadline, which is where timeouts are enforced and
where the peer and the awaited item are named.

A thread stuck in `wait()` when the pool is abandoned is a daemon thread; tearing the process group down wakes it
with an error, which it records and exits on. Every work is waited exactly once: a second `wait()` on a gloo
send/recv work blocks until the group timeout (measured: the second waiter never returns).
"""
from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from mindspeed_flow.pool.wire import MAX_BATCH, WireHeader, as_bytes, encode_header, has_payload

# Called with the received header tensor; returns the payload buffers to receive into, in send order (empty: no
# payload), a context handed on to `Deliver`, and how many items the message carries. Runs on the stream thread,
# outside the pool lock.
Land = Callable[[torch.Tensor], tuple[list[torch.Tensor], Any, int]]
Deliver = Callable[[Any, list[torch.Tensor]], None]


class InboundStream:
    """Receives the messages of one peer on one channel, in order, until it has the items the pool asked for.

    The pool calls `request(n)` (holding `cond`) when it learns that n more items will come (an expected
    embedding, a credit owed for a sent item, a gradient owed for it). A message carries 1..MAX_BATCH items, so
    a header receive is posted only while fewer items have been announced than asked for, and one at a time:
    nothing is ever left posted when the plan is exhausted (it would steal the next pool's first message).

    Two stages, each on its own thread, so transfers pipeline: as a header lands, the header thread allocates
    the batch's payload buffers, posts their receives and at once posts the next header receive; the payload thread
    waits for the payloads in order and delivers. A sequential receiver would pay one rendezvous round trip per
    message before even asking for the next header.
    """

    def __init__(self, *, cond: threading.Condition, peer: int, group: dist.ProcessGroup | None,
                 header_tag: int, payload_tag: int | None, header_len: int, land: Land, deliver: Deliver,
                 name: str, wire_device: torch.device = torch.device("cpu")) -> None:
        self.cond = cond
        self.peer = peer
        self.group = group
        self.header_tag = header_tag
        self.payload_tag = payload_tag
        self.header_len = header_len
        self.land = land
        self.deliver = deliver
        self.wire_device = wire_device
        self.wanted = 0     # items the pool knows will come
        self.announced = 0  # items in the headers landed so far (may run ahead of `wanted`: early arrivals)
        self.received = 0   # items delivered
        self.messages = 0   # messages landed
        self.closed = False
        self.error: BaseException | None = None
        self._landed: deque[tuple[list[dist.Work], list[torch.Tensor], Any, int]] = deque()  # in order
        self._threads = [threading.Thread(target=self._guard, args=(self._next_header,), name=f"{name}-headers",
                                          daemon=True),
                         threading.Thread(target=self._guard, args=(self._next_payload,), name=f"{name}-payloads",
                                          daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def request(self, n: int = 1) -> None:
        """Ask for n more items (call with `cond` held)."""
        self.wanted += n
        self.cond.notify_all()

    def close(self) -> None:
        """Stop after the current message (call with `cond` held)."""
        self.closed = True
        self.cond.notify_all()

    @property
    def idle(self) -> bool:
        return self.received >= self.wanted

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    def _next_header(self) -> bool:
        with self.cond:
            while self.announced >= self.wanted and not self.closed:
                self.cond.wait()
            if self.closed:
                return False
            # Posted under the lock, as every pool post is: on backends that coalesce point-to-point calls per
            # process group (NCCL) concurrent posts from several threads must not interleave.
            header = torch.empty(self.header_len, dtype=torch.int64, device=self.wire_device)
            work = dist.irecv(header, src=self.peer, group=self.group, tag=self.header_tag)
        work.wait()  # every work is waited exactly once: a second wait on a gloo work blocks
        buffers, context, count = self.land(header)
        with self.cond:
            assert self.payload_tag is not None or not buffers, "a payload was announced on a header-only channel"
            works = [dist.irecv(b, src=self.peer, group=self.group, tag=self.payload_tag) for b in buffers]
            self.announced += count
            self.messages += 1
            self._landed.append((works, buffers, context, count))
            self.cond.notify_all()
        return True

    def _next_payload(self) -> bool:
        with self.cond:
            while not self._landed and not self.closed:
                self.cond.wait()
            if self.closed:
                return False
            works, buffers, context, count = self._landed.popleft()
        for work in works:
            work.wait()
        self.deliver(context, buffers)
        with self.cond:
            self.received += count
            self.cond.notify_all()
        return True

    def _guard(self, step: Callable[[], bool]) -> None:
        run_guarded(self, step)


def run_guarded(owner: "InboundStream | Outbox", step: Callable[[], bool]) -> None:
    """Run `step` until it returns False; record the first exception on `owner` for the waiting thread."""
    try:
        while step():
            pass
    except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits on this stream
        with owner.cond:
            owner.error = owner.error or exc
            owner.cond.notify_all()


class Outbox:
    """Sends the items queued for one peer on one channel, coalescing those that queue up behind a send.

    `push` (with `cond` held) queues an item and returns; the outbox thread sends what is queued as one message
    (one header for up to MAX_BATCH items and `coalesce_bytes` of payload, a larger item alone; the payloads are
    posted with the header, never copied), waits for the sends to complete, and loops. An item pushed while the link is idle leaves at once, alone; items pushed
    while a send is in flight leave together next, so per-item costs shrink exactly when items are small and
    many, and no item ever waits for a timer or for a batch to fill.
    """

    def __init__(self, *, cond: threading.Condition, peer: int, group: dist.ProcessGroup | None, channel: int,
                 header_tag: int, payload_tag: int | None, coalesce_bytes: int,
                 on_sent: Callable[[list[WireHeader]], None], name: str,
                 wire_device: torch.device = torch.device("cpu")) -> None:
        self.cond = cond
        self.peer = peer
        self.group = group
        self.channel = channel
        self.on_sent = on_sent
        self.header_tag = header_tag
        self.payload_tag = payload_tag
        self.coalesce_bytes = coalesce_bytes
        self.wire_device = wire_device
        self.pushed = 0     # items queued so far
        self.sent = 0       # items whose message completed
        self.messages = 0   # messages completed
        self.in_flight: list[WireHeader] = []  # the items of the message being sent
        self.closed = False
        self.error: BaseException | None = None
        self._queue: deque[tuple[WireHeader, torch.Tensor | None]] = deque()
        self._thread = threading.Thread(target=run_guarded, args=(self, self._send_next), name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def push(self, header: WireHeader, tensor: torch.Tensor | None) -> None:
        """Queue one item (call with `cond` held)."""
        if self.error is not None:
            raise self.error
        self._queue.append((header, tensor))
        self.pushed += 1
        self.cond.notify_all()

    def close(self) -> None:
        """Stop once the queue is empty (call with `cond` held)."""
        self.closed = True
        self.cond.notify_all()

    @property
    def idle(self) -> bool:
        return self.sent >= self.pushed

    def pending(self) -> list[WireHeader]:
        """Items not yet received by the peer: in flight first, then queued (call with `cond` held)."""
        return [*self.in_flight, *(h for h, _ in self._queue)]

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _take_batch(self) -> list[tuple[WireHeader, torch.Tensor | None]]:
        batch = [self._queue.popleft()]
        size = batch[0][0].nbytes
        while self._queue and len(batch) < MAX_BATCH and size + self._queue[0][0].nbytes <= self.coalesce_bytes:
            size += self._queue[0][0].nbytes
            batch.append(self._queue.popleft())
        return batch

    def _send_next(self) -> bool:
        with self.cond:
            while not self._queue and not self.closed:
                self.cond.wait()
            if not self._queue:
                return False
            batch = self._take_batch()
            self.in_flight = [h for h, _ in batch]
        headers = [h for h, _ in batch]
        header = encode_header(headers).to(self.wire_device)
        payloads = [as_bytes(t) for h, t in batch if t is not None and has_payload(h)]
        with self.cond:  # posted under the lock (see InboundStream._next_header)
            ops = [dist.P2POp(dist.isend, header, self.peer, self.group, self.header_tag)]
            ops += [dist.P2POp(dist.isend, p, self.peer, self.group, self.payload_tag) for p in payloads]
            works = list(dist.batch_isend_irecv(ops))
        for work in works:  # waited here, once; the buffers stay alive until then
            work.wait()
        with self.cond:
            self.sent += len(batch)
            self.messages += 1
            self.in_flight = []
            self.on_sent(headers)
            self.cond.notify_all()
        return True


def wait_work(work: dist.Work, deadline: float, *, on_timeout: Callable[[], BaseException],
              on_failure: Callable[[BaseException], BaseException]) -> None:
    """Wait for one send/recv until `deadline` (time.monotonic()); raise the caller's error if it does not end.

    A failure after the deadline is a timeout; a failure before it is the transport's (a dead peer fails fast).
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise on_timeout()
    try:
        # timedelta(0) means "no timeout" to c10d, so never pass less than a millisecond.
        work.wait(timeout=datetime.timedelta(seconds=max(remaining, 1e-3)))
    except RuntimeError as exc:
        if time.monotonic() >= deadline - 1e-3:
            raise on_timeout() from exc
        raise on_failure(exc) from exc
