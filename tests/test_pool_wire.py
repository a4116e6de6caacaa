"""The pool's wire format: batch headers round-trip every supported dtype/shape, payloads travel as their bytes,
and garbage is rejected by name."""
from __future__ import annotations


import pytest
import torch

from mindspeed_flow.pool import PoolProtocolError
from mindspeed_flow.pool.wire import (CHANNEL_CREDIT, CHANNEL_EMBEDDING, CHANNEL_GRAD, DTYPE_CODES, HEADER_LEN,
                                      MAX_BATCH, MAX_NDIM, PAYLOAD_ALIGN, TAGS, as_bytes, check_sendable,
                                      credit_header, decode_header, dense_payload, encode_header, from_bytes,
                                      has_payload, item_header, pack_payloads, payload_layout, slice_payloads)


@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES, key=str))
@pytest.mark.parametrize("shape", [(), (0, 8), (7, 3), (2, 3, 4, 1)])
def test_header_and_payload_round_trip(dtype: torch.dtype, shape: tuple[int, ...]):
    tensor = (torch.arange(torch.Size(shape).numel()) % 5).reshape(shape).to(dtype)
    header = encode_header([item_header(CHANNEL_EMBEDDING, 17, 3, tensor)])
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    [meta] = decode_header(header, expected_channel=CHANNEL_EMBEDDING, peer=0)
    assert (meta.sample_id, meta.step, meta.dtype, meta.shape) == (17, 3, dtype, shape)
    assert has_payload(meta) == (meta.nbytes > 0)
    payload = as_bytes(tensor)
    assert payload.dtype == torch.uint8 and payload.numel() == meta.nbytes
    assert meta.nbytes == 0 or payload.data_ptr() == tensor.data_ptr()  # a contiguous tensor goes without a copy
    back = from_bytes(payload.clone(), meta)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_a_batch_of_mixed_items_round_trips():
    tensors = [torch.randn(17, 8).to(torch.bfloat16), torch.arange(3, dtype=torch.int64), torch.zeros(0, 4),
               (torch.arange(5) % 2).bool(), torch.randn(2, 3, dtype=torch.float64)]
    items = [item_header(CHANNEL_GRAD, sid, 7, t) for sid, t in enumerate(tensors)]
    decoded = decode_header(encode_header(items), expected_channel=CHANNEL_GRAD, peer=1)
    assert decoded == items
    for meta, tensor in zip(decoded, tensors):
        assert torch.equal(from_bytes(as_bytes(tensor).clone(), meta), tensor)


def test_non_contiguous_tensor_travels_as_its_values():
    tensor = torch.arange(12.0).reshape(3, 4).t()
    [meta] = decode_header(encode_header([item_header(CHANNEL_GRAD, 1, 0, tensor)]), expected_channel=CHANNEL_GRAD,
                           peer=2)
    assert torch.equal(from_bytes(as_bytes(tensor).clone(), meta), tensor)


def test_garbage_and_wrong_channel_are_named():
    with pytest.raises(PoolProtocolError, match="from rank 3 is not a pool header"):
        decode_header(torch.zeros(HEADER_LEN, dtype=torch.int64), expected_channel=CHANNEL_EMBEDDING, peer=3)
    grad_header = encode_header([item_header(CHANNEL_GRAD, 1, 0, torch.ones(2))])
    with pytest.raises(PoolProtocolError, match="rank 5 sent a gradient header on the embedding channel"):
        decode_header(grad_header, expected_channel=CHANNEL_EMBEDDING, peer=5)
    lying = encode_header([item_header(CHANNEL_EMBEDDING, 9, 9, torch.ones(1)),
                           item_header(CHANNEL_EMBEDDING, 4, 1, torch.ones(2, 2))])
    lying[4 + 13 + 4] += 1  # the second item's nbytes no longer matches its shape
    with pytest.raises(PoolProtocolError, match="sample 4 .step 1."):
        decode_header(lying, expected_channel=CHANNEL_EMBEDDING, peer=0)
    too_many = encode_header([item_header(CHANNEL_EMBEDDING, 0, 0, torch.ones(1))])
    too_many[3] = MAX_BATCH + 1
    with pytest.raises(PoolProtocolError, match=f"announcing {MAX_BATCH + 1} items"):
        decode_header(too_many, expected_channel=CHANNEL_EMBEDDING, peer=0)
    with pytest.raises(ValueError, match=f"1..{MAX_BATCH} items of one channel"):
        encode_header([item_header(CHANNEL_EMBEDDING, i, 0, torch.ones(1)) for i in range(MAX_BATCH + 1)])


def test_unsendable_tensors_are_refused_before_sending():
    with pytest.raises(TypeError, match="sample 3.*complex64"):
        check_sendable(torch.zeros(2, dtype=torch.complex64), "put of sample 3")
    with pytest.raises(ValueError, match=f"at most {MAX_NDIM}"):
        check_sendable(torch.zeros([1] * (MAX_NDIM + 1)), "put of sample 3")


def test_credits_round_trip_without_payload_and_tags_are_distinct():
    credits = [credit_header(9, 2, 4096), credit_header(10, 2, 0)]
    decoded = decode_header(encode_header(credits), expected_channel=CHANNEL_CREDIT, peer=0)
    assert [(c.sample_id, c.step, c.nbytes) for c in decoded] == [(9, 2, 4096), (10, 2, 0)]
    assert not any(has_payload(c) for c in decoded)
    tags = [TAGS.embedding_header, TAGS.embedding_payload, TAGS.grad_header, TAGS.grad_payload, TAGS.credit]
    assert len(set(tags)) == len(tags) and 0 not in tags


def _mixed_batch() -> list[torch.Tensor]:
    """Every dtype, odd byte counts, an empty tensor and a non-contiguous one: one batch's worth."""
    tensors = [(torch.arange(3 + 2 * i) % 7).to(dtype) for i, dtype in enumerate(sorted(DTYPE_CODES, key=str))]
    return tensors + [torch.zeros(0, 3), torch.arange(12.0).reshape(3, 4).t()]


def test_a_packed_batch_lands_as_one_buffer_and_slices_back_exactly():
    tensors = _mixed_batch()
    items = [item_header(CHANNEL_EMBEDDING, sid, 4, t) for sid, t in enumerate(tensors)]
    offsets, total = payload_layout(items)
    placed = sorted((off, h.nbytes) for off, h in zip(offsets, items) if off is not None)
    assert all(off % PAYLOAD_ALIGN == 0 for off, _ in placed)
    assert all(a + n <= b for (a, n), (b, _) in zip(placed, placed[1:]))  # disjoint, in order
    assert total == placed[-1][0] + placed[-1][1]
    assert [off is None for off in offsets] == [not has_payload(h) for h in items]
    sent = pack_payloads(items, tensors)
    assert sent.dtype == torch.uint8 and sent.numel() == total
    views, buffer = slice_payloads(decode_header(encode_header(items), expected_channel=CHANNEL_EMBEDDING, peer=0),
                                   torch.device("cpu"))
    buffer.copy_(sent)  # what the one receive of the batch delivers
    for tensor, meta, view in zip(tensors, items, views):
        back = from_bytes(torch.empty(0, dtype=torch.uint8) if view is None else view, meta)
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
        assert view is None or view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_one_payload_goes_uncopied_and_no_payload_means_no_buffer():
    tensor = torch.randn(5, 3)
    items = [item_header(CHANNEL_GRAD, 1, 0, tensor), item_header(CHANNEL_GRAD, 2, 0, torch.zeros(0, 3))]
    assert pack_payloads(items, [tensor, torch.zeros(0, 3)]).data_ptr() == tensor.data_ptr()
    credits = [credit_header(1, 0, 4096), credit_header(2, 0, 64)]
    assert pack_payloads(credits, [None, None]) is None
    assert slice_payloads(credits, torch.device("cpu")) == ([None, None], None)


def _dense(items: list, tensors: list[torch.Tensor]) -> list:
    return [item_header(CHANNEL_EMBEDDING, i, 0, t, dense=True) for i, t in zip(items, tensors)]


def test_a_dense_batch_of_adjacent_views_goes_uncopied_and_slices_back_exactly():
    batch = torch.randn(3 + 5 + 0 + 1, 7).to(torch.bfloat16)  # odd sizes: no item ends on PAYLOAD_ALIGN
    tensors = list(batch.split([3, 5, 0, 1]))
    headers = _dense(range(4), tensors)
    decoded = decode_header(encode_header(headers), expected_channel=CHANNEL_EMBEDDING, peer=0)
    assert decoded == headers and all(h.dense for h in decoded)
    payload = dense_payload(tensors)
    assert payload.data_ptr() == batch.data_ptr() and payload.numel() == batch.numel() * 2  # the region itself
    offsets, total = payload_layout(decoded)
    assert offsets == [0, 3 * 7 * 2, None, 8 * 7 * 2] and total == payload.numel()  # back to back, no padding
    views, buffer = slice_payloads(decoded, torch.device("cpu"))
    buffer.copy_(payload)
    for view, h, t in zip(views, decoded, tensors):
        assert (view is None) == (t.numel() == 0)
        if view is not None:
            assert torch.equal(from_bytes(view, h), t)


@pytest.mark.parametrize("make", [
    lambda b: [b[4:6], b[0:4]],            # adjacent, out of order
    lambda b: [b[0:2], b[3:5]],            # a gap
    lambda b: [b[:, :2], b[:, 2:]],        # not contiguous
    lambda b: [b[0:2], b[2:4].clone()],    # another storage
])
def test_a_dense_batch_of_anything_else_is_one_concatenated_copy(make):
    tensors = make(torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4))
    payload = dense_payload(tensors)
    assert torch.equal(payload, torch.cat([t.reshape(-1) for t in tensors]).view(torch.uint8))
    assert all(payload.data_ptr() != t.data_ptr() for t in tensors)


def test_a_header_mixes_no_layouts_and_empty_items_send_nothing():
    a, b = torch.ones(2), torch.ones(3)
    with pytest.raises(ValueError, match="one channel and one layout"):
        encode_header([item_header(CHANNEL_EMBEDDING, 0, 0, a), *_dense([1], [b])])
    assert dense_payload([torch.empty(0, 4), torch.empty(0, 4)]) is None
