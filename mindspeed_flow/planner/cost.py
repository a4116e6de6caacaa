"""Analytic cost and memory model of one part under a parallel layout, vectorized over layouts.

Every function takes numpy arrays of layout fields (dp, tp, pp, cp, token budget b, recompute rc) and returns
arrays, so the same code prices one layout for a report and 10^5 layouts for the search.

Time of one optimizer step of a part (seconds), for the global batch G split over dp replicas:
- backbone: m packed microbatches of b tokens (padded: pipeline stages need static shapes) run through a
  pp-stage 1F1B pipeline: (m - 1) x t_slowest + the sum of the stage times, where a stage's time = its layers x
  (compute + TP all-reduces (4 per layer, 6 with recompute) + CP K/V exchange) + PP send/recv + a fixed
  per-microbatch overhead; the LM head runs on the last stage (the embedding lookup on the first), and the
  layers per stage are split unevenly to balance that (`stage_split`); then the DP gradient sync
  (reduce-scatter + all-gather with the distributed optimizer, all-reduce without) and the optimizer update
  (memory bound). Causal attention FLOPs are counted per sample (varlen), linear FLOPs on padded tokens.
- MoE backbone (expert parallelism ep, experts not tensor-split: Megatron's expert-tensor-parallel 1, so ep
  divides dp x tp): linear FLOPs from the ACTIVE parameters (top-k + shared experts); per MoE layer and
  microbatch 4 all-to-alls (dispatch + combine, forward and backward; 6 with recompute), each moving
  tokens/(tp cp) x hidden x top-k x bytes x (ep - 1)/ep per device over the link the ep consecutive ranks span;
  the routed experts' gradients sync over the expert-data-parallel group (dp x tp x cp / ep ranks).
- encoder: its G/dp samples' images, TP all-reduces per layer, the embedding traffic to the backbone (and the
  gradient back when trainable), DP sync and optimizer when trainable, plus one sample's forward of pipeline fill
  (the backbone waits for the first embedding). A frozen encoder runs forward only (2x its parameters per patch).
Compute rate = devices x peak x efficiency(role) x tp_scaling^log2(tp), or profiled seconds per FLOP.

Memory per device (bytes), the most loaded pipeline stage, as the planned job's host allocates it
(planner.job; `planner/memory.py` checks each host's model against the memory its tiny jobs measure):
- weights / grads / optimizer states. MindSpeed-MM (Megatron, and the default): bf16 weights (2 B), fp32 main
  gradients (4 B: Megatron's gradient buffer accumulates in fp32 under --bf16), fp32 main weights + Adam m, v
  (12 B) sharded by the distributed optimizer over DP x CP (its data-parallel group includes the CP ranks);
  MoE: the routed experts' share of a stage is divided by ep (not by tp), the rest by tp, and the experts'
  optimizer states are sharded over the expert-data-parallel group (dp x tp x cp / ep);
  fp32 training: 4 + 4 + 8 B; unsharded without it. The torch host: gradients and AdamW's m, v in the
  parameters' own dtype (bf16: 2 + 2 + 4 B, fp32: 4 + 4 + 8 B; no fp32 master copy); FSDP2 (the backbone at
  tp 1, dp > 1) shards all three over DP; DDP (dp > 1 otherwise) keeps a second copy of the gradients in its
  buckets; the encoder's optimizer is never sharded.
- activations per token per layer (elements): act_h x h + act_kv x kv + act_f x ffn (PartSpec; counted
  from the HF modules: LLM 8h + 2kv + 4f), divided by tp (sequence parallel) and cp; unfused attention (CPU)
  also keeps a b x b fp32 mask per layer; the torch host's per-sequence attention keeps K, V at full width and
  per-sequence copies of Q and the output instead (8h + 2h + 2h + 4f, no mask). 1F1B keeps min(m, pp)
  microbatches on stage 0. Full recompute keeps each layer's input only plus one layer's activations. The last
  stage also holds the logits (and their gradient) in fp32.
- buffers: the backbone keeps 2 microbatches of received embeddings; an encoder the embeddings of its held
  samples, at most the pool capacity (planner.pool_capacity_mb; 0: the plan sizes it, `pool_capacity_needed`).

Loaders (CostContext.loader): how a job's data loader turns samples into backbone microbatches. The decoupled plan
packs samples to the token budget b (`flow`); a baseline runs its own system's loader: one sample per microbatch at
its own length (`sample`: MindSpeed-MM's examples, --micro-batch-size 1 --variable-seq-lengths) or padded to the
sequence length (`pad`: Megatron-LM's static shapes). A per-sample loader leaves the DP replicas with unequal work;
the step waits for the slowest (`Loader.imbalance`, from the workload's sample lengths).
  A trainable encoder keeps the activations of all its in-flight samples (strict mode: its backward waits for
  the backbone's gradients) unless it recomputes, when it keeps only the pixel inputs. In flight: the whole
  step's samples on the torch host; on MindSpeed-MM, `flow.encoder_inflight` decoder microbatch groups
  (planner.encoder_inflight; each group is one decoder microbatch's samples, priced at the largest token budget).
- activation counts: the parts' own (counted from the HF modules) unless planner.activation_counts names a
  host's (`memory.ACTIVATION_COUNTS`: MindSpeed-MM's modules on the emulated NPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from mindspeed_flow.config.planner import PlannerConfig
from mindspeed_flow.planner.hardware import Cluster
from mindspeed_flow.skus import normalize_dtype
from mindspeed_flow.planner.jobs import job_rules
from mindspeed_flow.planner.parts import PartSpec

LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "b", "rc")
LOGITS_BYTES = 4 + 4  # fp32 logits and their gradient


@dataclass(frozen=True)
class Bytes:
    param: float
    grad: float
    optim: float
    act: float


def precision_bytes(dtype: str, job: str = "") -> Bytes:
    """Bytes per parameter (weights, gradients, optimizer states) and per activation element on the job's host."""
    d = normalize_dtype(dtype)
    if d not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"planner.dtype={dtype!r}: expected bf16, fp16 or fp32")
    p = 4 if d == "fp32" else 2
    if job_rules(job).name == "torch":  # autograd's gradients and AdamW's m, v in the parameters' dtype
        return Bytes(param=p, grad=p, optim=2 * p, act=p)
    if d == "fp32":
        return Bytes(param=4, grad=4, optim=8, act=4)
    return Bytes(param=2, grad=4, optim=12, act=2)  # Megatron: fp32 main grads, fp32 main weights + m, v


@dataclass(frozen=True)
class Loader:
    """How samples become backbone microbatches (module docstring: Loaders).

    kind: "flow" (packed to the layout's token budget b), "sample" (one sample per microbatch at its own length),
    "pad" (one sample per microbatch padded to `seq_len`). `sample_costs`: the backbone cost of each sample of the
    step's stream in FLOPs, in the order the loader deals them to DP replicas (what `imbalance` sums)."""

    kind: str = "flow"
    seq_len: int = 0
    sample_costs: tuple[float, ...] = ()

    @property
    def per_sample(self) -> bool:
        return self.kind in ("sample", "pad")

    def imbalance(self, dp: np.ndarray, pp: np.ndarray | int = 1) -> np.ndarray:
        """The step's pipeline time over the mean microbatch's, per layout. MindSpeed-MM / Megatron hand each DP
        rank a contiguous slice of the global batch (G / dp samples, one a microbatch); in 1F1B the pp stages work
        on pp consecutive microbatches at once and each slot lasts as long as the largest of them, so a replica
        takes sum_k max(c_k .. c_k+pp-1) (its microbatch costs c), and the step waits for the slowest replica.
        Padded microbatches all cost the same (1.0); the flow plan's packing scheduler balances its microbatches
        (1.0: the fill factor prices its waste)."""
        dp = np.asarray(dp)
        pp = np.broadcast_to(np.asarray(pp), dp.shape)
        if self.kind != "sample" or not self.sample_costs or dp.size == 0:
            return np.ones(dp.shape)
        c = np.asarray(self.sample_costs, dtype=np.float64)
        out: dict[tuple[int, int], float] = {}
        for d, p in set(zip(dp.ravel().tolist(), pp.ravel().tolist())):
            n = len(c) // int(d) * int(d)
            if n == 0:
                out[(d, p)] = 1.0
                continue
            per = c[:n].reshape(int(d), -1)
            w = min(int(p), per.shape[1])
            slots = np.lib.stride_tricks.sliding_window_view(
                np.concatenate([per, np.zeros((int(d), w - 1))], axis=1), w, axis=1).max(axis=2)
            out[(d, p)] = float(slots.sum(axis=1).max() / max(per.sum(axis=1).mean(), 1e-30))
        return np.array([out[(d, p)] for d, p in zip(dp.ravel().tolist(), pp.ravel().tolist())]).reshape(dp.shape)


FLOW_LOADER = Loader()


@dataclass(frozen=True)
class CostContext:
    """What the cost model needs besides the part and the layout."""

    cluster: Cluster
    cfg: PlannerConfig
    global_batch: int
    contention: float = 1.0  # compute slowdown when devices share host cores (CPU emulation)
    job_devices: int = 0  # devices the job may span (prices the links between parts); 0: the whole cluster
    loader: Loader = FLOW_LOADER  # how samples become backbone microbatches (baselines run their own loader)

    @property
    def bytes(self) -> Bytes:
        return precision_bytes(self.cfg.dtype, self.cfg.job)

    @property
    def peak(self) -> float:
        return self.cluster.peak(self.cfg.dtype)

    def seconds_per_flop(self, role: str, tp: np.ndarray) -> np.ndarray:
        """Seconds per FLOP on ONE device of a tp-way group (tp's smaller GEMMs run less efficiently)."""
        scaling = self.cfg.tp_scaling ** np.log2(np.maximum(tp, 1))
        profiled = float(dict(self.cfg.seconds_per_flop).get(role, 0.0) or 0.0)
        if profiled > 0:
            return profiled / scaling * self.contention
        eff = float(dict(self.cfg.efficiency).get(role, 0.5))
        return self.contention / (self.peak * eff * scaling)

    def overlap(self, kind: str) -> float:
        return float(dict(self.cfg.overlap).get(kind, 0.0))


@dataclass
class Layouts:
    """Struct of arrays: one entry per candidate layout of one part."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray  # backbone expert parallelism (MoE; 1 otherwise): splits the routed experts over dp x tp ranks
    b: np.ndarray  # backbone microbatch token budget (0 for an encoder)
    rc: np.ndarray  # full activation recompute (encoder: 1 from the pixels per image, 2 also per layer)

    @property
    def devices(self) -> np.ndarray:
        return self.dp * self.tp * self.pp * self.cp

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    def take(self, idx: np.ndarray | int) -> "Layouts":
        idx = np.atleast_1d(idx)
        return Layouts(**{k: getattr(self, k)[idx] for k in LAYOUT_FIELDS})

    def row(self, i: int) -> dict[str, int]:
        return {k: int(getattr(self, k)[i]) for k in LAYOUT_FIELDS}

    @staticmethod
    def from_rows(rows: list[Mapping[str, int]]) -> "Layouts":
        return Layouts(**{k: np.array([int(r.get(k, 1 if k in ("dp", "tp", "pp", "cp", "ep") else 0)) for r in rows],
                                      dtype=np.int64) for k in LAYOUT_FIELDS})


@dataclass
class Costs:
    """Per-layout predictions (arrays aligned with a Layouts)."""

    time: np.ndarray  # seconds per optimizer step
    memory: np.ndarray  # bytes on the most loaded device
    memory_parts: dict[str, np.ndarray] = field(default_factory=dict)  # weights, grads, optim, act, buffers
    time_parts: dict[str, np.ndarray] = field(default_factory=dict)  # compute, bubble, tp, cp, pp, dp, ...
    microbatches: np.ndarray | None = None
    stage_layers: dict[str, np.ndarray] = field(default_factory=dict)  # backbone: layers on first/mid/last stage


# ---------------------------------------------------------------------------------------------- communication
def ring_allreduce_time(nbytes: np.ndarray, n: np.ndarray, bw: np.ndarray, lat: np.ndarray) -> np.ndarray:
    """Ring all-reduce: 2 (n-1)/n of the buffer over the slowest link, 2 (n-1) latency hops; 0 for n = 1."""
    n = np.asarray(n, dtype=np.float64)
    return np.where(n > 1, 2.0 * (n - 1) / np.maximum(n, 1) * nbytes / bw + 2.0 * (n - 1) * lat, 0.0)


def _link(ctx: CostContext, span: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth and latency of a group whose ranks span `span` consecutive devices (rank order tp, cp, dp, pp):
    the slowest tier it crosses (package, node, scale-up domain, scale-out; `Cluster.tiers`)."""
    return ctx.cluster.link(span)


def bridge_link(ctx: CostContext) -> tuple[float, float]:
    """The encoder -> backbone embedding link: parts sit side by side in rank order, so the bridge crosses at
    least a node boundary, and the scale-out tier once the job spans more than one scale-up domain."""
    span = max(ctx.cluster.devices_per_node + 1, ctx.job_devices or ctx.cluster.devices)
    bw, lat = ctx.cluster.link(np.array([span]))
    return float(bw[0]), float(lat[0])


def dp_sync_time(ctx: CostContext, params_per_device: np.ndarray, dp: np.ndarray, span: np.ndarray) -> np.ndarray:
    """Gradient sync over DP: reduce-scatter grads + all-gather params (distributed optimizer) or all-reduce."""
    by = ctx.bytes
    bw, lat = _link(ctx, span)
    dp = np.asarray(dp, dtype=np.float64)
    frac = (dp - 1) / np.maximum(dp, 1)
    if ctx.cfg.distributed_optimizer:
        t = params_per_device * frac * (by.grad + by.param) / bw + 2 * (dp - 1) * lat
    else:
        t = 2 * params_per_device * frac * by.grad / bw + 2 * (dp - 1) * lat
    return np.where(dp > 1, t, 0.0) * (1.0 - ctx.overlap("dp"))


def optimizer_shards(ctx: CostContext, role: str, dp: np.ndarray, tp: np.ndarray,
                     cp: np.ndarray | int = 1) -> np.ndarray:
    """Ranks a part's optimizer states are sharded over on the planned job (planner.job; 1: unsharded).

    Megatron's distributed optimizer shards over the data-parallel group with context parallelism (DP x CP
    ranks hold the same weights); FSDP2 on the torch host shards over DP (that host runs no CP)."""
    rules = job_rules(ctx.cfg.job)
    dp = np.asarray(dp)
    if not ctx.cfg.distributed_optimizer or (role == "encoder" and not rules.shard_encoder):
        return np.ones_like(dp)
    if role == "backbone" and not rules.shard_with_tp:
        return np.where(np.asarray(tp) > 1, 1, dp)
    return dp * np.asarray(cp)


def optimizer_time(ctx: CostContext, params_per_device: np.ndarray, dp: np.ndarray,
                   shards: np.ndarray | None = None) -> np.ndarray:
    """Adam update is memory bound: read + write weights, grads and states of this device's shard."""
    by = ctx.bytes
    shard = params_per_device / (shards if shards is not None else dp if ctx.cfg.distributed_optimizer else 1)
    return shard * 2.0 * (by.param + by.grad + by.optim) / ctx.cluster.hbm_bandwidth


def expert_params_per_device(part: PartSpec, L: Layouts, layers: np.ndarray | float) -> np.ndarray:
    """Routed-expert parameters a device of a stage holding `layers` layers keeps: that stage's share of the
    experts (spread evenly over the layers) over ep; not split by tp (expert-tensor-parallel 1)."""
    return np.asarray(layers, dtype=np.float64) * (part.expert_params / part.layers) / L.ep


def expert_data_parallel(L: Layouts) -> np.ndarray:
    """Ranks holding the same experts (Megatron's expert-data-parallel group): dp x tp x cp / ep."""
    return L.dp * L.tp * L.cp // L.ep


def expert_tail_time(part: PartSpec, ctx: CostContext, L: Layouts,
                     layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient sync and optimizer update of the routed experts a device holds on `layers` layers: over the
    expert-data-parallel group (0 for a dense part)."""
    experts = expert_params_per_device(part, L, layers)
    if not part.expert_params:  # no second gradient sync (its latency would count) for a dense part
        return np.zeros_like(experts), np.zeros_like(experts)
    edp = expert_data_parallel(L)
    sync = dp_sync_time(ctx, experts, edp, L.tp * L.cp * L.dp)
    return sync, optimizer_time(ctx, experts, edp, optimizer_shards(ctx, part.role, edp, 1))


def backbone_tail_time(part: PartSpec, ctx: CostContext, L: Layouts, params: np.ndarray,
                       layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient sync and optimizer update of a backbone device holding `params` parameters on `layers` layers:
    the dense share over DP (the distributed optimizer's DP x CP shards), the routed experts over the
    expert-data-parallel group (`expert_tail_time`)."""
    dense = params - expert_params_per_device(part, L, layers)
    e_sync, e_opt = expert_tail_time(part, ctx, L, layers)
    sync = dp_sync_time(ctx, dense, L.dp, L.tp * L.cp * L.dp) + e_sync
    return sync, optimizer_time(ctx, dense, L.dp, optimizer_shards(ctx, part.role, L.dp, L.tp, L.cp)) + e_opt


def ep_alltoall_time(ctx: CostContext, ep: np.ndarray, tokens: np.ndarray, hidden: int, top_k: int) -> np.ndarray:
    """One MoE all-to-all (dispatch or combine) of `tokens` tokens per device: each token's hidden state goes to
    its top-k experts, (ep - 1)/ep of them on other ranks of the ep group (ep consecutive ranks); 0 when ep = 1."""
    ep = np.asarray(ep)
    bw, lat = _link(ctx, ep)
    n = ep.astype(np.float64)
    nbytes = tokens * hidden * top_k * ctx.bytes.act
    return np.where(ep > 1, nbytes * (n - 1) / n / bw + (n - 1) * lat, 0.0)


# ------------------------------------------------------------------------------------------------ memory
@dataclass(frozen=True)
class ActCounts:
    """Bytes one layer saves for backward: per token (x hidden, x ffn, x heads) and per attention score (x heads,
    and once, summed over each sequence's length squared). What a host's modules save, counted from their saved
    tensors (autograd's saved-tensor hooks) on one microbatch; the logits are booked apart (LOGITS_BYTES)."""

    h: float
    f: float
    heads: float
    scores_per_head: float
    scores: float


# planner.activation_counts: "" (the parts' own, counted from the HF modules) or one of these.
# megatron_emulated: MindSpeed-MM's Megatron layers (fused RMSNorm, SwiGLU, npu_fusion_attention) on the emulated
# NPU, counted on a tiny Qwen2.5-VL decoder (hidden 512, ffn 1024, 16 heads): per token per layer 18.7 B x h of
# fp32 norm inputs and residuals, 6.7 B x h of bf16 linear inputs, 12 B x h of fp32 Q, K, V (the emulated kernel
# upcasts them and repeats K and V to every head), 8 B x ffn of bf16 SwiGLU inputs and output, 13 B per head of
# softmax statistics; per sequence the emulated kernel keeps 3 fp32 score matrices per head and a bool mask.
ACTIVATION_COUNTS = {
    "megatron_emulated": ActCounts(h=37.5, f=8.0, heads=13.0, scores_per_head=12.0, scores=1.0),
}


def activation_counts(ctx: CostContext) -> ActCounts | None:
    name = ctx.cfg.activation_counts
    if not name:
        return None
    if name not in ACTIVATION_COUNTS:
        raise ValueError(f"planner.activation_counts={name!r}: expected '' or one of {sorted(ACTIVATION_COUNTS)}")
    return ACTIVATION_COUNTS[name]


def counted_layer_bytes(c: ActCounts, part: PartSpec, tokens: np.ndarray, sq_tokens: np.ndarray,
                        tp: np.ndarray) -> np.ndarray:
    """Bytes one layer saves for `tokens` tokens whose attention sequences' squared lengths sum to `sq_tokens`
    (tensor parallel: hidden, ffn and heads split over tp)."""
    per_token = (c.h * part.hidden + c.f * part.ffn + c.heads * part.heads) / tp
    return tokens * per_token + sq_tokens * (c.scores_per_head * part.heads / tp + c.scores)


# Hidden-wide copies per token per layer the torch host's varlen attention keeps besides the HF counts: each
# sequence's slice of Q and of the attention output (counted on the tiny Qwen2-VL backbone's saved tensors).
TORCH_VARLEN_COPIES = 2.0


def act_elems_per_token_layer(part: PartSpec, flash: bool) -> float:
    """Stored activation elements per token per layer (before TP/CP division; no recompute).

    Fused attention keeps K and V at their own (GQA) width; the unfused CPU path repeats them to every head.
    """
    kv = part.kv_dim if flash else part.hidden
    return part.act_h * part.hidden + part.act_kv * kv + part.act_f * part.ffn


def static_memory(ctx: CostContext, params: np.ndarray, dp: np.ndarray, trainable: bool,
                  shards: np.ndarray | None = None) -> dict[str, np.ndarray]:
    by = ctx.bytes
    if not trainable:
        z = np.zeros_like(params, dtype=np.float64)
        return {"weights": params * by.param, "grads": z, "optim": z}
    shard = shards if shards is not None else dp if ctx.cfg.distributed_optimizer else 1
    return {"weights": params * by.param, "grads": params * by.grad, "optim": params * by.optim / shard}


def part_static_memory(ctx: CostContext, role: str, params: np.ndarray, dp: np.ndarray, tp: np.ndarray,
                       cp: np.ndarray | int, trainable: bool) -> dict[str, np.ndarray]:
    """Weights, gradients and optimizer states of a part's device on the planned job's host.

    Megatron (MindSpeed-MM, the default): `static_memory` with the optimizer sharded over DP x CP. The torch
    host: FSDP2 (where it shards the optimizer) shards weights and gradients as well; DDP (dp > 1, unsharded)
    also holds its gradient buckets, a second copy of the gradients."""
    shards = optimizer_shards(ctx, role, dp, tp, cp)
    mem = static_memory(ctx, params, dp, trainable, shards)
    if job_rules(ctx.cfg.job).name != "torch" or not trainable:
        return mem
    fsdp = shards > 1
    mem["weights"] = np.where(fsdp, mem["weights"] / shards, mem["weights"])
    mem["grads"] = np.where(fsdp, mem["grads"] / shards, np.where(np.asarray(dp) > 1, 2.0, 1.0) * mem["grads"])
    return mem


# ------------------------------------------------------------------------------------------------ backbone
def microbatches(part: PartSpec, ctx: CostContext, dp: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Packed microbatches per replica: its tokens over the filled budget, at least 1, at most one per sample.

    Best fit leaves on average about half a sample of room in each microbatch, so the fill is
    packing_fill x (1 - mean sample / (2 b)) (at least half the budget). A per-sample loader: one per sample.
    """
    samples = ctx.global_batch / dp
    if ctx.loader.per_sample:  # --micro-batch-size 1: one microbatch per sample
        return np.maximum(np.floor(samples), 1)
    b = np.maximum(b, 1).astype(np.float64)
    fill = ctx.cfg.packing_fill * np.maximum(0.5, 1.0 - part.tokens_per_sample / (2.0 * b))
    m = np.ceil(samples * part.tokens_per_sample / (b * fill))
    return np.clip(m, 1, np.maximum(np.floor(samples), 1))


def microbatch_tokens(part: PartSpec, ctx: CostContext, b: np.ndarray, peak: bool = False) -> np.ndarray:
    """Tokens a backbone microbatch computes (peak=False: on average; True: the largest, what memory holds).

    flow: the token budget (static shapes: padded to b). sample: the mean sample (the longest for memory). pad:
    the sequence length."""
    b = np.asarray(b, dtype=np.float64)
    if ctx.loader.kind == "sample":
        return np.full(b.shape, float(part.max_item_tokens if peak else part.tokens_per_sample))
    if ctx.loader.kind == "pad":
        return np.full(b.shape, float(max(ctx.loader.seq_len, part.max_item_tokens)))
    return b


def stage_split(layers: int, pp: np.ndarray, e_first: np.ndarray, e_last: np.ndarray,
                uneven: bool) -> dict[str, np.ndarray]:
    """Layers per pipeline stage that minimize the slowest stage, and that stage's time in layer units.

    Stage 0 also carries `e_first` (a coupled ViT, in layer-times) and the last stage `e_last` (the LM head and
    loss); middle stages hold layers only; every stage keeps at least one layer. Uneven (Megatron/MindSpeed
    `pipeline_num_layers`, any list): a bound T is reachable iff every stage can hold a layer and the stages'
    capacities floor(T - e_first) + floor(T - e_last) + (pp - 2) floor(T) reach L. With
    lb = max(total / pp, 1 + e_first, 1 + e_last), T = lb + 2 always is, so the optimum is the smallest reachable
    value of the forms k, k + e_first, k + e_last (k whole) in [lb, lb + 2]: exact, nine candidates.
    Uniform: L / pp each (pp must divide L).
    Returns "t" (slowest stage), "sum" (all stages), the layers on the "first" and "last" stage, "mid" (the
    most on a middle stage) and "mid_short" (how many middle stages hold one layer fewer than that).
    """
    pp = np.asarray(pp, dtype=np.int64)
    shape = np.broadcast_shapes(pp.shape, np.shape(e_first), np.shape(e_last))
    pp = np.broadcast_to(pp, shape).astype(np.float64)
    ef = np.broadcast_to(np.asarray(e_first, dtype=np.float64), shape)
    el = np.broadcast_to(np.asarray(e_last, dtype=np.float64), shape)
    total = layers + ef + el
    one = pp == 1
    if not uneven:
        n = layers / np.maximum(pp, 1)
        t = np.where(one, total, n + np.maximum(ef, el))
        return {"t": t, "sum": total, "first": np.where(one, layers, n), "mid": n, "mid_short": np.zeros(shape),
                "last": np.where(one, layers, n)}
    eps = 1e-9
    mids = np.maximum(pp - 2, 0)
    lb = np.maximum(np.maximum(total / np.maximum(pp, 1), 1 + ef), 1 + el)

    def capacity(t: np.ndarray) -> np.ndarray:
        cf, cl, cm = np.floor(t - ef + eps), np.floor(t - el + eps), np.floor(t + eps)
        ok = (cf >= 1) & (cl >= 1) & ((mids == 0) | (cm >= 1))
        return np.where(ok, cf + cl + mids * cm, -1)

    best_t = np.full(shape, np.inf)
    for off in (np.zeros(shape), ef, el):
        for k in range(3):
            t = np.ceil(lb - off - eps) + k + off
            t = np.where(t < lb - eps, t + 1, t)
            reach = capacity(t) >= layers
            best_t = np.where(reach & (t < best_t), t, best_t)
    best_t = np.where(one, total, best_t)
    # fill to capacity, then give back the surplus: first stage (most microbatches in flight), then the last,
    # then middle stages one layer each
    cf, cl, cm = np.floor(best_t - ef + eps), np.floor(best_t - el + eps), np.floor(best_t + eps)
    surplus = np.maximum(cf + cl + mids * cm - layers, 0)
    first = np.maximum(cf - surplus, 1)
    surplus -= cf - first
    last = np.maximum(cl - surplus, 1)
    surplus -= cl - last
    mid = np.where(mids > 0, cm - np.floor(surplus / np.maximum(mids, 1)), 0)
    short = np.where(mids > 0, surplus - np.floor(surplus / np.maximum(mids, 1)) * mids, 0)
    return {"t": best_t, "sum": total, "first": np.where(one, layers, first), "mid": mid, "mid_short": short,
            "last": np.where(one, layers, last)}


def backbone_stage_mb_time(part: PartSpec, ctx: CostContext, L: Layouts, m: np.ndarray,
                           first_extra: np.ndarray | float = 0.0) -> dict[str, np.ndarray]:
    """Per-microbatch time of the slowest pipeline stage, split by cause, and the stage split.

    The embedding sits on the first stage (a lookup: no FLOPs counted) and the LM head on the last; with
    `first_extra` seconds of other work on stage 0 (a coupled ViT) the split moves layers off that stage.
    Keys "compute", "tp", "cp", "ep", "pp", "overhead" add up to the slowest stage; "sum_stages" is the time of one
    microbatch through all stages (what the pipeline fill costs); "layers_first/mid/last" is the split.
    """
    by = ctx.bytes
    samples = ctx.global_batch / L.dp
    b = microbatch_tokens(part, ctx, L.b)
    rc_mult = np.where(L.rc > 0, 1.0 + part.forward_fraction, 1.0)
    if ctx.cfg.flash_attention and ctx.loader.kind != "pad":  # varlen kernels: attention per sample
        attn_mb = part.attn_flops_per_sample * samples / m
    else:  # one dense b x b masked attention per microbatch (padded: the whole sequence length)
        attn_mb = part.attn_flops_per_sample / max(part.sq_tokens_per_sample, 1.0) * b ** 2
    head_tok = min((6.0 if part.trainable else 2.0) * part.vocab * part.hidden, part.linear_flops_per_token)
    layer_flops = ((part.linear_flops_per_token - head_tok) * b + attn_mb) * rc_mult / part.layers
    spf = ctx.seconds_per_flop(part.role, L.tp) / (L.tp * L.cp)
    layer_compute = layer_flops * spf
    head = head_tok * b * spf  # the LM head is not recomputed
    tokens = b / L.cp
    bw_tp, lat_tp = _link(ctx, L.tp)
    n_coll = np.where(L.rc > 0, 6.0, 4.0)
    layer_tp = n_coll * ring_allreduce_time(tokens * part.hidden * by.act, L.tp, bw_tp, lat_tp) * (1 - ctx.overlap("tp"))
    bw_cp, lat_cp = _link(ctx, L.tp * L.cp)
    kv_bytes = tokens * 2 * part.kv_dim * by.act / L.tp
    layer_cp = np.where(L.cp > 1, 3.0 * ((L.cp - 1) * kv_bytes / bw_cp + (L.cp - 1) * lat_cp), 0.0) * (1 - ctx.overlap("cp"))
    # MoE: dispatch + combine, forward and backward (+ the recomputed forward's), in the MoE layers only
    moe_share = part.moe_layers / part.layers
    layer_ep = (moe_share * np.where(L.rc > 0, 6.0, 4.0) * ep_alltoall_time(ctx, L.ep, tokens / L.tp, part.hidden,
                                                                           part.top_k) * (1 - ctx.overlap("ep")))
    unit = layer_compute + layer_tp + layer_cp + layer_ep
    ef, el = np.asarray(first_extra) / unit, head / unit
    split = stage_split(part.layers, L.pp, ef, el, ctx.cfg.uneven_pp)
    # the slowest stage's time by cause: its layers' compute and communication; its extra work is compute
    t = split["t"]
    layers_slow = np.where(np.isclose(t, split["first"] + ef), split["first"],
                           np.where(np.isclose(t, split["last"] + el), split["last"], split["mid"]))
    layers_slow = np.where(L.pp == 1, part.layers, layers_slow)
    extra = t - layers_slow
    bw_pp, lat_pp = _link(ctx, L.devices)
    p2p = np.where(L.pp > 1, 2.0 * (tokens / L.tp * part.hidden * by.act / bw_pp + lat_pp), 0.0) * (1 - ctx.overlap("pp"))
    overhead = np.full_like(unit, ctx.cfg.microbatch_overhead_s * ctx.contention)
    return {
        "compute": (layers_slow * layer_compute + extra * unit),
        "tp": layers_slow * layer_tp,
        "cp": layers_slow * layer_cp,
        "ep": layers_slow * layer_ep,
        "pp": p2p,
        "overhead": overhead,
        "sum_stages": split["sum"] * unit + L.pp * (p2p + overhead),
        "layers_first": split["first"], "layers_mid": split["mid"], "layers_last": split["last"],
        "mid_short": split["mid_short"],
    }


STAGE_KEYS = ("compute", "tp", "cp", "ep", "pp", "overhead")


def stage_time(mb: dict[str, np.ndarray]) -> np.ndarray:
    """Seconds of one microbatch on the slowest stage (the causes of `backbone_stage_mb_time`)."""
    return sum(mb[k] for k in STAGE_KEYS)


def pipeline_time(mb: dict[str, np.ndarray], m: np.ndarray) -> np.ndarray:
    """1F1B with stages of unequal time: (m - 1) x the slowest stage + one microbatch through every stage."""
    return (m - 1) * stage_time(mb) + mb["sum_stages"]


def stage_layer_list(split: dict[str, np.ndarray], pp: int, i: int) -> list[int]:
    """Layers on each stage of layout i, first to last (middle stages short one layer come first)."""
    get = lambda k: int(round(float(np.asarray(split[k])[i])))  # noqa: E731
    if pp == 1:
        return [get("first")]
    short = get("mid_short")
    mids = [get("mid") - 1] * short + [get("mid")] * (pp - 2 - short)
    return [get("first")] + mids + [get("last")]


def backbone_stage_params(part: PartSpec, L: Layouts, split: dict[str, np.ndarray] | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Parameters per device on the first and on the last pipeline stage (the stage split's layer counts); the
    first stage's idle module counts here when it trains (`PartSpec.idle_first_params`)."""
    n_first = np.ceil(part.layers / L.pp) if split is None else split["layers_first"]
    n_last = np.ceil(part.layers / L.pp) if split is None else split["layers_last"]
    single = L.pp == 1
    n_first = np.where(single, part.layers, n_first)
    n_last = np.where(single, part.layers, n_last)
    first = part.first_params + (part.idle_first_params if part.idle_first_trainable else 0)
    return (stage_params(part, L, n_first, first + np.where(single, part.last_params, 0)),
            stage_params(part, L, n_last, part.last_params + np.where(single, first, 0)))


def stage_params(part: PartSpec, L: Layouts, layers: np.ndarray, ends: np.ndarray | int = 0) -> np.ndarray:
    """Parameters per device of a stage of `layers` layers plus `ends` (embedding / head) parameters: the dense
    share over tp, the routed experts' over ep (`expert_params_per_device`)."""
    experts = expert_params_per_device(part, L, layers)
    whole = np.asarray(layers, dtype=np.float64) * part.layer_params + ends
    return (whole - experts * L.ep) / L.tp + experts


def backbone_activation_memory(part: PartSpec, ctx: CostContext, L: Layouts, inflight: np.ndarray,
                                layers_stage: np.ndarray | None = None) -> np.ndarray:
    """Activation bytes of `inflight` microbatches on a stage of `layers_stage` layers (default: an even share;
    with recompute: layer inputs + one layer).

    Unfused attention (CPU) also keeps the dense block-diagonal mask of each layer: b^2 fp32 values.
    """
    by = ctx.bytes
    layers_stage = np.ceil(part.layers / L.pp) if layers_stage is None else layers_stage
    b = microbatch_tokens(part, ctx, L.b, peak=True)
    tokens = b / L.cp  # per device with CP; TP divides through sequence parallelism
    counts = activation_counts(ctx)
    if counts is not None:  # a host's own counts; the microbatch's sequences: its share of samples' lengths^2
        samples_mb = b * ctx.cfg.packing_fill / max(part.tokens_per_sample, 1.0)
        per_layer = counted_layer_bytes(counts, part, tokens, part.sq_tokens_per_sample * samples_mb / L.cp, L.tp)
    elif job_rules(ctx.cfg.job).name == "torch":
        # The torch host's packed microbatches attend per sequence (its varlen path, on every device): no b x b
        # mask, but K and V repeated to every head and per-sequence copies of Q and the output are kept.
        elems = act_elems_per_token_layer(part, False) + TORCH_VARLEN_COPIES * part.hidden
        per_layer = elems * tokens / L.tp * by.act
    else:
        per_layer = act_elems_per_token_layer(part, ctx.cfg.flash_attention) * tokens / L.tp * by.act
        if not ctx.cfg.flash_attention:
            per_layer = per_layer + tokens * b * 4.0
    full = inflight * layers_stage * per_layer
    ckpt = inflight * layers_stage * tokens / L.tp * part.hidden * by.act + per_layer
    return np.where(L.rc > 0, ckpt, full)


def backbone_costs(part: PartSpec, ctx: CostContext, L: Layouts) -> Costs:
    m = microbatches(part, ctx, L.dp, L.b)
    mb = backbone_stage_mb_time(part, ctx, L, m)
    t_mb = stage_time(mb)
    pipeline = pipeline_time(mb, m) * ctx.loader.imbalance(L.dp, L.pp)
    p_first, p_last = backbone_stage_params(part, L, mb)
    p_mid = stage_params(part, L, mb["layers_mid"])
    p_dev = np.maximum(np.maximum(p_first, p_last), p_mid)
    dp_t, opt_t = backbone_tail_time(part, ctx, L, p_dev, most_layers(mb))
    time = pipeline + dp_t + opt_t + ctx.cfg.step_overhead_s * ctx.contention
    mem = backbone_memory(part, ctx, L, m, mb)
    comp = mb["compute"] * m
    return Costs(
        time=time, memory=mem["total"], memory_parts=mem["parts"], microbatches=m,
        time_parts={"compute": comp, "bubble": pipeline - m * t_mb, "tp": mb["tp"] * m, "cp": mb["cp"] * m,
                    "ep": mb["ep"] * m, "pp": mb["pp"] * m, "dp": dp_t, "optimizer": opt_t},
        stage_layers={**{k: mb[f"layers_{k}"] for k in ("first", "mid", "last")}, "mid_short": mb["mid_short"]},
    )


def most_layers(mb: dict[str, np.ndarray]) -> np.ndarray:
    """The most layers a pipeline stage holds (the stage split of `backbone_stage_mb_time`)."""
    return np.maximum(np.maximum(mb["layers_first"], mb["layers_last"]), mb["layers_mid"])


def backbone_static_memory(part: PartSpec, ctx: CostContext, L: Layouts, params: np.ndarray,
                           layers: np.ndarray) -> dict[str, np.ndarray]:
    """Weights, gradients and optimizer states of a backbone device holding `params` parameters on `layers`
    layers: `part_static_memory` of the dense share, plus the routed experts' with their optimizer states sharded
    over the expert-data-parallel group."""
    experts = expert_params_per_device(part, L, layers)
    dense = part_static_memory(ctx, part.role, params - experts, L.dp, L.tp, L.cp, True)
    moe = part_static_memory(ctx, part.role, experts, expert_data_parallel(L), 1, 1, True)
    return {k: dense[k] + moe[k] for k in dense}


def backbone_memory(part: PartSpec, ctx: CostContext, L: Layouts, m: np.ndarray,
                    mb: dict[str, np.ndarray]) -> dict:
    """Bytes per device on the first, a middle (the second: pp - 1 microbatches in flight) and the last stage."""
    by = ctx.bytes
    one_f1b = ctx.cfg.pp_schedule == "1f1b"
    inflight_first = np.where(L.pp > 1, np.minimum(m, L.pp) if one_f1b else m, 1)
    inflight_mid = np.where(L.pp > 2, np.minimum(m, L.pp - 1) if one_f1b else m, 0)
    act_first = backbone_activation_memory(part, ctx, L, inflight_first, mb["layers_first"])
    act_mid = backbone_activation_memory(part, ctx, L, inflight_mid, mb["layers_mid"])
    act_last = backbone_activation_memory(part, ctx, L, np.ones_like(m), mb["layers_last"])
    b = microbatch_tokens(part, ctx, L.b, peak=True)
    recv = 2.0 * b / L.cp * part.hidden * by.act / L.tp  # embeddings of 2 microbatches from the pool
    logits = b / L.cp * part.vocab / L.tp * LOGITS_BYTES  # fp32 log-probs saved for the loss + their grad
    p_first, p_last = backbone_stage_params(part, L, mb)
    p_mid = stage_params(part, L, mb["layers_mid"])
    s_first, s_mid, s_last = (backbone_static_memory(part, ctx, L, p, n) for p, n in (
        (p_first, mb["layers_first"]), (p_mid, mb["layers_mid"]), (p_last, mb["layers_last"])))
    if part.idle_first_params and not part.idle_first_trainable:  # frozen: its weights only, over the stage's TP
        frozen = part.idle_first_params / L.tp * by.param
        s_first["weights"] = s_first["weights"] + frozen
        s_last["weights"] = s_last["weights"] + np.where(L.pp == 1, frozen, 0.0)
    single = L.pp == 1
    stages = {
        "first": sum(s_first.values()) + act_first + recv + np.where(single, logits, 0.0),
        "mid": np.where(L.pp > 2, sum(s_mid.values()) + act_mid, 0.0),
        "last": sum(s_last.values()) + act_last + logits,
    }
    first_w = (stages["first"] >= stages["mid"]) & (stages["first"] >= stages["last"])
    mid_w = ~first_w & (stages["mid"] >= stages["last"])
    pick = lambda a, b, c: np.where(first_w, a, np.where(mid_w, b, c))  # noqa: E731
    parts = {k: pick(s_first[k], s_mid[k], s_last[k]) for k in s_first}
    parts["activations"] = pick(act_first, act_mid, act_last)
    parts["buffers"] = pick(recv + np.where(single, logits, 0.0), np.zeros_like(recv), logits)
    total = np.maximum(np.maximum(stages["first"], stages["mid"]), stages["last"])
    return {"total": total, "parts": parts, "stages": stages}


# ------------------------------------------------------------------------------------------------ encoder
def encoder_samples_time(part: PartSpec, ctx: CostContext, samples: np.ndarray, tp: np.ndarray,
                         rc: np.ndarray) -> dict[str, np.ndarray]:
    """Time for one tp group to encode (fwd, + bwd when trainable) `samples` samples, split by cause."""
    by = ctx.bytes
    # rc 1 runs the forward again from the pixels; rc 2 (per layer) does that storing layer inputs, then rebuilds
    # each layer during its backward: one more forward
    rc_mult = np.where(part.trainable, 1.0 + np.clip(rc, 0, 2) * part.forward_fraction, 1.0)
    flops = samples * part.flops_per_sample * rc_mult
    compute = flops / tp * ctx.seconds_per_flop(part.role, tp)
    bw_tp, lat_tp = _link(ctx, tp)
    # all-reduces per layer: 2 forward (attention, MLP), 2 backward, 2 more when the forward is recomputed
    n_coll = 4.0 + 2.0 * np.clip(rc, 0, 2) if part.trainable else np.full_like(tp, 2.0, float)
    images = samples * part.items_per_sample
    per_image = ring_allreduce_time(part.tokens_per_sample / max(part.items_per_sample, 1e-9) * part.hidden
                                    * by.act, tp, bw_tp, lat_tp)
    tp_comm = part.layers * n_coll * images * per_image
    bw_x, lat_x = bridge_link(ctx)
    directions = 2.0 if part.trainable else 1.0
    embed = directions * (samples * embedding_bytes(part, ctx, part.out_tokens_per_sample) / tp / bw_x
                          + samples * lat_x)
    return {
        "compute": compute,
        "tp": tp_comm * (1.0 - ctx.overlap("tp")),
        "embed": embed * (1.0 - ctx.overlap("embed")),
        "overhead": samples * ctx.cfg.item_overhead_s * ctx.contention,
    }


def encoder_static_params(part: PartSpec, tp: np.ndarray) -> np.ndarray:
    return part.total_params / tp


def encoder_activation_memory(part: PartSpec, ctx: CostContext, samples: np.ndarray, tp: np.ndarray,
                              rc: np.ndarray) -> np.ndarray:
    """Activations an encoder rank holds for `samples` in-flight samples.

    Kept (trainable, rc 0): every layer's activations, the merger's, and the pixel inputs of all of them.
    Recompute (rc 1): the pixel inputs only, plus one (the largest) image's activations of all layers during
    its backward. Per-layer recompute (rc 2): the pixel inputs, plus during one image's backward its layer inputs
    (hidden per patch per layer), one layer's activations and the merger's. Frozen: forward only, one layer of
    one image at a time.
    """
    by = ctx.bytes
    per_tok = (part.layers * act_elems_per_token_layer(part, ctx.cfg.flash_attention) / tp
               + part.act_head_per_token) * by.act
    inputs = samples * part.tokens_per_sample * part.input_elems_per_token * by.act
    kept = samples * part.tokens_per_sample * per_tok + inputs
    one_image = part.max_item_tokens * per_tok
    counts = activation_counts(ctx)
    if counts is not None:  # a host's own counts: every layer attends within each image (sq_tokens_per_sample)
        per_sample = (part.layers * counted_layer_bytes(counts, part, part.tokens_per_sample,
                                                        part.sq_tokens_per_sample, tp)
                      + part.tokens_per_sample * part.act_head_per_token * by.act)
        kept = samples * per_sample + inputs
        one_image = per_sample * part.max_item_tokens / max(part.tokens_per_sample, 1.0)
    if not part.trainable:
        layer = act_elems_per_token_layer(part, ctx.cfg.flash_attention) / tp * by.act
        return np.broadcast_to(part.max_item_tokens * layer, np.shape(samples * tp)).astype(np.float64)
    layer_act = act_elems_per_token_layer(part, ctx.cfg.flash_attention) / tp * by.act
    per_layer_ckpt = part.max_item_tokens * ((part.layers * part.hidden / tp + part.act_head_per_token) * by.act
                                             + layer_act)
    return np.where(rc >= 2, inputs + per_layer_ckpt, np.where(rc > 0, inputs + one_image, kept))


# Decoder microbatch groups a MindSpeed-MM encoder replica holds when planner.encoder_inflight is 0: the host's
# default is the decoder's pp + 1, and the encoder is priced before the decoder's pp is chosen, so this is that
# default at pp 8 (an upper bound for plans with pp <= 8).
DEFAULT_ENCODER_INFLIGHT = 9


def encoder_inflight_samples(part: PartSpec, ctx: CostContext, samples: np.ndarray) -> np.ndarray:
    """Samples whose activations an encoder replica holds at once.

    The torch host (and any job without a bound) holds its whole step's samples until the backbone's gradients
    come back. MindSpeed-MM holds `flow.encoder_inflight` decoder microbatch groups (planner.encoder_inflight,
    0: DEFAULT_ENCODER_INFLIGHT); a group is one decoder microbatch's samples, priced at the largest token budget
    the planner considers (planner.token_budgets, or 4 x the longest sample rounded up to token_alignment)."""
    if job_rules(ctx.cfg.job).name != "mm" or not part.trainable or part.llm_tokens_per_sample <= 0:
        return samples
    groups = int(ctx.cfg.encoder_inflight) or DEFAULT_ENCODER_INFLIGHT
    align = max(int(ctx.cfg.token_alignment), 1)
    budget = max([int(b) for b in ctx.cfg.token_budgets]
                 or [int(np.ceil(part.llm_max_tokens * 4.0 / align)) * align])
    per_group = max(budget * ctx.cfg.packing_fill / part.llm_tokens_per_sample, 1.0)
    return np.minimum(samples, groups * per_group)


def embedding_bytes(part: PartSpec, ctx: CostContext, tokens: float) -> float:
    """Bytes of one sample's embeddings of `tokens` LLM tokens (what the pool carries and counts): the merger's
    output and, for Qwen3-VL, one deepstack feature tensor per deepstack layer of the same size."""
    return float(tokens) * part.out_hidden * part.embedding_tensors * ctx.bytes.act


def samples_per_round(ctx: CostContext, enc_dp: int, microbatches: int) -> float:
    """Samples one producer (encoder replica) supplies while every backbone replica takes one microbatch: the
    step's G samples come in `microbatches` rounds and are shared by the enc_dp producers."""
    return ctx.global_batch / max(int(microbatches), 1) / max(int(enc_dp), 1)


def pool_capacity_needed(part: PartSpec, ctx: CostContext, enc_dp: int, microbatches: int, pp: int) -> float:
    """Pool capacity per producer (bytes) so that it never stalls on credits while the backbone can take more.

    Derivation: the backbone's first stage takes one microbatch a round, and in the 1F1B warm-up it takes pp of
    them before its first backward; a producer that has encoded the samples of those pp rounds plus the round it
    is encoding never waits for a credit the backbone could return. So it needs room for (pp + 1) rounds of its
    samples (`samples_per_round`), at most the samples it holds anyway (the encoder's in-flight bound, its whole
    step without one), each sized as the workload's largest embedding: a byte-counting pool holding that many
    bytes holds that many samples whatever their sizes, and the largest one always passes."""
    per_round = samples_per_round(ctx, enc_dp, microbatches)
    samples_step = ctx.global_batch / max(int(enc_dp), 1)
    held = float(encoder_inflight_samples(part, ctx, np.array([samples_step]))[0])
    samples = min(np.ceil(per_round) * min(int(pp) + 1, max(int(microbatches), 1)), held, np.ceil(samples_step))
    return max(samples, 1.0) * embedding_bytes(part, ctx, part.max_out_tokens)


def pool_stall_time(part: PartSpec, ctx: CostContext, capacity_bytes: float, enc_dp: int, microbatches: int,
                    forward_per_sample_s: float) -> float:
    """Seconds a step waits on a pool smaller than a round of a producer's samples (a pinned capacity).

    The pool counts bytes, so it holds about capacity / (mean embedding) samples (at least one: an embedding larger
    than the capacity passes when nothing else is in flight). While the backbone computes a round, a producer
    encodes that many samples of the next one and then waits for credits; when the backbone takes them, the rest of
    the round (per-round samples - held samples) is encoded while the backbone waits: that many encoder forwards a
    round, every round (the step simulator's pool credits replay the same)."""
    held = max(1.0, np.floor(capacity_bytes / max(embedding_bytes(part, ctx, part.out_tokens_per_sample), 1.0)))
    short = max(0.0, samples_per_round(ctx, enc_dp, microbatches) - held)
    return float(microbatches) * short * forward_per_sample_s


def encoder_costs(part: PartSpec, ctx: CostContext, L: Layouts) -> Costs:
    samples = ctx.global_batch / L.dp
    enc = encoder_samples_time(part, ctx, samples, L.tp, L.rc)
    work = sum(enc.values())
    # The backbone waits for the first sample's embedding: one sample's forward. Its backward is not on that path
    # (it runs once the gradient is back, while later samples are still in flight), so it is not counted.
    fill = work * part.forward_fraction / np.maximum(samples, 1.0)
    p_dev = encoder_static_params(part, L.tp)
    if part.trainable:
        dp_t = dp_sync_time(ctx, p_dev, L.dp, L.tp * L.dp)
        opt_t = optimizer_time(ctx, p_dev, L.dp, optimizer_shards(ctx, part.role, L.dp, L.tp, L.cp))
    else:
        dp_t = opt_t = np.zeros_like(work)
    time = work + fill + dp_t + opt_t + ctx.cfg.step_overhead_s * ctx.contention
    static = part_static_memory(ctx, part.role, p_dev, L.dp, L.tp, L.cp, part.trainable)
    held = encoder_inflight_samples(part, ctx, samples)
    act = encoder_activation_memory(part, ctx, held, L.tp, L.rc)
    # the embeddings in flight: those of the held samples, at most the pool's capacity (a bound, not a buffer
    # allocated up front; 0: the plan sizes the pool after the search and books the capacity it chose)
    embeddings = held * embedding_bytes(part, ctx, part.out_tokens_per_sample) / L.tp
    cap = ctx.cfg.pool_capacity_mb * 2**20 if ctx.cfg.pool_capacity_mb > 0 else np.inf
    pool = np.minimum(np.broadcast_to(embeddings, act.shape), cap)
    parts = dict(static)
    parts.update({"activations": act, "buffers": pool})
    return Costs(time=time, memory=sum(parts.values()), memory_parts=parts, microbatches=np.ceil(samples),
                 time_parts={"compute": enc["compute"], "tp": enc["tp"], "embed": enc["embed"], "fill": fill,
                             "dp": dp_t, "optimizer": opt_t})


def part_costs(part: PartSpec, ctx: CostContext, L: Layouts) -> Costs:
    return backbone_costs(part, ctx, L) if part.role == "backbone" else encoder_costs(part, ctx, L)


def model_flops_per_step(parts: list[PartSpec], global_batch: int) -> float:
    """FLOPs of the model per step (what MFU counts: no recompute, no padding)."""
    return float(global_batch * sum(p.flops_per_sample for p in parts))
