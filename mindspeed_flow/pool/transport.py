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
with an error, which it records and exits on.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

# Called with the received header tensor; returns the payload buffer to receive into (None: no payload) and a
# context handed on to `Deliver`. Runs on the stream thread, outside the pool lock.
Land = Callable[[torch.Tensor], tuple[torch.Tensor | None, Any]]
Deliver = Callable[[Any, torch.Tensor | None], None]


class InboundStream(threading.Thread):
    """Receives the messages of one peer on one channel, in order, as many as the pool has asked for.

    The pool calls `request(n)` (holding `cond`) when it learns that n more messages will come (an expected
    embedding, a credit owed for a sent item, a gradient owed for it); the thread posts a receive only for
    messages it knows will come, so nothing is left posted when the plan is exhausted.
    """

    def __init__(self, *, cond: threading.Condition, peer: int, group: dist.ProcessGroup | None,
                 header_tag: int, payload_tag: int | None, header_len: int, land: Land, deliver: Deliver,
                 name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.cond = cond
        self.peer = peer
        self.group = group
        self.header_tag = header_tag
        self.payload_tag = payload_tag
        self.header_len = header_len
        self.land = land
        self.deliver = deliver
        self.wanted = 0
        self.received = 0
        self.closed = False
        self.error: BaseException | None = None

    def request(self, n: int = 1) -> None:
        """Ask for n more messages (call with `cond` held)."""
        self.wanted += n
        self.cond.notify_all()

    def close(self) -> None:
        """Stop after the current message (call with `cond` held)."""
        self.closed = True
        self.cond.notify_all()

    @property
    def idle(self) -> bool:
        return self.received >= self.wanted

    def _next_message(self) -> bool:
        with self.cond:
            while self.received >= self.wanted and not self.closed:
                self.cond.wait()
            if self.closed:
                return False
        header = torch.empty(self.header_len, dtype=torch.int64)
        self._post_recv(header, self.header_tag).wait()
        buffer, context = self.land(header)
        if buffer is not None and buffer.numel() > 0:
            assert self.payload_tag is not None, "a payload was announced on a header-only channel"
            self._post_recv(buffer, self.payload_tag).wait()
        self.deliver(context, buffer)
        with self.cond:
            self.received += 1
            self.cond.notify_all()
        return True

    def _post_recv(self, buffer: torch.Tensor, tag: int) -> dist.Work:
        # Posted under the pool's lock, as every pool send is: posting never blocks, and on backends that
        # coalesce point-to-point calls per process group (NCCL) concurrent posts from threads must not interleave.
        with self.cond:
            return dist.irecv(buffer, src=self.peer, group=self.group, tag=tag)

    def run(self) -> None:
        try:
            while self._next_message():
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits on this stream
            with self.cond:
                self.error = exc
                self.cond.notify_all()


def send_message(header: torch.Tensor, payload: torch.Tensor | None, *, peer: int,
                 group: dist.ProcessGroup | None, header_tag: int, payload_tag: int | None,
                 on_failure: Callable[[BaseException], BaseException]) -> list[dist.Work]:
    """Send a header and its payload (if any) as one batch; returns the works to wait on.

    Posting a send to a peer whose connection is gone raises at once; `on_failure` turns that into the caller's
    error, which names the peer and the item.
    """
    ops = [dist.P2POp(dist.isend, header, peer, group, header_tag)]
    if payload is not None and payload.numel() > 0:
        ops.append(dist.P2POp(dist.isend, payload, peer, group, payload_tag))
    try:
        return list(dist.batch_isend_irecv(ops))
    except RuntimeError as exc:
        raise on_failure(exc) from exc


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
