"""Unified embedding pool: per-sample embeddings from encoder ranks to backbone ranks over torch.distributed
point-to-point, gradients back, bounded capacity with credit-based backpressure, device/host tiers, counters.

Two modes on one wire (`wire.py`) with one set of errors (`errors.py`): `EmbeddingPool` discovers what arrives
from each header (below); `planned.PlannedTransport` moves a step whose every item all ranks know in advance, in one
global order per direction, which in-order device streams need (the MindSpeed-MM flow job's transport).

    pool = EmbeddingPool(rank=rank, group=None, capacity_bytes=64 << 20, timeout_s=60, device=device)
    # producer                                   # consumer
    pool.put(emb, sample_id=i, step=s, consumer=c)   pool.expect(producer=p, items=[(i, s), ...])
    g = pool.wait_grad(sample_id=i, step=s, consumer=c)  e = pool.get(sample_id=i, step=s, producer=p)
                                                  pool.return_grad(e.grad, sample_id=i, step=s, producer=p)
    pool.flush()  # end of step: every send received
"""
from mindspeed_flow.pool.errors import (PoolError, PoolPeerError, PoolProtocolError, PoolShapeError,
                                        PoolTimeout)
from mindspeed_flow.pool.handle import EmbeddingHandle, Tier
from mindspeed_flow.pool.planned import PlannedItem, PlannedTransport
from mindspeed_flow.pool.pool import EmbeddingPool
from mindspeed_flow.pool.stats import PoolStats
from mindspeed_flow.pool.wire import TAGS, PoolTags

__all__ = ["EmbeddingHandle", "EmbeddingPool", "PlannedItem", "PlannedTransport", "PoolError", "PoolPeerError",
           "PoolProtocolError", "PoolShapeError", "PoolStats", "PoolTags", "PoolTimeout", "TAGS", "Tier"]
