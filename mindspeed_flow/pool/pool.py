"""`EmbeddingPool`: embeddings from encoder ranks to backbone ranks, gradients back, bounded by credits.

Roles. A producer (encoder rank) `put`s one embedding per sample for the consumer that the step plan names and
later `wait_grad`s its gradient; a consumer (backbone first-stage rank) `expect`s the items of each producer in
the order that producer will send them, `get`s them in any order and `return_grad`s d(loss)/d(embedding). A rank
can be both. Ranks are global ranks; the pool works on the world group or on the group it is given, and holds
no process-group globals.

Backpressure. A producer counts the bytes it has sent and not yet seen consumed ("in flight"). `put` blocks
while that count plus the new item would exceed `capacity_bytes`; each `get` on the consumer sends a credit back
that frees the item's bytes (`get_many`, a microbatch's items: one credit message for all of them, sent before the
call would block on an item the producer has not sent, so held-back credits never starve it). An item larger than the capacity goes through when nothing else is in flight, so
the pool never deadlocks on one big embedding. With a frozen encoder (`return_grads=False`) there is no gradient
channel and the producer runs ahead into later steps bounded only by these credits.

Tiers. A consumer keeps received embeddings on `device` up to `capacity_bytes`; an embedding larger than
`host_tier_bytes`, or one that would push device occupancy past the capacity, lands in host memory and moves to
the device when `get` takes it. (On CPU both tiers are host memory; the placement and the counters are real.)

Transport: see `transport.py` (one receiving thread per peer and channel; deadlines on the caller's side) and
`wire.py` (fixed int64 header, then the payload bytes, distinct tags per channel). Every blocking call raises
`PoolTimeout` after `timeout_s`, naming this rank, the peer and the awaited item, and `PoolPeerError` when the
transport to the peer fails (a dead peer fails within milliseconds on gloo).

Batches. `put_many` sends the items of one encoder forward as one message: one header with every item's record
and one payload transfer of their bytes back to back, the encoder's output region itself when the items are
adjacent views of it (no copy), so the per-item costs of `put` (a queue hand-off, a lock acquisition, a header
record in a message of its own when the link is idle) are paid once per forward. The consumer receives the
batch through the header path like any other message: one receive for the header, one for the whole payload,
and get() hands out views of that buffer. `expect(..., specs=...)` names each item's planned (shape, dtype); the
header is checked against them as it lands, before any item is handed out, and a mismatch raises
`PoolProtocolError` naming the item (the ranks disagree on the step plan).

Groups. Headers and credits always travel on `group`, a gloo group (tags keep channels apart; `Topology` builds
it). Payloads travel on `data_groups` when given: two groups of the job's device backend (NCCL/HCCL), one per
direction (embeddings producer->consumer, gradients consumer->producer), because device backends match
point-to-point messages by order, not by tag, and run a pair's sends and receives on one stream, where
embeddings and gradients crossing in opposite directions could wait on each other. Payloads then go from device
memory to device memory (the device tier is device memory). Without `data_groups` (CPU jobs, or as a fallback)
payloads are staged through host memory on `group` and moved to `device` in `get`/`wait_grad`. On `data_groups`
the order of a rank's device operations is the order its threads reach them (a payload receive when its header
lands, sends per consumer): safe where each pair of ranks has a stream of its own (torch_npu's default P2P
communicators), not where a communicator's point-to-point operations share one stream (`P2P_HCCL_BUFFSIZE=0`),
where consumers that saw headers in opposite producer orders deadlock (tests/test_pool_planned.py). A job whose
every transfer is known in advance uses the planned mode instead (`planned.py`: one global order per direction).
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.pool.buffers import ReceiveBuffers
from mindspeed_flow.pool.errors import PoolError, PoolPeerError, PoolProtocolError, PoolShapeError, PoolTimeout
from mindspeed_flow.pool.handle import EmbeddingHandle, Tier
from mindspeed_flow.pool.stats import PoolCounters, PoolStats
from mindspeed_flow.pool.transport import InboundStream, LandedItem, Outbox
from mindspeed_flow.pool.wire import (CHANNEL_CREDIT, CHANNEL_EMBEDDING, CHANNEL_GRAD, CHANNEL_NAMES, DTYPE_CODES,
                                      HEADER_LEN, MAX_BATCH, MAX_NDIM, STAGED_MAX_BYTES, TAGS, WireHeader, check_sendable,
                                      credit_header, decode_header, dense_payload, from_bytes, item_header, pack_payloads,
                                      slice_payloads)
from mindspeed_flow.telemetry.trace import traced

# (peer rank, sample_id, step): the pool's key for an item on one side of one producer/consumer pair.
ItemKey = tuple[int, int, int]
# A landed batch: each item's header and view of the payload, and the batch's buffer.
_Landed = tuple[list[LandedItem], torch.Tensor | None]
# What the consumer's plan says an item is: (shape, dtype).
Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass
class _Held:
    """Consumer side: an embedding received (or landing) and not yet taken by get()."""

    handle: EmbeddingHandle
    tensor: torch.Tensor | None = None  # None while the payload is still arriving
    landing_t: float = 0.0  # time.monotonic() when its header landed (the payload transfer starts)


# Items queued behind a send, and a put_many's items, share a message up to this much payload; a larger item goes
# alone. Measured with `bench pool` (16 items of 1 MiB, one step): 4 MiB messages (four a step) reached 0.47-0.57 of
# raw isend/irecv, 16 MiB (one) 0.70-0.92, as every message costs a header round and thread hand-offs; the staged
# receives (wire.staged_bytes) follow the payload size up to 32 MiB, so such messages still land pre-posted.
MAX_BATCH_BYTES = 16 << 20

# Outbound channels: (header tag, payload tag) and whether items carry a payload.
_OUT_TAGS = {CHANNEL_EMBEDDING: (TAGS.embedding_header, TAGS.embedding_payload),
             CHANNEL_GRAD: (TAGS.grad_header, TAGS.grad_payload),
             CHANNEL_CREDIT: (TAGS.credit, None)}
_STAGED_TAGS = {CHANNEL_EMBEDDING: TAGS.embedding_staged, CHANNEL_GRAD: TAGS.grad_staged}


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
        self._gloo = str(dist.get_backend(group)) == "gloo"  # staged payloads (wire.staged_bytes) need gloo's rules
        # Payloads: on the device groups in device memory, else staged like the headers.
        self.data_groups = data_groups
        self._payload_groups = {CHANNEL_EMBEDDING: data_groups[0], CHANNEL_GRAD: data_groups[1]} if data_groups else {}
        self._payload_device = _transport_device(data_groups[0], self.device) if data_groups else self._wire_device
        # Host receive buffers are reused once nothing views them (buffers.py): up to twice the capacity (items in
        # flight, in power-of-two size classes) and a few staging buffers.
        self._receive_buffers = (ReceiveBuffers(2 * capacity_bytes + 4 * STAGED_MAX_BYTES)
                                 if self._payload_device.type == "cpu" else None)
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
        self._awaited: set[ItemKey] = set()               # (producer, sample, step) expected, not yet arrived
        self._held: dict[ItemKey, _Held] = {}             # arrived or landing, not yet taken by get()
        self._early: dict[int, deque[tuple[int, int]]] = {}  # producer -> arrived in a batch before expected
        self._embedding_streams: dict[int, InboundStream] = {}
        self._specs: dict[ItemKey, Spec] = {}  # planned (shape, dtype) of expected items, checked as their headers land
        # both sides: one coalescing sender per (peer, channel)
        self._outboxes: dict[tuple[int, int], Outbox] = {}

    # ------------------------------------------------------------------ producer side

    @traced("pool.put")
    def put(self, tensor: torch.Tensor, *, sample_id: int, step: int, consumer: int) -> EmbeddingHandle:
        """Send `tensor` to `consumer` without waiting for it to arrive; block while over capacity.

        On gloo a contiguous CPU tensor is sent without a copy: do not modify it in place until the consumer has
        taken it (`inflight_handles()` no longer lists it). Items queued behind a send share its next message;
        `put_many` sends several items as one message from the start.
        """
        self._check_peer(consumer, "consumer")
        check_sendable(tensor, f"put of sample {sample_id} (step {step}) for consumer rank {consumer}")
        header = item_header(CHANNEL_EMBEDDING, sample_id, step, tensor)
        payload = tensor.detach().to(self._payload_device)
        [handle] = self._enqueue(consumer, [header], [tensor.device],
                                 lambda: self._outbox(consumer, CHANNEL_EMBEDDING).push(header, payload))
        return handle

    @traced("pool.put")  # the timeline's put span, one per batch
    def put_many(self, tensors: Sequence[torch.Tensor], *, sample_ids: Sequence[int], step: int,
                 consumer: int) -> list[EmbeddingHandle]:
        """Send several items to `consumer` as few messages: one header for all their records and one payload
        transfer per batch; block while over capacity. Returns one handle per item, in order.

        The way an encoder produces: one forward over several images yields one contiguous [tokens, hidden] output
        split per image. Tensors of one dtype go back to back (a dense batch); when they are adjacent views of one
        contiguous storage, in order, that region is sent as it is, without a copy (do not modify it in place until
        the consumer has taken every item), otherwise they are concatenated into one staging buffer (mixed dtypes:
        copied at aligned offsets). A group is split into several batches only where it exceeds `max_batch_items`,
        `max_batch_bytes` or the capacity (an item larger than those goes alone); each batch takes the pool's lock
        once and waits for credits once.
        """
        tensors, sample_ids = list(tensors), [int(s) for s in sample_ids]
        self._check_peer(consumer, "consumer")
        if len(tensors) != len(sample_ids):
            raise ValueError(f"put_many: {len(tensors)} tensors for {len(sample_ids)} sample_ids (one id per tensor)")
        if len(set(sample_ids)) != len(sample_ids):
            raise ValueError(f"put_many: sample_ids {sample_ids} name a sample twice (each item once per step)")
        for tensor, sid in zip(tensors, sample_ids):
            if tensor.dtype not in DTYPE_CODES or tensor.dim() > MAX_NDIM:  # the message only when it is needed
                check_sendable(tensor, f"put_many of sample {sid} (step {step}) for consumer rank {consumer}")
        # One dtype: items back to back (offsets stay multiples of the element size); mixed: aligned offsets.
        dense = len({t.dtype for t in tensors}) == 1
        headers = [item_header(CHANNEL_EMBEDDING, sid, step, t, dense) for t, sid in zip(tensors, sample_ids)]
        payloads = [t.detach() if t.device == self._payload_device else t.detach().to(self._payload_device)
                    for t in tensors]
        handles: list[EmbeddingHandle] = []
        for lo, hi in self._batches(headers):
            items, chunk = headers[lo:hi], payloads[lo:hi]
            payload = dense_payload(chunk) if dense else pack_payloads(items, chunk)
            send = lambda items=items, payload=payload: self._outbox(  # noqa: E731
                consumer, CHANNEL_EMBEDDING).push_batch(items, payload)
            handles += self._enqueue(consumer, items, [t.device for t in tensors[lo:hi]], send)
        return handles

    def _batches(self, headers: list[WireHeader]) -> list[tuple[int, int]]:
        """`put_many`'s messages: consecutive runs of at most `max_batch_items` items and min(`max_batch_bytes`,
        capacity) payload bytes (an item over the limit goes alone)."""
        limit = min(self.max_batch_bytes, self.capacity_bytes)
        runs: list[tuple[int, int]] = []
        lo, size = 0, 0
        for i, h in enumerate(headers):
            if i > lo and (i - lo >= self.max_batch_items or size + h.nbytes > limit):
                runs.append((lo, i))
                lo, size = i, 0
            size += h.nbytes
        if headers:
            runs.append((lo, len(headers)))
        return runs

    def _enqueue(self, consumer: int, items: list[WireHeader], devices: list[torch.device],
                 send: Callable[[], None]) -> list[EmbeddingHandle]:
        """Account for one message of `items` to `consumer` and queue it with `send` on the embedding outbox: one
        lock acquisition and one wait for credits for the whole message."""
        nbytes = sum(h.nbytes for h in items)
        first = items[0]
        what = (f"sample {first.sample_id} (step {first.step})" if len(items) == 1 else
                f"{len(items)} samples from sample {first.sample_id} (step {first.step}) on")
        start = time.monotonic()
        deadline = start + self.timeout_s
        with self._cond:
            for h in items:
                key = (consumer, *h.key)
                if key in self._sent or key in self._grads_owed or key in self._grads:
                    raise ValueError(f"rank {self.rank}: sample {h.sample_id} (step {h.step}) was already put for "
                                     f"consumer rank {consumer}")
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
            c.puts += len(items)
            c.bytes_sent += nbytes
            c.oversize_puts += sum(int(h.nbytes > self.capacity_bytes) for h in items)
            c.add_inflight(nbytes, len(items))
            if self.return_grads:
                self._grads_owed.update((consumer, *h.key) for h in items)
            send()
            # The handles are made once the message is on its way: nothing before the send that need not be.
            handles = [EmbeddingHandle(h.sample_id, h.step, self.rank, consumer, h.shape, h.dtype, h.nbytes,
                                       "device" if d == self.device else "host") for h, d in zip(items, devices)]
            for h, handle in zip(items, handles):
                self._sent[(consumer, *h.key)] = handle
            # Asked for after the send is posted: each request wakes a receiving thread, which would otherwise
            # compete with this one for the interpreter while it posts (the replies come long after anyway).
            self._stream(self._credit_streams, consumer, "credit").request(len(items))
            if self.return_grads:
                self._stream(self._grad_streams, consumer, "grad").request(len(items))
        return handles

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

        `specs`: one (shape, dtype) per item, from the step plan: each item's header is checked against its spec
        as it lands, before get() hands any item of its message out."""
        self._check_peer(producer, "producer")
        items = [(int(s), int(t)) for s, t in items]
        checked = self._check_specs(items, specs)
        with self._cond:
            stream = self._stream(self._embedding_streams, producer, "embedding")
            plan = self._plans.setdefault(producer, deque())
            for i, item in enumerate(items):
                key = (producer, *item)
                if self._take_early(producer, item):
                    stream.request(1)  # already arrived: counted, not planned
                    continue
                if key in self._awaited or key in self._held:
                    raise ValueError(f"rank {self.rank}: sample {item[0]} (step {item[1]}) from producer rank "
                                     f"{producer} is already expected")
                self._awaited.add(key)
                plan.append(item)
                if checked is not None:
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

    @traced("pool.get")
    def get(self, *, sample_id: int, step: int, producer: int,
            expected_shape: Sequence[int] | None = None) -> torch.Tensor:
        """Block until the item from `producer` has arrived; return it on `device` and credit the producer.

        An item that was not `expect`ed is appended to that producer's plan (it must be the next one it sends).
        """
        return self._get(sample_id, step, producer, expected_shape, None)

    @traced("pool.get")  # the timeline's get span, one per microbatch
    def get_many(self, items: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """`get` of several (sample_id, step, producer) items in this order (a microbatch's embeddings); their
        credits go back together, one message per producer (and per MAX_BATCH items), when the last is taken.

        One credit message instead of one per item spares the producer a credit landing per item and this rank a
        send per item, both thread hand-offs that cost more than a small item's bytes. Credits held back are sent
        before any get() in the call blocks, so they never hold up an item this call waits for."""
        deferred: dict[int, list[WireHeader]] = {}
        out: list[torch.Tensor] = []
        at = 0
        while at < len(items):
            with self._cond:  # every item already here, from `at` on, under one lock acquisition
                while at < len(items) and self._ready((items[at][2], items[at][0], items[at][1])):
                    sample_id, step, producer = items[at]
                    self._check_peer(producer, "producer")
                    out.append(self._take((producer, sample_id, step), None, deferred, time.monotonic()))
                    at += 1
            if at < len(items):  # the general path: bookkeeping, and waiting for it to arrive
                sample_id, step, producer = items[at]
                out.append(self._get(sample_id, step, producer, None, deferred))
                at += 1
        with self._cond:
            self._send_deferred_credits(deferred)
        return [t.to(self.device) for t in out]

    def _ready(self, key: ItemKey) -> bool:
        """Whether get() of `key` can take it at once, with no bookkeeping on the way (lock held): it has arrived,
        was expected (not held early)."""
        held = self._held.get(key)
        return held is not None and held.tensor is not None and key[1:] not in self._early.get(key[0], ())

    def _send_deferred_credits(self, deferred: dict[int, list[WireHeader]]) -> None:
        """Send the credits `get_many` held back, one message per producer and MAX_BATCH items (lock held)."""
        for producer, credits in deferred.items():
            for at in range(0, len(credits), MAX_BATCH):
                # Queued for the posting thread: get_many returns to the caller's compute without posting them.
                self._outbox(producer, CHANNEL_CREDIT).push_batch(credits[at:at + MAX_BATCH], None, inline=False)
        deferred.clear()

    def _get(self, sample_id: int, step: int, producer: int, expected_shape: Sequence[int] | None,
             deferred: dict[int, list[WireHeader]] | None) -> torch.Tensor:
        """`get`; with `deferred`, the credit is added there (by producer) instead of sent (see `get_many`), and the
        tensor is returned where it landed (get_many moves its items to `device`)."""
        self._check_peer(producer, "producer")
        key = (producer, sample_id, step)
        what = f"the embedding of sample {sample_id} (step {step})"
        start = time.monotonic()
        deadline = start + self.timeout_s
        with self._cond:
            if (sample_id, step) in self._early.get(producer, ()):
                self._take_early(producer, (sample_id, step))
                self._stream(self._embedding_streams, producer, "embedding").request(1)
            elif key not in self._awaited and key not in self._held:
                self._awaited.add(key)
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
                if deferred and key not in self._held:
                    # About to block on an item not yet sent or not yet announced: the credits held back go
                    # first, as the producer may need them to send it (an announced item's bytes are already
                    # on the way and need no credit).
                    self._send_deferred_credits(deferred)
            stream = self._embedding_streams.get(producer)
            if stream is not None:
                stream.waiters += 1
            try:
                while key not in self._held or self._held[key].tensor is None:
                    self._raise_if_failed(self._receivers_of(producer), what)
                    handed = stream.take_handoff() if stream is not None else None
                    if handed is not None:  # its header landed while this call waited: finish it here, off the lock
                        self._cond.release()
                        try:
                            stream.finish_handed(handed)
                        finally:
                            self._cond.acquire()
                        continue
                    if not self._wait(deadline):
                        raise PoolTimeout(self._get_timeout_message(what, producer))
            finally:
                self._get_blocked_since = None
                if stream is not None:
                    stream.waiters -= 1
                    if not stream.waiters:
                        stream.return_handoffs()
            tensor = self._take(key, expected_shape, deferred, start)
        return tensor if deferred is not None else tensor.to(self.device)

    def _take(self, key: ItemKey, expected_shape: Sequence[int] | None,
              deferred: dict[int, list[WireHeader]] | None, start: float) -> torch.Tensor:
        """Take an arrived item out of the pool and credit its producer (lock held); `start`: when get() began."""
        producer, sample_id, step = key
        held = self._held[key]
        h = held.handle
        if expected_shape is not None and tuple(expected_shape) != h.shape:
            raise PoolShapeError(f"rank {self.rank}: sample {sample_id} (step {step}) from producer rank "
                                 f"{producer} has shape {list(h.shape)}, expected {list(expected_shape)}")
        del self._held[key]
        c = self._counters
        c.add_held(h.tier, -h.nbytes, -1)
        c.gets += 1
        c.get_wait_s += time.monotonic() - start
        if h.tier == "host":
            c.host_to_device_bytes += h.nbytes
        if deferred is not None:
            deferred.setdefault(producer, []).append(credit_header(h.sample_id, h.step, h.nbytes))
        else:
            self._send_credit(h)
        assert held.tensor is not None
        return held.tensor

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
            busy = sorted({s.peer for s in streams if not s.idle})
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

    def _land_embedding(self, producer: int, raw: torch.Tensor, staged: torch.Tensor | None) -> _Landed:
        headers = decode_header(raw, expected_channel=CHANNEL_EMBEDDING, peer=producer)
        now = time.monotonic()
        with self._cond:
            plan, counters = self._plans[producer], self._counters
            for header in headers:
                key = (header.sample_id, header.step)
                if plan:
                    if plan[0] != key:
                        raise PoolProtocolError(self._order_message(producer, plan[0], key))
                    plan.popleft()
                    self._awaited.discard((producer, *key))
                else:  # batched with expected items before this rank expected it: held until expect() names it
                    self._early.setdefault(producer, deque()).append(key)
                if self._specs:
                    self._check_header_spec(producer, header)
                tier = self._choose_tier(header.nbytes)
                counters.add_held(tier, header.nbytes, +1)
                if tier == "host":
                    counters.host_tier_items += 1
                self._held[(producer, *key)] = _Held(EmbeddingHandle(
                    header.sample_id, header.step, producer, self.rank, header.shape, header.dtype, header.nbytes,
                    tier), landing_t=now)
        return self._payload_views(headers, staged)

    def _check_header_spec(self, producer: int, header: WireHeader) -> None:
        """An item expected with specs must match them (lock held)."""
        spec = self._specs.pop((producer, *header.key), None)
        if spec is not None and spec != (header.shape, header.dtype):
            what = f"rank {self.rank}: sample {header.sample_id} (step {header.step}) from producer rank {producer}"
            raise PoolProtocolError(f"{what} was planned as {list(spec[0])} {spec[1]} but the producer sent "
                                    f"{list(header.shape)} {header.dtype}; the ranks disagree on the step plan")

    def _deliver_embeddings(self, producer: int, items: list[LandedItem]) -> None:
        """Hand a landed message's items to get(): one lock acquisition and one notification for the message."""
        with self._cond:
            held = [self._held[(producer, *header.key)] for header, _ in items]
        tensors = []
        for (header, buffer), entry in zip(items, held):
            tensor = self._unpack(header, buffer)
            # Off the lock: a device copy may take a while and get() of other items must not wait for it.
            if entry.handle.tier == "host" and tensor.device.type != "cpu":
                tensor = tensor.cpu()
            elif entry.handle.tier == "device" and tensor.device != self.device:
                tensor = tensor.to(self.device)
            tensors.append(tensor)
        with self._cond:
            for entry, tensor in zip(held, tensors):
                entry.tensor = tensor
            self._account_transfer(producer, held[0].landing_t)
            self._counters.bytes_received += sum(header.nbytes for header, _ in items)
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

    def _land_credit(self, consumer: int, raw: torch.Tensor, _: torch.Tensor | None) -> _Landed:
        return [(h, None) for h in decode_header(raw, expected_channel=CHANNEL_CREDIT, peer=consumer)], None

    def _deliver_credits(self, consumer: int, credits: list[LandedItem]) -> None:
        with self._cond:
            for credit, _ in credits:
                sent = self._sent.pop((consumer, *credit.key), None)
                if sent is None or sent.nbytes != credit.nbytes:
                    raise PoolProtocolError(f"rank {consumer} returned a credit for sample {credit.sample_id} (step "
                                            f"{credit.step}, {credit.nbytes} B) that rank {self.rank} has not sent "
                                            f"to it")
                self._counters.add_inflight(-credit.nbytes, -1)
            self._cond.notify_all()

    def _land_grad(self, consumer: int, raw: torch.Tensor, staged: torch.Tensor | None) -> _Landed:
        headers = decode_header(raw, expected_channel=CHANNEL_GRAD, peer=consumer)
        with self._cond:
            for header in headers:
                if (consumer, *header.key) not in self._grads_owed:
                    raise PoolProtocolError(f"rank {consumer} returned a gradient for sample {header.sample_id} "
                                            f"(step {header.step}) that rank {self.rank} did not send it (or got "
                                            f"twice)")
        return self._payload_views(headers, staged)

    def _deliver_grads(self, consumer: int, items: list[LandedItem]) -> None:
        grads = [self._unpack(header, buffer) for header, buffer in items]
        with self._cond:
            for (header, _), grad in zip(items, grads):
                key = (consumer, *header.key)
                self._grads_owed.discard(key)
                self._grads[key] = grad
                self._counters.grads_received += 1
                self._counters.grad_bytes_received += header.nbytes
            self._cond.notify_all()

    def _payload_views(self, headers: list[WireHeader], staged: torch.Tensor | None) -> _Landed:
        """The batch's receive buffer and each item's view of it (None: the item has no payload); `staged`: the
        message's staging buffer on a staged channel."""
        views, buffer = slice_payloads(headers, self._payload_device, staged,
                                       None if self._receive_buffers is None else self._receive_buffers.take)
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
                                       self._land_embedding, self._deliver_embeddings)
            elif channel == "grad":
                tags, land, deliver = (TAGS.grad_header, TAGS.grad_payload), self._land_grad, self._deliver_grads
            else:
                tags, land, deliver = (TAGS.credit, None), self._land_credit, self._deliver_credits
            stream = InboundStream(cond=self._cond, lock=self._lock, peer=peer, group=self.group, header_tag=tags[0],
                                   payload_tag=tags[1], header_len=HEADER_LEN,
                                   land=lambda raw, staged, p=peer, f=land: f(p, raw, staged),
                                   deliver=lambda items, p=peer, f=deliver: f(p, items),
                                   name=f"pool-r{self.rank}-{channel}-from-r{peer}", wire_device=self._wire_device,
                                   payload_group=self._payload_groups.get(
                                       CHANNEL_GRAD if channel == "grad" else CHANNEL_EMBEDDING),
                                   staged_tag=self._staged_tag(
                                       {"embedding": CHANNEL_EMBEDDING, "grad": CHANNEL_GRAD}.get(channel)),
                                   alloc=None if self._receive_buffers is None else self._receive_buffers.take)
            streams[peer] = stream
            stream.start()
        return stream

    def _staged_tag(self, channel: int | None) -> int | None:
        """The staged tag of a payload channel whose header and payload both move over gloo (see
        `wire.staged_bytes`); None elsewhere: device backends need a receive of the exact size."""
        if channel not in _STAGED_TAGS or channel in self._payload_groups or not self._gloo:
            return None
        return _STAGED_TAGS[channel]

    def _send(self, peer: int, header: WireHeader, payload: torch.Tensor | None) -> None:
        """Queue one item for `peer` on its channel's coalescing sender (call with the lock held)."""
        self._outbox(peer, header.channel).push(header, payload)

    def _outbox(self, peer: int, channel: int) -> Outbox:
        """The coalescing sender for (peer, channel), started on first use (call with the lock held)."""
        if self._closed:
            raise PoolError(f"rank {self.rank}: the pool is closed")
        self._raise_if_send_failed(peer, channel)
        box = self._outboxes.get((peer, channel))
        if box is None:
            header_tag, payload_tag = _OUT_TAGS[channel]
            box = Outbox(cond=self._cond, lock=self._lock, peer=peer, group=self.group, channel=channel,
                         header_tag=header_tag, payload_tag=payload_tag, max_batch_items=self.max_batch_items,
                         max_batch_bytes=self.max_batch_bytes,
                         on_sent=self._on_sent, name=f"pool-r{self.rank}-{CHANNEL_NAMES[channel]}-to-r{peer}",
                         wire_device=self._wire_device, payload_group=self._payload_groups.get(channel),
                         staged_tag=self._staged_tag(channel))
            self._outboxes[(peer, channel)] = box
            box.start()
        return box

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
        still = len(self._plans.get(producer, ()))
        return (f"rank {self.rank} waited {self.timeout_s:.1f} s for {what} from producer rank {producer} "
                f"({arrived} items from it are buffered, {still} expected items have not arrived)")
