"""Embeddings and their gradients between bridge ranks, in the order of the step plan, on the device backend.

In a MindSpeed-MM flow job every rank knows the whole step plan: which encoder replica produces each sample's
embedding, which decoder replica consumes it, in which order, and its size (image tokens x hidden). So nothing has
to be discovered at run time and the payloads can travel the way device backends want them.

Device backends (HCCL, NCCL) run the point-to-point operations of one communicator in issue order on one stream,
and a send completes only when the peer's stream reaches the matching receive. Two rules follow, and both are
kept here:

- **one communicator per direction**: embeddings (encoder -> decoder) travel on `embedding_group`, gradients
  (decoder -> encoder) on `gradient_group`. On one shared communicator an encoder's posted gradient receives
  would sit in front of its own embedding sends, and the decoder could never compute those gradients;
- **one global order per direction**: every rank issues its operations of a step in the order of one total
  order over the step's items (`schedule.embedding_order` / `schedule.gradient_order`), restricted to its own
  items. Then the item earliest in that order is always at the head of both its ends' streams, so there is no
  cycle of waits, whatever the number of producers and consumers.

Each receive is posted as its own operation (`isend`/`irecv`), never as one `batch_isend_irecv`: backends that
coalesce a batch (NCCL, and HCCL through torch_npu's own `batch_isend_irecv`) return ONE work for the whole batch,
so waiting on "the work of item k" would wait on nothing, or on everything. A consumer posts every embedding of a
step at the step's start; each lands as soon as it is encoded, while the decoder works on earlier microbatches
(streaming), and `receive()` waits only for the item it needs.

Payloads go over the device groups (HCCL on Ascend, NCCL on CUDA, the emulated HCCL under `mindspeed-flow
emulate`), each preceded by a small int64 header over the gloo `header_group` carrying (step, sample, elements): the
receiver checks it against its plan before using the payload, so ranks whose plans diverged (different data,
different code) stop with a message naming both ranks and both items instead of training on another sample's
embedding. The header is also what the deadline watches: it is a host message, so waiting for it with a timeout
costs no device synchronisation; the payload's work is then waited on the device stream only.

Memory is bounded by the step: a consumer holds the receive buffers of one step's embeddings (what it consumes
anyway), a producer keeps each sent embedding until its send completes (a frozen encoder waits, with
`wait_sent`, once `flow.encoder_inflight` groups are in flight).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.pool.transport import wait_work

_MAGIC = 0x464C4F57  # "FLOW"
KIND_EMBEDDING, KIND_GRAD = 1, 2
_KINDS = {KIND_EMBEDDING: "embedding", KIND_GRAD: "gradient"}
HEADER_ELEMENTS = 5


class FlowTransportError(RuntimeError):
    """A transfer that failed, timed out or did not match the plan; the message names the peer and the item."""


@dataclass(frozen=True)
class Item:
    """One planned transfer: `tokens` rows of the hidden size, for `sample_id` of `step`, from or to `peer`."""

    peer: int
    step: int
    sample_id: int
    tokens: int


@dataclass
class _Pending:
    item: Item
    kind: int
    header: torch.Tensor
    payload: torch.Tensor
    header_work: Any
    payload_work: Any


def _header(kind: int, step: int, sample_id: int, numel: int) -> torch.Tensor:
    """(magic, kind, step, sample, elements); `step` counts from 0, messages name Megatron's iteration (step + 1)."""
    return torch.tensor([_MAGIC, kind, step, sample_id, numel], dtype=torch.int64)


class PlannedTransport:
    """One rank's side of the encoder <-> decoder bridge (a producer, a consumer, or both)."""

    def __init__(self, *, rank: int, embedding_group: Any, gradient_group: Any, header_group: Any,
                 device: torch.device, timeout_s: float, dtype: torch.dtype = torch.bfloat16,
                 describe: Callable[[int], str] = lambda r: f"rank {r}") -> None:
        self.rank = rank
        self.groups = {KIND_EMBEDDING: embedding_group, KIND_GRAD: gradient_group}
        self.header_group = header_group
        self.device = device
        self.timeout_s = timeout_s
        self.dtype = dtype
        self.describe = describe
        self._recv: dict[tuple[int, int, int, int], _Pending] = {}  # (peer, kind, step, sample) -> posted receive
        self._sends: list[_Pending] = []
        self.bytes_sent = {KIND_EMBEDDING: 0, KIND_GRAD: 0}
        self.bytes_received = {KIND_EMBEDDING: 0, KIND_GRAD: 0}  # payloads taken by receive() (for the metrics)

    def _what(self, kind: int, item: Item, direction: str) -> str:
        return (f"the {_KINDS[kind]} of sample {item.sample_id} (iteration {item.step + 1}) {direction} "
                f"{self.describe(item.peer)}")

    # ------------------------------------------------------------------ posting

    def post_receives(self, kind: int, items: Sequence[Item], hidden: int) -> None:
        """Post one receive per item, in the given order (the plan's global order restricted to this rank)."""
        for item in items:
            key = (item.peer, kind, item.step, item.sample_id)
            if key in self._recv:
                raise FlowTransportError(f"{self.describe(self.rank)}: {self._what(kind, item, 'from')} is already "
                                         "expected")
            header = torch.empty(HEADER_ELEMENTS, dtype=torch.int64)
            payload = torch.empty((item.tokens, hidden), dtype=self.dtype, device=self.device)
            try:
                header_work = dist.irecv(header, item.peer, group=self.header_group)
                payload_work = dist.irecv(payload, item.peer, group=self.groups[kind])
            except RuntimeError as exc:
                raise FlowTransportError(f"{self.describe(self.rank)}: posting the receive of "
                                         f"{self._what(kind, item, 'from')} failed: {exc}") from exc
            self._recv[key] = _Pending(item, kind, header, payload, header_work, payload_work)

    def send(self, kind: int, peer: int, step: int, sample_id: int, tensor: torch.Tensor) -> None:
        """Send one item (its header over gloo, the payload over the device backend) without waiting."""
        payload = tensor.detach().to(dtype=self.dtype).reshape(-1, tensor.shape[-1]).contiguous()
        item = Item(peer, step, sample_id, int(payload.shape[0]))
        header = _header(kind, step, sample_id, payload.numel())
        try:
            header_work = dist.isend(header, peer, group=self.header_group)
            payload_work = dist.isend(payload, peer, group=self.groups[kind])
        except RuntimeError as exc:
            raise FlowTransportError(f"{self.describe(self.rank)}: sending {self._what(kind, item, 'to')} failed: "
                                     f"{exc}") from exc
        self._sends.append(_Pending(item, kind, header, payload, header_work, payload_work))
        self.bytes_sent[kind] += payload.numel() * payload.element_size()
        self._reap(block=False)

    # ------------------------------------------------------------------ receiving

    def receive(self, kind: int, peer: int, step: int, sample_id: int) -> torch.Tensor:
        """Wait for a posted item; check its header against the plan; return the payload ([tokens, hidden])."""
        key = (peer, kind, step, sample_id)
        pending = self._recv.pop(key, None)
        item = Item(peer, step, sample_id, 0)
        what = self._what(kind, item, "from")
        me = self.describe(self.rank)
        if pending is None:
            raise FlowTransportError(f"{me}: {what} was never expected (plans differ between ranks?)")
        deadline = time.monotonic() + self.timeout_s
        wait_work(pending.header_work, deadline,
                  on_timeout=lambda: FlowTransportError(f"{me} waited {self.timeout_s:.0f} s for {what}: "
                                                        f"{self.describe(peer)} is hung or far behind"),
                  on_failure=lambda exc: FlowTransportError(f"{me}: the transfer of {what} failed ({exc}); "
                                                            f"{self.describe(peer)} probably died"))
        magic, got_kind, got_step, got_sample, numel = (int(v) for v in pending.header.tolist())
        if (magic, got_kind, got_step, got_sample, numel) != (_MAGIC, kind, step, sample_id, pending.payload.numel()):
            raise FlowTransportError(
                f"{me} expected {what} ({pending.payload.numel()} elements) but {self.describe(peer)} sent "
                f"{_KINDS.get(got_kind, got_kind)} of sample {got_sample} (iteration {got_step + 1}, {numel} "
                "elements): the ranks' step plans differ (same data.json, sampler seed and mindspeed-flow version on "
                "every rank?)")
        # The header proves the peer posted the payload's send. Wait on the payload without a timeout: device
        # backends then only order the current stream after the transfer (a timeout would make NCCL/HCCL block
        # the host until it completes); gloo returns once the bytes are in.
        try:
            pending.payload_work.wait()
        except RuntimeError as exc:
            raise FlowTransportError(f"{me}: the transfer of {what} failed ({exc})") from exc
        self.bytes_received[kind] += pending.payload.numel() * pending.payload.element_size()
        return pending.payload

    def flush(self) -> None:
        """Wait until every send of this rank has been received."""
        self._reap(block=True)

    def wait_sent(self, kind: int, step: int, sample_ids: Sequence[int]) -> None:
        """Wait until this rank's sends of these samples have been received (the encoder's in-flight bound)."""
        ids = set(sample_ids)
        self._reap(block=True, only=lambda s: s.kind == kind and s.item.step == step and s.item.sample_id in ids)

    def pending_receives(self) -> int:
        return len(self._recv)

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
                what = self._what(s.kind, s.item, "to")
                for work in works:
                    wait_work(work, deadline,
                              on_timeout=lambda: FlowTransportError(
                                  f"{self.describe(self.rank)} waited {self.timeout_s:.0f} s for "
                                  f"{self.describe(s.item.peer)} to receive {what}"),
                              on_failure=lambda exc: FlowTransportError(
                                  f"{self.describe(self.rank)}: sending {what} failed ({exc})"))
            elif not all(w.is_completed() for w in works):
                keep.append(s)
                continue
            else:
                for w in works:
                    w.wait()  # a completed gloo work must still be waited once
        self._sends = keep
