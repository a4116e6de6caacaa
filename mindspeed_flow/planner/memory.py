"""The planner's memory model per host, evaluated on tiny jobs and compared with the peak they measure.

The planner prices a device's memory with one model per host (`cost.py`: `precision_bytes`,
`part_static_memory`, `backbone_memory`, `encoder_activation_memory`, `encoder_inflight_samples`). This module
calls those same functions on the shapes a tiny job ran, and sets each part's predicted peak beside the peak
that job measured (`mindspeed-flow bench memory`, tests/test_planner_memory.py and
tests/mindspeed_mm/test_memory_model.py):

- MindSpeed-MM (the flow-patched job on the emulated NPU, run with MSF_FLOW_MEMORY=1): measured = the npu
  allocator's peak in the emulator's exit summary, per rank. Predicted per rank: bf16 weights (2 B / parameter,
  frozen ones included), fp32 main gradients (4 B), fp32 main weights + Adam m, v (12 B) over DP x CP, MindSpeed's
  cached causal mask for npu_fusion_attention on decoder ranks (2048 x 2048 bool), and the activations held at
  once: a decoder stage under 1F1B holds pp - stage microbatches (its largest consecutive ones), the last stage
  also the fp32 logits and their gradient; an encoder replica holds `flow.encoder_inflight` groups (its largest
  consecutive ones). Activations use planner.activation_counts=megatron_emulated (what MindSpeed-MM's layers keep
  on the emulated NPU, `cost.ACTIVATION_COUNTS`), evaluated on each microbatch's tokens and sequence lengths and
  each group's images (window-attention layers attend within 8 x 8 patch windows).
- the torch host (`mindspeed-flow train`, run with MSF_MEMORY_TRACK=1): measured = each rank's peak of live
  tensor bytes (`telemetry.tensor_bytes.LiveTensorBytes`; torch's CPU allocator keeps no peak). Predicted per rank: weights,
  gradients and AdamW states in the parameters' dtype, DDP's gradient buckets on a DDP backbone (dp > 1), the
  encoder holding its whole step's samples' activations (strict mode: their backward waits for the backbone),
  the backbone one microbatch at the token budget (its per-sequence attention keeps no score matrix, but K and V
  repeated to every head and per-sequence copies of Q and the output) plus the fp32 logits and their gradient
  and two microbatches of received embeddings.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mindspeed_flow.config.planner import PlannerConfig
from mindspeed_flow.planner.cost import (
    LOGITS_BYTES, CostContext, Layouts, backbone_activation_memory, backbone_costs, encoder_activation_memory,
    encoder_costs, part_static_memory,
)
from mindspeed_flow.planner.hardware import load_cluster
from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.planner.parts import vlm_parts
from mindspeed_flow.specs import VLMSpec

# Goal of the check: every part's predicted peak within this fraction of its measured peak.
TOLERANCE = 0.15
# MindSpeed caches one compressed causal mask for npu_fusion_attention (sparse modes 2/3): 2048 x 2048 bool.
FUSED_MASK_BYTES = 2048 * 2048

_MEMORY_LINE = re.compile(r"\[flow\] rank (\d+) \((encoder|decoder)\) memory step (\d+): at start (\d+) bytes, "
                          r"peak before (\d+) bytes, peak after forward-backward (\d+) bytes, at end (\d+) bytes, "
                          r"parameters (\d+) trainable (\d+) frozen, shapes ")
_NPU_PEAK = re.compile(r"\[msf-emulation rank=(\d+)\] npu \(strict\): npu:\d+ peak (\d+) bytes")
_TORCH_LINE = re.compile(r"\[mindspeed-flow\] rank (\d+) \((encoder|backbone|coupled)\) tensor memory: peak (\d+) "
                         r"bytes, between steps (\d+) bytes")


@dataclass
class PartMemory:
    """One rank's measured and predicted bytes; `terms` add up to `predicted`."""

    rank: int
    part: str  # "encoder", "decoder stage 0", "backbone", ...
    measured: float
    terms: dict[str, float] = field(default_factory=dict)
    measured_static: float = 0.0  # bytes held between steps, when the job reports them

    @property
    def predicted(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


# ------------------------------------------------------------------------------------------------ MindSpeed-MM
@dataclass
class MMRank:
    rank: int
    part: str  # "encoder" | "decoder"
    static: int  # bytes at the start of the last step (after the first update: optimizer states exist)
    trainable: int
    frozen: int
    steps: list[dict] = field(default_factory=list)  # per step: {"segments": [[...]], "images": [[[t, h, w]]]}
    peak: int = 0  # the npu allocator's peak over the job (exit summary)


def parse_mm_output(output: str) -> dict[int, MMRank]:
    """Ranks' memory lines (MSF_FLOW_MEMORY=1) and the emulator's exit peaks from a flow job's output."""
    ranks: dict[int, MMRank] = {}
    decoder = json.JSONDecoder()
    for m in _MEMORY_LINE.finditer(output):
        rank, part = int(m.group(1)), m.group(2)
        r = ranks.setdefault(rank, MMRank(rank, part, 0, int(m.group(8)), int(m.group(9))))
        r.static = int(m.group(4))
        # the shapes run to the end of the JSON object (ranks print concurrently: another line may follow on
        # the same line of the output)
        r.steps.append(decoder.raw_decode(output, m.end())[0])
    for rank, peak in _NPU_PEAK.findall(output):
        if int(rank) in ranks:
            ranks[int(rank)].peak = int(peak)
    return ranks


def mm_context(global_batch: int) -> CostContext:
    """The planner's context for a MindSpeed-MM job on the emulated NPU (bf16, distributed optimizer)."""
    cfg = PlannerConfig(job="mm", dtype="bf16", distributed_optimizer=True, flash_attention=True,
                        activation_counts="megatron_emulated", packing_fill=1.0)
    return CostContext(load_cluster("cpu"), cfg, global_batch)


def _layer_part(name: str, role: str, cfg: dict, layers: int, vocab: int = 0, ffn_key: str = "ffn_hidden_size",
                trainable: bool = True) -> PartSpec:
    heads = int(cfg["num_attention_heads"])
    return PartSpec(name=name, role=role, trainable=trainable, layers=layers, hidden=int(cfg["hidden_size"]),
                    ffn=int(cfg.get(ffn_key) or cfg["ffn_hidden_size"]), heads=heads,
                    kv_heads=int(cfg.get("num_query_groups") or heads), gated_mlp=True, layer_params=0,
                    first_params=0, last_params=0, total_params=0, tokens_per_sample=0.0,
                    sq_tokens_per_sample=0.0, items_per_sample=1.0, max_item_tokens=0, linear_flops_per_token=0.0,
                    attn_flops_per_sample=0.0, vocab=vocab)


def _max_window(values: Sequence[float], k: int) -> float:
    """The largest sum of k consecutive values (all of them when there are fewer)."""
    if not values:
        return 0.0
    k = max(1, min(k, len(values)))
    return max(sum(values[i:i + k]) for i in range(len(values) - k + 1))


def _window_sq(t: int, h: int, w: int, side: int) -> int:
    """Sum of squared window lengths of a t x h x w patch grid cut into side x side windows."""
    rows = [min(side, h - i) for i in range(0, h, side)]
    cols = [min(side, w - j) for j in range(0, w, side)]
    return sum((t * r * c) ** 2 for r in rows for c in cols)


def predict_mm_decoder(rank: MMRank, stage: int, pp: int, layers: int, llm: dict, dp: int,
                       ctx: CostContext) -> dict[str, float]:
    """A decoder stage's peak terms (see the module docstring), from the microbatches its steps ran."""
    by = ctx.bytes
    static = part_static_memory(ctx, "backbone", np.array([float(rank.trainable)]), np.array([dp]), np.array([1]),
                                1, True)
    part = _layer_part("decoder", "backbone", llm, layers, vocab=int(llm["vocab_size"]))
    last = stage == pp - 1
    act, logits = 0.0, 0.0
    for step in rank.steps:
        per_mb = []
        for segs in step.get("segments", []):
            tokens = float(sum(segs))
            sq = float(sum(s * s for s in segs))
            mb = dataclasses.replace(part, tokens_per_sample=tokens, sq_tokens_per_sample=sq)
            L = Layouts.from_rows([{"dp": dp, "tp": 1, "pp": pp, "cp": 1, "b": int(tokens), "rc": 0}])
            per_mb.append(float(backbone_activation_memory(mb, ctx, L, np.array([1.0]), np.array([layers]))[0]))
            if last:
                logits = max(logits, tokens * part.vocab * LOGITS_BYTES)
        # 1F1B: stage s runs pp - s forwards before its first backward
        act = max(act, _max_window(per_mb, pp - stage))
    return {"weights": float(static["weights"][0]) + rank.frozen * by.param, "grads": float(static["grads"][0]),
            "optim": float(static["optim"][0]), "caches": float(FUSED_MASK_BYTES), "activations": act,
            "logits": logits}


def predict_mm_encoder(rank: MMRank, vit: dict, bound: int, dp: int, ctx: CostContext) -> dict[str, float]:
    """An encoder replica's peak terms: static, and its `bound` largest consecutive groups' activations."""
    by = ctx.bytes
    static = part_static_memory(ctx, "encoder", np.array([float(rank.trainable)]), np.array([dp]), np.array([1]),
                                1, True)
    layers = int(vit["num_layers"])
    full = set(vit.get("fullatt_block_indexes") or range(layers))
    side = int(vit.get("window_attn_size", 112)) // int(vit.get("patch_size", 14))
    in_elems = int(vit.get("in_channels", 3)) * int(vit.get("temporal_patch_size", 2)) * int(vit["patch_size"]) ** 2
    part = dataclasses.replace(_layer_part("encoder", "encoder", vit, layers, ffn_key="intermediate_size"),
                               input_elems_per_token=in_elems, act_head_per_token=3.0 * int(vit["hidden_size"]))
    held = 0.0
    for step in rank.steps:
        per_group = []
        for grids in step.get("images", []):
            patches = float(sum(t * h * w for t, h, w in grids))
            sq_full = float(sum((t * h * w) ** 2 for t, h, w in grids))
            sq_win = float(sum(_window_sq(t, h, w, side) for t, h, w in grids))
            # the mean over layers of each layer's squared sequence lengths (full-attention or windowed)
            sq = (len(full) * sq_full + (layers - len(full)) * sq_win) / layers
            g = dataclasses.replace(part, tokens_per_sample=patches, sq_tokens_per_sample=sq,
                                    max_item_tokens=int(patches))
            per_group.append(float(encoder_activation_memory(g, ctx, np.array([1.0]), np.array([1]),
                                                             np.array([0]))[0]))
        held = max(held, _max_window(per_group, bound))
    return {"weights": float(static["weights"][0]) + rank.frozen * by.param, "grads": float(static["grads"][0]),
            "optim": float(static["optim"][0]), "activations": held}


def compare_mm(output: str, model_json: Path, enc_dp: int, dec_dp: int, split: Sequence[int], bound: int,
               global_batch: int) -> list[PartMemory]:
    """Predicted vs measured peak per rank of a flow job (encoder ranks first, then decoder stages in order)."""
    cfg = json.loads(Path(model_json).read_text())
    vit, llm = cfg["image_encoder"]["vision_encoder"], cfg["text_decoder"]
    ranks = parse_mm_output(output)
    ctx = mm_context(global_batch)
    out = []
    n_enc = sum(1 for r in ranks.values() if r.part == "encoder")
    pp = len(split)
    for rank in sorted(ranks):
        r = ranks[rank]
        if r.part == "encoder":
            terms, name = predict_mm_encoder(r, vit, bound, enc_dp, ctx), "encoder"
        else:
            stage = (rank - n_enc) // dec_dp % pp if pp > 1 else 0
            terms = predict_mm_decoder(r, stage, pp, split[stage], llm, dec_dp, ctx)
            name = f"decoder stage {stage}"
        out.append(PartMemory(rank, name, float(r.peak), terms, float(r.static)))
    return out


# ------------------------------------------------------------------------------------------------ torch host
def parse_torch_output(output: str) -> dict[int, tuple[str, int, int]]:
    """{rank: (part, peak bytes, bytes between steps)} from a `mindspeed-flow train` run with MSF_MEMORY_TRACK=1."""
    return {int(r): (part, int(peak), int(between)) for r, part, peak, between in _TORCH_LINE.findall(output)}


def compare_torch(output: str, run_dir: Path) -> list[PartMemory]:
    """Predicted vs measured peak per rank of a decoupled torch-host run (its config.yaml and the steps it ran):
    the planner's own part costs (`encoder_costs`, `backbone_costs`) of the run's layout; the encoder at the
    step whose samples need the most, the backbone at its token budget."""
    from mindspeed_flow.config import load as config_load  # lazy: torch
    from mindspeed_flow.config.load import model_hf_config  # lazy: torch
    from mindspeed_flow.data import build_dataset, iter_global_batches, token_spec_from_hf_config  # lazy: torch

    job = config_load.load(Path(run_dir) / "config.yaml")
    hf_cfg = model_hf_config(job)
    dataset = build_dataset(job.data, token_spec_from_hf_config(hf_cfg), hf_config=hf_cfg)
    G = int(job.trainer.global_batch_size)
    batches = iter_global_batches(dataset, G, seed=job.seed)
    steps = [[dataset.shape(i) for i in next(batches)] for _ in range(int(job.trainer.steps))]
    spec = VLMSpec.from_hf_config(hf_cfg)
    pe, pb = vlm_parts(spec, [s for step in steps for s in step], freeze_encoder=job.model.freeze_encoder)
    dtype = "fp32" if job.model.dtype == "float32" else "bf16"
    enc_l, bb_l = job.parallel.encoder, job.parallel.backbone
    cfg = PlannerConfig(job="torch", dtype=dtype, flash_attention=False,
                        distributed_optimizer=job.parallel.backbone_dp_impl == "fsdp",
                        pool_capacity_mb=float(job.flow.pool_capacity_mb))
    ctx = CostContext(load_cluster("cpu"), cfg, G)
    out = []
    enc_costs = []  # per step: the planner's costs of the encoder at that step's samples
    for step in steps:
        pe_step = dataclasses.replace(pe, tokens_per_sample=float(np.mean([s.vit_patches for s in step])),
                                      out_tokens_per_sample=float(np.mean([s.image_tokens for s in step])))
        enc_costs.append(encoder_costs(pe_step, ctx, _layout(enc_l.dp, 0)))
    out = []
    for rank, (part, peak, between) in sorted(parse_torch_output(output).items()):
        if part == "encoder":  # the step whose samples need the most
            costs = max(enc_costs, key=lambda c: float(c.memory[0]))
        elif part == "backbone":
            costs = backbone_costs(pb, ctx, _layout(bb_l.dp, int(job.packing.token_budget)))
        else:
            continue
        terms = {k: float(v[0]) for k, v in costs.memory_parts.items()}
        out.append(PartMemory(rank, part, float(peak), terms, float(between)))
    return out


def _layout(dp: int, b: int) -> Layouts:
    return Layouts.from_rows([{"dp": dp, "tp": 1, "pp": 1, "cp": 1, "b": b, "rc": 0}])


# ------------------------------------------------------------------------------------------------ report
def table(title: str, rows: Sequence[PartMemory]) -> str:
    """Predicted and measured peak per part side by side, with the predicted terms."""
    mib = 2.0**20
    lines = [title, f"  {'rank':>4} {'part':<16} {'predicted MiB':>13} {'measured MiB':>12} {'error':>7}  terms (MiB)"]
    for r in rows:
        terms = ", ".join(f"{k} {v / mib:.2f}" for k, v in r.terms.items() if v)
        lines.append(f"  {r.rank:>4} {r.part:<16} {r.predicted / mib:>13.2f} {r.measured / mib:>12.2f} "
                     f"{100 * r.error:>+6.1f}%  {terms}")
    worst = max((abs(r.error) for r in rows), default=0.0)
    lines.append(f"  largest |error| {100 * worst:.1f}% (goal <= {100 * TOLERANCE:.0f}%)")
    return "\n".join(lines)


def as_json(rows: Sequence[PartMemory]) -> list[dict[str, Any]]:
    return [{"rank": r.rank, "part": r.part, "predicted": r.predicted, "measured": r.measured, "error": r.error,
             "terms": r.terms} for r in rows]
