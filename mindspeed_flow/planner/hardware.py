"""Hardware facts for the planner and MFU: the per-SKU peak table and cluster presets (recipes/cluster/*.yaml).

`PEAK_TFLOPS` holds nominal dense peaks (TFLOP/s, no sparsity) per device SKU and dtype. Ascend 910B SKUs
differ (DESIGN §9): read the device name (`torch_npu.npu.get_device_name()` gives e.g. "Ascend910B3") and look it
up with `peak_flops`, which `mindspeed_flow.accelerator` uses for MFU. Figures are vendor-nominal; MFU computed
against them is only as good as the SKU match, so the report always prints the peak it used.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from mindspeed_flow.config.planner import ClusterConfig

# TFLOP/s, dense. Keys are lower-case SKU names; `_SKU_PATTERNS` maps device-name spellings to them.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "ascend910b1": {"bf16": 376.0, "fp16": 376.0},
    "ascend910b2": {"bf16": 353.9, "fp16": 353.9},
    "ascend910b3": {"bf16": 313.0, "fp16": 313.0},
    "ascend910b4": {"bf16": 280.0, "fp16": 280.0},
    "ascend910c": {"bf16": 752.0, "fp16": 752.0},  # 910C (Atlas 900 A3): two dies, per package
    "h100_sxm": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "cpu": {"bf16": 0.1, "fp16": 0.1, "fp32": 0.1},  # nominal: CPU-emulated cluster, calibrated by `profile`
}

# Device-name regexes (searched case-insensitively, first match wins) -> SKU key.
_SKU_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"910_?93|910c", "ascend910c"),
    (r"910b1", "ascend910b1"),
    (r"910b2", "ascend910b2"),  # also 910B2C
    (r"910b3", "ascend910b3"),
    (r"910b4", "ascend910b4"),
    (r"h200", "h200"),
    (r"h100|h800", "h100_sxm"),
    (r"a100|a800", "a100"),
    (r"^cpu$", "cpu"),
)
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def normalize_dtype(dtype: str) -> str:
    d = str(dtype).lower().replace("torch.", "")
    return _DTYPE_ALIASES.get(d, d)


def sku_of(device_name: str) -> str | None:
    """SKU key of a device name ("Ascend910B3", "NVIDIA H100 80GB HBM3", "cpu"), or None if unknown."""
    name = device_name.strip().lower()
    if name in PEAK_TFLOPS:
        return name
    for pattern, sku in _SKU_PATTERNS:
        if re.search(pattern, name):
            return sku
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak in FLOP/s (not TFLOP/s) of one device for `dtype`, or None when the SKU or dtype is unknown."""
    sku = sku_of(device_name)
    if sku is None:
        return None
    tflops = PEAK_TFLOPS[sku].get(normalize_dtype(dtype))
    return None if tflops is None else tflops * 1e12


@dataclass(frozen=True)
class Cluster:
    """A validated ClusterConfig with derived units (bytes, bytes/s, seconds)."""

    config: ClusterConfig

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def devices(self) -> int:
        return int(self.config.devices)

    @property
    def devices_per_node(self) -> int:
        return int(self.config.devices_per_node)

    @property
    def hbm_bytes(self) -> float:
        return float(self.config.hbm_gb) * 1e9

    def peak(self, dtype: str) -> float:
        table = {normalize_dtype(k): float(v) for k, v in dict(self.config.peak_tflops).items()}
        d = normalize_dtype(dtype)
        if d not in table:
            raise ValueError(f"cluster {self.name!r}: peak_tflops has no entry for dtype {d!r} (has {sorted(table)})")
        return table[d] * 1e12

    def bandwidth(self, intra: bool) -> float:
        return (self.config.intra_node_gbps if intra else self.config.inter_node_gbps) * 1e9

    def latency(self, intra: bool) -> float:
        return (self.config.intra_node_latency_us if intra else self.config.inter_node_latency_us) * 1e-6

    @property
    def hbm_bandwidth(self) -> float:
        return float(self.config.hbm_tbps) * 1e12

    def with_devices(self, devices: int) -> "Cluster":
        return Cluster(dataclasses.replace(self.config, devices=int(devices)))


def validate_cluster(cfg: ClusterConfig) -> None:
    """Reject a cluster description whose fields contradict each other; the message names the field."""
    if cfg.devices < 1:
        raise ValueError(f"cluster {cfg.name!r}: devices must be >= 1, got {cfg.devices}")
    if cfg.devices_per_node < 1:
        raise ValueError(f"cluster {cfg.name!r}: devices_per_node must be >= 1, got {cfg.devices_per_node}")
    if cfg.hbm_gb <= 0:
        raise ValueError(f"cluster {cfg.name!r}: hbm_gb must be > 0, got {cfg.hbm_gb}")
    for key in ("intra_node_gbps", "inter_node_gbps", "hbm_tbps"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"cluster {cfg.name!r}: {key} must be > 0, got {getattr(cfg, key)}")
    if not cfg.tp_sizes or any(int(t) < 1 for t in cfg.tp_sizes):
        raise ValueError(f"cluster {cfg.name!r}: tp_sizes must list sizes >= 1, got {list(cfg.tp_sizes)}")


def recipes_dir() -> str:
    """The repository's recipes/ folder (next to the package)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "recipes"))


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster preset by name (recipes/cluster/NAME.yaml) or a YAML path, validated."""
    from omegaconf import OmegaConf

    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(recipes_dir(), "cluster", f"{name_or_path}.yaml")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(os.path.join(recipes_dir(), "cluster")) if f.endswith(".yaml"))
        raise ValueError(f"cluster={name_or_path!r}: no such preset or file; known presets: {known}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return Cluster(cluster_config_from_dict(raw, where=path))


def cluster_config_from_dict(raw: dict, where: str = "cluster") -> ClusterConfig:
    """Build + validate a ClusterConfig; dict fields replace the defaults (no merge: a 910B has no fp32 entry)."""
    known = {f.name for f in dataclasses.fields(ClusterConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown cluster field(s) {unknown}; known fields: {sorted(known)}")
    cfg = ClusterConfig(**raw)
    validate_cluster(cfg)
    return cfg
