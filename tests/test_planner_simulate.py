"""The step simulator: its event engine against closed forms (1F1B, processor sharing, collectives), a real
CPU job's step replayed with the runtime's own step plan (causality, pool credits), and the planner's top-k
ranking by simulated time from the command line."""
from __future__ import annotations

import json

import pytest

from mindspeed_flow.config.load import compose, to_job_config
from mindspeed_flow.planner import cli
from mindspeed_flow.planner.inputs import build_problem, parse_kv
from mindspeed_flow.planner.simulate import (
    COMM, SimulationDeadlock, Simulator, StepCosts, _one_f_one_b, rank_by_simulation, simulate_job, write_timeline,
)


def _pipeline(pp: int, m: int, f: float, b: float, kind: str = "1f1b") -> float:
    sim = Simulator(pp)
    ids: dict = {}
    for s in range(pp):
        for op, k in _one_f_one_b(pp, s, m, kind):
            ids[(s, op, k)] = sim.add(s, f"{op}{k}", f if op == "F" else b, tag=op)
    for (s, op, k), i in ids.items():
        if op == "F" and s > 0:
            sim.ops[i].deps.append((ids[(s - 1, "F", k)], 0.0))
        if op == "B":
            sim.ops[i].deps.append((ids[(s, "F", k)], 0.0))
            if s < pp - 1:
                sim.ops[i].deps.append((ids[(s + 1, "B", k)], 0.0))
    return sim.run()


@pytest.mark.parametrize("pp,m", [(1, 4), (2, 4), (4, 8), (3, 2)])
def test_pipeline_schedules_match_closed_forms(pp: int, m: int) -> None:
    f, b = 1.0, 2.0
    assert _pipeline(pp, m, f, b) == pytest.approx((m + pp - 1) * (f + b))  # 1F1B, equal stages
    assert _pipeline(pp, m, f, b, "gpipe") == pytest.approx((m + pp - 1) * (f + b))


def test_processor_sharing_collectives_and_deadlock() -> None:
    sim = Simulator(2, cores=1)
    sim.add(0, "a", 1.0)
    sim.add(1, "b", 1.0)
    assert sim.run() == pytest.approx(2.0)  # two busy ranks on one core: each at half speed
    sim = Simulator(2)
    sim.add(0, "long", 3.0)
    sim.add(0, "sync", 0.5, kind=COMM, collective="g")
    sim.add(1, "sync", 0.5, kind=COMM, collective="g")
    assert sim.run() == pytest.approx(3.5)
    assert sim.ops[2].start == pytest.approx(3.0)  # rank 1 waits for rank 0 to join the collective
    sim = Simulator(2)
    a = sim.add(0, "a", 1.0)
    sim.add(1, "b", 1.0, deps=[(a + 2, 0.0)])
    sim.add(0, "c", 1.0, deps=[(a + 1, 0.0)])
    with pytest.raises(SimulationDeadlock, match="deadlock"):
        sim.run()


@pytest.mark.parametrize("overrides", [["experiment=default"], ["experiment=parity_pp2"],
                                       ["experiment=default", "flow.mode=coupled"]])
def test_cpu_job_step_replays_the_runtime_plan(overrides, tmp_path) -> None:
    job = to_job_config(compose(overrides + ["flow.pool_capacity_mb=0.05"]))
    problem, _ = build_problem(parse_kv(["model=tiny_qwen2_vl", "data=infovqa_tiny", "cluster=cpu", "devices=3",
                                         "samples=64"]))
    res = simulate_job(job, problem.ctx, [1], cores=2)[1]
    # the 3 ranks, plus a loader lane (prefetch thread) per rank that loads pixels: encoder, or coupled DP rank
    ranks = {r for r, role in res.roles.items() if not role.startswith("loader")}
    assert res.step_seconds > 0 and ranks == set(range(3))
    lanes = sorted(r for r in res.roles if r not in ranks)
    assert lanes == list(range(3, 3 + (1 if job.flow.mode == "decoupled" else 3)))
    ops = res.ops
    by_name = {(op.rank, op.name): op for op in ops}
    for op in ops:
        assert op.end >= op.start - 1e-12
        for d, lag in op.deps:  # nothing starts before what it waits for
            assert op.start >= ops[d].end + lag - 1e-9
        if op.name.startswith("enc bwd"):  # an encoder backward follows its sample's first-stage backward
            assert any(ops[d].name.startswith("B") for d, _ in op.deps)
    if job.flow.mode == "decoupled":
        assert any(op.name.startswith("put") for op in ops)
    else:
        assert not any(op.name.startswith("put") for op in ops) and (0, "dp sync") in by_name
    png = tmp_path / "t.png"
    write_timeline(res, str(png))
    assert png.stat().st_size > 1000


def test_top_k_ranked_by_simulated_time_from_the_cli(capsys, tmp_path) -> None:
    problem, _ = build_problem(parse_kv(["cluster=atlas_800t_a2", "model=qwen2_5_vl_3b", "devices=16",
                                         "samples=128"]))
    rows = rank_by_simulation(problem, 3)
    assert 1 <= len(rows) <= 3
    assert [r["simulated_s"] for r in rows] == sorted(r["simulated_s"] for r in rows)
    for r in rows:
        assert r["devices"] <= 16 and r["analytic_s"] > 0
        assert abs(r["simulated_s"] / r["analytic_s"] - 1) < 0.5  # the two models price the same work
    png = tmp_path / "tl.png"
    rc = cli.main(["cluster=atlas_800t_a2", "model=qwen2_5_vl_3b", "devices=16", "samples=128", "--no-baselines",
                   "--simulate", "2", "--timeline", str(png), "--json"])
    assert rc == 0 and png.exists()
    obj = json.loads(capsys.readouterr().out)
    # the chosen plan replayed (no baselines asked for), and the 2 best layouts ranked
    assert [r["name"] for r in obj["simulated"]] == ["decoupled"]
    assert len(obj["simulated_top_k"]) == 2
    assert {"simulated_s", "analytic_s", "encoder", "backbone"} <= set(obj["simulated_top_k"][0])


def test_two_rank_layouts_ranked_with_the_vit_on_stage_zero() -> None:
    """Coupled DP2, coupled PP2 with the ViT inside stage 0's microbatches, decoupled 1 + 1: all simulated on
    the same recipe and batches; the coupled pipeline charges the ViT to stage 0 only."""
    from mindspeed_flow.planner.simulate import two_rank_ranking

    problem, _ = build_problem(parse_kv(["model=tiny_qwen2_vl", "data=infovqa_tiny", "cluster=cpu", "devices=2",
                                         "samples=64"]))
    ranking = two_rank_ranking(problem.ctx, ["experiment=default"], steps=(1,))
    assert set(ranking) == {"coupled_dp2", "coupled_pp2_vit_stage0", "decoupled_1+1"}
    assert list(ranking.values()) == sorted(ranking.values()) and min(ranking.values()) > 0
    job = to_job_config(compose(["experiment=default", "parallel=enc1_bb_pp2"]))
    plain = simulate_job(job, problem.ctx, [1], cores=0)[1]  # unshared cores: compare work, not sharing
    vit0 = simulate_job(job, problem.ctx, [1], cores=0, vit_on_stage0=True)[1]
    assert set(vit0.roles) == {1, 2} and not any(op.tag in ("enc_fwd", "put") for op in vit0.ops)
    stage0 = lambda res: sum(op.end - op.start for op in res.ops if op.rank == 1 and op.tag in ("fwd", "bwd"))  # noqa: E731
    stage1 = lambda res: sum(op.end - op.start for op in res.ops if op.rank == 2 and op.tag in ("fwd", "bwd"))  # noqa: E731
    assert stage0(vit0) > stage0(plain) and stage1(vit0) == pytest.approx(stage1(plain), rel=1e-9)


def test_coupled_pipeline_runs_its_own_split_with_the_vit_on_stage_zero() -> None:
    """`flow.mode=coupled parallel.coupled.pp=2`: the coupled layout's own step plan as a 2-stage pipeline, the
    ViT's work in stage 0's microbatches, the LLM layers per stage from `parallel.coupled.layer_split`."""
    problem, _ = build_problem(parse_kv(["model=tiny_qwen2_vl", "data=infovqa_tiny", "cluster=cpu", "devices=2",
                                         "samples=64"]))
    base = ["experiment=heavy_encoder_2rank", "model=tiny_qwen2_vl", "data=infovqa_tiny", "flow.mode=coupled",
            "parallel.coupled.pp=2"]
    busy = {}
    for split in ("[1,3]", "[3,1]"):
        job = to_job_config(compose([*base, f"parallel.coupled.layer_split={split}"]))
        res = simulate_job(job, problem.ctx, [1], cores=0)[1]
        assert set(res.roles) == {0, 1} and res.roles[1] == "coupled dp0 pp1"
        ops = res.ops
        assert not any(op.tag in ("enc_fwd", "put", "load") for op in ops)
        for op in ops:
            if op.rank == 1 and op.tag == "fwd":  # stage 1's forward waits for stage 0's activations
                assert any(ops[d].rank == 0 and ops[d].tag == "fwd" for d, _ in op.deps)
        busy[split] = [sum(op.work for op in ops if op.rank == r and op.tag in ("fwd", "bwd")) for r in (0, 1)]
    # moving two layers from stage 1 to stage 0 moves work the same way
    assert busy["[3,1]"][0] > busy["[1,3]"][0] and busy["[3,1]"][1] < busy["[1,3]"][1]


class _Loading(StepCosts):
    """The planner's rates plus a fixed pixel-loading time per sample (what the bench measures)."""

    def sample_load(self, patches_per_image) -> float:  # noqa: ANN001
        return 0.05


def test_prefetch_lanes_overlap_loading_only_when_a_core_is_free() -> None:
    """A coupled DP rank loads pixels in a prefetch thread: with a spare core the loading hides behind compute
    (only the first sample's load is exposed); with the rank's core only, it adds its full time."""
    from mindspeed_flow.specs import VLMSpec

    problem, _ = build_problem(parse_kv(["model=tiny_qwen2_vl", "data=infovqa_tiny", "cluster=cpu", "devices=2",
                                         "samples=64"]))
    job = to_job_config(compose(["experiment=default", "flow.mode=coupled", "parallel.world_size=1"]))
    from mindspeed_flow.config.load import model_hf_config

    spec = VLMSpec.from_hf_config(model_hf_config(job))
    run = lambda cores, costs=None: simulate_job(job, problem.ctx, [1], cores=cores, spinning_waits=False,  # noqa: E731
                                                 costs=costs)[1]
    plain = run(2).step_seconds
    loading = _Loading(spec, problem.ctx)
    two, one = run(2, loading), run(1, loading)
    loads = [op for op in two.ops if op.tag == "load"]
    assert loads and two.roles[loads[0].rank] == "loader of 0"
    total = sum(op.work for op in loads)
    assert one.step_seconds == pytest.approx(plain + total, rel=1e-6)  # one core: compute and loads add up
    assert plain < two.step_seconds < plain + total  # a spare core: the loads overlap the rank's compute
