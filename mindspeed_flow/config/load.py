"""Compose a job config from the recipe tree (Hydra compose API) and check the rules that span several fields.

`mindspeed-flow train` composes in the launching process, writes the resolved config to RUN_DIR/config.yaml and
every worker reads that file: all ranks see the same config, and a run directory records exactly what ran.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from mindspeed_flow.config.schema import FlowJobConfig, register_configs
from mindspeed_flow.model_presets import hf_config_dict, load_config_json
from mindspeed_flow.resources import data_path
from mindspeed_flow.specs import DEEPSTACK_FAMILIES, encoder_parts
from mindspeed_flow.utils.usage import nearest, unknown_key


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the field and the rule."""


def recipes_dir() -> Path:
    """The Hydra recipe tree: $MSF_RECIPES, else the package's (mindspeed_flow.resources: recipes/ at the
    repository root, or inside an installed wheel)."""
    env = os.environ.get("MSF_RECIPES")
    if env:
        return Path(env).resolve()
    return data_path("recipes").resolve()


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return cfg


def known_keys() -> list[str]:
    """Every dotted key a `train` override may set (the schema's fields) and the recipe groups (experiment=, ...)."""
    keys: list[str] = []

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                keys.append(prefix + str(k))
                walk(v, f"{prefix}{k}.")

    walk(OmegaConf.to_container(OmegaConf.structured(FlowJobConfig)), "")
    return keys + [d.name for d in recipes_dir().iterdir() if d.is_dir()]


def explain_override_error(exc: Exception) -> str | None:
    """One line for an override Hydra / OmegaConf refused: an unknown key with the nearest valid one, a value of
    the wrong type with the field and the type, an unknown recipe with the nearest one; None for anything else."""
    if isinstance(exc, MissingConfigException) and exc.options and exc.missing_cfg_file:
        group, _, name = str(exc.missing_cfg_file).rpartition("/")
        guess = nearest(name, exc.options)
        hint = f"did you mean {group}={guess}?" if guess else f"recipes: {', '.join(exc.options)}"
        return f"{group}={name}: no such recipe in recipes/{group}/; {hint}"
    err: BaseException | None = exc
    while err is not None:
        key = getattr(err, "full_key", None)
        if key and isinstance(err, (ConfigAttributeError, ConfigKeyError)):
            return str(unknown_key(key, known_keys(), see="the fields are recipes/config.yaml's and its groups'"))
        if key and isinstance(err, ValidationError):
            return f"{key}: {str(getattr(err, 'msg', err)).splitlines()[0]}"
        err = err.__cause__
    return None


def to_job_config(cfg: DictConfig) -> FlowJobConfig:
    """Typed view of a composed config (validates every key and type against the dataclass schema)."""
    typed = OmegaConf.merge(OmegaConf.structured(FlowJobConfig), cfg)
    return OmegaConf.to_object(typed)  # type: ignore[return-value]


def save(cfg: FlowJobConfig | DictConfig, path: str | os.PathLike) -> None:
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(node, str(path), resolve=True)


def load(path: str | os.PathLike) -> FlowJobConfig:
    return to_job_config(OmegaConf.load(str(path)))


def model_hf_config(job: FlowJobConfig) -> dict:
    """The HF config.json dict of the job's model: a local checkpoint's, else the preset's with overrides."""
    if job.model.pretrained_path:
        return load_config_json(job.model.pretrained_path)
    return hf_config_dict(job.model.family, job.model.preset, dict(job.model.hf_overrides))


def encoder_inflight_error(job: FlowJobConfig) -> str:
    """Why the torch host cannot run `flow.encoder_inflight` with this job ('' when it can).

    The bound counts consumer microbatch slots (see `StepEngine._produce`). A trainable encoder at the bound
    waits for its oldest slot's gradients, which a consumer returns only after that slot's backward: without a
    backbone pipeline that needs the slot itself (any bound >= 1 is safe); under 1F1B the first stage forwards
    min(pp, microbatches) microbatches before its first backward, so the bound must be >= parallel.backbone.pp;
    GPipe forwards the whole step first, so no bound below the step's (varying) microbatch count is safe. A
    frozen encoder holds nothing (the pool's credits bound what it sends) and coupled ranks hold one
    microbatch's graph, so the bound does not apply there. 0 keeps the whole step held: it is safe for every
    layout (GPipe included) and leaves the default run's schedule and timing unchanged."""
    f, bb = job.flow, job.parallel.backbone
    value = f.encoder_inflight
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return (f"flow.encoder_inflight={value!r}: must be an integer >= 0 (consumer microbatch slots an encoder "
                "rank holds graphs of; 0: the whole step)")
    if value == 0 or f.mode != "decoupled" or job.model.freeze_encoder or bb.pp <= 1:
        return ""
    if job.parallel.pp_schedule == "gpipe":
        return (f"flow.encoder_inflight={value} with parallel.pp_schedule='gpipe' and parallel.backbone.pp={bb.pp}: "
                "GPipe forwards every microbatch of the step before the first gradient comes back, so the encoder "
                "must hold the whole step; use parallel.pp_schedule=1f1b or flow.encoder_inflight=0")
    if value < bb.pp:
        return (f"flow.encoder_inflight={value}: must be >= parallel.backbone.pp={bb.pp} (1F1B: the backbone's "
                f"first stage forwards {bb.pp} microbatches before the first gradient comes back; a smaller bound "
                "deadlocks) or 0 (the whole step)")
    return ""


def check_rules(job: FlowJobConfig) -> None:
    """Cross-field rules of the training recipe (layout rules live in step.layout.Layout.validate)."""
    t, p, f, d = job.trainer, job.packing, job.flow, job.data
    rules = [
        (t.steps >= 1, f"trainer.steps={t.steps}: must be >= 1"),
        (t.lr > 0, f"trainer.lr={t.lr}: must be > 0"),
        (t.grad_clip >= 0, f"trainer.grad_clip={t.grad_clip}: must be >= 0 (0 disables clipping)"),
        (p.token_budget >= 16, f"packing.token_budget={p.token_budget}: must be >= 16 tokens"),
        (p.oversize_policy in ("error", "skip"), f"packing.oversize_policy={p.oversize_policy!r}: 'error' or 'skip'"),
        (f.mode in ("decoupled", "coupled"), f"flow.mode={f.mode!r}: must be 'decoupled' or 'coupled'"),
        (f.timeout_s > 0, f"flow.timeout_s={f.timeout_s}: must be > 0"),
        (f.pool_capacity_mb > 0, f"flow.pool_capacity_mb={f.pool_capacity_mb}: must be > 0"),
        (f.encoder_batch_tokens >= 0, f"flow.encoder_batch_tokens={f.encoder_batch_tokens}: must be >= 0 "
                                      f"(0: one sample per encoder forward)"),
        (not f.fix_sp_embedding_grad, "flow.fix_sp_embedding_grad=true: a fix for MindSpeed-MM's VLMModel under "
                                      "sequence parallelism (its pretrain_vlm.py flow job); the torch host's embeddings "
                                      "have no such gather"),
        (job.model.dtype in ("float32", "bfloat16", "float16"),
         f"model.dtype={job.model.dtype!r}: float32, bfloat16 or float16"),
        (d.min_pixels <= d.max_pixels, f"data.min_pixels={d.min_pixels} > data.max_pixels={d.max_pixels}"),
        (d.num_samples >= t.global_batch_size,
         f"data.num_samples={d.num_samples} < trainer.global_batch_size={t.global_batch_size}"),
        (job.parallel.backbone_dp_impl in ("ddp", "fsdp"),
         f"parallel.backbone_dp_impl={job.parallel.backbone_dp_impl!r}: 'ddp' or 'fsdp'"),
        (p.pad_multiple >= 0, f"packing.pad_multiple={p.pad_multiple}: must be >= 0"),
        (p.layout in ("auto", "packed"),
         f"packing.layout={p.layout!r}: the torch host always packs its microbatches (varlen attention); 'rows' is "
         "the MindSpeed-MM host's comparison layout"),
        (p.step_mode in ("samples", "packs", "window"),
         f"packing.step_mode={p.step_mode!r}: 'samples', 'packs' or 'window'"),
        (p.lookahead >= (0 if p.step_mode == "window" else 1),
         f"packing.lookahead={p.lookahead}: must be >= 1 sample (0 = trainer.global_batch_size with step_mode=window)"),
        (p.packs_per_rank >= 0, f"packing.packs_per_rank={p.packs_per_rank}: must be >= 0 (0: the pipeline size)"),
        (p.step_mode != "packs" or p.scheduler == "flow",
         f"packing.scheduler={p.scheduler!r}: packing.step_mode=packs runs the flow streaming packer; use 'flow'"),
        (p.step_mode != "packs" or p.lookahead < d.num_samples,
         f"packing.lookahead={p.lookahead}: packing.step_mode=packs needs it below data.num_samples={d.num_samples} "
         f"(a sample cannot wait in the buffer while its next epoch's copy arrives)"),
        (p.step_mode != "packs" or p.pad_multiple == 0,
         f"packing.pad_multiple={p.pad_multiple}: packing.step_mode=packs pads every pack to token_budget; use 0"),
        (p.step_mode != "window" or p.scheduler == "flow",
         f"packing.scheduler={p.scheduler!r}: packing.step_mode=window runs the flow streaming packer; use 'flow'"),
        (p.step_mode != "window" or p.lookahead <= t.global_batch_size,
         f"packing.lookahead={p.lookahead}: packing.step_mode=window needs it <= trainer.global_batch_size="
         f"{t.global_batch_size} (the samples a step leaves in the pool must fit the next step)"),
        (p.step_mode != "window" or (p.lookahead or t.global_batch_size) + t.global_batch_size < d.num_samples,
         f"packing.lookahead={p.lookahead}: packing.step_mode=window needs lookahead (0: trainer.global_batch_size) "
         f"+ trainer.global_batch_size={t.global_batch_size} below data.num_samples={d.num_samples} (the pool holds "
         f"that many distinct samples)"),
        (p.step_mode != "window" or p.packs_per_rank == 0,
         f"packing.packs_per_rank={p.packs_per_rank}: packing.step_mode=window makes as many packs as the step's "
         f"samples need; use 0"),
        (job.parallel.pp_schedule in ("gpipe", "1f1b"),
         f"parallel.pp_schedule={job.parallel.pp_schedule!r}: 'gpipe' or '1f1b'"),
        (0.0 <= d.max_bad_fraction <= 1.0, f"data.max_bad_fraction={d.max_bad_fraction}: must be in [0, 1]"),
        (t.nan_policy in ("stop", "skip"), f"trainer.nan_policy={t.nan_policy!r}: 'stop' or 'skip'"),
        (t.max_nonfinite_steps >= 0, f"trainer.max_nonfinite_steps={t.max_nonfinite_steps}: must be >= 0"),
        (t.max_restarts >= 0, f"trainer.max_restarts={t.max_restarts}: must be >= 0"),
        (t.on_save_error in ("stop", "continue"), f"trainer.on_save_error={t.on_save_error!r}: 'stop' or 'continue'"),
        (t.stop_grace_s >= 1, f"trainer.stop_grace_s={t.stop_grace_s}: must be >= 1 (seconds)"),
        (not (t.resume and t.overwrite), "trainer.resume=true and trainer.overwrite=true: choose one (resume "
                                         "continues the run in run_dir, overwrite starts a new one there)"),
        (job.faults.truncate_file in ("distcp", "metadata"),
         f"faults.truncate_file={job.faults.truncate_file!r}: 'distcp' or 'metadata'"),
        (job.parallel.tp_overlap in ("auto", "mc2", "chunked", "plain"),
         f"parallel.tp_overlap={job.parallel.tp_overlap!r}: 'auto', 'mc2', 'chunked' or 'plain'"),
        (job.parallel.tp_overlap_chunks >= 1,
         f"parallel.tp_overlap_chunks={job.parallel.tp_overlap_chunks}: must be >= 1"),
        (not (job.parallel.backbone.tp > 1 and job.parallel.backbone.dp > 1 and
              job.parallel.backbone_dp_impl == "fsdp" and f.mode == "decoupled"),
         f"parallel.backbone_dp_impl='fsdp' with parallel.backbone.tp={job.parallel.backbone.tp}: the torch host "
         "shards over DP with FSDP2 only without TP; use 'ddp' with tp > 1"),
    ]
    for ok, msg in rules:
        if not ok:
            raise RecipeError(msg)
    deepstack = deepstack_layout_error(job)
    if deepstack:
        raise RecipeError(deepstack)
    inflight = encoder_inflight_error(job)
    if inflight:
        raise RecipeError(inflight)
    check_encoder_parts(job)


def deepstack_layout_error(job: FlowJobConfig) -> str:
    """Qwen3-VL's deepstack maps are added after the first LLM layers and its ViT and MoE blocks have no TP plan
    here: the torch host trains it with DP/FSDP in every part, no TP, no pipeline ('' when the layout fits)."""
    if job.model.family not in DEEPSTACK_FAMILIES:
        return ""
    p = job.parallel
    for field, value in (("parallel.encoder.tp", p.encoder.tp), ("parallel.backbone.tp", p.backbone.tp),
                         ("parallel.backbone.pp", p.backbone.pp), ("parallel.coupled.pp", p.coupled.pp)):
        if value > 1:
            return (f"{field}={value} with model.family={job.model.family!r}: the torch host trains Qwen3-VL "
                    "(deepstack) with data parallel parts only (DDP or FSDP2); use 1")
    return ""


def check_encoder_parts(job: FlowJobConfig) -> None:
    """`parallel.encoders` must name exactly the model's encoder parts; raises RecipeError naming the field."""
    want = encoder_parts(job.model.family)
    got = list((job.parallel.encoders or {}).keys())
    if len(want) == 1 and got:
        raise RecipeError(f"parallel.encoders={got}: model.family={job.model.family!r} has one encoder part; "
                         "use parallel.encoder (parallel.encoders is for models with several encoders)")
    sized_coupled = job.flow.mode == "coupled" and int(getattr(job.parallel, "world_size", 0) or 0) > 0
    if len(want) > 1:
        # a coupled job sized by parallel.world_size runs the whole model on every rank: no encoder part layouts
        if sorted(got) != sorted(want) and not (sized_coupled and not got):
            raise RecipeError(f"parallel.encoders={got}: model.family={job.model.family!r} has the encoder parts "
                             f"{list(want)}; give each one a layout (e.g. {{{want[0]}: {{dp: 1}}, ...}})")
        if job.flow.mode == "coupled" and job.parallel.coupled.pp > 1:
            # the coupled pipeline's stage 0 runs one encoder (the ViT) inside the stage module
            raise RecipeError(f"parallel.coupled.pp={job.parallel.coupled.pp} with several encoder parts "
                             "(parallel.encoders): the torch host's coupled pipeline holds one encoder; use pp 1")
