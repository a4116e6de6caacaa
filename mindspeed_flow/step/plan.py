"""From a global batch's sample shapes to every rank's work for one step.

Every rank runs this on the same inputs and gets the same answer, so no rank asks another what to do:
  1. the packing scheduler assigns samples (or, with `packing.step_mode: packs`, the streaming packer already has:
     its plan comes in as `plan`) to (backbone DP rank, microbatch slot) by LLM cost;
  2. for each encoder part (one, "encoder", for a VLM; e.g. "audio" and "vision" for the Omni thinker), within
     each group of that part's bridge, the samples the part has something to encode for go to its encoder ranks by
     encoder cost, slot by slot (the packing scheduler's `encoder_schedule`), so each encoder rank encodes in the
     order the backbone consumes: microbatch 0 of every DP rank is encoded first and the backbone starts while
     later inputs are still being encoded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing import CostModel, StepPlan, encoder_schedule, plan_step
from mindspeed_flow.step.layout import AUDIO, Bridge, Layout


@dataclass
class StepWork:
    step: int
    sample_ids: list[int]
    plan: StepPlan
    # encoder part -> sample id -> global rank of the encoder that produces that part's embedding of the sample
    # (samples with something for the part to encode only); one part, "encoder", for a VLM
    producers: dict[str, dict[int, int]] = field(default_factory=dict)
    # sample id -> global rank of the backbone first-stage rank that consumes it
    consumer_of: dict[int, int] = field(default_factory=dict)
    # encoder global rank -> sample ids in encode (= consumption) order
    encode_order: dict[int, list[int]] = field(default_factory=dict)
    # encoder part -> its producer ranks -> total encoder cost this step (the balance metric compares a part's
    # producers with each other only: an audio part's mel frames never weigh against ViT costs)
    encoder_cost: dict[str, dict[int, float]] = field(default_factory=dict)

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


def encoder_costs(parts: Iterable[str], shape_of: Callable[[int], SampleShape], cost_model: CostModel,
                  audio_cost: Optional[Callable[[int], float]] = None) -> dict[str, Callable[[int], float]]:
    """Per encoder part, sample id -> that part's encoder work (0: nothing to encode): `audio_cost` (mel frames,
    the Omni dataset's) for an audio part, the ViT cost of the sample's images for an image part."""
    def vit(sid: int) -> float:
        shape = shape_of(sid)
        return cost_model.encoder_cost(shape) if shape.num_images else 0.0

    return {part: audio_cost if part == AUDIO else vit for part in parts}


def plan_decoupled_step(step: int, shapes: Sequence[SampleShape], *, bridges: Mapping[str, Bridge], token_budget: int,
                        cost_model: CostModel, scheduler: str, min_microbatches: int, oversize_policy: str,
                        pad_multiple: int = 0, plan: StepPlan | None = None,
                        part_costs: Mapping[str, Callable[[int], float]] | None = None) -> StepWork:
    """The backbone plan (every part's bridge has the same consumers), then each encoder part's samples (those
    whose part cost is > 0) balanced over that part's producers, in the order the backbone consumes them.
    `part_costs` (see `encoder_costs`): None prices every part by the ViT cost of the shapes' images."""
    consumers = next(iter(bridges.values())).consumers
    if plan is None:
        # the packing scheduler's encoder count: the first part's producers (a VLM's only part)
        plan = plan_step(list(shapes), dp=len(consumers), num_encoders=len(next(iter(bridges.values())).producers),
                         token_budget=token_budget, cost_model=cost_model, scheduler=scheduler,
                         min_microbatches=min_microbatches, oversize_policy=oversize_policy, pad_multiple=pad_multiple)
    work = StepWork(step, [s.sample_id for s in shapes], plan)
    for d, row in enumerate(plan.microbatches):
        for mb in row:
            for sid in mb.sample_ids:
                work.consumer_of[sid] = consumers[d]
    if part_costs is None:
        part_costs = encoder_costs(bridges, {s.sample_id: s for s in shapes}.__getitem__, cost_model)
    for part, bridge in bridges.items():
        _assign_producers(work, part, bridge, part_costs[part])
    return work


def _assign_producers(work: StepWork, part: str, bridge: Bridge, cost: Callable[[int], float]) -> None:
    """Give each sample with something for `part` to encode (cost > 0) a producer of `bridge`, in consumption
    order."""
    plan = work.plan
    producer_of = work.producers.setdefault(part, {})
    loads_of = work.encoder_cost.setdefault(part, {})
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
        order, loads = encoder_schedule(slots, costs, ids, len(producers), costs > 0)
        for p, sids, load in zip(producers, order, loads):
            work.encode_order[p] = sids
            loads_of[p] = load
            for sid in sids:
                producer_of[sid] = p


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
                work.producers.setdefault("encoder", {})[sid] = d
    return work


def plan_job_step(job: Any, layout: Layout, bridges: Mapping[str, Bridge], step: int,
                  shapes: Sequence[SampleShape], cost_model: CostModel, *,
                  audio_cost: Optional[Callable[[int], float]] = None, plan: Optional[StepPlan] = None) -> StepWork:
    """A torch-host job's step plan from its recipe (`job`: a FlowJobConfig, of which `packing` is read; the step
    core does not import the recipe schema, which imports it), identical on every rank and in the planner's simulator
    (which replays it without a dataset or a process group). `plan`: the streaming packer's plan of this step
    (packing.step_mode=packs/window), used instead of packing `shapes`; `audio_cost`: the data set's audio cost
    per sample (only the Omni data set has audio)."""
    p = job.packing
    common = dict(token_budget=p.token_budget, cost_model=cost_model, scheduler=p.scheduler,
                  oversize_policy=p.oversize_policy, pad_multiple=p.pad_multiple, plan=plan)
    if layout.mode == "decoupled":
        # each encoder part's samples balanced over its own producers, priced in its own unit
        costs = encoder_costs(bridges, {s.sample_id: s for s in shapes}.__getitem__, cost_model, audio_cost)
        return plan_decoupled_step(step, shapes, bridges=bridges, part_costs=costs,
                                   min_microbatches=layout.part("backbone").pp, **common)
    coupled = layout.part("coupled")
    return plan_coupled_step(step, shapes, dp=coupled.dp, min_microbatches=coupled.pp, **common)
