"""Wire format of the embedding pool: channel tags, the fixed-size header, and payload byte views.

Every message between a producer (encoder rank) and a consumer (backbone first-stage rank) is a small int64
header followed, for tensors, by the payload as raw bytes. The header is fixed-size so the receiver can post
its receive before it knows anything about the item; the payload is sent as `uint8` so one code path carries
every dtype (gloo, NCCL and HCCL all move bytes), and its size comes from the header, so shapes never have to be
agreed in advance.

Each channel has its own tags (a header tag and a payload tag): messages with the same (peer, tag) are
delivered in order, so with one tag per message kind a prefetched header can never be matched by a payload,
and embeddings, gradients and credits never mix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mindspeed_flow.pool.errors import PoolProtocolError

HEADER_MAGIC = 0x4D53_464C_4F57  # "MSFLOW": a header that does not start with it came from the wrong tag/peer
WIRE_VERSION = 1
MAX_NDIM = 8

# Header layout (int64): magic, version, channel, sample_id, step, dtype code, ndim, nbytes, dims[MAX_NDIM].
_FIXED_FIELDS = 8
HEADER_LEN = _FIXED_FIELDS + MAX_NDIM
# A credit is (sample_id, step, nbytes): it tells the producer that the consumer took the item out of the pool.
CREDIT_LEN = 3


@dataclass(frozen=True)
class PoolTags:
    """Point-to-point tags per channel. Far from 0 so they never collide with pipelining's default tag."""

    embedding_header: int = 0x4D50_0001
    embedding_payload: int = 0x4D50_0002
    grad_header: int = 0x4D50_0003
    grad_payload: int = 0x4D50_0004
    credit: int = 0x4D50_0005


TAGS = PoolTags()

CHANNEL_EMBEDDING = 1
CHANNEL_GRAD = 2
CHANNEL_NAMES = {CHANNEL_EMBEDDING: "embedding", CHANNEL_GRAD: "gradient"}

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


@dataclass(frozen=True)
class WireHeader:
    """A decoded header: which item this is and how to allocate its payload."""

    channel: int
    sample_id: int
    step: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.sample_id, self.step)


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


def check_sendable(tensor: torch.Tensor, what: str) -> None:
    """Reject what the header cannot describe, naming the item, before anything is sent."""
    if tensor.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise TypeError(f"{what}: dtype {tensor.dtype} cannot travel through the pool (supported: {supported})")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"{what}: tensor has {tensor.dim()} dims, the pool header holds at most {MAX_NDIM}")


def encode_header(channel: int, sample_id: int, step: int, tensor: torch.Tensor) -> torch.Tensor:
    """The int64 header announcing `tensor` as item (sample_id, step) on `channel` (a CPU tensor)."""
    shape = tuple(tensor.shape)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:_FIXED_FIELDS] = torch.tensor([HEADER_MAGIC, WIRE_VERSION, channel, sample_id, step,
                                           DTYPE_CODES[tensor.dtype], len(shape),
                                           tensor_nbytes(shape, tensor.dtype)], dtype=torch.int64)
    if shape:
        header[_FIXED_FIELDS:_FIXED_FIELDS + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor, *, expected_channel: int, peer: int) -> WireHeader:
    """Decode and validate a received header; garbage means a tag collision or a peer on another version."""
    values = [int(v) for v in header.cpu().tolist()]
    magic, version, channel, sample_id, step, dtype_code, ndim, nbytes = values[:_FIXED_FIELDS]
    if magic != HEADER_MAGIC or version != WIRE_VERSION:
        raise PoolProtocolError(f"a message from rank {peer} is not a pool header (magic {magic:#x}, version "
                                f"{version}); another user of the process group sends on the pool's tags, or the "
                                f"peer runs a different mindspeed-flow version")
    if channel != expected_channel:
        raise PoolProtocolError(f"rank {peer} sent a {CHANNEL_NAMES.get(channel, channel)} header on the "
                                f"{CHANNEL_NAMES[expected_channel]} channel")
    if dtype_code not in _CODE_TO_DTYPE or not 0 <= ndim <= MAX_NDIM:
        raise PoolProtocolError(f"rank {peer} sent a header with dtype code {dtype_code} and ndim {ndim}")
    shape = tuple(values[_FIXED_FIELDS:_FIXED_FIELDS + ndim])
    dtype = _CODE_TO_DTYPE[dtype_code]
    if tensor_nbytes(shape, dtype) != nbytes:
        raise PoolProtocolError(f"rank {peer} sent a header for sample {sample_id} (step {step}) whose size "
                                f"{nbytes} B does not match shape {list(shape)} of {dtype}")
    return WireHeader(channel, sample_id, step, dtype, shape, nbytes)


def encode_credit(sample_id: int, step: int, nbytes: int) -> torch.Tensor:
    return torch.tensor([sample_id, step, nbytes], dtype=torch.int64)


def decode_credit(credit: torch.Tensor) -> tuple[int, int, int]:
    sample_id, step, nbytes = (int(v) for v in credit.tolist())
    return sample_id, step, nbytes


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous copy of `tensor` (what goes on the wire)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def from_bytes(buffer: torch.Tensor, header: WireHeader) -> torch.Tensor:
    """The tensor described by `header`, viewing the received bytes without a copy."""
    return buffer.view(header.dtype).reshape(header.shape)
