"""The pool's planned mode: every transfer of a step known in advance, issued in one global order per direction.

The pool has two modes on one wire (`wire.py`: the int64 header, the tags, the error types of `errors.py`):

- **discovered** (`EmbeddingPool`): a consumer learns what arrives from each header; receiving threads per peer post
  payload receives as headers land, senders per peer coalesce what queues up, credits bound what is in flight;
- **planned** (`PlannedTransport`, here): every rank knows the whole step plan (which producer sends each item to
  which consumer, in which order, of which size), so nothing is discovered at run time and the device operations
  can be issued in an order that in-order device streams can never deadlock on. The MindSpeed-MM flow job moves
  its embeddings and gradients this way.

Why the discovered mode cannot carry the flow job's payloads. Device backends (HCCL, NCCL) run the point-to-point
operations of one communicator in issue order on one stream, and a send completes only when the peer's stream
reaches the matching receive. The discovered mode issues its device operations in the order its threads get to
them: a consumer posts a producer's payload receive when that producer's header lands, a producer posts per
consumer from that consumer's sender. Where a communicator's point-to-point operations share one stream (HCCL
with `P2P_HCCL_BUFFSIZE=0`), two consumers whose headers landed in opposite producer orders wait on each other
in a cycle; `tests/test_pool_device_order.py` makes that interleaving on the strict emulated NPU and the pool
times out on every rank, while this mode moves the same plan. Two rules make this mode safe:

- **one communicator per direction**: embeddings (producer -> consumer) travel on `embedding_group`, gradients
  (consumer -> producer) on `gradient_group`. On one shared communicator a producer's posted gradient receives
  would sit in front of its own embedding sends, and the consumer could never compute those gradients;
- **one global order per direction**: every rank issues its operations of a step in the order of one total
  order over the step's items (the flow job's `schedule.embedding_order` / `schedule.gradient_order`), restricted
  to its own items. Then the item earliest in that order is always at the head of both its ends' streams, so
  there is no cycle of waits, whatever the number of producers and consumers.

Each receive is posted as its own operation (`isend`/`irecv`), never as one `batch_isend_irecv`: backends that
coalesce a batch (NCCL, and HCCL through torch_npu's own `batch_isend_irecv`) return ONE work for the whole batch,
so waiting on "the work of item k" would wait on nothing, or on everything. A consumer posts every item of a step
at the step's start; each lands as soon as it is sent, while the consumer works on earlier ones (prefetch), and
`receive()` waits only for the item it needs.

Payloads go over the device groups in their own dtype and shape ([tokens, hidden]), each preceded by a one-item
pool header (`wire.encode_header`, `PLANNED_HEADER_LEN`) over the gloo `header_group` on the pool's planned tags:
the receiver checks it against its plan (sample, step, dtype, shape) before using the payload, so ranks whose plans
diverged stop with `PoolProtocolError` naming both ranks and both items instead of training on another sample's
embedding. The header is also what the deadline watches (`PoolTimeout`): it is a host message, so waiting for it
with a timeout costs no device synchronisation; the payload's work is then waited on the device stream only. A
transfer that fails raises `PoolPeerError`.

Memory is bounded by the plan (this mode needs no credits): a consumer holds the receive buffers of one step's
items (what it consumes anyway), a producer keeps each sent tensor until its send completes (the flow job's frozen
encoder waits, with `wait_sent`, once `flow.encoder_inflight` groups are in flight).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.pool.errors import PoolPeerError, PoolProtocolError, PoolTimeout
from mindspeed_flow.pool.transport import wait_work
from mindspeed_flow.pool.wire import (CHANNEL_EMBEDDING, CHANNEL_GRAD, CHANNEL_NAMES, CHANNEL_PIXELS, TAGS, WireHeader,
                                      decode_header, encode_header, header_len, item_header)

PLANNED_HEADER_LEN = header_len(1)  # one item per message: 18 int64 (a discovered-mode header holds 16 items)
# (header tag, payload tag) per channel: payload tags matter on gloo only (device backends match by order)
_TAGS = {CHANNEL_EMBEDDING: (TAGS.embedding_planned_header, TAGS.embedding_planned),
         CHANNEL_GRAD: (TAGS.grad_planned_header, TAGS.grad_planned),
         CHANNEL_PIXELS: (TAGS.pixels_planned_header, TAGS.pixels_planned)}


@dataclass(frozen=True)
class PlannedItem:
    """One planned transfer: `tokens` rows of the hidden size, for `sample_id` of `step`, from or to `peer`."""

    peer: int
    step: int
    sample_id: int
    tokens: int


@dataclass
class _Pending:
    item: PlannedItem
    channel: int
    header: torch.Tensor
    payload: torch.Tensor
    header_work: Any
    payload_work: Any


class PlannedTransport:
    """One rank's side of planned transfers (a producer, a consumer, or both); `step` counts from 0 and messages
    name Megatron's iteration (step + 1)."""

    def __init__(self, *, rank: int, embedding_group: Any, gradient_group: Any, header_group: Any,
                 device: torch.device, timeout_s: float, dtype: torch.dtype = torch.bfloat16,
                 describe: Callable[[int], str] = lambda r: f"rank {r}") -> None:
        self.rank = rank
        # Pixels (the FSDP2 flow job) travel the gradients' direction, so they share its communicator and order.
        self.groups = {CHANNEL_EMBEDDING: embedding_group, CHANNEL_GRAD: gradient_group, CHANNEL_PIXELS: gradient_group}
        self.header_group = header_group
        self.device = device
        self.timeout_s = timeout_s
        self.dtype = dtype
        self.describe = describe
        self._recv: dict[tuple[int, int, int, int], _Pending] = {}  # (peer, channel, step, sample) -> posted receive
        self._sends: list[_Pending] = []
        self.bytes_sent = {CHANNEL_EMBEDDING: 0, CHANNEL_GRAD: 0, CHANNEL_PIXELS: 0}
        # payloads taken by receive() (for the metrics)
        self.bytes_received = {CHANNEL_EMBEDDING: 0, CHANNEL_GRAD: 0, CHANNEL_PIXELS: 0}

    def _what(self, channel: int, item: PlannedItem, direction: str) -> str:
        return (f"the {CHANNEL_NAMES[channel]} of sample {item.sample_id} (iteration {item.step + 1}) {direction} "
                f"{self.describe(item.peer)}")

    # ------------------------------------------------------------------ posting

    def post_receives(self, channel: int, items: Sequence[PlannedItem], hidden: int) -> None:
        """Post one receive per item, in the given order (the plan's global order restricted to this rank)."""
        header_tag, payload_tag = _TAGS[channel]
        for item in items:
            key = (item.peer, channel, item.step, item.sample_id)
            if key in self._recv:
                raise ValueError(f"{self.describe(self.rank)}: {self._what(channel, item, 'from')} is already "
                                 "expected")
            header = torch.empty(PLANNED_HEADER_LEN, dtype=torch.int64)
            payload = torch.empty((item.tokens, hidden), dtype=self.dtype, device=self.device)
            try:
                header_work = dist.irecv(header, item.peer, group=self.header_group, tag=header_tag)
                payload_work = dist.irecv(payload, item.peer, group=self.groups[channel], tag=payload_tag)
            except RuntimeError as exc:
                raise PoolPeerError(f"{self.describe(self.rank)}: posting the receive of "
                                    f"{self._what(channel, item, 'from')} failed: {exc}") from exc
            self._recv[key] = _Pending(item, channel, header, payload, header_work, payload_work)

    def send(self, channel: int, peer: int, step: int, sample_id: int, tensor: torch.Tensor) -> None:
        """Send one item (its header over gloo, the payload over the device backend) without waiting."""
        payload = tensor.detach().to(dtype=self.dtype).reshape(-1, tensor.shape[-1]).contiguous()
        item = PlannedItem(peer, step, sample_id, int(payload.shape[0]))
        header = encode_header([item_header(channel, sample_id, step, payload)], PLANNED_HEADER_LEN)
        header_tag, payload_tag = _TAGS[channel]
        try:
            header_work = dist.isend(header, peer, group=self.header_group, tag=header_tag)
            payload_work = dist.isend(payload, peer, group=self.groups[channel], tag=payload_tag)
        except RuntimeError as exc:
            raise PoolPeerError(f"{self.describe(self.rank)}: sending {self._what(channel, item, 'to')} failed: "
                                f"{exc}") from exc
        self._sends.append(_Pending(item, channel, header, payload, header_work, payload_work))
        self.bytes_sent[channel] += payload.numel() * payload.element_size()
        self._reap(block=False)

    # ------------------------------------------------------------------ receiving

    def receive(self, channel: int, peer: int, step: int, sample_id: int) -> torch.Tensor:
        """Wait for a posted item; check its header against the plan; return the payload ([tokens, hidden])."""
        key = (peer, channel, step, sample_id)
        pending = self._recv.pop(key, None)
        what = self._what(channel, PlannedItem(peer, step, sample_id, 0), "from")
        me = self.describe(self.rank)
        if pending is None:
            raise PoolProtocolError(f"{me}: {what} was never expected (plans differ between ranks?)")
        deadline = time.monotonic() + self.timeout_s
        wait_work(pending.header_work, deadline,
                  on_timeout=lambda: PoolTimeout(f"{me} waited {self.timeout_s:.0f} s for {what}: "
                                                 f"{self.describe(peer)} is hung or far behind"),
                  on_failure=lambda exc: PoolPeerError(f"{me}: the transfer of {what} failed ({exc}); "
                                                       f"{self.describe(peer)} probably died"))
        expected = item_header(channel, sample_id, step, pending.payload)
        self._check(decode_header(pending.header, expected_channel=channel, peer=peer), expected, what, peer)
        # The header proves the peer posted the payload's send. Wait on the payload without a timeout: device
        # backends then only order the current stream after the transfer (a timeout would make NCCL/HCCL block
        # the host until it completes); gloo returns once the bytes are in.
        try:
            pending.payload_work.wait()
        except RuntimeError as exc:
            raise PoolPeerError(f"{me}: the transfer of {what} failed ({exc})") from exc
        self.bytes_received[channel] += pending.payload.numel() * pending.payload.element_size()
        return pending.payload

    def _check(self, got: list[WireHeader], expected: WireHeader, what: str, peer: int) -> None:
        """The landed header must be the planned item's: same sample, step, dtype and shape."""
        header = got[0] if len(got) == 1 else None
        if header == expected:
            return
        numel = expected.nbytes // expected.dtype.itemsize
        sent = ("a message of several items" if header is None else
                f"{CHANNEL_NAMES[header.channel]} of sample {header.sample_id} (iteration {header.step + 1}, "
                f"{list(header.shape)} {str(header.dtype).removeprefix('torch.')})")
        raise PoolProtocolError(
            f"{self.describe(self.rank)} expected {what} ({numel} elements, {list(expected.shape)}) but "
            f"{self.describe(peer)} sent {sent}: the ranks' step plans differ (same data.json, sampler seed and "
            "mindspeed-flow version on every rank?)")

    def flush(self) -> None:
        """Wait until every send of this rank has been received."""
        self._reap(block=True)

    def wait_sent(self, channel: int, step: int, sample_ids: Sequence[int]) -> None:
        """Wait until this rank's sends of these samples have been received (the encoder's in-flight bound)."""
        ids = set(sample_ids)
        self._reap(block=True, only=lambda s: s.channel == channel and s.item.step == step and s.item.sample_id in ids)

    # ------------------------------------------------------------------ internals

    def _reap(self, block: bool, only: Callable[[_Pending], bool] = lambda s: True) -> None:
        keep = []
        for s in self._sends:
            works = (s.header_work, s.payload_work)
            if block and not only(s):
                keep.append(s)
                continue
            if block:
                deadline = time.monotonic() + self.timeout_s
                what = self._what(s.channel, s.item, "to")
                for work in works:
                    wait_work(work, deadline,
                              on_timeout=lambda: PoolTimeout(
                                  f"{self.describe(self.rank)} waited {self.timeout_s:.0f} s for "
                                  f"{self.describe(s.item.peer)} to receive {what}"),
                              on_failure=lambda exc: PoolPeerError(
                                  f"{self.describe(self.rank)}: sending {what} failed ({exc})"))
            elif not all(w.is_completed() for w in works):
                keep.append(s)
                continue
            else:
                for w in works:
                    w.wait()  # a completed gloo work must still be waited once
        self._sends = keep
