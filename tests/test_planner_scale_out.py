"""The network beyond one scale-up domain: every link figure of every cluster preset names its source or says it
is assumed; a job larger than one A3 SuperPoD prices the collectives that cross SuperPoDs on the scale-out tier
(slower than a hypothetical single fabric of the same size); a plan reports MFU over the devices it uses and over
the cluster's, and its link tiers with their sources."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from mindspeed_flow.cli import main
from mindspeed_flow.config.planner import PlannerConfig
from mindspeed_flow.planner.cost import CostContext, Layouts, backbone_costs, bridge_link, encoder_costs
from mindspeed_flow.planner.hardware import LINK_FIGURES, Cluster, cluster_config_from_dict, load_cluster
from mindspeed_flow.planner.inputs import build_problem, parse_kv

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "recipes" / "cluster").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_link_figure_has_a_source_or_is_assumed(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    sources = raw.get("link_sources") or {}
    used = [f for t in load_cluster(str(path)).tiers() for f in t.figures]
    given = [f for f in LINK_FIGURES if f in raw]
    for figure in sorted(set(used) | set(given)):
        entry = sources.get(figure)
        assert entry, f"{path.name}: {figure} has no link_sources entry"
        has_source = bool(str(entry.get("source") or "").strip())
        assert has_source != (entry.get("assumed") is True), f"{path.name}: {figure}: {entry}"


def test_link_sources_are_validated() -> None:
    base = {"name": "x", "sku": "ascend910b3", "devices": 16, "devices_per_node": 8}
    with pytest.raises(ValueError, match="either source"):
        cluster_config_from_dict({**base, "link_sources": {"intra_node_gbps": {"note": "?"}}})
    with pytest.raises(ValueError, match="not a link figure"):
        cluster_config_from_dict({**base, "link_sources": {"intra_gbps": {"assumed": True}}})
    with pytest.raises(ValueError, match="scale_out_gbps > 0"):
        cluster_config_from_dict({**base, "devices_per_pod": 8})
    with pytest.raises(ValueError, match="multiple of devices_per_node"):
        cluster_config_from_dict({**base, "devices_per_pod": 12, "scale_out_gbps": 1.0})


def test_a3_tiers_follow_the_superpod() -> None:
    """A3: 16 dies a node, 768 (384 packages) on one Unified Bus SuperPoD, the scale-out network beyond."""
    c = load_cluster("atlas_900_a3_384").with_devices(1536)
    assert [t.name for t in c.tiers()] == ["node", "pod", "scale_out"] and c.pods == 2
    bw, lat = c.link(np.array([16, 768, 769]))
    cfg = c.config
    assert list(bw) == [cfg.intra_node_gbps * 1e9, cfg.inter_node_gbps * 1e9, cfg.scale_out_gbps * 1e9]
    assert list(lat) == pytest.approx([cfg.intra_node_latency_us * 1e-6, cfg.inter_node_latency_us * 1e-6,
                                       cfg.scale_out_latency_us * 1e-6])
    assert cfg.scale_out_gbps < cfg.inter_node_gbps
    # A2: the node is the scale-up domain; between nodes is already the scale-out (RoCE) network
    a2 = load_cluster("atlas_800t_a2")
    assert [t.name for t in a2.tiers()] == ["node", "scale_out"]
    assert a2.link(np.array([9]))[0][0] == a2.config.inter_node_gbps * 1e9


def _single_fabric(c: Cluster) -> Cluster:
    """The same devices on one hypothetical fabric: every node-crossing link is the SuperPoD's Unified Bus."""
    return Cluster(dataclasses.replace(c.config, devices_per_pod=0, scale_out_gbps=0.0, scale_out_latency_us=0.0))


def test_beyond_one_superpod_dp_and_pp_cross_the_scale_out_tier() -> None:
    problem, _ = build_problem(parse_kv(["cluster=atlas_900_a3_384", "model=qwen2_5_vl_72b", "devices=1536",
                                         "samples=64"]))
    enc, bb = problem.parts
    tier = problem.ctx
    flat = dataclasses.replace(tier, cluster=_single_fabric(problem.cluster))
    # backbone: tp8 x dp96 = 768 devices a stage; pp2 spans both SuperPoDs. DP groups stay in one SuperPoD (a
    # stage is 768 consecutive devices), pipeline sends cross. tp8 x dp192 x pp1 = 1536: the DP ring crosses.
    L = Layouts.from_rows([{"dp": 96, "tp": 8, "pp": 2, "cp": 1, "b": 16384, "rc": 1},
                           {"dp": 192, "tp": 8, "pp": 1, "cp": 1, "b": 16384, "rc": 1},
                           {"dp": 48, "tp": 8, "pp": 2, "cp": 1, "b": 16384, "rc": 1}])
    ct, cf = backbone_costs(bb, tier, L), backbone_costs(bb, flat, L)
    assert ct.time_parts["pp"][0] > cf.time_parts["pp"][0]  # 1536-device pipeline: a stage boundary crosses
    assert ct.time_parts["dp"][0] == pytest.approx(cf.time_parts["dp"][0])  # 768-device DP span: one SuperPoD
    assert ct.time_parts["dp"][1] > 5 * cf.time_parts["dp"][1]  # 1536-device DP ring: 196 vs 25 GB/s
    assert ct.time[1] > cf.time[1]
    # a layout inside one SuperPoD is priced the same either way
    assert ct.time[2] == pytest.approx(cf.time[2]) and ct.time_parts["pp"][2] == pytest.approx(cf.time_parts["pp"][2])
    # the DP term is the ring at the scale-out bandwidth: (dp - 1) / dp x (grads + params) bytes per device
    c = problem.cluster.config
    by = 4 + 2  # fp32 grads reduce-scattered, bf16 params all-gathered (distributed optimizer)
    p_dev = bb.total_params / 8  # pp1, tp8
    expect = (p_dev * (191 / 192) * by / (c.scale_out_gbps * 1e9) + 2 * 191 * c.scale_out_latency_us * 1e-6) \
        * (1 - problem.cfg.overlap["dp"])
    assert ct.time_parts["dp"][1] == pytest.approx(expect, rel=1e-9)
    # the embedding bridge of a two-SuperPoD job crosses the tier too
    assert bridge_link(tier)[0] == c.scale_out_gbps * 1e9 and bridge_link(flat)[0] == c.inter_node_gbps * 1e9
    E = Layouts.from_rows([{"dp": 512, "tp": 1, "pp": 1, "cp": 1, "b": 0, "rc": 2}])
    assert encoder_costs(enc, tier, E).time_parts["embed"][0] > encoder_costs(enc, flat, E).time_parts["embed"][0]


def test_a3_inside_one_superpod_never_uses_the_scale_out_tier() -> None:
    c = load_cluster("atlas_900_a3_384")
    ctx = CostContext(c, PlannerConfig(), 1536, job_devices=768)
    assert bridge_link(ctx)[0] == c.config.inter_node_gbps * 1e9


def test_plan_json_gives_mfu_over_used_and_cluster_devices_and_the_link_tiers(tmp_path, capsys) -> None:
    # a small cluster of two 32-device scale-up domains keeps the plan fast; the tiers are the A3 preset's
    raw = yaml.safe_load((REPO / "recipes" / "cluster" / "atlas_900_a3_384.yaml").read_text())
    raw.update(devices=64, devices_per_pod=32)
    path = tmp_path / "two_pods.yaml"
    path.write_text(yaml.safe_dump(raw))
    rc = main(["plan", f"cluster={path}", "model=qwen2_5_vl_3b", "devices=60", "samples=64", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    obj = json.loads(out)
    pred = obj["predicted"]
    assert pred["cluster_devices"] == 60 and pred["devices_used"] <= 60
    assert pred["mfu_devices_used"] == pred["mfu"]
    assert pred["mfu_cluster"] == pytest.approx(pred["mfu"] * pred["devices_used"] / 60)
    rec = obj["recommended"]
    assert rec["mfu_cluster"] == pytest.approx(rec["mfu"] * rec["devices"] / 60)
    assert obj["decoupled"]["mfu_cluster"] == pytest.approx(pred["mfu_cluster"])
    for b in obj["baselines"].values():
        if b is not None:
            assert b["mfu_cluster"] == pytest.approx(b["mfu"] * b["devices"] / 60)
    tiers = {t["tier"]: t for t in obj["links"]}
    assert list(tiers) == ["node", "pod", "scale_out"] and tiers["pod"]["max_span_devices"] == 32
    assert tiers["pod"]["gbps_source"].startswith("CloudMatrix384")
    assert tiers["scale_out"]["gbps_source"].startswith("assumed")
    assert "scale_out_gbps" in obj["inputs"]
    rc = main(["plan", f"cluster={path}", "model=qwen2_5_vl_3b", "devices=60", "samples=64", "--no-baselines"])
    text = capsys.readouterr().out
    assert rc == 0 and "over the cluster's 60" in text and "links (2 scale-up domain(s) of 32 devices):" in text
