"""The pool's wire format: headers round-trip every supported dtype/shape, and garbage is rejected by name."""
from __future__ import annotations

import pytest
import torch

from mindspeed_flow.pool import PoolProtocolError
from mindspeed_flow.pool.wire import (CHANNEL_EMBEDDING, CHANNEL_GRAD, DTYPE_CODES, HEADER_LEN, MAX_NDIM, TAGS,
                                      as_bytes, check_sendable, decode_credit, decode_header, encode_credit,
                                      encode_header, from_bytes)


@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES, key=str))
@pytest.mark.parametrize("shape", [(), (0, 8), (7, 3), (2, 3, 4, 1)])
def test_header_and_payload_round_trip(dtype: torch.dtype, shape: tuple[int, ...]):
    tensor = (torch.arange(torch.Size(shape).numel()) % 5).reshape(shape).to(dtype)
    header = encode_header(CHANNEL_EMBEDDING, 17, 3, tensor)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    meta = decode_header(header, expected_channel=CHANNEL_EMBEDDING, peer=0)
    assert (meta.sample_id, meta.step, meta.dtype, meta.shape) == (17, 3, dtype, shape)
    payload = as_bytes(tensor)
    assert payload.dtype == torch.uint8 and payload.numel() == meta.nbytes
    assert torch.equal(from_bytes(payload.clone(), meta), tensor)


def test_non_contiguous_tensor_travels_as_its_values():
    tensor = torch.arange(12.0).reshape(3, 4).t()
    meta = decode_header(encode_header(CHANNEL_GRAD, 1, 0, tensor), expected_channel=CHANNEL_GRAD, peer=2)
    assert torch.equal(from_bytes(as_bytes(tensor).clone(), meta), tensor)


def test_garbage_and_wrong_channel_are_named():
    with pytest.raises(PoolProtocolError, match="from rank 3 is not a pool header"):
        decode_header(torch.zeros(HEADER_LEN, dtype=torch.int64), expected_channel=CHANNEL_EMBEDDING, peer=3)
    grad_header = encode_header(CHANNEL_GRAD, 1, 0, torch.ones(2))
    with pytest.raises(PoolProtocolError, match="rank 5 sent a gradient header on the embedding channel"):
        decode_header(grad_header, expected_channel=CHANNEL_EMBEDDING, peer=5)
    lying = encode_header(CHANNEL_EMBEDDING, 4, 1, torch.ones(2, 2))
    lying[7] += 1  # nbytes no longer matches the shape
    with pytest.raises(PoolProtocolError, match="sample 4 .step 1."):
        decode_header(lying, expected_channel=CHANNEL_EMBEDDING, peer=0)


def test_unsendable_tensors_are_refused_before_sending():
    with pytest.raises(TypeError, match="sample 3.*complex64"):
        check_sendable(torch.zeros(2, dtype=torch.complex64), "put of sample 3")
    with pytest.raises(ValueError, match=f"at most {MAX_NDIM}"):
        check_sendable(torch.zeros([1] * (MAX_NDIM + 1)), "put of sample 3")


def test_credit_round_trip_and_distinct_tags():
    assert decode_credit(encode_credit(9, 2, 4096)) == (9, 2, 4096)
    tags = [TAGS.embedding_header, TAGS.embedding_payload, TAGS.grad_header, TAGS.grad_payload, TAGS.credit]
    assert len(set(tags)) == len(tags) and 0 not in tags
