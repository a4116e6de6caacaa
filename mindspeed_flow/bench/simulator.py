"""`mindspeed-flow bench simulator`: the step simulator and the analytic model against measured CPU steps.

    mindspeed-flow bench simulator [--layouts coupled-dp1,coupled-dp2,coupled-pp2,coupled-pp2-split13,
        decoupled-1+1,decoupled-1+1-frozen] [--experiment heavy_encoder_2rank] [--global-batch 16] [--steps 8]
        [--warmup 2] [--rounds 3] [--max-load 1.5 --max-wait 30] [--quiet 0.25] [--repeats 3] [--timelines DIR]
        [--probe] [--json]

The headline layouts never put more ranks on the host than it has physical cores: coupled DP1 (one rank),
coupled DP2, coupled PP2 with the ViT on stage 0 (even split, and the [1, 3] split that lightens the ViT's
stage), decoupled 1 encoder + 1 backbone rank (also with a frozen encoder: `decoupled-1+1-frozen`), all on
`experiment=heavy_encoder_2rank` (a 6-layer ViT on images of up to 1024 patches beside a 4-layer LLM: compute,
not Python, sets the step). The older 3-4 rank layouts (`eA-bB[pP][@T]`, planner-written recipes) still run with
--oversubscribed, but are not in the headline: with more ranks than cores the step time is mostly the OS
scheduler's (which rank runs when, time slices, wake-up preferences), which the simulator does not model.

In one run:
1. `mindspeed-flow profile` measures the analytic model's calibration table (one thread, as a rank runs);
2. every layout trains --steps steps with `mindspeed-flow train` (a subprocess, as a user runs it), in
   --rounds interleaved rounds (each round runs every layout once, so load from other jobs hits all alike;
   --max-load waits for a quiet host before each run);
3. per layout, this process measures the job's own primitives, one thread, process CPU time (the median of
   --repeats), at the shapes the measured steps used: each sample's pixel loading (what the prefetch thread
   spends), its images' encoder forward and backward (the runtime's `encode_samples`), each packed
   microbatch's text loading + packing + embedding, one decoder layer, and LM head + loss, forward and
   backward apart; AdamW + clipping per parameter; the step planner; for decoupled jobs the pool's CPU per
   embedding on two gloo ranks; gloo all-reduce bandwidth and latency (once, by the profile); and how much
   slower the encoder's forward + backward runs with every core computing a copy at once (forked processes,
   CPU time: the host's shared caches and memory);
4. the simulator replays each measured step: the runtime's own step plan; per rank, what the engine does
   (coupled DP: the prefetch thread loads pixels beside the rank, the rank encodes inside its forward, DDP
   all-reduce, optimizer; coupled pipeline: 1F1B over the layout's own layer split, stage 0 loading and
   encoding each microbatch's images inside that microbatch's forward; decoupled: the encoder's prefetch
   thread, encode, put with pool credits, gradients back, encoder backward); compute shares the host's
   physical cores (processor sharing, each computing thread slower by the measured concurrency factor);
   waiting ranks block and use no core;
5. the analytic model prices the same layout (the planner pinned to it; the coupled baseline's own model for
   coupled layouts), calibrated by the profile of step 1.
Measured is, per step, the median over the rounds in which the host was quiet during that step (other jobs'
runnable threads, scanned every 0.1 s, at most --quiet on average: a step that shared the cores with another
job measures that job too), then the median over the steps after --warmup; simulated the median of the same
steps' replays. No figure is fitted to a step time: every input is a primitive's
measurement. As a check that no prediction uses, the table also gives the CPU seconds per step the job's
processes really used beside the compute the simulator charged. --probe adds the older replay on the share of
a core a probe process read (`HostProbe`), for comparison on loaded hosts.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.bench import bench_main
from mindspeed_flow.config import load as config_load
from mindspeed_flow.config.load import compose, model_hf_config, to_job_config
from mindspeed_flow.data.build import build_dataset
from mindspeed_flow.data.sampler import iter_global_batches
from mindspeed_flow.data.tokens import token_spec_from_hf_config
from mindspeed_flow.hosts.torch.build import build_vlm
from mindspeed_flow.hosts.torch.engine import encode_samples
from mindspeed_flow.hosts.torch.optim import build_optimizer
from mindspeed_flow.hosts.torch.split import split_vlm, token_loss_sum
from mindspeed_flow.packing import CostModel
from mindspeed_flow.planner.baselines import megatron_coupled
from mindspeed_flow.planner.hardware import recipes_dir
from mindspeed_flow.planner.inputs import build_problem, data_recipe_fields, parse_kv
from mindspeed_flow.planner.plan import make_plan
from mindspeed_flow.planner.profile import measure as profile_measure
from mindspeed_flow.planner.profile import write_outputs
from mindspeed_flow.planner.report import recipe_yaml
from mindspeed_flow.planner.simulate import StepCosts, simulate_job, write_timeline
from mindspeed_flow.planner.validate import _LAYOUT, parse_layout, plan_layout
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.step.layout import BACKBONE, COUPLED, ENCODER, Layout, bridges_of
from mindspeed_flow.step.plan import plan_job_step
from mindspeed_flow.utils.multiproc import run_ranks

# The headline layouts: at most one rank per physical core of a 2-core host, as overrides on --experiment
# (heavy_encoder_2rank: a 6-layer ViT on images of up to 1024 patches beside a 4-layer LLM, 1 + 1 ranks).
HEADLINE_LAYOUTS: dict[str, tuple[str, ...]] = {
    "coupled-dp1": ("flow.mode=coupled", "parallel.world_size=1"),
    "coupled-dp2": ("flow.mode=coupled",),
    "coupled-pp2": ("flow.mode=coupled", "parallel.coupled.pp=2"),
    "coupled-pp2-split13": ("flow.mode=coupled", "parallel.coupled.pp=2", "parallel.coupled.layer_split=[1,3]"),
    "decoupled-1+1": ("flow.mode=decoupled",),
    "decoupled-1+1-frozen": ("flow.mode=decoupled", "model.freeze_encoder=true"),
}
DEFAULT_LAYOUTS = ",".join(HEADLINE_LAYOUTS)
# 3-4 ranks on a 2-core host: measured only with --oversubscribed (the OS scheduler then sets the step time)
OVERSUBSCRIBED_LAYOUTS = "e1-b1,e1-b2,e2-b1,e1-b1p2,e2-b1p2"


# ------------------------------------------------------------------------------------------------ host load
def _probe_loop(conn: Any, interval_s: float, burst_s: float, size: int) -> None:
    """In a session of its own (with the kernel's autogroup, a scheduling group apart from the job's): every
    `interval_s`, fixed float32 matmuls (size x size, one thread) for `burst_s` of wall time, recording its wall
    and CPU seconds and the matmuls done; send [(time, wall, cpu, matmuls)] when told to stop."""
    os.setsid()
    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    out: list[tuple[float, float, float, int]] = []
    groups: list[tuple[float, dict[str, int]]] = []
    names: dict[str, str] = {}
    while not conn.poll(interval_s):
        t0, c0, n = time.perf_counter(), time.thread_time(), 0
        while time.perf_counter() - t0 < burst_s:
            torch.mm(a, b)
            n += 1
        out.append((t0, time.perf_counter() - t0, time.thread_time() - c0, n))
        groups.append((time.perf_counter(), runnable_by_group(names)))
    conn.send((out, groups))


def sched_group(pid: str, cache: dict[str, str]) -> str:
    """The scheduling group of a process: its session's autogroup when the kernel has autogroup on (each
    session then shares the CPU as one), else the process itself."""
    if pid not in cache:
        try:
            cache[pid] = Path(f"/proc/{pid}/autogroup").read_text().split()[0]
        except (OSError, IndexError):
            cache[pid] = pid
    return cache[pid]


def _runnable_count(pid: str, tids: list[str], me: str) -> int:
    """How many of process `pid`'s threads `tids` are runnable now (state R in /proc), thread `me` left out."""
    n = 0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                text = f.read()
        except OSError:
            continue
        k = text.rfind(b")")  # the command name may hold spaces and parentheses: the state follows the last ')'
        n += text[k + 2:k + 3] == b"R"
    return n


def runnable_by_group(cache: dict[str, str]) -> dict[str, int]:
    """Runnable threads on the host per scheduling group, the calling thread left out."""
    me = str(threading.get_native_id())
    out: dict[str, int] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        n = _runnable_count(pid, tids, me)
        if n:
            g = sched_group(pid, cache)
            out[g] = out.get(g, 0) + n
    return out


def fair_share(cores: float, demands: Sequence[float]) -> list[float]:
    """Cores each group gets when groups of `demands` runnable threads share `cores` fairly (max-min: no group
    gets more than it can run; the rest is split evenly among the others)."""
    left, out = float(cores), [0.0] * len(demands)
    todo = sorted(range(len(demands)), key=lambda i: demands[i])
    while todo:
        level = left / len(todo)
        if demands[todo[0]] <= level:
            i = todo.pop(0)
            out[i] = float(demands[i])
            left -= out[i]
        else:
            for j in todo:
                out[j] = level
            break
    return out


class HostProbe:
    """A reference kernel run in bursts (by default 2 ms every 20 ms, a tenth of a core) all along a run, from
    before the job starts until its primitives are measured. Two readings per window: the share of a core it
    got (CPU / wall seconds: what a rank that alternates compute and waits gets from a host other jobs share;
    1.0 = a core of its own), and its CPU seconds per matmul, whose ratio between a step and the primitives'
    measurement says how much slower the same work was then (other jobs' cache and memory traffic, a virtual
    CPU's stolen time). The share read depends on the burst length (the kernel's scheduler favours short
    wake-ups): see --probe-burst-ms."""

    def __init__(self, interval_s: float = 0.02, burst_s: float = 0.002, size: int = 192) -> None:
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_probe_loop, args=(child, interval_s, burst_s, size), daemon=True)
        self._proc.start()
        self.samples: list[tuple[float, float, float, int]] = []
        self.groups: list[tuple[float, dict[str, int]]] = []  # (time, runnable threads per scheduling group)

    def stop(self) -> None:
        self._conn.send("stop")
        self.samples, self.groups = self._conn.recv()
        self._proc.join(timeout=5)

    def _in(self, lo: float, hi: float) -> list[tuple[float, float, float, int]]:
        return [x for x in self.samples if lo <= x[0] <= hi and x[1] > 0 and x[3] > 0]

    def share(self, lo: float, hi: float) -> float:
        """Share of a core the bursts started in [lo, hi] got (CPU over wall seconds, summed)."""
        xs = self._in(lo, hi)
        return min(1.0, sum(c for _, _, c, _ in xs) / sum(w for _, w, _, _ in xs)) if xs else float("nan")

    def group_capacity(self, lo: float, hi: float, job_group: str, world: int, cores: float) -> list[float]:
        """[n] -> cores the job's group gets with n ranks computing, shared fairly with the other groups that
        had runnable threads (`fair_share`), averaged over the scans in [lo, hi]."""
        scans = [g for t, g in self.groups if lo <= t <= hi]
        if not scans:
            return [0.0] + [min(float(n), cores) for n in range(1, world + 1)]
        cap = [0.0] * (world + 1)
        for g in scans:
            others = [float(v) for k, v in g.items() if k != job_group]
            for n in range(1, world + 1):
                cap[n] += fair_share(cores, [float(n)] + others)[0] / len(scans)
        return cap

    def cpu_cost(self, lo: float, hi: float) -> float:
        """CPU seconds per matmul in the bursts started in [lo, hi]."""
        xs = self._in(lo, hi)
        return sum(c for _, _, c, _ in xs) / sum(n for _, _, _, n in xs) if xs else float("nan")


def runnable_outside(sessions: set[int], cache: dict[str, int]) -> int:
    """Runnable threads on the host outside the given sessions (other jobs' demand for the cores), the calling
    thread left out. `cache`: pid -> session id."""
    me = str(threading.get_native_id())
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
            if pid not in cache:
                cache[pid] = os.getsid(int(pid))
        except OSError:
            continue
        if cache[pid] not in sessions:
            n += _runnable_count(pid, tids, me)
    return n


class StepWatch(threading.Thread):
    """Notes when the job's metrics file gains a line (a step's end), every `scan_every` polls how many threads
    of other jobs are runnable (the host's load outside this job and this bench: a step that overlapped other
    jobs' compute did not have the cores to itself), and, as a check that no prediction uses, the CPU seconds
    the job's processes have used so far."""

    def __init__(self, root: int, metrics: Path, interval_s: float = 0.01, scan_every: int = 10) -> None:
        super().__init__(daemon=True)
        self.root, self.metrics, self.interval_s, self.scan_every = root, metrics, interval_s, scan_every
        self.step_ends: list[float] = []
        self.job_cpu: list[float] = []  # job CPU seconds at each step end
        self.job_group = ""  # the job's scheduling group (read once it runs)
        self.others: list[tuple[float, int]] = []  # (time, runnable threads outside the job and the bench)
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def _job_cpu_seconds(self) -> float:
        try:
            import psutil  # optional: psutil
        except ImportError:  # a check only (no prediction reads it): without psutil the column reads nan
            return float("nan")
        try:
            return float(sum(sum(p.cpu_times()[:2]) for p in psutil.Process(self.root).children(recursive=True)))
        except psutil.Error:
            return float("nan")

    def run(self) -> None:
        lines, polls, cache = 0, 0, {}
        try:
            sessions = {os.getsid(0), os.getsid(self.root)}
        except OSError:
            sessions = {os.getsid(0)}
        while not self._stop_event.is_set():
            if self.scan_every and polls % self.scan_every == 0:
                self.others.append((time.perf_counter(), runnable_outside(sessions, cache)))
            polls += 1
            try:
                n = self.metrics.read_bytes().count(b"\n") if self.metrics.exists() else 0
            except OSError:
                n = lines
            if n > lines:
                if not self.job_group:
                    self.job_group = sched_group(str(self.root), {})
                now, cpu = time.perf_counter(), self._job_cpu_seconds()
                self.step_ends += [now] * (n - lines)
                self.job_cpu += [cpu] * (n - lines)
                lines = n
            self._stop_event.wait(self.interval_s)

    def others_in(self, step: int) -> float:
        """Mean runnable threads of other jobs over `step`'s window (nan if no scan fell in it)."""
        lo, hi = self.window(step)
        xs = [n for t, n in self.others if lo <= t <= hi]
        return sum(xs) / len(xs) if xs else float("nan")

    def window(self, step: int) -> tuple[float, float]:
        """(start, end) of `step`: from the previous step's end to its own."""
        return self.step_ends[step - 1], self.step_ends[step]

    def job_cpu_per_step(self, steps: Sequence[int]) -> float:
        """CPU seconds the job's ranks used per step over consecutive `steps` (what the simulator's compute
        charges should add up to)."""
        return (self.job_cpu[steps[-1]] - self.job_cpu[steps[0] - 1]) / len(steps)


def host_capacity(share: float, world: int, cores: float, slowdown: float = 1.0) -> list[float]:
    """[n] -> cores (in cores of the primitives' measurement) the job gets while n of its ranks compute:
    min(n, cores) cores at `share` of each, each `slowdown` times slower than when the primitives were timed."""
    return [0.0] + [min(float(n), cores) * share / slowdown for n in range(1, world + 1)]


# ------------------------------------------------------------------------------------------- pool primitive
def _pool_cpu_rank(rank: int, world: int, items: int, nbytes: int, with_grads: bool, repeats: int) -> float:
    """Process CPU seconds per item of the pool on this side (pool and gloo threads included): the producer
    puts `items` embeddings (and waits for their gradients), the consumer gets them (and returns gradients)."""
    pool = EmbeddingPool(rank=rank, group=None, capacity_bytes=max(64 * nbytes * items, 1 << 26), timeout_s=60.0,
                         device=torch.device("cpu"), return_grads=with_grads)
    tensor = torch.randn(max(nbytes // 4, 1))
    times: list[float] = []
    for step in range(repeats + 1):  # the first round sets up connections and buffers
        if rank == 1:
            pool.expect(producer=0, items=[(i, step) for i in range(items)])
        dist.barrier()
        c0 = time.process_time()
        if rank == 0:
            for i in range(items):
                pool.put(tensor, sample_id=i, step=step, consumer=1)
            for i in range(items) if with_grads else ():
                pool.wait_grad(sample_id=i, step=step, consumer=1)
        else:
            for i in range(items):
                emb = pool.get(sample_id=i, step=step, producer=0)
                if with_grads:
                    pool.return_grad(emb, sample_id=i, step=step, producer=0)
        pool.flush()
        if step:
            times.append(time.process_time() - c0)
        dist.barrier()
    pool.close()
    return statistics.median(times) / items


def pool_cpu_per_item(nbytes: int, with_grads: bool, items: int = 24, repeats: int = 3) -> tuple[float, float]:
    """(producer, consumer) CPU seconds per embedding of `nbytes` through the pool between two gloo ranks."""
    prod, cons = run_ranks(_pool_cpu_rank, 2, items, int(nbytes), with_grads, repeats, timeout_s=120.0)
    return prod, cons


# --------------------------------------------------------------------------------------- measured primitives
def _cpu_time(fn: Any, repeats: int) -> tuple[float, Any]:
    """(median process CPU seconds of fn() over `repeats`, the last result); torch runs one thread here.
    The median, not the fastest: the job's ranks pay the caches other jobs on the host disturb too."""
    times, out = [], None
    for _ in range(repeats):
        c0 = time.process_time()
        out = fn()
        times.append(time.process_time() - c0)
    return statistics.median(times), out


def _make_measured_costs() -> type:
    class MeasuredCosts(StepCosts):
        """StepCosts whose per-call figures are measured on this machine at the exact call shapes (see the
        module docstring), on demand and cached: the simulator asks, the real model answers."""

        def __init__(self, job: Any, ctx: Any, link: dict[str, float], repeats: int = 3) -> None:
            hf = model_hf_config(job)
            frozen = bool(job.model.freeze_encoder)
            super().__init__(VLMSpec.from_hf_config(hf), ctx, trainable_encoder=not frozen,
                             keep_encoder_activations=bool(job.flow.keep_encoder_activations))
            torch.set_num_threads(int(os.environ.get("MSF_THREADS_PER_RANK", "1")))  # as a rank runs
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[job.model.dtype]
            model = build_vlm(hf["model_type"], hf, seed=job.seed, dtype=dtype)
            self.encoder, self.backbone = split_vlm(model)
            self.dataset = build_dataset(job.data, token_spec_from_hf_config(hf))
            self.repeats, self.link_fit = repeats, link
            self.by_patches: dict[tuple[int, ...], int] = {}
            self.by_tokens: dict[int, int] = {}
            self._enc: dict[tuple[int, ...], tuple[float, float]] = {}
            self._bb: dict[tuple, tuple[float, ...]] = {}
            self._opt_per_param: Optional[float] = None
            self.sync_kind = "compute"  # gloo on this host reduces and copies on the ranks' own cores
            self.pool_item = (0.0, 0.0)  # (producer, consumer) CPU seconds per embedding through the pool

        def register(self, sample_ids: Sequence[int], with_pool: bool = True) -> None:
            """Samples whose shapes the simulator will ask about (the measured steps' samples); with_pool (a
            decoupled job) measures the pool's cost per item at their median embedding size."""
            tokens = sorted(self.dataset.shape(sid).image_tokens for sid in sample_ids)
            nbytes = tokens[len(tokens) // 2] * self.spec.vision.out_hidden_size * 4
            if with_pool:
                self.pool_item = pool_cpu_per_item(nbytes, self.trainable_encoder, repeats=self.repeats)
            for sid in sample_ids:
                shape = self.dataset.shape(sid)
                self.by_patches.setdefault(tuple(shape.vit_patches_per_image), sid)
                self.by_tokens.setdefault(shape.llm_tokens, sid)

        # -- encoder: one sample's pixels (generated as the prefetch thread does), its images' forward and backward
        def _encoder(self, patches_per_image: Sequence[int]) -> tuple[float, float, float]:
            key = tuple(int(p) for p in patches_per_image)
            if key not in self._enc:
                self._enc[key] = self._measure_encoder(self.by_patches[key])
            return self._enc[key]

        def sample_load(self, patches_per_image: Sequence[int]) -> float:
            return self._encoder(patches_per_image)[0]

        def encoder_fwd_bwd(self, patches_per_image: Sequence[int]) -> tuple[float, float]:
            _, f, b = self._encoder(patches_per_image)
            f += self.pool_item[0]  # its put (and, when trained, the wait for its gradient)
            if not self.trainable_encoder:
                return f, 0.0
            return f, b + (0.0 if self.keep_encoder_activations else f)  # recompute: the forward again

        def coupled_encoder_fwd_bwd(self, patches_per_image: Sequence[int]) -> tuple[float, float]:
            _, f, b = self._encoder(patches_per_image)  # inside the rank's own graph: no pool, no recompute
            return f, b if self.trainable_encoder else 0.0

        def _measure_encoder(self, sid: int) -> tuple[float, float, float]:
            """(pixel loading, forward, backward) CPU seconds of one sample, as the runtime's ranks run them."""
            load, sample = _cpu_time(lambda: self.dataset.sample(sid, with_pixels=True), self.repeats)
            if not sample.image_token_counts:
                return load, 0.0, 0.0
            trainable = self.trainable_encoder
            fwds, bwds = [], [0.0]
            for _ in range(self.repeats):
                c0 = time.process_time()
                embs = encode_samples(self.encoder, [sample], trainable)
                fwds.append(time.process_time() - c0)
                if trainable:
                    grads = [torch.ones_like(e) for e in embs]
                    c0 = time.process_time()
                    torch.autograd.backward(embs, grads)
                    bwds.append(time.process_time() - c0)
            self.encoder.zero_grad(set_to_none=True)
            return load, statistics.median(fwds), statistics.median(bwds[1:] or bwds)

        # -- the host: how much slower the job's compute runs when several ranks compute at once
        def concurrency_slowdown(self, cores: int, calls: int = 6) -> list[float]:
            """[n] -> CPU seconds per call of the encoder's forward + backward on the job's median sample with
            n copies running at once in forked processes, over its CPU seconds alone (n = 1..cores; [0] unused).
            CPU time, not wall: it reads what sharing the caches and memory of the host costs, not which share
            of a core other jobs leave (the runs wait for a quiet host for that)."""
            keys = sorted(k for k in self.by_patches if k)
            sid = self.by_patches[keys[len(keys) // 2]] if keys else next(iter(self.by_patches.values()))
            sample = self.dataset.sample(sid, with_pixels=True)

            def per_call() -> float:
                out = []
                for _ in range(calls):
                    c0 = time.process_time()
                    embs = encode_samples(self.encoder, [sample], True)
                    torch.autograd.backward(embs, [torch.ones_like(e) for e in embs])
                    out.append(time.process_time() - c0)
                self.encoder.zero_grad(set_to_none=True)
                return statistics.median(out)

            def child(conn: Any) -> None:
                conn.send(per_call())

            alone = per_call()
            out = [1.0, 1.0]
            ctx = mp.get_context("fork")
            for n in range(2, cores + 1):
                pipes = [ctx.Pipe() for _ in range(n)]
                procs = [ctx.Process(target=child, args=(w,), daemon=True) for _, w in pipes]
                for proc in procs:
                    proc.start()
                times = [r.recv() for r, _ in pipes]
                for proc in procs:
                    proc.join(timeout=10)
                out.append(max(1.0, statistics.median(times) / alone))
            return out

        # -- backbone: text loading + packing + embedding, one decoder layer, LM head + loss
        def backbone_stage(self, budget: int, seq_lens: Sequence[int], layers: int, last: bool) -> tuple[float, float]:
            key = (int(budget), tuple(sorted(int(s) for s in seq_lens)))
            if key not in self._bb:
                self._bb[key] = self._measure_backbone(*key)
            emb_f, emb_b, lay_f, lay_b, head_f, head_b = self._bb[key]
            # a stage that does not end the model starts it (the CPU runtime runs pp <= 2 here); a whole model
            # (layers == all) does both
            first = not last or layers == self.spec.llm.num_layers
            fwd = layers * lay_f + (emb_f + self.pool_item[1] * len(seq_lens) if first else 0.0) \
                + (head_f if last else 0.0)
            bwd = layers * lay_b + (emb_b if first else 0.0) + (head_b if last else 0.0)
            if self.bb_rc:
                bwd += layers * lay_f
            return fwd, bwd

        def _measure_backbone(self, budget: int, seq_lens: tuple[int, ...]) -> tuple[float, ...]:
            pool = dict(self.by_tokens)
            ids = [pool[n] for n in seq_lens]
            with torch.no_grad():
                embeds = [self.encoder.encode_many([self.dataset.sample(i, with_pixels=True)])[0]
                          if self.dataset.shape(i).num_images else None for i in ids]
            bb, runs = self.backbone, []
            for _ in range(self.repeats):
                leaves = [e.clone().requires_grad_() if e is not None else None for e in embeds]
                c0 = time.process_time()
                samples = [self.dataset.sample(i, with_pixels=False) for i in ids]
                packed = bb.pack(samples, leaves, budget)
                hidden = bb.embed(packed, leaves)
                c1 = time.process_time()
                h_in = hidden.detach().requires_grad_()
                h_out = bb.run_layers(h_in, packed.position_ids, packed.segments, bb.layers[:1])
                c2 = time.process_time()
                h_top = h_out.detach().requires_grad_()
                loss = token_loss_sum(bb.logits(h_top), packed.labels)
                c3 = time.process_time()
                loss.backward()
                c4 = time.process_time()
                h_out.backward(h_top.grad)
                c5 = time.process_time()
                hidden.backward(h_in.grad)
                c6 = time.process_time()
                runs.append((c1 - c0, c6 - c5, c2 - c1, c5 - c4, c3 - c2, c4 - c3))
            bb.zero_grad(set_to_none=True)
            return tuple(statistics.median(col) for col in zip(*runs))

        # -- optimizer, collectives, links: measured rates
        def optimizer(self, params: float, dp: int = 1) -> float:
            if self._opt_per_param is None:
                self._opt_per_param = self._measure_optimizer()
            return self._opt_per_param * params

        def _measure_optimizer(self) -> float:
            """CPU seconds per parameter of the runtime's update: norm, clip, AdamW (foreach off), zero_grad."""
            params = [p for p in self.backbone.parameters() if p.requires_grad]
            opt = build_optimizer(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)

            def update() -> None:
                for p in params:
                    p.grad = torch.full_like(p, 1e-3)
                c0 = time.process_time()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return time.process_time() - c0

            update()  # AdamW allocates its states on the first step
            return statistics.median(update() for _ in range(self.repeats)) / sum(p.numel() for p in params)

        def link(self, nbytes: float) -> float:
            return nbytes / (self.link_fit["gbps"] * 1e9) + self.link_fit["latency_us"] * 1e-6

        def allreduce(self, params: float, n: int) -> float:
            """Ring all-reduce of fp32 gradients over n ranks at the measured 2-rank link."""
            nbytes = params * 4.0
            return 2.0 * (n - 1) / n * nbytes / (self.link_fit["gbps"] * 1e9) \
                + 2.0 * (n - 1) * self.link_fit["latency_us"] * 1e-6

    return MeasuredCosts


def step_planning_seconds(job: Any, steps: Sequence[int], repeats: int = 3) -> float:
    """CPU seconds every rank spends between steps on the runtime's own step plan (median over `steps`)."""
    hf = model_hf_config(job)
    layout = Layout.from_config(job.parallel, job.flow.mode)
    bridges = bridges_of(layout)
    dataset = build_dataset(job.data, token_spec_from_hf_config(hf))
    cost_model = CostModel.from_config(job.packing, VLMSpec.from_hf_config(hf),
                                       frozen_encoder=bool(job.model.freeze_encoder))
    batches = iter_global_batches(dataset, job.trainer.global_batch_size, seed=job.seed,
                                  max_bad=job.data.max_bad_samples)
    out = []
    for step in range(max(steps) + 1):
        ids = next(batches)
        if step in steps:
            t, _ = _cpu_time(lambda: plan_job_step(job, layout, bridges, step, [dataset.shape(i) for i in ids], cost_model),
                             repeats)
            out.append(t)
    return statistics.median(out)


def step_sample_ids(job: Any, steps: Sequence[int]) -> list[int]:
    """The sample ids of the given steps' global batches (the runtime's sampler, same seed)."""
    dataset = build_dataset(job.data, token_spec_from_hf_config(model_hf_config(job)))
    batches = iter_global_batches(dataset, job.trainer.global_batch_size, seed=job.seed,
                                  max_bad=job.data.max_bad_samples)
    ids: list[int] = []
    for step in range(max(steps) + 1):
        batch = next(batches)
        if step in steps:
            ids += list(batch)
    return ids


# ------------------------------------------------------------------------------------------------ the bench
def physical_cores() -> int:
    """Physical cores of this host: distinct (package, core) pairs in /proc/cpuinfo (logical CPUs where it does
    not tell): one rank per core at most."""
    pairs, phys = set(), "0"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (x.strip() for x in line.partition(":"))
            if key == "physical id":
                phys = value
            elif key == "core id":
                pairs.add((phys, value))
    except OSError:
        pass
    return len(pairs) or os.cpu_count() or 1


def train_watched(recipes: Path, overrides: Sequence[str], steps: int, run_dir: Path, timeout_s: float = 900
                  ) -> tuple[list[dict], StepWatch]:
    """`mindspeed-flow train <overrides>` in a subprocess, with a StepWatch running."""
    env = dict(os.environ, MSF_RECIPES=str(recipes))
    cmd = [sys.executable, "-m", "mindspeed_flow.cli", "train", *overrides, f"trainer.steps={steps}",
           f"run_dir={run_dir}", "trainer.progress=false"]
    # A session of its own: with the kernel's autogroup the job is one scheduling group, as the probe is.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    watch = StepWatch(proc.pid, run_dir / "metrics.jsonl")
    watch.start()
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{err[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return lines, watch


def _fill(per_step: dict[int, float]) -> dict[int, float]:
    """A step too short to hold a probe burst takes the median of the other steps' readings (1.0 if none)."""
    ok = [v for v in per_step.values() if math.isfinite(v)]
    fill = statistics.median(ok) if ok else 1.0
    return {k: v if math.isfinite(v) else fill for k, v in per_step.items()}


def layout_overrides(text: str, args: argparse.Namespace) -> list[str]:
    """The `train` overrides of a named layout (HEADLINE_LAYOUTS) on the bench's workload."""
    if text not in HEADLINE_LAYOUTS:
        raise ValueError(f"--layouts: {text!r} is neither a layout name ({', '.join(HEADLINE_LAYOUTS)}) nor "
                         "eA-bB[pP][@T]")
    return [f"experiment={args.experiment}", f"model={args.model}", f"data={args.data}",
            f"trainer.global_batch_size={args.global_batch}", *HEADLINE_LAYOUTS[text]]


def analytic_seconds(job: Any, model: str, data: str, profile: str) -> tuple[float, Any, Optional[list[int]]]:
    """The analytic model's step seconds for exactly the job's layout, calibrated by `profile`: (seconds, its
    CostContext, the LLM layers per stage it priced). Decoupled: the planner pinned to the layout; coupled: the
    coupled baseline's own model (ViT on stage 0) pinned to it, its tuned (uneven, balanced around the ViT)
    split when the job sets one, else the even split."""
    layout = Layout.from_config(job.parallel, job.flow.mode)
    budget = job.packing.token_budget
    kv = [f"model={model}", f"data={data}", "cluster=cpu", f"devices={max(layout.world_size, 2)}",
          f"global_batch={job.trainer.global_batch_size}", "samples=512", "planner.recompute=[false]",
          f"planner.profile={profile}", f"freeze_encoder={str(bool(job.model.freeze_encoder)).lower()}"]
    if layout.mode == "decoupled":
        enc, bb = layout.part(ENCODER), layout.part(BACKBONE)
        problem, _ = build_problem(parse_kv(kv + [f"encoder.dp={enc.dp}", f"backbone.dp={bb.dp}",
                                                  f"backbone.pp={bb.pp}", f"backbone.b={budget}"]))
        return make_plan(problem, with_baselines=False).step_seconds, problem.ctx, None
    part = layout.part(COUPLED)
    problem, _ = build_problem(parse_kv(kv))
    enc, bb = problem.parts
    res = megatron_coupled(enc, bb, problem.baseline_ctx, layout.world_size, tuned=bool(part.layer_split),
                           fixed={"dp": part.dp, "pp": part.pp, "tp": 1, "cp": 1, "b": budget})
    if res is None:
        raise RuntimeError(f"the analytic model finds no coupled layout dp{part.dp} pp{part.pp} that fits")
    return res.step_seconds, problem.ctx, res.layout["coupled"].get("layers")


def layout_world(text: str, args: argparse.Namespace) -> int:
    """Ranks a layout runs (no planning, no profile: the oversubscription check comes first)."""
    if _LAYOUT.match(text):
        lay = parse_layout(text)
        return lay["enc_dp"] + lay["bb_dp"] * lay["bb_pp"]
    job = to_job_config(compose(layout_overrides(text, args)))
    return Layout.from_config(job.parallel, job.flow.mode).world_size


def prepare_layout(text: str, args: argparse.Namespace, recipes: Path, profile: str) -> dict[str, Any]:
    """What a layout trains with (overrides), and its analytic prediction. `eA-bB[pP][@T]` layouts (the
    oversubscribing set) go through the planner as `planner.validate` does and run its recipe."""
    if _LAYOUT.match(text):
        plan, ref = plan_layout(parse_layout(text), args.model, args.data, args.global_batch, profile)
        name = "simbench_" + re.sub(r"[^A-Za-z0-9]", "_", text)
        data_recipe, data_inline = data_recipe_fields(args.data)
        (recipes / "experiment" / f"{name}.yaml").write_text(
            recipe_yaml(plan, name, ref.recipe, data_recipe, ref.inline, data_inline))
        return {"layout": text, "overrides": [f"experiment={name}"], "world": plan.devices,
                "analytic_s": plan.step_seconds, "ctx": plan.problem.ctx, "analytic_layers": None}
    overrides = layout_overrides(text, args)
    job = to_job_config(compose(overrides))

    world = Layout.from_config(job.parallel, job.flow.mode).world_size
    seconds, ctx, layers = analytic_seconds(job, args.model, args.data, profile)
    return {"layout": text, "overrides": overrides, "world": world, "analytic_s": seconds, "ctx": ctx,
            "analytic_layers": layers}


def simulate_layout_runs(prep: dict[str, Any], runs: list[tuple[list[dict], StepWatch, Path]],
                         args: argparse.Namespace, link: dict[str, float],
                         probe: Optional[HostProbe]) -> dict[str, Any]:
    """Calibrate the primitives of a layout's job, replay its measured steps, and make its table row."""
    metrics0, watch0, run_dir0 = runs[0]
    measured_steps = list(range(max(1, min(args.warmup, len(metrics0) - 1)), len(metrics0)))
    job = config_load.load(run_dir0 / "config.yaml")
    ctx = prep["ctx"]
    costs = _make_measured_costs()(job, ctx, link, args.repeats)
    costs.register(step_sample_ids(job, measured_steps), with_pool=job.flow.mode == "decoupled")
    cal_start = time.perf_counter()
    for k in measured_steps:  # the simulator's questions, answered (measured) now
        simulate_job(job, ctx, [k], cores=1.0, step_overhead_s=0.0, spinning_waits=False, costs=costs)
    overhead = step_planning_seconds(job, measured_steps)
    cal_end = time.perf_counter()
    cores = float(physical_cores())
    slowdown = costs.concurrency_slowdown(int(cores))
    # [n] -> cores the job gets while n of its threads compute: min(n, cores), each slower when others compute
    capacity = [0.0] + [min(n, cores) / slowdown[min(n, int(cores))] for n in range(1, int(cores) + 1)]
    # Waiting ranks block (gloo, the pool's condition variables): only computing ranks (and loader threads)
    # take core time; the host's physical cores are the job's (the headline layouts never oversubscribe them).
    sims = simulate_job(job, ctx, measured_steps, cores=cores, step_overhead_s=overhead, spinning_waits=False,
                        costs=costs, host_share={k: capacity for k in measured_steps})
    plain = simulate_job(job, ctx, measured_steps, cores=cores, step_overhead_s=overhead, spinning_waits=False,
                         costs=costs)
    # measured: per step, the median over the rounds where the step ran on a quiet host (other jobs' runnable
    # threads <= --quiet on average over the step; the same step of each round ran the same batch and plan);
    # the steps with no quiet round are left out (all steps, flagged, when no step was quiet)
    others = {k: [w.others_in(k) for _, w, _ in runs] for k in measured_steps}
    per_step = {k: statistics.median(q) for k in measured_steps
                if (q := [m[k]["step_seconds"] for (m, _, _), o in zip(runs, others[k]) if o <= args.quiet])}
    quiet = bool(per_step)
    if not quiet:
        per_step = {k: statistics.median(m[k]["step_seconds"] for m, _, _ in runs) for k in measured_steps}
    used = sorted(per_step)
    measured = statistics.median(per_step.values())
    simulated = statistics.median(sims[k].step_seconds for k in used)
    mid = sorted(used, key=lambda k: sims[k].step_seconds)[len(used) // 2]
    if args.timelines is not None:
        name = re.sub(r"[^A-Za-z0-9]", "_", prep["layout"])
        write_timeline(sims[mid], str(Path(args.timelines) / f"{name}.png"),
                       f"{prep['layout']}: simulated {sims[mid].step_seconds:.3g} s, measured "
                       f"{per_step[mid]:.3g} s (step {mid})")
    row = {
        "layout": prep["layout"], "world": prep["world"], "overrides": prep["overrides"],
        "token_budget": job.packing.token_budget, "steps": used, "rounds": len(runs), "quiet": quiet,
        "other_threads_per_step": [others[k] for k in measured_steps],
        "measured_s": measured, "simulated_s": simulated, "sim_error": simulated / measured - 1,
        "analytic_s": prep["analytic_s"], "analytic_error": prep["analytic_s"] / measured - 1,
        "analytic_layers": prep["analytic_layers"],
        "measured_steps_s": [per_step[k] for k in used],
        "measured_runs_s": [[m[k]["step_seconds"] for k in measured_steps] for m, _, _ in runs],
        "simulated_steps_s": [sims[k].step_seconds for k in used],
        "bubble_fraction": sims[mid].bubble_fraction, "pool_wait_s": sims[mid].pool_wait_s,
        "concurrency_slowdown": slowdown[1:],
        "no_slowdown_s": statistics.median(plain[k].step_seconds for k in measured_steps),
        "step_overhead_s": overhead, "pool_item_cpu_s": list(costs.pool_item),
        "job_cpu_per_step_s": statistics.median(w.job_cpu_per_step(measured_steps) for _, w, _ in runs),
        "charged_cpu_per_step_s": statistics.mean(
            sum(op.work for op in sims[k].ops if op.kind == "compute") for k in measured_steps),
    }
    if probe is not None:
        probe_windows = ([(w.window(measured_steps[0])[0], w.window(measured_steps[-1])[1]) for _, w, _ in runs],
                         (cal_start, cal_end))

        def on_probe_share() -> None:
            """The same replay on the share of a core the host probe got over the measured steps (every round),
            each computing rank slower by the probe's CPU cost then over its cost during calibration; run once
            the probe has stopped (its readings come back then)."""
            spans, cal = probe_windows
            # a loaded host may starve the probe through short steps: then its reading over the whole run counts
            whole = (min(lo for lo, _ in spans), max(hi for _, hi in spans))
            share = statistics.median(probe.share(*sp) for sp in spans)
            share = share if math.isfinite(share) else probe.share(*whole)
            slowdown = statistics.median(probe.cpu_cost(*sp) for sp in spans) / probe.cpu_cost(*cal)
            slowdown = slowdown if math.isfinite(slowdown) else 1.0
            capacity = {k: host_capacity(share, prep["world"], cores, slowdown) for k in measured_steps}
            shared = simulate_job(job, ctx, measured_steps, cores=cores, step_overhead_s=overhead,
                                  spinning_waits=False, costs=costs, host_share=capacity)
            row.update(core_share=share, slowdown=slowdown,
                       probe_s=statistics.median(shared[k].step_seconds for k in measured_steps))

        row["_on_probe_share"] = on_probe_share
    return row


def _quiet_host(max_load: float, max_wait: float) -> float:
    """The 1-minute load average, waited for (up to max_wait seconds) until it is at most max_load."""
    deadline = time.monotonic() + max_wait
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        time.sleep(5.0)
        load = os.getloadavg()[0]
    return load


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cores = physical_cores()
    for text in args.layouts.split(","):
        world = layout_world(text, args)
        if world > cores and not args.oversubscribed:
            raise SystemExit(f"bench simulator: layout {text} has {world} ranks on {cores} physical cores: pass "
                             "--oversubscribed to measure it anyway (see --help)")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="msf-simbench-"))
    workdir = workdir / time.strftime("%Y%m%d-%H%M%S")  # a fresh folder per invocation
    recipes = workdir / "recipes"
    shutil.copytree(recipes_dir(), recipes)
    # The analytic model's calibration and the link figures, measured now on this machine (same run), one
    # thread per call, as each rank runs (MSF_THREADS_PER_RANK).
    table = profile_measure(args.model, args.data, "cpu", [512, 1024, 2048], args.repeats)
    profile = str(workdir / "profile.json")
    write_outputs(table, profile, None)
    link = table["calibration"]["link"]
    preps = [prepare_layout(text, args, recipes, profile) for text in args.layouts.split(",")]
    probe = HostProbe(interval_s=10 * args.probe_burst_ms / 1e3, burst_s=args.probe_burst_ms / 1e3) \
        if args.probe else None
    runs: dict[str, list] = {p["layout"]: [] for p in preps}
    loads: list[float] = []
    rows, failed = [], set()
    try:
        for r in range(args.rounds):  # interleaved: load from other jobs hits every layout alike
            for prep in preps:
                if prep["layout"] in failed:
                    continue
                loads.append(_quiet_host(args.max_load, args.max_wait) if args.max_load > 0 else os.getloadavg()[0])
                run_dir = workdir / "runs" / f"{re.sub(r'[^A-Za-z0-9]', '_', prep['layout'])}-{r}"
                try:
                    metrics, watch = train_watched(recipes, prep["overrides"], args.steps, run_dir)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # one broken layout must not hide the others
                    print(f"bench simulator: layout {prep['layout']} failed: {str(e)[-400:]}", file=sys.stderr)
                    failed.add(prep["layout"])
                    continue
                runs[prep["layout"]].append((metrics, watch, run_dir))
        for prep in preps:
            if runs[prep["layout"]]:
                rows.append(simulate_layout_runs(prep, runs[prep["layout"]], args, link, probe))
    finally:
        if probe is not None:
            probe.stop()
    for row in rows:
        if "_on_probe_share" in row:
            row.pop("_on_probe_share")()
    n = max(len(rows), 1)
    return {
        "model": args.model, "data": args.data, "experiment": args.experiment, "global_batch": args.global_batch,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "cores": cores,
        "load_average_before_runs": loads, "load_average": os.getloadavg()[0], "link": link,
        "rows": rows, "workdir": str(workdir),
        "mean_abs_sim_error": sum(abs(r["sim_error"]) for r in rows) / n if rows else None,
        "mean_abs_analytic_error": sum(abs(r["analytic_error"]) for r in rows) / n if rows else None,
        "mean_abs_probe_error":
            sum(abs(r["probe_s"] / r["measured_s"] - 1) for r in rows) / n if rows and args.probe else None,
    }


def table(report: dict[str, Any], args: Any = None) -> str:
    probe = report.get("mean_abs_probe_error") is not None
    loads = report["load_average_before_runs"]
    out = [f"step time: measured vs simulated vs analytic ({report['model']} on {report['data']}, global batch "
           f"{report['global_batch']}; per step the median over {report['rounds']} interleaved round(s), then the "
           f"median of steps {report['warmup']}..{report['steps'] - 1}; {report['cores']} physical cores, load "
           f"average before the runs {min(loads, default=0):.2f}-{max(loads, default=0):.2f})",
           f"  {'layout':<22} {'world':>5} {'measured s':>10} {'simulated s':>11} {'err %':>7} {'analytic s':>10} "
           f"{'err %':>7} {'bubbles':>7} {'job CPU s':>9} {'charged':>8} {'quiet steps':>11} {'others':>6}"
           + (f" {'probe s':>8} {'err %':>7}" if probe else "")]
    for r in report["rows"]:
        # other jobs' runnable threads: NaN for a step no 0.1 s scan fell inside (a short step), so none may be known
        seen = [x for xs in r["other_threads_per_step"] for x in xs if math.isfinite(x)]
        others = f"{statistics.mean(seen):>6.2f}" if seen else f"{'n/a':>6}"
        line = (f"  {r['layout']:<22} {r['world']:>5} {r['measured_s']:>10.3f} {r['simulated_s']:>11.3f} "
                f"{100 * r['sim_error']:>+7.1f} {r['analytic_s']:>10.3f} {100 * r['analytic_error']:>+7.1f} "
                f"{r['bubble_fraction']:>7.2f} {r['job_cpu_per_step_s']:>9.3f} {r['charged_cpu_per_step_s']:>8.3f} "
                f"{(str(len(r['steps'])) + '/' + str(len(r['other_threads_per_step']))) if r['quiet'] else 'none':>11} "
                f"{others}")
        if probe:
            line += f" {r['probe_s']:>8.3f} {100 * (r['probe_s'] / r['measured_s'] - 1):>+7.1f}"
        out.append(line)
    if report["rows"]:
        out.append(f"mean |error| over {len(report['rows'])} layouts: simulator "
                   f"{100 * report['mean_abs_sim_error']:.1f}%, analytic model "
                   f"{100 * report['mean_abs_analytic_error']:.1f}%"
                   + (f", simulator on the probe's core share {100 * report['mean_abs_probe_error']:.1f}%"
                      if probe else "") + "  (goal for the simulator: <= 10%)")
    slow = [r["concurrency_slowdown"][-1] for r in report["rows"]]
    out.append("quiet steps: measured steps with a round where other jobs had <= --quiet runnable threads (those "
               "rounds' median counts; 'none': no quiet step, all steps count); others: other jobs' runnable "
               "threads, mean over the steps and rounds.")
    out.append("job CPU s: CPU seconds per step the job's processes used, beside the compute the simulator charged "
               "(a check; no prediction reads it). The simulator runs each computing thread slower by the "
               f"measured concurrency slowdown (x{min(slow, default=1):.3f}-x{max(slow, default=1):.3f} with every "
               f"core computing). Runs in {report['workdir']}")
    return "\n".join(out)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mindspeed-flow bench simulator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                    help=f"comma-separated: names ({', '.join(HEADLINE_LAYOUTS)}) on --experiment, or eA-bB[pP][@T] "
                         "(planner-written recipes on --model/--data)")
    ap.add_argument("--oversubscribed", action="store_true",
                    help="allow layouts with more ranks than physical cores (e.g. --layouts "
                         f"{OVERSUBSCRIBED_LAYOUTS}); not in the headline: with several ranks per core the step "
                         "time is mostly the OS scheduler's, which the simulator does not model")
    ap.add_argument("--experiment", default="heavy_encoder_2rank", help="the recipe the named layouts start from")
    ap.add_argument("--model", default="tiny_qwen2_vl_big_vit")
    ap.add_argument("--data", default="infovqa_tiny_large")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every layout (medians per step)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of each primitive (the median counts)")
    ap.add_argument("--max-load", type=float, default=1.5,
                    help="before each run wait (up to --max-wait s) until the 1-minute load average is at most this "
                         "(0: never wait)")
    ap.add_argument("--max-wait", type=float, default=30.0)
    ap.add_argument("--quiet", type=float, default=0.25,
                    help="a measured step counts when other jobs had at most this many runnable threads on average "
                         "over it (a step of the job without the cores to itself measures the other jobs)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--timelines", default=None, help="folder for the simulated step timelines (PNG)")
    ap.add_argument("--probe", action="store_true",
                    help="run the host probe (HostProbe) and add a replay on the core share it read")
    ap.add_argument("--probe-burst-ms", type=float, default=2.0,
                    help="length of the host probe's bursts (one every 10 bursts' time); see HostProbe")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(list(argv))
    if args.steps < 2 or not 0 <= args.warmup < args.steps:
        ap.error(f"--steps {args.steps} / --warmup {args.warmup}: need steps >= 2 and 0 <= warmup < steps")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be >= 1")
    if not 0.1 <= args.probe_burst_ms <= 100:
        ap.error(f"--probe-burst-ms {args.probe_burst_ms}: must be within [0.1, 100]")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return bench_main(sys.argv[1:] if argv is None else argv, parse_args, measure, table)


if __name__ == "__main__":
    raise SystemExit(main())
