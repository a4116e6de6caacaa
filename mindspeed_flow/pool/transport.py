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

from mindspeed_flow.pool.wire import (STAGED_MIN_BYTES, WireHeader, encode_header, has_payload, pack_payloads,
                                     staged_bytes, staged_chunks, travels_staged)

# Called with the received header tensor and the message's staging buffer (None: the channel is not staged);
# returns one (context, view of the payload or None) per item of the message,
# in send order, and the batch's one payload buffer that those views slice (None: no item has a payload). Runs on
# the stream thread, outside the pool lock. `Deliver` gets a message's items, all at once, once its bytes are in.
LandedItem = tuple[Any, torch.Tensor | None]
Land = Callable[[torch.Tensor, torch.Tensor | None], tuple[list[LandedItem], torch.Tensor | None]]
Deliver = Callable[[list[LandedItem]], None]


class InboundStream:
    """Receives the messages of one peer on one channel, in order, until it has the items the pool asked for.

    The pool calls `request(n)` (holding `cond`) when it learns that n more items will come (an expected
    embedding, a credit owed for a sent item, a gradient owed for it). A message carries 1..MAX_BATCH items, so
    a header receive is posted only while fewer items have been announced than asked for, and one at a time:
    nothing is ever left posted when the plan is exhausted (it would steal the next pool's first message).

    Two stages, each on its own thread, so transfers pipeline: as a header lands, the header thread posts the
    next header receive, allocates the batch's one payload buffer and posts its receive; the payload thread
    waits for the payloads in order and delivers each item as a view of its batch's buffer. A sequential receiver would pay one rendezvous round trip per
    message before even asking for the next header.
    """

    def __init__(self, *, cond: threading.Condition, lock: threading.RLock, peer: int,
                 group: dist.ProcessGroup | None,
                 header_tag: int, payload_tag: int | None, header_len: int, land: Land, deliver: Deliver,
                 name: str, wire_device: torch.device = torch.device("cpu"),
                 payload_group: dist.ProcessGroup | None = None, staged_tag: int | None = None,
                 alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        self.cond = cond
        # This stream's own threads wait on `wake` (the same lock as `cond`): the pool's notifications on `cond`
        # wake only its callers, and a request() wakes only this stream, not every thread of the pool (measured:
        # waking them all on each put and get cost more than moving a 64-token embedding).
        self.wake = threading.Condition(lock)
        self.peer = peer
        self.group = group
        self.payload_group = payload_group or group  # a device group moves payloads where one is given
        self.header_tag = header_tag
        self.payload_tag = payload_tag
        self.staged_tag = staged_tag  # gloo only: each header's receive goes out with a staged receive here
        self.staged_size = STAGED_MIN_BYTES  # the next staged receive's size (wire.staged_bytes)
        self.alloc = alloc  # where staging buffers come from (the pool reuses them, see buffers.py)
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
        # Pool callers blocked waiting for this stream's items (the pool counts them, under `cond`): while there are
        # any, a landed message whose only wait left is its staged payload goes to them (`take_handoff`) instead of
        # being finished on this stream's thread, so the caller wakes once, when the bytes are in, not a second time
        # when this thread has delivered them.
        self.waiters = 0
        self._handoff: deque[tuple[list[dist.Work], list[LandedItem], tuple[torch.Tensor, torch.Tensor] | None]] = deque()
        # landed batches, in order: (the receives to wait, each item's context and view of the payload, and for a
        # small staged payload the (staging buffer, own buffer) pair its bytes are copied between)
        self._landed: deque[tuple[list[dist.Work], list[LandedItem], tuple[torch.Tensor, torch.Tensor] | None]] = deque()
        # the next header's receive once posted, with its staged receive (buffer, work) on a staged channel
        self._header_posted: tuple[torch.Tensor, dist.Work, tuple[torch.Tensor, list[dist.Work]] | None] | None = None
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
        self.wake.notify_all()

    def close(self) -> None:
        """Stop after the current message (call with `cond` held)."""
        self.closed = True
        self.cond.notify_all()
        self.wake.notify_all()

    @property
    def idle(self) -> bool:
        return self.received >= self.wanted

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    def _post_header(self) -> tuple[torch.Tensor, dist.Work, tuple[torch.Tensor, list[dist.Work]] | None]:
        """Post the receive of the next header, and on a staged channel its staged message's (call with `cond` held).

        Posted under the lock, as every pool post is: on backends that coalesce point-to-point calls per process
        group (NCCL) concurrent posts from several threads must not interleave."""
        header = torch.empty(self.header_len, dtype=torch.int64, device=self.wire_device)
        work = dist.irecv(header, src=self.peer, group=self.group, tag=self.header_tag)
        if self.staged_tag is None:
            return header, work, None
        size = self.staged_size
        buffer = torch.empty(size, dtype=torch.uint8) if self.alloc is None else self.alloc(size)
        chunk = size // staged_chunks(size)
        return header, work, (buffer, [dist.irecv(buffer[at:at + chunk], src=self.peer, group=self.group,
                                                  tag=self.staged_tag) for at in range(0, size, chunk)])

    def _next_header(self) -> bool:
        with self.cond:
            if self._header_posted is None:
                while self.announced >= self.wanted and not self.closed:
                    self.wake.wait()
                if self.closed:
                    return False
                self._header_posted = self._post_header()
            header, work, staged = self._header_posted
        work.wait()  # every work is waited exactly once: a second wait on a gloo work blocks
        items, buffer = self.land(header, None if staged is None else staged[0])
        waits: list[dist.Work] = []  # the receives this message's payload needs, in the payload thread
        copy: tuple[torch.Tensor, torch.Tensor] | None = None
        if staged is not None:
            staging, staged_works = staged
            if buffer is not None and travels_staged(buffer.numel(), staging.numel()):
                waits += staged_works
                if buffer.data_ptr() != staging.data_ptr():  # a small payload: copied out into its own buffer
                    copy = (staging, buffer)
            elif buffer is None:  # the staged chunks are empty and sent with the header: here or nearly
                for staged_work in staged_works:
                    staged_work.wait()
            else:  # a payload over the staged size: the empty staged chunks, then the payload on its own tag
                waits += staged_works
        with self.cond:
            self._header_posted = None
            self.announced += len(items)
            self.messages += 1
            if staged is not None:  # before the next header's receive is posted: it is sized by this payload
                self.staged_size = staged_bytes(0 if buffer is None else buffer.numel())
            # Delivered on this thread when nothing is ahead of it and nothing is left to receive but the staged
            # message (posted with the header, its bytes right behind it on the wire) or nothing at all (credits,
            # empty items): that spares a hand-off to the payload thread, a wake-up per message that costs more
            # than a small batch's bytes on a busy host. The next header's receive goes out first.
            deliver_now = not self._landed and not self._handoff and (
                buffer is None or bool(waits) and not self._needs_payload_tag(buffer, staged))
            if deliver_now and self.announced < self.wanted and not self.closed:
                self._header_posted = self._post_header()
            handed = deliver_now and bool(waits) and self.waiters > 0
            if handed:
                self._handoff.append((waits, items, copy))
                self.cond.notify_all()
        if deliver_now and not handed:
            self._finish(waits, items, copy)
        if deliver_now:
            return True
        with self.cond:
            # The next header's receive goes out before this batch's payload receive. Transports that move a
            # message only once both ends have posted it (gloo) then send the small next header ahead of this
            # payload, so the next payload's receive is posted while this one is still on the wire and the link
            # never idles for a round trip between payloads (measured with `bench pool`: without it, 4 MiB items
            # ran at about half of raw isend/irecv).
            if self.announced < self.wanted and not self.closed:
                self._header_posted = self._post_header()
            if self._needs_payload_tag(buffer, staged):
                assert self.payload_tag is not None, "a payload was announced on a header-only channel"
                waits.append(dist.irecv(buffer, src=self.peer, group=self.payload_group, tag=self.payload_tag))
            self._landed.append((waits, items, copy))
            self.wake.notify_all()
        return True

    def _next_payload(self) -> bool:
        with self.cond:
            while not self._landed and not self.closed:
                self.wake.wait()
            if self.closed:
                return False
            waits, items, copy = self._landed.popleft()
        self._finish(waits, items, copy)
        return True

    def take_handoff(self) -> tuple[list[dist.Work], list[LandedItem], tuple[torch.Tensor, torch.Tensor] | None] | None:
        """The oldest landed message handed to blocked callers, for one of them to finish (call with `cond` held)."""
        return self._handoff.popleft() if self._handoff else None

    def finish_handed(self, handed: tuple[list[dist.Work], list[LandedItem],
                                          tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Finish a message taken with `take_handoff` on the caller's thread (without `cond`); a failure is recorded
        as this stream's error, which the caller's wait loop raises."""
        try:
            self._finish(*handed)
        except BaseException as exc:  # noqa: BLE001 - reported through the stream, as its own thread would
            with self.cond:
                self.error = self.error or exc
                self.cond.notify_all()

    def return_handoffs(self) -> None:
        """The last blocked caller left (call with `cond` held): messages still handed go back to the payload
        thread, ahead of anything it has, so they are finished and in order."""
        if self._handoff:
            self._landed.extendleft(reversed(self._handoff))
            self._handoff.clear()
            self.wake.notify_all()

    @staticmethod
    def _needs_payload_tag(buffer: torch.Tensor | None, staged: tuple[torch.Tensor, list[dist.Work]] | None) -> bool:
        """Whether a message's payload comes on the payload tag (not staged, or over the staged size)."""
        return buffer is not None and (staged is None or not travels_staged(buffer.numel(), staged[0].numel()))

    def _finish(self, waits: list[dist.Work], items: list[LandedItem],
                copy: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Wait for a landed message's receives, copy a small staged payload out, and deliver its items."""
        for work in waits:  # the batch's payload transfer (and on a staged channel its staged message), once each
            work.wait()
        if copy is not None:  # the staging buffer is free again once this copy's views are gone
            staging, own = copy
            own.copy_(staging[:own.numel()])
        self._deliver_all(items)

    def _deliver_all(self, items: list[LandedItem]) -> None:
        """Hand a message's items to the pool (one call for the whole message), then count them as received."""
        self.deliver(items)
        with self.cond:
            self.received += len(items)
            self.cond.notify_all()

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
    """Sends the items queued for one peer on one channel, coalescing those that queue up behind the sends.

    `push` (with `cond` held) queues an item and returns. A posting thread sends what is queued as one message
    (one header for up to `max_batch_items` items and `max_batch_bytes` of payload, a larger item alone; the
    batch's payloads go as one transfer posted with the header, copied into one buffer when there are several,
    `wire.pack_payloads`) while fewer than `window` messages are in flight; a reaping thread waits for the oldest message's sends to complete. Items
    pushed while the window is free leave at once; items pushed while it is full leave together in the next
    message, so per-item costs shrink exactly when items are small and many, and no item ever waits for a timer
    or for a batch to fill. Two messages in flight keep the link busy while one of them is being reaped.
    """

    def __init__(self, *, cond: threading.Condition, lock: threading.RLock, peer: int,
                 group: dist.ProcessGroup | None, channel: int,
                 header_tag: int, payload_tag: int | None, max_batch_items: int, max_batch_bytes: int,
                 on_sent: Callable[[list[WireHeader]], None], name: str, window: int = 2,
                 wire_device: torch.device = torch.device("cpu"),
                 payload_group: dist.ProcessGroup | None = None, staged_tag: int | None = None) -> None:
        self.cond = cond
        self.wake = threading.Condition(lock)  # this outbox's threads wait here (see InboundStream)
        self.staged_tag = staged_tag  # gloo only: every message also sends one staged message (wire.staged_bytes)
        self.staged_size = STAGED_MIN_BYTES  # the size of the receive the peer posts for the next staged message
        self.peer = peer
        self.group = group
        self.payload_group = payload_group or group
        self.channel = channel
        self.on_sent = on_sent
        self.header_tag = header_tag
        self.payload_tag = payload_tag
        self.max_batch_items = max_batch_items
        self.max_batch_bytes = max_batch_bytes
        self.window = window
        self.wire_device = wire_device
        self.pushed = 0     # items queued so far
        self.sent = 0       # items whose message completed
        self.messages = 0   # messages completed
        self.closed = False
        self.error: BaseException | None = None
        # queued messages-to-be: (items, their tensors or, when `packed`, the batch's one payload, packed)
        self._queue: deque[tuple[list[WireHeader], list[torch.Tensor | None] | torch.Tensor | None, bool]] = deque()
        self._packing: list[WireHeader] = []  # the batch being packed (taken off the queue, not yet posted)
        # posted messages, oldest first: (items, works, buffers kept alive until the works complete)
        self._in_flight: deque[tuple[list[WireHeader], list[dist.Work], list[torch.Tensor]]] = deque()
        self._threads = [threading.Thread(target=run_guarded, args=(self, self._post_next), name=f"{name}-post",
                                          daemon=True),
                         threading.Thread(target=run_guarded, args=(self, self._reap_next), name=f"{name}-reap",
                                          daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def push(self, header: WireHeader, tensor: torch.Tensor | None) -> None:
        """Queue one item (call with `cond` held)."""
        if self.error is not None:
            raise self.error
        self._queue.append(([header], [tensor], False))
        self.pushed += 1
        self.wake.notify_all()

    def push_batch(self, items: list[WireHeader], payload: torch.Tensor | None, *, inline: bool = True) -> None:
        """Send a batch packed by the caller (`put_many`, a microbatch's credits): its items and their one payload
        leave as one message, never merged with other items (call with `cond` held).

        `inline`: posted here, on the caller's thread, when nothing is queued ahead of it and the window has room:
        a hand-off to the posting thread waits for that thread to get the interpreter lock back from a caller that
        is still running Python, which measured longer than moving a 4 MiB batch's first bytes. Otherwise queued."""
        if self.error is not None:
            raise self.error
        self.pushed += len(items)
        if inline and not self._queue and not self._packing and len(self._in_flight) < self.window:
            self._post(items, payload)
            return
        self._queue.append((items, payload, True))
        self.wake.notify_all()

    def close(self) -> None:
        """Stop once nothing is queued or in flight (call with `cond` held)."""
        self.closed = True
        self.cond.notify_all()
        self.wake.notify_all()

    @property
    def idle(self) -> bool:
        return self.sent >= self.pushed

    def pending(self) -> list[WireHeader]:
        """Items not yet received by the peer: in flight first, then queued (call with `cond` held)."""
        return [*(h for items, _, _ in self._in_flight for h in items), *self._packing,
                *(h for items, _, _ in self._queue for h in items)]

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    def _post_next(self) -> bool:
        with self.cond:
            while (not self._queue or len(self._in_flight) >= self.window) and not self.closed:
                self.wake.wait()
            if not self._queue:
                return False
            items, tensors, packed = self._queue.popleft()
            if not packed:  # single items queued behind the sends leave together
                tensors = list(tensors)
                size = _payload_bytes(items[0])
                while (self._queue and not self._queue[0][2] and len(items) < self.max_batch_items
                       and size + _payload_bytes(self._queue[0][0][0]) <= self.max_batch_bytes):
                    more, more_tensors, _ = self._queue.popleft()
                    size += _payload_bytes(more[0])
                    items = [*items, *more]
                    tensors += more_tensors
            self._packing = items
        # Packed off the lock: copying several payloads into one buffer must not hold up put()/get().
        payload = tensors if packed else pack_payloads(items, tensors)
        with self.cond:
            self._packing = []
            self._post(items, payload)
        return True

    def _post(self, items: list[WireHeader], payload: torch.Tensor | None) -> None:
        """Post one message's sends (call with `cond` held: see InboundStream._post_header); posting never blocks."""
        header = encode_header(items).to(self.wire_device)
        if self.staged_tag is not None:  # gloo: the staged chunks hold the payload if it fits, else are empty
            nbytes = 0 if payload is None else payload.numel() * payload.element_size()
            staged = payload is not None and travels_staged(nbytes, self.staged_size)
            chunk = self.staged_size // staged_chunks(self.staged_size)
            chunks = [payload[at:at + chunk] if staged and at < nbytes else _NO_BYTES  # type: ignore[index]
                      for at in range(0, self.staged_size, chunk)]
            self.staged_size = staged_bytes(nbytes)
            # Plain isends: gloo has nothing to coalesce, and a batch_isend_irecv of P2POps costs 1.3-1.5x as much
            # to post (measured, 2 messages: 55 vs 41 us on torch 2.13, 128 vs 83 us on 2.7).
            works = [dist.isend(header, self.peer, group=self.group, tag=self.header_tag)]
            works += [dist.isend(c, self.peer, group=self.group, tag=self.staged_tag) for c in chunks]
            if payload is not None and not staged:
                works.append(dist.isend(payload, self.peer, group=self.payload_group, tag=self.payload_tag))
        elif payload is None:  # header only (credits, empty items): no batch to build
            works = [dist.isend(header, self.peer, group=self.group, tag=self.header_tag)]
        else:
            header_op = dist.P2POp(dist.isend, header, self.peer, self.group, self.header_tag)
            payload_op = dist.P2POp(dist.isend, payload, self.peer, self.payload_group, self.payload_tag)
            if self.payload_group is self.group:
                works = list(dist.batch_isend_irecv([header_op, payload_op]))
            else:  # header on the gloo group, payload on the device group: one batch per backend
                works = list(dist.batch_isend_irecv([header_op])) + list(dist.batch_isend_irecv([payload_op]))
        self._in_flight.append((items, works, [header] if payload is None else [header, payload]))
        self.wake.notify_all()

    def _reap_next(self) -> bool:
        with self.cond:
            while not self._in_flight and not (self.closed and not self._queue):
                self.wake.wait()
            if not self._in_flight:
                return False
            items, works, _ = self._in_flight[0]
        for work in works:  # waited here, once
            work.wait()
        with self.cond:
            self._in_flight.popleft()
            self.sent += len(items)
            self.messages += 1
            self.on_sent(items)
            self.cond.notify_all()
            self.wake.notify_all()
        return True


_NO_BYTES = torch.empty(0, dtype=torch.uint8)  # the staged message of a batch whose payload is absent or too large


def _payload_bytes(item: WireHeader) -> int:
    return item.nbytes if has_payload(item) else 0  # a credit's nbytes are what it frees, not what it carries


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
