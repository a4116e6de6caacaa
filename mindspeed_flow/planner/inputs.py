"""Turning `plan`/`profile` arguments (cluster=, model=, data=, devices=, overrides) into a `Problem`.

model= accepts a model recipe name (recipes/model/NAME.yaml: family + preset, or pretrained_path), a local
checkpoint directory or config.json path, or FAMILY:PRESET (e.g. qwen2_5_vl:72b). The training precision
follows the model recipe's dtype (float32 -> fp32 memory model); `planner.FIELD=VALUE` overrides any
PlannerConfig field, `parallel.encoder.tp=2` / `parallel.backbone.pp=4` (train's names; `encoder.tp=2` and
`backbone.pp=4` are short aliases) pin a layout field of a part; `parallel.audio.tp=2` (or `audio.tp=2`,
`parallel.encoders.audio.tp=2`) pins the audio encoder part of a three-part plan (`parallel.encoders.vision.*` is
the vision encoder, `encoder.*`). `trainer.global_batch_size=` and
`model.freeze_encoder=` are accepted for `global_batch=` and `freeze_encoder=`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import yaml

from mindspeed_flow.config.planner import PlannerConfig
from mindspeed_flow.config.schema import ModelConfig
from mindspeed_flow.model_presets import hf_config_dict, load_config_json
from mindspeed_flow.planner.cost import LAYOUT_FIELDS
from mindspeed_flow.planner.hardware import Cluster, load_cluster, recipes_dir
from mindspeed_flow.planner.jobs import job_rules, mm_audio_rules
from mindspeed_flow.planner.parts import vlm_parts
from mindspeed_flow.planner.plan import Problem
from mindspeed_flow.planner.space import PlanError
from mindspeed_flow.planner.workload import BUILTIN_DATA, PLAN_ONLY_DATA, load_workload
from mindspeed_flow.specs import VLMSpec
from mindspeed_flow.utils.usage import UsageError, typed, unknown_key

DEFAULTS = {"cluster": "atlas_900_a3_384", "model": "qwen2_5_vl_72b", "data": "infovqa"}
_PIN_ALIASES = {"token_budget": "b", "recompute": "rc"}


@dataclass
class ModelRef:
    name: str
    hf_config: dict
    recipe: str | None  # recipes/model/NAME.yaml, when model= named one
    inline: dict | None  # model fields for a recipe when there is no model recipe
    dtype: str  # ModelConfig.dtype
    freeze_encoder: bool


def resolve_model(model: str) -> ModelRef:
    path = os.path.join(recipes_dir(), "model", f"{model}.yaml")
    if os.path.exists(path):
        raw = yaml.safe_load(open(path)) or {}
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        bad = sorted(set(raw) - known)
        if bad:
            raise PlanError(f"{path}: unknown model field(s) {bad}")
        mc = ModelConfig(**raw)
        cfg = (load_config_json(mc.pretrained_path) if mc.pretrained_path
               else hf_config_dict(mc.family, mc.preset, mc.hf_overrides))
        return ModelRef(model, cfg, model, None, mc.dtype, bool(mc.freeze_encoder))
    if os.path.exists(model):
        cfg = load_config_json(model)
        family = cfg.get("model_type", "qwen2_vl")
        inline = {"family": family, "preset": "local", "pretrained_path": os.path.abspath(model),
                  "dtype": "bfloat16"}
        return ModelRef(os.path.basename(os.path.abspath(model)), cfg, None, inline, "bfloat16", False)
    if ":" in model:
        family, preset = model.split(":", 1)
        cfg = hf_config_dict(family, preset)
        dtype = "float32" if preset == "tiny" else "bfloat16"
        return ModelRef(f"{family}_{preset}", cfg, None, {"family": family, "preset": preset, "dtype": dtype},
                        dtype, False)
    known = sorted(f[:-5] for f in os.listdir(os.path.join(recipes_dir(), "model")) if f.endswith(".yaml"))
    raise PlanError(f"model={model!r}: not a model recipe, a config.json path or FAMILY:PRESET; recipes: {known}")


def data_recipe_fields(data: str) -> tuple[str | None, dict | None]:
    """How an experiment recipe refers to `data=`: a recipe name, or inline fields."""
    if data in PLAN_ONLY_DATA:  # shapes only: no dataset the hosts could train on
        raise ValueError(f"data={data}: a planning workload (sample shapes only), which no host trains from; --out "
                         "needs a data recipe or a length table (a CSV of the real data's shapes)")
    if data in BUILTIN_DATA:
        return None, dict(BUILTIN_DATA[data])
    if data.endswith(".csv"):
        return None, {"source": "length_table", "path": os.path.abspath(data)}
    if os.path.exists(os.path.join(recipes_dir(), "data", f"{data}.yaml")):
        return data, None
    return None, yaml.safe_load(open(data))


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def apply_planner_overrides(cfg: PlannerConfig, overrides: Mapping[str, Any]) -> PlannerConfig:
    known = {f.name for f in dataclasses.fields(PlannerConfig)}
    for key in overrides:
        if key not in known:
            raise unknown_key(f"planner.{key}", (f"planner.{k}" for k in known), "planner field")
    return dataclasses.replace(cfg, **dict(overrides))


def load_profile(cfg: PlannerConfig) -> PlannerConfig:
    """Apply a profile table (JSON written by `mindspeed-flow profile`) to the planner config."""
    if not cfg.profile:
        return cfg
    with open(cfg.profile) as f:
        table = json.load(f)
    calib = table.get("calibration", table)
    fields = {k: calib[k] for k in ("seconds_per_flop", "microbatch_overhead_s", "item_overhead_s",
                                     "step_overhead_s") if k in calib}
    if "spread" in calib:
        fields["calibration_spread"] = dict(calib["spread"])
    return dataclasses.replace(cfg, **fields)


def apply_profile_links(cluster: Cluster, cfg: PlannerConfig) -> Cluster:
    """The profile's measured link (bandwidth, latency) replaces the preset's figures for every link."""
    if not cfg.profile:
        return cluster
    with open(cfg.profile) as f:
        link = json.load(f).get("calibration", {}).get("link")
    if not link:
        return cluster
    c = cluster.config
    fields = {"intra_node_gbps": link["gbps"], "inter_node_gbps": link["gbps"],
              "intra_node_latency_us": link["latency_us"], "inter_node_latency_us": link["latency_us"]}
    if c.devices_per_pod:
        fields.update(scale_out_gbps=link["gbps"], scale_out_latency_us=link["latency_us"])
    measured = {k: {"source": f"measured by mindspeed-flow profile ({cfg.profile})"} for k in fields}
    return Cluster(dataclasses.replace(c, **fields, link_sources={**dict(c.link_sources), **measured}))


def default_planner_config(cluster: Cluster, model: ModelRef) -> PlannerConfig:
    """CPU clusters train fp32 with eager attention and plain DDP; accelerators bf16, fused attention, ZeRO-1."""
    on_cpu = cluster.config.backend == "cpu"
    fp32 = model.dtype == "float32"
    return PlannerConfig(dtype="fp32" if fp32 else "bf16", flash_attention=not on_cpu,
                         distributed_optimizer=not on_cpu, freeze_encoder=model.freeze_encoder)


@dataclass
class PlanArgs:
    cluster: str
    model: str
    data: str
    devices: int | None
    planner: dict
    pins: dict
    samples: int


# plan's own keys, and the names `train` gives the same things (accepted as aliases)
TOP_KEYS = ("cluster", "model", "data", "devices", "global_batch", "freeze_encoder", "samples")
TRAIN_NAMES = {"trainer.global_batch_size": "global_batch", "model.freeze_encoder": "freeze_encoder"}
PART_NAMES = ("encoder", "audio", "backbone")
# a MindSpeed-MM recipe's `parallel.encoders` keys -> the planner's part names
ENCODER_KEYS = {"vision": "encoder", "audio": "audio"}


def _pin_key(key: str) -> tuple[str, str] | None:
    """(part, layout field) of a pin: `parallel.backbone.cp` (train's name) or its short form `backbone.cp`;
    `parallel.encoders.vision.tp` / `parallel.encoders.audio.tp` (a MindSpeed-MM recipe's names) too."""
    parts = key.split(".")
    if parts[0] == "parallel":
        parts = parts[1:]
    if len(parts) == 3 and parts[0] == "encoders" and parts[1] in ENCODER_KEYS:
        parts = [ENCODER_KEYS[parts[1]], parts[2]]
    if len(parts) != 2 or parts[0] == "planner":
        return None
    return parts[0], parts[1]


def known_plan_keys() -> list[str]:
    fields = [*LAYOUT_FIELDS, *_PIN_ALIASES]
    return [*TOP_KEYS, *TRAIN_NAMES, *(f"planner.{f.name}" for f in dataclasses.fields(PlannerConfig)),
            *(f"{pre}{part}.{f}" for pre in ("parallel.", "") for part in PART_NAMES for f in fields)]


def parse_kv(argv: Sequence[str]) -> PlanArgs:
    """key=value arguments (flags are handled by the caller). An unknown key or a value of the wrong type is a
    UsageError naming it (and the nearest valid key), never a PlanError: nothing was planned yet."""
    kv: dict[str, str] = {}
    for a in argv:
        if "=" not in a:
            raise UsageError(f"argument {a!r}: expected key=value (cluster=, model=, data=, devices=, "
                             "planner.FIELD=, parallel.encoder.tp=, parallel.backbone.pp=, ...) or a --flag")
        k, v = a.split("=", 1)
        k = k.strip()
        kv[TRAIN_NAMES.get(k, k)] = v.strip()
    planner: dict[str, Any] = {}
    pins: dict[str, dict[str, int]] = {}
    args = PlanArgs(cluster=kv.pop("cluster", DEFAULTS["cluster"]), model=kv.pop("model", DEFAULTS["model"]),
                    data=kv.pop("data", DEFAULTS["data"]), devices=None, planner=planner, pins=pins,
                    samples=int(typed("samples", kv.pop("samples", "2048"), int)))
    if "devices" in kv:
        args.devices = int(typed("devices", kv.pop("devices"), int))
    if "global_batch" in kv:
        planner["global_batch_size"] = typed("global_batch", kv.pop("global_batch"), int)
    if "freeze_encoder" in kv:
        planner["freeze_encoder"] = bool(_parse_value(kv.pop("freeze_encoder")))
    planner_fields = {f.name for f in dataclasses.fields(PlannerConfig)}
    for k, v in kv.items():
        head, _, field = k.partition(".")
        pin = _pin_key(k)
        if head == "planner" and field in planner_fields:
            planner[field] = _parse_value(v)
        elif pin and pin[0] in PART_NAMES and pin[1] in (*LAYOUT_FIELDS, *_PIN_ALIASES):
            pins.setdefault(pin[0], {})[_PIN_ALIASES.get(pin[1], pin[1])] = int(typed(k, v, int))
        else:
            raise unknown_key(k, known_plan_keys(), see="the keys are listed by `mindspeed-flow plan --help`")
    return args


def build_problem(args: PlanArgs) -> tuple[Problem, ModelRef]:
    cluster = load_cluster(args.cluster)
    model = resolve_model(args.model)
    cfg = default_planner_config(cluster, model)
    cfg = load_profile(apply_planner_overrides(cfg, args.planner))
    cluster = apply_profile_links(cluster, cfg)
    workload = load_workload(args.data, model.hf_config, args.samples)
    spec = VLMSpec.from_hf_config(model.hf_config, name=model.name)
    family = str(model.hf_config.get("model_type") or "")
    rules = job_rules(cfg.job)
    if rules.shared_encoder_settings and spec.audio is not None and cfg.freeze_audio is not None \
            and cfg.freeze_audio != cfg.freeze_encoder:
        raise UsageError(f"planner.freeze_audio={cfg.freeze_audio} with freeze_encoder={cfg.freeze_encoder}: "
                         f"{rules.label} freezes its encoder parts together (model.freeze_encoder); leave "
                         "planner.freeze_audio unset")
    parts = vlm_parts(spec, workload.shapes, freeze_encoder=cfg.freeze_encoder, freeze_audio=cfg.freeze_audio,
                      audio_part_always=rules.shared_encoder_settings)
    if family in rules.dp_only:  # the job's host trains this family with data parallel parts only
        parts = [dataclasses.replace(p, tp_sizes=(1,), pp_sizes=(1,)) for p in parts]
    if rules.mm_audio and spec.audio is not None:
        parts = mm_audio_rules(parts, spec.audio.heads, cfg.distributed_optimizer)
    names = [p.name for p in parts]
    for name in args.pins:
        if name not in names:  # a part this model and workload do not have (e.g. audio without clips)
            raise UsageError(f"{name}.*: this plan has no {name} part; its parts are {', '.join(names)}"
                             + (" (an audio part needs a model with an audio encoder and a workload with audio "
                                "clips, e.g. data=infovqa_audio)" if name == "audio" else ""))
    budget = args.devices if args.devices is not None else cluster.devices
    if budget > cluster.devices:  # devices= beyond the preset: a bigger cluster of the same kind
        cluster = cluster.with_devices(budget)
    problem = Problem(parts=parts, cluster=cluster, cfg=cfg, budget=budget, fixed=args.pins,
                      model_name=model.name, data_name=workload.name, spec=spec,
                      family=family,
                      shapes=tuple(workload.shapes))
    return problem, model
