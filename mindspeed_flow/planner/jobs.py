"""What each job that runs a plan can run, as rules on the planner's search space (`plan --job mm|torch|any`).

A plan is only useful if the job it is written for starts it. Each rule below mirrors a check the host makes
before any rank starts, so the planner never prices a layout that host refuses:

- `mm`, the flow-patched MindSpeed-MM job (`hosts/mindspeed_mm/recipe.py`): no context parallelism in either
  part (MindSpeed's CP groups span the whole world); the image encoder is not pipelined; recompute is Megatron's,
  per module in model.json (`recompute_granularity: full`, `recompute_method: uniform`, `recompute_num_layers:
  1`: TransformerConfig fields, which MindSpeed-MM's get_model_config takes from the module's section only), so
  the encoder recomputes per layer (level 2) or not at all, never from the pixels (the host keeps ViT
  activations: flow.keep_encoder_activations must stay true); the optimizer is sharded by the job's
  --use-distributed-optimizer (the recipe says `backbone_dp_impl: ddp`); Qwen2.5-VL models and the Qwen2.5-Omni
  thinker. Omni's audio encoder (`mm_audio_rules`, as `build_parts` and `parts_for_job` check it): on a workload
  with audio clips it is a part of its own, ranked between the vision encoder and the decoder (the recipe's
  `parallel.encoders: {vision: ..., audio: ...}`), its tp dividing its attention heads, pp = cp = 1, and a frozen
  audio part needs the job's --use-distributed-optimizer (planner.distributed_optimizer); without clips it runs on
  the decoder's first stage, in the decoder's TP group, so the decoder's tp must divide its heads too.
- `torch`, the torch host (`mindspeed-flow train`, `step.layout.Layout.validate` and `config.load.check_rules`): no
  context parallelism; the Qwen2.5-Omni thinker always in three parts (audio, vision, backbone: the host splits it
  so, clips or not), its encoder parts frozen together (model.freeze_encoder) and recomputing alike (one
  flow.keep_encoder_activations: `plan.make_plan` prices each shared level and keeps the faster); the encoder is not pipelined; the encoder recomputes only from the pixels
  (flow.keep_encoder_activations=false, level 1); the backbone never recomputes; FSDP2 shards the backbone only
  without TP (with TP it runs DDP, so optimizer states are not sharded) and never shards the encoder; no expert
  parallelism (a MoE LLM's experts stay whole on each backbone rank); Qwen3-VL (deepstack) with data parallel parts
  only (no TP, no pipeline).
- both: the launch scripts start whole nodes, so a plan fills whole nodes of the cluster preset (or fewer than
  one node).
- `any`: no host's rules, every layout the cost model prices: how the planner prices the models no host here
  trains decoupled yet (InternVL3.5, GLM-4.5V); no recipe is written for it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mindspeed_flow.planner.parts import PartSpec
from mindspeed_flow.specs import DEEPSTACK_FAMILIES

JOBS = ("mm", "torch")
# train: launch-script's name for the torch host's job; any: no host's rules (RULES[""])
JOB_ALIASES = {"train": "torch", "any": ""}


# Families the planner prices that neither host builds yet (plan them with --job any)
NOT_BUILT = ("internvl", "glm4v_moe")


@dataclass(frozen=True)
class JobRules:
    name: str  # "" (no host: every layout the cost model prices), "mm" or "torch"
    label: str
    cp: bool  # context parallelism
    encoder_rc: tuple[int, ...]  # recompute levels of a trainable encoder (0 keep, 1 from pixels, 2 per layer)
    backbone_rc: tuple[int, ...]  # 0 keep, 1 full recompute per layer
    shard_with_tp: bool  # the backbone's optimizer states shard over DP also when tp > 1
    shard_encoder: bool  # the encoder's optimizer states shard over DP
    whole_nodes: bool
    replicated_kv: bool = True  # backbone tp may exceed the KV heads (each TP rank keeps a copy of a KV head)
    expert_parallel: bool = True  # a MoE backbone may divide its experts over ep ranks
    dp_only: tuple[str, ...] = ()  # model families the job trains with data parallel parts only (tp = pp = 1)
    families: tuple[str, ...] = ()  # model families the job trains decoupled (empty: any)
    # model families the planner cannot plan for this job, and why
    refused: tuple[tuple[str, str], ...] = ()
    launch_job: str = ""  # `launch-script --job` of this job
    mm_audio: bool = False  # the MindSpeed-MM host's audio encoder rules (`mm_audio_rules`)
    # the encoder parts share one freeze flag and one recompute setting (the torch host's model.freeze_encoder and
    # flow.keep_encoder_activations), and a model with an audio encoder always runs it as a part of its own (the
    # torch host splits the Omni thinker in three, clips or not)
    shared_encoder_settings: bool = False

    def skipped(self) -> list[str]:
        """What the job's plans leave out, and why (one phrase each)."""
        if not self.name:
            return []
        out = ["context parallelism (the host refuses cp > 1)" if not self.cp else "",
               "encoder pipelining (the encoder part runs data/tensor parallel only)"]
        if 1 not in self.encoder_rc:
            out.append("encoder recompute from the pixels (the MindSpeed-MM host keeps ViT activations; it "
                       "recomputes per layer from model.json)")
        if 2 not in self.encoder_rc:
            out.append("per-layer encoder recompute (the torch host recomputes from the pixels only)")
        if 1 not in self.backbone_rc:
            out.append("backbone recompute (the torch host has no activation checkpointing)")
        if not self.shard_with_tp:
            out.append("optimizer sharding with TP (FSDP2 runs without TP; tp > 1 layouts are priced with DDP)")
        if not self.replicated_kv:
            out.append("backbone TP beyond the KV heads (the host needs num_query_groups divisible by tp)")
        if not self.expert_parallel:
            out.append("expert parallelism (the torch host keeps a MoE LLM's experts whole on every backbone rank)")
        if self.dp_only:
            out.append(f"TP and pipelines for {', '.join(self.dp_only)} (deepstack: the torch host trains it with "
                       "data parallel parts only)")
        if self.whole_nodes:
            out.append("partial nodes (the launch scripts start whole nodes)")
        return [s for s in out if s]


RULES = {
    "": JobRules("", "any layout", cp=True, encoder_rc=(0, 1, 2), backbone_rc=(0, 1), shard_with_tp=True,
                 shard_encoder=True, whole_nodes=False),
    "mm": JobRules("mm", "the flow-patched MindSpeed-MM job", cp=False, encoder_rc=(0, 2), backbone_rc=(0, 1),
                   shard_with_tp=True, shard_encoder=True, whole_nodes=True, replicated_kv=False,
                   families=("qwen2_5_vl", "qwen2_5_omni_thinker"), launch_job="mm", mm_audio=True),
    "torch": JobRules("torch", "the torch host (mindspeed-flow train)", cp=False, encoder_rc=(0, 1),
                      backbone_rc=(0,), shard_with_tp=False, shard_encoder=False, whole_nodes=True,
                      expert_parallel=False, dp_only=DEEPSTACK_FAMILIES, shared_encoder_settings=True,
                      refused=tuple((f, "the torch host builds Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE), LLaVA "
                                  "and the Omni thinker only "
                                  "(hosts/torch/hf_compat.py); price it with --job any") for f in NOT_BUILT),
                      launch_job="train"),
}


def refusal(rules: JobRules, family: str | None) -> str:
    """Why the job cannot run a plan of this model family (empty when it can)."""
    why = dict(rules.refused).get(str(family), "")
    if why:
        return why
    if rules.families and family not in rules.families:
        return (f"{rules.label} trains {', '.join(rules.families)} models decoupled only (hosts/mindspeed_mm/"
                "recipe.py); plan it for the torch host with --job torch")
    return ""


def mm_audio_rules(parts: list[PartSpec], audio_heads: int, distributed_optimizer: bool) -> list[PartSpec]:
    """`parts` restricted to what the MindSpeed-MM host runs of a model with an audio encoder of `audio_heads`
    heads (0: none; the parts unchanged). Mirrors hosts/mindspeed_mm/recipe.py: an audio part (`audio`) takes tp
    dividing the heads and pp = cp = 1 (its PartSpec's sizes already; cp is the job's rule) and, frozen, needs
    --use-distributed-optimizer; without an audio part the audio encoder shares the decoder's TP group, so the
    backbone's tp must divide the heads."""
    if not audio_heads:
        return parts
    audio = next((p for p in parts if p.name == "audio"), None)
    if audio is None:
        return [dataclasses.replace(p, tp_sizes=tuple(t for t in p.tp_sizes if audio_heads % t == 0))
                if p.role == "backbone" else p for p in parts]
    if not audio.trainable and not distributed_optimizer:
        raise ValueError("planner.distributed_optimizer=false: the audio part is frozen (planner.freeze_audio, or "
                         "freeze_encoder), so it has no trainable parameter and the MindSpeed-MM job needs "
                         "--use-distributed-optimizer (its placeholder optimizer for a part without parameters "
                         "needs it); plan with planner.distributed_optimizer=true or planner.freeze_audio=false")
    return parts


def job_rules(job: str) -> JobRules:
    key = JOB_ALIASES.get(job, job)
    if key not in RULES:
        raise ValueError(f"--job {job!r}: must be one of {', '.join(JOBS)} or any (mm: the flow-patched MindSpeed-MM "
                         "job; torch: mindspeed-flow train; any: every layout the cost model prices)")
    return RULES[key]


def node_sizes(total_budget: int, per_node: int) -> list[tuple[int, int]]:
    """The device counts a whole-node plan may use, as closed intervals: up to one node, then whole nodes."""
    if per_node <= 1 or total_budget <= per_node:
        return [(0, total_budget)]
    return [(0, per_node)] + [(k * per_node, k * per_node) for k in range(2, total_budget // per_node + 1)]


def allowed_total(n: int, budget: int, per_node: int) -> bool:
    return any(lo <= n <= hi for lo, hi in node_sizes(budget, per_node))
