"""The flow recipe of a MindSpeed-MM job: which ranks form which part, each part's layout, packing and timeouts.

A MindSpeed-MM job becomes a flow job by `--flow-recipe FLOW.yaml` (see `mindspeed_flow_patches.launch`). FLOW.yaml
uses the project's recipe schema (`mindspeed_flow.config.schema.FlowJobConfig`), so the file `mindspeed-flow plan
--out` writes works as it is: `parallel.encoder` / `parallel.backbone` give each part's dp/tp/pp/cp, `packing` the
LLM microbatch scheduler, `flow.timeout_s` how long a transfer may take, `flow.encoder_inflight` how many decoder microbatch groups an
encoder replica holds (see `encoder_inflight`; the torch host's `flow.pool_capacity_mb` does not apply: the
MindSpeed-MM host's transfers are planned and bounded by one step). The job's own model.json and data.json keep describing the model and
the data (the recipe's `model`/`data`/`cluster` sections are the planner's and are not read here).

Everything here is checked before any process group exists, with messages that name the recipe field (or the
job flag) and the rule: part sizes against the launched world, each part's TP against its heads, and every field
whose value the MindSpeed-MM host cannot honour.

Parts and ranks. Parts take contiguous blocks of global ranks in list order: the image encoder (ViT + projector)
first, then Qwen2.5-Omni's audio encoder when the recipe makes it a part (`parallel.encoders: {vision: ..., audio:
...}` instead of `parallel.encoder`), the text decoder last, so Megatron's `print_rank_last` (global rank world-1) is a decoder last-stage rank
and prints the usual iteration line. Inside a part the order is Megatron's tp-cp-dp-pp.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mindspeed_flow.config.schema import FlowJobConfig, PackingConfig, PartParallelConfig
from mindspeed_flow.hosts.mindspeed_mm import FLOW_ENTRY_SCRIPTS
from mindspeed_flow.step.layout import AUDIO, BACKBONE, ENCODER, Layout, PartLayout

# The MindSpeed-MM modules each part builds (`model_provider(modules=...)`; one that model.json lacks is skipped).
# An audio encoder (Qwen2.5-Omni) is its own part when the recipe lists one (`parallel.encoders.audio`), else it
# runs on the decoder's first stage, beside the LLM's embeddings it feeds (`part_modules`).
PART_MODULES: dict[str, tuple[str, ...]] = {ENCODER: ("image_encoder",), AUDIO: ("audio_encoder",),
                                            BACKBONE: ("audio_encoder", "text_decoder")}
# `parallel.encoders` keys of a MindSpeed-MM flow recipe -> the part each names.
ENCODER_KEYS = {"vision": ENCODER, "audio": AUDIO}


def part_modules(layout: Layout, part: str) -> tuple[str, ...]:
    """The modules `part` builds in this layout: the decoder leaves the audio encoder to an audio part."""
    if part == BACKBONE and AUDIO in layout.encoder_parts:
        return ("text_decoder",)
    return PART_MODULES[part]


# model.json's audio_encoder.audio_encoder.model_id values the decoder part runs.
AUDIO_ENCODERS = ("qwen_omni",)


class FlowRecipeError(ValueError):
    """A flow recipe (or its pairing with the job) that cannot run; the message names the field and the rule."""


# What the flow job takes, in one place: the launcher's checks read these tables and `support_table()` renders
# them for the README and docs/mindspeed_mm.md (a test keeps both equal to it). Anything else is refused before a
# process group exists, with the reason.
#
# model.json field -> (the ids the host trains decoupled, each part tested end to end against the unpatched job;
# known ids it refuses, with why).
MODEL_IDS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "model_id": (("qwen2_5vl",), {}),
    "image_encoder.vision_encoder.model_id": (("qwen2vit", "qwen2_5_vit"), {
        "qwen3vit": "Qwen3-VL's ViT returns deepstack features beside the embeddings; the flow transport carries "
                    "one embedding tensor per sample",
        "clip": "InternVL's ViT takes no image_grid_thw; the flow planner needs each image's patch grid",
        "glm4v_vit": "GLM-4V's ViT is not tested as a flow part",
        "videoalign_vit": "the video-align ViT is not tested as a flow part",
    }),
    "image_encoder.vision_projector.model_id": (("lnmlp",), {}),
    "text_decoder.model_id": (("qwen2_5_lm", "qwen2_5_omni_thinker"), {
        "qwen3_lm": "Qwen3 LLM decoders are not tested as a flow part",
        "glm4v_lm": "GLM-4V's LLM is not tested as a flow part",
    }),
}
# entry script (its path's tail) -> why it is refused
SUPPORTED_SCRIPTS = ("pretrain_vlm.py",)
REFUSED_SCRIPTS = {
    "pretrain_omni.py": "MindSpeed-MM's OmniModel entry is not a flow entry (its Qwen2.5-Omni example trains through "
                        "pretrain_vlm.py, where the audio encoder can be its own part: parallel.encoders.audio)",
    "evaluate_vlm.py": "evaluation, not training: run it unpatched (a flow checkpoint first goes through "
                       "`mindspeed-flow convert-checkpoint --to coupled`)",
    "inference_vlm.py": "inference, not training: run it unpatched",
    "mcore/models/qwen3_5/pretrain_qwen3_5.py": "Qwen3.5 on MindSpeed-MM's mcore path is not a flow entry yet",
}
SUPPORTED_SAMPLERS = ("BaseRandomBatchSampler",)


@dataclass(frozen=True)
class ModelShape:
    """What the layout is checked against, read from the job's model.json."""

    vit_heads: int
    vit_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_layers: int
    encoder_trainable: bool
    # text_decoder.pipeline_num_layers as a flat list of ints (None when absent or interleaved), and the file's name
    # for messages: the coupled job's split, which the decoder keeps when it has one entry per decoder stage.
    llm_split: Optional[tuple[int, ...]] = None
    source: str = "model.json"
    audio_heads: int = 0  # the audio encoder's attention heads; 0 without one
    audio_trainable: bool = False  # model.json's audio_encoder.audio_encoder.freeze is false (MindSpeed-MM: frozen)
    # model.json's audio_encoder.audio_encoder.sequence_parallel (None: absent, so the job's --sequence-parallel)
    audio_sequence_parallel: Optional[bool] = None

    @staticmethod
    def from_model_json(path: str | Path) -> "ModelShape":
        try:
            cfg = json.loads(Path(path).read_text())
            vit = cfg["image_encoder"]["vision_encoder"]
            proj = cfg["image_encoder"]["vision_projector"]
            llm = cfg["text_decoder"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise FlowRecipeError(f"--mm-model {path}: cannot read the image_encoder/text_decoder sections ({err})")
        problems = unsupported_model(cfg)
        if problems:
            raise FlowRecipeError(f"--mm-model {path}: " + "; ".join(problems))
        # MindSpeed-MM's defaults (pretrain_vlm._apply_freezing): the ViT is frozen unless it says otherwise, the
        # projector trains unless it says otherwise.
        trainable = not (vit.get("freeze", True) and proj.get("freeze", False))
        split = llm.get("pipeline_num_layers")
        flat = isinstance(split, list) and bool(split) and all(isinstance(n, int) for n in split)
        audio = (cfg.get("audio_encoder") or {}).get("audio_encoder") or {}
        return ModelShape(int(vit["num_attention_heads"]), int(vit["num_layers"]), int(llm["num_attention_heads"]),
                          int(llm.get("num_query_groups") or llm["num_attention_heads"]), int(llm["num_layers"]),
                          trainable, tuple(split) if flat else None, Path(path).name,
                          int(audio.get("num_attention_heads", 0)), bool(audio) and not audio.get("freeze", True),
                          None if audio.get("sequence_parallel") is None else bool(audio["sequence_parallel"]))

    @property
    def audio(self) -> bool:
        return self.audio_heads > 0


@dataclass(frozen=True)
class FlowParts:
    """The job's layout (every part's DP/TP/PP/CP and global ranks: the same `Layout` the torch host, the planner's
    simulator and the launch-script writer use) and what the MindSpeed-MM host adds to it."""

    layout: Layout
    packing: PackingConfig
    timeout_s: float
    encoder_trainable: bool
    decoder_layers: tuple[int, ...] = field(default_factory=tuple)  # text_decoder.pipeline_num_layers per stage
    decoder_layers_from: str = "an even split"  # where decoder_layers came from (see `decoder_split`)
    # Decoder microbatch groups an encoder replica holds at once (flow.encoder_inflight, 0 resolved): see
    # `encoder_inflight`.
    encoder_inflight: int = 2
    # What the job writes for its users (hosts/mindspeed_mm/metrics.py): the recipe's `run_dir` when it sets one
    # (absolute), and `trainer.trace` (per-rank spans merged into RUN_DIR/trace.json).
    run_dir: Optional[str] = None
    trace: bool = False
    audio_trainable: bool = False  # an audio part (`parallel.encoders.audio`) trains its audio encoder
    # flow.fix_sp_embedding_grad: the text embeddings' gather out of the sequence-parallel region splits its
    # gradient instead of summing the TP ranks' copies (patches/flow.py, process_multimodal_embeddings_wrapper)
    fix_sp_embedding_grad: bool = False

    @property
    def audio_part(self) -> bool:
        """Whether the audio encoder is a part on its own ranks (else it runs on the decoder's first stage)."""
        return AUDIO in self.layout.encoder_parts

    def trainable(self, part: str) -> bool:
        """Whether `part` has parameters that train (the decoder always does)."""
        return {ENCODER: self.encoder_trainable, AUDIO: self.audio_trainable}.get(part, True)

    @property
    def frozen_parts(self) -> list[str]:
        return [p.name for p in self.layout.parts if not self.trainable(p.name)]

    def describe(self) -> str:
        rows = []
        for p in self.layout.parts:
            r = self.layout.part_ranks(p.name)
            rows.append(f"{p.name} ({'+'.join(part_modules(self.layout, p.name))}): ranks {r[0]}-{r[-1]}, "
                        f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}")
        return "; ".join(rows)


# Fields of the project schema the MindSpeed-MM host cannot honour, with the reason given to the user.
def _unsupported(job: FlowJobConfig) -> list[str]:
    out = []
    par, flow, pack = job.parallel, job.flow, job.packing
    if flow.mode != "decoupled":
        out.append(f"flow.mode={flow.mode!r}: a coupled MindSpeed-MM job is the unpatched job itself; run it without "
                   "--flow-recipe")
    if not flow.keep_encoder_activations:
        out.append("flow.keep_encoder_activations=false: the MindSpeed-MM host keeps ViT activations (recompute comes "
                   "from the job's own --recompute-* flags)")
    if par.backbone_dp_impl != "ddp":
        out.append(f"parallel.backbone_dp_impl={par.backbone_dp_impl!r}: MindSpeed-MM's Megatron backend shards "
                   "optimizer state with the job's --use-distributed-optimizer, not FSDP2; use 'ddp'")
    if par.pp_schedule != "1f1b":
        out.append(f"parallel.pp_schedule={par.pp_schedule!r}: Megatron runs 1F1B; use '1f1b'")
    if pack.pad_multiple:
        out.append(f"packing.pad_multiple={pack.pad_multiple}: MindSpeed-MM microbatches are padded to their own "
                   "longest sample (use 0)")
    if pack.layout not in ("auto", "packed", "rows"):
        out.append(f"packing.layout={pack.layout!r}: 'auto' (packed with --use-flash-attn, else rows), 'packed' or "
                   "'rows'")
    if pack.step_mode != "samples":
        out.append(f"packing.step_mode={pack.step_mode!r}: MindSpeed-MM's loader makes the steps (a fixed "
                   "--global-batch-size of samples); use 'samples'")
    named = [("encoder", par.encoder)] if not par.encoders else \
        [(f"encoders.{k}", _part_cfg(v)) for k, v in par.encoders.items()]
    for name, p in named + [("backbone", par.backbone)]:
        if p.cp != 1:
            out.append(f"parallel.{name}.cp={p.cp}: MindSpeed's context-parallel group wrappers build their groups "
                       "over the whole world, not over one part (cp must be 1)")
    for name, p in named:
        if p.pp != 1:
            out.append(f"parallel.{name}.pp={p.pp}: an encoder part runs data/tensor parallel only (pp must be 1)")
    for name, node in (par.encoders or {}).items():
        extra = sorted(set(node.keys() if hasattr(node, "keys") else ()) - {"dp", "tp", "pp", "cp"})
        if extra:
            out.append(f"parallel.encoders.{name}: unknown keys {extra}; each part takes dp, tp, pp, cp")
    unknown = sorted(set(par.encoders) - set(ENCODER_KEYS))
    if unknown or (par.encoders and "vision" not in par.encoders):
        out.append(f"parallel.encoders={sorted(par.encoders)}: a MindSpeed-MM flow job's encoder parts are `vision` "
                   "(the image encoder) and optionally `audio` (Qwen2.5-Omni's audio encoder on its own ranks)")
    return out


def _part_cfg(node: object) -> PartParallelConfig:
    """One `parallel.encoders.<name>` entry (a mapping of dp/tp/pp/cp; missing sizes are 1)."""
    sizes = dict(node.items()) if hasattr(node, "items") else {}  # type: ignore[union-attr]
    return PartParallelConfig(**{k: sizes[k] for k in ("dp", "tp", "pp", "cp") if k in sizes})


def unsupported_model(cfg: dict) -> list[str]:
    """Why model.json describes a model the host cannot train decoupled (empty when it can)."""
    out = []
    for dotted, (allowed, refused) in MODEL_IDS.items():
        node: object = cfg
        for key in dotted.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node not in allowed:
            why = refused.get(str(node), "not a model the flow host supports")
            out.append(f"{dotted}={node!r}: {why} (supported: {', '.join(allowed)})")
    audio = (cfg.get("audio_encoder") or {}).get("audio_encoder") if isinstance(cfg.get("audio_encoder"), dict) \
        else None
    if cfg.get("audio_encoder") and (not isinstance(audio, dict) or audio.get("model_id") not in AUDIO_ENCODERS):
        got = audio.get("model_id") if isinstance(audio, dict) else None
        out.append(f"audio_encoder.audio_encoder.model_id={got!r}: not an audio encoder the flow host runs "
                   f"(supported: {', '.join(AUDIO_ENCODERS)})")
    split = audio.get("pipeline_num_layers") if isinstance(audio, dict) else None
    if isinstance(split, list) and any(n for n in split[1:] if isinstance(n, int)):
        # A coupled checkpoint keeps each stage's audio layers numbered from 0 in its own folder; the flow job
        # runs them all on the LLM's first stage and reads them from the coupled job's first stage.
        out.append(f"audio_encoder.audio_encoder.pipeline_num_layers={split}: the flow job runs the audio encoder "
                   f"whole on the LLM's first stage and reads its layers from a coupled checkpoint's first stage; "
                   f"put them all there ([{sum(n for n in split if isinstance(n, int))}"
                   f"{', 0' * (len(split) - 1)}], as MindSpeed-MM's Omni example does)")
    llm = cfg.get("text_decoder") or {}
    for key in ("num_moe_experts", "num_experts", "moe_router_topk"):
        if llm.get(key):
            out.append(f"text_decoder.{key}={llm[key]}: MoE decoders (expert parallelism) are not supported by the "
                       "flow host")
            break
    if llm.get("use_remove_padding"):
        out.append("text_decoder.use_remove_padding=true: the flow decoder packs its own microbatches "
                   "(packing.layout) and hands the attention their sequence lengths itself; set it to false")
    return out


def support_table() -> str:
    """What the flow job takes and refuses, as a Markdown table (the README and docs/mindspeed_mm.md hold it)."""
    def ids(values: Iterable[str]) -> str:
        return ", ".join(f"`{v}`" for v in values)

    names = {"model_id": "model (`model_id`)", "image_encoder.vision_encoder.model_id": "ViT",
             "image_encoder.vision_projector.model_id": "projector", "text_decoder.model_id": "LLM"}
    rows = [("entry script", f"{ids(SUPPORTED_SCRIPTS)} (MindSpeed-MM's Megatron VLM path); "
                             "`mindspeed_mm/fsdp/train/trainer.py` (its FSDP2 trainer: `model_id: qwen3_vl_moe`, "
                             "FSDP per part, expert parallel inside the LLM's part, HF weights in, images and videos "
                             "in any mix per sample); `pretrain_transformers.py` (Megatron's loop over MindSpeed's torch "
                             "FSDP2, each part its own FSDP2 shards, DCP checkpoints interchangeable with the unpatched "
                             "job's): `CONFIG.yaml` with `model_id: qwen3_vl` / `qwen3_vl_moe` (the example's frozen "
                             "tower or a trained one; images and videos in any mix per sample), or the arguments on the command line with `--mm-model` "
                             "`model_id: glm4v_moe` (GLM-4.5V: per-token loss, MoE LLM, image and video samples)",
             ids(REFUSED_SCRIPTS))]
    rows += [(names[field], ids(ok), ids(refused) or "anything else") for field, (ok, refused) in MODEL_IDS.items()]
    rows += [
        ("LLM kind", "dense", "MoE (`num_moe_experts`, `--expert-model-parallel-size`), `use_remove_padding: true`"),
        ("other parts", "`audio_encoder` (Qwen2.5-Omni's `qwen_omni`, with `qwen2_5_omni_thinker`), microbatches in "
                        "rows: its own part (`parallel.encoders: {vision: ..., audio: ...}`, DP/TP, frozen or "
                        "trained), or on the LLM's ranks, whole on its first stage; with sequence parallelism at TP "
                        "> 1 when its model.json section says `\"sequence_parallel\": false`",
         "the audio encoder pipelined (model.json's split or the recipe's pp), at TP > 1 under sequence parallelism "
         "without that key or under MC2"),
        ("parallelism", "any DP/TP per part, decoder PP (uneven split), sequence parallel, MC2",
         "CP > 1, VPP, encoder PP, `--use-torch-fsdp2` on `pretrain_vlm.py`, `--hetero-parallel`, `--dist-train`"),
        ("data", f"images, 0-n per sample, or videos (`attr.videos`, model.json's `img_context_token_id` the video "
                 f"pad id, as MindSpeed-MM trains them), {ids(SUPPORTED_SAMPLERS)}",
         "images and videos in one data set (`attr.images` and `attr.videos`), other samplers"),
        ("checkpoints", "`--ckpt-format torch`", "`torch_dist` (Megatron's default with `--save`/`--load`)"),
    ]
    lines = ["| | supported | refused |", "|---|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows])


@dataclass(frozen=True)
class LayerSplit:
    """LLM layers per decoder pipeline stage, and where they came from (said in every message about them)."""

    layers: tuple[int, ...]
    source: str


def decoder_split(stages: int, llm_layers: int, *, recipe_split: Optional[list] = None,
                  model_split: Optional[tuple[int, ...]] = None, recipe_name: str = "FLOW.yaml",
                  model_name: str = "model.json") -> LayerSplit:
    """The one rule for the LLM's layers per pipeline stage, used by the launcher and by the converter.

    1. the recipe's `parallel.backbone.layer_split` (e.g. the uneven split `mindspeed-flow plan --out` writes);
    2. else model.json's `text_decoder.pipeline_num_layers` when it has one entry per stage (the job's own split
       carries over; with another count it describes the coupled pipeline, which the decoder does not have);
    3. else an even split, the remainder on the later stages.
    A split that is given but cannot be honoured is an error naming its file and field, never a silent fallback."""
    where_recipe = f"{recipe_name} parallel.backbone.layer_split"
    where_model = f"{model_name} text_decoder.pipeline_num_layers"
    rule = (f"needs one entry per decoder pipeline stage (pp={stages}), each >= 1, summing to the LLM's "
            f"{llm_layers} layers")
    if recipe_split is not None:
        split = tuple(recipe_split)
        if len(split) != stages or any(not isinstance(n, int) or n < 1 for n in split) or sum(split) != llm_layers:
            raise FlowRecipeError(f"{recipe_name}: parallel.backbone.layer_split={list(split)}: {rule} (the recipe's "
                                  f"split wins over {where_model})")
        return LayerSplit(split, where_recipe)
    if model_split is not None and len(model_split) == stages:
        split = tuple(model_split)
        if any(n < 1 for n in split) or sum(split) != llm_layers:
            raise FlowRecipeError(f"{model_name}: text_decoder.pipeline_num_layers={list(split)}: has one entry per "
                                  f"pipeline stage (pp={stages}), so it gives the split, but each entry must be >= 1 "
                                  f"and they must sum to the LLM's {llm_layers} layers; fix it or give {where_recipe}")
        return LayerSplit(split, where_model)
    why = (f"no {where_recipe}; {where_model} " +
           ("absent" if model_split is None else f"{list(model_split)} has {len(model_split)} entries, not {stages}"))
    return LayerSplit(even_split(llm_layers, stages), f"an even split ({why})")


def decoder_split_for(job: FlowJobConfig, model: ModelShape, recipe_name: str = "FLOW.yaml") -> LayerSplit:
    """`decoder_split` for a flow job: its recipe's backbone PP and split, its model.json's."""
    return decoder_split(job.parallel.backbone.pp, model.llm_layers, recipe_split=job.parallel.backbone.layer_split,
                         model_split=model.llm_split, recipe_name=recipe_name, model_name=model.source)


def load_flow_job(path: str | Path) -> FlowJobConfig:
    """FLOW.yaml merged over the schema; Hydra's `defaults` list (written by `plan --out`) is not needed here."""
    path = Path(path)
    if not path.is_file():
        raise FlowRecipeError(f"--flow-recipe {path}: no such file")
    try:
        raw = OmegaConf.load(str(path))
        if "defaults" in raw:
            raw.pop("defaults")
        merged = OmegaConf.merge(OmegaConf.structured(FlowJobConfig), raw)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise FlowRecipeError(f"--flow-recipe {path}: {str(err).splitlines()[0]}") from None


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage, the remainder on the later stages (the first stage also embeds)."""
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if s >= stages - extra else 0) for s in range(stages))


def build_parts(job: FlowJobConfig, *, world_size: int, model: ModelShape, global_batch_size: int,
                micro_batch_size: int, recipe_name: str = "FLOW.yaml",
                recipe_global_batch_size: Optional[int] = None) -> FlowParts:
    """Validate the recipe against the launched world and the model; raise FlowRecipeError naming the field."""
    problems = _unsupported(job)
    if problems:
        raise FlowRecipeError(f"{recipe_name}: " + "; ".join(problems))
    bb_cfg = job.parallel.backbone
    # The parts in rank order: the image encoder, the audio encoder when it is a part, the decoder last.
    encoders = {ENCODER: ("parallel.encoder", job.parallel.encoder)} if not job.parallel.encoders else \
        {ENCODER_KEYS[k]: (f"parallel.encoders.{k}", _part_cfg(job.parallel.encoders[k]))
         for k in ("vision", "audio") if k in job.parallel.encoders}
    if AUDIO in encoders and not model.audio:
        raise FlowRecipeError(f"{recipe_name}: parallel.encoders.audio: {model.source} has no audio_encoder to run "
                              "on it; drop the audio part")
    layouts = tuple(PartLayout(name, c.dp, c.tp, c.pp, c.cp) for name, (_, c) in encoders.items()) + \
        (PartLayout(BACKBONE, bb_cfg.dp, bb_cfg.tp, bb_cfg.pp, bb_cfg.cp),)
    field_of = {name: f for name, (f, _) in encoders.items()}
    field_of[BACKBONE] = "parallel.backbone"
    for p in layouts:
        f = field_of[p.name]
        for dim in ("dp", "tp", "pp", "cp"):
            v = getattr(p, dim)
            if not isinstance(v, int) or v < 1:
                raise FlowRecipeError(f"{recipe_name}: {f}.{dim}={v!r}: every parallel size must be an integer >= 1")
    total = sum(p.size for p in layouts)
    sizes = " + ".join(f"{p.name} {p.size} (dp{p.dp} x tp{p.tp} x pp{p.pp} x cp{p.cp})" for p in layouts)
    if total != world_size:
        raise FlowRecipeError(f"{recipe_name}: the parts need {sizes} = {total} ranks but the job was launched with "
                              f"{world_size}; change parallel.* or the launch size (--nproc_per_node x --nnodes)")
    if job.parallel.world_size and job.parallel.world_size != world_size:
        raise FlowRecipeError(f"{recipe_name}: parallel.world_size={job.parallel.world_size} but the job was launched "
                              f"with {world_size} ranks")
    enc, bb = layouts[0], layouts[-1]
    # The audio encoder shares the TP group of the part it runs in: its own, else the decoder's.
    audio_at, audio_tp = (field_of[AUDIO], layouts[1].tp) if AUDIO in encoders else ("parallel.backbone", bb.tp)
    checks = [
        (model.vit_heads % enc.tp == 0, f"{field_of[ENCODER]}.tp={enc.tp}: the ViT's num_attention_heads "
                                        f"({model.vit_heads}) must be divisible by tp"),
        (model.llm_heads % bb.tp == 0, f"parallel.backbone.tp={bb.tp}: the LLM's num_attention_heads "
                                       f"({model.llm_heads}) must be divisible by tp"),
        (model.llm_kv_heads % bb.tp == 0, f"parallel.backbone.tp={bb.tp}: the LLM's num_query_groups "
                                          f"({model.llm_kv_heads}) must be divisible by tp"),
        (model.audio_heads % audio_tp == 0, f"{audio_at}.tp={audio_tp}: the audio encoder runs on these ranks, and "
                                            f"its num_attention_heads ({model.audio_heads}) must be divisible by tp"),
        (bb.pp <= model.llm_layers, f"parallel.backbone.pp={bb.pp}: more pipeline stages than LLM layers "
                                    f"({model.llm_layers})"),
    ]
    if recipe_global_batch_size is not None and recipe_global_batch_size != global_batch_size:
        checks.append((False, f"trainer.global_batch_size={recipe_global_batch_size} (the batch the plan assumed) "
                              f"but the job runs --global-batch-size {global_batch_size}; make them agree"))
    for p in layouts:
        checks.append((global_batch_size % (micro_batch_size * p.dp) == 0,
                       f"{field_of[p.name]}.dp={p.dp}: --global-batch-size {global_batch_size} must be divisible by "
                       f"--micro-batch-size {micro_batch_size} x dp (every DP rank of every part gets the same "
                       "share of each global batch)"))
    for ok, msg in checks:
        if not ok:
            raise FlowRecipeError(f"{recipe_name}: {msg}")
    if job.flow.pool_capacity_mb <= 0 or job.flow.timeout_s <= 0:
        raise FlowRecipeError(f"{recipe_name}: flow.pool_capacity_mb and flow.timeout_s must be > 0")
    if job.packing.oversize_policy not in ("error", "skip"):
        raise FlowRecipeError(f"{recipe_name}: packing.oversize_policy={job.packing.oversize_policy!r}: "
                              "'error' or 'skip'")
    split = decoder_split_for(job, model, recipe_name)
    audio_trainable = AUDIO in encoders and model.audio_trainable
    return FlowParts(Layout(layouts), job.packing, float(job.flow.timeout_s), model.encoder_trainable, split.layers,
                     split.source,
                     encoder_inflight(job.flow.encoder_inflight, bb.pp, model.encoder_trainable or audio_trainable,
                                      recipe_name),
                     audio_trainable=audio_trainable, fix_sp_embedding_grad=bool(job.flow.fix_sp_embedding_grad))


def encoder_inflight(value: object, decoder_pp: int, trainable: bool, recipe_name: str = "FLOW.yaml") -> int:
    """The bound on decoder microbatch groups an encoder replica holds (`flow.encoder_inflight`), resolved.

    A trainable encoder at the bound waits for its oldest group's gradients. Under 1F1B the decoder's first stage
    forwards min(pp, microbatches) microbatches before the backward that returns the first gradient, so a bound
    below pp can leave the encoder waiting for a gradient the decoder cannot compute before it gets the next
    embedding: refused. 0 gives pp + 1, the warm-up need and one group encoded ahead of the decoder. A frozen
    encoder waits only for its sends to be received (the decoder posts every receive of a step at its start), so
    any bound >= 1 is safe there."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FlowRecipeError(f"{recipe_name}: flow.encoder_inflight={value!r}: must be an integer >= 0 (0: the "
                              "decoder's pipeline depth + 1)")
    if value == 0:
        return decoder_pp + 1
    if trainable and value < decoder_pp:
        raise FlowRecipeError(f"{recipe_name}: flow.encoder_inflight={value}: must be >= parallel.backbone.pp="
                              f"{decoder_pp} (the decoder's first stage forwards {decoder_pp} microbatches before "
                              "the first gradient comes back; a smaller bound deadlocks) or 0")
    return value


def argv_value(argv: list[str], flag: str, default: Optional[str] = None) -> Optional[str]:
    """The value of `--flag v` or `--flag=v` in a Megatron command line (the last one wins, as in argparse)."""
    value = default
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def check_job_flags(argv: list[str], script: Optional[str] = None) -> None:
    """The job's own entry script and flags the flow host cannot honour (each refused with the reason)."""
    name = Path(script).name if script is not None else None
    if name is not None and name not in SUPPORTED_SCRIPTS:
        path = Path(script).as_posix()
        why = next((why for tail, why in REFUSED_SCRIPTS.items() if path.endswith(tail)),
                   "not an entry script the flow host knows")
        raise FlowRecipeError(f"{name}: {why}; a flow job runs one of MindSpeed-MM's "
                              f"{', '.join(FLOW_ENTRY_SCRIPTS)}")
    cp = int(argv_value(argv, "--context-parallel-size", "1") or 1)
    if cp > 1:
        raise FlowRecipeError(f"--context-parallel-size {cp}: flow parts run without context parallelism; set 1 "
                              "(each part's layout comes from the flow recipe)")
    ep = int(argv_value(argv, "--expert-model-parallel-size", "1") or 1)
    if ep > 1:
        raise FlowRecipeError(f"--expert-model-parallel-size {ep}: expert parallelism (MoE) is not supported by the "
                              "flow host")
    if "--use-torch-fsdp2" in argv or "--use-custom-fsdp" in argv:
        flag = "--use-torch-fsdp2" if "--use-torch-fsdp2" in argv else "--use-custom-fsdp"
        raise FlowRecipeError(f"{flag}: Megatron's FSDP wrapper is not supported per flow part yet (its sharding and "
                              "checkpoints are untested with separate parts); drop it: --use-distributed-optimizer "
                              "shards the optimizer state over each part's data-parallel ranks")
    if argv_value(argv, "--save") or argv_value(argv, "--load"):
        fmt = argv_value(argv, "--ckpt-format", "torch_dist")
        if fmt != "torch":
            raise FlowRecipeError(f"--ckpt-format {fmt}{' (Megatron default)' if '--ckpt-format' not in argv else ''}"
                                  ": a flow job saves and loads Megatron's torch format (per-part rank folders); "
                                  "add --ckpt-format torch")


def check_data_json(path: str | Path) -> None:
    """Data the flow host cannot train as the unpatched job does: images and videos together, untested samplers."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise FlowRecipeError(f"--mm-data {path}: cannot read it ({err})")
    attr = ((cfg.get("dataset_param") or {}).get("attr") or {})
    if attr.get("videos") and attr.get("images"):
        # Refused because the unpatched job cannot train it either: MindSpeed-MM scatters vision embeddings at one
        # token id (model.json's img_context_token_id) and its get_batch overwrites an image batch's pixels with
        # the videos'; a flow job reproduces the unpatched job, so it has nothing to match here.
        raise FlowRecipeError(f"--mm-data {path}: dataset_param.attr images={attr['images']!r} and "
                              f"videos={attr['videos']!r}: MindSpeed-MM's pretrain_vlm.py cannot train images and "
                              "videos in one data set (it scatters vision embeddings only at model.json's "
                              "img_context_token_id, one token id); train them as separate data sets")
    loader = cfg.get("dataloader_param") or {}
    sampler = loader.get("sampler_type")
    if sampler not in SUPPORTED_SAMPLERS:
        raise FlowRecipeError(f"--mm-data {path}: dataloader_param.sampler_type={sampler!r}: the flow job reproduces "
                              f"the unpatched job's global batches for {', '.join(SUPPORTED_SAMPLERS)} only")


def parts_for_job(recipe_path: str | Path, argv: list[str], world_size: int,
                  script: Optional[str] = None) -> FlowParts:
    """Everything the launcher checks before MindSpeed is imported: entry x flags x recipe x world x model.json x
    data.json."""
    check_job_flags(argv, script)
    job = load_flow_job(recipe_path)
    model_json = argv_value(argv, "--mm-model")
    if not model_json:
        raise FlowRecipeError("the job has no --mm-model: a flow job needs MindSpeed-MM's model.json")
    model = ModelShape.from_model_json(model_json)
    data_json = argv_value(argv, "--mm-data")
    if data_json:
        check_data_json(data_json)
    gbs = int(argv_value(argv, "--global-batch-size", "0") or 0)
    mbs = int(argv_value(argv, "--micro-batch-size", "1") or 1)
    if gbs < 1:
        raise FlowRecipeError("the job has no --global-batch-size: a flow job plans each global batch")
    for flag in ("--virtual-pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage"):
        if argv_value(argv, flag):
            raise FlowRecipeError(f"{flag}: interleaved pipelines are not supported by the flow decoder yet")
    if not model.encoder_trainable and "--use-distributed-optimizer" not in argv:
        raise FlowRecipeError("model.json freezes the whole image encoder, so its part has no trainable parameter: "
                              "run with --use-distributed-optimizer (MindSpeed-MM's placeholder optimizer for a part "
                              "without parameters fails in Megatron's non-distributed optimizer: no main_grad)")
    if model.audio and not model.audio_trainable and "audio" in (job.parallel.encoders or {}) and \
            "--use-distributed-optimizer" not in argv:
        raise FlowRecipeError("parallel.encoders.audio: model.json freezes the audio encoder, so its part has no "
                              "trainable parameter: run with --use-distributed-optimizer (MindSpeed-MM's placeholder "
                              "optimizer for a part without parameters needs it)")
    if job.packing.layout == "packed" and model.audio:
        raise FlowRecipeError("packing.layout=packed: model.json has an audio_encoder, and Qwen2.5-Omni's rope index "
                              "numbers a microbatch's positions from its audio clips too, so a packed row cannot "
                              "restart them per sample; set packing.layout: rows (auto picks rows)")
    if job.packing.layout == "packed" and "--use-flash-attn" not in argv:
        raise FlowRecipeError("packing.layout=packed needs the job's --use-flash-attn: a packed microbatch's samples "
                              "are kept apart by the flash-attention kernel's varlen (TND) layout; add the flag or "
                              "set packing.layout: rows")
    if "--hetero-parallel" in argv or "--dist-train" in argv:
        raise FlowRecipeError("--hetero-parallel / --dist-train: these are MindSpeed's own encoder/LLM splits; "
                              "a flow job replaces them, drop the flag")
    raw = OmegaConf.load(str(recipe_path))
    stated = OmegaConf.select(raw, "trainer.global_batch_size")
    parts = build_parts(job, world_size=world_size, model=model, global_batch_size=gbs, micro_batch_size=mbs,
                        recipe_name=Path(recipe_path).name,
                        recipe_global_batch_size=None if stated is None else int(stated))
    check_audio_sequence_parallel(argv, parts, model)
    check_resume_layout(argv, parts)
    run_dir = flow_run_dir(OmegaConf.select(raw, "run_dir"), argv)
    if job.trainer.trace and run_dir is None:
        raise FlowRecipeError(f"{Path(recipe_path).name}: trainer.trace=true: the trace goes to RUN_DIR/trace.json but "
                              "the job has no run directory; set run_dir in the recipe, or give the job "
                              "--tensorboard-dir or --save")
    return replace(parts, run_dir=run_dir, trace=bool(job.trainer.trace))


def check_audio_sequence_parallel(argv: list[str], parts: FlowParts, model: ModelShape) -> None:
    """Sequence parallelism where Qwen2.5-Omni's audio encoder runs at TP > 1: refused before any rank starts unless
    model.json turns it off for that module. MindSpeed-MM's audio encoder never splits its frames over the TP ranks,
    so with its section's sequence_parallel taken from --sequence-parallel its layers gather and reduce-scatter a
    whole sequence ("First dimension of the tensor should be divisible by tensor parallel size"; the unpatched job
    fails the same way). With `"sequence_parallel": false` in that section (MindSpeed-MM's get_model_config lets a
    module's own keys win) its layers run plain TP, and the job matches the unpatched one. MC2 cannot run there at
    all: MindSpeed checks every module's config, and refuses MC2 in one without sequence parallelism. An audio part
    at tp 1 needs neither: sequence parallelism is off in a part without TP."""
    if not model.audio or "--sequence-parallel" not in argv:
        return
    audio = next((p for p in parts.layout.parts if p.name == AUDIO), parts.layout.parts[-1])
    if audio.tp == 1:
        return
    where = ("parallel.encoders.audio.tp" if audio.name == AUDIO else
             "parallel.backbone.tp (the audio encoder runs on the decoder's first stage)") + f"={audio.tp}"
    own_part = "give the audio encoder its own part at tp 1 (parallel.encoders: {vision: ..., audio: {tp: 1, ...}})"
    if "--use-ascend-mc2" in argv:
        raise FlowRecipeError(f"--use-ascend-mc2 with Qwen2.5-Omni's audio encoder at {where}: MindSpeed's MC2 needs "
                              "sequence parallelism in every TP module, and MindSpeed-MM's audio encoder cannot run "
                              f"it (it never splits its frames over TP; the unpatched job fails too); {own_part}")
    if model.audio_sequence_parallel is not False:
        raise FlowRecipeError(f"--sequence-parallel with Qwen2.5-Omni's audio encoder at {where}: MindSpeed-MM's "
                              "audio encoder never splits its frames over TP, so its sequence-parallel layers fail "
                              "('First dimension of the tensor should be divisible by tensor parallel size'; the "
                              f"unpatched job too); add \"sequence_parallel\": false to {model.source}'s "
                              f"audio_encoder.audio_encoder (its layers then run plain TP), or {own_part}")


def check_resume_layout(argv: list[str], parts: FlowParts) -> None:
    """A flow checkpoint under --load whose parts were saved in another TP/PP than the recipe's: refused before any
    rank starts unless the job loads weights only (each rank then reads its share, re-split)."""
    load = argv_value(argv, "--load")
    if not load:
        return
    # lazy: the checkpoint module needs torch, which the launcher's checks (`mindspeed-flow emulate`) otherwise skip
    from mindspeed_flow.hosts.mindspeed_mm import checkpoint

    saved = checkpoint.saved_layouts(load, int(argv_value(argv, "--ckpt-step", "0") or 0) or None)
    moved = []
    for p in parts.layout.parts:
        module = checkpoint.module_of(p.name)
        if module in saved and saved[module] != (p.tp, p.pp):
            tp, pp = saved[module]
            moved.append(f"{module} at TP {tp} PP {pp} (the recipe: TP {p.tp} PP {p.pp})")
    if moved and not checkpoint.weights_only("--finetune" in argv, "--no-load-optim" in argv, "--no-load-rng" in argv):
        raise FlowRecipeError(f"--load {load}: saved with {', '.join(moved)}; {checkpoint.RESPLIT_HINT}")


def flow_run_dir(stated: Optional[str], argv: list[str]) -> Optional[str]:
    """Where a flow job writes metrics.jsonl and trace.json (absolute; relative paths from the launch folder, as
    Megatron reads its own): the recipe's `run_dir` when it states one (the schema's default is the torch
    host's), else the folder holding `--tensorboard-dir`, else the folder holding `--save`; None: no run folder,
    nothing written."""
    if stated:
        return str(Path(stated).resolve())
    for flag in ("--tensorboard-dir", "--save"):
        value = argv_value(argv, flag)
        if value:
            return str(Path(value).resolve().parent)
    return None
