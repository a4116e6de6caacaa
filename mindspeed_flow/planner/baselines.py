"""The layouts mindspeed-flow is compared with, priced by the same cost model, each at its best layout.

- `megatron_coupled`: the classic coupled layout: one DP for the whole model, the ViT on pipeline stage 0
  beside the first LLM layers (uniform layer split), both halves on the same TP group and the same
  microbatches. Stage 0 is slower than the others by the ViT's work, and the 1F1B pipeline runs at the pace
  of its slowest stage: T = (m - 1) max_s t_s + sum_s t_s.
- `mindspeed_dist_train`: MindSpeed's `--dist-train`: the ViT on its own devices, but with the same DP as the
  LLM, run as an extra pipeline stage in front of the LLM stages with blocking send/recv (no overlap of the
  embedding traffic): T = (m - 1) max(t_vit, t_llm) + t_vit + pp t_llm.
Each baseline searches its own layout space (dp, tp, pp, token budget, recompute) within the same device
budget and memory limit, so the reported gain is over the best that layout family can do.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from mindspeed_flow.planner.cost import (
    CostContext, Layouts, backbone_costs, backbone_stage_mb_time, backbone_stage_params, dp_sync_time,
    encoder_activation_memory, encoder_samples_time, encoder_static_params, model_flops_per_step, optimizer_time,
    static_memory,
)
from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.planner.space import PlanError, enumerate_layouts


@dataclass
class BaselineResult:
    name: str
    layout: dict  # part name -> {dp, tp, pp, cp, b, rc}
    step_seconds: float
    samples_per_s: float
    mfu: float
    devices: int
    memory_gb: float


def _finish(name: str, layout: dict, t: float, devices: int, mem: float, parts: list[PartSpec],
            ctx: CostContext) -> BaselineResult:
    flops = model_flops_per_step(parts, ctx.global_batch)
    return BaselineResult(name=name, layout=layout, step_seconds=float(t),
                          samples_per_s=ctx.global_batch / float(t),
                          mfu=flops / (float(t) * devices * ctx.peak), devices=int(devices), memory_gb=mem / 1e9)


def _limit(ctx: CostContext) -> float:
    return ctx.cluster.hbm_bytes * ctx.cfg.memory_headroom


def _backbone_grid(bb: PartSpec, ctx: CostContext, budget: int, cp_one: bool) -> Layouts:
    fixed = {"cp": 1} if cp_one else None
    return enumerate_layouts(bb, ctx, budget, fixed)


def megatron_coupled(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int) -> BaselineResult | None:
    """Best coupled (ViT on stage 0) layout within `budget` devices, or None if none fits in memory."""
    try:
        L = _backbone_grid(bb, ctx, budget, cp_one=True)
    except PlanError:
        return None
    L = L.take(np.nonzero(np.isin(L.tp, enc.tp_sizes))[0])  # the ViT shares the TP group
    if len(L) == 0:
        return None
    c = backbone_costs(bb, ctx, L)
    m = c.microbatches
    mb = backbone_stage_mb_time(bb, ctx, L, m)
    t_llm = sum(mb.values())
    samples_mb = ctx.global_batch / L.dp / m
    vit = encoder_samples_time(enc, ctx, samples_mb, L.tp, L.rc)
    t_vit = vit["compute"] + vit["tp"] + vit["overhead"]  # colocated: no embedding traffic
    t0 = t_llm + t_vit
    pipeline = (m - 1) * np.maximum(t0, t_llm) + t0 + (L.pp - 1) * t_llm
    p_vit = encoder_static_params(enc, L.tp)
    p_first, p_last = backbone_stage_params(bb, L)
    p_stage0 = p_first + p_vit
    sync = dp_sync_time(ctx, np.maximum(p_stage0, p_last), L.dp, L.tp * L.dp)
    opt = optimizer_time(ctx, np.maximum(p_stage0, p_last), L.dp)
    t = pipeline + sync + opt + ctx.cfg.step_overhead_s
    inflight = np.where(L.pp > 1, np.minimum(m, L.pp), 1)
    vit_static = sum(static_memory(ctx, p_vit, L.dp, enc.trainable).values())
    vit_act = encoder_activation_memory(enc, ctx, inflight * samples_mb, L.tp, L.rc)
    mem = np.maximum(c.stage_memory["first"] + vit_static + vit_act, c.stage_memory["last"])
    ok = mem <= _limit(ctx)
    if not ok.any():
        return None
    i = int(np.nonzero(ok)[0][np.argmin(t[ok])])
    row = L.row(i)
    return _finish("megatron_coupled", {"coupled": row}, t[i], int(L.devices[i]), float(mem[i]), [enc, bb], ctx)


def mindspeed_dist_train(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int) -> BaselineResult | None:
    """Best dist-train layout (separate ViT devices, equal DP, ViT as a blocking pipeline stage), or None."""
    try:
        Lb = _backbone_grid(bb, ctx, budget, cp_one=False)
        Le = enumerate_layouts(enc, ctx, budget)
    except PlanError:
        return None
    no_overlap = dataclasses.replace(ctx.cfg, overlap={**dict(ctx.cfg.overlap), "embed": 0.0})
    ctx_block = dataclasses.replace(ctx, cfg=no_overlap)
    cb = backbone_costs(bb, ctx, Lb)
    m = cb.microbatches
    t_llm = sum(backbone_stage_mb_time(bb, ctx, Lb, m).values())
    best: tuple[float, int, int, float] | None = None
    for dp in np.unique(Lb.dp):
        jb = np.nonzero(Lb.dp == dp)[0]
        je = np.nonzero(Le.dp == dp)[0]
        if len(je) == 0:
            continue
        tp_e, rc_e = Le.tp[je][:, None], Le.rc[je][:, None]
        m_b, pp_b = m[jb][None, :], Lb.pp[jb][None, :]
        samples_mb = ctx.global_batch / dp / m_b
        vit = encoder_samples_time(enc, ctx_block, samples_mb, tp_e, rc_e)
        t_vit = sum(vit.values())
        tl = t_llm[jb][None, :]
        pipeline = (m_b - 1) * np.maximum(t_vit, tl) + t_vit + pp_b * tl
        p_e = encoder_static_params(enc, tp_e)
        t_enc_tail = (dp_sync_time(ctx, p_e, dp, tp_e * dp) + optimizer_time(ctx, p_e, dp)) if enc.trainable else 0.0
        t_bb_tail = (cb.time_parts["dp"] + cb.time_parts["optimizer"])[jb][None, :]
        t = pipeline + np.maximum(t_enc_tail, t_bb_tail) + ctx.cfg.step_overhead_s
        inflight = np.minimum(m_b, pp_b + 1)
        enc_mem = (sum(static_memory(ctx, p_e, np.full_like(p_e, dp), enc.trainable).values())
                   + encoder_activation_memory(enc, ctx, inflight * samples_mb, tp_e, rc_e))
        devices = Le.devices[je][:, None] + Lb.devices[jb][None, :]
        ok = (enc_mem <= _limit(ctx)) & (cb.memory[jb][None, :] <= _limit(ctx)) & (devices <= budget)
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
    layout = {enc.name: Le.row(ie), bb.name: Lb.row(ib)}
    return _finish("mindspeed_dist_train", layout, t, int(Le.devices[ie] + Lb.devices[ib]), mem, [enc, bb], ctx)
