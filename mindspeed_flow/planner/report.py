"""What a plan prints and writes: the readable report, the JSON object, the Hydra experiment recipe, the plot.

The recipe is an *experiment* recipe (`# @package _global_`, `defaults: - override /model: ...`) holding the
chosen layout (parallel.encoder / parallel.backbone; with an audio part, `parallel.encoders: {vision: ..., audio:
...}` in MindSpeed-MM's rank order), the global batch, the packing token budget and whether the encoder keeps its
activations, so `mindspeed-flow train experiment=NAME` runs the plan unchanged once the file is in
recipes/experiment/ (or in the tree $MSF_RECIPES points at), and a MindSpeed-MM flow job takes it as its flow recipe.
"""
from __future__ import annotations

import os

from typing import Any

import numpy as np

from mindspeed_flow.planner.baselines import LOADER_NAMES, split_factors
from mindspeed_flow.planner.jobs import job_rules
from mindspeed_flow.planner.plan import Plan, Problem, option_table

MFU_FORMULA = ("MFU = model FLOPs per step (no recompute, no padding) / (step time x devices x peak), over the "
               "devices used and over the cluster's (idle ones included)")


def cluster_mfu(mfu: float, devices: int, plan: Plan) -> float:
    """An MFU over `devices` restated over every device the plan was given."""
    return mfu * devices / max(plan.problem.budget, 1)


def links_json(plan: Plan) -> list[dict[str, Any]]:
    """The network tiers the cost model prices, innermost first, each figure with its source or `assumed`."""
    c = plan.problem.cluster
    return [{"tier": t.name, "where": t.where, "max_span_devices": t.span or None, "gbps": t.gbps,
             "latency_us": t.latency_us, "gbps_source": c.provenance(t.figures[0]),
             "latency_source": c.provenance(t.figures[1])} for t in c.tiers()]


def links_lines(plan: Plan) -> list[str]:
    c = plan.problem.cluster
    out = [f"links ({c.pods} scale-up domain(s) of {c.devices_per_pod} devices)" if c.devices_per_pod else "links:"]
    for t in links_json(plan):
        out.append(f"  {t['tier']:<9} {t['gbps']:g} GB/s [{t['gbps_source']}], {t['latency_us']:g} us "
                   f"[{t['latency_source']}]: {t['where']}")
    if out[0] != "links:":
        out[0] += ":"
    return out


def _layout_str(layout: dict) -> str:
    s = f"dp={layout['dp']} tp={layout['tp']} pp={layout['pp']} cp={layout['cp']}"
    if int(layout.get("ep") or 1) > 1:  # MoE backbone: routed experts split over ep ranks
        s += f" ep={layout['ep']}"
    if layout.get("b"):
        s += f" token_budget={layout['b']}"
    s += {0: "", 1: " recompute", 2: " recompute=per-layer"}.get(int(layout.get("rc") or 0), " recompute")
    if layout.get("layers"):
        s += f" layers/stage={layout['layers']}"
    if "vit_tp" in layout:
        s += f" vit_tp={layout['vit_tp']}" + {0: "", 1: " vit_recompute", 2: " vit_recompute=per-layer"}[int(layout.get("vit_rc") or 0)]
    return s


def spread_of(plan: Plan) -> float:
    """Relative uncertainty of the prediction from the calibration (the bottleneck part's fit spread), or 0."""
    spread = dict(plan.problem.cfg.calibration_spread)
    if not spread:
        return 0.0
    slow = max(plan.parts, key=lambda p: p.step_seconds)
    return float(spread.get(slow.role, max(spread.values())))


def _range(plan: Plan, value: float, unit: str = "") -> str:
    s = spread_of(plan)
    return f" ({value / (1 + s):.3g}-{value / max(1 - s, 1e-9):.3g}{unit})" if s > 0 else ""


def assumed_inputs(plan: Plan) -> str:
    """Which cost-model inputs were measured (profile) and which are assumed (preset / defaults)."""
    cfg = plan.problem.cfg
    measured, assumed = [], []
    (measured if dict(cfg.seconds_per_flop) else assumed).append(
        "compute rate" + ("" if dict(cfg.seconds_per_flop) else f" (efficiency {dict(cfg.efficiency)} of peak)"))
    cluster = plan.problem.cluster
    unsourced = cluster.assumed_links()
    if any("measured by" in cluster.provenance(f) for f in ("intra_node_gbps", "inter_node_gbps")):
        measured.append("link bandwidth/latency")
    if unsourced:
        assumed.append(f"link figures {', '.join(unsourced)} (preset {cluster.name}, no public source)")
    assumed += [f"overlap {dict(cfg.overlap)}", f"packing fill {cfg.packing_fill}",
                f"memory headroom {cfg.memory_headroom}"]
    out = ("measured by profile: " + ", ".join(measured) + "; ") if measured else ""
    return out + "assumed: " + ", ".join(assumed)


def job_line(plan: Plan) -> str:
    """Which job the plan is for and what its search left out (empty: no job, every layout)."""
    rules = job_rules(plan.problem.cfg.job)
    if not rules.name:
        return ""
    return f"job: {rules.name} ({rules.label}); not searched: " + "; ".join(rules.skipped())


def mm_settings(parts) -> list[str]:
    """MindSpeed-MM model.json settings a flow job needs for the planned recompute (TransformerConfig fields,
    which MindSpeed-MM reads per module from model.json, not from the command line)."""
    full = "recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1"
    where = {"backbone": "text_decoder", "encoder": "image_encoder.vision_encoder",
             "audio": "audio_encoder.audio_encoder"}
    return [f"model.json {where[p.name]}: {full}" for p in parts if p.name in where and int(p.layout["rc"])]


# a MindSpeed-MM flow recipe's `parallel.encoders` key of each encoder part (the vision encoder is "encoder" here)
ENCODER_KEYS = {"encoder": "vision", "audio": "audio"}


def to_json(plan: Plan) -> dict[str, Any]:
    pr = plan.problem
    baselines = {}
    for name, b in plan.baselines.items():
        baselines[name] = None if b is None else {
            "samples_per_s": b.samples_per_s, "mfu": b.mfu, "step_seconds": b.step_seconds,
            "devices": b.devices, "memory_gb": b.memory_gb, "layout": b.layout,
            "mfu_cluster": cluster_mfu(b.mfu, b.devices, plan),
            "gain": plan.samples_per_s / b.samples_per_s, "applies": b.applies, "why_not": b.why_not,
            "loader": b.loader}
    return {
        "model": pr.model_name, "cluster": pr.cluster.name, "data": pr.data_name, "budget_devices": pr.budget,
        "job": pr.cfg.job, "not_searched": job_rules(pr.cfg.job).skipped(),
        "global_batch_size": pr.global_batch, "dtype": pr.cfg.dtype,
        "parts": [{"name": p.name, "role": p.role, "devices": p.devices, "dp": p.layout["dp"], "tp": p.layout["tp"],
                   "pp": p.layout["pp"], "cp": p.layout["cp"], "ep": p.layout["ep"], "token_budget": p.layout["b"],
                   "recompute": bool(p.layout["rc"]), "recompute_level": int(p.layout["rc"]),
                   "microbatches": p.microbatches, "stage_layers": p.stage_layers,
                   "step_seconds": p.step_seconds, "memory_gb": p.memory_gb, "time_parts": p.time_parts}
                  for p in plan.parts],
        "predicted": {"samples_per_s": plan.samples_per_s, "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu,
                      "mfu_devices_used": plan.mfu, "mfu_cluster": plan.mfu_cluster,
                      "step_seconds": plan.step_seconds, "rate_gap_seconds": plan.selection.gap,
                      "devices_used": plan.devices, "cluster_devices": pr.budget, "peak_tflops": pr.ctx.peak / 1e12,
                      "relative_spread": spread_of(plan)},
        "pool": pool_json(plan),
        "gain_by_mechanism": split_json(plan),
        "links": links_json(plan),
        "inputs": assumed_inputs(plan),
        "binding": plan.binding,
        "solve_seconds": plan.solve_seconds,
        "method": plan.selection.method,
        "options_priced": plan.options_priced,
        "baselines": baselines,
        "strongest_baseline": None if plan.strongest_baseline is None else plan.strongest_baseline.name,
    }


def render_text(plan: Plan) -> str:
    pr = plan.problem
    c = pr.cluster
    lines = [
        f"mindspeed-flow plan: {pr.model_name} on {c.name} ({pr.budget} of {c.devices} devices, "
        f"{c.devices_per_node}/node, {c.config.hbm_gb:g} GB, {pr.ctx.peak / 1e12:g} TFLOPS {pr.cfg.dtype} "
        f"[{c.config.sku}]), data {pr.data_name}, global batch {pr.global_batch}",
    ]
    if job_line(plan):
        lines.append(job_line(plan))
    lines += ["", "layout:"]
    for p in plan.parts:
        mem = p.memory_gb
        lines.append(f"  {p.name:<9} {p.devices:>6} devices  {_layout_str(p.layout)}"
                     + (f" layers/stage={p.stage_layers}" if p.stage_layers else ""))
        unit = "microbatches" if p.role == "backbone" else "samples per replica"
        lines.append(f"  {'':<9} step {p.step_seconds:.4g} s ({p.microbatches} {unit}); memory/device "
                     f"{mem['total']:.2f} GB = weights {mem['weights']:.2f} + grads {mem['grads']:.2f} + optim "
                     f"{mem['optim']:.2f} + activations {mem['activations']:.2f} + buffers {mem['buffers']:.2f}")
        top = sorted(p.time_parts.items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"  {'':<9} time: " + ", ".join(f"{k} {v:.3g} s" for k, v in top))
    unused = pr.budget - plan.devices
    lines += [
        "",
        f"predicted: {plan.samples_per_s:.4g} samples/s{_range(plan, plan.samples_per_s)}, "
        f"{plan.tokens_per_s:.4g} tokens/s, MFU {100 * plan.mfu:.1f}%{_range(plan, 100 * plan.mfu, '%')} on the "
        f"{plan.devices} devices used, {100 * plan.mfu_cluster:.1f}% over the cluster's {pr.budget}"
        + (f" ({unused} left idle)" if unused else ""),
        f"  step {plan.step_seconds:.4g} s; rate gap {plan.selection.gap:.3g} s "
        f"({100 * plan.selection.gap / plan.step_seconds:.1f}% of the step, faster part idles)",
        f"  {MFU_FORMULA}; peak {pr.ctx.peak / 1e12:g} TFLOPS per device",
        *pool_lines(plan),
        "binding constraint: " + "; ".join(plan.binding),
        *links_lines(plan),
        "inputs: " + assumed_inputs(plan),
        f"solved in {1000 * plan.solve_seconds:.1f} ms ({plan.selection.method}, {plan.options_priced} layouts priced)",
    ]
    if plan.baselines:
        lines += ["", "baselines (same cost model, each at its best layout within the budget):"]
        for name, b in plan.baselines.items():
            if b is None:
                lines.append(f"  {name:<22} does not fit in memory within {pr.budget} devices")
                continue
            lay = "; ".join(f"{k}: {_layout_str(v)}" for k, v in b.layout.items())
            lines.append(f"  {name:<22} {b.samples_per_s:.4g} samples/s, MFU {100 * b.mfu:.1f}% on {b.devices} "
                         f"devices ({100 * cluster_mfu(b.mfu, b.devices, plan):.1f}% over {pr.budget}) -> plan gain x{plan.samples_per_s / b.samples_per_s:.2f}  [{lay}]"
                         + (f" loader: {LOADER_NAMES[b.loader]}" if b.loader in LOADER_NAMES else "")
                         + ("" if b.applies else f" (not applicable: {b.why_not})"))
        best = plan.strongest_baseline
        if best is not None:
            lines.append(f"strongest baseline: {best.name}; plan gain over it x"
                         f"{plan.samples_per_s / best.samples_per_s:.2f}")
        lines += split_lines(plan)
    return "\n".join(lines)


def split_lines(plan: Plan) -> list[str]:
    """The decoupled plan's gain over the strongest baseline by mechanism (throughput and MFU apart)."""
    if not plan.gain_split:
        return []
    f = split_factors(plan.gain_split)
    x = lambda v: "-" if v is None else f"x{v:.2f}"  # noqa: E731
    lines = [f"decoupled plan's gain by mechanism ({plan.problem.data_name}; counterfactuals re-priced with the same "
             f"model): throughput {x(f['total']['throughput'])}, MFU {x(f['total']['mfu'])}"]
    for c in plan.gain_split:
        fig = ("no layout fits" if c.samples_per_s is None else
               f"{c.samples_per_s:.4g} samples/s, MFU {100 * (c.mfu or 0):.1f}% on {c.devices} devices")
        gain = "" if c.step == "baseline" else (f"  -> {c.step} throughput {x(f[c.step]['throughput'])}, "
                                                f"MFU {x(f[c.step]['mfu'])}")
        lines.append(f"  {c.step:<9} {fig}: {c.what}{gain}")
    return lines


def split_json(plan: Plan) -> dict[str, Any] | None:
    if not plan.gain_split:
        return None
    return {"rows": [{"step": c.step, "what": c.what, "samples_per_s": c.samples_per_s, "mfu": c.mfu,
                      "devices": c.devices} for c in plan.gain_split],
            "factors": split_factors(plan.gain_split)}


def pool_lines(plan: Plan) -> list[str]:
    p = plan.pool
    if p is None:
        return []
    line = (f"pool: flow.pool_capacity_mb {p.capacity_mb:g} per producer ({'pinned' if p.pinned else 'sized'}; the "
            f"chosen layouts need {p.needed_mb:g} MB, the largest sample embedding is {p.largest_embedding_mb:.1f} MB)")
    if p.stall_s > 0:
        line += f"; below what the layouts need, a step waits {p.stall_s:.3g} s on pool credits (priced above)"
    return [line]


def pool_json(plan: Plan) -> dict[str, Any] | None:
    p = plan.pool
    return None if p is None else {"capacity_mb": p.capacity_mb, "needed_mb": p.needed_mb, "pinned": p.pinned,
                                   "largest_embedding_mb": p.largest_embedding_mb, "stall_seconds": p.stall_s}


def render_replay(rows: list[dict]) -> str:
    """The chosen plan and each baseline replayed on the same sample stream, analytic vs simulated."""
    lines = ["", "simulated (one step, the same sample stream for every row; error = simulated / analytic - 1):"]
    for r in rows:
        if r.get("simulated_s") is None:
            lines.append(f"  {r['name']:<22} analytic {r['analytic_s']:.4g} s; not replayed: {r.get('why_not', '')}")
            continue
        lines.append(f"  {r['name']:<22} analytic {r['analytic_s']:.4g} s, simulated {r['simulated_s']:.4g} s, "
                     f"error {100 * r['error']:+.1f}%; bubbles {100 * r['bubble_fraction']:.1f}%, pool wait "
                     f"{r['pool_wait_s']:.3g} s")
    return "\n".join(lines)


def render_ranking(ranked: list[dict]) -> str:
    """The top-k layouts ranked by simulated step time, with the analytic prediction beside it."""
    lines = ["", "top layouts by simulated step time (one step replayed; analytic model beside it):"]
    for i, r in enumerate(ranked):
        stall = f"; pool stalls at {r['pool_stall']} samples/producer" if r.get("pool_stall") else ""
        lines.append(f"  {i + 1}. simulated {r['simulated_s']:.4g} s, analytic {r['analytic_s']:.4g} s on {r['devices']} "
                     f"devices; bubbles {100 * r['bubble_fraction']:.1f}%, stage imbalance "
                     f"{r['stage_imbalance']:.3f}, pool wait {r['pool_wait_s']:.3g} s{stall}")
        lines.append(f"     encoder: {_layout_str(r['encoder'])}; backbone: {_layout_str(r['backbone'])}")
    return "\n".join(lines)


def _quote(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def recipe_head(pr: Problem, name: str, model_recipe: str | None, data_recipe: str | None,
                model_inline: dict | None = None, data_inline: dict | None = None) -> list[str]:
    """An experiment recipe's defaults list (model, data, cluster), its name and inline model / data fields."""
    overrides = [f"  - override /cluster: {pr.cluster.name}"]
    if model_recipe:
        overrides.insert(0, f"  - override /model: {model_recipe}")
    if data_recipe:
        overrides.insert(1 if model_recipe else 0, f"  - override /data: {data_recipe}")
    lines = ["defaults:"] + overrides + ["", f"experiment_name: {name}"]
    if model_inline:
        lines += ["model:"] + [f"  {k}: {_quote(v)}" for k, v in model_inline.items()]
    if data_inline:
        lines += ["data:"] + [f"  {k}: {_quote(v)}" for k, v in data_inline.items()]
    return lines


def recipe_yaml(plan: Plan, name: str, model_recipe: str | None, data_recipe: str | None,
                model_inline: dict | None = None, data_inline: dict | None = None) -> str:
    """A Hydra experiment recipe that `mindspeed-flow train experiment=NAME` runs as planned."""
    pr = plan.problem
    by = {p.name: p for p in plan.parts}
    enc, bb = by.get("encoder"), by.get("backbone")
    encoders = [p for p in plan.parts if p.role == "encoder"]
    lines = [
        "# @package _global_",
        f"# mindspeed-flow train experiment={name}",
        f"# Written by `mindspeed-flow plan` for {pr.model_name} on {pr.cluster.name} ({plan.devices} devices): "
        f"predicted {plan.samples_per_s:.4g} samples/s, MFU {100 * plan.mfu:.1f}%.",
    ]
    if bb is not None and bb.layout["rc"]:
        lines.append("# The plan assumes full activation recompute in the backbone.")
    uneven = bb is not None and len(set(bb.stage_layers)) > 1
    if uneven:
        lines.append(f"# The plan assumes backbone layers per pipeline stage {list(bb.stage_layers)}: "
                     "parallel.backbone.layer_split below (both hosts take it; on a MindSpeed-MM flow job it wins over "
                     "model.json's text_decoder.pipeline_num_layers).")
    lines += recipe_head(pr, name, model_recipe, data_recipe, model_inline, data_inline)
    lines += ["parallel:"]
    several = len(encoders) > 1  # vision and audio: MindSpeed-MM's `parallel.encoders`, in rank order
    if several:
        lines.append("  encoders:")
    for part in (*encoders, bb):
        if part is not None:
            lay = part.layout
            split = f", layer_split: {list(part.stage_layers)}" if part is bb and uneven else ""
            ep = f", ep: {lay['ep']}" if lay["ep"] > 1 else ""
            key = f"  {ENCODER_KEYS[part.name]}" if several and part is not bb else part.name
            lines.append(f"  {key}: {{dp: {lay['dp']}, tp: {lay['tp']}, pp: {lay['pp']}, "
                         f"cp: {lay['cp']}{ep}{split}}}")
    job = job_rules(pr.cfg.job).name
    # the MindSpeed-MM job shards optimizer states with its --use-distributed-optimizer; FSDP2 is the torch host's
    # and runs without TP there
    sharded = (pr.cfg.distributed_optimizer and bb is not None and bb.layout["dp"] > 1 and job != "mm"
               and (job != "torch" or bb.layout["tp"] == 1))
    lines.append(f"  backbone_dp_impl: {'fsdp' if sharded else 'ddp'}")
    lines.append(f"  pp_schedule: {pr.cfg.pp_schedule}")
    lines.append(f"  world_size: {plan.devices}")
    lines += ["trainer:", f"  global_batch_size: {pr.global_batch}"]
    if bb is not None:
        lines += ["packing:", f"  token_budget: {bb.layout['b']}"]
    if enc is not None and enc.role == "encoder":
        # level 1 recomputes from the pixels (the torch host's keep_encoder_activations=false); the MindSpeed-MM
        # host keeps them and recomputes per layer from model.json
        keep = int(enc.layout["rc"]) != 1 if job else not bool(enc.layout["rc"])
        lines += ["flow:", f"  keep_encoder_activations: {_quote(keep)}"]
        if plan.pool is not None:  # the capacity the plan sized (or the pinned one it priced)
            lines.append(f"  pool_capacity_mb: {plan.pool.capacity_mb:g}")
        trainable = any(pp.trainable for pp in pr.parts if pp.role == "encoder")
        if job == "mm" and pr.cfg.encoder_inflight and bb is not None and trainable:
            # the bound the encoder's memory was priced with (the host refuses one below the decoder's pp)
            lines.append(f"  encoder_inflight: {max(int(pr.cfg.encoder_inflight), int(bb.layout['pp']))}")
    if job == "mm" and mm_settings(plan.parts):
        lines[3:3] = [f"# MindSpeed-MM {s} (the recompute the plan assumes)" for s in mm_settings(plan.parts)]
    # Qwen2.5-Omni's audio encoder runs in its own part's TP group, else in the decoder's: at TP > 1 it needs
    # sequence parallelism off in its own model.json section (the host refuses the job otherwise)
    audio = by.get("audio") or (bb if getattr(pr.spec, "audio", None) is not None else None)
    if job == "mm" and audio is not None and audio.layout["tp"] > 1:
        where = "its own part" if audio is not bb else "the decoder's first stage"
        lines.insert(3, f"# The audio encoder runs at tp {audio.layout['tp']} ({where}): with --sequence-parallel, "
                        "add \"sequence_parallel\": false to model.json's audio_encoder.audio_encoder (MindSpeed-MM's "
                        "audio encoder does not split its frames over TP); --use-ascend-mc2 needs it at tp 1.")
    if job == "mm" and any(p.name == "audio" and not p.trainable for p in pr.parts):
        lines.insert(3, "# The audio part is frozen: run the job with --use-distributed-optimizer (MindSpeed-MM's "
                        "placeholder optimizer for a part without parameters needs it).")
    return "\n".join(lines) + "\n"


def throughput_vs_encoder_share(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Best predicted samples/s when the encoder gets exactly n devices (the backbone gets the rest)."""
    enc = next(p for p in problem.parts if p.role == "encoder")
    others = [p for p in problem.parts if p is not enc]
    te = option_table(enc, problem, problem.budget)
    tabs = [option_table(p, problem, problem.budget) for p in others]
    xs, ys = [], []
    for n in sorted(set(int(d) for d in te.layouts.devices[te.fits])):
        t_enc = float(te.costs.time[te.fits & (te.layouts.devices == n)].min())
        rest = problem.budget - n
        t_rest = [float(t.costs.time[t.usable(rest)].min()) if len(t.usable(rest)) else np.inf for t in tabs]
        if len(others) != 1 or not np.isfinite(t_rest[0]):
            continue
        xs.append(n / problem.budget)
        ys.append(problem.global_batch / max(t_enc, t_rest[0]))
    return np.asarray(xs), np.asarray(ys)


def write_plot(plan: Plan, path: str) -> None:
    """PNG: predicted samples/s vs the encoder's share of the devices, with the plan and the baselines."""
    import matplotlib  # optional: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    xs, ys = throughput_vs_encoder_share(plan.problem)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(100 * xs, ys, "o-", ms=3, label="best layout with this encoder share")
    enc = next((p for p in plan.parts if p.role == "encoder"), None)
    if enc is not None:
        ax.plot([100 * enc.devices / plan.problem.budget], [plan.samples_per_s], "r*", ms=14, label="plan")
    for (name, b), style in zip(plan.baselines.items(), ("--", ":", "-.", (0, (1, 3)))):
        if b is not None:
            ax.axhline(b.samples_per_s, ls=style, color="gray", label=f"{name} ({b.samples_per_s:.3g}/s)")
    ax.set_xlabel("encoder share of devices (%)")
    ax.set_ylabel("predicted samples/s")
    ax.set_title(f"{plan.problem.model_name} on {plan.problem.cluster.name} ({plan.problem.budget} devices)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)



