"""Pool counters: peaks follow occupancy, and a step reset keeps levels but restarts everything per-step."""
from __future__ import annotations

from dataclasses import asdict

from mindspeed_flow.pool.stats import PoolCounters


def test_peaks_track_both_sides_and_reset_keeps_levels():
    c = PoolCounters(capacity_bytes=100)
    c.add_inflight(60, +1)
    c.add_held("device", 30, +1)
    c.add_held("host", 50, +1)
    c.add_inflight(-60, -1)
    c.puts, c.put_wait_s, c.bytes_sent = 3, 0.5, 60
    s = c.snapshot()
    assert (s.occupancy_bytes, s.occupancy_peak_bytes) == (80, 140)
    assert (s.inflight_bytes, s.inflight_peak_bytes, s.inflight_items) == (0, 60, 0)
    assert (s.device_peak_bytes, s.host_peak_bytes, s.buffered_items) == (30, 50, 2)
    c.reset_step()
    r = c.snapshot()
    assert (r.puts, r.put_wait_s, r.bytes_sent) == (0, 0.0, 0)
    assert (r.occupancy_bytes, r.occupancy_peak_bytes, r.inflight_peak_bytes) == (80, 80, 0)
    assert (r.device_bytes, r.host_bytes, r.buffered_items, r.capacity_bytes) == (30, 50, 2, 100)
    assert set(asdict(r)) == set(asdict(s))
