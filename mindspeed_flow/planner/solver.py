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
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from ortools.sat.python import cp_model  # imported here so solve timings exclude the import

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

    def objective(self) -> tuple[float, float, int]:
        return (self.max_time, self.gap, self.devices)


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


def _cpsat(options: list[np.ndarray], devices: list[np.ndarray], tint: list[np.ndarray], budget: int,
           maximize_min: bool) -> tuple[list[int], int] | None:
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
                tie_key: list[np.ndarray] | None = None) -> Selection | None:
    """Lexicographic optimum (see module docstring) with CP-SAT; None when nothing fits the budget."""
    t0 = time.perf_counter()
    devices, times = _as_arrays(devices, times)
    if any(len(t) == 0 for t in times):
        return None
    scale = _scale(times)
    tint = [np.rint(t * scale).astype(np.int64) for t in times]
    keys = tie_key or [np.zeros_like(t) for t in times]
    # stage 1: min max T over the staircases
    stairs = [staircase(d, t.astype(np.float64), k) for d, t, k in zip(devices, tint, keys)]
    if sum(int(d[s].min()) for d, s in zip(devices, stairs)) > budget:
        return None
    res = _cpsat(stairs, devices, tint, budget, maximize_min=False)
    if res is None:
        return None
    _, z = res
    # stage 2: max min T with every T <= z
    if len(devices) > 1:
        fronts = [_slow_frontier(d, t.astype(np.float64), np.nonzero(t <= z)[0]) for d, t in zip(devices, tint)]
        res2 = _cpsat(fronts, devices, tint, budget, maximize_min=True)
        if res2 is None:  # cannot happen when stage 1 was optimal; keep stage 1's answer
            raise RuntimeError("CP-SAT stage 2 found no solution although stage 1 did")
        _, w = res2
    else:
        w = z
    # stage 3: separable: per part the fewest devices with w <= T <= z (ties: the tie key, then faster)
    choice = []
    for d, t, k in zip(devices, tint, keys):
        ok = np.nonzero((t >= w) & (t <= z))[0]
        best = ok[np.lexsort((t[ok], k[ok], d[ok]))[0]]
        choice.append(int(best))
    return _selection(choice, devices, times, time.perf_counter() - t0, "cp-sat")


def _selection(choice: list[int], devices: list[np.ndarray], times: list[np.ndarray], seconds: float,
               method: str) -> Selection:
    ts = [float(t[c]) for t, c in zip(times, choice)]
    return Selection(choice=choice, max_time=max(ts), gap=max(ts) - min(ts),
                     devices=int(sum(int(d[c]) for d, c in zip(devices, choice))), solve_seconds=seconds,
                     method=method)


def solve_exhaustive(devices: list[np.ndarray], times: list[np.ndarray], budget: int,
                     tie_key: list[np.ndarray] | None = None) -> Selection | None:
    """The same lexicographic objective by enumerating every combination of options (no pruning)."""
    t0 = time.perf_counter()
    devices, times = _as_arrays(devices, times)
    if any(len(t) == 0 for t in times):
        return None
    grids = np.meshgrid(*[np.arange(len(t)) for t in times], indexing="ij")
    idx = [g.ravel() for g in grids]
    tt = np.stack([t[i] for t, i in zip(times, idx)])
    dev = sum(d[i] for d, i in zip(devices, idx))
    ok = dev <= budget
    if not ok.any():
        return None
    tmax, tmin = tt.max(axis=0), tt.min(axis=0)
    z = tmax[ok].min()
    ok &= tmax <= z * (1 + REL_TIE)
    gap = tmax - tmin
    g = gap[ok].min()
    ok &= gap <= g + z * REL_TIE
    dmin = dev[ok].min()
    ok &= dev == dmin
    pick = int(np.nonzero(ok)[0][0])
    return _selection([int(i[pick]) for i in idx], devices, times, time.perf_counter() - t0, "exhaustive")
