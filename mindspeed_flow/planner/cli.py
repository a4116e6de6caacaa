"""`mindspeed-flow plan`: the heterogeneous parallel allocator's command line.

    mindspeed-flow plan [cluster=atlas_900_a3_384] [model=qwen2_5_vl_72b] [data=infovqa] [devices=N]
                        [global_batch=G] [freeze_encoder=true] [samples=2048] [planner.FIELD=VALUE]
                        [parallel.encoder.tp=2 parallel.backbone.pp=4 parallel.backbone.token_budget=32768
                         parallel.backbone.recompute=1]
                        [--job mm|torch|any] [--out recipe.yaml [--force]] [--name NAME] [--json] [--exhaustive]
                        [--plot PATH.png] [--no-baselines] [--simulate K] [--timeline PATH.png]
                        [--launch-script FILE.sh [--cluster a2|a3]]

--job is the job that will run the plan: mm (default), the flow-patched MindSpeed-MM job, or torch (`train` is an
alias), mindspeed-flow train, or any: every layout the cost model prices, for the models no host here trains
decoupled (Qwen3-VL, InternVL3.5, GLM-4.5V; no recipe is written). Only layouts that job runs
are searched (planner/jobs.py: no context parallelism, its recompute kinds, its optimizer sharding, whole nodes of
the cluster preset); one line says what was left out and why. The written recipe and --launch-script are for that
job.

Layout pins use train's names, parallel.PART.FIELD (PART: encoder, audio or backbone; FIELD: dp, tp, pp, cp, ep (a
MoE backbone's expert parallelism), token_budget (b), recompute (rc)); the short PART.FIELD is an alias, and
parallel.encoders.vision.FIELD / parallel.encoders.audio.FIELD (a MindSpeed-MM recipe's names) pin the encoder
parts. A model with an audio encoder (the Qwen2.5-Omni thinker) on a workload with audio clips
(data=infovqa_audio, or a length table with an audio_frames column) is planned in three parts: the vision encoder
(`encoder`), the audio encoder (`audio`; planner.freeze_audio, default as freeze_encoder) and the backbone; its
recipe says parallel.encoders: {vision: ..., audio: ...}, the layout the MindSpeed-MM job runs in three parts. For
--job torch the thinker is always three parts (the torch host's split), its encoders recomputing alike.
--simulate, --timeline and --plot replay one encoder part and refuse a three-part plan.
trainer.global_batch_size= and model.freeze_encoder= are aliases of global_batch= and freeze_encoder=. An unknown
key or option, or a value of the wrong type, is a usage error (exit status 2) naming the nearest valid key. --out
and --launch-script refuse an existing file unless --force is given (which replaces only those files, and says
so).

--simulate 1 replays one step of the chosen decoupled plan and of each baseline in the discrete-event step
simulator (`planner/simulate.py`), all on the same sample stream (one seeded draw of the global batch from the
workload, so microbatches vary as its lengths do), and prints per row the analytic step time, the simulated one and
the error (`--json`: "simulated"); --timeline writes the decoupled plan's simulated timeline. --simulate K > 1 also
ranks the K best layouts (by the analytic model) by simulated step time, as before.

cluster= is a preset in recipes/cluster/ or a YAML path; model= a model recipe (recipes/model/), a local
checkpoint directory / config.json, or FAMILY:PRESET; data= `infovqa` (full resolution), a data recipe, or a
length-table CSV; samples= how many sample shapes are drawn from it. planner.profile=PATH.json applies a
`mindspeed-flow profile` calibration.

With no arguments it plans Qwen2.5-VL-72B on an Atlas 900 A3 SuperPoD (384 NPUs) on InfoVQA-like data. An
infeasible input exits with status 3 and a message naming the binding constraint and the smallest device
count that would fit. `--launch-script FILE.sh` (with --out) also writes the Ascend cluster script that launches the
written recipe (see `mindspeed-flow launch-script`).
"""
from __future__ import annotations

import json
import os
import sys

from mindspeed_flow.planner.inputs import build_problem, data_recipe_fields, parse_kv
from mindspeed_flow.planner.jobs import job_rules, refusal
from mindspeed_flow.planner.plan import make_plan
from mindspeed_flow.planner.recommend import coupled_recipe, first_line, recommend
from mindspeed_flow.planner.recommend import to_json as recommendation_json
from mindspeed_flow.planner.report import recipe_yaml, render_ranking, render_replay, render_text, to_json, write_plot
from mindspeed_flow.planner.simulate import rank_by_simulation, replay_plan, write_timeline
from mindspeed_flow.planner.space import PlanError
from mindspeed_flow.utils.usage import UsageError, unknown_key

_FLAGS_WITH_VALUE = ("--out", "--plot", "--name", "--simulate", "--timeline", "--launch-script", "--cluster", "--job")
_SWITCHES = ("--json", "--exhaustive", "--no-baselines", "--force")


def _split_flags(argv: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    flags: dict[str, str | bool] = {}
    rest: list[str] = []
    it = iter(argv)
    for a in it:
        if a in _FLAGS_WITH_VALUE:
            value = next(it, None)
            if value is None:
                raise UsageError(f"{a} needs a value")
            flags[a] = value
        elif a.startswith("--") and "=" in a and a.split("=", 1)[0] in _FLAGS_WITH_VALUE:
            k, v = a.split("=", 1)
            flags[k] = v
        elif a in _SWITCHES:
            flags[a] = True
        elif a in ("-h", "--help"):
            flags["--help"] = True
        elif a.startswith("-"):
            raise unknown_key(a.split("=", 1)[0], (*_FLAGS_WITH_VALUE, *_SWITCHES, "--help"), "option")
        else:
            rest.append(a)
    return flags, rest


def _check_outputs(flags: dict[str, str | bool]) -> None:
    """--out and --launch-script never replace a file unless --force says so (and then say that they did)."""
    for flag in ("--out", "--launch-script"):
        target = flags.get(flag)
        if target and os.path.exists(str(target)):
            if not flags.get("--force"):
                raise UsageError(f"{flag} {target} already exists: not overwriting it (pass --force to replace it, "
                                 f"or choose another {flag})")
            print(f"mindspeed-flow plan: --force: replacing {target}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        flags, kv = _split_flags(argv)
        if flags.get("--help"):
            print((__doc__ or "").strip())
            return 0
        if flags.get("--launch-script") and not flags.get("--out"):
            raise UsageError("--launch-script needs --out RECIPE.yaml: the script launches that recipe")
        args = parse_kv(kv)
        rules = job_rules(str(flags.get("--job") or "mm"))
        if flags.get("--out") and not rules.name:
            raise UsageError("--out writes a recipe for the job that runs it: --job mm or --job torch, not any")
        args.planner.setdefault("job", rules.name)
        _check_outputs(flags)
        if flags.get("--out"):
            data_recipe_fields(args.data)  # a workload no host trains from cannot be written into a recipe
        problem, model = build_problem(args)
        family = model.hf_config.get("model_type")
        if refusal(rules, family):
            raise ValueError(f"model={args.model} ({family}): {refusal(rules, family)}")
        replays = [f for f in ("--simulate", "--timeline", "--plot") if flags.get(f)]
        if replays and len(problem.parts) > 2:
            raise UsageError(f"{'/'.join(replays)}: the step simulator and the plot handle one encoder part and the "
                             f"backbone; this plan has {len(problem.parts)} parts "
                             f"({', '.join(p.name for p in problem.parts)}): drop {' '.join(replays)}")
        plan = make_plan(problem, exhaustive=bool(flags.get("--exhaustive")),
                         with_baselines=not flags.get("--no-baselines"))
    except PlanError as e:
        print(f"mindspeed-flow plan: infeasible: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as e:
        print(f"mindspeed-flow plan: {e}", file=sys.stderr)
        return 2
    rec = recommend(plan)
    launch_msg = ""
    ranked = replayed = None
    if flags.get("--simulate"):
        try:
            k = int(str(flags["--simulate"]))
        except ValueError:
            print(f"mindspeed-flow plan: --simulate {flags['--simulate']!r}: expected a whole number of layouts",
                  file=sys.stderr)
            return 2
        replayed = replay_plan(plan, cores=problem.host_cores)
        ranked = rank_by_simulation(problem, k, cores=problem.host_cores) if k > 1 else None
        if flags.get("--timeline") and replayed and replayed[0].get("result") is not None:
            write_timeline(replayed[0]["result"], str(flags["--timeline"]))
    if flags.get("--out"):
        out = str(flags["--out"])
        name = str(flags.get("--name") or os.path.splitext(os.path.basename(out))[0])
        data_recipe, data_inline = data_recipe_fields(args.data)
        if rec.baseline is not None:  # a baseline the job runs beats the decoupled plan: write its layout
            text = coupled_recipe(plan, rec, name, model.recipe, data_recipe, model.inline, data_inline)
        else:
            text = recipe_yaml(plan, name, model.recipe, data_recipe, model.inline, data_inline)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        if flags.get("--launch-script"):
            from mindspeed_flow.runtime.launch_script import (  # lazy: torch
                LaunchScriptError, plan_from_recipe, write_script)

            try:
                launch = plan_from_recipe(out, flags.get("--cluster"), job_rules(problem.cfg.job).launch_job or "mm")
                script = write_script(launch, str(flags["--launch-script"]), force=bool(flags.get("--force")))
                for note in launch.notes:
                    print(f"mindspeed-flow plan: launch script note: {note}", file=sys.stderr)
            except LaunchScriptError as e:
                print(f"mindspeed-flow plan: recipe written to {out}, but no launch script: {e}", file=sys.stderr)
                return 2
            launch_msg = f"launch script written to {script} (check it: bash {script} --dry-run)"
    if flags.get("--plot"):
        write_plot(plan, str(flags["--plot"]))
    if flags.get("--json"):
        obj = {**recommendation_json(plan, rec), **to_json(plan)}
        if replayed is not None:
            obj["simulated"] = [{k: v for k, v in r.items() if k != "result"} for r in replayed]
        if ranked is not None:
            obj["simulated_top_k"] = [{k: v for k, v in r.items() if k != "result"} for r in ranked]
        print(json.dumps(obj, indent=1, sort_keys=False))
    else:
        print(first_line(plan, rec))
        for setting in rec.settings:
            print(f"  {setting}")
        print(render_text(plan))
        if replayed is not None:
            print(render_replay(replayed))
        if ranked is not None:
            print(render_ranking(ranked))
        if flags.get("--timeline") and replayed:
            print(f"timeline written to {flags['--timeline']}")
        if flags.get("--out"):
            print(f"recipe written to {flags['--out']}")
        if launch_msg:
            print(launch_msg)
        if flags.get("--plot"):
            print(f"plot written to {flags['--plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
