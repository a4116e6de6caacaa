"""The planner's Qwen2.5-Omni audio encoder part: its FLOPs and parameters against a hand count of the 7B config,
its token rule against transformers', the length table's audio_frames column, the three-part plan for the
MindSpeed-MM job (a recipe the host's own `build_parts` accepts), audio pins, and the coupled baseline that carries
the audio encoder on the LLM's first stage."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mindspeed_flow.cli import main
from mindspeed_flow.config.planner import PlannerConfig
from mindspeed_flow.data.shapes import (LengthTableError, SampleShape, audio_conv_frames, audio_llm_tokens,
                                        read_length_table, write_length_table)
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError, ModelShape, build_parts, load_flow_job
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.planner.baselines import megatron_coupled
from mindspeed_flow.planner.cost import CostContext
from mindspeed_flow.planner.hardware import load_cluster
from mindspeed_flow.planner.jobs import mm_audio_rules
from mindspeed_flow.planner.parts import audio_part, vlm_parts
from mindspeed_flow.planner.workload import load_workload
from mindspeed_flow.specs import VLMSpec

OMNI = hf_config_dict("qwen2_5_omni_thinker", "7b")
SPEC = VLMSpec.from_hf_config(OMNI)
# Qwen2.5-Omni-7B's audio encoder (thinker_config.audio_config), written out by hand
D, LAYERS, HEADS, FFN, MEL, OUT = 1280, 32, 20, 5120, 128, 3584
CONV1 = MEL * D * 3 + D
CONV2 = D * D * 3 + D
LAYER = (3 * (D * D + D) + D * D) + 2 * 2 * D + (D * FFN + FFN) + (FFN * D + D)  # q, v, o biased; k not
HEAD = 2 * D + D * OUT + OUT  # ln_post + proj
BOS_EOS = 2 * OUT


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_audio_part_params_and_flops_match_a_hand_count() -> None:
    assert SPEC.audio is not None and (SPEC.audio.d_model, SPEC.audio.layers, SPEC.audio.heads) == (D, LAYERS, HEADS)
    assert SPEC.audio.params == CONV1 + CONV2 + BOS_EOS + LAYERS * LAYER + HEAD == 639_647_232
    for frames, chunks in ((3000, [100] * 15), (450, [100, 100, 25])):  # 30 s; 4.5 s (a short last chunk)
        shapes = [SampleShape(0, 10, ((1, 4, 4),), 2, (frames,))]
        t, a = (frames - 1) // 2 + 1, ((frames - 1) // 2 + 1 - 2) // 2 + 1
        for trainable, mult in ((True, 3.0), (False, 1.0)):
            part = audio_part(SPEC, shapes, trainable=trainable)
            forward = 2 * (CONV1 * frames + (CONV2 + LAYERS * LAYER) * t + HEAD * a) \
                + 4 * LAYERS * D * sum(c * c for c in chunks)
            assert part.flops_per_sample == pytest.approx(mult * forward, rel=1e-12)
        assert (part.first_params, part.layer_params, part.last_params) == (CONV1 + CONV2 + BOS_EOS, LAYER, HEAD)
        assert (part.tokens_per_sample, part.sq_tokens_per_sample, part.out_tokens_per_sample) == (
            t, sum(c * c for c in chunks), a)
        assert (part.heads, part.kv_heads, part.hidden, part.ffn, part.out_hidden) == (HEADS, HEADS, D, FFN, OUT)
        assert part.tp_sizes == (1, 2, 4) and part.pp_sizes == (1,) and part.cp_sizes == (1,)


def test_audio_params_match_the_transformers_module() -> None:
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    cfg = Qwen2_5OmniAudioEncoderConfig(**{k: v for k, v in OMNI["audio_config"].items()})
    with torch.device("meta"):  # shapes only: no memory for 0.64 B parameters
        module = Qwen2_5OmniAudioEncoder(cfg)
    assert sum(p.numel() for p in module.parameters()) == SPEC.audio.params


def test_audio_token_rule_matches_transformers() -> None:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    lengths = [1, 2, 3, 4, 5, 199, 200, 201, 450, 1001, 2999, 3000, 4801]
    conv, out = Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(lengths))
    assert [audio_conv_frames(n) for n in lengths] == conv.tolist()
    assert [audio_llm_tokens(n) for n in lengths] == out.tolist()
    # the attention chunks cover exactly the frames the layers see
    assert [sum(SPEC.audio.chunk_frames(n)) for n in lengths] == conv.tolist()
    s = SampleShape(0, 7, ((1, 4, 4),), 2, (3000, 450))
    assert (s.audio_tokens, s.llm_tokens) == (750 + 112, 7 + 4 + 750 + 112)
    assert SampleShape(0, 7).llm_tokens == 7 and SampleShape(0, 7).audio_tokens == 0


def test_length_table_round_trips_audio_frames(tmp_path: Path) -> None:
    shapes = [SampleShape(0, 37, ((1, 36, 52),), 2, (3000, 1200)), SampleShape(1, 120), SampleShape(2, 5, (), 2, (450,))]
    path = tmp_path / "t.csv"
    write_length_table(path, shapes)
    assert path.read_text().splitlines()[:2] == ["sample_id,text_tokens,image_grid_thw,audio_frames",
                                                 "0,37,1x36x52,3000;1200"]
    assert read_length_table(path) == shapes
    write_length_table(path, [SampleShape(0, 37, ((1, 36, 52),))])  # no clips: the old three columns
    assert path.read_text().splitlines()[0] == "sample_id,text_tokens,image_grid_thw"
    path.write_text("sample_id,text_tokens,image_grid_thw,audio_frames\n0,3,,200\n1,3,,12x\n")
    with pytest.raises(LengthTableError, match=r"row 3: audio_frames: '12x' is not an integer"):
        read_length_table(path)
    path.write_text("sample_id,text_tokens,image_grid_thw,audio_frames\n0,3,,0\n")
    with pytest.raises(LengthTableError, match=r"row 2: audio_frames: '0' must be > 0"):
        read_length_table(path)


def test_workload_with_clips_plans_three_parts_without_clips_two() -> None:
    audio = load_workload("infovqa_audio", OMNI, 32)
    plain = load_workload("infovqa", OMNI, 32)
    assert all(len(s.audio_frames) == 1 and 200 <= s.audio_frames[0] <= 3000 for s in audio.shapes)
    assert [s.image_grid_thw for s in audio.shapes] == [s.image_grid_thw for s in plain.shapes]
    assert [p.name for p in vlm_parts(SPEC, audio.shapes)] == ["encoder", "audio", "backbone"]
    assert [p.name for p in vlm_parts(SPEC, plain.shapes)] == ["encoder", "backbone"]
    frozen = vlm_parts(SPEC, audio.shapes, freeze_encoder=True)
    assert not frozen[0].trainable and not frozen[1].trainable  # the audio part follows freeze_encoder...
    assert vlm_parts(SPEC, audio.shapes, freeze_encoder=True, freeze_audio=False)[1].trainable  # ...unless told
    with pytest.raises(ValueError, match="no audio encoder"):
        load_workload("infovqa_audio", hf_config_dict("qwen2_5_vl", "7b"), 8)


def _omni_model_shape(audio_trainable: bool = True) -> ModelShape:
    return ModelShape(SPEC.vision.num_heads, SPEC.vision.depth, SPEC.llm.num_heads, SPEC.llm.num_kv_heads,
                      SPEC.llm.num_layers, True, audio_heads=SPEC.audio.heads, audio_trainable=audio_trainable)


def test_mm_plan_writes_a_three_part_recipe_the_host_accepts(tmp_path: Path, capsys) -> None:
    args = ["--job", "mm", "model=qwen2_5_omni_thinker:7b", "cluster=atlas_800t_a2", "devices=64", "samples=128"]
    rc, out, err = _run(capsys, *args, "data=infovqa_audio", "--json")
    assert rc == 0, err
    obj = json.loads(out)
    assert [p["name"] for p in obj["parts"]] == ["encoder", "audio", "backbone"]
    audio = obj["parts"][1]
    assert audio["pp"] == 1 and audio["cp"] == 1 and HEADS % audio["tp"] == 0
    assert obj["baselines"]["megatron_coupled"] is not None
    # infovqa_audio is shapes only: the recipe is written from the same shapes as a length table
    table = tmp_path / "audio.csv"
    write_length_table(table, load_workload("infovqa_audio", OMNI, 128).shapes)
    recipe, script = tmp_path / "omni.yaml", tmp_path / "omni.sh"
    rc, out, err = _run(capsys, *args, f"data={table}", "--out", str(recipe), "--launch-script", str(script))
    assert rc == 0, err
    raw = yaml.safe_load(recipe.read_text())
    assert list(raw["parallel"]["encoders"]) == ["vision", "audio"] and "encoder" not in raw["parallel"]
    job = load_flow_job(recipe)
    gbs = job.trainer.global_batch_size
    parts = build_parts(job, world_size=job.parallel.world_size, model=_omni_model_shape(), global_batch_size=gbs,
                        micro_batch_size=1, recipe_name=recipe.name, recipe_global_batch_size=gbs)
    assert parts.audio_part and [p.name for p in parts.layout.parts] == ["encoder", "audio", "backbone"]
    sizes = {p["name"]: p["devices"] for p in json.loads(_run(capsys, *args, f"data={table}", "--json")[1])["parts"]}
    assert [p.size for p in parts.layout.parts] == [sizes["encoder"], sizes["audio"], sizes["backbone"]]
    assert "launch script written" in out and "audio:" in script.read_text()
    frozen = tmp_path / "frozen.yaml"  # a frozen audio part: the recipe says the job needs the distributed optimizer
    rc, _, err = _run(capsys, *args, f"data={table}", "freeze_encoder=true", "--no-baselines", "--out", str(frozen))
    assert rc == 0 and "--use-distributed-optimizer" in frozen.read_text(), err
    assert "--use-distributed-optimizer" not in recipe.read_text()
    # an audio part at tp > 1: the recipe says what --sequence-parallel then needs in model.json (the host refuses
    # the job without it), and at tp 1 it says nothing
    for tp, said in ((2, True), (1, False)):
        pinned = tmp_path / f"audio_tp{tp}.yaml"
        rc, _, err = _run(capsys, *args, f"data={table}", f"parallel.audio.tp={tp}", "--no-baselines", "--out",
                          str(pinned))
        assert rc == 0 and ('"sequence_parallel": false to model.json\'s audio_encoder' in pinned.read_text()) == said


def test_audio_pins_follow_the_host_rules(capsys) -> None:
    args = ["--job", "mm", "model=qwen2_5_omni_thinker:7b", "data=infovqa_audio", "cluster=atlas_800t_a2",
            "devices=64", "samples=64", "--no-baselines", "--json"]
    for pin in ("parallel.audio.tp=2", "audio.tp=2", "parallel.encoders.audio.tp=2"):
        rc, out, err = _run(capsys, *args, pin)
        assert rc == 0, err
        assert [p["tp"] for p in json.loads(out)["parts"] if p["name"] == "audio"] == [2]
    rc, _, err = _run(capsys, *args, "parallel.audio.tp=8")  # 20 heads
    assert rc == 3 and "audio.tp=8 is not allowed" in err and "divisible by tp" in err, err
    rc, _, err = _run(capsys, *args, "parallel.audio.pp=2")
    assert rc == 3 and "audio.pp=2 is not allowed" in err, err
    rc, _, err = _run(capsys, *[a for a in args if a != "data=infovqa_audio"], "audio.tp=2")  # no clips: no part
    assert rc == 2 and "no audio part" in err and "encoder, backbone" in err, err
    rc, _, err = _run(capsys, *args, "parallel.speech.tp=2")
    assert rc == 2 and "parallel.speech.tp" in err, err
    rc, _, err = _run(capsys, *args[:-1], "--simulate", "1")
    assert rc == 2 and "--simulate" in err and "3 parts" in err, err


def test_host_accepts_the_planned_audio_tp_and_refuses_one_the_planner_would_not_plan(tmp_path: Path) -> None:
    """The planner's audio tp sizes are exactly the host's: every one it offers passes build_parts, 8 does not."""
    part = audio_part(SPEC, load_workload("infovqa_audio", OMNI, 8).shapes)
    for tp in (1, 2, 4, 8):
        recipe = tmp_path / f"tp{tp}.yaml"
        recipe.write_text(f"parallel:\n  encoders:\n    vision: {{dp: 1}}\n    audio: {{dp: 1, tp: {tp}}}\n"
                          "  backbone: {dp: 1}\n")
        job = load_flow_job(recipe)
        call = lambda: build_parts(job, world_size=2 + tp, model=_omni_model_shape(), global_batch_size=8,  # noqa: E731
                                   micro_batch_size=1)
        if tp in part.tp_sizes:
            call()
        else:
            with pytest.raises(FlowRecipeError, match="must be divisible by tp"):
                call()


def test_mm_audio_rules() -> None:
    shapes = load_workload("infovqa", OMNI, 8).shapes
    two = [dataclasses.replace(p, tp_sizes=(1, 2, 4, 8)) for p in vlm_parts(SPEC, shapes)]
    # no audio part: the audio encoder runs in the decoder's TP group, so the decoder's tp divides its 20 heads
    assert mm_audio_rules(two, 20, True)[-1].tp_sizes == (1, 2, 4)
    assert mm_audio_rules(two, 0, True) == two
    three = vlm_parts(SPEC, load_workload("infovqa_audio", OMNI, 8).shapes, freeze_encoder=True)
    assert mm_audio_rules(three, 20, True) == three
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        mm_audio_rules(three, 20, False)


def test_coupled_baseline_counts_the_audio_on_the_first_stage() -> None:
    """MindSpeed-MM's coupled job runs the audio encoder on the LLM's first stage: the same layout gets slower once
    the samples carry clips (its memory never less; here the last stage, with the logits, stays the peak)."""
    plain = load_workload("infovqa", OMNI, 64).shapes
    with_clips = load_workload("infovqa_audio", OMNI, 64).shapes
    cluster = load_cluster("atlas_800t_a2")
    ctx = CostContext(cluster, PlannerConfig(), global_batch=64, job_devices=32)
    enc, bb = vlm_parts(SPEC, plain)
    bb = dataclasses.replace(bb, idle_first_params=0)  # the LLM alone (without clips it holds the audio encoder)
    enc_a, aud, bb_a = vlm_parts(SPEC, with_clips)
    fixed = {"dp": 4, "tp": 2, "pp": 4, "cp": 1, "rc": 1}
    before = megatron_coupled(enc, bb, ctx, 32, fixed=fixed)
    # the same parts, the audio work added on stage 0 (its tokens' share of the LLM left out)
    added = megatron_coupled(enc, bb, ctx, 32, fixed=fixed, audio=aud)
    after = megatron_coupled(enc_a, bb_a, ctx, 32, fixed=fixed, audio=aud)
    assert before is not None and added is not None and after is not None
    assert added.step_seconds > before.step_seconds and added.memory_gb >= before.memory_gb
    assert after.step_seconds > added.step_seconds  # the clips' LLM tokens too
    # the first stage holds fewer LLM layers once it also runs the audio encoder
    assert added.layout["coupled"]["layers"][0] <= before.layout["coupled"]["layers"][0]
    # one stage (it is the peak): its weights, gradients and optimizer shard (bf16 + fp32 grads + Adam over dp 8,
    # tp 4) are there, and its activations
    one = {"dp": 8, "tp": 4, "pp": 1, "cp": 1, "rc": 1, "b": before.layout["coupled"]["b"]}
    alone = megatron_coupled(enc, bb, ctx, 32, fixed=one, vit_rc=(2,))
    shared = megatron_coupled(enc, bb, ctx, 32, fixed=one, vit_rc=(2,), audio=aud)
    assert alone is not None and shared is not None
    static = SPEC.audio.params / 4 * (2 + 4 + 12 / 8) / 1e9
    assert shared.memory_gb - alone.memory_gb == pytest.approx(static, rel=0.2)
    assert shared.memory_gb - alone.memory_gb > static
    # a layout whose TP the audio encoder cannot take (20 heads) is not searched
    assert megatron_coupled(enc, bb, ctx, 32, fixed={**fixed, "tp": 8}, audio=aud) is None
    assert np.isfinite(after.mfu) and after.mfu > 0


def test_without_clips_the_audio_encoder_is_held_on_the_backbones_first_stage() -> None:
    """On a workload without clips the Omni plan has two parts and MindSpeed-MM builds the audio encoder on the
    decoder's first stage: its weights (and trained, its gradients and optimizer shard) are that stage's, over the
    stage's TP, and nothing else changes."""
    from mindspeed_flow.planner.cost import Layouts, backbone_costs

    plain = load_workload("infovqa", OMNI, 64).shapes
    _, bb = vlm_parts(SPEC, plain)
    _, bb_frozen = vlm_parts(SPEC, plain, freeze_audio=True)
    alone = dataclasses.replace(bb, idle_first_params=0)
    assert (bb.idle_first_params, bb.idle_first_trainable, bb_frozen.idle_first_trainable) == (
        SPEC.audio.params, True, False)
    assert (vlm_parts(SPEC, load_workload("infovqa_audio", OMNI, 64).shapes)[2].idle_first_params,
            vlm_parts(dataclasses.replace(SPEC, audio=None), plain)[1].idle_first_params) == (0, 0)
    ctx = CostContext(load_cluster("atlas_800t_a2"), PlannerConfig(), global_batch=64, job_devices=64)
    L = Layouts.from_rows([{"dp": 8, "tp": 4, "pp": 1, "b": 8192}, {"dp": 4, "tp": 4, "pp": 4, "b": 8192}])
    c, c_frozen, c_alone = (backbone_costs(p, ctx, L) for p in (bb, bb_frozen, alone))
    by = ctx.bytes
    per_device = SPEC.audio.params / 4
    trained = per_device * (by.param + by.grad + by.optim / 8)  # optimizer sharded over dp 8 (distributed)
    one, two = (c.memory - c_alone.memory), (c_frozen.memory - c_alone.memory)
    assert one[0] == pytest.approx(trained, rel=1e-9) and two[0] == pytest.approx(per_device * by.param, rel=1e-9)
    # pp 4: the first stage grows by as much (whether it is the peak depends on the logits on the last stage)
    first = lambda costs, part: backbone_memory_stages(part, ctx, L, costs)["first"]  # noqa: E731
    assert first(c, bb)[1] - first(c_alone, alone)[1] == pytest.approx(
        per_device * (by.param + by.grad + by.optim / 4), rel=1e-9)
    assert first(c_frozen, bb_frozen)[1] - first(c_alone, alone)[1] == pytest.approx(per_device * by.param, rel=1e-9)
    # no compute: the same pipeline time; a trained one adds its gradient sync and optimizer step
    assert np.allclose(c_frozen.time, c_alone.time) and np.all(c.time > c_alone.time)
    assert np.allclose(c.time_parts["compute"], c_alone.time_parts["compute"])


def backbone_memory_stages(part, ctx, L, costs) -> dict:
    from mindspeed_flow.planner.cost import backbone_memory, backbone_stage_mb_time

    m = costs.microbatches
    return backbone_memory(part, ctx, L, m, backbone_stage_mb_time(part, ctx, L, m))["stages"]


@pytest.mark.parametrize("devices", [8, 12])
def test_three_parts_cpsat_matches_exhaustive(devices: int) -> None:
    """The solver takes the audio part as one more entry of its list: CP-SAT finds the exhaustive optimum."""
    from mindspeed_flow.planner.inputs import build_problem, parse_kv
    from mindspeed_flow.planner.plan import make_plan

    args = parse_kv(["model=qwen2_5_omni_thinker:7b", "data=infovqa_audio", "cluster=h100_8", f"devices={devices}",
                     "samples=32", "global_batch=24"])
    args.planner["job"] = ""
    problem, _ = build_problem(args)
    fast, slow = make_plan(problem, with_baselines=False), make_plan(problem, exhaustive=True, with_baselines=False)
    assert [p.name for p in fast.parts] == ["encoder", "audio", "backbone"]
    assert fast.step_seconds == pytest.approx(slow.step_seconds, rel=1e-6) and fast.devices == slow.devices


def _torch_problem(*kv: str):
    from mindspeed_flow.planner.inputs import build_problem, parse_kv

    args = parse_kv(["model=qwen2_5_omni_thinker:7b", "cluster=atlas_800t_a2", "devices=64", "samples=64", *kv])
    args.planner["job"] = "torch"
    return build_problem(args)[0]


@pytest.mark.parametrize("data", ["infovqa_audio", "infovqa"])
def test_torch_job_plans_the_omni_thinker_in_three_parts_recomputing_alike(data: str) -> None:
    """The torch host splits the Omni thinker in three, clips or not, and has one flow.keep_encoder_activations:
    the plan has an audio part either way, both encoders take one recompute level, and it is the faster of the
    plans with each shared level pinned."""
    import mindspeed_flow.planner.plan as plan_mod
    from mindspeed_flow.planner.space import PlanError

    problem = _torch_problem(f"data={data}")
    assert [p.name for p in problem.parts] == ["encoder", "audio", "backbone"]
    assert problem.parts[-1].idle_first_params == 0  # the audio encoder is its own part: not on the backbone
    variants = plan_mod.shared_rc_problems(problem)
    assert [v.fixed["encoder"]["rc"] for v in variants] == [v.fixed["audio"]["rc"] for v in variants] == [0, 1]
    plan = plan_mod.make_plan(problem, with_baselines=False)
    by = {p.name: p for p in plan.parts}
    assert by["encoder"].layout["rc"] == by["audio"].layout["rc"]
    each = []
    for v in variants:  # keeping every ViT activation does not fit 64 devices here: that level is infeasible
        try:
            each.append(plan_mod.make_plan_parts(v, with_baselines=False).samples_per_s)
        except PlanError:
            pass
    assert plan.samples_per_s == max(each) and plan.problem is problem  # the search's pins are not reported
    # a pin on one encoder holds for both; two different pins are refused naming both
    one = plan_mod.make_plan(_torch_problem(f"data={data}", "parallel.audio.rc=1"), with_baselines=False)
    assert {p.name: p.layout["rc"] for p in one.parts if p.name != "backbone"} == {"encoder": 1, "audio": 1}
    with pytest.raises(PlanError, match=r"encoder.rc=1, audio.rc=0: .*\(one flow.keep_encoder_activations"):
        plan_mod.make_plan(_torch_problem(f"data={data}", "parallel.encoder.rc=1", "parallel.audio.rc=0"),
                           with_baselines=False)
    # the MindSpeed-MM job sets each part's recompute in its own model.json section: no shared level
    assert plan_mod.shared_rc_problems(dataclasses.replace(
        problem, cfg=dataclasses.replace(problem.cfg, job="mm"))) == []


def test_torch_job_freezes_omni_encoders_together(capsys) -> None:
    rc, _, err = _run(capsys, "--job", "torch", "model=qwen2_5_omni_thinker:7b", "data=infovqa_audio",
                      "cluster=atlas_800t_a2", "devices=64", "samples=32", "planner.freeze_audio=true")
    assert rc == 2 and "planner.freeze_audio=True with freeze_encoder=False" in err and "model.freeze_encoder" in err
    frozen = _torch_problem("data=infovqa_audio", "freeze_encoder=true")
    assert not any(p.trainable for p in frozen.parts if p.role == "encoder")
