"""Topology: layouts are validated before any group exists; groups and the bridge match the layout."""
import pytest

from mindspeed_flow.config.schema import CoupledParallelConfig, ParallelConfig, PartParallelConfig
from mindspeed_flow.topology import Topology
from mindspeed_flow.step.layout import Bridge, Layout, LayoutError, ModelLimits, PartLayout
from mindspeed_flow.utils.multiproc import run_ranks

LIMITS = ModelLimits(llm_layers=4, llm_heads=4, llm_kv_heads=2, vit_heads=2, vit_layers=2)


def _layout(enc_dp=1, bb_dp=2, bb_pp=1, bb_tp=1, mode="decoupled"):
    cfg = ParallelConfig(encoder=PartParallelConfig(dp=enc_dp), backbone=PartParallelConfig(dp=bb_dp, pp=bb_pp, tp=bb_tp))
    return Layout.from_config(cfg, mode)


@pytest.mark.parametrize(
    "kwargs, validate, match",
    [
        (dict(bb_dp=2), dict(world_size=4), "launched with 4 ranks but the layout needs 3"),
        (dict(bb_pp=8, bb_dp=1), dict(limits=LIMITS), r"parallel.backbone.pp=8: more pipeline stages than layers \(4\)"),
        (dict(bb_tp=3, bb_dp=1), dict(limits=LIMITS), r"parallel.backbone.tp=3: the attention heads \(4\)"),
        (dict(bb_dp=3), dict(global_batch_size=16), "global_batch_size=16 is not divisible by parallel.backbone.dp=3"),
        (dict(bb_dp=0), dict(), r"parallel.backbone.dp=0: every parallel size must be an integer >= 1"),
        (dict(bb_dp=2), dict(expected_world=5), "parallel.world_size=5 but the layout needs 3"),
    ],
)
def test_invalid_layouts_name_field_and_rule(kwargs, validate, match):
    with pytest.raises(LayoutError, match=match):
        _layout(**kwargs).validate(**validate)


def test_coupled_pipeline_layout_and_layer_split():
    """Coupled mode keeps the decoupled layout's rank count: 4 ranks as pp2 x dp2, LLM layers [1, 3] per stage;
    a split that does not match pp or the model's layers names the field and the rule."""
    cfg = ParallelConfig(encoder=PartParallelConfig(dp=2), backbone=PartParallelConfig(dp=2),
                         coupled=CoupledParallelConfig(pp=2, layer_split=[1, 3]))
    layout = Layout.from_config(cfg, "coupled")
    (part,) = layout.parts
    assert (part.dp, part.pp, part.layer_split, layout.world_size) == (2, 2, (1, 3), 4)
    layout.validate(limits=LIMITS, world_size=4, global_batch_size=8)
    cfg.coupled.layer_split = [2, 3]
    with pytest.raises(LayoutError, match=r"parallel.coupled.layer_split=\[2, 3\]: .* sum to the 4 LLM layers"):
        Layout.from_config(cfg, "coupled").validate(limits=LIMITS)
    cfg.coupled.pp = 3
    with pytest.raises(LayoutError, match=r"parallel.coupled.pp=3: must be an integer >= 1 that divides the 4"):
        Layout.from_config(cfg, "coupled")
    cfg.backbone.layer_split = [3, 1]
    cfg.backbone.pp, cfg.backbone.dp = 2, 1
    assert Layout.from_config(cfg, "decoupled").part("backbone").layer_split == (3, 1)


def test_bad_mode():
    with pytest.raises(LayoutError, match="flow.mode='both'"):
        _layout(mode="both")


def test_coords_roundtrip_megatron_order():
    p = PartLayout("backbone", dp=2, tp=2, pp=3)
    seen = set()
    for r in range(p.size):
        c = p.coords(r)
        assert p.local_rank_of(**c) == r
        seen.add((c["tp"], c["dp"], c["pp"]))
    assert len(seen) == 12
    assert p.coords(1)["tp"] == 1 and p.coords(2)["dp"] == 1 and p.coords(4)["pp"] == 1


@pytest.mark.parametrize(
    "prods, cons, expected",
    [
        ([0, 1], [2, 3], [([0], [2]), ([1], [3])]),
        ([0, 1, 2, 3], [4, 5], [([0, 1], [4]), ([2, 3], [5])]),
        ([0], [1, 2], [([0], [1, 2])]),
        ([0, 1], [2, 3, 4], [([0, 1], [2, 3, 4])]),
    ],
)
def test_bridge_groups_partition_both_sides(prods, cons, expected):
    b = Bridge.build(prods, cons)
    assert b.groups == expected
    assert sorted(p for g in b.groups for p in g[0]) == prods
    assert sorted(c for g in b.groups for c in g[1]) == cons
    for c in cons:
        assert all(c in b.consumers_of(p) for p in b.producers_of(c))


def _build(rank, world, enc_dp, bb_dp, bb_pp):
    topo = Topology.build(_layout(enc_dp=enc_dp, bb_dp=bb_dp, bb_pp=bb_pp))
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=topo.dp_group)
    return dict(part=topo.part, dp=topo.dp_rank, pp=topo.pp_rank, dp_sum=t.item(), dp_ranks=topo.dp_ranks,
                pp_ranks=topo.pp_ranks, consumers=topo.bridge.consumers, producers=topo.bridge.producers)


def test_groups_on_real_ranks():
    # 2 encoder ranks + backbone dp2 x pp2 (ranks 2..5: stage 0 = 2,3; stage 1 = 4,5)
    out = run_ranks(_build, 6, 2, 2, 2, timeout_s=30)
    assert [o["part"] for o in out] == ["encoder"] * 2 + ["backbone"] * 4
    assert out[0]["dp_sum"] == 1.0  # encoder dp group {0,1}
    assert out[2]["dp_ranks"] == [2, 3] and out[2]["dp_sum"] == 5.0
    assert out[2]["pp_ranks"] == [2, 4] and out[5]["pp"] == 1
    assert out[0]["consumers"] == [2, 3] and out[0]["producers"] == [0, 1]
