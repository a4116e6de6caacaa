"""Errors raised by the embedding pool. Each message names this rank, the peer rank and what was awaited."""
from __future__ import annotations


class PoolError(RuntimeError):
    """Base class of every pool failure."""


class PoolTimeout(PoolError, TimeoutError):
    """A blocking pool call waited longer than the pool's timeout (the peer is alive but did not deliver)."""


class PoolPeerError(PoolError):
    """The transport to a peer failed (typically the peer process died); the message names the peer rank."""


class PoolProtocolError(PoolError):
    """A received message does not fit the protocol: garbage header, unknown credit, or a plan mismatch."""


class PoolShapeError(PoolError, ValueError):
    """A received embedding does not have the shape the consumer expected."""
