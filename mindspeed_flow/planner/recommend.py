"""What `plan` recommends: the decoupled plan, or a baseline's layout when that one is predicted faster.

Following the tool must never lose throughput: when a baseline the planned job can run beats the decoupled plan,
the recommendation (first line of the report, the recipe `--out` writes, `--json`'s "recommended") is that
baseline's layout, and the decoupled plan's own figures stay beside it. What each job can run of a baseline:

- `mm`: a coupled baseline (`megatron_coupled`, `coupled_uniform`, and `mindspeed_mm_hetero`, the coupled
  pipeline with --hetero-parallel and the ViT's own TP) is the unpatched MindSpeed-MM job itself: the
  recipe says `flow.mode: coupled` with the layout in `parallel.coupled`, the launch script runs `pretrain_vlm.py`
  without the flow launcher, and the MindSpeed-MM flags and model.json settings are printed.
- `torch`: a coupled baseline with TP, CP and recompute off (the torch host's coupled mode runs DP x PP, the ViT
  on stage 0; with several encoder parts, the Omni thinker's, DP only).
Baselines the job cannot run (hetero-parallel, dist-train, a coupled layout with TP on the torch host) are still
reported, and if one of them is the strongest the first line says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mindspeed_flow.planner.baselines import BaselineResult
from mindspeed_flow.planner.jobs import job_rules
from mindspeed_flow.planner.plan import Plan
from mindspeed_flow.planner.report import recipe_head

COUPLED = ("megatron_coupled", "coupled_uniform", "mindspeed_mm_hetero")


@dataclass
class Recommendation:
    name: str  # "decoupled" or a baseline's name
    samples_per_s: float
    mfu: float
    devices: int
    baseline: BaselineResult | None = None  # the baseline whose layout is recommended
    settings: list[str] = field(default_factory=list)  # MindSpeed-MM flags and model.json settings (mm coupled)

    @property
    def coupled(self) -> dict | None:
        return None if self.baseline is None else self.baseline.layout.get("coupled")


def runnable(b: BaselineResult, job: str, encoders: int = 1) -> bool:
    """Whether the planned job runs this baseline's layout as it was priced (`encoders`: the model's encoder
    parts; the torch host's coupled pipeline holds one, so with several it runs coupled with pp 1 only)."""
    row = b.layout.get("coupled")
    if b.name not in COUPLED or row is None or not b.applies:
        return False
    if job == "mm":
        return True
    if job == "torch":  # no TP, CP or recompute, and the ViT on the job's (DP-only) layout
        return (row["tp"] == 1 and row["cp"] == 1 and not row["rc"] and not row.get("vit_rc")
                and row.get("vit_tp", 1) == 1 and (encoders == 1 or row["pp"] == 1))
    return False


def mm_coupled_settings(row: dict, vit_layers: int, audio_layers: int = 0) -> list[str]:
    """MindSpeed-MM flags and model.json settings of a coupled layout (the unpatched job); `audio_layers` > 0: an
    audio encoder, priced whole on the first stage."""
    flags = [f"--tensor-model-parallel-size {row['tp']}", f"--pipeline-model-parallel-size {row['pp']}"]
    if row["cp"] > 1:
        flags += [f"--context-parallel-size {row['cp']}", "--context-parallel-algo ulysses_cp_algo"]
    if row.get("vit_tp", row["tp"]) != row["tp"]:  # the ViT on a TP of its own: MindSpeed-MM's hetero-parallel
        flags.append("--hetero-parallel")
    out = ["MindSpeed-MM flags: " + " ".join(flags + ["--use-distributed-optimizer"])]
    if "--hetero-parallel" in flags:
        out.append(f"model.json image_encoder.vision_encoder: tp: {row['vit_tp']} (its own TP under "
                   "--hetero-parallel)")
    layers = row.get("layers") or []
    if row["pp"] > 1 and layers:
        out.append(f"model.json text_decoder.pipeline_num_layers: {list(layers)}; image_encoder.vision_encoder."
                   f"pipeline_num_layers: {[vit_layers] + [0] * (row['pp'] - 1)}"
                   + (f"; audio_encoder.audio_encoder.pipeline_num_layers: {[audio_layers] + [0] * (row['pp'] - 1)}"
                      if audio_layers else ""))
    if row["cp"] > 1:
        out.append("model.json image_encoder.vision_encoder.use_vit_dp: true (the microbatch's images split over "
                   "the CP ranks)")
    full = "recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1"
    if row.get("rc"):
        out.append(f"model.json text_decoder: {full}")
    if row.get("vit_rc"):
        out.append(f"model.json image_encoder.vision_encoder: {full}")
        if audio_layers:
            out.append(f"model.json audio_encoder.audio_encoder: {full}")
    return out


def recommend(plan: Plan) -> Recommendation:
    """The fastest of the decoupled plan and the baselines the planned job runs (ties: the decoupled plan)."""
    job = job_rules(plan.problem.cfg.job).name
    best = Recommendation("decoupled", plan.samples_per_s, plan.mfu, plan.devices)
    encoders = sum(p.role == "encoder" for p in plan.problem.parts)
    for b in plan.baselines.values():
        if b is not None and runnable(b, job, encoders) and b.samples_per_s > best.samples_per_s:
            best = Recommendation(b.name, b.samples_per_s, b.mfu, b.devices, b)
    if best.baseline is not None and job == "mm":
        enc = next((p for p in plan.problem.parts if p.role == "encoder"), None)
        audio = next((p for p in plan.problem.parts if p.name == "audio"), None)
        best.settings = mm_coupled_settings(best.coupled or {}, enc.layers if enc else 0,
                                            audio.layers if audio else 0)
    return best


def gain(value: float, plan: Plan) -> float | None:
    b = plan.strongest_baseline
    return None if b is None else value / b.samples_per_s


def first_line(plan: Plan, rec: Recommendation) -> str:
    """The report's first line: what to run, its gain over the strongest baseline, the decoupled plan beside it."""
    strong = plan.strongest_baseline
    g_rec, g_dec = gain(rec.samples_per_s, plan), gain(plan.samples_per_s, plan)
    versus = "" if strong is None else f" over the strongest baseline ({strong.name} {strong.samples_per_s:.4g}/s)"
    if rec.baseline is None:
        head = (f"recommended: the decoupled plan, {rec.samples_per_s:.4g} samples/s"
                + ("" if g_rec is None else f", x{g_rec:.2f}{versus}"))
        if strong is not None and g_rec is not None and g_rec < 1:
            head += (f"; {strong.name} is predicted faster but {job_rules(plan.problem.cfg.job).label} cannot run "
                     "its layout")
        return head
    how = "the unpatched MindSpeed-MM job" if job_rules(plan.problem.cfg.job).name == "mm" else "the coupled torch job"
    return (f"recommended: the {rec.name} layout as {how}, {rec.samples_per_s:.4g} samples/s, x{g_rec:.2f}{versus}: "
            f"it beats the decoupled plan ({plan.samples_per_s:.4g} samples/s, x{g_dec:.2f})")


def to_json(plan: Plan, rec: Recommendation) -> dict:
    strong = plan.strongest_baseline
    return {
        "recommended": {"name": rec.name, "samples_per_s": rec.samples_per_s, "mfu": rec.mfu,
                        "mfu_cluster": rec.mfu * rec.devices / max(plan.problem.budget, 1), "devices": rec.devices,
                        "gain_over_strongest": gain(rec.samples_per_s, plan),
                        "layout": None if rec.baseline is None else rec.baseline.layout, "settings": rec.settings},
        "decoupled": {"samples_per_s": plan.samples_per_s, "mfu": plan.mfu, "mfu_cluster": plan.mfu_cluster,
                      "devices": plan.devices,
                      "gain_over_strongest": gain(plan.samples_per_s, plan)},
        "strongest_applicable_baseline": None if strong is None else strong.name,
    }


def coupled_recipe(plan: Plan, rec: Recommendation, name: str, model_recipe: str | None, data_recipe: str | None,
                   model_inline: dict | None = None, data_inline: dict | None = None) -> str:
    """The experiment recipe of a recommended coupled baseline (flow.mode: coupled, the layout in parallel.coupled)."""
    pr = plan.problem
    row = rec.coupled or {}
    job = job_rules(pr.cfg.job).name
    lines = ["# @package _global_", f"# mindspeed-flow train experiment={name}" if job == "torch" else
             f"# mindspeed-flow launch-script {name}.yaml --job mm (runs the unpatched MindSpeed-MM job)",
             f"# Written by `mindspeed-flow plan --job {job}` for {pr.model_name} on {pr.cluster.name}: the baseline "
             f"{rec.name} is predicted at {rec.samples_per_s:.4g} samples/s (MFU {100 * rec.mfu:.1f}%) on "
             f"{rec.devices} devices, the decoupled plan at {plan.samples_per_s:.4g} samples/s: this recipe is the "
             "coupled layout."]
    lines += [f"# {s}" for s in rec.settings]
    lines += recipe_head(pr, name, model_recipe, data_recipe, model_inline, data_inline)
    split = f", layer_split: {list(row['layers'])}" if row.get("pp", 1) > 1 and row.get("layers") else ""
    sizes = f"pp: {row['pp']}" + (f", tp: {row['tp']}, cp: {row['cp']}" if job == "mm" else "")
    lines += ["parallel:", f"  coupled: {{{sizes}{split}}}", f"  world_size: {rec.devices}",
              "flow:", "  mode: coupled", "trainer:", f"  global_batch_size: {pr.global_batch}",
              "packing:", f"  token_budget: {row['b']}"]
    return "\n".join(lines) + "\n"
