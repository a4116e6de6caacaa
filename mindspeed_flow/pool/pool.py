"""`EmbeddingPool`: embeddings from encoder ranks to backbone ranks, gradients back, bounded by credits.

Roles. A producer (encoder rank) `put`s one embedding per sample for the consumer that the step plan names and
later `wait_grad`s its gradient; a consumer (backbone first-stage rank) `expect`s the items of each producer in
the order that producer will send them, `get`s them in any order and `return_grad`s d(loss)/d(embedding). A rank
can be both. Ranks are global ranks; the pool works on the world group or on the group it is given, and holds
no process-group globals.

Backpressure. A producer counts the bytes it has sent and not yet seen consumed ("in flight"). `put` blocks
while that count plus the new item would exceed `capacity_bytes`; each `get` on the consumer sends a credit back
that frees the item's bytes. An item larger than the capacity goes through when nothing else is in flight, so
the pool never deadlocks on one big embedding. With a frozen encoder (`return_grads=False`) there is no gradient
channel and the producer runs ahead into later steps bounded only by these credits.

Tiers. A consumer keeps received embeddings on `device` up to `capacity_bytes`; an embedding larger than
`host_tier_bytes`, or one that would push device occupancy past the capacity, lands in host memory and moves to
the device when `get` takes it. (On CPU both tiers are host memory; the placement and the counters are real.)

Transport: see `transport.py` (one receiving thread per peer and channel; deadlines on the caller's side) and
`wire.py` (fixed int64 header, then the payload bytes, distinct tags per channel). Every blocking call raises
`PoolTimeout` after `timeout_s`, naming this rank, the peer and the awaited item, and `PoolPeerError` when the
transport to the peer fails (a dead peer fails within milliseconds on gloo).

Planned items. Where both sides derive an item's shape and dtype from the same step plan, the consumer passes them
to `expect(..., specs=...)` and the producer puts with `planned=True`: the consumer posts the item's receives at
once (its one-item header and its bytes, into a buffer of the planned size) and the producer sends both the moment
it puts them, on tags of their own. No header thread, no round trip, no batch copy: measured with `bench pool`,
those per-message costs (thread wake-ups and Python on both sides, a header landing before a payload receive
could be posted, a copy into a fresh batch buffer) cost more than the transfer of a 64-token embedding. One
thread per producer waits for the planned receives in send order, checks each header against the plan (item,
shape, dtype) and only then holds the item for get(); a mismatch raises `PoolProtocolError` naming the item.
Receives posted ahead are bounded by `capacity_bytes` (bytes posted and not yet taken by get(); get() of a later
item posts what it needs). Planned items have their own order, apart from header-path items of the same producer.
They need tag matching (gloo payloads): with `data_groups` both calls fall back to the header path, where the
header is checked against the specs. The sizes must really agree: gloo aborts the process on a message larger
than the receive posted for it, so the plan, not the tensor, must be the source of both sides' specs.

Groups. Headers and credits always travel on `group`, a gloo group (tags keep channels apart; `Topology` builds
it). Payloads travel on `data_groups` when given: two groups of the job's device backend (NCCL/HCCL), one per
direction (embeddings producer->consumer, gradients consumer->producer), because device backends match
point-to-point messages by order, not by tag, and run a pair's sends and receives on one stream, where
embeddings and gradients crossing in opposite directions could wait on each other. Payloads then go from device
memory to device memory (the device tier is device memory). Without `data_groups` (CPU jobs, or as a fallback)
payloads are staged through host memory on `group` and moved to `device` in `get`/`wait_grad`.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.pool.errors import PoolError, PoolPeerError, PoolProtocolError, PoolShapeError, PoolTimeout
from mindspeed_flow.pool.handle import EmbeddingHandle, Tier
from mindspeed_flow.pool.stats import PoolCounters, PoolStats
from mindspeed_flow.pool.transport import InboundStream, LandedItem, Outbox, wait_work
from mindspeed_flow.pool.wire import (CHANNEL_CREDIT, CHANNEL_EMBEDDING, CHANNEL_GRAD, CHANNEL_NAMES, DTYPE_CODES,
                                      HEADER_LEN, MAX_BATCH, MAX_NDIM, RECORD_LEN, TAGS, WireHeader, check_sendable,
                                      credit_header, decode_header, encode_header, from_bytes, item_header,
                                      slice_payloads, tensor_nbytes)
from mindspeed_flow.runtime.trace import traced

# (peer rank, sample_id, step): the pool's key for an item on one side of one producer/consumer pair.
ItemKey = tuple[int, int, int]
# A landed batch: each item's header, view of the payload and own receive (planned items), and the batch's buffer.
_Landed = tuple[list[LandedItem], torch.Tensor | None]
# What the consumer's plan says an item is: (shape, dtype).
Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass
class _Held:
    """Consumer side: an embedding received (or landing) and not yet taken by get()."""

    handle: EmbeddingHandle
    tensor: torch.Tensor | None = None  # None while the payload is still arriving
    landing_t: float = 0.0  # time.monotonic() when its header landed (the payload transfer starts)
    planned_bytes: int = 0  # bytes of its receive posted ahead (planned items), freed from the budget by get()


@dataclass
class _PlannedReceive:
    """Consumer side: a planned item's own receive, from posting (send order) to arrival (waited by get())."""

    key: tuple[int, int]
    spec: Spec
    nbytes: int
    buffer: torch.Tensor | None = None
    work: Optional[dist.Work] = None  # None for an empty item (no bytes travel)
    record: torch.Tensor | None = None  # the item's one-item header, checked against `spec` before hand-out
    record_work: Optional[dist.Work] = None
    posted: bool = False
    posted_t: float = 0.0  # time.monotonic() when its receive was posted
    waiting: bool = False  # a get() waits for its works (each is waited exactly once)

# Items queued behind a send share a message up to this much payload; a larger item goes alone. Large items gain
# nothing from sharing a header (their transfer dwarfs it) and, measured with `bench pool`, lose pipelining.
MAX_BATCH_BYTES = 4 << 20

# Outbound channels: (header tag, payload tag) and whether items carry a payload.
_OUT_TAGS = {CHANNEL_EMBEDDING: (TAGS.embedding_header, TAGS.embedding_payload),
             CHANNEL_GRAD: (TAGS.grad_header, TAGS.grad_payload),
             CHANNEL_CREDIT: (TAGS.credit, None)}


def _transport_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """gloo moves CPU tensors; device backends (nccl, hccl) move tensors on the pool's device."""
    backend = str(dist.get_backend(group))
    return torch.device("cpu") if backend == "gloo" or device.type == "cpu" else device


def _fmt_bytes(n: int) -> str:
    return f"{n} B" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


class EmbeddingPool:
    """Per-sample embedding transfer between producer and consumer ranks, with credits and a gradient path."""

    def __init__(self, *, rank: int, group: dist.ProcessGroup | None, capacity_bytes: int, timeout_s: float,
                 device: torch.device, host_tier_bytes: int | None = None, return_grads: bool = True,
                 max_batch_items: int = MAX_BATCH, max_batch_bytes: int = MAX_BATCH_BYTES,
                 data_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
                 receive_ahead: bool = True) -> None:
        """`receive_ahead`: receive expected embeddings in the background as soon as they are sent (prefetch:
        their transfer hides behind the consumer's compute); False receives an item only once get() asks for it
        (or for a later one of the same producer), the baseline that shows what prefetching hides.
        `max_batch_items` / `max_batch_bytes`: how many items and payload bytes one message may carry (items queued
        behind a send leave together; an item over `max_batch_bytes` goes alone)."""
        if not dist.is_initialized():
            raise RuntimeError("EmbeddingPool needs an initialized torch.distributed process group")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if host_tier_bytes is not None and host_tier_bytes < 0:
            raise ValueError(f"host_tier_bytes must be >= 0 or None, got {host_tier_bytes}")
        if not 1 <= max_batch_items <= MAX_BATCH:
            raise ValueError(f"max_batch_items must be in 1..{MAX_BATCH} (1: one item per message), got "
                             f"{max_batch_items}")
        if max_batch_bytes <= 0:
            raise ValueError(f"max_batch_bytes must be > 0 (an item larger than it travels alone), got "
                             f"{max_batch_bytes}")
        if rank != dist.get_rank():
            raise ValueError(f"rank={rank} but this process is global rank {dist.get_rank()}")
        members = (dist.get_process_group_ranks(group) if group is not None
                   else list(range(dist.get_world_size())))
        if rank not in members:
            raise ValueError(f"rank {rank} is not in the pool's process group (ranks {members})")
        self.rank = rank
        self.group = group
        self.members = frozenset(members)
        self.capacity_bytes = capacity_bytes
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.host_tier_bytes = host_tier_bytes
        self.return_grads = return_grads
        self.max_batch_items = max_batch_items
        self.max_batch_bytes = max_batch_bytes
        self.receive_ahead = receive_ahead
        self._get_blocked_since: float | None = None  # when the get() now waiting began to wait
        self._last_landed: dict[int, float] = {}  # per producer: when its previous payload landed
        self._unrequested: dict[int, deque[tuple[int, int]]] = {}  # receive_ahead=False: expected, not asked for
        self._wire_device = _transport_device(group, self.device)
        # Payloads: on the device groups in device memory, else staged like the headers.
        self.data_groups = data_groups
        self._payload_groups = {CHANNEL_EMBEDDING: data_groups[0], CHANNEL_GRAD: data_groups[1]} if data_groups else {}
        self._payload_device = _transport_device(data_groups[0], self.device) if data_groups else self._wire_device
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the pool's callers wait here; each stream has its own
        self._counters = PoolCounters(capacity_bytes)
        self._closed = False
        # producer side
        self._sent: dict[ItemKey, EmbeddingHandle] = {}  # (consumer, sample, step) -> awaiting its credit
        self._grads_owed: set[ItemKey] = set()           # (consumer, sample, step) -> gradient not yet arrived
        self._grads: dict[ItemKey, torch.Tensor] = {}    # arrived, not yet taken by wait_grad
        self._credit_streams: dict[int, InboundStream] = {}
        self._grad_streams: dict[int, InboundStream] = {}
        # consumer side
        self._plans: dict[int, deque[tuple[int, int]]] = {}  # producer -> (sample, step) still to arrive, in order
        self._planned: set[ItemKey] = set()               # (producer, sample, step) expected, not yet arrived
        self._held: dict[ItemKey, _Held] = {}             # arrived or landing, not yet taken by get()
        self._early: dict[int, deque[tuple[int, int]]] = {}  # producer -> arrived in a batch before expected
        self._embedding_streams: dict[int, InboundStream] = {}
        self._specs: dict[ItemKey, Spec] = {}  # planned (shape, dtype) of expected items, checked when they land
        # Planned items take the planned route only where payloads are matched by tag (gloo), see the module doc.
        self._planned_route = data_groups is None
        # Planned receives per producer not yet arrived, in send order (posted first), and by key until arrival.
        self._rx_arrival: dict[int, deque[_PlannedReceive]] = {}
        self._rx_by_key: dict[ItemKey, _PlannedReceive] = {}
        self._planned_rx_bytes = 0  # bytes of planned receives posted and not yet taken by get()
        self._planned_failed: dict[int, BaseException] = {}  # producer -> why waiting for its planned items failed
        # producer side: planned sends not yet waited, (works, tensors kept alive until then); waited when the
        # item's credit lands (the consumer has it, so they are complete) or by flush(): no thread of their own
        self._planned_sends: dict[ItemKey, tuple[list[dist.Work], list[torch.Tensor]]] = {}
        # both sides: one coalescing sender per (peer, channel)
        self._outboxes: dict[tuple[int, int], Outbox] = {}

    # ------------------------------------------------------------------ producer side

    @traced("pool.put")
    def put(self, tensor: torch.Tensor, *, sample_id: int, step: int, consumer: int,
            planned: bool = False) -> EmbeddingHandle:
        """Send `tensor` to `consumer` without waiting for it to arrive; block while over capacity.

        On gloo a contiguous CPU tensor is sent without a copy: do not modify it in place until the consumer has
        taken it (`inflight_handles()` no longer lists it). `planned`: the consumer expects this item with its
        shape and dtype (`expect(..., specs=...)`), so its bytes leave now, into the receive posted for them.
        """
        what = f"sample {sample_id} (step {step})"
        self._check_peer(consumer, "consumer")
        check_sendable(tensor, f"put of {what} for consumer rank {consumer}")
        key = (consumer, sample_id, step)
        nbytes = tensor_nbytes(tuple(tensor.shape), tensor.dtype)
        handle = EmbeddingHandle(sample_id, step, self.rank, consumer, tuple(tensor.shape), tensor.dtype, nbytes,
                                 "device" if tensor.device == self.device else "host")
        planned = planned and self._planned_route
        header = item_header(CHANNEL_EMBEDDING, sample_id, step, tensor, planned=planned)
        payload = tensor.detach().to(self._payload_device)
        start = time.monotonic()
        deadline = start + self.timeout_s
        with self._cond:
            if key in self._sent or key in self._grads_owed or key in self._grads:
                raise ValueError(f"rank {self.rank}: {what} was already put for consumer rank {consumer}")
            if self._over_capacity(nbytes):
                self._counters.put_blocks += 1
                self._cond.notify_all()  # observers of stats() see the block as soon as it starts
            while self._over_capacity(nbytes):
                self._raise_if_failed(self._credit_streams.values(), f"credits (to put {what})")
                self._raise_if_send_failed(consumer, CHANNEL_EMBEDDING)
                if not self._wait(deadline):
                    raise PoolTimeout(self._put_timeout_message(what, consumer, nbytes))
            c = self._counters
            c.put_wait_s += time.monotonic() - start
            c.puts += 1
            c.bytes_sent += nbytes
            c.oversize_puts += int(nbytes > self.capacity_bytes)
            c.add_inflight(nbytes, +1)
            self._stream(self._credit_streams, consumer, "credit").request(1)
            if self.return_grads:
                self._grads_owed.add(key)
                self._stream(self._grad_streams, consumer, "grad").request(1)
            if planned:
                self._send_planned(consumer, header, payload)
            else:
                self._send(consumer, header, payload)
            self._sent[key] = handle
        return handle

    def _send_planned(self, consumer: int, header: WireHeader, payload: torch.Tensor) -> None:
        """Send a planned item now: its one-item header (the consumer checks it before handing the item out) and
        its bytes, each into a receive the consumer posted from its plan; no header thread, no round trip
        (lock held: posts keep send order)."""
        if self._closed:
            raise PoolError(f"rank {self.rank}: the pool is closed")
        record = encode_header([header], RECORD_LEN)
        works = [dist.isend(record, consumer, group=self.group, tag=TAGS.embedding_planned_header)]
        if header.nbytes > 0:
            works.append(dist.isend(payload.contiguous().view(-1).view(torch.uint8), consumer, group=self.group,
                                    tag=TAGS.embedding_planned))
        self._planned_sends[(consumer, *header.key)] = (works, [record, payload])
        self._counters.embedding_messages += 1  # one item per message, not coalesced

    @traced("pool.wait_grad")
    def wait_grad(self, *, sample_id: int, step: int, consumer: int) -> torch.Tensor:
        """Block until `consumer` returns d(loss)/d(embedding) of the item; the gradient is on `device`."""
        self._require_grads("wait_grad")
        key = (consumer, sample_id, step)
        what = f"the gradient of sample {sample_id} (step {step})"
        start = time.monotonic()
        deadline = start + self.timeout_s
        with self._cond:
            if key not in self._grads and key not in self._grads_owed:
                raise ValueError(f"rank {self.rank}: wait_grad for sample {sample_id} (step {step}) from consumer "
                                 f"rank {consumer}, but that item was never put for it (or its gradient was taken)")
            while key not in self._grads:
                self._raise_if_failed([self._grad_streams[consumer]], what)
                if not self._wait(deadline):
                    raise PoolTimeout(f"rank {self.rank} waited {self.timeout_s:.1f} s for {what} from consumer "
                                      f"rank {consumer}")
            grad = self._grads.pop(key)
            self._counters.grad_wait_s += time.monotonic() - start
        return grad.to(self.device)

    # ------------------------------------------------------------------ consumer side

    def expect(self, *, producer: int, items: Iterable[tuple[int, int]],
               specs: Sequence[tuple[Sequence[int], torch.dtype]] | None = None) -> None:
        """Announce the (sample_id, step) items `producer` will send, in its send order; receiving starts now.

        `specs`: one (shape, dtype) per item, from the step plan; the producer must put these items with
        `planned=True` (a planned put is only received by an expect with specs). Their receives are posted now
        (within the capacity budget) and each item's header is checked against its spec before get() hands it
        out. Planned items have their own order: the plan order is checked among planned items and among the
        others, each as sent."""
        self._check_peer(producer, "producer")
        items = [(int(s), int(t)) for s, t in items]
        checked = self._check_specs(items, specs)
        with self._cond:
            if checked is not None and self._planned_route:
                for item, spec in zip(items, checked):
                    key = (producer, *item)
                    if key in self._rx_by_key or key in self._held or key in self._planned:
                        raise ValueError(f"rank {self.rank}: sample {item[0]} (step {item[1]}) from producer rank "
                                         f"{producer} is already expected")
                    self._add_planned(producer, _PlannedReceive(item, spec, tensor_nbytes(*spec)))
                self._post_planned()
                return
            stream = self._stream(self._embedding_streams, producer, "embedding")
            plan = self._plans.setdefault(producer, deque())
            for i, item in enumerate(items):
                key = (producer, *item)
                if self._take_early(producer, item):
                    stream.request(1)  # already arrived: counted, not planned
                    continue
                if key in self._planned or key in self._held or key in self._rx_by_key:
                    raise ValueError(f"rank {self.rank}: sample {item[0]} (step {item[1]}) from producer rank "
                                     f"{producer} is already expected")
                self._planned.add(key)
                plan.append(item)
                if checked is not None:  # no planned route (device payload groups): checked when the header lands
                    self._specs[key] = checked[i]
                if self.receive_ahead:
                    stream.request(1)
                else:
                    self._unrequested.setdefault(producer, deque()).append(item)

    def _check_specs(self, items: list[tuple[int, int]],
                     specs: Sequence[tuple[Sequence[int], torch.dtype]] | None) -> list[Spec] | None:
        """`expect`'s specs as (shape tuple, dtype), one per item; bad input names the field and the rule."""
        if specs is None:
            return None
        if not self.receive_ahead:
            raise ValueError("expect(specs=...) posts the items' receives ahead, but this pool was built with "
                             "receive_ahead=False")
        specs = list(specs)
        if len(specs) != len(items):
            raise ValueError(f"expect: specs has {len(specs)} entries for {len(items)} items (one (shape, dtype) "
                             f"per item)")
        checked = []
        for (sid, step), spec in zip(items, specs):
            shape, dtype = spec
            shape = tuple(int(d) for d in shape)
            if dtype not in DTYPE_CODES or len(shape) > MAX_NDIM or min(shape, default=0) < 0:
                raise ValueError(f"expect: specs entry of sample {sid} (step {step}) is ({list(shape)}, {dtype}); "
                                 f"it needs a pool dtype and at most {MAX_NDIM} dims, each >= 0")
            checked.append((shape, dtype))
        return checked

    def _post_planned(self) -> None:
        """Post planned receives in each producer's send order while those posted and not yet taken by get() stay
        within `capacity_bytes` (one at least); the rest are posted as their headers land (lock held)."""
        for producer, pending in self._rx_arrival.items():
            for rx in pending:
                if rx.posted:
                    continue
                if self._planned_rx_bytes > 0 and self._planned_rx_bytes + rx.nbytes > self.capacity_bytes:
                    return
                self._post_receive(producer, rx)

    def _post_receive(self, producer: int, rx: _PlannedReceive) -> None:
        """Post one planned receive into a fresh buffer of its planned size (lock held: posts keep send order)."""
        rx.record = torch.empty(RECORD_LEN, dtype=torch.int64)
        rx.record_work = dist.irecv(rx.record, src=producer, group=self.group, tag=TAGS.embedding_planned_header)
        rx.buffer = torch.empty(rx.nbytes, dtype=torch.uint8, device=self._payload_device)
        rx.work = (dist.irecv(rx.buffer, src=producer, group=self.group, tag=TAGS.embedding_planned)
                   if rx.nbytes > 0 else None)  # an empty item: its header alone
        rx.posted = True
        rx.posted_t = time.monotonic()
        self._planned_rx_bytes += rx.nbytes

    def _add_planned(self, producer: int, rx: _PlannedReceive) -> None:
        """Register a planned receive behind this producer's earlier ones (lock held)."""
        self._rx_arrival.setdefault(producer, deque()).append(rx)
        self._rx_by_key[(producer, *rx.key)] = rx

    def _await_planned(self, key: ItemKey, deadline: float) -> None:
        """If `key` is a planned item not yet here: post its receives (and the earlier ones of its producer, budget
        or not: get() wants it now), then wait on this thread for them in send order (each work exactly once),
        check each one's header against the plan and hold it. The waiting thread is the caller's: no receiving
        thread sits between the bytes landing and get() (a wake-up per item, which a busy host makes slow)."""
        producer, sample_id, step = key
        while True:
            with self._cond:
                if producer in self._planned_failed:
                    raise self._planned_failed[producer]
                rx = self._rx_by_key.get(key)
                if rx is None:
                    return
                pending = self._rx_arrival[producer]
                for r in pending:
                    if not r.posted:
                        self._post_receive(producer, r)
                    if r is rx:
                        break
                head = pending[0]
                if head.waiting:  # another thread waits for it: let that one finish
                    if not self._wait(deadline):
                        raise PoolTimeout(self._get_timeout_message(f"the embedding of sample {sample_id} (step "
                                                                    f"{step})", producer))
                    continue
                head.waiting = True
                self._get_blocked_since = time.monotonic()
            try:
                what = f"the embedding of sample {head.key[0]} (step {head.key[1]})"
                for work in (head.record_work, head.work):
                    if work is None:
                        continue
                    wait_work(work, deadline,
                              on_timeout=lambda: PoolTimeout(self._get_timeout_message(what, producer)),
                              on_failure=lambda exc: PoolPeerError(
                                  f"rank {self.rank} was waiting for {what} from rank {producer}, but receiving "
                                  f"from rank {producer} failed ({type(exc).__name__}: {exc}); rank {producer} "
                                  f"probably died, check its log"))
                self._check_record(producer, head)  # before anyone sees the bytes
            except BaseException as exc:
                with self._cond:  # its works were waited once: every later wait on this producer fails alike
                    self._planned_failed[producer] = exc
                    head.waiting = False
                    self._get_blocked_since = None
                    self._cond.notify_all()
                raise
            with self._cond:
                head.waiting = False
                self._get_blocked_since = None
                self._hold_planned(producer, head)

    def _check_record(self, producer: int, rx: _PlannedReceive) -> None:
        """The planned item's header must name the item this receive was posted for, with the planned spec."""
        assert rx.record is not None
        [header] = decode_header(rx.record, expected_channel=CHANNEL_EMBEDDING, peer=producer)
        what = f"rank {self.rank}: planned sample {rx.key[0]} (step {rx.key[1]}) from producer rank {producer}"
        if header.key != rx.key:
            raise PoolProtocolError(f"{what}: the producer sent sample {header.sample_id} (step {header.step}) in "
                                    f"its place; put(planned=True) and expect(specs=...) must name the same items "
                                    f"in the same order")
        if (header.shape, header.dtype) != rx.spec:
            raise PoolProtocolError(f"{what} was planned as {list(rx.spec[0])} {rx.spec[1]} but the producer sent "
                                    f"{list(header.shape)} {header.dtype}; the ranks disagree on the step plan")

    def _hold_planned(self, producer: int, rx: _PlannedReceive) -> None:
        """A planned item's bytes are in: hold it for get() like a landed item (lock held)."""
        self._rx_arrival[producer].popleft()
        del self._rx_by_key[(producer, *rx.key)]
        shape, dtype = rx.spec
        tier = self._choose_tier(rx.nbytes)
        c = self._counters
        c.add_held(tier, rx.nbytes, +1)
        c.host_tier_items += int(tier == "host")
        c.bytes_received += rx.nbytes
        self._account_transfer(producer, rx.posted_t)
        assert rx.buffer is not None
        assert rx.buffer is not None
        tensor = rx.buffer.view(dtype).reshape(shape)
        if tier == "device" and tensor.device != self.device:
            tensor = tensor.to(self.device)
        handle = EmbeddingHandle(rx.key[0], rx.key[1], producer, self.rank, shape, dtype, rx.nbytes, tier)
        self._held[(producer, *rx.key)] = _Held(handle, tensor, planned_bytes=rx.nbytes)
        self._cond.notify_all()

    @traced("pool.get")
    def get(self, *, sample_id: int, step: int, producer: int,
            expected_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Block until the item from `producer` has arrived; return it on `device` and credit the producer.

        An item that was not `expect`ed is appended to that producer's plan (it must be the next one it sends).
        """
        self._check_peer(producer, "producer")
        key = (producer, sample_id, step)
        what = f"the embedding of sample {sample_id} (step {step})"
        start = time.monotonic()
        deadline = start + self.timeout_s
        self._await_planned(key, deadline)
        with self._cond:
            if (sample_id, step) in self._early.get(producer, ()):
                self._take_early(producer, (sample_id, step))
                self._stream(self._embedding_streams, producer, "embedding").request(1)
            elif key not in self._planned and key not in self._held:
                self._planned.add(key)
                self._plans.setdefault(producer, deque()).append((sample_id, step))
                self._stream(self._embedding_streams, producer, "embedding").request(1)
            elif (sample_id, step) in self._unrequested.get(producer, ()):
                # Receive on demand: this item and the producer's earlier ones (they come first on the wire).
                pending, n = self._unrequested[producer], 0
                while pending:
                    n += 1
                    if pending.popleft() == (sample_id, step):
                        break
                self._stream(self._embedding_streams, producer, "embedding").request(n)
            if key not in self._held or self._held[key].tensor is None:
                self._get_blocked_since = start
            try:
                while key not in self._held or self._held[key].tensor is None:
                    self._raise_if_failed(self._receivers_of(producer), what)
                    if not self._wait(deadline):
                        raise PoolTimeout(self._get_timeout_message(what, producer))
            finally:
                self._get_blocked_since = None
            held = self._held[key]
            h = held.handle
            if expected_shape is not None and tuple(expected_shape) != h.shape:
                raise PoolShapeError(f"rank {self.rank}: sample {sample_id} (step {step}) from producer rank "
                                     f"{producer} has shape {list(h.shape)}, expected {list(expected_shape)}")
            del self._held[key]
            if held.planned_bytes:
                self._planned_rx_bytes -= held.planned_bytes
                self._post_planned()
            c = self._counters
            c.add_held(h.tier, -h.nbytes, -1)
            c.gets += 1
            c.get_wait_s += time.monotonic() - start
            if h.tier == "host":
                c.host_to_device_bytes += h.nbytes
            self._send_credit(h)
        assert held.tensor is not None
        return held.tensor.to(self.device)

    @traced("pool.return_grad")
    def return_grad(self, grad: torch.Tensor, *, sample_id: int, step: int, producer: int) -> None:
        """Send d(loss)/d(embedding) of an item back to its producer without waiting."""
        self._require_grads("return_grad")
        self._check_peer(producer, "producer")
        what = f"gradient of sample {sample_id} (step {step})"
        check_sendable(grad, f"return_grad of {what} to producer rank {producer}")
        header = item_header(CHANNEL_GRAD, sample_id, step, grad)
        payload = grad.detach().to(self._payload_device)
        with self._cond:
            self._send(producer, header, payload)
            self._counters.grads_sent += 1
            self._counters.grad_bytes_sent += header.nbytes

    # ------------------------------------------------------------------ both sides

    @traced("pool.flush")
    def flush(self) -> None:
        """Wait until every item this rank queued to send (embeddings, credits, gradients) has been received.

        A send completes only once its receiver has asked for it (`expect`/`get` for embeddings), so a producer
        running ahead of its consumers (frozen encoder) should flush where the consumers have expected the items
        it sent, e.g. at the end of training, not at the end of each of its own steps.
        """
        start = time.monotonic()
        deadline = start + self.timeout_s
        with self._cond:  # planned sends not yet credited: waited here (taken, so a late credit skips them)
            planned = list(self._planned_sends.items())
            self._planned_sends.clear()
        for (consumer, sample_id, step), (works, _) in planned:
            what = f"the planned embedding of sample {sample_id} (step {step})"
            for work in works:
                wait_work(work, deadline,
                          on_timeout=lambda: PoolTimeout(f"rank {self.rank} waited {self.timeout_s:.1f} s in flush() "
                                                         f"for {what} to be received by rank {consumer} (did it "
                                                         f"expect it with specs?)"),
                          on_failure=lambda exc: PoolPeerError(f"rank {self.rank}: sending {what} to rank {consumer} "
                                                               f"failed ({type(exc).__name__}: {exc}); rank "
                                                               f"{consumer} probably died, check its log"))
        with self._cond:
            for box in self._outboxes.values():
                while not box.idle:
                    self._raise_if_send_failed(box.peer, box.channel)
                    if not self._wait(deadline):
                        pending = box.pending()
                        what = (f"{CHANNEL_NAMES[box.channel]} of sample {pending[0].sample_id} (step "
                                f"{pending[0].step})" if pending else CHANNEL_NAMES[box.channel])
                        raise PoolTimeout(f"rank {self.rank} waited {self.timeout_s:.1f} s in flush() for the {what} "
                                          f"to be received by rank {box.peer} ({len(pending)} items not yet received)")
            self._counters.flush_wait_s += time.monotonic() - start

    def stats(self) -> PoolStats:
        with self._cond:
            return self._counters.snapshot()

    def reset_step_stats(self) -> None:
        with self._cond:
            self._counters.reset_step()

    def inflight_handles(self) -> list[EmbeddingHandle]:
        """Producer side: items sent and not yet consumed, in send order."""
        with self._cond:
            return list(self._sent.values())

    def buffered_handles(self) -> list[EmbeddingHandle]:
        """Consumer side: items received (or landing) and not yet taken by get()."""
        with self._cond:
            return [h.handle for h in self._held.values()]

    def close(self, *, wait: bool = True) -> None:
        """Stop the receiving threads, first waiting (up to `timeout_s`, if `wait`) for every message still owed
        to this rank: credits for items it sent, gradients, expected embeddings. Call flush() before it.

        Waiting matters: a receive left posted would take the message meant for a later pool on the same group
        and tags. Threads still busy after the wait are daemons and die with the process group (with a warning).
        """
        deadline = time.monotonic() + (self.timeout_s if wait else 0.0)
        with self._cond:
            self._closed = True
            streams: list[InboundStream | Outbox] = [*self._credit_streams.values(), *self._grad_streams.values(),
                                                     *self._embedding_streams.values(), *self._outboxes.values()]
            while any(not s.idle and s.error is None for s in streams) and self._wait(deadline):
                pass
            # Planned receives are waited by get() alone: one posted and never taken stays posted (a deadline here
            # would close the transport to that peer), so it is reported like a busy stream.
            busy = sorted({s.peer for s in streams if not s.idle}
                          | {p for p, pending in self._rx_arrival.items() if any(rx.posted for rx in pending)}
                          | {c for c, _, _ in self._planned_sends})
            for s in streams:
                s.close()
        for s in streams:
            if s.idle:
                s.join(timeout=1.0)
        if busy:
            # Their posted receives stay posted: a later pool on the same group and tags could lose messages.
            warnings.warn(f"rank {self.rank}: pool closed while still waiting for messages from rank(s) {busy}; "
                          f"do not start another pool on this process group", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> "EmbeddingPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ receiving threads' callbacks

    def _land_embedding(self, producer: int, raw: torch.Tensor) -> _Landed:
        headers = decode_header(raw, expected_channel=CHANNEL_EMBEDDING, peer=producer)
        with self._cond:
            plan = self._plans[producer]
            for header in headers:
                if plan:
                    if plan[0] != header.key:
                        raise PoolProtocolError(self._order_message(producer, plan[0], header.key))
                    plan.popleft()
                    self._planned.discard((producer, *header.key))
                else:  # batched with planned items before this rank expected it: held until expect() names it
                    self._early.setdefault(producer, deque()).append(header.key)
                self._check_header_spec(producer, header)
                tier = self._choose_tier(header.nbytes)
                self._counters.add_held(tier, header.nbytes, +1)
                self._counters.host_tier_items += int(tier == "host")
                self._held[(producer, *header.key)] = _Held(EmbeddingHandle(
                    header.sample_id, header.step, producer, self.rank, header.shape, header.dtype, header.nbytes,
                    tier), landing_t=time.monotonic())
        return self._payload_views(headers)

    def _check_header_spec(self, producer: int, header: WireHeader) -> None:
        """A header-path item expected with specs (no planned route: device payload groups) must match them; a
        planned record never travels on the header path (lock held)."""
        spec = self._specs.pop((producer, *header.key), None)
        what = f"rank {self.rank}: sample {header.sample_id} (step {header.step}) from producer rank {producer}"
        if header.planned:
            raise PoolProtocolError(f"{what} came as a planned item on the header channel")
        if spec is not None and spec != (header.shape, header.dtype):
            raise PoolProtocolError(f"{what} was planned as {list(spec[0])} {spec[1]} but the producer sent "
                                    f"{list(header.shape)} {header.dtype}; the ranks disagree on the step plan")

    def _deliver_embedding(self, producer: int, header: WireHeader, buffer: torch.Tensor | None) -> None:
        key = (producer, *header.key)
        with self._cond:
            tier = self._held[key].handle.tier
        tensor = self._unpack(header, buffer)
        # Off the lock: a device copy may take a while and get() of other items must not wait for it.
        if tier == "host" and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        elif tier == "device" and tensor.device != self.device:
            tensor = tensor.to(self.device)
        with self._cond:
            self._held[key].tensor = tensor
            self._account_transfer(producer, self._held[key].landing_t)
            self._counters.bytes_received += header.nbytes
            self._cond.notify_all()

    def _account_transfer(self, producer: int, landing_t: float) -> None:
        """Count one landed payload (under the lock): its time on the wire, from its header landing or the
        producer's previous payload landing (payloads of one stream arrive one after another), and the part of it
        during which a get() was blocked (exposed; the rest was hidden behind the consumer's compute)."""
        now = time.monotonic()
        begin = max(landing_t, self._last_landed.get(producer, 0.0))
        self._last_landed[producer] = now
        c = self._counters
        c.transfer_s += now - begin
        if self._get_blocked_since is not None:
            c.transfer_exposed_s += max(0.0, now - max(begin, self._get_blocked_since))

    def _land_credit(self, consumer: int, raw: torch.Tensor) -> _Landed:
        return [(h, None) for h in decode_header(raw, expected_channel=CHANNEL_CREDIT, peer=consumer)], None

    def _deliver_credit(self, consumer: int, credit: WireHeader, _: torch.Tensor | None) -> None:
        with self._cond:
            planned = self._planned_sends.pop((consumer, *credit.key), None)
            sent = self._sent.pop((consumer, *credit.key), None)
            if sent is None or sent.nbytes != credit.nbytes:
                raise PoolProtocolError(f"rank {consumer} returned a credit for sample {credit.sample_id} (step "
                                        f"{credit.step}, {credit.nbytes} B) that rank {self.rank} has not sent to it")
            self._counters.add_inflight(-credit.nbytes, -1)
            self._cond.notify_all()
        for work in planned[0] if planned else ():
            work.wait()  # the consumer took the item: its sends are complete (each work is waited exactly once)

    def _land_grad(self, consumer: int, raw: torch.Tensor) -> _Landed:
        headers = decode_header(raw, expected_channel=CHANNEL_GRAD, peer=consumer)
        with self._cond:
            for header in headers:
                if (consumer, *header.key) not in self._grads_owed:
                    raise PoolProtocolError(f"rank {consumer} returned a gradient for sample {header.sample_id} "
                                            f"(step {header.step}) that rank {self.rank} did not send it (or got "
                                            f"twice)")
        return self._payload_views(headers)

    def _deliver_grad(self, consumer: int, header: WireHeader, buffer: torch.Tensor | None) -> None:
        grad = self._unpack(header, buffer)
        key = (consumer, *header.key)
        with self._cond:
            self._grads_owed.discard(key)
            self._grads[key] = grad
            self._counters.grads_received += 1
            self._counters.grad_bytes_received += header.nbytes
            self._cond.notify_all()

    def _payload_views(self, headers: list[WireHeader]) -> _Landed:
        """The batch's receive buffer and each item's view of it (None: the item has no payload)."""
        views, buffer = slice_payloads(headers, self._payload_device)
        return list(zip(headers, views)), buffer

    def _unpack(self, header: WireHeader, buffer: torch.Tensor | None) -> torch.Tensor:
        """The item's tensor, viewing its received bytes (an empty item gets an empty tensor)."""
        if buffer is None:
            buffer = torch.empty(0, dtype=torch.uint8, device=self._payload_device)
        return from_bytes(buffer, header)

    # ------------------------------------------------------------------ helpers

    def _stream(self, streams: dict[int, InboundStream], peer: int, channel: str) -> InboundStream:
        """The receiving thread for (peer, channel), started on first use (call with the lock held)."""
        if self._closed:
            raise PoolError(f"rank {self.rank}: the pool is closed")
        stream = streams.get(peer)
        if stream is None:
            if channel == "embedding":
                tags, land, deliver = ((TAGS.embedding_header, TAGS.embedding_payload),
                                       self._land_embedding, self._deliver_embedding)
            elif channel == "grad":
                tags, land, deliver = (TAGS.grad_header, TAGS.grad_payload), self._land_grad, self._deliver_grad
            else:
                tags, land, deliver = (TAGS.credit, None), self._land_credit, self._deliver_credit
            stream = InboundStream(cond=self._cond, lock=self._lock, peer=peer, group=self.group, header_tag=tags[0],
                                   payload_tag=tags[1], header_len=HEADER_LEN,
                                   land=lambda raw, p=peer, f=land: f(p, raw),
                                   deliver=lambda ctx, buf, p=peer, f=deliver: f(p, ctx, buf),
                                   name=f"pool-r{self.rank}-{channel}-from-r{peer}", wire_device=self._wire_device,
                                   payload_group=self._payload_groups.get(
                                       CHANNEL_GRAD if channel == "grad" else CHANNEL_EMBEDDING))
            streams[peer] = stream
            stream.start()
        return stream

    def _send(self, peer: int, header: WireHeader, payload: torch.Tensor | None) -> None:
        """Queue one item for `peer` on its channel's coalescing sender (call with the lock held)."""
        if self._closed:
            raise PoolError(f"rank {self.rank}: the pool is closed")
        self._raise_if_send_failed(peer, header.channel)
        box = self._outboxes.get((peer, header.channel))
        if box is None:
            header_tag, payload_tag = _OUT_TAGS[header.channel]
            box = Outbox(cond=self._cond, lock=self._lock, peer=peer, group=self.group, channel=header.channel,
                         header_tag=header_tag, payload_tag=payload_tag, max_batch_items=self.max_batch_items,
                         max_batch_bytes=self.max_batch_bytes,
                         on_sent=self._on_sent, name=f"pool-r{self.rank}-{CHANNEL_NAMES[header.channel]}-to-r{peer}",
                         wire_device=self._wire_device, payload_group=self._payload_groups.get(header.channel))
            self._outboxes[(peer, header.channel)] = box
            box.start()
        box.push(header, payload)

    def _on_sent(self, items: list[WireHeader]) -> None:
        """An outbox completed a message (called with the lock held)."""
        if items[0].channel == CHANNEL_EMBEDDING:
            self._counters.embedding_messages += 1

    def _send_credit(self, handle: EmbeddingHandle) -> None:
        self._send(handle.producer, credit_header(handle.sample_id, handle.step, handle.nbytes), None)

    def _raise_if_send_failed(self, peer: int, channel: int) -> None:
        box = self._outboxes.get((peer, channel))
        if box is None or box.error is None:
            return
        err = box.error
        pending = box.pending()
        what = (f"the {CHANNEL_NAMES[channel]} of sample {pending[0].sample_id} (step {pending[0].step})"
                if pending else f"a {CHANNEL_NAMES[channel]} message")
        raise PoolPeerError(f"rank {self.rank}: sending {what} to rank {peer} failed ({type(err).__name__}: {err}); "
                            f"rank {peer} probably died, check its log") from err

    def _over_capacity(self, nbytes: int) -> bool:
        """A put of `nbytes` must wait: something is in flight and the item would push it past the capacity."""
        c = self._counters
        return c.inflight_bytes > 0 and c.inflight_bytes + nbytes > self.capacity_bytes

    def _choose_tier(self, nbytes: int) -> Tier:
        if self.host_tier_bytes is not None and nbytes > self.host_tier_bytes:
            return "host"
        if self._counters.device_bytes + nbytes > self.capacity_bytes:
            return "host"
        return "device"

    def _wait(self, deadline: float) -> bool:
        """Wait on the condition until notified or `deadline`; False once the deadline has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(timeout=remaining)
        return True

    def _receivers_of(self, producer: int) -> list[InboundStream]:
        """The threads that receive from `producer` (lock held): their errors end a wait for its items."""
        stream = self._embedding_streams.get(producer)
        return [] if stream is None else [stream]

    def _raise_if_failed(self, streams: Iterable[InboundStream], what: str) -> None:
        for stream in streams:
            err = stream.error
            if err is None:
                continue
            if isinstance(err, PoolError):
                raise err
            raise PoolPeerError(f"rank {self.rank} was waiting for {what} from rank {stream.peer}, but receiving "
                                f"from rank {stream.peer} failed ({type(err).__name__}: {err}); rank {stream.peer} "
                                f"probably died, check its log") from err

    def _check_peer(self, peer: int, role: str) -> None:
        if peer == self.rank:
            raise ValueError(f"rank {self.rank}: the {role} rank is this rank; the pool moves data between ranks")
        if peer not in self.members:
            raise ValueError(f"rank {self.rank}: {role} rank {peer} is not in the pool's process group "
                             f"(ranks {sorted(self.members)})")

    def _require_grads(self, call: str) -> None:
        if not self.return_grads:
            raise PoolError(f"rank {self.rank}: {call}() on a pool built with return_grads=False (frozen encoder: "
                            f"there is no gradient channel)")

    def _put_timeout_message(self, what: str, consumer: int, nbytes: int) -> str:
        owing = sorted({h.consumer for h in self._sent.values()})
        c = self._counters
        return (f"rank {self.rank} waited {self.timeout_s:.1f} s to put {what} ({_fmt_bytes(nbytes)}) for consumer "
                f"rank {consumer}: {c.inflight_items} items ({_fmt_bytes(c.inflight_bytes)}) in flight to consumer "
                f"rank(s) {owing} fill the capacity of {_fmt_bytes(self.capacity_bytes)} and no credit came back "
                f"(is each consumer calling get()?)")

    def _order_message(self, producer: int, expected: tuple[int, int], sent: tuple[int, int]) -> str:
        return (f"rank {self.rank} expected sample {expected[0]} (step {expected[1]}) next from producer rank "
                f"{producer} (plan order), but it sent sample {sent[0]} (step {sent[1]}); the ranks disagree on the "
                f"step plan")

    def _take_early(self, producer: int, key: tuple[int, int]) -> bool:
        """Plan `key` against the items that arrived before they were expected; True if it is one of them."""
        early = self._early.get(producer)
        if not early:
            return False
        if early[0] != key:
            raise PoolProtocolError(self._order_message(producer, key, early[0]))
        early.popleft()
        return True

    def _get_timeout_message(self, what: str, producer: int) -> str:
        arrived = sum(1 for (p, _, _) in self._held if p == producer)
        still = len(self._plans.get(producer, ())) + len(self._rx_arrival.get(producer, ()))
        return (f"rank {self.rank} waited {self.timeout_s:.1f} s for {what} from producer rank {producer} "
                f"({arrived} items from it are buffered, {still} expected items have not arrived; an item put "
                f"with planned=True arrives only once expected with specs)")
