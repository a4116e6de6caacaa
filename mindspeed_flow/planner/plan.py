"""Planning end to end: parts + cluster + workload -> option tables -> solver -> a `Plan` with its baselines.

`make_plan(problem)` is the library entry (the CLI, the benchmark and the tests call it). It prices every
structurally valid layout of every part (vectorized, `cost.py`), keeps those that fit in device memory, solves
the lexicographic allocation (`solver.py`), explains which constraint binds, and prices the baselines
(`baselines.py`). When nothing fits it raises `PlanError` naming the binding constraint and the smallest device
count that would fit.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mindspeed_flow.config.planner import PlannerConfig
from mindspeed_flow.planner.baselines import BaselineResult, Counterfactual, all_baselines, gain_split, strongest
from mindspeed_flow.planner.cost import (
    CostContext, Costs, Layouts, embedding_bytes, model_flops_per_step, part_costs, pool_capacity_needed,
    pool_stall_time, stage_layer_list,
)
from mindspeed_flow.planner.hardware import Cluster
from mindspeed_flow.planner.jobs import job_rules
from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.planner.solver import Selection, solve_cpsat, solve_cpsat_shared, solve_exhaustive
from mindspeed_flow.planner.space import PlanError, enumerate_layouts, rc_values

GB = 1e9
STREAM_SEED = 0  # the step's sample stream (Problem.stream): one draw, shared by every priced and replayed row


def resolve_global_batch(cfg: PlannerConfig, devices: int) -> int:
    """planner.global_batch_size, or auto: the most divisible number in [2 x devices, 4 x devices] (>= 16).

    Every DP size must divide the global batch, so a batch with many divisors lets layouts use the whole
    device budget (a power of two would only allow power-of-two DP sizes).
    """
    if cfg.global_batch_size:
        if cfg.global_batch_size < 1:
            raise PlanError(f"planner.global_batch_size={cfg.global_batch_size}: must be >= 1")
        return int(cfg.global_batch_size)
    lo, hi = max(16, 2 * devices), max(32, 4 * devices)
    n = np.arange(lo, hi + 1, dtype=np.int64)
    counts = np.zeros_like(n)
    for d in range(1, int(np.sqrt(hi)) + 1):  # divisor pairs (d, n / d)
        hit = (n % d == 0) & (d * d <= n)
        counts += np.where(hit, np.where(n == d * d, 1, 2), 0)
    return int(n[int(np.argmax(counts))])  # first (smallest) of the most divisible


@dataclass
class Problem:
    parts: list[PartSpec]
    cluster: Cluster
    cfg: PlannerConfig
    budget: int  # devices the plan may use
    global_batch: int = 0  # 0: resolve_global_batch(cfg, budget)
    fixed: dict[str, dict[str, int]] = field(default_factory=dict)  # part name -> pinned layout fields
    model_name: str = "model"
    data_name: str = "data"
    family: str = ""  # the model's HF model_type (which baselines' systems run it); empty: unknown
    # what the step simulator replays (set by inputs.build_problem): the model's VLMSpec and sample shapes
    spec: Any = None
    shapes: tuple = ()

    def __post_init__(self) -> None:
        if not self.global_batch:
            self.global_batch = resolve_global_batch(self.cfg, self.budget)
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise PlanError(f"part names must be unique, got {names}")
        for name in self.fixed:
            if name not in names:
                raise PlanError(f"{name}.*: no part named {name!r}; parts are {names}")

    @property
    def ctx(self) -> CostContext:
        return CostContext(self.cluster, self.cfg, self.global_batch, job_devices=self.budget)

    def stream(self, seed: int = STREAM_SEED) -> list:
        """One step's global batch drawn from the workload's shapes (with replacement, a fixed seed), numbered
        0..G-1: the one sample stream the baselines' loaders are priced on and every `--simulate` row replays."""
        if not self.shapes:
            return []
        idx = np.random.default_rng(seed).integers(0, len(self.shapes), size=self.global_batch)
        return [dataclasses.replace(self.shapes[int(i)], sample_id=k) for k, i in enumerate(idx)]

    def stream_lengths(self) -> np.ndarray | None:
        """LLM tokens per sample of `stream()`, in order (None: no shapes, baselines priced from averages)."""
        s = self.stream()
        return np.array([x.llm_tokens for x in s], dtype=np.float64) if s else None

    @property
    def host_cores(self) -> int:
        """CPU emulation: the cores the devices (processes) share; 0 when devices do not share compute."""
        cores = int(self.cluster.config.host_cores)
        return (os.cpu_count() or 1) if cores < 0 else cores

    @property
    def node(self) -> int:
        """Devices per node when the planned job starts whole nodes (planner.job), else 0."""
        return int(self.cluster.devices_per_node) if job_rules(self.cfg.job).whole_nodes else 0

    @property
    def baseline_ctx(self) -> CostContext:
        """Baselines keep every device busy most of the step: on shared cores they slow down by devices/cores.
        They are priced as their own systems run (every layout the cost model prices), whichever job is planned."""
        cores = self.host_cores
        return CostContext(self.cluster, dataclasses.replace(self.cfg, job=""), self.global_batch,
                           max(1.0, self.budget / cores) if cores > 0 else 1.0, job_devices=self.budget)

    @property
    def memory_limit(self) -> float:
        return self.cluster.hbm_bytes * self.cfg.memory_headroom


@dataclass
class OptionTable:
    """All structurally valid layouts of one part (up to `max_devices`), their costs, and which fit in memory."""

    part: PartSpec
    layouts: Layouts
    costs: Costs
    fits: np.ndarray  # bool: memory within the limit

    @property
    def busy_device_seconds(self) -> np.ndarray:
        """Seconds per step the part's devices compute (pipeline bubbles and the fill wait are idle)."""
        idle = self.costs.time_parts.get("bubble", 0.0) + self.costs.time_parts.get("fill", 0.0)
        return self.layouts.devices * (self.costs.time - idle)

    def usable(self, budget: int) -> np.ndarray:
        return np.nonzero(self.fits & (self.layouts.devices <= budget))[0]


def option_table(part: PartSpec, problem: Problem, max_devices: int, pin: bool = True) -> OptionTable:
    L = enumerate_layouts(part, problem.ctx, max_devices, problem.fixed.get(part.name) if pin else None)
    C = part_costs(part, problem.ctx, L)
    return OptionTable(part, L, C, C.memory <= problem.memory_limit)


@dataclass
class PartPlan:
    name: str
    role: str
    layout: dict[str, int]  # dp, tp, pp, cp, b (token budget), rc (recompute)
    devices: int
    step_seconds: float
    microbatches: int
    memory_gb: dict[str, float]  # weights, grads, optim, activations, buffers, total
    time_parts: dict[str, float]
    stage_layers: list[int] = field(default_factory=list)  # backbone with pp > 1: layers on each stage


@dataclass
class PoolSizing:
    """The embedding pool of a decoupled plan: the capacity it needs, the one it writes, and what a smaller
    (pinned) one costs a step."""

    needed_mb: float  # cost.pool_capacity_needed for the chosen layouts, rounded up to whole MiB
    capacity_mb: float  # what the recipe's flow.pool_capacity_mb says: needed_mb, or planner.pool_capacity_mb
    pinned: bool
    largest_embedding_mb: float  # the workload's largest sample embedding
    stall_s: float  # seconds a step waits on credits (0 unless pinned below needed_mb)


def size_pool(problem: Problem, parts: list["PartPlan"]) -> PoolSizing | None:
    """The pool the chosen layouts need (`cost.pool_capacity_needed`), or the pinned one and its stall; each
    encoder part's memory figure books the capacity (an upper bound on the embeddings it has in flight).
    flow.pool_capacity_mb is one figure for every producer, so with several encoder parts (vision, audio) it is
    the largest any of them needs, and a pinned one stalls the step by the longest of their waits."""
    by_name = {p.name: p for p in parts}
    bb = next((p for p in parts if p.role == "backbone"), None)
    encoders = [(p, by_name[p.name]) for p in problem.parts if p.role == "encoder" and p.name in by_name]
    if bb is None or not encoders:
        return None
    ctx = problem.ctx
    m = max(bb.microbatches, 1)
    needed = max(float(np.ceil(pool_capacity_needed(spec, ctx, int(plan.layout["dp"]), m, int(bb.layout["pp"]))
                               / 2**20)) for spec, plan in encoders)
    pinned = problem.cfg.pool_capacity_mb > 0
    capacity = float(problem.cfg.pool_capacity_mb) if pinned else needed
    stall = 0.0
    for spec, plan in encoders:
        if pinned:  # one sample's encoder forward on a producer (what a short round waits for): the fill
            stall = max(stall, pool_stall_time(spec, ctx, capacity * 2**20, int(plan.layout["dp"]), m,
                                               plan.time_parts.get("fill", 0.0)))
        else:  # book the capacity on the encoder (a pinned one: at most the embeddings it holds, as priced)
            mem = plan.memory_gb
            mem["total"] += capacity * 2**20 / GB - mem.get("buffers", 0.0)
            mem["buffers"] = capacity * 2**20 / GB
    largest = max(embedding_bytes(spec, ctx, spec.max_out_tokens) for spec, _ in encoders) / 2**20
    return PoolSizing(needed_mb=needed, capacity_mb=capacity, pinned=pinned, largest_embedding_mb=largest,
                      stall_s=stall)


@dataclass
class Plan:
    problem: Problem
    parts: list[PartPlan]
    selection: Selection
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    binding: list[str]
    baselines: dict[str, BaselineResult | None]
    options_priced: int
    solve_seconds: float
    pool: "PoolSizing | None" = None  # the embedding pool the plan writes (None: no encoder part)
    gain_split: list[Counterfactual] = field(default_factory=list)  # the gain over the strongest, by mechanism

    @property
    def step_seconds(self) -> float:
        """The slowest part's step, plus the waits of a pinned pool smaller than the plan needs."""
        return self.selection.max_time + (self.pool.stall_s if self.pool else 0.0)

    @property
    def devices(self) -> int:
        return self.selection.devices

    @property
    def mfu_cluster(self) -> float:
        """MFU over every device the plan was given (devices=, or the preset's size): idle devices count."""
        return self.mfu * self.devices / max(self.problem.budget, 1)

    @property
    def strongest_baseline(self) -> BaselineResult | None:
        return strongest(self.baselines)




def _part_plan(table: OptionTable, i: int) -> PartPlan:
    c = table.costs
    mem = {k: float(v[i]) / GB for k, v in c.memory_parts.items()}
    mem["total"] = float(c.memory[i]) / GB
    pp = int(table.layouts.pp[i])
    split = []
    if c.stage_layers and pp > 1:
        split = stage_layer_list(c.stage_layers, pp, i)
    return PartPlan(name=table.part.name, role=table.part.role, layout=table.layouts.row(i),
                    devices=int(table.layouts.devices[i]), step_seconds=float(c.time[i]),
                    microbatches=int(c.microbatches[i]) if c.microbatches is not None else 0, memory_gb=mem,
                    time_parts={k: float(v[i]) for k, v in c.time_parts.items()}, stage_layers=split)


def _solve(tables: list[OptionTable], budget: int, exhaustive: bool,
           host_cores: int = 0, node: int = 0) -> tuple[Selection | None, list[np.ndarray]]:
    usable = [t.usable(budget) for t in tables]
    devs = [t.layouts.devices[u] for t, u in zip(tables, usable)]
    times = [t.costs.time[u] for t, u in zip(tables, usable)]
    keys = [t.costs.memory[u] for t, u in zip(tables, usable)]  # ties: the layout that needs less memory
    if host_cores > 0:  # devices share host cores: the step also waits for all busy work / cores
        work = [t.busy_device_seconds[u] / host_cores for t, u in zip(tables, usable)]
        if exhaustive:
            return solve_exhaustive(devs, times, budget, keys, work=work), usable
        return solve_cpsat_shared(devs, times, work, budget, keys), usable
    if exhaustive:
        return solve_exhaustive(devs, times, budget, keys, node=node), usable
    return solve_cpsat(devs, times, budget, keys, node=node), usable


def smallest_fitting_devices(problem: Problem, pin: bool = True) -> tuple[int | None, dict[str, int | None]]:
    """Fewest devices at which every part has a layout that fits in memory (per part, and their sum)."""
    per_part: dict[str, int | None] = {}
    for part in problem.parts:
        table = option_table(part, problem, max_devices=1 << 30, pin=pin)
        ok = np.nonzero(table.fits)[0]
        per_part[part.name] = int(table.layouts.devices[ok].min()) if len(ok) else None
    if any(v is None for v in per_part.values()):
        return None, per_part
    return int(sum(per_part.values())), per_part  # type: ignore[arg-type]


def _infeasible(problem: Problem, tables: list[OptionTable]) -> PlanError:
    """The message for a problem with no solution: the binding constraint and the smallest fitting size."""
    need, per_part = smallest_fitting_devices(problem)
    limit_gb = problem.memory_limit / GB
    for part, table in zip(problem.parts, tables):
        if per_part[part.name] is None:
            i = int(np.argmin(table.costs.memory)) if len(table.layouts) else None
            detail = "" if i is None else (f"; its leanest layout {_fmt_layout(table.layouts.row(i))} needs "
                                           f"{table.costs.memory[i] / GB:.1f} GB")
            return PlanError(
                f"memory: the {part.name} does not fit in {limit_gb:.1f} GB per device "
                f"(hbm_gb={problem.cluster.config.hbm_gb} x headroom {problem.cfg.memory_headroom}) at any layout"
                f"{detail}; no device count fits: use devices with more memory, recompute, or smaller samples")
    split = " + ".join(f"{k} {v}" for k, v in per_part.items())
    return PlanError(
        f"device budget: {problem.budget} devices are too few; the smallest plan that fits in memory needs "
        f"{need} devices ({split}); set devices>={need} or pick a cluster with more memory per device")


def _fmt_layout(row: dict[str, int]) -> str:
    s = f"dp{row['dp']} tp{row['tp']} pp{row['pp']} cp{row['cp']}"
    if int(row.get("ep") or 1) > 1:
        s += f" ep{row['ep']}"
    if row.get("b"):
        s += f" budget{row['b']}"
    return s + {0: "", 1: " recompute", 2: " recompute per layer"}.get(int(row.get("rc") or 0), " recompute")


def _binding(problem: Problem, tables: list[OptionTable], sel: Selection) -> list[str]:
    """Which constraints stop a faster plan: device budget, memory, global batch (tested one at a time)."""
    out: list[str] = []
    chosen = [int(u) for u in sel.choice]
    times = [float(t.costs.time[c]) for t, c in zip(tables, chosen)]
    k = int(np.argmax(times))
    bott, c_b = tables[k], chosen[k]
    others = sel.devices - int(bott.layouts.devices[c_b])
    faster = bott.costs.time < times[k] * (1 - 1e-9)
    room = problem.budget - others
    beyond = faster & bott.fits & (bott.layouts.devices > room)
    if beyond.any():
        more = int(bott.layouts.devices[beyond].min()) + others
        out.append(f"device budget: the {bott.part.name} (the bottleneck) would run faster with more devices "
                   f"(a {more}-device plan is faster)")
    mem_blocked = faster & ~bott.fits & (bott.layouts.devices <= room)
    if mem_blocked.any():
        j = int(np.nonzero(mem_blocked)[0][np.argmin(bott.costs.memory[mem_blocked])])  # the nearest miss
        out.append(f"memory: a faster {bott.part.name} layout {_fmt_layout(bott.layouts.row(j))} would need "
                   f"{bott.costs.memory[j] / GB:.1f} GB > {problem.memory_limit / GB:.1f} GB per device")
    if int(bott.layouts.dp[c_b]) == problem.global_batch:
        out.append(f"global batch: the {bott.part.name} already runs one sample per DP rank "
                   f"(global batch {problem.global_batch})")
    if sel.max_time > max(times) * (1 + 1e-9):
        out.append(f"host CPU: the {sel.devices} device processes share {problem.host_cores} cores; their busy "
                   f"work per step ({sel.max_time:.3g} s per core) exceeds the slowest part ({max(times):.3g} s)")
    idle = problem.budget - sel.devices
    if idle > 0:
        nodes = (f"; the job starts whole nodes of {problem.node}" if problem.node > 1 else "")
        out.append(f"layout granularity: {idle} devices stay idle because no faster layout uses them "
                   f"(devices = dp x tp x pp x cp, dp divides the global batch {problem.global_batch}{nodes})")
    if not out:
        out.append("none binding: a layout rule (TP in a node, divisibility) or the rate balance itself")
    return out


def shared_rc_problems(problem: Problem) -> list[Problem]:
    """For a job whose encoder parts recompute alike (`JobRules.shared_encoder_settings`: the torch host's one
    flow.keep_encoder_activations) with several trainable encoder parts: `problem` once per level the parts share,
    each with every encoder part's rc pinned to it; [] for any other job (each part takes its own level)."""
    rules = job_rules(problem.cfg.job)
    encoders = [p for p in problem.parts if p.role == "encoder" and p.trainable]
    if not rules.shared_encoder_settings or len(encoders) < 2:
        return []
    pinned = {p.name: problem.fixed[p.name]["rc"] for p in encoders if "rc" in problem.fixed.get(p.name, {})}
    if len(set(pinned.values())) > 1:
        raise PlanError(f"{', '.join(f'{k}.rc={v}' for k, v in pinned.items())}: {rules.label} recomputes its "
                        "encoder parts alike (one flow.keep_encoder_activations); pin one level for all of them")
    levels = sorted(set(pinned.values())) or sorted(set.intersection(*(set(rc_values(p, problem.ctx))
                                                                         for p in encoders)))
    return [dataclasses.replace(problem, fixed={**problem.fixed, **{p.name: {**problem.fixed.get(p.name, {}),
                                                                             "rc": rc} for p in encoders}})
            for rc in levels]


def make_plan(problem: Problem, exhaustive: bool = False, with_baselines: bool = True) -> Plan:
    """Plan `problem` (see the module docstring); raises PlanError with the binding constraint if nothing fits.
    Encoder parts that must recompute alike (`shared_rc_problems`): each shared level is planned, the faster kept."""
    variants = shared_rc_problems(problem)
    if variants:
        plans: list[Plan] = []
        first_error: PlanError | None = None
        for variant in variants:
            try:
                plans.append(make_plan_parts(variant, exhaustive, with_baselines))
            except PlanError as e:
                first_error = first_error or e
        if not plans:
            raise first_error if first_error is not None else PlanError("no recompute level to plan")
        best = max(plans, key=lambda p: p.samples_per_s)
        # the pins were the search's, not the user's: the plan reports the problem as asked
        return dataclasses.replace(best, problem=problem)
    return make_plan_parts(problem, exhaustive, with_baselines)


def make_plan_parts(problem: Problem, exhaustive: bool = False, with_baselines: bool = True) -> Plan:
    """`make_plan` with each part's layout searched on its own."""
    if problem.budget < 1:
        raise PlanError(f"devices={problem.budget}: must be >= 1")
    if problem.budget > problem.cluster.devices:
        raise PlanError(f"devices={problem.budget} exceeds cluster {problem.cluster.name!r} "
                        f"({problem.cluster.devices} devices)")
    t0 = time.perf_counter()
    try:
        # 2x the budget so the binding-constraint analysis can see what more devices would buy
        tables = [option_table(p, problem, max_devices=2 * problem.budget) for p in problem.parts]
    except PlanError as e:
        need, _ = smallest_fitting_devices(problem, pin=False)
        hint = "" if need is None else f"; without the pinned value the smallest fitting plan needs {need} devices"
        raise PlanError(f"{e}{hint}") from None
    sel, usable = _solve(tables, problem.budget, exhaustive, problem.host_cores, problem.node)
    if sel is None:
        raise _infeasible(problem, tables)
    solve_seconds = time.perf_counter() - t0
    sel.choice = [int(u[c]) for u, c in zip(usable, sel.choice)]
    parts = [_part_plan(t, c) for t, c in zip(tables, sel.choice)]
    ctx = problem.ctx
    base_ctx = problem.baseline_ctx
    flops = model_flops_per_step(problem.parts, problem.global_batch)
    pool = size_pool(problem, parts)
    step = sel.max_time + (pool.stall_s if pool else 0.0)
    backbone = next((p for p in problem.parts if p.role == "backbone"), problem.parts[-1])
    baselines: dict[str, BaselineResult | None] = {}
    lengths = problem.stream_lengths() if with_baselines else None  # one draw for the baselines and the split
    # the vision encoder, and the audio encoder when it is a part: the coupled baselines run both on stage 0
    enc = next((p for p in problem.parts if p.role == "encoder" and p.name != "audio"), None)
    audio = next((p for p in problem.parts if p.name == "audio"), None)
    if with_baselines and enc is not None and len(problem.parts) == 2 + (audio is not None):
        baselines = all_baselines(enc, backbone, base_ctx, problem.budget, problem.node, problem.family,
                                  lengths, audio=audio)
    mfu = flops / (step * sel.devices * ctx.peak)
    split: list[Counterfactual] = []
    base = strongest(baselines)
    if base is not None and enc is not None:
        split = gain_split(enc, backbone, base_ctx, problem.budget, base,
                           (problem.global_batch / step, mfu, sel.devices), problem.node, lengths, audio=audio)
    return Plan(
        problem=problem, parts=parts, selection=sel, samples_per_s=problem.global_batch / step,
        tokens_per_s=problem.global_batch * backbone.tokens_per_sample / step,
        mfu=mfu, binding=_binding(problem, tables, sel), baselines=baselines,
        options_priced=sum(len(t.layouts) for t in tables), solve_seconds=solve_seconds, pool=pool,
        gain_split=split,
    )
