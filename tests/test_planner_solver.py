"""The CP-SAT allocation equals the exhaustive enumeration's optimum on random small planning instances.

Each instance is a full planning problem (random VLM-like parts, random cluster, random memory limit, random
global batch and device budget; a third of them CPU-emulated, with devices sharing 1-4 host cores), priced by
the real cost model; `make_plan` is run once with the CP-SAT
solver and once with `exhaustive=True`, and the lexicographic objective (slowest part's step time, rate gap,
devices used) must agree within 1e-6 relative, infeasible instances included (both must refuse).
"""
from __future__ import annotations

import numpy as np
import pytest

from mindspeed_flow.config.planner import ClusterConfig, PlannerConfig
from mindspeed_flow.planner.hardware import Cluster
from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.planner.plan import Problem, make_plan
from mindspeed_flow.planner.solver import solve_cpsat, solve_cpsat_shared, solve_exhaustive
from mindspeed_flow.planner.space import PlanError

FEASIBLE_WANTED = 200  # compared instances with a plan; infeasible ones are compared too (both must refuse)
MAX_SEEDS = 400


def _random_part(rng: np.random.Generator, role: str) -> PartSpec:
    heads = int(rng.choice([2, 4, 8, 16]))
    hidden = heads * int(rng.choice([16, 32, 64]))
    layers = int(rng.choice([2, 3, 4, 5, 6, 7, 8, 12]))
    ffn = hidden * int(rng.integers(2, 5))
    layer_params = 4 * hidden * hidden + 3 * hidden * ffn
    vocab = int(rng.choice([0, 1000, 5000])) if role == "backbone" else 0
    first = vocab * hidden if role == "backbone" else hidden * 588
    last = first
    tokens = float(rng.uniform(50, 400))
    trainable = role == "backbone" or bool(rng.random() < 0.7)
    mult = 6.0 if trainable else 2.0
    total = layers * layer_params + first + last
    return PartSpec(
        name=role if role != "encoder2" else "encoder2", role="encoder" if role.startswith("encoder") else role,
        trainable=trainable, layers=layers, hidden=hidden, ffn=ffn, heads=heads,
        kv_heads=int(rng.choice([h for h in (1, 2, heads) if heads % h == 0])), gated_mlp=bool(rng.random() < 0.5),
        layer_params=layer_params, first_params=first, last_params=last, total_params=total,
        tokens_per_sample=tokens, sq_tokens_per_sample=tokens**2 * float(rng.uniform(1, 1.5)), items_per_sample=1.0,
        max_item_tokens=int(tokens * rng.uniform(1.2, 2.5)), linear_flops_per_token=mult * total,
        attn_flops_per_sample=mult * layers * hidden * tokens**2, out_tokens_per_sample=tokens / 4,
        out_hidden=hidden, input_elems_per_token=588, vocab=max(vocab, 1),
        tp_sizes=tuple(t for t in (1, 2, 4, 8) if heads % t == 0),
        pp_sizes=tuple(range(1, layers + 1)) if role == "backbone" else (1,),  # uneven splits included
        cp_sizes=(1, 2) if role == "backbone" else (1,),
    )


def _random_problem(seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    dpn = int(rng.choice([2, 4, 8]))
    devices = int(rng.integers(1, 33))
    cluster = Cluster(ClusterConfig(
        name=f"rand{seed}", devices=devices, devices_per_node=dpn, hbm_gb=float(rng.choice([0.02, 0.1, 1.0, 8.0])),
        peak_tflops={"bf16": float(rng.uniform(1, 100))}, intra_node_gbps=float(rng.uniform(5, 200)),
        inter_node_gbps=float(rng.uniform(1, 50)), sku="test", backend="npu", hbm_tbps=1.0,
        tp_sizes=[1, 2, 4, 8], cp_sizes=[1, 2], host_cores=int(rng.choice([0, 0, 0, 1, 2, 4]))))
    roles = ["encoder", "backbone"] if rng.random() < 0.8 else ["encoder", "encoder2", "backbone"]
    parts = [_random_part(rng, r) for r in roles]
    cfg = PlannerConfig(global_batch_size=int(rng.choice([4, 6, 8, 12, 16, 32])),
                        batch_divisible=bool(rng.random() < 0.8),
                        token_budgets=[] if rng.random() < 0.5 else [512, 1024],
                        token_alignment=int(rng.choice([64, 128])), uneven_pp=bool(rng.random() < 0.8),
                        microbatch_overhead_s=float(rng.choice([0.0, 1e-3])))
    return Problem(parts=parts, cluster=cluster, cfg=cfg, budget=devices)


UNEVEN: list[int] = []  # seeds whose plan splits the backbone's layers unevenly


def _objective(problem: Problem, exhaustive: bool, seed: int = -1) -> tuple[float, float, int] | str:
    try:
        plan = make_plan(problem, exhaustive=exhaustive, with_baselines=False)
    except PlanError as e:
        return f"infeasible: {str(e).split(':')[0]}"
    if any(len(set(p.stage_layers)) > 1 for p in plan.parts):
        UNEVEN.append(seed)
    sel = plan.selection
    return (sel.max_time, sel.gap, sel.devices)


def test_cpsat_equals_exhaustive_on_random_planning_instances() -> None:
    feasible = infeasible = 0
    for seed in range(MAX_SEEDS):
        if feasible >= FEASIBLE_WANTED:
            break
        problem = _random_problem(seed)
        a, b = _objective(problem, False, seed), _objective(problem, True)
        if isinstance(a, str) or isinstance(b, str):
            assert a == b, (seed, a, b)
            infeasible += 1
            continue
        feasible += 1
        assert a[0] == pytest.approx(b[0], rel=1e-6), (seed, a, b)
        assert abs(a[1] - b[1]) <= 1e-6 * b[0], (seed, a, b)
        assert a[2] == b[2], (seed, a, b)
    assert feasible >= FEASIBLE_WANTED, (feasible, infeasible)
    assert infeasible > 0  # the refusal path was exercised too
    assert len(UNEVEN) >= 10, UNEVEN  # plans with uneven pipeline stages were among them


def test_cpsat_equals_exhaustive_on_random_option_tables() -> None:
    """The solver core alone, on raw (devices, time) tables with ties and up to 3 parts."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        k = int(rng.integers(1, 4))
        devs = [rng.integers(1, 20, size=int(rng.integers(1, 30))) for _ in range(k)]
        times = [np.round(rng.uniform(0.1, 10, size=len(d)), int(rng.integers(1, 4))) for d in devs]
        budget = int(rng.integers(1, 50))
        a, b = solve_cpsat(devs, times, budget), solve_exhaustive(devs, times, budget)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.max_time == pytest.approx(b.max_time, rel=1e-6)
            assert abs(a.gap - b.gap) <= 1e-6 * b.max_time
            assert a.devices == b.devices


def test_whole_node_solver_equals_exhaustive_on_random_option_tables() -> None:
    """Whole nodes (at most one node, or a multiple of it): the per-residue pruning keeps CP-SAT exact."""
    rng = np.random.default_rng(23)
    for _ in range(300):
        k = int(rng.integers(1, 4))
        node = int(rng.choice([2, 4, 8]))
        devs = [rng.integers(1, 20, size=int(rng.integers(1, 30))) for _ in range(k)]
        times = [np.round(rng.uniform(0.1, 10, size=len(d)), int(rng.integers(1, 4))) for d in devs]
        budget = int(rng.integers(1, 50))
        a, b = solve_cpsat(devs, times, budget, node=node), solve_exhaustive(devs, times, budget, node=node)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.devices <= node or a.devices % node == 0
            assert a.max_time == pytest.approx(b.max_time, rel=1e-6)
            assert abs(a.gap - b.gap) <= 1e-6 * b.max_time
            assert a.devices == b.devices


def test_shared_host_solver_equals_exhaustive_on_random_option_tables() -> None:
    """With the host-CPU bound (step >= sum of busy work / cores), CP-SAT still equals enumeration."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        k = int(rng.integers(1, 4))
        devs = [rng.integers(1, 6, size=int(rng.integers(1, 12))) for _ in range(k)]
        times = [np.round(rng.uniform(0.1, 3, size=len(d)), 2) for d in devs]
        work = [d * t * rng.uniform(0.3, 1, size=len(d)) / float(rng.choice([1, 2, 4])) for d, t in zip(devs, times)]
        budget = int(rng.integers(1, 12))
        a, b = solve_cpsat_shared(devs, times, work, budget), solve_exhaustive(devs, times, budget, work=work)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.max_time == pytest.approx(b.max_time, rel=1e-6)
            assert abs(a.gap - b.gap) <= 1e-6 * b.max_time
            assert a.devices == b.devices
