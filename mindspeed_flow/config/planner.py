"""Schemas of the `cluster` and `planner` recipe groups (owned by planner/)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterConfig:
    name: str = "cpu"
    devices: int = 3
    devices_per_node: int = 3
    hbm_gb: float = 8.0
    peak_tflops: dict = field(default_factory=lambda: {"fp32": 0.1, "bf16": 0.1})
    intra_node_gbps: float = 10.0
    inter_node_gbps: float = 10.0
    intra_node_latency_us: float = 10.0
    inter_node_latency_us: float = 50.0
