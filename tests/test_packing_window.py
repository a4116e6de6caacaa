"""Window steps (`packing.step_mode: window`): exactly global_batch_size samples per step chosen from a pool of packs;
each sample placed once over a finite stream, the wait bound, determinism, the resumable state (directly and through
`PackedSteps` over the real sampler), the exact-count pack choice itself, and the config rules."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mindspeed_flow.data.sampler import iter_global_batches
from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing import PackingError
from mindspeed_flow.packing.window import WindowPacker, select_packs
from mindspeed_flow.packing.workloads import infovqa_shapes, near_budget_shapes
from mindspeed_flow.hosts.torch.packed_steps import PackedSteps
from tests.test_packing_stream_steps import COST, Counting, LengthsDataset, resumed_after

GEOMETRY = dict(dp=4, num_encoders=2, min_microbatches=2)


def mixed_shapes(n: int, budget: int, seed: int) -> list[SampleShape]:
    """Near-budget and InfoVQA-like samples interleaved: both ways of cutting a step come up."""
    shapes = near_budget_shapes(n // 2, budget, seed=seed) + infovqa_shapes(n - n // 2, seed=seed, start_id=n // 2,
                                                                            max_pixels=400 * 28 * 28)
    return [shapes[i] for i in np.random.default_rng(seed).permutation(n)]


def window(source, budget: int = 4096, **kw) -> WindowPacker:
    args = dict(global_batch_size=96, token_budget=budget, cost_model=COST, lookahead=64)
    args.update(kw)
    return WindowPacker(source, **args)


@pytest.mark.parametrize("workload", ["near_budget", "mixed"])
@pytest.mark.parametrize("pad_multiple", [0, 64])
def test_steps_hold_exactly_the_batch_and_every_sample_once(workload: str, pad_multiple: int) -> None:
    n, budget = 2000, 4096
    shapes = near_budget_shapes(n, budget, seed=5) if workload == "near_budget" else mixed_shapes(n, budget, 5)
    w = window(iter(shapes), budget)
    plans = list(w.steps(**GEOMETRY, pad_multiple=pad_multiple))
    counts = [len(p.sample_ids()) for p in plans]
    assert counts[:-1] == [96] * (len(plans) - 1) and 0 < counts[-1] <= 96  # only the finite stream's last is short
    assert sorted(sid for p in plans for sid in p.sample_ids()) == sorted(s.sample_id for s in shapes)
    by_id = {s.sample_id: s for s in shapes}
    for p in plans:
        p.check([by_id[sid] for sid in p.sample_ids()])  # exactly once, budget, equal counts per rank
        assert p.dp == 4 and p.num_slots >= 2
        longest = max(mb.tokens for rank in p.microbatches for mb in rank)
        assert p.seq_len == (budget if not pad_multiple else min(budget, -(-longest // pad_multiple) * pad_multiple))
        assert all(mb.padded_tokens == p.seq_len for rank in p.microbatches for mb in rank)
    assert w.whole_pack_steps > 0  # the window really chose whole packs
    assert w.max_age <= w.max_wait
    # the same stream gives the same steps (every rank computes them alone)
    again = list(window(iter(shapes), budget).steps(**GEOMETRY, pad_multiple=pad_multiple))
    assert [[mb.sample_ids for r in p.microbatches for mb in r] for p in again] == \
        [[mb.sample_ids for r in p.microbatches for mb in r] for p in plans]


def test_near_budget_window_pads_less_than_the_next_samples() -> None:
    """The point of the window: on near-budget lengths, steps of the same size pad less than the same stream cut
    into consecutive steps (plan_step, what step_mode=samples runs)."""
    from mindspeed_flow.packing import plan_step

    budget, g = 4096, 96
    shapes = near_budget_shapes(40 * g, budget, seed=11)
    plans = list(window(iter(shapes), budget, global_batch_size=g, lookahead=g).steps(**GEOMETRY))[:-1]
    fixed = [plan_step(shapes[i:i + g], token_budget=budget, cost_model=COST, **{
        "dp": 4, "num_encoders": 2, "min_microbatches": 2}) for i in range(0, len(plans) * g, g)]
    pad = 1 - sum(p.real_tokens for p in plans) / sum(p.padded_tokens for p in plans)
    pad_fixed = 1 - sum(p.real_tokens for p in fixed) / sum(p.padded_tokens for p in fixed)
    assert pad < pad_fixed


@pytest.mark.parametrize("max_wait", [1, 2, 4])
def test_no_pooled_sample_waits_more_than_max_wait_steps(max_wait: int) -> None:
    """Ages are steps a pooled sample was left out of; every stepped sample's age stays within the
    bound, and a sample of age max_wait is in the very next step."""
    shapes = mixed_shapes(3000, 4096, seed=7)
    w = window(iter(shapes), max_wait=max_wait)
    while True:
        old = {sid for mb, a in zip(w.pool, w.ages) for sid in mb.sample_ids if a >= max_wait}
        plan = w.next_step(**GEOMETRY)
        if plan is None:
            break
        assert old <= set(plan.sample_ids())
        assert max(w.ages, default=0) <= max_wait
    assert w.max_age <= max_wait
    if max_wait <= 2:  # the bound is reached on this stream, so the test checks something
        assert w.max_age == max_wait


@pytest.mark.parametrize("split", [0, 1, 5, 17])
def test_state_round_trip_gives_the_same_steps(split: int) -> None:
    shapes = mixed_shapes(2500, 4096, seed=3)
    whole = list(window(iter(shapes)).steps(**GEOMETRY, pad_multiple=64))
    source = Counting(shapes)
    first = window(source)
    before = [first.next_step(**GEOMETRY, pad_multiple=64) for _ in range(split)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps: plain JSON
    by_id = {s.sample_id: s for s in shapes}
    second = window(iter(shapes[source.taken:]))
    second.load_state_dict(state, by_id.__getitem__)
    after = list(second.steps(**GEOMETRY, pad_multiple=64))
    steps = [[mb.sample_ids for r in p.microbatches for mb in r] for p in before + after]
    assert steps == [[mb.sample_ids for r in p.microbatches for mb in r] for p in whole]
    assert [p.encoder_order for p in before + after] == [p.encoder_order for p in whole]
    used = window(iter(shapes))
    used.next_step(**GEOMETRY)
    with pytest.raises(PackingError, match="fresh WindowPacker"):
        used.load_state_dict(state, by_id.__getitem__)


def test_select_packs_makes_the_count_exact_with_a_multiple_of_dp() -> None:
    # 12 full packs of 2 and 3 samples, 2 lighter ones; 20 samples in a multiple of 4 packs: the 8 fullest hold
    # 8 x 2 + swaps; whichever choice, the count is exact, the packs a multiple of 4, the forced pack in.
    sizes = np.array([2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 1, 4])
    loads = np.array([100, 100, 99, 99, 98, 98, 100, 100, 97, 97, 96, 96, 50, 60])
    ages = np.zeros(14, dtype=np.int64)
    ages[12] = 3
    chosen = select_packs(sizes, loads, ages, count=20, dp=4, min_packs=4, max_wait=3)
    assert chosen is not None and int(sizes[chosen].sum()) == 20 and chosen.size % 4 == 0 and 12 in chosen
    # no multiple of 4 packs can hold exactly 5 samples when every pack holds 2
    assert select_packs(np.full(8, 2), np.full(8, 100), np.zeros(8, np.int64), count=5, dp=4, min_packs=4,
                        max_wait=3) is None


def test_window_rejects_bad_arguments() -> None:
    with pytest.raises(PackingError, match=r"lookahead=200: must be in \[1, global_batch_size=96\]"):
        window(iter([]), lookahead=200)
    with pytest.raises(PackingError, match=r"max_wait=0: must be >= 1 step"):
        window(iter([]), max_wait=0)
    with pytest.raises(PackingError, match=r"global_batch_size=0: must be >= 1"):
        window(iter([]), global_batch_size=0)


def window_steps(dataset: LengthsDataset) -> PackedSteps:
    return PackedSteps(iter_global_batches(dataset, 16, seed=7), dataset, token_budget=2048, cost_model=COST,
                       lookahead=16, oversize_policy="error", dp=2, num_encoders=1, packs_per_rank=0, pp=2,
                       global_batch_size=16, pad_multiple=64)


@pytest.mark.parametrize("stop_after", [1, 6])
def test_window_steps_over_the_sampler_resume_like_an_uninterrupted_run(stop_after: int) -> None:
    """Over several epochs of the real sampler (ids come again while their first copy may still be pooled)."""
    from mindspeed_flow.packing.workloads import near_budget_lengths

    dataset = LengthsDataset(near_budget_lengths(100, 2048, seed=9))
    steps = window_steps(dataset)
    ids = [next(steps) for _ in range(20)]
    assert all(len(step) == 16 and len(set(step)) == 16 for step in ids)
    resumed = resumed_after(window_steps, dataset, stop_after)
    assert [next(resumed) for _ in range(20 - stop_after)] == ids[stop_after:]
    assert resumed.plan.dp == 2 and resumed.plan.num_slots >= 2


def test_window_recipe_composes_validates_and_the_mindspeed_mm_host_refuses_it() -> None:
    from mindspeed_flow.config.load import check_rules, compose, to_job_config
    from mindspeed_flow.hosts.mindspeed_mm.recipe import _unsupported

    job = to_job_config(compose(["packing=flow_window"]))
    check_rules(job)
    assert (job.packing.step_mode, job.packing.lookahead) == ("window", 0)
    assert any(x.startswith("packing.step_mode='window'") for x in _unsupported(job))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["packing.lookahead=13"], r"packing.lookahead=13: packing.step_mode=window needs it <= "
                                   r"trainer.global_batch_size=12"),
        (["data.num_samples=20"], r"packing.lookahead=0: packing.step_mode=window needs lookahead \(0: "
                                  r"trainer.global_batch_size\) \+ trainer.global_batch_size=12 below "
                                  r"data.num_samples=20"),
        (["packing.scheduler=sorted"], r"packing.scheduler='sorted': packing.step_mode=window runs the flow"),
        (["packing.packs_per_rank=2"], r"packing.packs_per_rank=2: packing.step_mode=window makes"),
        (["packing.lookahead=-1"], r"packing.lookahead=-1: must be >= 1 sample \(0 = trainer.global_batch_size"),
    ],
)
def test_bad_window_config_names_field_and_rule(overrides: list[str], match: str) -> None:
    from mindspeed_flow.config.load import RecipeError, check_rules, compose, to_job_config

    job = to_job_config(compose(["packing=flow_window", *overrides]))
    with pytest.raises(RecipeError, match=match):
        check_rules(job)


def test_torch_host_refuses_the_rows_layout() -> None:
    from mindspeed_flow.config.load import RecipeError, check_rules, compose, to_job_config

    with pytest.raises(RecipeError, match=r"packing.layout='rows': the torch host always packs"):
        check_rules(to_job_config(compose(["packing.layout=rows"])))
    check_rules(to_job_config(compose(["packing.layout=packed"])))
