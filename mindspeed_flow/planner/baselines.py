"""The layouts mindspeed-flow is compared with, priced by the same cost model, each at its best layout.

Every baseline searches its own layout space within the same device budget and memory limit, so the reported
gain is over the best that family can do, and the report names the strongest one. Each runs its own system's data
loader (`LOADERS`, priced by `cost.Loader`): the tokens it computes per step and how unevenly its DP replicas are
loaded follow from the workload's sample lengths, not from the decoupled plan's packing.

Loaders, as the systems' own examples run them:
- MindSpeed-MM (`megatron_coupled`, `mindspeed_mm_hetero`, `mindspeed_dist_train`, which runs MindSpeed-MM's
  InternVL2 examples): examples/qwen2.5vl/finetune_qwen2_5_vl_{7b,72b}.sh set --micro-batch-size 1 and
  --variable-seq-lengths, and data_{7b,72b}.json turns no packing on (MindSpeed-MM's greedy-knapsack packing,
  data_utils/func_utils/convert.py, runs only for a dataset marked `packing`): one sample per microbatch at its
  own length, the G / dp samples of a DP rank in a contiguous slice of the global batch; the step waits for the
  replica whose samples cost the most.
- Megatron-LM (`coupled_uniform`): static shapes, every microbatch (one sample) padded to --seq-length, here the
  longest sample rounded up to planner.token_alignment; linear layers and the causal attention run on the padding.

- `coupled_uniform`: the untuned coupled Megatron layout: the ViT on pipeline stage 0 beside an even share of
  the LLM layers, ViT TP = LLM TP, one recompute flag for both, no CP.
- `megatron_coupled`: the coupled layout as a tuned MindSpeed-MM user runs it (its 72B config): uneven
  `pipeline_num_layers` that move LLM layers off stage 0 to balance the ViT, separate recompute for ViT and
  LLM (per module in model.json), CP allowed (Ulysses), and the ViT on the job's TP with the microbatch's images
  split over the CP ranks (model.json `use_vit_dp`: MindSpeed-MM builds every module with the job's TP, so the
  ViT cannot take another). The 1F1B pipeline runs at the pace of its slowest stage:
  T = (m - 1) max_s t_s + sum_s t_s.
- `mindspeed_mm_hetero`: MindSpeed-MM `--hetero-parallel` as its code runs it (mindspeed_mm/utils/hetero_parallel.py:
  the image encoder's forward pre-hook gathers the microbatch's pixels over the decoder's DP group and splits them
  over the encoder's own DP group, inside each microbatch's forward): the coupled pipeline, the ViT on the first
  stage's devices with a TP (and so a DP) of its own. Its limits: the ViT stays on the first stage's critical path,
  every microbatch, and no pinned example (examples/qwen2.5vl, internvl) turns it on.
- `mindspeed_dist_train`: MindSpeed `--dist-train`: the ViT on its own devices as an extra, blocking pipeline
  stage in front of the LLM stages (embedding traffic not overlapped), with equal DP, or with `main_dp` on the
  LLM: the ViT's DP is k x the LLM's and each inner-DP group of k ViT replicas encodes one LLM microbatch's
  images together: T = (m - 1) max(t_vit, t_llm) + t_vit + sum of LLM stages. MindSpeed's dist-train runs only
  the model pairs it lists (`_SUPPORT_MODEL_NAME` in mindspeed/core/multi_modal/dist_train/dist_train_config.py:
  InternVL2's ViT + GPT, OpenSoraPlan 1.3's VAE + DiT); for other models it is priced but marked as not
  applying, and the plan's gain is reported over the strongest baseline that applies.

With `node` > 1 every baseline uses at most one node or whole nodes of that size (what a launch starts).

An audio encoder (`audio`: the Qwen2.5-Omni thinker's, on a workload with clips) runs where MindSpeed-MM's coupled
job runs it: on the LLM's first pipeline stage (model.json's audio pipeline_num_layers [all, 0, ...]), on the job's
TP (its heads divisible by tp), its microbatch's clips encoded beside the ViT's images (`_audio_on_first_stage`):
its time, weights and activations are stage 0's. Dist-train's LLM stages carry it the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from mindspeed_flow.planner.cost import (
    CostContext, Layouts, Loader, backbone_costs, backbone_memory, backbone_stage_mb_time, backbone_stage_params,
    dp_sync_time, encoder_activation_memory, encoder_samples_time, encoder_static_params,
    expert_params_per_device, expert_tail_time, model_flops_per_step, most_layers, optimizer_time, pipeline_time,
    stage_layer_list, stage_params, stage_time, static_memory,
)
from mindspeed_flow.planner.jobs import allowed_total
from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.planner.space import PlanError, enumerate_layouts, rc_values

# model families (HF model_type) whose encoder + LLM pair MindSpeed's dist-train runs (InternVL2: a LLaVA-style
# InternViT + LLM); see the module docstring
DIST_TRAIN_FAMILIES = ("llava", "internvl", "internvl_chat")

# which loader each baseline's system runs (module docstring), and how the report names it
LOADERS = {"coupled_uniform": "pad", "megatron_coupled": "sample", "mindspeed_mm_hetero": "sample",
           "mindspeed_dist_train": "sample"}
LOADER_NAMES = {"pad": "Megatron-LM: micro-batch 1 padded to the sequence length",
                "sample": "MindSpeed-MM examples: micro-batch 1 at its own length, no packing",
                "flow": "flow packing to the token budget"}


def stream_costs(bb: PartSpec, lengths: np.ndarray) -> tuple[float, ...]:
    """Each sample's backbone FLOPs (linear on its tokens, causal attention on its length squared): what a DP
    replica of a per-sample loader sums."""
    lengths = np.asarray(lengths, dtype=np.float64)
    attn_per_sq = bb.attn_flops_per_sample / max(bb.sq_tokens_per_sample, 1.0)
    return tuple(float(x) for x in bb.linear_flops_per_token * lengths + attn_per_sq * lengths**2)


def with_loader(ctx: CostContext, kind: str, bb: PartSpec, lengths: np.ndarray | None) -> CostContext:
    """`ctx` running `kind`'s loader over the step's sample stream (`lengths`: LLM tokens per sample, in order)."""
    if kind == "flow":
        return dataclasses.replace(ctx, loader=Loader())
    align = max(int(ctx.cfg.token_alignment), 1)
    seq_len = int(np.ceil(bb.max_item_tokens / align)) * align
    costs = stream_costs(bb, lengths) if lengths is not None and len(lengths) else ()
    return dataclasses.replace(ctx, loader=Loader(kind, seq_len=seq_len, sample_costs=costs))


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
    loader: str = ""  # how its data loader forms microbatches (LOADERS)


def _one_budget(L: Layouts, ctx: CostContext) -> np.ndarray:
    """A per-sample loader has no token budget: keep one (the smallest, the padded sequence length) of the
    layouts that differ only in it."""
    if not ctx.loader.per_sample or len(L) == 0:
        return np.ones(len(L), dtype=bool)
    return L.b == L.b.min()


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


@dataclass
class StageWork:
    """Extra work on the LLM's first pipeline stage, per layout: seconds per microbatch, parameters per device
    (those that sync and update when trainable), static and activation bytes per device."""

    time: np.ndarray
    params: np.ndarray
    static: np.ndarray
    activations: np.ndarray


def _audio_on_first_stage(audio: PartSpec | None, ctx: CostContext, L: Layouts, samples_mb: np.ndarray,
                          inflight: np.ndarray, rc: np.ndarray) -> StageWork:
    """The audio encoder on the first stage of coupled layouts `L` (module docstring): each tp group encodes its
    share of a microbatch's samples' clips (the CP ranks split them, as they split the ViT's images: assumed, the
    generous reading for the baseline); zero without an audio encoder."""
    zero = np.zeros(len(L))
    if audio is None:
        return StageWork(zero, zero, zero, zero)
    per_replica = samples_mb / L.cp
    rc_a = np.minimum(rc, max(rc_values(audio, ctx)))  # a frozen audio encoder does not recompute
    t = encoder_samples_time(audio, ctx, per_replica, L.tp, rc_a)
    p = encoder_static_params(audio, L.tp)
    static = sum(static_memory(ctx, p, L.dp * L.cp, audio.trainable).values())
    act = encoder_activation_memory(audio, ctx, inflight * per_replica, L.tp, rc_a)
    return StageWork(t["compute"] + t["tp"] + t["overhead"], p if audio.trainable else zero, static, act)


def _audio_tp(audio: PartSpec | None, L: Layouts) -> np.ndarray:
    """Which layouts' TP the audio encoder takes (its heads divisible by tp); all without one."""
    return np.ones(len(L), dtype=bool) if audio is None else np.isin(L.tp, audio.tp_sizes)


def megatron_coupled(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int,
                     tuned: bool = True, fixed: Mapping[str, int] | None = None, node: int = 0,
                     vit_rc: tuple[int, ...] | None = None, vit_tps: tuple[int, ...] = (0,),
                     audio: PartSpec | None = None) -> BaselineResult | None:
    """Best coupled (ViT on stage 0) layout within `budget` devices, or None if none fits in memory.

    tuned=False is `coupled_uniform` (even split, shared TP and recompute, no CP). `fixed` pins layout fields of
    the coupled model (dp, pp, tp, cp, b, rc), e.g. to price the exact layout a run uses; `vit_rc` limits the
    ViT's recompute levels (e.g. a host without ViT recompute); `node`: whole nodes; `vit_tps`: the ViT's TP sizes
    (0: the job's TP; others: `--hetero-parallel`, the ViT on its own TP over the first stage's devices); `audio`:
    an audio encoder on the first stage too (module docstring)."""
    name = "megatron_coupled" if tuned else "coupled_uniform"
    cctx = ctx if tuned else dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, uneven_pp=False))
    pins = {**({} if tuned else {"cp": 1}), **dict(fixed or {})}
    try:
        L = enumerate_layouts(bb, cctx, budget, pins or None)
    except PlanError:
        return None
    # the ViT shares the job's TP group
    L = L.take(np.nonzero(np.isin(L.tp, enc.tp_sizes) & _audio_tp(audio, L) & _whole(L.devices, budget, node)
                          & _one_budget(L, ctx))[0])
    if len(L) == 0:
        return None
    m = backbone_costs(bb, cctx, L).microbatches
    samples_mb = ctx.global_batch / L.dp / m
    group = L.tp * L.cp  # stage 0's devices per replica: the ViT runs on them
    best: tuple[float, int, int, int, float, dict] | None = None
    for tv in vit_tps:
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
            inflight = np.where(L.pp > 1, np.minimum(m, L.pp), 1)
            aud = _audio_on_first_stage(audio, ctx, L, samples_mb, inflight, rc_v)
            mb = backbone_stage_mb_time(bb, cctx, L, m, first_extra=t_vit + aud.time)
            pipeline = pipeline_time(mb, m) * cctx.loader.imbalance(L.dp, L.pp)
            p_vit = encoder_static_params(enc, t_v)
            p_first, p_last = backbone_stage_params(bb, L, mb)
            p_mid = stage_params(bb, L, mb["layers_mid"])
            p_dev = np.maximum(np.maximum(p_first + p_vit + aud.params, p_last), p_mid)
            # MoE: the routed experts sync and update over their expert-data-parallel group
            layers = most_layers(mb)
            p_dense = p_dev - expert_params_per_device(bb, L, layers)
            e_sync, e_opt = expert_tail_time(bb, ctx, L, layers)
            sync = dp_sync_time(ctx, p_dense, L.dp, L.devices) + e_sync
            opt = optimizer_time(ctx, p_dense, L.dp) + e_opt
            t = pipeline + sync + opt + ctx.cfg.step_overhead_s * ctx.contention
            stages = backbone_memory(bb, cctx, L, m, mb)["stages"]
            vit_static = sum(static_memory(ctx, p_vit, L.dp * split, enc.trainable).values())
            vit_act = encoder_activation_memory(enc, ctx, inflight * per_replica, t_v, rc_v)
            first = stages["first"] + vit_static + vit_act + aud.static + aud.activations
            mem = np.maximum(np.maximum(first, stages["mid"]), stages["last"])
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
    return _finish(name, {"coupled": row}, t, int(L.devices[i]), mem, _parts(enc, audio, bb), ctx)


def _parts(enc: PartSpec, audio: PartSpec | None, bb: PartSpec) -> list[PartSpec]:
    """The parts whose FLOPs a baseline's MFU counts."""
    return [enc, bb] if audio is None else [enc, audio, bb]


def _grids(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int) -> tuple[Layouts, Layouts] | None:
    """Every structurally valid layout of the encoder and of the backbone (None if a part has none)."""
    try:
        return enumerate_layouts(enc, ctx, budget), enumerate_layouts(bb, ctx, budget)
    except PlanError:
        return None


def mindspeed_mm_hetero(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int,
                        node: int = 0, audio: PartSpec | None = None) -> BaselineResult | None:
    """Best `--hetero-parallel` layout: the coupled pipeline with the ViT on its own TP (and so its own DP) over
    the first stage's devices, or None (module docstring)."""
    best = megatron_coupled(enc, bb, ctx, budget, tuned=True, node=node, vit_tps=(0, *enc.tp_sizes), audio=audio)
    if best is not None:
        best.name = "mindspeed_mm_hetero"
    return best


def mindspeed_dist_train(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int,
                         node: int = 0, audio: PartSpec | None = None) -> BaselineResult | None:
    """Best dist-train layout (separate ViT devices, ViT DP = k x LLM DP with inner DP, blocking stage); an audio
    encoder on the LLM's first stage (module docstring)."""
    grids = _grids(enc, bb, ctx, budget)
    if grids is None:
        return None
    Le, Lb = grids
    Lb = Lb.take(np.nonzero(_one_budget(Lb, ctx) & _audio_tp(audio, Lb))[0])
    no_overlap = dataclasses.replace(ctx.cfg, overlap={**dict(ctx.cfg.overlap), "embed": 0.0})
    ctx_block = dataclasses.replace(ctx, cfg=no_overlap)
    cb = backbone_costs(bb, ctx, Lb)
    m = cb.microbatches
    aud = _audio_on_first_stage(audio, ctx, Lb, ctx.global_batch / Lb.dp / m,
                                np.where(Lb.pp > 1, np.minimum(m, Lb.pp), 1), Lb.rc)
    mb = backbone_stage_mb_time(bb, ctx, Lb, m, first_extra=aud.time)
    # a trainable audio encoder's gradients sync and update with the first stage's
    aud_tail = (dp_sync_time(ctx, aud.params, Lb.dp, Lb.devices) + optimizer_time(ctx, aud.params, Lb.dp)
                if audio is not None and audio.trainable else 0.0)
    t_llm = stage_time(mb)
    imbalance = ctx.loader.imbalance(Lb.dp, Lb.pp + 1)  # the ViT stage in front of the LLM's
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
        pipeline = ((m_b - 1) * np.maximum(t_vit, t_llm[jb][None, :]) + t_vit + mb["sum_stages"][jb][None, :]) \
            * imbalance[jb][None, :]
        p_e = encoder_static_params(enc, tp_e)
        dp_e = Le.dp[je][:, None]
        t_enc_tail = (dp_sync_time(ctx, p_e, dp_e, tp_e * dp_e) + optimizer_time(ctx, p_e, dp_e)
                      if enc.trainable else 0.0)
        t_bb_tail = (cb.time_parts["dp"] + cb.time_parts["optimizer"] + aud_tail)[jb][None, :]
        t = pipeline + np.maximum(t_enc_tail, t_bb_tail) + ctx.cfg.step_overhead_s * ctx.contention
        inflight = np.minimum(m_b, Lb.pp[jb][None, :] + 1)
        enc_mem = (sum(static_memory(ctx, p_e, dp_e, enc.trainable).values())
                   + encoder_activation_memory(enc, ctx, inflight * samples_mb, tp_e, rc_e))
        devices = Le.devices[je][:, None] + Lb.devices[jb][None, :]
        bb_mem = cb.memory + aud.static + aud.activations  # the audio's bytes (stage 0's) on the peak stage
        ok = ((enc_mem <= _limit(ctx)) & (bb_mem[jb][None, :] <= _limit(ctx)) & (devices <= budget)
              & _whole(devices, budget, node))
        if not ok.any():
            continue
        flat = np.where(ok, t, np.inf)
        k = int(np.argmin(flat))
        ie, ib = np.unravel_index(k, flat.shape)
        if best is None or flat[ie, ib] < best[0]:
            mem = max(float(np.broadcast_to(enc_mem, flat.shape)[ie, ib]), float(bb_mem[jb][ib]))
            best = (float(flat[ie, ib]), int(je[ie]), int(jb[ib]), mem)
    if best is None:
        return None
    t, ie, ib, mem = best
    layout = {enc.name: Le.row(ie), bb.name: _split_row(Lb, mb, ib)}
    return _finish("mindspeed_dist_train", layout, t, int(Le.devices[ie] + Lb.devices[ib]), mem,
                   _parts(enc, audio, bb), ctx)


def all_baselines(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int, node: int = 0,
                  family: str = "", lengths: np.ndarray | None = None,
                  audio: PartSpec | None = None) -> dict[str, BaselineResult | None]:
    """Every baseline at its best layout (None: that family has no layout that fits), each with its own loader
    (`LOADERS`) over the step's sample stream (`lengths`: LLM tokens per sample; None: sample averages, no
    imbalance); `family` (HF model_type, empty: unknown) marks the baselines whose system does not run that
    model; `audio`: an audio encoder, on the LLM's first stage (module docstring)."""
    lctx = {name: with_loader(ctx, kind, bb, lengths) for name, kind in LOADERS.items()}
    out = {
        "coupled_uniform": megatron_coupled(enc, bb, lctx["coupled_uniform"], budget, tuned=False, node=node,
                                            audio=audio),
        "megatron_coupled": megatron_coupled(enc, bb, lctx["megatron_coupled"], budget, tuned=True, node=node,
                                             audio=audio),
        "mindspeed_mm_hetero": mindspeed_mm_hetero(enc, bb, lctx["mindspeed_mm_hetero"], budget, node=node,
                                                   audio=audio),
        "mindspeed_dist_train": mindspeed_dist_train(enc, bb, lctx["mindspeed_dist_train"], budget, node=node,
                                                     audio=audio),
    }
    for name, b in out.items():
        if b is not None:
            b.loader = LOADERS[name]
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


# ----------------------------------------------------------------------------------------- gain by mechanism
@dataclass
class Counterfactual:
    """One step of the gain split: a layout family re-priced with the same cost model."""

    step: str  # "baseline", "packing", "layouts", "streaming"
    what: str
    samples_per_s: float | None
    mfu: float | None
    devices: int | None


def gain_split(enc: PartSpec, bb: PartSpec, ctx: CostContext, budget: int, base: BaselineResult,
               decoupled: tuple[float, float, int], node: int = 0,
               lengths: np.ndarray | None = None, audio: PartSpec | None = None) -> list[Counterfactual]:
    """The decoupled plan's gain over `base` split by mechanism, by counterfactual re-pricing:

    baseline (its own loader) -> packing: the same coupled layout with the flow packing scheduler instead of its
    loader (best token budget) -> layouts: each part on its own TP over the coupled pipeline (hetero-parallel's
    per-part layouts) with the flow packing, best such layout -> streaming: the decoupled plan (its own devices per
    part, embeddings streamed through the pool, `decoupled` = samples/s, MFU, devices). Each step's gain is the
    ratio to the step before; their product is the plan's gain over `base`. A step with no layout that fits is
    None and its gain folds into the next one. A non-coupled `base` (dist-train) is re-searched, not pinned."""
    flow = with_loader(ctx, "flow", bb, lengths)
    out = [Counterfactual("baseline", f"{base.name} as its system runs it ({LOADER_NAMES.get(base.loader, '')})",
                          base.samples_per_s, base.mfu, base.devices)]
    row = base.layout.get("coupled")
    if row is not None:
        fixed = {k: int(row[k]) for k in ("dp", "tp", "pp", "cp", "ep", "rc")}
        packed = megatron_coupled(enc, bb, flow, budget, tuned=base.name != "coupled_uniform", fixed=fixed,
                                  node=node, vit_rc=(int(row.get("vit_rc", 0)),),
                                  vit_tps=(int(row.get("vit_tp", 0)),), audio=audio)
    else:
        packed = mindspeed_dist_train(enc, bb, flow, budget, node=node, audio=audio)
    out.append(Counterfactual("packing", "the same layout, flow packing to a token budget",
                              *((packed.samples_per_s, packed.mfu, packed.devices) if packed else (None,) * 3)))
    layouts = mindspeed_mm_hetero(enc, bb, flow, budget, node=node, audio=audio)
    out.append(Counterfactual("layouts", "each part on its own TP in the coupled pipeline, flow packing",
                              *((layouts.samples_per_s, layouts.mfu, layouts.devices) if layouts else (None,) * 3)))
    out.append(Counterfactual("streaming", "the decoupled plan: its own devices per part, streamed embeddings",
                              *decoupled))
    return out


def split_factors(split: list[Counterfactual]) -> dict[str, dict[str, float | None]]:
    """Each step's throughput and MFU gain over the last step that priced (None where a step did not)."""
    out: dict[str, dict[str, float | None]] = {}
    prev = split[0]
    for c in split[1:]:
        if c.samples_per_s is None or prev.samples_per_s is None:
            out[c.step] = {"throughput": None, "mfu": None}
            continue
        out[c.step] = {"throughput": c.samples_per_s / prev.samples_per_s,
                       "mfu": (c.mfu or 0.0) / max(prev.mfu or 0.0, 1e-30)}
        prev = c
    first, last = split[0], split[-1]
    out["total"] = {"throughput": (last.samples_per_s or 0.0) / max(first.samples_per_s or 0.0, 1e-30),
                    "mfu": (last.mfu or 0.0) / max(first.mfu or 0.0, 1e-30)}
    return out
