"""Choosing one layout per part: the OR-Tools CP-SAT model, and the exhaustive enumeration it is tested against.

Input: for each part a table of feasible options (devices, step seconds); a device budget N. The objective is
lexicographic:
  1. minimize the slowest part's step time z = max_p T_p (steady-state throughput = G / z: the slower of
     producer and consumer sets the pace);
  2. then minimize the rate gap z - min_p T_p (the faster part idles that long every step);
  3. then minimize the devices used.
Solved as three small CP-SAT models (solve, fix, re-solve), each over per-part option sets pruned in a way that
provably keeps that stage's optimum:
  stage 1 keeps, per part, the (devices, time) Pareto staircase: an option that another beats on both devices
          and time can be swapped for it without breaking the budget or raising max T;
  stage 2 keeps options with T <= z* on the (fewer devices, slower) frontier, which is what maximizing min T
          needs; every selection there has max T = z* because z* is optimal;
  stage 3 is separable once z* and w* = min T are fixed (each part: fewest devices with w* <= T <= z*), and the
          sum fits the budget because the stage-2 solution does.
Times enter CP-SAT as integers (seconds x scale, about 1e-7 relative resolution).

Whole nodes (`node` > 1, what a job's launch script starts): the devices used must be at most one node or a
whole number of nodes. Swapping an option for one with the same devices modulo `node` keeps that property, so
the staircase and frontier are kept per residue class (at most `node` times the options) and stay exact; stage 3
is then a small CP-SAT model (fewest devices per part and residue) instead of a separable pick.

CPU-emulated clusters, whose devices are processes sharing a few cores, add one more bound: the step cannot
be shorter than the busy work of all parts divided by the cores (sum_p W_p). That couples the parts, so
`solve_cpsat_shared` solves the same three stages as general CP-SAT models over all options (no pruning:
such clusters have a handful of devices).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from ortools.sat.python import cp_model  # imported here so solve timings exclude the import

from mindspeed_flow.planner.jobs import node_sizes

TIME_RESOLUTION = 1e7  # the fastest option maps to this many integer units
REL_TIE = 1e-9  # exhaustive: times this close (relative) are ties


@dataclass
class Selection:
    choice: list[int]  # option index per part
    max_time: float
    gap: float
    devices: int
    solve_seconds: float
    method: str


def _scale(times: Sequence[np.ndarray]) -> float:
    lo = min(float(np.min(t)) for t in times if len(t))
    return TIME_RESOLUTION / max(lo, 1e-30)


def staircase(devices: np.ndarray, times: np.ndarray, order_key: np.ndarray | None = None) -> np.ndarray:
    """Indices of the (devices, time) Pareto front: strictly faster as devices grow (ties: first by order_key)."""
    key = np.zeros_like(times) if order_key is None else order_key
    order = np.lexsort((key, times, devices))
    keep, best = [], np.inf
    for i in order:
        if times[i] < best:
            keep.append(i)
            best = times[i]
    return np.asarray(keep, dtype=np.int64)


def _slow_frontier(devices: np.ndarray, times: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Among idx, the (fewer devices, larger time) front: strictly slower as devices grow."""
    order = idx[np.lexsort((-times[idx], devices[idx]))]
    keep, best = [], -np.inf
    for i in order:
        if times[i] > best:
            keep.append(i)
            best = times[i]
    return np.asarray(keep, dtype=np.int64)


def _per_residue(devices: np.ndarray, idx: np.ndarray, node: int, front) -> np.ndarray:
    """`front` (a Pareto filter over idx) applied per class of devices modulo `node` (all of idx when node <= 1)."""
    if node <= 1:
        return front(idx)
    res = devices[idx] % node
    kept = [front(idx[res == r]) for r in np.unique(res)]
    return np.concatenate(kept) if kept else idx[:0]


def _whole_nodes(m: "cp_model.CpModel", total, budget: int, node: int) -> None:
    """total devices in {1..node} or a multiple of node (see `jobs.node_sizes`)."""
    if node > 1:
        m.add_linear_expression_in_domain(total, cp_model.Domain.from_intervals(
            [list(iv) for iv in node_sizes(budget, node)]))


def _cpsat(options: list[np.ndarray], devices: list[np.ndarray], tint: list[np.ndarray], budget: int,
           maximize_min: bool, node: int = 0) -> tuple[list[int], int] | None:
    """One CP-SAT model: pick one option per part within the budget; minimize max T or maximize min T."""
    m = cp_model.CpModel()
    hi = int(max(int(t[o].max()) for t, o in zip(tint, options)))
    bound = m.new_int_var(0, hi, "bound")
    xs, used = [], []
    for p, opts in enumerate(options):
        x = [m.new_bool_var(f"x{p}_{k}") for k in range(len(opts))]
        m.add_exactly_one(x)
        t_p = sum(int(tint[p][o]) * v for o, v in zip(opts, x))
        if maximize_min:
            m.add(bound <= t_p)
        else:
            m.add(bound >= t_p)
        used.append(sum(int(devices[p][o]) * v for o, v in zip(opts, x)))
        xs.append(x)
    m.add(sum(used) <= budget)
    _whole_nodes(m, sum(used), budget, node)
    if maximize_min:
        m.maximize(bound)
    else:
        m.minimize(bound)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # tiny models: one worker is fastest and deterministic
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL,):
        return None
    choice = [int(opts[next(k for k, v in enumerate(x) if solver.value(v))]) for opts, x in zip(options, xs)]
    return choice, int(solver.value(bound))


def _as_arrays(devices: Sequence[np.ndarray],
               times: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return [np.asarray(d, dtype=np.int64) for d in devices], [np.asarray(t, dtype=np.float64) for t in times]


def solve_cpsat(devices: list[np.ndarray], times: list[np.ndarray], budget: int,
                tie_key: list[np.ndarray] | None = None, node: int = 0) -> Selection | None:
    """Lexicographic optimum (see module docstring) with CP-SAT; None when nothing fits the budget (in whole
    nodes of `node` devices when node > 1)."""
    t0 = time.perf_counter()
    devices, times = _as_arrays(devices, times)
    if any(len(t) == 0 for t in times):
        return None
    scale = _scale(times)
    tint = [np.rint(t * scale).astype(np.int64) for t in times]
    keys = tie_key or [np.zeros_like(t) for t in times]
    # stage 1: min max T over the staircases
    stairs = [_per_residue(d, np.arange(len(d)), node, lambda ix, d=d, t=t, k=k: ix[staircase(
        d[ix], t[ix].astype(np.float64), k[ix])]) for d, t, k in zip(devices, tint, keys)]
    if sum(int(d[s].min()) for d, s in zip(devices, stairs)) > budget:
        return None
    res = _cpsat(stairs, devices, tint, budget, maximize_min=False, node=node)
    if res is None:
        return None
    _, z = res
    # stage 2: max min T with every T <= z
    if len(devices) > 1:
        fronts = [_per_residue(d, np.nonzero(t <= z)[0], node, lambda ix, d=d, t=t: _slow_frontier(
            d, t.astype(np.float64), ix)) for d, t in zip(devices, tint)]
        res2 = _cpsat(fronts, devices, tint, budget, maximize_min=True, node=node)
        if res2 is None:  # cannot happen when stage 1 was optimal; keep stage 1's answer
            raise RuntimeError("CP-SAT stage 2 found no solution although stage 1 did")
        _, w = res2
    else:
        w = z
    # stage 3: per part the fewest devices with w <= T <= z (ties: the tie key, then faster); separable unless
    # whole nodes couple the parts, then per residue class and a small CP-SAT model over those
    choice = []
    picks = []
    for d, t, k in zip(devices, tint, keys):
        ok = np.nonzero((t >= w) & (t <= z))[0]
        picks.append(_per_residue(d, ok, node, lambda ix, d=d, t=t, k=k: ix[np.lexsort((t[ix], k[ix], d[ix]))[:1]]))
        choice.append(int(picks[-1][np.argmin(d[picks[-1]])]) if node <= 1 else -1)
    if node > 1:
        choice = _fewest_devices(picks, devices, budget, node)
    return _selection(choice, devices, times, time.perf_counter() - t0, "cp-sat")


def _fewest_devices(options: list[np.ndarray], devices: list[np.ndarray], budget: int, node: int) -> list[int]:
    """One option per part (from `options`) using the fewest devices, in whole nodes."""
    m = cp_model.CpModel()
    xs = []
    for p, opts in enumerate(options):
        x = [m.new_bool_var(f"x{p}_{k}") for k in range(len(opts))]
        m.add_exactly_one(x)
        xs.append(x)
    used = sum(int(devices[p][o]) * v for p, (opts, x) in enumerate(zip(options, xs)) for o, v in zip(opts, x))
    m.add(used <= budget)
    _whole_nodes(m, used, budget, node)
    m.minimize(used)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    if solver.solve(m) != cp_model.OPTIMAL:
        raise RuntimeError("CP-SAT stage 3 found no solution although stages 1 and 2 did")
    return [int(opts[next(k for k, v in enumerate(x) if solver.value(v))]) for opts, x in zip(options, xs)]


def _cpsat_shared(devices: list[np.ndarray], tint: list[np.ndarray], wint: list[np.ndarray], budget: int,
                  stage: str, z: int = 0, gap: int = 0) -> tuple[list[int], int] | None:
    """The three stages over every option when parts share host cores (CPU emulation):
    step Z = max(max_p T_p, sum_p W_p) with W the busy work per core; gap = max_p T_p - min_p T_p."""
    m = cp_model.CpModel()
    top = int(max(int(t.max()) for t in tint) + sum(int(w.max()) for w in wint))
    big_z = m.new_int_var(0, top, "z")
    hi, lo = m.new_int_var(0, top, "hi"), m.new_int_var(0, top, "lo")
    xs, used, work = [], [], []
    for p in range(len(devices)):
        x = [m.new_bool_var(f"x{p}_{k}") for k in range(len(tint[p]))]
        m.add_exactly_one(x)
        t_p = sum(int(tint[p][k]) * v for k, v in enumerate(x))
        m.add(big_z >= t_p)
        m.add(hi >= t_p)
        m.add(lo <= t_p)
        work.append(sum(int(wint[p][k]) * v for k, v in enumerate(x)))
        used.append(sum(int(devices[p][k]) * v for k, v in enumerate(x)))
        xs.append(x)
    m.add(big_z >= sum(work))
    m.add(sum(used) <= budget)
    if stage == "z":
        m.minimize(big_z)
    else:
        m.add(big_z <= z)
        if stage == "gap":
            m.minimize(hi - lo)
        else:
            m.add(hi - lo <= gap)
            m.minimize(sum(used))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    if solver.solve(m) != cp_model.OPTIMAL:
        return None
    choice = [next(k for k, v in enumerate(x) if solver.value(v)) for x in xs]
    value = {"z": big_z, "gap": hi - lo}.get(stage)
    return choice, int(solver.value(value)) if value is not None else 0


def solve_cpsat_shared(devices: list[np.ndarray], times: list[np.ndarray], work: list[np.ndarray], budget: int,
                       tie_key: list[np.ndarray] | None = None) -> Selection | None:
    """Lexicographic optimum when the parts share host cores: the step also waits for sum_p work_p (each
    option's busy device-seconds divided by the cores). No pruning: such clusters are a few devices."""
    t0 = time.perf_counter()
    devices, times = _as_arrays(devices, times)
    work = [np.asarray(w, dtype=np.float64) for w in work]
    if any(len(t) == 0 for t in times):
        return None
    scale = _scale(times)
    tint = [np.rint(t * scale).astype(np.int64) for t in times]
    wint = [np.rint(w * scale).astype(np.int64) for w in work]
    res = _cpsat_shared(devices, tint, wint, budget, "z")
    if res is None:
        return None
    z = res[1]
    gap = _cpsat_shared(devices, tint, wint, budget, "gap", z=z)[1]  # type: ignore[index]
    choice = _cpsat_shared(devices, tint, wint, budget, "dev", z=z, gap=gap)[0]  # type: ignore[index]
    return _selection(choice, devices, times, time.perf_counter() - t0, "cp-sat", work)


def _selection(choice: list[int], devices: list[np.ndarray], times: list[np.ndarray], seconds: float,
               method: str, work: list[np.ndarray] | None = None) -> Selection:
    ts = [float(t[c]) for t, c in zip(times, choice)]
    shared = 0.0 if work is None else sum(float(w[c]) for w, c in zip(work, choice))
    return Selection(choice=choice, max_time=max(max(ts), shared), gap=max(ts) - min(ts),
                     devices=int(sum(int(d[c]) for d, c in zip(devices, choice))), solve_seconds=seconds,
                     method=method)


def solve_exhaustive(devices: list[np.ndarray], times: list[np.ndarray], budget: int,
                     tie_key: list[np.ndarray] | None = None,
                     work: list[np.ndarray] | None = None, node: int = 0) -> Selection | None:
    """The same lexicographic objective by enumerating every combination of options (no pruning); with
    `work`, the step is max(max_p T_p, sum_p work_p) as in `solve_cpsat_shared`."""
    t0 = time.perf_counter()
    devices, times = _as_arrays(devices, times)
    if any(len(t) == 0 for t in times):
        return None
    grids = np.meshgrid(*[np.arange(len(t)) for t in times], indexing="ij")
    idx = [g.ravel() for g in grids]
    tt = np.stack([t[i] for t, i in zip(times, idx)])
    dev = sum(d[i] for d, i in zip(devices, idx))
    ok = dev <= budget
    if node > 1:
        ok &= np.any([(dev >= lo) & (dev <= hi) for lo, hi in node_sizes(budget, node)], axis=0)
    if not ok.any():
        return None
    tmax, tmin = tt.max(axis=0), tt.min(axis=0)
    step = tmax if work is None else np.maximum(tmax, sum(np.asarray(w, dtype=np.float64)[i]
                                                           for w, i in zip(work, idx)))
    z = step[ok].min()
    ok &= step <= z * (1 + REL_TIE)
    gap = tmax - tmin
    g = gap[ok].min()
    ok &= gap <= g + z * REL_TIE
    dmin = dev[ok].min()
    ok &= dev == dmin
    pick = int(np.nonzero(ok)[0][0])
    return _selection([int(i[pick]) for i in idx], devices, times, time.perf_counter() - t0, "exhaustive", work)
