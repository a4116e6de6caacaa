"""The step plan every rank computes: each sample consumed once, produced inside its bridge group, encoded in
consumption order, and identical across calls (no rank-dependent state)."""
from __future__ import annotations

import pytest

from mindspeed_flow.packing import CostModel
from mindspeed_flow.packing.workloads import infovqa_shapes
from mindspeed_flow.step.plan import plan_coupled_step, plan_decoupled_step
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.step.layout import Bridge

COST = CostModel.from_spec(VLMSpec.from_hf_config(hf_config_dict("qwen2_vl", "tiny")))


@pytest.mark.parametrize("producers, consumers", [([0], [1, 2]), ([0, 1], [2]), ([0, 1, 2, 3], [4, 5]),
                                                  ([0, 1], [2, 3, 4])])
def test_decoupled_plan_respects_bridge_and_order(producers: list[int], consumers: list[int]) -> None:
    shapes = infovqa_shapes(48, seed=5, max_pixels=64 * 28 * 28)
    bridge = Bridge.build(producers, consumers)
    work = plan_decoupled_step(0, shapes, bridges={"encoder": bridge}, token_budget=2048, cost_model=COST,
                               scheduler="flow", min_microbatches=2, oversize_policy="error")
    again = plan_decoupled_step(0, shapes, bridges={"encoder": bridge}, token_budget=2048, cost_model=COST,
                                scheduler="flow", min_microbatches=2, oversize_policy="error")
    assert list(work.producers) == ["encoder"]  # one encoder part: the one mapping is keyed "encoder"
    producer_of = work.producers["encoder"]
    assert work.encode_order == again.encode_order and producer_of == again.producers["encoder"]
    assert sorted(work.consumer_of) == sorted(s.sample_id for s in shapes)
    with_images = {s.sample_id for s in shapes if s.num_images}
    assert set(producer_of) == with_images
    slot_of = {sid: k for row in work.plan.microbatches for k, mb in enumerate(row) for sid in mb.sample_ids}
    for p, sids in work.encode_order.items():
        # slot by slot: everything the backbone needs for slot k is encoded before anything of slot k + 1
        assert [slot_of[s] for s in sids] == sorted(slot_of[s] for s in sids)
        for sid in sids:
            assert producer_of[sid] == p
            group_producers, group_consumers = bridge.group_of_consumer(work.consumer_of[sid])
            assert p in group_producers and work.consumer_of[sid] in group_consumers
    assert list(work.encoder_cost) == ["encoder"]
    loads = [v for v in work.encoder_cost["encoder"].values()]
    assert max(loads) / (sum(loads) / len(loads)) < 1.25
    # each consumer takes a producer's items in the order that producer puts them (no pool-credit deadlock)
    for consumer in consumers:
        taken = [sid for row, c in zip(work.plan.microbatches, bridge.consumers) if c == consumer
                 for mb in row for sid in work.in_put_order([s for s in mb.sample_ids if s in producer_of])]
        for p, sids in work.encode_order.items():
            mine = [sid for sid in taken if producer_of[sid] == p]
            assert mine == [sid for sid in sids if work.consumer_of[sid] == consumer]


def test_coupled_plan_encodes_where_it_consumes() -> None:
    shapes = infovqa_shapes(24, seed=1, max_pixels=64 * 28 * 28)
    work = plan_coupled_step(0, shapes, dp=3, token_budget=2048, cost_model=COST, scheduler="flow",
                             oversize_policy="error")
    producer_of = work.producers["encoder"]
    assert all(producer_of[s] == work.consumer_of[s] for s in producer_of)
    assert len(work.plan.microbatches) == 3


def test_encode_groups_keep_order_within_the_patch_budget() -> None:
    from mindspeed_flow.hosts.torch.engine import encode_groups

    ids, patches = [7, 3, 9, 1, 4], [100, 200, 900, 50, 60]
    assert encode_groups(ids, patches, 0) == [[7], [3], [9], [1], [4]]
    assert encode_groups(ids, patches, 300) == [[7, 3], [9], [1, 4]]  # 900 > budget: alone
    assert encode_groups(ids, patches, 10_000) == [ids]
    assert [s for g in encode_groups(ids, patches, 250) for s in g] == ids
