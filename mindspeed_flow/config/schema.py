"""Structured config schemas for every recipe group, registered in Hydra's ConfigStore.

A recipe YAML is validated against these dataclasses when Hydra composes it: an unknown key or a value of the
wrong type fails at load time with the full key path. Rules that relate several fields (sizes that must add up
to the world, divisibility, ...) are checked by `mindspeed_flow.config.validate` and by `topology`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from mindspeed_flow.config.packing import PackingConfig
from mindspeed_flow.config.planner import ClusterConfig


@dataclass
class ModelConfig:
    # qwen2_vl | qwen2_5_vl | llava
    family: str = "qwen2_vl"
    # "tiny" builds a small config in code; any other value is ignored when `pretrained_path` is set.
    preset: str = "tiny"
    # Overrides merged into the HF config built for the preset (vision keys under `vision_config`).
    hf_overrides: dict = field(default_factory=dict)
    # Local directory holding config.json (+ safetensors) of a real checkpoint; no hub downloads.
    pretrained_path: Optional[str] = None
    dtype: str = "float32"
    freeze_encoder: bool = False


@dataclass
class DataConfig:
    # synthetic_infovqa | sharegpt | length_table
    source: str = "synthetic_infovqa"
    num_samples: int = 4096
    seed: int = 1234
    # Qwen2-VL dynamic resolution: each side resized to a multiple of 28, pixels clamped to [min, max].
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 64 * 28 * 28
    qa_turns_mean: float = 5.5
    question_tokens: list = field(default_factory=lambda: [10, 20])
    answer_tokens: list = field(default_factory=lambda: [1, 5])
    text_only_fraction: float = 0.0
    # sharegpt: JSON file and the folder its image paths are relative to; length_table: CSV path.
    path: Optional[str] = None
    image_root: Optional[str] = None
    # Corrupt / missing samples are skipped and counted; above this many the job stops with the list of ids.
    max_bad_samples: int = 16
    # ... and it stops when more than this fraction of the samples read were bad (judged after 100 samples).
    max_bad_fraction: float = 1.0
    # sharegpt: decode every image once when its shape is first read, so a truncated file is caught at plan
    # time on every rank alike (False: read only the header; a truncated file then fails at load time).
    verify_images: bool = True
    # sharegpt: a length table of the good samples, written once by export_length_table; shapes then come from
    # it (no image is opened at plan time) and samples absent from it are skipped as bad.
    shape_table: Optional[str] = None
    # Samples loaded ahead of the consumer by the background prefetch thread (bounds prefetched memory).
    prefetch_depth: int = 2
    # synthetic_omni: [lo, hi] mel frames (10 ms each) per audio clip.
    audio_frames: list = field(default_factory=lambda: [40, 300])


@dataclass
class PartParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Layers per pipeline stage (length pp, each >= 1, summing to the part's layers); null: an even split.
    layer_split: Optional[list] = None


@dataclass
class CoupledParallelConfig:
    """flow.mode=coupled: the ranks the decoupled layout would use run the whole model as `pp` pipeline stages x
    (ranks / pp) DP replicas; stage 0 holds the ViT (+ merger) beside its LLM layers (MindSpeed-MM's layout)."""

    pp: int = 1
    # LLM layers per stage; null: an even split. A tuned job gives stage 0 fewer layers to carry the ViT.
    layer_split: Optional[list] = None
    # Tensor and context parallel sizes of a coupled MindSpeed-MM job (the unpatched job that `launch-script --job
    # mm` starts for a coupled recipe); the torch host's coupled mode runs tp = cp = 1.
    tp: int = 1
    cp: int = 1


@dataclass
class ParallelConfig:
    encoder: PartParallelConfig = field(default_factory=PartParallelConfig)
    backbone: PartParallelConfig = field(default_factory=lambda: PartParallelConfig(dp=2))
    # Several encoder parts, each its own group and DP (e.g. {audio: {dp: 1}, vision: {dp: 1}} for the Omni
    # thinker); when set, `encoder` is unused. Empty: the one `encoder` part.
    encoders: dict = field(default_factory=dict)
    coupled: CoupledParallelConfig = field(default_factory=CoupledParallelConfig)
    # ddp | fsdp (FSDP2 fully_shard)
    backbone_dp_impl: str = "ddp"
    # gpipe | 1f1b
    pp_schedule: str = "1f1b"
    # Tensor-parallel linears (tp > 1): auto (MC2 on Ascend where its limits hold, else chunked async
    # collectives behind the matmuls) | mc2 (MC2 wherever a fused op exists, error where it cannot run) | chunked
    # | plain (blocking collectives; the reference)
    tp_overlap: str = "auto"
    # Row chunks the chunked implementation splits a matmul into (each chunk's collective hides behind the next)
    tp_overlap_chunks: int = 2
    # Expected world size; 0 means "whatever the layout needs". A mismatch with the launched world is an error.
    # In coupled mode (flow.mode=coupled) a value > 0 is the number of coupled DP ranks.
    world_size: int = 0


@dataclass
class FlowConfig:
    # decoupled: encoder and backbone on separate process groups; coupled: every rank runs the whole model.
    mode: str = "decoupled"
    # Pool capacity per producer, in MiB of embeddings in flight (backpressure above it).
    pool_capacity_mb: float = 64.0
    # Every blocking receive gives up after this many seconds, naming the peer and what was awaited.
    timeout_s: float = 120.0
    # Receive embeddings ahead, in the background, while the backbone computes earlier microbatches (False:
    # receive each one when the backbone asks for it; the baseline for the hidden / exposed transfer figures).
    prefetch_embeddings: bool = True
    # Encoder keeps activations between forward and backward (False: recompute per sample in backward).
    keep_encoder_activations: bool = True
    # ViT patches per encoder forward: consecutive samples of a rank's encode (= consumption) order are encoded
    # together up to this many patches (a larger sample alone); 0: one sample per forward.
    encoder_batch_tokens: int = 0
    # Encoder activations held at once, in consumer microbatch slots (both hosts; the MindSpeed-MM host calls a
    # slot a decoder microbatch group). A trainable encoder holds the autograd graphs (torch host recomputing:
    # the inputs) of at most this many consecutive slots; at the bound it waits for the oldest slot's gradients
    # and runs its backward before encoding more (only the encoder waits). Must be >= the backbone's pipeline
    # depth (parallel.backbone.pp): under 1F1B its first stage forwards that many microbatches before its first
    # backward; GPipe needs the whole step (refused with a bound on the torch host). 0: MindSpeed-MM host: the
    # pipeline depth + 1 (the warm-up need and one group encoded ahead of the decoder); torch host: the whole
    # step, as before the bound existed (safe for every layout, GPipe included). A frozen MindSpeed-MM encoder
    # counts groups of embeddings sent but not yet received; a frozen torch-host encoder holds nothing (pool
    # credits bound what it sends).
    encoder_inflight: int = 0
    # MindSpeed-MM host only (pretrain_vlm.py): under --sequence-parallel MindSpeed-MM's VLMModel gathers the text
    # embeddings with a backward that sums the TP ranks' identical gradients, so the word embedding gets TP times
    # its gradient (the unpatched job too). True gathers them with a split backward instead: the gradient the same
    # job computes without sequence parallelism. False (default): MindSpeed-MM's own, so losses match its job's.
    fix_sp_embedding_grad: bool = False


@dataclass
class TrainerConfig:
    steps: int = 50
    global_batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    progress: bool = True
    # Save a DCP checkpoint every N steps (0: never) and/or at the end; resume from the newest valid one.
    checkpoint_every: int = 0
    save_final: bool = False
    resume: bool = False
    keep_checkpoints: int = 2
    async_checkpoint: bool = False
    # A run_dir that holds another run is refused unless resume=true (continue it) or overwrite=true (its files
    # are moved, unchanged, under RUN_DIR/replaced/<its run id>/).
    overwrite: bool = False
    # The launcher restarts all workers this many times after a rank fails or hangs; they resume by themselves.
    # Never after a deliberate stop (SIGTERM saved, nan_policy=stop, a refused resume, bad data).
    max_restarts: int = 0
    # A failed checkpoint save (ENOSPC, I/O error): stop (exit with the cause) | continue (warn, train on; a
    # metrics line that cannot be written is kept and appended once a write succeeds).
    on_save_error: str = "stop"
    # Seconds the launcher gives the workers after it passes on a SIGTERM/SIGINT before it kills them (torchrun's
    # own default is 30). The workers save at most 3 steps after the signal (they agree on the step without
    # waiting on each other), so it must exceed 3 step times plus one save; the writer rank warns when it does not.
    # Keep the scheduler's own grace period (e.g. Slurm's KillWait) above it.
    stop_grace_s: int = 30
    # A non-finite global gradient norm (NaN/Inf loss) before the optimizer step: stop | skip (drop the step's
    # update) and stop once more than max_nonfinite_steps steps in a row were non-finite.
    nan_policy: str = "stop"
    max_nonfinite_steps: int = 3
    # TensorBoard scalars in RUN_DIR/tensorboard beside metrics.jsonl (needs the tensorboard package).
    tensorboard: bool = True
    # Per-rank Chrome-trace events (encoder, pool, backbone spans) merged into RUN_DIR/trace.json (Perfetto).
    trace: bool = False


@dataclass
class FaultsConfig:
    """Fault drills, each off at -1; they fire in the first attempt only, so an elastic restart recovers."""

    # SIGKILL global rank `kill_rank` at the start of step `kill_step`.
    kill_rank: int = -1
    kill_step: int = -1
    # SIGSTOP global rank `hang_rank` at the start of step `hang_step` (a peer that stops answering).
    hang_rank: int = -1
    hang_step: int = -1
    # More global ranks SIGSTOPped together with hang_rank at hang_step (a whole node stopping, e.g. [0, 1]).
    hang_ranks: list = field(default_factory=list)
    # Every data file of the save at step `enospc_step` fails with ENOSPC, as on a full disk.
    enospc_step: int = -1
    # After the save at step `truncate_step` completes, cut `truncate_file` (distcp | metadata) in half.
    truncate_step: int = -1
    truncate_file: str = "distcp"
    # Global rank `nan_rank` turns its gradients NaN at step `nan_step` (a hook on its parameters).
    nan_rank: int = -1
    nan_step: int = -1
    # Global rank `sigterm_rank` receives SIGTERM after step `sigterm_step`: the job saves and exits with 75.
    sigterm_rank: int = -1
    sigterm_step: int = -1
    # Global rank `loader_error_rank` raises where it reads the batch of step `loader_error_step`.
    loader_error_rank: int = -1
    loader_error_step: int = -1
    # Every rank sleeps this many seconds at the start of every step (a model whose steps are long), in every attempt.
    slow_step_s: float = 0.0


@dataclass
class FlowJobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    run_dir: str = "runs/default"
    seed: int = 0
    experiment_name: str = "default"


def register_configs() -> None:
    """Register the schemas; recipes list `schema_*` entries in their defaults to be validated by them."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=FlowJobConfig)
    cs.store(group="model", name="schema_model", node=ModelConfig)
    cs.store(group="data", name="schema_data", node=DataConfig)
    cs.store(group="parallel", name="schema_parallel", node=ParallelConfig)
    cs.store(group="packing", name="schema_packing", node=PackingConfig)
    cs.store(group="cluster", name="schema_cluster", node=ClusterConfig)
    cs.store(group="flow", name="schema_flow", node=FlowConfig)


__all__ = [
    "ModelConfig", "DataConfig", "PartParallelConfig", "CoupledParallelConfig", "ParallelConfig", "FlowConfig", "TrainerConfig", "FaultsConfig",
    "FlowJobConfig", "PackingConfig", "ClusterConfig", "register_configs", "MISSING", "Any",
]
