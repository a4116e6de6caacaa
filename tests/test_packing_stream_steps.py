"""Token-defined steps (`packing.step_mode: packs`): the streaming packer's invariants on near-budget lengths, its
resumable state, and `PackedSteps` over the real sampler resuming exactly where an uninterrupted run would be."""
from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from mindspeed_flow.data.sampler import iter_global_batches
from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.packing import CostModel, PackingError
from mindspeed_flow.packing.streaming import StreamingPacker
from mindspeed_flow.packing.workloads import infovqa_shapes, near_budget_lengths, near_budget_shapes
from mindspeed_flow.hosts.torch.packed_steps import PackedSteps
from mindspeed_flow.specs import VLMSpec

COST = CostModel.from_spec(VLMSpec.from_hf_config(hf_config_dict("qwen2_vl", "7b")))


def packs_of(plans) -> list[list[list[int]]]:
    return [[mb.sample_ids for rank in p.microbatches for mb in rank] for p in plans]


@pytest.mark.parametrize("lookahead", [1, 7, 256])
def test_near_budget_stream_places_each_sample_once_within_budget(lookahead: int) -> None:
    budget = 4096
    shapes = near_budget_shapes(3000, budget, seed=5)
    packer = StreamingPacker(iter(shapes), token_budget=budget, cost_model=COST, lookahead=lookahead)
    plans = list(packer.steps(dp=4, num_encoders=2, microbatches_per_rank=3))
    ids = sorted(sid for p in plans for sid in p.sample_ids())
    assert ids == list(range(3000))
    assert packer.max_buffered <= lookahead
    lengths = near_budget_lengths(3000, budget, seed=5)
    for p in plans:
        p.check([shapes[sid] for sid in p.sample_ids()])  # exactly once, budget, equal counts per rank
        assert p.num_slots == 3 and p.seq_len == budget
        for rank in p.microbatches:
            for mb in rank:
                assert mb.tokens == int(lengths[mb.sample_ids].sum()) <= budget
                assert mb.padded_tokens == budget
        # what the engine pads: every pack (empty ones too) to the budget
        assert p.padding_fraction == pytest.approx(1 - p.real_tokens / (4 * 3 * budget))
    assert all(p.empty_microbatches == 0 for p in plans[:-1])  # only the finite stream's last step is completed


class Counting:
    """An iterator over shapes that remembers how many it handed out (what a resumed source starts after)."""

    def __init__(self, shapes: list[SampleShape]) -> None:
        self.shapes, self.taken = shapes, 0

    def __iter__(self) -> Iterator[SampleShape]:
        return self

    def __next__(self) -> SampleShape:
        if self.taken == len(self.shapes):
            raise StopIteration
        self.taken += 1
        return self.shapes[self.taken - 1]


@pytest.mark.parametrize("split", [0, 1, 4, 9])
def test_streaming_state_round_trip_gives_the_same_steps(split: int) -> None:
    shapes = infovqa_shapes(1500, seed=3, text_only_fraction=0.1) + near_budget_shapes(1500, 16384, seed=4,
                                                                                         start_id=1500)
    rng = np.random.default_rng(0)
    shapes = [shapes[i] for i in rng.permutation(len(shapes))]
    geometry = dict(dp=2, num_encoders=3, microbatches_per_rank=4)
    whole = list(StreamingPacker(iter(shapes), token_budget=16384, cost_model=COST, lookahead=200).steps(**geometry))
    source = Counting(shapes)
    first = StreamingPacker(source, token_budget=16384, cost_model=COST, lookahead=200)
    before = [first.next_step(**geometry) for _ in range(split)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps: plain JSON
    by_id = {s.sample_id: s for s in shapes}
    second = StreamingPacker(iter(shapes[source.taken:]), token_budget=16384, cost_model=COST, lookahead=200)
    second.load_state_dict(state, by_id.__getitem__)
    after = list(second.steps(**geometry))
    assert packs_of(before + after) == packs_of(whole)
    assert [p.encoder_order for p in before + after] == [p.encoder_order for p in whole]
    used = StreamingPacker(iter(shapes), token_budget=16384, cost_model=COST, lookahead=200)
    used.next_step(**geometry)
    with pytest.raises(PackingError, match="fresh StreamingPacker"):
        used.load_state_dict(state, by_id.__getitem__)


class LengthsDataset:
    """Text-only samples of given LLM lengths: what the sampler and the step source need of a dataset."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths.tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def shape(self, i: int) -> SampleShape:
        return SampleShape(i, self.lengths[i])


def resumed_after(make: Callable[[Any], PackedSteps], dataset: Any, stop_after: int) -> PackedSteps:
    """Fresh steps from `make(dataset)` restored from the state (through JSON, as a checkpoint holds it) of another
    run stopped after `stop_after` steps."""
    again = make(dataset)
    for _ in range(stop_after):
        next(again)
    state = json.loads(json.dumps(again.state_dict()))
    resumed = make(dataset)
    resumed.load_state_dict(state)
    return resumed


def packed_steps(dataset: LengthsDataset, **kw) -> PackedSteps:
    args = dict(token_budget=2048, cost_model=COST, lookahead=64, oversize_policy="error", dp=2, num_encoders=1,
                packs_per_rank=0, pp=3)
    args.update(kw)
    return PackedSteps(iter_global_batches(dataset, 16, seed=7), dataset, **args)


@pytest.mark.parametrize("stop_after", [1, 5])
def test_packed_steps_resume_like_an_uninterrupted_run(stop_after: int) -> None:
    dataset = LengthsDataset(near_budget_lengths(400, 2048, seed=9))
    steps = packed_steps(dataset)
    ids = [next(steps) for _ in range(12)]
    plans = [[mb.sample_ids for rank in steps.plan.microbatches for mb in rank]]
    assert all(len(step) for step in ids)
    flat = list(itertools.chain.from_iterable(ids))
    assert len(flat) == len(set(flat))  # within the first epoch no sample comes twice

    resumed = resumed_after(packed_steps, dataset, stop_after)
    rest = [next(resumed) for _ in range(12 - stop_after)]
    assert rest == ids[stop_after:]
    assert [[mb.sample_ids for rank in resumed.plan.microbatches for mb in rank]] == plans
    assert resumed.plan.num_slots == 3 and resumed.plan.dp == 2


def test_packed_steps_rejects_fewer_packs_than_pipeline_stages() -> None:
    with pytest.raises(ValueError, match=r"packing.packs_per_rank=2: must be >= the backbone's pipeline size 3"):
        packed_steps(LengthsDataset(np.full(40, 100)), packs_per_rank=2)


def test_packs_recipe_composes_and_the_mindspeed_mm_host_refuses_it() -> None:
    from mindspeed_flow.config.load import compose, to_job_config
    from mindspeed_flow.hosts.mindspeed_mm.recipe import _unsupported

    job = to_job_config(compose(["packing=flow_packs"]))
    assert (job.packing.step_mode, job.packing.packs_per_rank, job.packing.lookahead) == ("packs", 0, 1024)
    assert any(x.startswith("packing.step_mode='packs'") for x in _unsupported(job))
    assert not any("step_mode" in x for x in _unsupported(to_job_config(compose([]))))


def test_a_sample_that_comes_again_while_in_flight_waits_for_its_first_copy() -> None:
    """A sampler's next epoch can bring an id that still waits in the buffer: no step holds it twice, every copy
    is placed once, and the waiting copies survive a state round trip."""
    shapes = near_budget_shapes(90, 2048, seed=2)
    epochs = 6
    source = Counting([shapes[i] for e in range(epochs) for i in np.random.default_rng(e).permutation(90)])
    geometry = dict(dp=2, num_encoders=1, microbatches_per_rank=3)
    packer = StreamingPacker(source, token_budget=2048, cost_model=COST, lookahead=48)
    plans = [packer.next_step(**geometry) for _ in range(10)]
    state = json.loads(json.dumps(packer.state_dict()))
    assert state["deferred"], "the crafted source must make an id come back while in flight"
    resumed = StreamingPacker(iter(source.shapes[source.taken:]), token_budget=2048, cost_model=COST, lookahead=48)
    resumed.load_state_dict(state, lambda sid: shapes[sid])
    plans += list(resumed.steps(**geometry))
    for p in plans:
        ids = p.sample_ids()
        assert len(ids) == len(set(ids))
    counts = np.bincount([sid for p in plans for sid in p.sample_ids()], minlength=90)
    assert (counts == epochs).all()


def test_a_source_with_fewer_distinct_samples_than_the_buffer_is_one_clear_error() -> None:
    shapes = near_budget_shapes(5, 2048, seed=2)
    packer = StreamingPacker(itertools.cycle(shapes), token_budget=2048, cost_model=COST, lookahead=16)
    with pytest.raises(PackingError, match=r"too few distinct samples for lookahead=16"):
        packer.next_step(dp=1, num_encoders=1, microbatches_per_rank=1)
