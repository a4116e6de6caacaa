"""Discrete-event simulation of one training step of a job, as the runtime would run it.

The analytic cost model (cost.py) prices a layout from workload averages; this module replays one real step:
- the step's samples and the runtime's own step plan (`step.plan`: the packing scheduler's microbatches per
  backbone DP rank, the encoder schedule that orders each encoder rank's samples, the producer -> consumer map);
- per encoder rank, each sample's forward (its real images' FLOPs), its `put` into the embedding pool, which
  blocks while the pool holds `capacity` un-consumed samples of that producer, then each sample's backward when
  its gradient returns (recomputing the forward first when activations are not kept);
- per backbone DP replica, the 1F1B (or GPipe) schedule of every pipeline stage: each microbatch's forward and
  backward on each stage (its real token budget and attention lengths, the stage's layers, the LM head on the
  last stage), stage-to-stage sends, and the first stage waiting for its microbatch's embeddings;
- the coupled mode: each rank encodes and trains its own microbatches;
- then each group's gradient all-reduce (a collective: it starts when all members are ready) and the optimizer.
Every rank runs its operations in program order; an operation starts when its rank is free and its
dependencies have finished (plus a link delay). Compute shares the host's cores (processor sharing: with n
busy ranks on c cores each runs at min(1, c / n) speed; with `spinning_waits` every rank counts as busy; on a
host shared with other jobs, `capacity[n]` gives the cores the job gets while n of its ranks compute, and each
runs at min(1, capacity[n] / n)), which is how CPU-emulated clusters behave; on real devices set cores=0 (every
rank owns its device).

The rates are the planner's: seconds per FLOP per part (calibrated by `mindspeed-flow profile`), per-item,
per-microbatch and per-step overheads, link bandwidths from the cluster preset. The result gives the step time,
each rank's busy/idle time, pipeline bubbles, stage imbalance, pool waits, and a timeline PNG.
"""
from __future__ import annotations

import dataclasses as dc
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import numpy as np

from mindspeed_flow.config.load import compose, model_hf_config, to_job_config
from mindspeed_flow.config.packing import PackingConfig
from mindspeed_flow.data.sampler import iter_global_batches
from mindspeed_flow.packing import CostModel
from mindspeed_flow.planner.baselines import with_loader
from mindspeed_flow.planner.cost import (CostContext, _link, dp_sync_time, ep_alltoall_time, optimizer_time,
                                         precision_bytes, ring_allreduce_time, stage_layer_list)
from mindspeed_flow.planner.plan import option_table
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.step.layout import BACKBONE, COUPLED, ENCODER, Layout, PartLayout, bridges_of
from mindspeed_flow.step.plan import plan_decoupled_step, plan_job_step

COMPUTE, COMM = "compute", "comm"


class SimulationDeadlock(RuntimeError):
    """Every rank waits on an op that can never become ready (e.g. pool credits held by blocked consumers)."""


@dataclass
class Op:
    rank: int
    name: str
    kind: str  # "compute" (shares host cores) | "comm"
    work: float  # seconds on an unshared core / link
    deps: list[tuple[int, float]] = field(default_factory=list)  # (op id, delay after its end)
    collective: Optional[str] = None  # ops with the same key start together on all their ranks
    tag: str = ""  # category for the timeline and the summary: enc_fwd, enc_bwd, fwd, bwd, put, sync, optim, ...
    start: float = float("nan")
    end: float = float("nan")


class Simulator:
    """Ranks run their ops in program order; see the module docstring."""

    def __init__(self, world: int, cores: float = 0.0, spinning_waits: bool = False,
                 capacity: Optional[Sequence[float]] = None) -> None:
        self.world, self.cores = world, float(cores)
        self.spinning_waits = spinning_waits
        self.capacity = list(capacity) if capacity else None  # [n] -> cores the job gets with n ranks computing
        self.ops: list[Op] = []
        self.program: list[list[int]] = [[] for _ in range(world)]
        self._done = 0
        # ranks from here on are helper threads (prefetch loaders): they block when idle, even with spinning_waits
        self.lanes_from = world

    def add(self, rank: int, name: str, work: float, kind: str = COMPUTE, deps: Sequence[tuple[int, float]] = (),
            collective: Optional[str] = None, tag: str = "") -> int:
        self.ops.append(Op(rank, name, kind, max(float(work), 0.0), list(deps), collective, tag or name))
        self.program[rank].append(len(self.ops) - 1)
        return len(self.ops) - 1

    def run(self) -> float:
        """Simulate; returns the time the last op ends. Raises if the programs deadlock."""
        ops, pos = self.ops, [0] * self.world
        remaining: dict[int, float] = {}
        members: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            if op.collective:
                members.setdefault(op.collective, []).append(i)
        now, self._done = 0.0, 0
        while self._done < len(ops):
            started = self._start_ready(pos, remaining, members, now)
            if not remaining:
                if started:
                    continue
                wake = self._next_release(pos, now)
                if wake is not None:
                    now = wake
                    continue
                waiting = [ops[self.program[r][pos[r]]].name for r in range(self.world) if pos[r] < len(self.program[r])]
                raise SimulationDeadlock(f"simulation deadlock at t={now:.4g}s; ranks wait at {waiting}")
            n_compute = sum(1 for i in remaining if ops[i].kind == COMPUTE)
            if self.spinning_waits:  # waiting ranks poll and hold their share of the cores too
                n_compute = self.lanes_from + sum(1 for i in remaining if ops[i].kind == COMPUTE
                                                  and ops[i].rank >= self.lanes_from)
            share = min(1.0, self.cores / n_compute) if self.cores > 0 and n_compute else 1.0
            if self.capacity and n_compute:
                share = min(1.0, self.capacity[min(n_compute, len(self.capacity) - 1)] / n_compute)
            rate = {i: (share if ops[i].kind == COMPUTE else 1.0) for i in remaining}
            dt = min(remaining[i] / rate[i] for i in remaining)
            # the next release time of a delayed dependency may come first: advance to it instead
            wake = self._next_release(pos, now)
            if wake is not None and wake - now < dt:
                dt = wake - now
            now += dt
            for i in list(remaining):
                remaining[i] -= rate[i] * dt
                if remaining[i] <= 1e-12:
                    del remaining[i]
                    ops[i].end = now
                    pos[ops[i].rank] += 1
                    self._done += 1
        return max((op.end for op in ops), default=0.0)

    def _ready(self, i: int, now: float) -> bool:
        return all(not np.isnan(self.ops[d].end) and self.ops[d].end + lag <= now + 1e-12
                   for d, lag in self.ops[i].deps)

    def _next_release(self, pos: list[int], now: float) -> Optional[float]:
        times = [self.ops[d].end + lag for r in range(self.world) if pos[r] < len(self.program[r])
                 for d, lag in self.ops[self.program[r][pos[r]]].deps
                 if not np.isnan(self.ops[d].end) and self.ops[d].end + lag > now + 1e-12]
        return min(times) if times else None

    def _start_ready(self, pos: list[int], remaining: dict[int, float], members: dict[str, list[int]],
                     now: float) -> bool:
        started = False
        for r in range(self.world):
            if pos[r] >= len(self.program[r]):
                continue
            i = self.program[r][pos[r]]
            op = self.ops[i]
            if i in remaining or not np.isnan(op.start) or not self._ready(i, now):
                continue
            if op.collective:
                group = members[op.collective]
                heads = all(self.program[self.ops[j].rank][pos[self.ops[j].rank]] == j and self._ready(j, now)
                            for j in group)
                if not heads:
                    continue
                work = max(self.ops[j].work for j in group)
                for j in group:
                    self.ops[j].start, self.ops[j].work = now, work
                    self._begin(j, remaining, pos)
            else:
                op.start = now
                self._begin(i, remaining, pos)
            started = True
        return started

    def _begin(self, i: int, remaining: dict[int, float], pos: list[int]) -> None:
        if self.ops[i].work <= 0:  # zero-length op: done at once
            self.ops[i].end = self.ops[i].start
            pos[self.ops[i].rank] += 1
            self._done += 1
        else:
            remaining[i] = self.ops[i].work


# ----------------------------------------------------------------------------------------------- step programs
@dataclass
class StepCosts:
    """Per-call costs of one job: what the simulator charges (seconds on an unshared core / link).

    One simulated rank stands for a tp x cp group: compute divides over it (at the planner's TP efficiency),
    and each layer adds its TP all-reduces and CP K/V exchange as the cost model prices them."""

    spec: Any  # VLMSpec
    ctx: CostContext
    trainable_encoder: bool = True
    keep_encoder_activations: bool = True
    enc_tp: int = 1
    enc_rc: int = -1  # encoder recompute level (0 keep, 1 from pixels, 2 per layer); -1: from keep_encoder_...
    bb_tp: int = 1
    bb_cp: int = 1
    bb_ep: int = 1  # MoE backbone: expert-parallel size (its all-to-alls per MoE layer, as the cost model prices)
    bb_rc: int = 0
    # On a CPU host a collective's reduction and copies run on the ranks' cores: its time shares them too
    sync_kind: str = COMM

    def spf(self, role: str, group: int = 1) -> float:
        """Seconds per FLOP of the whole tp (x cp) group of one part."""
        tp = self.enc_tp if role == "encoder" else self.bb_tp
        return float(self.ctx.seconds_per_flop(role, np.array([tp]))[0]) / group

    def _allreduce_in_group(self, nbytes: float, n: int) -> float:
        bw, lat = _link(self.ctx, np.array([n]))
        return float(ring_allreduce_time(np.array(nbytes), np.array(n), bw, lat)[0])

    def encoder_fwd_bwd(self, patches_per_image: Sequence[int]) -> tuple[float, float]:
        """(forward, backward) seconds of one sample's images."""
        rc = self.enc_rc if self.enc_rc >= 0 else (0 if self.keep_encoder_activations else 1)
        return self._encoder_cost(patches_per_image, rc)

    def _encoder_cost(self, patches_per_image: Sequence[int], rc: int) -> tuple[float, float]:
        v = self.spec.vision
        flops = float(sum(v.image_flops(int(p), self.trainable_encoder) for p in patches_per_image))
        total = flops * self.spf("encoder", self.enc_tp) + self.ctx.cfg.item_overhead_s * self.ctx.contention
        act = precision_bytes(self.ctx.cfg.dtype).act
        comm = sum(self._allreduce_in_group(p * v.hidden_size * act, self.enc_tp) for p in patches_per_image) \
            * v.depth * (1.0 - self.ctx.overlap("tp")) if self.enc_tp > 1 else 0.0
        if not self.trainable_encoder:
            return total + 2 * comm, 0.0
        fwd = total / 3.0 + 2 * comm
        bwd = total * 2.0 / 3.0 + 2 * comm + rc * fwd
        return fwd, bwd

    def coupled_encoder_fwd_bwd(self, patches_per_image: Sequence[int]) -> tuple[float, float]:
        """(forward, backward) seconds of one sample's images encoded inside a coupled rank's own forward: the
        graph stays in the microbatch's autograd graph (no recompute) and nothing goes through the pool."""
        return self._encoder_cost(patches_per_image, 0)

    def sample_load(self, patches_per_image: Sequence[int]) -> float:
        """Seconds to load one sample's pixels (decode / generate). The planner's FLOP rates fold loading into the
        per-item overhead, so 0 here; measured costs give the real figure, and the simulator charges it where the
        runtime spends it (a prefetch thread beside the rank, or inline in a coupled pipeline's first stage)."""
        return 0.0

    def backbone_stage(self, budget: int, seq_lens: Sequence[int], layers: int, last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one packed microbatch on a stage of `layers` decoder layers."""
        llm = self.spec.llm
        head_tok = 6.0 * llm.vocab_size * llm.hidden_size
        attn_tok2 = llm.attn_flops_per_token_sq(True) / llm.num_layers
        attn = attn_tok2 * (sum(s * s for s in seq_lens) if self.ctx.cfg.flash_attention else budget * budget)
        body = (llm.linear_flops_per_token(True) - head_tok) / llm.num_layers * budget
        group = self.bb_tp * self.bb_cp
        spf = self.spf("backbone", group)
        layer_fwd = (body + attn) / 3.0 * spf
        act = precision_bytes(self.ctx.cfg.dtype).act
        tokens = budget / self.bb_cp
        tp = (self._allreduce_in_group(tokens * llm.hidden_size * act, self.bb_tp) * (1 - self.ctx.overlap("tp"))
              if self.bb_tp > 1 else 0.0)
        # MoE: a dispatch and a combine per MoE layer each way (layers here are the mean layer, as the cost model)
        a2a = float(ep_alltoall_time(self.ctx, np.array([self.bb_ep]), tokens / self.bb_tp, llm.hidden_size,
                                     llm.experts_per_token)[0]) * 2 * llm.moe_layers / llm.num_layers \
            * (1 - self.ctx.overlap("ep"))
        cp = 0.0
        if self.bb_cp > 1:
            bw, lat = _link(self.ctx, np.array([group]))
            kv = tokens * 2 * llm.num_kv_heads * llm.head_dim * act / self.bb_tp
            cp = float(((self.bb_cp - 1) * kv / bw + (self.bb_cp - 1) * lat)[0]) * (1 - self.ctx.overlap("cp"))
        rc = 1 if self.bb_rc else 0
        head = head_tok * budget * spf if last else 0.0
        mb = self.ctx.cfg.microbatch_overhead_s * self.ctx.contention
        fwd = layers * (layer_fwd + 2 * tp + cp + a2a) + head / 3.0 + mb / 3.0
        bwd = layers * (2 * layer_fwd + 2 * tp + 2 * cp + a2a + rc * (layer_fwd + 2 * tp + cp + a2a)) \
            + head * 2.0 / 3.0 + mb * 2.0 / 3.0
        return fwd, bwd

    def link(self, nbytes: float) -> float:
        c = self.ctx.cluster
        return nbytes / c.bandwidth(True) + c.latency(True)

    def allreduce(self, params: float, n: int) -> float:
        """DP gradient sync of `params` (per device of the group) over n replicas, as the cost model prices it."""
        span = np.array([n * self.bb_tp * self.bb_cp])
        return float(dp_sync_time(self.ctx, np.array([params]), np.array([n]), span)[0])

    def optimizer(self, params: float, dp: int = 1) -> float:
        return float(optimizer_time(self.ctx, np.array([params]), np.array([dp]))[0])


def _one_f_one_b(pp: int, s: int, m: int, kind: str) -> list[tuple[str, int]]:
    """Order of ("F"|"B", microbatch) on stage s of pp for m microbatches (torch.distributed.pipelining order)."""
    if kind == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    warm = min(pp - 1 - s, m)
    order = [("F", k) for k in range(warm)]
    f, b = warm, 0
    while f < m:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    order += [("B", k) for k in range(b, m)]
    return order


@dataclass
class StepResult:
    step_seconds: float
    ranks: dict[int, dict[str, float]]  # busy / idle seconds and role per rank
    bubble_fraction: float  # backbone ranks: idle share of the step before their gradient sync
    stage_imbalance: float  # slowest / mean busy time over backbone stages
    pool_wait_s: float  # encoder ranks: time blocked on a full pool (mean)
    ops: list[Op] = field(default_factory=list)
    roles: dict[int, str] = field(default_factory=dict)
    pool_stall: int = 0  # > 0: with this many samples of pool room per producer the step deadlocks

    def summary(self) -> dict[str, float]:
        return {"step_seconds": self.step_seconds, "bubble_fraction": self.bubble_fraction,
                "stage_imbalance": self.stage_imbalance, "pool_wait_s": self.pool_wait_s}


def simulate_step(work: Any, shapes: Sequence[Any], layout: Any, costs: StepCosts, *, pool_capacity: int,
                  pp_schedule: str = "1f1b", layer_split: Optional[Sequence[int]] = None,
                  cores: float = 0.0, step_overhead_s: float = 0.0, spinning_waits: bool = False,
                  vit_on_stage0: bool = False, capacity: Optional[Sequence[float]] = None,
                  prefetch_depth: int = 0, pool_capacity_bytes: float = 0.0,
                  embedding_elem_bytes: float = 4.0) -> StepResult:
    """Simulate one step. `work`: the runtime's StepWork; `layout`: the runtime's topology.Layout;
    `pool_capacity`: samples a producer may have in the pool not yet taken by the backbone; with
    `pool_capacity_bytes` > 0 the pool counts bytes as the runtime's does instead (a put waits until the bytes
    not yet taken plus its own fit, or nothing else is in flight), each sample's embedding its image tokens x
    the ViT's output width x `embedding_elem_bytes`.

    `vit_on_stage0`: the coupled pipeline layout (MindSpeed-MM's) priced on a decoupled layout's step plan: no
    encoder ranks; each first-stage rank encodes its microbatch's images inside that microbatch's forward (and
    backward), and holds the ViT's parameters (the decoupled layout's encoder ranks are left out). A coupled
    layout with pp > 1 (`flow.mode=coupled parallel.coupled.pp=P`) runs the same way on its own step plan.
    `layer_split`: LLM layers per stage (default: the layout's own split, else even).
    `prefetch_depth` > 0: the ranks that load pixels in a background thread (encoder ranks, coupled DP ranks)
    get a loader lane beside them, `costs.sample_load` per sample, at most this many samples ahead; its compute
    shares the host's cores with the ranks'. A coupled pipeline's first stage loads inline, in its forward."""
    by_id = {s.sample_id: s for s in shapes}
    coupled = layout.mode == "coupled"
    pipelined_coupled = coupled and layout.part(COUPLED).pp > 1
    vit0 = vit_on_stage0 or pipelined_coupled
    off = layout.part_ranks(BACKBONE)[0] if vit_on_stage0 and not coupled else 0
    # loader lanes (a prefetch thread per rank that loads pixels ahead of its consumer), numbered after the ranks
    if coupled and not pipelined_coupled:
        loading = list(range(layout.world_size))
    elif not vit0:
        loading = [r for r in layout.part_ranks(ENCODER) if r in work.encode_order]
    else:
        loading = []
    if prefetch_depth <= 0:
        loading = []
    lane_of = {r: layout.world_size + j for j, r in enumerate(loading)}
    sim = _OffsetSimulator(layout.world_size - off + len(lane_of), cores, spinning_waits=spinning_waits,
                           offset=off, capacity=capacity)
    sim.lanes_from = layout.world_size - off
    spec = costs.spec
    roles: dict[int, str] = {}
    start = {r: sim.add(r, "step start", step_overhead_s, tag="overhead") for r in range(off, layout.world_size)}
    takes: dict[int, list[tuple[int, float, int]]] = {r: [] for r in lane_of}  # rank -> [(sample, load s, take op)]
    emb_bytes = lambda sid: (by_id[sid].image_tokens * spec.vision.out_hidden_size  # noqa: E731
                             * spec.vision.embedding_tensors * embedding_elem_bytes)
    if coupled and not pipelined_coupled:
        _coupled_program(sim, work, by_id, layout, costs, roles, start, takes)
    else:
        enc = None if vit0 else layout.part(ENCODER)
        bb = layout.part(COUPLED if coupled else BACKBONE)
        enc_ranks = [] if vit0 else layout.part_ranks(ENCODER)
        bb_base = layout.part_ranks(bb.name)[0]
        n_layers = spec.llm.num_layers
        split = layer_split if layer_split is not None else getattr(bb, "layer_split", None)
        if split is None:
            from mindspeed_flow.hosts.torch.pipeline import split_layers  # lazy: torch

            stage_layers = [b - a for a, b in split_layers(n_layers, bb.pp)]
        else:
            stage_layers = list(split)
        # backbone programs first (ids of first-stage forwards are the encoders' pool-credit dependencies)
        fwd0: dict[int, int] = {}  # sample id -> first-stage forward op that consumes it
        bwd0: dict[int, int] = {}  # sample id -> first-stage backward op that produces its gradient
        put_ops: dict[int, int] = {}
        get_ops: dict[int, int] = {}  # sample id -> the consumer's get, which returns the producer's credit
        enc_fwd_ids: dict[int, int] = {}
        # encoders' forwards and puts are created after the backbone's ops but referenced by them: reserve order
        bb_programs: list[tuple[int, int, list[tuple[str, int]]]] = []
        for d in range(bb.dp):
            row = work.plan.microbatches[d]
            for s in range(bb.pp):
                rank = bb_base + bb.local_rank_of(dp=d, pp=s)
                roles[rank] = f"{'coupled' if coupled else 'backbone'} dp{d} pp{s}"
                bb_programs.append((d, s, _one_f_one_b(bb.pp, s, len(row), pp_schedule)))
        # encoder forwards + puts (deps on pool credits are filled in after the backbone ops exist)
        credit_deps: list[tuple[int, int]] = []  # (put op, sample whose consumption frees the credit)
        for r in enc_ranks:
            if r not in work.encode_order:
                roles[r] = "encoder (tp peer)"
                continue
            roles[r] = f"encoder {enc_ranks.index(r)}"
            order = work.encode_order[r]
            for k, sid in enumerate(order):
                patches = by_id[sid].vit_patches_per_image
                if r in lane_of:  # the sample leaves the prefetch queue: the encoder waits for its pixels
                    takes[r].append((sid, costs.sample_load(patches), sim.add(r, f"take {sid}", 0.0, kind=COMM,
                                                                              tag="take")))
                f, _ = costs.encoder_fwd_bwd(patches)
                enc_fwd_ids[sid] = sim.add(r, f"enc fwd {sid}", f, deps=[(start[r], 0.0)], tag="enc_fwd")
                put_ops[sid] = sim.add(r, f"put {sid}", 0.0, kind=COMM, tag="put")
                if pool_capacity_bytes > 0:
                    # the earliest sample j whose bytes up to this one fit; the put waits for sample j - 1's take
                    j, held = k, emb_bytes(sid)
                    while j > 0 and held + emb_bytes(order[j - 1]) <= pool_capacity_bytes:
                        j -= 1
                        held += emb_bytes(order[j])
                    if j > 0:
                        credit_deps.append((put_ops[sid], order[j - 1]))
                elif k >= pool_capacity:
                    credit_deps.append((put_ops[sid], order[k - pool_capacity]))
        # backbone ops
        ids: dict[tuple[int, int, str, int], int] = {}
        p2p = costs.link(max(work.plan.seq_len or 0, 1) * spec.llm.hidden_size * 4.0) if bb.pp > 1 else 0.0
        for d, s, order in bb_programs:
            rank = bb_base + bb.local_rank_of(dp=d, pp=s)
            row = work.plan.microbatches[d]
            for kind, k in order:
                mb = row[k]
                seqs = [by_id[sid].llm_tokens for sid in mb.sample_ids]
                budget = work.plan.seq_len or max(sum(seqs), 1)
                fwd, bwd = costs.backbone_stage(budget, seqs, stage_layers[s], s == bb.pp - 1)
                if vit0 and s == 0:
                    # the first stage loads the microbatch's pixels and encodes them when the schedule runs its
                    # forward (no prefetch thread), and the ViT's backward is part of the stage's backward
                    imgs = [by_id[sid].vit_patches_per_image for sid in mb.sample_ids if by_id[sid].num_images]
                    enc_cost = [costs.coupled_encoder_fwd_bwd(p) for p in imgs]
                    fwd += sum(c[0] for c in enc_cost) + sum(costs.sample_load(p) for p in imgs)
                    bwd += sum(c[1] for c in enc_cost)
                deps: list[tuple[int, float]] = [(start[rank], 0.0)]
                if kind == "F":
                    if s == 0:
                        # the consumer takes the microbatch's embeddings one by one in their producers' put
                        # order (`StepWork.in_put_order`), each get freeing a pool credit
                        for sid in work.in_put_order([sid for sid in mb.sample_ids if sid in put_ops]):
                            get_ops[sid] = sim.add(rank, f"get {sid}", 0.0, kind=COMM, tag="get",
                                                   deps=[(put_ops[sid], costs.link(emb_bytes(sid)))])
                            deps.append((get_ops[sid], 0.0))
                    ids[(d, s, "F", k)] = sim.add(rank, f"F{k} s{s} d{d}", fwd, deps=deps, tag="fwd")
                    if s == 0:
                        for sid in mb.sample_ids:
                            fwd0[sid] = ids[(d, s, "F", k)]
                else:
                    deps.append((ids[(d, s, "F", k)], 0.0))
                    ids[(d, s, "B", k)] = sim.add(rank, f"B{k} s{s} d{d}", bwd, deps=deps, tag="bwd")
                    if s == 0:
                        for sid in mb.sample_ids:
                            bwd0[sid] = ids[(d, s, "B", k)]
            params = _stage_params(spec, stage_layers, s, bb.pp) / costs.bb_tp
            if vit0 and s == 0:
                params += spec.vision.params / costs.bb_tp
            if bb.dp > 1:
                sim.add(rank, f"dp sync s{s}", costs.allreduce(params, bb.dp), kind=costs.sync_kind,
                        collective=f"bbdp{s}",
                        tag="sync")
            sim.add(rank, "optimizer", costs.optimizer(params, bb.dp), tag="optim")
        for (d, s, kind, k), i in ids.items():  # stage-to-stage sends: activations forward, gradients back
            if kind == "F" and s > 0:
                sim.ops[i].deps.append((ids[(d, s - 1, "F", k)], p2p))
            if kind == "B" and s < bb.pp - 1:
                sim.ops[i].deps.append((ids[(d, s + 1, "B", k)], p2p))
        for put, sid in credit_deps:
            sim.ops[put].deps.append((get_ops[sid], 0.0))
        # encoder backwards in encode order (the runtime waits for each gradient in that order), sync, optimizer
        for r in enc_ranks:
            if r not in work.encode_order:
                continue
            if costs.trainable_encoder:
                for sid in work.encode_order[r]:
                    _, b = costs.encoder_fwd_bwd(by_id[sid].vit_patches_per_image)
                    sim.add(r, f"enc bwd {sid}", b, deps=[(bwd0[sid], costs.link(emb_bytes(sid)))], tag="enc_bwd")
                p_enc = spec.vision.params / costs.enc_tp
                if enc.dp > 1:
                    sim.add(r, "enc dp sync", costs.allreduce(p_enc, enc.dp), kind=costs.sync_kind, collective="encdp",
                            tag="sync")
                sim.add(r, "optimizer", costs.optimizer(p_enc, enc.dp), tag="optim")
    _loader_lanes(sim, lane_of, takes, prefetch_depth, roles, start)
    total = sim.run()
    return _result(sim, total, roles)


def _loader_lanes(sim: Simulator, lane_of: dict[int, int], takes: dict[int, list[tuple[int, float, int]]],
                  depth: int, roles: dict[int, str], start: dict[int, int]) -> None:
    """Each loading rank's prefetch thread (`data.prefetch`): it loads its rank's samples in consumption order,
    holding at most `depth` loaded samples in its queue, so it starts sample i once sample i - 1 is loaded and
    sample i - 1 - depth has been taken; the rank's take of sample i waits for its load."""
    for r, lane in lane_of.items():
        roles[lane] = f"loader of {r}"
        for i, (sid, seconds, take) in enumerate(takes[r]):
            deps = [(start[r], 0.0)] + ([(takes[r][i - 1 - depth][2], 0.0)] if i - 1 - depth >= 0 else [])
            load = sim.add(lane, f"load {sid}", seconds, deps=deps, tag="load")
            sim.ops[take].deps.append((load, 0.0))


class _OffsetSimulator(Simulator):
    """A Simulator whose ranks are numbered from `offset` (the layout's ranks without its encoder part)."""

    def __init__(self, world: int, cores: float, spinning_waits: bool, offset: int,
                 capacity: Optional[Sequence[float]] = None) -> None:
        super().__init__(world, cores, spinning_waits, capacity)
        self.offset = offset

    def add(self, rank: int, *args: Any, **kwargs: Any) -> int:
        i = super().add(rank - self.offset, *args, **kwargs)
        self.ops[i].rank = rank
        return i

    def run(self) -> float:
        for op in self.ops:
            op.rank -= self.offset
        try:
            return super().run()
        finally:
            for op in self.ops:
                op.rank += self.offset


def _stage_params(spec: Any, stage_layers: Sequence[int], s: int, pp: int) -> float:
    llm = spec.llm
    p = stage_layers[s] * llm.layer_params
    if s == 0:
        p += llm.embedding_params
    if s == pp - 1:
        p += llm.head_params + llm.hidden_size
    return float(p)


def _coupled_program(sim: Simulator, work: Any, by_id: dict, layout: Any, costs: StepCosts,
                     roles: dict[int, str], start: dict[int, int],
                     takes: dict[int, list[tuple[int, float, int]]]) -> None:
    """Coupled DP: each rank takes its microbatch's samples from its prefetch queue (a loader lane when `takes`
    has the rank), encodes their images inside the forward, then DP all-reduce and the optimizer."""
    spec = costs.spec
    world = layout.world_size
    params = float(spec.vision.params + spec.llm.total_params)
    for r in range(world):
        roles[r] = f"coupled dp{r}"
        row = work.plan.microbatches[r]
        for k, mb in enumerate(row):
            seqs = [by_id[sid].llm_tokens for sid in mb.sample_ids]
            budget = work.plan.seq_len or max(sum(seqs), 1)
            f, b = costs.backbone_stage(budget, seqs, spec.llm.num_layers, True)
            for sid in mb.sample_ids if r in takes else ():
                takes[r].append((sid, costs.sample_load(by_id[sid].vit_patches_per_image),
                                 sim.add(r, f"take {sid}", 0.0, kind=COMM, tag="take")))
            enc = [costs.coupled_encoder_fwd_bwd(by_id[sid].vit_patches_per_image) for sid in mb.sample_ids
                   if by_id[sid].num_images]
            sim.add(r, f"mb{k} fwd", f + sum(e[0] for e in enc), deps=[(start[r], 0.0)], tag="fwd")
            sim.add(r, f"mb{k} bwd", b + sum(e[1] for e in enc), tag="bwd")
        if world > 1:
            sim.add(r, "dp sync", costs.allreduce(params, world), kind=costs.sync_kind, collective="dp", tag="sync")
        sim.add(r, "optimizer", costs.optimizer(params, world), tag="optim")


def _result(sim: Simulator, total: float, roles: dict[int, str]) -> StepResult:
    off = getattr(sim, "offset", 0)
    ranks: dict[int, dict[str, float]] = {}
    for r in range(off, off + sim.world):
        mine = [sim.ops[i] for i in sim.program[r - off]]
        busy = sum(op.end - op.start for op in mine if op.kind == COMPUTE and op.tag not in ("overhead",))
        # a put starts once the pool has room: the wait is from the end of the op before it
        pool = sum(op.start - prev.end for prev, op in zip(mine, mine[1:]) if op.tag == "put")
        ranks[r] = {"busy_s": busy, "idle_s": total - busy, "pool_wait_s": pool}
    # pipeline stages: a backbone's, or a coupled pipeline's ("coupled dpD ppS"; coupled DP ranks have no stage)
    bb = [r for r, role in roles.items()
          if role.startswith("backbone") or (role.startswith("coupled") and " pp" in role)]
    bubbles, stage_busy = [], []
    for r in bb:
        mine = [sim.ops[i] for i in sim.program[r - off] if sim.ops[i].tag in ("fwd", "bwd")]
        if mine:
            span = max(op.end for op in mine) - min(op.start for op in mine)
            busy = sum(op.end - op.start for op in mine)
            bubbles.append(1.0 - busy / max(span, 1e-12))
            stage_busy.append(busy)
    enc = [r for r, role in roles.items() if role.startswith("encoder ") and "peer" not in role]
    return StepResult(
        step_seconds=total, ranks=ranks,
        bubble_fraction=float(np.mean(bubbles)) if bubbles else 0.0,
        stage_imbalance=float(max(stage_busy) / np.mean(stage_busy)) if stage_busy else 1.0,
        pool_wait_s=float(np.mean([ranks[r]["pool_wait_s"] for r in enc])) if enc else 0.0,
        ops=sim.ops, roles=roles)


_COLORS = {"enc_fwd": "#4c72b0", "enc_bwd": "#8172b2", "fwd": "#55a868", "bwd": "#c44e52", "sync": "#dd8452",
           "optim": "#937860", "put": "#cccccc", "load": "#64b5cd", "overhead": "#eeeeee"}


def write_timeline(result: StepResult, path: str, title: str = "") -> None:
    """PNG: one row per rank, one bar per op, coloured by kind."""
    import matplotlib  # optional: plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: plots
    from matplotlib.patches import Patch  # optional: plots

    ranks = sorted(result.roles)
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(ranks)))
    for y, r in enumerate(ranks):
        for op in result.ops:
            if op.rank == r and op.end > op.start:
                ax.broken_barh([(op.start, op.end - op.start)], (y - 0.4, 0.8),
                               facecolors=_COLORS.get(op.tag, "#999999"), edgecolors="none")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"{r}: {result.roles[r]}" for r in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"simulated step: {result.step_seconds:.3g} s, bubbles {100 * result.bubble_fraction:.0f}%",
                 fontsize=9)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items() if k != "overhead"], fontsize=7,
              ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.5 + 0.45 * len(ranks))), frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legend below the axes stays in the picture
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ a whole job
def simulate_job(job: Any, ctx: CostContext, steps: Sequence[int], cores: float = 0.0,
                 step_overhead_s: Optional[float] = None, spinning_waits: Optional[bool] = None,
                 vit_on_stage0: bool = False, costs: Optional[StepCosts] = None,
                 host_share: Optional[dict[int, Sequence[float]]] = None) -> dict[int, StepResult]:
    """Simulate the given steps of a training job (a FlowJobConfig) with the planner's rates in `ctx`: the same
    global batches (sampler, seed), step plans (`step.plan.plan_job_step`) and layout the runtime uses.

    `spinning_waits` (default: on for CPU clusters): a waiting rank keeps its share of the host cores, as the
    CPU runtime's ranks do (gloo waits, the pool's receiving threads, the pixel prefetcher); measured on 6 CPU
    layouts this predicted the step better than counting only computing ranks (see docs/planner.md).
    `costs`: per-call costs to charge instead of the planner's FLOP rates (e.g. `bench.simulator`'s measured
    ones); `host_share`: per step, the cores the job got with n ranks computing (`Simulator`'s capacity)."""
    from mindspeed_flow.data.build import build_dataset  # lazy: torch
    from mindspeed_flow.data.tokens import token_spec_from_hf_config  # lazy: torch

    hf = model_hf_config(job)
    spec = VLMSpec.from_hf_config(hf)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    bridges = bridges_of(layout)
    dataset = build_dataset(job.data, token_spec_from_hf_config(hf))
    frozen = bool(job.model.freeze_encoder)
    cost_model = CostModel.from_config(job.packing, spec, frozen_encoder=frozen)
    batches = iter_global_batches(dataset, job.trainer.global_batch_size, seed=job.seed,
                                  max_bad=job.data.max_bad_samples)
    costs = costs or StepCosts(spec, ctx, trainable_encoder=not frozen,
                               keep_encoder_activations=bool(job.flow.keep_encoder_activations))
    overhead = ctx.cfg.step_overhead_s if step_overhead_s is None else step_overhead_s
    out: dict[int, StepResult] = {}
    for step in range(max(steps) + 1):
        ids = next(batches)
        if step not in steps:
            continue
        shapes = [dataset.shape(i) for i in ids]
        work = plan_job_step(job, layout, bridges, step, shapes, cost_model)
        emb = (max((s.image_tokens for s in shapes), default=1) * spec.vision.out_hidden_size
               * spec.vision.embedding_tensors * 4.0)
        capacity = max(1, int(job.flow.pool_capacity_mb * 2**20 // max(emb, 1.0)))
        spin = ctx.cluster.config.backend == "cpu" if spinning_waits is None else spinning_waits
        out[step] = simulate_step(work, shapes, layout, costs, pool_capacity=capacity,
                                  pp_schedule=job.parallel.pp_schedule, cores=cores, step_overhead_s=overhead,
                                  spinning_waits=spin, vit_on_stage0=vit_on_stage0,
                                  capacity=(host_share or {}).get(step), prefetch_depth=job.data.prefetch_depth)
    return out


# ------------------------------------------------------------------------------------------- planner top-k
def simulate_layout(problem: Any, enc_row: dict, bb_row: dict, cores: float = 0.0,
                    scheduler: str = "flow", stream: Optional[Sequence[Any]] = None,
                    pool_capacity_mb: float = 0.0) -> StepResult:
    """Simulate one step of a planned layout: the problem's workload shapes as one global batch (cycled; or
    `stream`, the step's samples), packed by the runtime's step planner; each simulated rank is one tp x cp
    group. `pool_capacity_mb` > 0: the pool counts bytes with that capacity (else planner.pool_capacity_mb in
    samples of the mean embedding, the older replay)."""
    if problem.spec is None or not problem.shapes:
        raise ValueError("the problem carries no model spec / workload shapes (build it with inputs.build_problem)")
    spec, ctx = problem.spec, problem.ctx
    g = problem.global_batch
    shapes = list(stream) if stream is not None else [
        dc.replace(problem.shapes[i % len(problem.shapes)], sample_id=i) for i in range(g)]
    layout = Layout((PartLayout(ENCODER, dp=int(enc_row["dp"])),
                     PartLayout(BACKBONE, dp=int(bb_row["dp"]), pp=int(bb_row["pp"]))), "decoupled")
    frozen = bool(problem.cfg.freeze_encoder)
    cost_model = CostModel.from_config(PackingConfig(), spec, frozen_encoder=frozen)
    work = plan_decoupled_step(0, shapes, bridges=bridges_of(layout), token_budget=int(bb_row["b"]),
                               cost_model=cost_model, scheduler=scheduler, min_microbatches=int(bb_row["pp"]),
                               oversize_policy="error")
    costs = StepCosts(spec, ctx, trainable_encoder=not frozen, enc_tp=int(enc_row["tp"]), enc_rc=int(enc_row["rc"]),
                      bb_tp=int(bb_row["tp"]), bb_cp=int(bb_row["cp"]), bb_ep=int(bb_row.get("ep", 1)),
                      bb_rc=int(bb_row["rc"]))
    act = precision_bytes(ctx.cfg.dtype).act
    emb = np.mean([s.image_tokens for s in shapes]) * spec.vision.out_hidden_size * spec.vision.embedding_tensors * act
    capacity = max(1, int((problem.cfg.pool_capacity_mb or 64.0) * 2**20 // max(emb, 1.0)))
    split = bb_row.get("layers") or None
    run = lambda cap: simulate_step(  # noqa: E731
        work, shapes, layout, costs, pool_capacity=cap, pp_schedule=problem.cfg.pp_schedule, layer_split=split,
        cores=cores, step_overhead_s=ctx.cfg.step_overhead_s, embedding_elem_bytes=act,
        pool_capacity_bytes=pool_capacity_mb * 2**20 if cap < g else 0.0)
    try:
        return run(capacity)
    except SimulationDeadlock:
        # producers wait for credits that only consumers blocked on other producers can return: the runtime
        # would stall the same way; report it and price the plan as if the pool had room
        res = run(g)
        res.pool_stall = capacity
        return res


def top_k_layouts(problem: Any, k: int) -> list[dict]:
    """The k best (encoder, backbone) pairs by the analytic model: the k fastest distinct backbone layouts that
    leave room for an encoder, each with the fewest-device encoder that keeps pace (else the fastest that fits)."""
    enc_p = next(p for p in problem.parts if p.role == "encoder")
    bb_p = next(p for p in problem.parts if p.role == "backbone")
    te, tb = option_table(enc_p, problem, problem.budget), option_table(bb_p, problem, problem.budget)
    ue, ub = te.usable(problem.budget), tb.usable(problem.budget)
    out: list[dict] = []
    for j in ub[np.argsort(tb.costs.time[ub], kind="stable")]:
        room = problem.budget - int(tb.layouts.devices[j])
        cand = ue[te.layouts.devices[ue] <= room]
        if len(cand) == 0:
            continue
        t_b = float(tb.costs.time[j])
        pace = cand[te.costs.time[cand] <= t_b]
        i = int(pace[np.lexsort((te.costs.time[pace], te.layouts.devices[pace]))[0]]) if len(pace) else \
            int(cand[np.argmin(te.costs.time[cand])])
        bb_row = tb.layouts.row(int(j))
        if bb_row["pp"] > 1:
            bb_row["layers"] = stage_layer_list(tb.costs.stage_layers, bb_row["pp"], int(j))
        out.append({"encoder": te.layouts.row(i), "backbone": bb_row,
                    "devices": int(te.layouts.devices[i] + tb.layouts.devices[j]),
                    "analytic_s": max(float(te.costs.time[i]), t_b)})
        if len(out) == k:
            break
    return out


def rank_by_simulation(problem: Any, k: int, cores: float = 0.0) -> list[dict]:
    """Top-k layouts by the analytic model, each simulated; returned fastest-simulated first."""
    rows = top_k_layouts(problem, k)
    for r in rows:
        res = simulate_layout(problem, r["encoder"], r["backbone"], cores)
        r.update(simulated_s=res.step_seconds, bubble_fraction=res.bubble_fraction,
                 stage_imbalance=res.stage_imbalance, pool_wait_s=res.pool_wait_s, pool_stall=res.pool_stall,
                 result=res)
    return sorted(rows, key=lambda r: r["simulated_s"])


def two_rank_ranking(ctx: CostContext, overrides: Sequence[str] = (), steps: Sequence[int] = (1, 2, 3),
                     cores: float = 2.0) -> dict[str, float]:
    """Simulated mean step seconds of the three 2-rank layouts of one recipe: coupled DP2, coupled PP2 with the
    ViT on stage 0 (MindSpeed-MM's pipeline layout), decoupled 1 encoder + 1 backbone; fastest first."""
    jobs = {
        "coupled_dp2": (["parallel=enc1_bb_dp2", "parallel.backbone.dp=1", "flow.mode=coupled"], False),
        # the runtime's coupled pipeline on the same 2 ranks (its own step plan; the ViT on stage 0)
        "coupled_pp2_vit_stage0": (["parallel=enc1_bb_dp2", "parallel.backbone.dp=1", "flow.mode=coupled",
                                    "parallel.coupled.pp=2"], False),
        "decoupled_1+1": (["parallel=enc1_bb_dp2", "parallel.backbone.dp=1"], False),
    }
    out = {}
    for name, (extra, vit0) in jobs.items():
        job = to_job_config(compose([*overrides, *extra]))
        res = simulate_job(job, ctx, list(steps), cores=cores, vit_on_stage0=vit0)
        out[name] = float(np.mean([r.step_seconds for r in res.values()]))
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


# ------------------------------------------------------------------------------- the plan and its baselines
def simulate_coupled_baseline(problem: Any, b: Any, stream: Sequence[Any], cores: float = 0.0) -> StepResult:
    """Replay a coupled baseline (`baselines.LOADERS`: one sample per microbatch; padded to the sequence length
    for `pad`) on the step's stream: DP rank d takes the d-th contiguous slice of the global batch, stage 0
    encodes each microbatch's images inside its forward, 1F1B over the baseline's stage split."""
    row = b.layout["coupled"]
    dp, pp = int(row["dp"]), int(row["pp"])
    bb = next(p for p in problem.parts if p.role == "backbone")
    loader = with_loader(problem.baseline_ctx, b.loader or "sample", bb, None).loader
    per = len(stream) // dp
    rows = [[SimpleNamespace(sample_ids=[s.sample_id]) for s in stream[d * per:(d + 1) * per]] for d in range(dp)]
    work = SimpleNamespace(plan=SimpleNamespace(microbatches=rows, seq_len=loader.seq_len if loader.kind == "pad"
                                                else 0),
                           encode_order={}, in_put_order=lambda ids: list(ids))
    layout = Layout((PartLayout(COUPLED, dp=dp, pp=pp),), "coupled")
    costs = StepCosts(problem.spec, problem.baseline_ctx, trainable_encoder=not problem.cfg.freeze_encoder,
                      enc_tp=int(row.get("vit_tp", row["tp"])), bb_tp=int(row["tp"]), bb_cp=int(row["cp"]),
                      bb_ep=int(row.get("ep", 1)), bb_rc=int(row["rc"]))
    return simulate_step(work, stream, layout, costs, pool_capacity=len(stream), pp_schedule=problem.cfg.pp_schedule,
                         layer_split=row.get("layers") or None, cores=cores,
                         step_overhead_s=problem.cfg.step_overhead_s)


def replay_plan(plan: Any, cores: float = 0.0) -> list[dict]:
    """`plan --simulate`: the chosen decoupled plan and each baseline replayed on the same sample stream
    (`Problem.stream`: one draw of G samples, so microbatches vary as the workload's lengths do), each row with
    the analytic step time beside the simulated one and the error. Baselines the simulator has no program for
    (dist-train's blocking ViT stage) say so instead of a number."""
    problem = plan.problem
    stream = problem.stream()
    by = {p.role: p for p in plan.parts}
    out: list[dict] = []
    enc, bb = by.get("encoder"), by.get("backbone")
    if enc is not None and bb is not None:
        row = dict(bb.layout, layers=bb.stage_layers or None)
        res = simulate_layout(problem, enc.layout, row, cores, stream=stream,
                              pool_capacity_mb=plan.pool.capacity_mb if plan.pool else 0.0)
        out.append({"name": "decoupled", "analytic_s": plan.step_seconds, "simulated_s": res.step_seconds,
                    "bubble_fraction": res.bubble_fraction, "pool_wait_s": res.pool_wait_s, "result": res})
    for name, b in plan.baselines.items():
        if b is None:
            continue
        entry: dict = {"name": name, "analytic_s": b.step_seconds}
        if "coupled" in b.layout:
            res = simulate_coupled_baseline(problem, b, stream, cores)
            entry.update(simulated_s=res.step_seconds, bubble_fraction=res.bubble_fraction, pool_wait_s=0.0,
                         result=res)
        else:
            entry.update(simulated_s=None, why_not="no simulator program for dist-train's blocking ViT stage")
        out.append(entry)
    for r in out:
        r["error"] = None if r.get("simulated_s") is None else r["simulated_s"] / r["analytic_s"] - 1.0
    return out
