"""The search space of one part: every structurally valid layout (dp, tp, pp, cp, ep, token budget, recompute).

Structural rules (checked here, before any cost is computed) and the message each gives when a user pins a
value that breaks it:
- TP inside a node: tp <= devices_per_node and tp divides it (TP collectives run every layer);
- TP sizes the runtime supports on this cluster (cluster.tp_sizes; CPU: 1) and CP sizes (cluster.cp_sizes);
- heads divisible by tp (and KV heads divisible by tp, or tp by KV heads: replicated KV);
- expert parallelism (MoE backbones; 1 otherwise): ep divides the routed experts and dp x tp (the experts are
  not tensor-split, so the ep ranks come out of the dp x tp ranks of a stage, as Megatron's expert-tensor-parallel
  size 1 requires);
- at least one layer per pipeline stage (layers divisible by pp when planner.uneven_pp=false); encoders take
  pp = cp = 1;
- global batch: each DP rank's share is whole (planner.batch_divisible) and at least one sample;
- token budget >= the longest sample (a packed microbatch must hold any sample).
Memory and the device budget are checked by the caller (they are what the solver trades off).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from mindspeed_flow.planner.cost import LAYOUT_FIELDS, CostContext, Layouts
from mindspeed_flow.planner.jobs import job_rules
from mindspeed_flow.planner.parts import PartSpec


class PlanError(ValueError):
    """A plan cannot be made; the message names the binding constraint (and the smallest fitting size)."""


AUTO_BUDGET_FACTORS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)


def auto_token_budgets(part: PartSpec, alignment: int = 256) -> list[int]:
    """Budgets from the longest sample up, each rounded up to `alignment`: bigger budgets, fewer microbatches."""
    a = max(int(alignment), 1)
    base = max(int(part.max_item_tokens), 1)
    return sorted({int(np.ceil(base * f / a)) * a for f in AUTO_BUDGET_FACTORS})


def _dp_values(ctx: CostContext, max_devices: int) -> list[int]:
    g = ctx.global_batch
    upto = min(g, max_devices)
    if ctx.cfg.batch_divisible:
        return [d for d in range(1, upto + 1) if g % d == 0]
    return list(range(1, upto + 1))


def candidate_values(part: PartSpec, ctx: CostContext, max_devices: int,
                     fixed: Mapping[str, int] | None = None) -> dict[str, list[int]]:
    """Allowed values per layout field; a pinned value that breaks a rule raises PlanError naming the rule."""
    fixed = dict(fixed or {})
    c = ctx.cluster
    dpn = c.devices_per_node
    rules = job_rules(ctx.cfg.job)
    tp = [t for t in part.tp_sizes if t in set(int(x) for x in c.config.tp_sizes) and t <= dpn and dpn % t == 0
          and (rules.replicated_kv or part.role != "backbone" or part.kv_heads % t == 0)]
    cp = [x for x in part.cp_sizes if x in set(int(y) for y in c.config.cp_sizes) and (x == 1 or rules.cp)]
    budgets = [0] if part.role == "encoder" else sorted(int(b) for b in (ctx.cfg.token_budgets
                                                                          or auto_token_budgets(part, ctx.cfg.token_alignment)))
    values = {
        "dp": _dp_values(ctx, max_devices),
        "tp": tp,
        "pp": [p for p in part.pp_sizes if p <= max_devices
               and p <= part.layers and (ctx.cfg.uneven_pp or part.layers % p == 0)],
        "cp": cp,
        "ep": [e for e in part.ep_sizes if e <= max_devices and (e == 1 or rules.expert_parallel)],
        "b": [b for b in budgets if part.role == "encoder" or b >= part.max_item_tokens],
        "rc": rc_values(part, ctx),
    }
    for key, val in fixed.items():
        if key not in LAYOUT_FIELDS:
            raise PlanError(f"{part.name}.{key}: unknown layout field; pin one of {list(LAYOUT_FIELDS)}")
        if int(val) not in values[key]:
            raise PlanError(f"{part.name}.{key}={val} is not allowed: {_why_not(part, ctx, key, int(val))}")
        values[key] = [int(val)]
    if not values["b"]:
        raise PlanError(f"{part.name}: every token budget {budgets} is shorter than the longest sample "
                        f"({part.max_item_tokens} tokens); raise planner.token_budgets")
    return {k: sorted(set(v)) for k, v in values.items()}


def rc_values(part: PartSpec, ctx: CostContext) -> list[int]:
    """Recompute levels: 0 keep, 1 full; a trainable encoder also 2 (from the pixels and per layer); only those
    the planned job runs (planner.job)."""
    if not part.trainable:
        return [0]
    levels = {int(bool(r)) for r in ctx.cfg.recompute}
    if part.role == "encoder" and 1 in levels:
        levels.add(2)
    rules = job_rules(ctx.cfg.job)
    runs = rules.encoder_rc if part.role == "encoder" else rules.backbone_rc
    return sorted(levels & set(runs)) or [0]


def _why_not(part: PartSpec, ctx: CostContext, key: str, val: int) -> str:
    c = ctx.cluster
    dpn = c.devices_per_node
    if key == "tp":
        if val > dpn or dpn % val:
            return f"TP over node size: tp must divide devices_per_node={dpn} (TP stays inside a node)"
        if val not in [int(x) for x in c.config.tp_sizes]:
            return f"cluster {c.name!r} supports tp in {list(c.config.tp_sizes)} (cluster.tp_sizes)"
        return f"heads ({part.heads}, kv {part.kv_heads}) must be divisible by tp; valid: {list(part.tp_sizes)}"
    if key == "pp":
        if part.role == "encoder":
            return "encoders are planned with pp=1"
        valid = [p for p in part.pp_sizes if ctx.cfg.uneven_pp or part.layers % p == 0]
        rule = "at least 1 layer per stage" if ctx.cfg.uneven_pp else "layers divisible by pp (planner.uneven_pp=false)"
        return f"{part.layers} layers: {rule}; valid: {valid}"
    if key == "cp" and not job_rules(ctx.cfg.job).cp:
        return f"{job_rules(ctx.cfg.job).label} runs without context parallelism (cp must be 1)"
    if key == "cp":
        return f"cp must be in {sorted(set(part.cp_sizes) & set(int(x) for x in c.config.cp_sizes))}"
    if key == "dp":
        return (f"global batch {ctx.global_batch} must split evenly over dp (planner.batch_divisible) and "
                f"dp <= devices")
    if key == "ep":
        return (f"ep must divide the {part.experts} routed experts (and dp x tp: checked per layout); valid: "
                f"{list(part.ep_sizes)}" if part.experts else f"the {part.name} has no experts (ep must be 1)")
    if key == "b":
        return f"token budget must be >= the longest sample ({part.max_item_tokens} tokens)"
    return (f"recompute must be one of {rc_values(part, ctx)} for the {part.name} on "
            f"{job_rules(ctx.cfg.job).label} (0 keep, 1 full / encoder from the pixels, 2 encoder per layer; "
            "frozen encoders: 0)")


def enumerate_layouts(part: PartSpec, ctx: CostContext, max_devices: int,
                      fixed: Mapping[str, int] | None = None) -> Layouts:
    """Every structurally valid layout using at most `max_devices` devices (memory not checked)."""
    vals = candidate_values(part, ctx, max_devices, fixed)
    grids = np.meshgrid(*[np.asarray(vals[k], dtype=np.int64) for k in LAYOUT_FIELDS], indexing="ij")
    L = Layouts(**{k: g.ravel() for k, g in zip(LAYOUT_FIELDS, grids)})
    keep = (L.devices <= max_devices) & ((L.dp * L.tp) % L.ep == 0)
    if fixed and "ep" in fixed and not keep.any() and (L.devices <= max_devices).any():
        raise PlanError(f"{part.name}.ep={fixed['ep']}: ep must divide dp x tp (the experts are not tensor-split, "
                        "so the expert-parallel ranks come out of a stage's dp x tp ranks)")
    return L.take(np.nonzero(keep)[0])
