"""Pool counters: occupancy (now and peak), items in flight, wait seconds, bytes and counts.

The pool updates one mutable `PoolCounters` under its lock; `stats()` hands out a frozen `PoolStats` snapshot,
so a metrics writer never sees a half-updated record. `reset_step()` zeroes the per-step quantities (counts,
bytes, waits) and restarts the peaks from the current occupancy, which is what a per-step metrics line wants.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of one rank's pool. Producer-side and consumer-side fields are both present on every rank."""

    capacity_bytes: int
    # everything this rank holds for the pool (in flight out + buffered in): the metrics' "pool occupancy"
    occupancy_bytes: int
    occupancy_peak_bytes: int
    # producer side: bytes/items sent to consumers and not yet credited back (what backpressure bounds)
    inflight_bytes: int
    inflight_peak_bytes: int
    inflight_items: int
    # consumer side: received, not yet taken by get(), per tier
    device_bytes: int
    device_peak_bytes: int
    host_bytes: int
    host_peak_bytes: int
    buffered_items: int
    # seconds blocked: put (backpressure), get, wait_grad, flush
    put_wait_s: float
    get_wait_s: float
    # consumer side, per embedding taken by get(): seconds its payload was on the wire (from its header landing to
    # its payload landing), and the part of that during which get() was blocked on it (exposed; the rest was hidden
    # behind the consumer's compute by receiving ahead)
    transfer_s: float
    transfer_exposed_s: float
    grad_wait_s: float
    flush_wait_s: float
    # traffic and counts
    bytes_sent: int
    bytes_received: int
    grad_bytes_sent: int
    grad_bytes_received: int
    puts: int
    put_blocks: int  # puts that found the pool full and waited for a credit
    embedding_messages: int  # messages the puts left in (fewer than puts when items were coalesced)
    gets: int
    grads_sent: int
    grads_received: int
    oversize_puts: int
    host_tier_items: int
    host_to_device_bytes: int


@dataclass
class PoolCounters:
    """The mutable state behind `PoolStats` (guarded by the pool's lock)."""

    capacity_bytes: int
    occupancy_bytes: int = 0
    occupancy_peak_bytes: int = 0
    inflight_bytes: int = 0
    inflight_peak_bytes: int = 0
    inflight_items: int = 0
    device_bytes: int = 0
    device_peak_bytes: int = 0
    host_bytes: int = 0
    host_peak_bytes: int = 0
    buffered_items: int = 0
    put_wait_s: float = 0.0
    get_wait_s: float = 0.0
    transfer_s: float = 0.0
    transfer_exposed_s: float = 0.0
    grad_wait_s: float = 0.0
    flush_wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    grad_bytes_sent: int = 0
    grad_bytes_received: int = 0
    puts: int = 0
    put_blocks: int = 0
    embedding_messages: int = 0
    gets: int = 0
    grads_sent: int = 0
    grads_received: int = 0
    oversize_puts: int = 0
    host_tier_items: int = 0
    host_to_device_bytes: int = 0

    def add_inflight(self, nbytes: int, delta_items: int) -> None:
        self.inflight_bytes += nbytes
        self.inflight_items += delta_items
        self.inflight_peak_bytes = max(self.inflight_peak_bytes, self.inflight_bytes)
        self._add_occupancy(nbytes)

    def add_held(self, tier: str, nbytes: int, delta_items: int) -> None:
        if tier == "device":
            self.device_bytes += nbytes
            self.device_peak_bytes = max(self.device_peak_bytes, self.device_bytes)
        else:
            self.host_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        self.buffered_items += delta_items
        self._add_occupancy(nbytes)

    def _add_occupancy(self, nbytes: int) -> None:
        self.occupancy_bytes += nbytes
        self.occupancy_peak_bytes = max(self.occupancy_peak_bytes, self.occupancy_bytes)

    def snapshot(self) -> PoolStats:
        return PoolStats(**{f.name: getattr(self, f.name) for f in fields(PoolStats)})

    def reset_step(self) -> None:
        """Zero per-step counts, bytes and waits; peaks restart from the current occupancy."""
        keep = {"capacity_bytes", "occupancy_bytes", "inflight_bytes", "inflight_items", "device_bytes", "host_bytes",
                "buffered_items"}
        for f in fields(PoolCounters):
            if f.name not in keep:
                setattr(self, f.name, type(getattr(self, f.name))())
        self.occupancy_peak_bytes = self.occupancy_bytes
        self.inflight_peak_bytes = self.inflight_bytes
        self.device_peak_bytes = self.device_bytes
        self.host_peak_bytes = self.host_bytes
