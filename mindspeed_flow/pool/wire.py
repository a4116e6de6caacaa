"""Wire format of the embedding pool: channel tags, the fixed-size batch header, and payload byte layout.

Every message between a producer (encoder rank) and a consumer (backbone first-stage rank) is a small int64
header describing a batch of 1..`MAX_BATCH` items, followed, for tensors, by one payload message on the payload
tag holding the items' raw bytes at aligned offsets (`payload_layout`), posted together with the header. One item
goes as its own bytes without a copy; several are copied into one buffer, so a batch of small embeddings is one
transfer (one rendezvous on gloo) and the receiver hands out views of one buffer instead of allocating per item.
The header is fixed-size so the receiver can post its receive before it knows anything about the batch; payloads
are `uint8` so one code path carries every dtype (gloo, NCCL and HCCL all move bytes), and their sizes follow from
the header, so shapes never have to be agreed in advance. Batching is what keeps small items cheap: a 64-token
embedding costs one record in a shared header and one credit record, not a header and a credit message of its
own, and no thread hand-off of its own.

Credits travel as payload-less batches on their own channel (an item record whose shape is the credited bytes).

Dense batches (wire version 5, `EmbeddingPool.put_many`): the items of one encoder forward, one dtype, travel
with their bytes back to back instead of at aligned offsets, so the encoder's output region can be sent as it is.
The planned mode (`planned.py`) sends one item per header in the same layout, on tags of its own.

Each channel has its own tags (a header tag and a payload tag): messages with the same (peer, tag) are
delivered in order, so a prefetched header can never be matched by a payload, and embeddings, gradients and
credits never mix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from mindspeed_flow.pool.errors import PoolProtocolError

HEADER_MAGIC = 0x4D53_464C_4F57  # "MSFLOW": a header that does not start with it came from the wrong tag/peer
WIRE_VERSION = 5  # 2: batched headers; 3: one payload buffer per batch; 4: planned items (gone); 5: dense batches
MAX_NDIM = 8
# On a gloo channel every message carries one "staged" message on the channel's staged tag, into a receive that the
# consumer posted together with the message's header receive: the payload when it fits that receive, else nothing
# (the payload then follows on the payload tag), so receives and messages pair one to one. Why: gloo moves a
# message only once its receive is posted (the sender waits for the receiver's notice), and a receive posted only
# once the header has landed is always late (measured, 4 MiB on loopback: 0.5 ms with the receive posted first,
# 3.2 ms with it posted 0.3 ms late). gloo accepts a message smaller than its receive, never a larger one, so both
# ends must agree on the receive's size without talking: it is the channel's previous payload rounded up to a power
# of two, within [STAGED_MIN_BYTES, STAGED_MAX_BYTES], which both ends know when they decide (`staged_bytes`). A
# stream of similar batches therefore always travels staged, whatever their size up to the maximum.
STAGED_MIN_BYTES = 4 << 20
STAGED_MAX_BYTES = 32 << 20


def staged_bytes(previous_payload: int) -> int:
    """The staged receive's size for a channel's next message, from the previous message's payload bytes (0: none)."""
    return min(STAGED_MAX_BYTES, max(STAGED_MIN_BYTES, 1 << max(previous_payload - 1, 0).bit_length()))


def staged_chunks(staged: int) -> int:
    """How many messages a staged message of `staged` bytes travels as: chunks of STAGED_MIN_BYTES, each into its own
    receive at its offset of one buffer, so the payload lands contiguous. One 16 MiB gloo message moved 5-20% slower
    than four of 4 MiB, receives posted first (measured on loopback: 4.2-6.7 ms against 3.9-5.3 ms)."""
    return max(1, staged // STAGED_MIN_BYTES)


def travels_staged(nbytes: int, staged: int) -> bool:
    """Whether a payload of `nbytes` rides in a staged message of `staged` bytes (both ends decide by this rule)."""
    return nbytes <= staged


MAX_BATCH = 16  # items per message: bounds the header (213 int64) while amortising per-message costs 16-fold
PAYLOAD_ALIGN = 64  # byte alignment of each item inside a batch's payload buffer (>= every dtype's element size)

# Header layout (int64): magic, version, channel, count, layout (0: aligned, 1: dense), then MAX_BATCH item records
# of sample_id, step, dtype code, ndim, nbytes, dims[MAX_NDIM] (unused records are zero).
_MESSAGE_FIELDS = 5
_ITEM_FIELDS = 5 + MAX_NDIM


def header_len(max_items: int) -> int:
    """The int64 length of a header holding up to `max_items` item records (both ends must agree on it)."""
    return _MESSAGE_FIELDS + max_items * _ITEM_FIELDS


HEADER_LEN = header_len(MAX_BATCH)


@dataclass(frozen=True)
class PoolTags:
    """Point-to-point tags per channel. Far from 0 so they never collide with pipelining's default tag."""

    embedding_header: int = 0x4D50_0001
    embedding_payload: int = 0x4D50_0002
    grad_header: int = 0x4D50_0003
    grad_payload: int = 0x4D50_0004
    credit: int = 0x4D50_0005
    # Planned mode (planned.py): embedding headers and payloads, posted in the plan's global embedding order
    embedding_planned_header: int = 0x4D50_0006
    embedding_planned: int = 0x4D50_0007
    # Staged payloads (gloo): into a receive the consumer posted with the header's receive (see `staged_bytes`)
    embedding_staged: int = 0x4D50_0008
    grad_staged: int = 0x4D50_0009
    # Planned mode (planned.py): gradient headers and payloads, posted in the plan's global gradient order
    grad_planned_header: int = 0x4D50_000A
    grad_planned: int = 0x4D50_000B
    # Planned mode (planned.py): an image's patch rows from the rank that loaded it to the encoder rank that encodes
    # it (the FSDP2 flow job); they travel the gradients' direction, consumer -> producer, in that global order
    pixels_planned_header: int = 0x4D50_000C
    pixels_planned: int = 0x4D50_000D


TAGS = PoolTags()

CHANNEL_EMBEDDING = 1
CHANNEL_GRAD = 2
CHANNEL_CREDIT = 3
CHANNEL_PIXELS = 4
CHANNEL_NAMES = {CHANNEL_EMBEDDING: "embedding", CHANNEL_GRAD: "gradient", CHANNEL_CREDIT: "credit",
                 CHANNEL_PIXELS: "pixels"}

# Stable codes (never reorder: both ends of a run must agree, and a checkpointed plan may outlive a version).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
_CODE_TO_DTYPE = {code: dtype for dtype, code in DTYPE_CODES.items()}


class WireHeader(NamedTuple):
    """One item of a batch: which item this is and how to find and view its bytes.

    A named tuple, not a dataclass: a batch builds one per item on both ends of every message, and a frozen
    dataclass costs three times as much to make."""

    channel: int
    sample_id: int
    step: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    # The batch's payload is its items' bytes back to back (`put_many`: one dtype, often one region of the encoder's
    # output sent without a copy) instead of at PAYLOAD_ALIGN offsets; set on every item of the message alike.
    dense: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.sample_id, self.step)


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * dtype.itemsize  # not torch.empty(): a factory call per item costs a GIL hand-off in put()


def check_sendable(tensor: torch.Tensor, what: str) -> None:
    """Reject what the header cannot describe, naming the item, before anything is sent."""
    if tensor.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise TypeError(f"{what}: dtype {tensor.dtype} cannot travel through the pool (supported: {supported})")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"{what}: tensor has {tensor.dim()} dims, the pool header holds at most {MAX_NDIM}")


def item_header(channel: int, sample_id: int, step: int, tensor: torch.Tensor, dense: bool = False) -> WireHeader:
    """The record announcing `tensor` as item (sample_id, step) on `channel` (`dense`: see WireHeader)."""
    return WireHeader(channel, sample_id, step, tensor.dtype, tuple(tensor.shape),
                      tensor.numel() * tensor.element_size(), dense)


def credit_header(sample_id: int, step: int, nbytes: int) -> WireHeader:
    """A credit: the consumer took item (sample_id, step) of `nbytes` out of the pool (no payload)."""
    return WireHeader(CHANNEL_CREDIT, sample_id, step, torch.uint8, (nbytes,), nbytes)


def encode_header(items: list[WireHeader], length: int = HEADER_LEN) -> torch.Tensor:
    """The int64 header announcing a batch of items of one channel and layout (a CPU tensor) of `length` values
    (`header_len`: a receiver that knows it gets one item, as planned mode does, posts a short receive)."""
    most = min(MAX_BATCH, (length - _MESSAGE_FIELDS) // _ITEM_FIELDS)
    if (not 1 <= len(items) <= most or len({h.channel for h in items}) != 1
            or len({h.dense for h in items}) != 1):
        raise ValueError(f"a pool message carries 1..{most} items of one channel and one layout, got "
                         f"{len(items)}")
    values = [HEADER_MAGIC, WIRE_VERSION, items[0].channel, len(items), int(items[0].dense)]
    for h in items:
        values += [h.sample_id, h.step, DTYPE_CODES[h.dtype], len(h.shape), h.nbytes, *h.shape]
        values += [0] * (MAX_NDIM - len(h.shape))
    values += [0] * (length - len(values))
    return torch.tensor(values, dtype=torch.int64)


def decode_header(header: torch.Tensor, *, expected_channel: int, peer: int) -> list[WireHeader]:
    """Decode and validate a received header; garbage means a tag collision or a peer on another version."""
    values = header.cpu().tolist()  # ints already
    magic, version, channel, count, dense = values[:_MESSAGE_FIELDS]
    if magic != HEADER_MAGIC or version != WIRE_VERSION:
        raise PoolProtocolError(f"a message from rank {peer} is not a pool header (magic {magic:#x}, version "
                                f"{version}); another user of the process group sends on the pool's tags, or the "
                                f"peer runs a different mindspeed-flow version")
    if channel != expected_channel:
        raise PoolProtocolError(f"rank {peer} sent a {CHANNEL_NAMES.get(channel, channel)} header on the "
                                f"{CHANNEL_NAMES[expected_channel]} channel")
    if not 1 <= count <= min(MAX_BATCH, (len(values) - _MESSAGE_FIELDS) // _ITEM_FIELDS) or dense not in (0, 1):
        raise PoolProtocolError(f"rank {peer} sent a header announcing {count} items (1..{MAX_BATCH} allowed) in "
                                f"layout {dense} (0 or 1)")
    items = []
    for i in range(count):
        at = _MESSAGE_FIELDS + i * _ITEM_FIELDS
        sample_id, step, dtype_code, ndim, nbytes = values[at:at + 5]
        if dtype_code not in _CODE_TO_DTYPE or not 0 <= ndim <= MAX_NDIM:
            raise PoolProtocolError(f"rank {peer} sent a header with dtype code {dtype_code} and ndim {ndim}")
        shape = tuple(values[at + 5:at + 5 + ndim])
        dtype = _CODE_TO_DTYPE[dtype_code]
        if tensor_nbytes(shape, dtype) != nbytes:
            raise PoolProtocolError(f"rank {peer} sent a header for sample {sample_id} (step {step}) whose size "
                                    f"{nbytes} B does not match shape {list(shape)} of {dtype}")
        items.append(WireHeader(channel, sample_id, step, dtype, shape, nbytes, bool(dense)))
    return items


def has_payload(item: WireHeader) -> bool:
    """Whether a payload message follows the header for this item (credits and empty tensors have none)."""
    return item.channel != CHANNEL_CREDIT and item.nbytes > 0


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous copy of `tensor` (what goes on the wire; no copy if contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def from_bytes(buffer: torch.Tensor, header: WireHeader) -> torch.Tensor:
    """The tensor described by `header`, viewing the received bytes without a copy (a view `slice_payloads` already
    typed and shaped is returned as it is)."""
    if buffer.dtype == header.dtype and buffer.shape == header.shape:
        return buffer
    return buffer.view(header.dtype).reshape(header.shape)


def payload_layout(items: list[WireHeader]) -> tuple[list[int | None], int]:
    """Where each item's bytes sit in its batch's one payload buffer, and the buffer's size.

    Offsets are multiples of `PAYLOAD_ALIGN`, so every item's view of the buffer can be reinterpreted as its
    dtype (a view needs an offset divisible by the element size) and starts on its own cache line. Items without
    a payload get None. Both ends compute the layout from the header alone, so it never travels. A dense batch
    (`WireHeader.dense`, one dtype) has its items back to back: every offset is still a multiple of the element size.
    """
    offsets: list[int | None] = []
    total = 0
    for item in items:
        if not has_payload(item):
            offsets.append(None)
            continue
        if not item.dense:
            total = -(-total // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        offsets.append(total)
        total += item.nbytes
    return offsets, total


def pack_payloads(items: list[WireHeader], tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The batch's one payload buffer, on the tensors' device (None: no item has a payload).

    A batch with one payload sends that tensor's bytes as they are (no copy); several are copied into one buffer
    at `payload_layout`'s offsets, so the batch costs one transfer instead of one per item (and, on gloo, one
    rendezvous round trip instead of one per item).
    """
    offsets, total = payload_layout(items)
    with_payload = [(off, t) for off, t in zip(offsets, tensors) if off is not None]
    if not with_payload:
        return None
    if len(with_payload) == 1:
        return as_bytes(with_payload[0][1])
    buffer = torch.empty(total, dtype=torch.uint8, device=with_payload[0][1].device)
    for off, tensor in with_payload:
        flat = as_bytes(tensor)
        buffer[off:off + flat.numel()].copy_(flat)
    return buffer


def dense_payload(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of `tensors` (one dtype) back to back, as one flat uint8 tensor (None: no bytes at all).

    Tensors that are adjacent, in order, in one contiguous storage (an encoder's batched output split per image)
    are sent as that region of the storage, without a copy; anything else is concatenated into one staging buffer.
    """
    full = [t for t in tensors if t.numel() > 0]
    if not full:
        return None
    first, itemsize = full[0], full[0].element_size()
    at = first.storage_offset()
    adjacent = True
    for t in full:
        if not t.is_contiguous() or t.storage_offset() != at or t.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr():
            adjacent = False
            break
        at += t.numel()
    if not adjacent:
        return torch.cat([t.detach().reshape(-1) for t in full]).view(torch.uint8)
    region = torch.empty(0, dtype=torch.uint8, device=first.device)
    start = first.storage_offset() * itemsize
    return region.set_(first.untyped_storage(), start, ((at - first.storage_offset()) * itemsize,))


def slice_payloads(items: list[WireHeader], device: torch.device, staged: torch.Tensor | None = None,
                   alloc: Callable[[int], torch.Tensor] | None = None
                   ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """A receive buffer for the batch's payload and each item's view of it (None: the item has no payload; a dense
    batch's views are already of the item's dtype and shape).

    The views share the buffer: an item kept alive keeps its whole batch's buffer (at most one batch, whose size
    the sender bounds), which is why large items travel alone. `staged`: the staging receive posted for this
    message (see `staged_bytes`); a payload that fills at least a quarter of it is viewed in place (no copy, at
    most 4x the payload's memory held), a smaller one gets a buffer of its own that the bytes are copied into.
    `alloc(nbytes)`: where a host buffer comes from (the pool's `ReceiveBuffers`); a fresh one without it.
    """
    offsets, total = payload_layout(items)
    if all(off is None for off in offsets):
        return [None] * len(items), None
    if staged is not None and staged.numel() // 4 <= total <= staged.numel():
        buffer = staged[:total]
    elif alloc is not None:
        buffer = alloc(total)
    else:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    if items[0].dense:  # one dtype, back to back: the items as typed views, cut in one call (a third of the cost)
        full = [i for i, off in enumerate(offsets) if off is not None]
        itemsize = items[0].dtype.itemsize
        typed = buffer[:total].view(items[0].dtype).split([items[i].nbytes // itemsize for i in full])
        views: list[torch.Tensor | None] = [None] * len(items)
        for i, view in zip(full, typed):
            views[i] = view.view(items[i].shape)
        return views, buffer
    return [None if off is None else buffer[off:off + item.nbytes] for off, item in zip(offsets, items)], buffer
