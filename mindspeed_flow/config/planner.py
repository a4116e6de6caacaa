"""Schemas of the `cluster` and `planner` recipe groups (owned by planner/).

`ClusterConfig` describes the hardware a plan is made for (recipes/cluster/*.yaml); `PlannerConfig` holds the
knobs of the cost model and the search (efficiency factors, overlap fractions, memory policy, candidate sets).
Both are plain dataclasses so they validate Hydra recipes and can be built in a notebook.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ClusterConfig:
    name: str = "cpu"
    devices: int = 3
    devices_per_node: int = 3
    hbm_gb: float = 8.0
    # Empty by default so a preset's table is not merged with a placeholder when Hydra composes it.
    peak_tflops: dict = field(default_factory=dict)
    intra_node_gbps: float = 10.0
    inter_node_gbps: float = 10.0
    intra_node_latency_us: float = 10.0
    inter_node_latency_us: float = 50.0
    # Device SKU (a key of mindspeed_flow.skus.SKUS): peak_tflops, hbm_gb, hbm_tbps a preset leaves out come from it.
    sku: str = "cpu"
    # npu | cuda | cpu: the backend the runtime will use (decides what the runtime can run, e.g. TP on CPU).
    backend: str = "cpu"
    # Device memory bandwidth in TB/s (optimizer step and other memory-bound phases).
    hbm_tbps: float = 0.02
    # TP / CP sizes the runtime supports on this cluster (TP must also fit inside a node).
    tp_sizes: list = field(default_factory=lambda: [1])
    cp_sizes: list = field(default_factory=lambda: [1])
    # CPU-emulated clusters: the devices are processes sharing this many cores (-1: this machine's count;
    # 0: devices do not share compute). More busy devices than cores slow each one down proportionally.
    host_cores: int = 0
    # Devices per physical package (A3: a 910C package is two dies, each scheduled as one device) and the
    # on-package link between them (GB/s, 0 = same as intra_node_gbps).
    devices_per_package: int = 1
    package_link_gbps: float = 0.0
    # The scale-out tier: devices in one scale-up domain (an A3 SuperPoD: 768 dies on one Unified Bus fabric),
    # whose nodes talk over inter_node_*; traffic between domains crosses the scale-out network (scale_out_*).
    # 0: the node is the scale-up domain and inter_node_* already is the scale-out network (A2 RoCE, H100 IB).
    devices_per_pod: int = 0
    scale_out_gbps: float = 0.0
    scale_out_latency_us: float = 0.0
    # Where each link figure comes from: figure name (intra_node_gbps, ...) -> {source: "..."} or
    # {assumed: true, note: "..."}; the report prints which link figures are assumed. A figure with no entry is
    # reported as assumed.
    link_sources: dict = field(default_factory=dict)
    # Where the figures come from (filled from the SKU table when the preset names a known sku).
    source: str = ""


@dataclass
class PlannerConfig:
    # Samples per optimizer step; 0 = auto (the smallest power of two >= 2 x devices, at least 16).
    global_batch_size: int = 0
    # Backbone microbatch token budgets to consider; empty = multiples of token_alignment from the longest sample
    # up (x1, 1.25, 1.5, 2, 2.5, 3, 4 of it, rounded up).
    token_budgets: list = field(default_factory=list)
    # Automatic token budgets are multiples of this (kernel tiles; 2 x cp x tp divides it for CP load balancing).
    token_alignment: int = 256
    # Pipeline stages may hold different layer counts (pipeline_num_layers), balanced around the LM head on the
    # last stage (and a coupled ViT on the first); False: pp divides the layers and every stage holds L / pp.
    uneven_pp: bool = True
    # Training precision: bf16 (mixed, fp32 master weights + Adam in fp32) | fp32 (CPU runs).
    dtype: str = "bf16"
    # Shard optimizer states (and fp32 master weights) over DP (Megatron distributed optimizer / FSDP).
    distributed_optimizer: bool = True
    # Fraction of per-device peak FLOP/s that dense compute reaches, per part role (calibrated by `profile`).
    efficiency: dict = field(default_factory=lambda: {"encoder": 0.45, "backbone": 0.55})
    # Efficiency multiplier per doubling of TP (smaller GEMMs).
    tp_scaling: float = 0.97
    # Fractions of each communication hidden behind compute (MC2 raises tp; overlap_grad_reduce raises dp).
    overlap: dict = field(default_factory=lambda: {"tp": 0.0, "cp": 0.5, "dp": 0.5, "pp": 0.0, "embed": 0.8})
    # Packed microbatches are filled to this fraction of the token budget on average.
    packing_fill: float = 0.95
    # 1f1b keeps min(m, pp) microbatches in flight on stage 0; gpipe keeps all m.
    pp_schedule: str = "1f1b"
    # Fixed costs (seconds) per microbatch, per encoder item (sample) and per step; calibrated by `profile`.
    microbatch_overhead_s: float = 0.0
    item_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # Per-part calibrated seconds per FLOP (overrides peak x efficiency when > 0), written by `profile`.
    seconds_per_flop: dict = field(default_factory=dict)
    # Attention kernels keep no score matrix (flash / fused); False = eager (CPU), scores are stored.
    flash_attention: bool = True
    # Use at most this fraction of device memory (allocator fragmentation, workspace).
    memory_headroom: float = 0.9
    # Embedding pool capacity per producer (MiB), counted on encoder ranks; backbone keeps 2 microbatches.
    # 0: sized by the plan (cost.pool_capacity_needed) and written as flow.pool_capacity_mb; > 0: pinned, and a
    # capacity below what the plan needs is priced as producer stalls (cost.pool_stall_time).
    pool_capacity_mb: float = 0.0
    # Recompute choices to consider (full activation recompute per layer).
    recompute: list = field(default_factory=lambda: [False, True])
    # Each DP rank's share of the global batch must be whole (the runtime splits the batch evenly).
    batch_divisible: bool = True
    # Frozen encoder: forward only, no grads or optimizer states.
    freeze_encoder: bool = False
    # Frozen audio encoder (its own part when the workload has audio clips); None = as freeze_encoder
    # (MindSpeed-MM's Qwen2.5-Omni example freezes both encoders).
    freeze_audio: Optional[bool] = None
    # The job the plan is for (planner/jobs.py): "mm" (flow-patched MindSpeed-MM), "torch" (mindspeed-flow
    # train), or "" (every layout the cost model prices, whichever host runs it). `plan --job` sets it.
    job: str = ""
    # MindSpeed-MM job (planner.job=mm): decoder microbatch groups an encoder replica holds at once, the
    # recipe's flow.encoder_inflight; 0 = the host's default (decoder pp + 1), priced at pp 8.
    encoder_inflight: int = 0
    # Activation bytes per layer: "" = the parts' own counts (from the HF modules); "megatron_emulated" =
    # MindSpeed-MM's modules on the emulated NPU (planner/cost.py ACTIVATION_COUNTS).
    activation_counts: str = ""
    # Path of a profile table (JSON from `mindspeed-flow profile`) that calibrates the fields above.
    profile: str = ""
    # Per part, the largest relative residual of the profile's fit (written by `profile`): predictions are
    # reported as ranges of +- this much; empty = uncalibrated (the report says the rates are assumed).
    calibration_spread: dict = field(default_factory=dict)
