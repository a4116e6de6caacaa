"""`mindspeed-flow bench simulator`: its pieces (fair probe, per-step windows, host capacity, pool primitive, the
simulator's capacity hook) and one small layout end to end. No test asserts on a wall-clock-derived error: the
machine is shared; only that every figure is there, finite and consistent."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from mindspeed_flow.bench import simulator as sb
from mindspeed_flow.planner.simulate import Simulator


def test_fair_share_between_groups() -> None:
    assert sb.fair_share(2.0, [1, 1]) == [1.0, 1.0]
    assert sb.fair_share(2.0, [2, 1, 1]) == pytest.approx([2 / 3] * 3)
    assert sb.fair_share(2.0, [3, 0.5]) == pytest.approx([1.5, 0.5])  # a light group leaves the rest
    assert sb.fair_share(2.0, [1]) == [1.0]  # never more than its runnable threads
    runnable = sb.runnable_by_group({})
    assert all(v >= 1 for v in runnable.values())


def test_host_capacity_and_simulator_capacity_hook() -> None:
    assert sb.host_capacity(0.5, 3, 2.0) == [0.0, 0.5, 1.0, 1.0]
    # two ranks computing 1 s each on 2 cores: 1 s alone, 2 s when each gets half a core
    for cap, want in ((None, 1.0), ([0.0, 0.5, 1.0], 2.0), ([0.0, 1.0, 1.0], 2.0)):
        sim = Simulator(2, cores=2, capacity=cap)
        sim.add(0, "a", 1.0)
        sim.add(1, "b", 1.0)
        assert sim.run() == pytest.approx(want)
    sim = Simulator(2, cores=2, capacity=[0.0, 0.25, 0.5])  # one rank alone: capacity[1]
    sim.add(0, "a", 1.0)
    assert sim.run() == pytest.approx(4.0)


def test_step_watch_windows_and_host_probe(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    probe = sb.HostProbe(interval_s=0.01, burst_s=0.002)
    watch = sb.StepWatch(root=os.getpid(), metrics=metrics, interval_s=0.005)
    watch.start()
    for step in range(3):
        time.sleep(0.15)
        with metrics.open("a") as f:
            f.write(json.dumps({"step": step}) + "\n")
        deadline = time.monotonic() + 30
        while len(watch.step_ends) <= step and time.monotonic() < deadline:  # the watcher saw this step end
            time.sleep(0.005)
    time.sleep(0.1)
    watch.stop()
    probe.stop()
    assert len(watch.step_ends) == 3 and watch.step_ends == sorted(watch.step_ends)
    lo, hi = watch.window(2)
    assert hi - lo >= 0.15
    assert len(watch.job_cpu) == 3
    assert probe.samples, "the probe ran no burst"
    share = probe.share(probe.samples[0][0], probe.samples[-1][0])
    assert 0.0 < share <= 1.0  # a computing probe always gets some of a core
    assert probe.cpu_cost(probe.samples[0][0], probe.samples[-1][0]) > 0
    cap = probe.group_capacity(probe.samples[0][0], probe.samples[-1][0] + 1, "no-such-group", 3, 2.0)
    assert len(cap) == 4 and cap[0] == 0.0 and all(0 < c <= min(n, 2.0) + 1e-9 for n, c in enumerate(cap) if n)
    assert cap == sorted(cap)  # more computing ranks never get fewer cores
    assert math.isnan(probe.share(hi + 10, hi + 11))


@pytest.mark.timeout(200)
def test_pool_primitive_costs_cpu_on_both_sides() -> None:
    prod, cons = sb.pool_cpu_per_item(64 * 1024, with_grads=True, items=8, repeats=2)
    assert prod > 0 and cons > 0
    assert prod < 0.5 and cons < 0.5  # seconds per item: a loose sanity bound, not a speed goal


@pytest.mark.timeout(600)
def test_bench_runs_end_to_end_on_one_layout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # a small named layout (one coupled rank) on the small model, to keep the test short
    args = sb.parse_args(["--layouts", "coupled-dp1", "--model", "tiny_qwen2_vl", "--data", "infovqa_tiny",
                          "--global-batch", "4", "--steps", "3", "--warmup", "1", "--repeats", "1", "--rounds", "1",
                          "--max-load", "0",
                          "--workdir", str(tmp_path), "--probe", "--json"])
    report = sb.measure(args)
    assert len(report["rows"]) == 1
    row = report["rows"][0]
    # steps 1 and 2 are measured; those another job shared the host with are left out unless none was quiet
    assert row["layout"] == "coupled-dp1" and row["world"] == 1 and row["steps"] in ([1], [2], [1, 2])
    assert "parallel.world_size=1" in row["overrides"]
    for key in ("measured_s", "simulated_s", "analytic_s", "probe_s"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["sim_error"] == pytest.approx(row["simulated_s"] / row["measured_s"] - 1)
    assert row["analytic_error"] == pytest.approx(row["analytic_s"] / row["measured_s"] - 1)
    assert report["mean_abs_sim_error"] == pytest.approx(abs(row["sim_error"]))
    assert len(row["simulated_steps_s"]) == len(row["measured_steps_s"]) == len(row["steps"])
    assert 0.0 < row["core_share"] <= 1.0
    assert row["charged_cpu_per_step_s"] > 0 and row["pool_item_cpu_s"] == [0.0, 0.0]  # coupled: no pool
    # per measured step and round: other jobs' runnable threads; the steps counted are the quiet ones (or all)
    assert [len(x) for x in row["other_threads_per_step"]] == [1, 1]
    assert row["quiet"] or row["steps"] == [1, 2]
    assert len(row["concurrency_slowdown"]) == sb.physical_cores() and row["concurrency_slowdown"][0] == 1.0
    text = sb.table(report)
    assert "coupled-dp1" in text and "mean |error|" in text and "probe s" in text
    # steps no 0.1 s scan fell inside (short steps on a busy host): the others' column says so, the table still prints
    row["other_threads_per_step"] = [[math.nan], [math.nan]]
    assert " n/a" in sb.table(report).splitlines()[2]


def test_bench_arguments_and_layouts() -> None:
    with pytest.raises(SystemExit):
        sb.parse_args(["--steps", "3", "--warmup", "3"])
    with pytest.raises(SystemExit):
        sb.parse_args(["--rounds", "0"])
    args = sb.parse_args([])
    names = args.layouts.split(",")
    assert len(names) >= 5 and any("pp2" in n for n in names) and set(names) <= set(sb.HEADLINE_LAYOUTS)
    with pytest.raises(ValueError, match="--layouts"):
        sb.layout_overrides("no-such-layout", args)
    assert sb.layout_overrides("coupled-pp2-split13", args)[-1] == "parallel.coupled.layer_split=[1,3]"
    # more ranks than physical cores: refused up front (before any profiling or training) unless asked for
    many = sb.physical_cores() + 1
    with pytest.raises(SystemExit, match="--oversubscribed"):
        sb.measure(sb.parse_args(["--layouts", f"e1-b{many - 1}", "--max-load", "0"]))
    assert sb.layout_world(f"e1-b{many - 1}", args) == many
    assert sb.layout_world("coupled-dp1", args) == 1 and sb.layout_world("decoupled-1+1", args) == 2
    # every headline layout fits a 2-core host: one rank per core at most
    from mindspeed_flow.config.load import compose, to_job_config
    from mindspeed_flow.step.layout import Layout

    for name in sb.HEADLINE_LAYOUTS:
        job = to_job_config(compose(sb.layout_overrides(name, args)))
        assert Layout.from_config(job.parallel, job.flow.mode).world_size <= 2, name


@pytest.mark.timeout(60)
def test_runnable_outside_sees_another_sessions_busy_thread() -> None:
    import subprocess
    import sys

    mine = {os.getsid(0)}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)
        seen = [sb.runnable_outside(mine, {}) for _ in range(20)]
        assert max(seen) >= 1  # a spinning process of its own session is another job's runnable thread
    finally:
        busy.kill()
        busy.wait()
