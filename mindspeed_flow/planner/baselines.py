"""The layouts mindspeed-flow is compared with, priced by the same cost model, each at its best layout.

Every baseline searches its own layout space within the same device budget and memory limit, so the reported
gain is over the best that family can do, and the report names the strongest one.

- `coupled_uniform`: the untuned coupled Megatron layout: the ViT on pipeline stage 0 beside an even share of
  the LLM layers, ViT TP = LLM TP, one recompute flag for both, no CP.
- `megatron_coupled`: the coupled layout as a tuned MindSpeed-MM user runs it (its 72B config): uneven
  `pipeline_num_layers` that move LLM layers off stage 0 to balance the ViT, separate recompute for ViT and
  LLM (per module in model.json), CP allowed (Ulysses), and the ViT on the job's TP with the microbatch's images
  split over the CP ranks (model.json `use_vit_dp`: MindSpeed-MM builds every module with the job's TP, so the
  ViT cannot take another). The 1F1B pipeline runs at the pace of its slowest stage:
  T = (m - 1) max_s t_s + sum_s t_s.
- `mindspeed_mm_hetero`: MindSpeed-MM `--hetero-parallel`: ViT and LLM co-located on the same devices, each
  with its own DP/TP layout; the ViT's schedule runs first for the whole step, then the LLM's (no overlap):
  T = T_vit + T_llm, and one device holds both modules' states.
- `mindspeed_dist_train`: MindSpeed `--dist-train`: the ViT on its own devices as an extra, blocking pipeline
  stage in front of the LLM stages (embedding traffic not overlapped), with equal DP, or with `main_dp` on the
  LLM: the ViT's DP is k x the LLM's and each inner-DP group of k ViT replicas encodes one LLM microbatch's
  images together: T = (m - 1) max(t_vit, t_llm) + t_vit + sum of LLM stages. MindSpeed's dist-train runs only
  the model pairs it lists (`_SUPPORT_MODEL_NAME` in mindspeed/core/multi_modal/dist_train/dist_train_config.py:
  InternVL2's ViT + GPT, OpenSoraPlan 1.3's VAE + DiT); for other models it is priced but marked as not
  applying, and the plan's gain is reported over the strongest baseline that applies.

With `node` > 1 every baseline uses at most one node or whole nodes of that size (what a launch starts).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from mindspeed_flow.planner.cost import (
    CostContext, Layouts, backbone_costs, backbone_memory, backbone_stage_mb_time, backbone_stage_params,
    dp_sync_time, encoder_activation_memory, encoder_costs, encoder_samples_time, encoder_static_params,
    model_flops_per_step, optimizer_time, pipeline_time, stage_layer_list, stage_time, static_memory,
)
from mindspeed_flow.planner.jobs import allowed_total
from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.planner.space import PlanError, enumerate_layouts, rc_values

# model families (HF model_type) whose encoder + LLM pair MindSpeed's dist-train runs (InternVL2: a LLaVA-style
# InternViT + LLM); see the module docstring
DIST_TRAIN_FAMILIES = ("llava", "internvl", "internvl_chat")

BASELINES = ("coupled_uniform", "megatron_coupled", "mindspeed_mm_hetero", "mindspeed_dist_train")


@dataclass
class BaselineResult:
    name: str
    layout: dict  # part name -> {dp, tp, pp, cp, b, rc} (+ the ViT's own tp / rc and the stage split)
    step_seconds: float
    samples_per_s: float
    mfu: float
    devices: int
    memory_gb: float
    applies: bool = True  # the system this baseline stands for runs this model
    why_not: str = ""


def _whole(devices: np.ndarray, budget: int, node: int) -> np.ndarray:
    """Which device counts a launch in whole nodes of `node` can use (all when node <= 1)."""
    if node <= 1:
        return np.ones(np.shape(devices), dtype=bool)
    # device counts repeat across the millions of (encoder, backbone) pairs: test each distinct count once
    values, inverse = np.unique(np.asarray(devices), return_inverse=True)
    ok = np.array([allowed_total(int(n), budget, node) for n in values], dtype=bool)
    return ok[inverse].reshape(np.shape(devices))


def _finish(name: str, layout: dict, t: float, devices: int, mem: float, parts: list[PartSpec],
            ctx: CostContext) -> BaselineResult:
    flops = model_flops_per_step(parts, ctx.global_batch)
    return BaselineResult(name=name, layout=layout, step_seconds=float(t),
                          samples_per_s=ctx.global_batch / float(t),
                          mfu=flops / (float(t) * devices * ctx.peak), devices=int(devices), memory_gb=mem / 1e9)


def _limit(ctx: CostContext) -> float:
    return ctx.cluster.hbm_bytes * ctx.cfg.memory_headroom


def _split_row(L: Layouts, mb: dict, i: int) -> dict:
    row = L.row(i)
    if row["pp"] > 1:
        split = {k: mb[f"layers_{k}"] for k in ("first", "mid", "last")}
        row["layers"] = stage_layer_list({**split, "mid_short": mb["mid_short"]}, row["pp"], i)
    return row


def megatron_coupled(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int,
                     tuned: bool = True, fixed: Mapping[str, int] | None = None, node: int = 0,
                     vit_rc: tuple[int, ...] | None = None) -> BaselineResult | None:
    """Best coupled (ViT on stage 0) layout within `budget` devices, or None if none fits in memory.

    tuned=False is `coupled_uniform` (even split, shared TP and recompute, no CP). `fixed` pins layout fields of
    the coupled model (dp, pp, tp, cp, b, rc), e.g. to price the exact layout a run uses; `vit_rc` limits the
    ViT's recompute levels (e.g. a host without ViT recompute); `node`: whole nodes."""
    name = "megatron_coupled" if tuned else "coupled_uniform"
    cctx = ctx if tuned else dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, uneven_pp=False))
    pins = {**({} if tuned else {"cp": 1}), **dict(fixed or {})}
    try:
        L = enumerate_layouts(bb, cctx, budget, pins or None)
    except PlanError:
        return None
    # the ViT shares the job's TP group
    L = L.take(np.nonzero(np.isin(L.tp, enc.tp_sizes) & _whole(L.devices, budget, node))[0])
    if len(L) == 0:
        return None
    m = backbone_costs(bb, cctx, L).microbatches
    samples_mb = ctx.global_batch / L.dp / m
    group = L.tp * L.cp  # stage 0's devices per replica: the ViT runs on them
    best: tuple[float, int, int, int, float, dict] | None = None
    for tv in (0,):
        for rcv in (vit_rc if vit_rc is not None else rc_values(enc, ctx)) if tuned else (None,):
            t_v = L.tp if tv == 0 else np.full_like(L.tp, tv)
            rc_v = L.rc if rcv is None else np.full_like(L.rc, rcv)
            ok_shape = (group % t_v == 0)
            if not ok_shape.any():
                continue
            split = group / t_v  # ViT replicas inside the group share the microbatch's images, whole images
            per_replica = np.ceil(samples_mb * enc.items_per_sample / split - 1e-9) / max(enc.items_per_sample, 1e-9)
            vit = encoder_samples_time(enc, ctx, per_replica, t_v, rc_v)
            t_vit = vit["compute"] + vit["tp"] + vit["overhead"]  # co-located: no embedding traffic
            mb = backbone_stage_mb_time(bb, cctx, L, m, first_extra=t_vit)
            pipeline = pipeline_time(mb, m)
            p_vit = encoder_static_params(enc, t_v)
            p_first, p_last = backbone_stage_params(bb, L, mb)
            p_mid = mb["layers_mid"] * bb.layer_params / L.tp
            p_dev = np.maximum(np.maximum(p_first + p_vit, p_last), p_mid)
            sync = dp_sync_time(ctx, p_dev, L.dp, L.devices)
            opt = optimizer_time(ctx, p_dev, L.dp)
            t = pipeline + sync + opt + ctx.cfg.step_overhead_s * ctx.contention
            inflight = np.where(L.pp > 1, np.minimum(m, L.pp), 1)
            stages = backbone_memory(bb, cctx, L, m, mb)["stages"]
            vit_static = sum(static_memory(ctx, p_vit, L.dp * split, enc.trainable).values())
            vit_act = encoder_activation_memory(enc, ctx, inflight * per_replica, t_v, rc_v)
            mem = np.maximum(np.maximum(stages["first"] + vit_static + vit_act, stages["mid"]), stages["last"])
            ok = ok_shape & (mem <= _limit(ctx))
            if not ok.any():
                continue
            i = int(np.nonzero(ok)[0][np.argmin(t[ok])])
            if best is None or t[i] < best[0]:
                row = _split_row(L, mb, i)
                row.update({"vit_tp": int(t_v[i]), "vit_rc": int(rc_v[i])})
                best = (float(t[i]), i, int(t_v[i]), int(rc_v[i]), float(mem[i]), row)
    if best is None:
        return None
    t, i, _, _, mem, row = best
    return _finish(name, {"coupled": row}, t, int(L.devices[i]), mem, [enc, bb], ctx)


def _grids(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int) -> tuple[Layouts, Layouts] | None:
    """Every structurally valid layout of the encoder and of the backbone (None if a part has none)."""
    try:
        return enumerate_layouts(enc, ctx, budget), enumerate_layouts(bb, ctx, budget)
    except PlanError:
        return None


def mindspeed_mm_hetero(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int,
                        node: int = 0) -> BaselineResult | None:
    """Best `--hetero-parallel` layout: ViT then LLM on the same devices, each with its own layout, or None."""
    grids = _grids(enc, bb, ctx, budget)
    if grids is None:
        return None
    Le, Lb = grids
    cb = backbone_costs(bb, ctx, Lb)
    ce = encoder_costs(enc, ctx, Le)
    # sequential: no fill wait and no embedding overlap (the ViT finishes before the LLM starts)
    t_e = ce.time - ce.time_parts["fill"] - ce.time_parts["embed"] + ce.time_parts["embed"] / max(
        1e-9, 1.0 - ctx.overlap("embed")) - ctx.cfg.step_overhead_s * ctx.contention
    # the ViT's activations wait for the LLM's backward unless it recomputes: both sets of states are resident
    e_mem = ce.memory - ce.memory_parts["buffers"]
    best: tuple[float, int, int, float] | None = None
    for d in np.unique(Lb.devices[_whole(Lb.devices, budget, node)]):
        jb, je = np.nonzero(Lb.devices == d)[0], np.nonzero(Le.devices == d)[0]
        if len(je) == 0:
            continue
        mem = e_mem[je][:, None] + cb.memory[jb][None, :]
        t = t_e[je][:, None] + cb.time[jb][None, :]
        flat = np.where(mem <= _limit(ctx), t, np.inf)
        k = int(np.argmin(flat))
        ie, ib = np.unravel_index(k, flat.shape)
        if np.isfinite(flat[ie, ib]) and (best is None or flat[ie, ib] < best[0]):
            best = (float(flat[ie, ib]), int(je[ie]), int(jb[ib]), float(mem[ie, ib]))
    if best is None:
        return None
    t, ie, ib, mem = best
    layout = {enc.name: Le.row(ie), bb.name: Lb.row(ib)}
    return _finish("mindspeed_mm_hetero", layout, t, int(Lb.devices[ib]), mem, [enc, bb], ctx)


def mindspeed_dist_train(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int,
                         node: int = 0) -> BaselineResult | None:
    """Best dist-train layout (separate ViT devices, ViT DP = k x LLM DP with inner DP, blocking stage)."""
    grids = _grids(enc, bb, ctx, budget)
    if grids is None:
        return None
    Le, Lb = grids
    no_overlap = dataclasses.replace(ctx.cfg, overlap={**dict(ctx.cfg.overlap), "embed": 0.0})
    ctx_block = dataclasses.replace(ctx, cfg=no_overlap)
    cb = backbone_costs(bb, ctx, Lb)
    m = cb.microbatches
    mb = backbone_stage_mb_time(bb, ctx, Lb, m)
    t_llm = stage_time(mb)
    best: tuple[float, int, int, float] | None = None
    for dp in np.unique(Lb.dp):
        jb = np.nonzero(Lb.dp == dp)[0]
        je = np.nonzero(Le.dp % dp == 0)[0]  # k = dp_vit / dp_llm ViT replicas per LLM replica (main_dp)
        if len(je) == 0:
            continue
        inner = (Le.dp[je] // dp)[:, None]
        tp_e, rc_e = Le.tp[je][:, None], Le.rc[je][:, None]
        m_b = m[jb][None, :]
        samples_mb = ctx.global_batch / dp / m_b / inner
        vit = encoder_samples_time(enc, ctx_block, samples_mb, tp_e, rc_e)
        t_vit = sum(vit.values())
        pipeline = (m_b - 1) * np.maximum(t_vit, t_llm[jb][None, :]) + t_vit + mb["sum_stages"][jb][None, :]
        p_e = encoder_static_params(enc, tp_e)
        dp_e = Le.dp[je][:, None]
        t_enc_tail = (dp_sync_time(ctx, p_e, dp_e, tp_e * dp_e) + optimizer_time(ctx, p_e, dp_e)
                      if enc.trainable else 0.0)
        t_bb_tail = (cb.time_parts["dp"] + cb.time_parts["optimizer"])[jb][None, :]
        t = pipeline + np.maximum(t_enc_tail, t_bb_tail) + ctx.cfg.step_overhead_s * ctx.contention
        inflight = np.minimum(m_b, Lb.pp[jb][None, :] + 1)
        enc_mem = (sum(static_memory(ctx, p_e, dp_e, enc.trainable).values())
                   + encoder_activation_memory(enc, ctx, inflight * samples_mb, tp_e, rc_e))
        devices = Le.devices[je][:, None] + Lb.devices[jb][None, :]
        ok = ((enc_mem <= _limit(ctx)) & (cb.memory[jb][None, :] <= _limit(ctx)) & (devices <= budget)
              & _whole(devices, budget, node))
        if not ok.any():
            continue
        flat = np.where(ok, t, np.inf)
        k = int(np.argmin(flat))
        ie, ib = np.unravel_index(k, flat.shape)
        if best is None or flat[ie, ib] < best[0]:
            mem = max(float(np.broadcast_to(enc_mem, flat.shape)[ie, ib]), float(cb.memory[jb][ib]))
            best = (float(flat[ie, ib]), int(je[ie]), int(jb[ib]), mem)
    if best is None:
        return None
    t, ie, ib, mem = best
    layout = {enc.name: Le.row(ie), bb.name: _split_row(Lb, mb, ib)}
    return _finish("mindspeed_dist_train", layout, t, int(Le.devices[ie] + Lb.devices[ib]), mem, [enc, bb], ctx)


def all_baselines(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int, node: int = 0,
                  family: str = "") -> dict[str, BaselineResult | None]:
    """Every baseline at its best layout (None: that family has no layout that fits); `family` (HF model_type,
    empty: unknown) marks the baselines whose system does not run that model."""
    out = {
        "coupled_uniform": megatron_coupled(enc, bb, ctx, budget, tuned=False, node=node),
        "megatron_coupled": megatron_coupled(enc, bb, ctx, budget, tuned=True, node=node),
        "mindspeed_mm_hetero": mindspeed_mm_hetero(enc, bb, ctx, budget, node=node),
        "mindspeed_dist_train": mindspeed_dist_train(enc, bb, ctx, budget, node=node),
    }
    dist = out["mindspeed_dist_train"]
    if dist is not None and family and family not in DIST_TRAIN_FAMILIES:
        dist.applies = False
        dist.why_not = (f"MindSpeed's dist-train does not run {family} (it runs InternVL2 and OpenSoraPlan 1.3 "
                        "only)")
    return out


def strongest(baselines: dict[str, BaselineResult | None]) -> BaselineResult | None:
    """The applicable baseline with the most samples/s (what the plan's gain is reported against)."""
    found = [b for b in baselines.values() if b is not None and b.applies]
    return max(found, key=lambda b: b.samples_per_s) if found else None
