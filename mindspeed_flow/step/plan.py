"""From a global batch's sample shapes to every rank's work for one step.

Every rank runs this on the same inputs and gets the same answer, so no rank asks another what to do:
  1. the packing scheduler assigns samples (or, with `packing.step_mode: packs`, the streaming packer already has:
     its plan comes in as `plan`) to (backbone DP rank, microbatch slot) by LLM cost;
  2. within each bridge group, samples with images go to encoder ranks by ViT cost, slot by slot (the packing
     scheduler's `encoder_schedule`), so each encoder rank encodes in the order the backbone consumes: microbatch 0
     of every DP rank is encoded first and the backbone starts while later images are still being encoded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing import CostModel, StepPlan, encoder_schedule, plan_step
from mindspeed_flow.topology import Bridge


@dataclass
class StepWork:
    step: int
    sample_ids: list[int]
    plan: StepPlan
    # sample id -> global rank of the encoder that produces its embedding (samples with images only)
    producer_of: dict[int, int] = field(default_factory=dict)
    # sample id -> global rank of the backbone first-stage rank that consumes it
    consumer_of: dict[int, int] = field(default_factory=dict)
    # encoder global rank -> sample ids in encode (= consumption) order
    encode_order: dict[int, list[int]] = field(default_factory=dict)
    # encoder global rank -> total ViT cost this step (for the balance metric)
    encoder_cost: dict[int, float] = field(default_factory=dict)
    # several encoder parts: part -> sample id -> producer rank (producer_of stays empty then), and part -> the
    # part's producer ranks
    producers: dict[str, dict[int, int]] = field(default_factory=dict)
    part_producers: dict[str, list[int]] = field(default_factory=dict)

    def producer_ranks(self) -> dict[str, list[int]]:
        """Encoder part -> its producer ranks (one part, "encoder", unless several were planned)."""
        return dict(self.part_producers) if self.part_producers else {"encoder": list(self.encoder_cost)}

    def in_put_order(self, sample_ids: Sequence[int]) -> list[int]:
        """`sample_ids` in the order their producers put them (each producer's encode order): a consumer that
        gets a microbatch's embeddings in this order frees pool capacity in the order it was taken, so a pool
        smaller than a microbatch cannot deadlock (the producer waits on a credit only for an item the consumer
        is about to get)."""
        pos = self.__dict__.get("_put_position")
        if pos is None:
            pos = {sid: i for sids in self.encode_order.values() for i, sid in enumerate(sids)}
            self.__dict__["_put_position"] = pos
        return sorted(sample_ids, key=lambda sid: pos.get(sid, -1))

    def slot_of(self) -> dict[int, int]:
        """Sample id -> the microbatch slot (index in its consumer's row) that consumes it; every DP rank has the
        same number of slots, and each producer's encode order runs through them in increasing order."""
        slots = self.__dict__.get("_slot_of")
        if slots is None:
            slots = {sid: k for row in self.plan.microbatches for k, mb in enumerate(row) for sid in mb.sample_ids}
            self.__dict__["_slot_of"] = slots
        return slots


def plan_decoupled_step(step: int, shapes: Sequence[SampleShape], *, bridge: Bridge, token_budget: int,
                        cost_model: CostModel, scheduler: str, min_microbatches: int, oversize_policy: str,
                        pad_multiple: int = 0, plan: StepPlan | None = None) -> StepWork:
    dp = len(bridge.consumers)
    if plan is None:
        plan = plan_step(list(shapes), dp=dp, num_encoders=len(bridge.producers), token_budget=token_budget,
                         cost_model=cost_model, scheduler=scheduler, min_microbatches=min_microbatches,
                         oversize_policy=oversize_policy, pad_multiple=pad_multiple)
    work = StepWork(step, [s.sample_id for s in shapes], plan)
    by_id = {s.sample_id: s for s in shapes}
    for d, row in enumerate(plan.microbatches):
        for mb in row:
            for sid in mb.sample_ids:
                work.consumer_of[sid] = bridge.consumers[d]
    _assign_producers(work, bridge, lambda sid: cost_model.encoder_cost(by_id[sid]),
                      lambda sid: by_id[sid].num_images > 0, work.producer_of)
    return work


def _assign_producers(work: StepWork, bridge: Bridge, cost: Callable[[int], float], has: Callable[[int], bool],
                      producer_of: dict[int, int]) -> None:
    """Give each sample that `has` something to encode a producer of `bridge`, in consumption order."""
    plan = work.plan
    for producers, consumers in bridge.groups:
        # The group's samples slot by slot (what its consumers run together), balanced over its producers by the
        # packing scheduler's encoder-side rule: within a slot heaviest first onto the least-loaded producer.
        ids: list[int] = []
        slots: list[list[int]] = []
        for k in range(plan.num_slots):
            slot = [sid for d, row in enumerate(plan.microbatches) if bridge.consumers[d] in consumers
                    for sid in row[k].sample_ids]
            slots.append(list(range(len(ids), len(ids) + len(slot))))
            ids.extend(slot)
        costs = np.array([cost(sid) for sid in ids], dtype=np.float64)
        has_input = np.array([has(sid) for sid in ids], dtype=bool)
        order, loads = encoder_schedule(slots, costs, ids, len(producers), has_input)
        for p, sids, load in zip(producers, order, loads):
            work.encode_order[p] = sids
            work.encoder_cost[p] = load
            for sid in sids:
                producer_of[sid] = p


def plan_multipart_step(step: int, shapes: Sequence[SampleShape], *, bridges: dict[str, Bridge],
                        part_costs: dict[str, Callable[[int], float]], token_budget: int, cost_model: CostModel,
                        scheduler: str, min_microbatches: int, oversize_policy: str, pad_multiple: int = 0,
                        plan: StepPlan | None = None) -> StepWork:
    """Several encoder parts feeding one backbone: the backbone plan as for one part, then each part's samples
    (those whose cost is > 0: the part has something to encode) balanced over that part's producers, in the
    order the backbone consumes them. `work.producers[part][sid]` names each embedding's producer."""
    any_bridge = next(iter(bridges.values()))
    if plan is None:
        plan = plan_step(list(shapes), dp=len(any_bridge.consumers), num_encoders=len(any_bridge.producers),
                         token_budget=token_budget, cost_model=cost_model, scheduler=scheduler,
                         min_microbatches=min_microbatches, oversize_policy=oversize_policy, pad_multiple=pad_multiple)
    work = StepWork(step, [s.sample_id for s in shapes], plan)
    for d, row in enumerate(plan.microbatches):
        for mb in row:
            for sid in mb.sample_ids:
                work.consumer_of[sid] = any_bridge.consumers[d]  # every bridge has the same consumers
    for part, bridge in bridges.items():
        cost = part_costs[part]
        _assign_producers(work, bridge, cost, lambda sid, cost=cost: cost(sid) > 0,
                          work.producers.setdefault(part, {}))
        work.part_producers[part] = list(bridge.producers)
    return work


def plan_coupled_step(step: int, shapes: Sequence[SampleShape], *, dp: int, token_budget: int,
                      cost_model: CostModel, scheduler: str, oversize_policy: str, pad_multiple: int = 0,
                      min_microbatches: int = 1, plan: StepPlan | None = None) -> StepWork:
    """Coupled baseline: the same scheduler over the `dp` replicas (every rank when not pipelined); each replica
    encodes what it consumes (a pipelined replica on its stage 0). Ids below are DP indices."""
    if plan is None:
        plan = plan_step(list(shapes), dp=dp, num_encoders=dp, token_budget=token_budget,
                         cost_model=cost_model, scheduler=scheduler, min_microbatches=min_microbatches,
                         oversize_policy=oversize_policy, pad_multiple=pad_multiple)
    work = StepWork(step, [s.sample_id for s in shapes], plan)
    for d, row in enumerate(plan.microbatches):
        for mb in row:
            for sid in mb.sample_ids:
                work.consumer_of[sid] = d
                work.producer_of[sid] = d
    return work
