"""Embeddings and their gradients between bridge ranks, in the order of the step plan, on the device backend.

In a MindSpeed-MM flow job every rank knows the whole step plan: which encoder replica produces each sample's
embedding, which decoder replica consumes it, in which order, and its size (image tokens x hidden). So nothing has
to be discovered at run time and the payloads can travel the way device backends want them: HCCL/NCCL match
point-to-point messages by order between a pair of ranks (not by tag), and every pair here has a fixed order:

- forward: a producer sends its items in its encode order; a consumer posts, per producer, one receive per item
  in that producer's send order as soon as the step starts (`batch_isend_irecv`), so an embedding lands while the
  decoder is still busy with an earlier microbatch (streaming), and `embedding()` waits only for the item it needs;
- backward: a consumer returns a microbatch's gradients in row order the moment autograd computes them; the
  producer posts the matching receives in that same order.

Payloads go over `payload_group` (the bridge ranks on the job's backend: HCCL on Ascend, NCCL on CUDA, gloo under
emulation), each preceded by a small int64 header over the gloo `header_group` carrying (step, sample, elements):
the receiver checks it against its plan, so ranks whose plans diverged (different data, different code) stop with
a message naming the peer and both items instead of training on another sample's embedding. Every wait has a
deadline and names the peer and the item when it expires.

Memory is bounded by the step: a consumer holds the receive buffers of one step's embeddings (what it consumes
anyway), a producer keeps each sent embedding until its send completes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mindspeed_flow.pool.transport import wait_work

_MAGIC = 0x464C4F57  # "FLOW"
KIND_EMBEDDING, KIND_GRAD = 1, 2
_KINDS = {KIND_EMBEDDING: "embedding", KIND_GRAD: "gradient"}


class FlowTransportError(RuntimeError):
    """A transfer that failed, timed out or did not match the plan; the message names the peer and the item."""


@dataclass
class _Pending:
    peer: int
    kind: int
    step: int
    sample_id: int
    header: torch.Tensor
    payload: torch.Tensor
    works: list


def _header(kind: int, step: int, sample_id: int, numel: int) -> torch.Tensor:
    return torch.tensor([_MAGIC, kind, step, sample_id, numel], dtype=torch.int64)


class PlannedTransport:
    """One rank's side of the encoder <-> decoder bridge (a producer, a consumer, or both)."""

    def __init__(self, *, rank: int, payload_group: Any, header_group: Any, device: torch.device, timeout_s: float,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.rank = rank
        self.payload_group = payload_group
        self.header_group = header_group
        self.device = device
        self.timeout_s = timeout_s
        self.dtype = dtype
        self._recv: dict[tuple[int, int, int, int], _Pending] = {}  # (peer, kind, step, sample) -> posted receive
        self._sends: list[_Pending] = []
        self.bytes_sent = {KIND_EMBEDDING: 0, KIND_GRAD: 0}
        self.wait_s = 0.0

    # ------------------------------------------------------------------ posting

    def post_receives(self, kind: int, peer: int, step: int, items: list[tuple[int, int]], hidden: int) -> None:
        """Post receives for (sample_id, tokens) items from `peer`, in the order `peer` sends them."""
        ops = []
        for sample_id, tokens in items:
            header = torch.empty(5, dtype=torch.int64)
            payload = torch.empty((tokens, hidden), dtype=self.dtype, device=self.device)
            pending = _Pending(peer, kind, step, sample_id, header, payload, [])
            ops.append((pending, dist.P2POp(dist.irecv, header, peer, self.header_group),
                        dist.P2POp(dist.irecv, payload, peer, self.payload_group)))
            key = (peer, kind, step, sample_id)
            if key in self._recv:
                raise FlowTransportError(f"rank {self.rank}: {_KINDS[kind]} of sample {sample_id} (step {step}) from "
                                         f"rank {peer} is already expected")
            self._recv[key] = pending
        if not ops:
            return
        # Headers (gloo) and payloads (device backend) are batched per group: a batch must not mix backends.
        header_works = dist.batch_isend_irecv([h for _, h, _ in ops])
        payload_works = dist.batch_isend_irecv([p for _, _, p in ops])
        for (pending, _, _), hw, pw in zip(ops, header_works, payload_works):
            pending.works = [hw, pw]

    def send(self, kind: int, peer: int, step: int, sample_id: int, tensor: torch.Tensor) -> None:
        """Send one item (its header over gloo, the payload over the device backend) without waiting."""
        payload = tensor.detach().to(device=self.device, dtype=self.dtype).reshape(-1, tensor.shape[-1]).contiguous()
        header = _header(kind, step, sample_id, payload.numel())
        try:
            works = [dist.isend(header, peer, group=self.header_group),
                     dist.isend(payload, peer, group=self.payload_group)]
        except RuntimeError as exc:
            raise FlowTransportError(f"rank {self.rank}: sending the {_KINDS[kind]} of sample {sample_id} (step "
                                     f"{step}) to rank {peer} failed: {exc}") from exc
        self._sends.append(_Pending(peer, kind, step, sample_id, header, payload, works))
        self.bytes_sent[kind] += payload.numel() * payload.element_size()
        self._reap(block=False)

    # ------------------------------------------------------------------ receiving

    def receive(self, kind: int, peer: int, step: int, sample_id: int) -> torch.Tensor:
        """Wait for a posted item; check its header against the plan; return the payload ([tokens, hidden])."""
        key = (peer, kind, step, sample_id)
        pending = self._recv.pop(key, None)
        what = f"the {_KINDS[kind]} of sample {sample_id} (step {step}) from rank {peer}"
        if pending is None:
            raise FlowTransportError(f"rank {self.rank}: {what} was never expected (plans differ between ranks?)")
        start = time.monotonic()
        self._wait(pending, f"rank {self.rank} waited {self.timeout_s:.0f} s for {what}")
        self.wait_s += time.monotonic() - start
        magic, got_kind, got_step, got_sample, numel = (int(v) for v in pending.header.tolist())
        if (magic, got_kind, got_step, got_sample, numel) != (_MAGIC, kind, step, sample_id, pending.payload.numel()):
            raise FlowTransportError(
                f"rank {self.rank} expected {what} ({pending.payload.numel()} elements) but rank {peer} sent "
                f"{_KINDS.get(got_kind, got_kind)} of sample {got_sample} (step {got_step}, {numel} elements): the "
                "ranks' step plans differ (same data.json, sampler seed and mindspeed-flow version on every rank?)")
        return pending.payload

    def flush(self) -> None:
        """Wait until every send of this rank has been received."""
        self._reap(block=True)

    # ------------------------------------------------------------------ internals

    def _wait(self, pending: _Pending, timeout_message: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        for work in pending.works:
            wait_work(work, deadline, on_timeout=lambda: FlowTransportError(timeout_message),
                      on_failure=lambda exc: FlowTransportError(f"{timeout_message}: transport failed ({exc})"))

    def _reap(self, block: bool) -> None:
        keep = []
        for s in self._sends:
            if block:
                self._wait(s, f"rank {self.rank} waited {self.timeout_s:.0f} s for rank {s.peer} to receive the "
                              f"{_KINDS[s.kind]} of sample {s.sample_id} (step {s.step})")
            elif not all(w.is_completed() for w in s.works):
                keep.append(s)
                continue
            else:
                for w in s.works:
                    w.wait()  # a completed gloo work must still be waited once
        self._sends = keep
