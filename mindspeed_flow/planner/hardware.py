"""Cluster presets for the planner (recipes/cluster/*.yaml): devices, nodes, link tiers with their sources.

A preset names its device `sku`; peaks and memory come from the one SKU table, `mindspeed_flow.skus`, which the
runtime's MFU reads too.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
from omegaconf import OmegaConf

from mindspeed_flow.config.planner import ClusterConfig
from mindspeed_flow.resources import data_path
from mindspeed_flow.skus import SKUS, normalize_dtype

# Link figures of a cluster preset, each of which needs a `link_sources` entry (a source, or assumed: true).
LINK_FIGURES = ("intra_node_gbps", "intra_node_latency_us", "inter_node_gbps", "inter_node_latency_us",
                "package_link_gbps", "scale_out_gbps", "scale_out_latency_us")


@dataclass(frozen=True)
class LinkTier:
    """One level of the network: groups spanning at most `span` consecutive devices (0: any) use this link."""

    name: str  # package | node | pod | scale_out
    where: str
    span: int
    gbps: float
    latency_us: float
    figures: tuple[str, str]  # the ClusterConfig fields of its bandwidth and latency


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
    def devices_per_pod(self) -> int:
        """Devices of one scale-up domain; 0 when the node is that domain (no tier between node and scale-out)."""
        return int(self.config.devices_per_pod)

    @property
    def pods(self) -> int:
        """Scale-up domains the cluster spans (1 without a pod tier or when it fits in one)."""
        pod = self.devices_per_pod
        return max(1, -(-self.devices // pod)) if pod > 0 else 1

    def tiers(self) -> list["LinkTier"]:
        """The links a group of consecutive devices uses, innermost first; see `link`."""
        c = self.config
        out = []
        if c.devices_per_package > 1 and c.package_link_gbps > 0:
            out.append(LinkTier("package", "the dies of one package", c.devices_per_package, c.package_link_gbps,
                                c.intra_node_latency_us, ("package_link_gbps", "intra_node_latency_us")))
        out.append(LinkTier("node", "inside a node", c.devices_per_node, c.intra_node_gbps, c.intra_node_latency_us,
                            ("intra_node_gbps", "intra_node_latency_us")))
        pod = self.devices_per_pod
        if pod > 0:
            out.append(LinkTier("pod", f"between nodes of one scale-up domain ({pod} devices)", pod,
                                c.inter_node_gbps, c.inter_node_latency_us, ("inter_node_gbps", "inter_node_latency_us")))
            out.append(LinkTier("scale_out", "between scale-up domains (scale-out network)", 0, c.scale_out_gbps,
                                c.scale_out_latency_us, ("scale_out_gbps", "scale_out_latency_us")))
        else:
            out.append(LinkTier("scale_out", "between nodes (scale-out network)", 0, c.inter_node_gbps,
                                c.inter_node_latency_us, ("inter_node_gbps", "inter_node_latency_us")))
        return out

    def link(self, span) -> tuple[np.ndarray, np.ndarray]:
        """Bandwidth (bytes/s) and latency (s) of a group spanning `span` consecutive devices: the slowest tier it
        crosses (a flat ring runs at its slowest hop), vectorized over spans."""
        span = np.asarray(span)
        tiers = self.tiers()
        bw = np.full(span.shape, tiers[-1].gbps * 1e9, dtype=np.float64)
        lat = np.full(span.shape, tiers[-1].latency_us * 1e-6, dtype=np.float64)
        for t in reversed(tiers[:-1]):  # innermost last, so it wins where it applies
            bw = np.where(span <= t.span, t.gbps * 1e9, bw)
            lat = np.where(span <= t.span, t.latency_us * 1e-6, lat)
        return bw, lat

    def provenance(self, figure: str) -> str:
        """Where a link figure comes from: its source, or "assumed" (with the preset's note)."""
        entry = dict(self.config.link_sources).get(figure) or {}
        if entry.get("source"):
            return str(entry["source"])
        note = entry.get("note")
        return "assumed" + (f" ({note})" if note else "")

    def assumed_links(self) -> list[str]:
        """Link figures the cost model uses that carry no source."""
        return [f for t in self.tiers() for f in (t.figures[0], t.figures[1])
                if self.provenance(f).startswith("assumed")]

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
    if cfg.devices_per_package < 1 or cfg.devices_per_node % cfg.devices_per_package:
        raise ValueError(f"cluster {cfg.name!r}: devices_per_package={cfg.devices_per_package} must be >= 1 and "
                         f"divide devices_per_node={cfg.devices_per_node}")
    if cfg.devices_per_pod < 0 or (cfg.devices_per_pod and cfg.devices_per_pod % cfg.devices_per_node):
        raise ValueError(f"cluster {cfg.name!r}: devices_per_pod={cfg.devices_per_pod} must be 0 (no pod tier) or a "
                         f"multiple of devices_per_node={cfg.devices_per_node}")
    if cfg.devices_per_pod and (cfg.scale_out_gbps <= 0 or cfg.scale_out_latency_us < 0):
        raise ValueError(f"cluster {cfg.name!r}: devices_per_pod={cfg.devices_per_pod} needs the scale-out link: "
                         f"scale_out_gbps > 0 (got {cfg.scale_out_gbps}) and scale_out_latency_us >= 0")
    for figure, entry in dict(cfg.link_sources).items():
        if figure not in LINK_FIGURES:
            raise ValueError(f"cluster {cfg.name!r}: link_sources.{figure}: not a link figure; known: {LINK_FIGURES}")
        entry = dict(entry or {})
        if not (str(entry.get("source") or "").strip() or entry.get("assumed") is True) or (
                entry.get("source") and entry.get("assumed")):
            raise ValueError(f"cluster {cfg.name!r}: link_sources.{figure} must give either source: TEXT or "
                             f"assumed: true (with an optional note), got {entry}")
    if not cfg.tp_sizes or any(int(t) < 1 for t in cfg.tp_sizes):
        raise ValueError(f"cluster {cfg.name!r}: tp_sizes must list sizes >= 1, got {list(cfg.tp_sizes)}")


def recipes_dir() -> str:
    """The package's recipes/ folder (mindspeed_flow.resources: the repository's, or an installed wheel's)."""
    return str(data_path("recipes"))


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster preset by name (recipes/cluster/NAME.yaml) or a YAML path, validated."""
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
    raw = dict(raw)
    sku = SKUS.get(str(raw.get("sku", "")).lower())
    if sku is not None:  # the preset names its device; the SKU table supplies the figures it leaves out
        raw.setdefault("peak_tflops", dict(sku.peak_tflops))
        raw.setdefault("hbm_gb", sku.hbm_gb)
        raw.setdefault("hbm_tbps", sku.hbm_tbps)
        raw.setdefault("source", sku.source)
    elif "peak_tflops" not in raw:
        raise ValueError(f"{where}: sku={raw.get('sku')!r} is not in the SKU table {sorted(SKUS)}; "
                         f"give peak_tflops, hbm_gb and hbm_tbps explicitly")
    cfg = ClusterConfig(**raw)
    validate_cluster(cfg)
    return cfg
