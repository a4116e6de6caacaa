"""The MindSpeed-MM host's pure parts, without MindSpeed sources: recipe checks, rank layout, checkpoint re-sharding."""
from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mindspeed_flow.config.schema import PackingConfig, PartParallelConfig
from mindspeed_flow.hosts.mindspeed_mm import checkpoint as ck
from mindspeed_flow.hosts.mindspeed_mm.host import model_spec, vit_frozen
from mindspeed_flow.hosts.mindspeed_mm.recipe import (MODEL_IDS, REFUSED_SCRIPTS, SUPPORTED_SCRIPTS, FlowRecipeError,
                                                      check_job_flags, even_split, part_modules, parts_for_job,
                                                      support_table, unsupported_model)
from mindspeed_flow.model_presets.real import REAL_PRESETS
from mindspeed_flow.packing import CostModel
from mindspeed_flow.specs import VLMSpec


def _model_json(tmp_path: Path, name: str = "model.json", top: dict | None = None, vit: dict | None = None,
                **llm) -> Path:
    cfg = {"model_id": "qwen2_5vl",
           "image_encoder": {"vision_encoder": {"model_id": "qwen2vit", "num_attention_heads": 2, "num_layers": 2,
                                                "freeze": False, **(vit or {})},
                             "vision_projector": {"model_id": "lnmlp", "freeze": False}},
           "text_decoder": {"model_id": "qwen2_5_lm", "num_attention_heads": 4, "num_query_groups": 2,
                            "num_layers": 2, **llm}, **(top or {})}
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flow.yaml"
    path.write_text(text)
    return path


def _argv(model: Path, gbs: int = 4) -> list[str]:
    return ["--mm-model", str(model), "--global-batch-size", str(gbs), "--micro-batch-size", "1"]


def test_parts_take_contiguous_ranks_encoder_first(tmp_path) -> None:
    recipe = _recipe(tmp_path, "parallel:\n  encoder: {dp: 2}\n  backbone: {dp: 1, tp: 2, pp: 2}\n")
    parts = parts_for_job(recipe, _argv(_model_json(tmp_path)), 6)
    assert parts.layout.part_ranks("encoder") == [0, 1] and parts.layout.part_ranks("backbone") == [2, 3, 4, 5]
    # Megatron's tp-cp-dp-pp order inside the decoder: TP neighbours adjacent, stage 1 after stage 0.
    assert parts.layout.global_rank("backbone", tp=1, pp=0) == 3
    assert parts.layout.global_rank("backbone", tp=0, pp=1) == 4
    assert parts.decoder_layers == (1, 1) and parts.encoder_trainable


@pytest.mark.parametrize("text,world,want", [
    ("parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 2}\n", 4, "launched with 4"),
    ("parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, tp: 3}\n", 4, "parallel.backbone.tp=3"),
    ("parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, cp: 2}\n", 3, "parallel.backbone.cp=2"),
    ("parallel:\n  encoder: {dp: 1, pp: 2}\n  backbone: {dp: 1}\n", 3, "parallel.encoder.pp=2"),
    ("parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 3}\n", 4, "--global-batch-size 4 must be divisible"),
    ("parallel:\n  backbone_dp_impl: fsdp\n", 3, "parallel.backbone_dp_impl='fsdp'"),
    ("trainer:\n  global_batch_size: 16\n", 3, "trainer.global_batch_size=16"),
    ("parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 2, tpp: 1}\n", 3, "tpp"),
])
def test_bad_recipes_name_the_field_and_the_rule(tmp_path, text, world, want) -> None:
    with pytest.raises(FlowRecipeError) as err:
        parts_for_job(_recipe(tmp_path, text), _argv(_model_json(tmp_path)), world)
    assert want in str(err.value)


def test_plan_out_recipe_with_defaults_list_is_accepted(tmp_path) -> None:
    text = ("# @package _global_\ndefaults:\n  - override /cluster: cpu\nexperiment_name: x\n"
            "parallel:\n  encoder: {dp: 1, tp: 1, pp: 1, cp: 1}\n  backbone: {dp: 2, tp: 1, pp: 1, cp: 1}\n"
            "  backbone_dp_impl: ddp\n  pp_schedule: 1f1b\n  world_size: 3\npacking:\n  token_budget: 512\n")
    parts = parts_for_job(_recipe(tmp_path, text), _argv(_model_json(tmp_path)), 3)
    assert parts.packing.token_budget == 512


def test_even_split_puts_the_remainder_late() -> None:
    assert even_split(7, 3) == (2, 2, 3) and even_split(4, 2) == (2, 2)


def _whole(gated: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, f = 8, 12
    t = {}
    for i in range(4):
        p = f"text_decoder.decoder.layers.{i}."
        t[p + "self_attention.linear_qkv.weight"] = torch.randn(3 * h, h, generator=g)
        t[p + "self_attention.linear_proj.weight"] = torch.randn(h, h, generator=g)
        t[p + "mlp.linear_fc1.weight"] = torch.randn((2 if gated else 1) * f, h, generator=g)
        t[p + "mlp.linear_fc2.weight"] = torch.randn(h, f, generator=g)
        t[p + "input_layernorm.weight"] = torch.randn(h, generator=g)
    t["text_decoder.embedding.word_embeddings.weight"] = torch.randn(16, h, generator=g)
    t["text_decoder.decoder.final_layernorm.weight"] = torch.randn(h, generator=g)
    t["text_decoder.output_layer.weight"] = torch.randn(16, h, generator=g)
    t["image_encoder.encoder.blocks.layers.0.mlp.linear_fc1.weight"] = torch.randn(2 * f, h, generator=g)
    return t


@pytest.mark.parametrize("tp,layers", [(1, [4]), (2, [4]), (2, [1, 3]), (4, [2, 2])])
def test_coupled_to_part_shards_and_back_keeps_every_tensor(tp, layers) -> None:
    gated = ("text_decoder.",)
    whole = _whole(gated=True)
    stages = []
    for pp_rank in range(len(layers)):
        shards = [ck.part_state(whole, "backbone", tp=tp, tp_rank=r, layers=layers, pp_rank=pp_rank,
                                gated_prefixes=gated) for r in range(tp)]
        assert all("image_encoder" not in k for s in shards for k in s)
        stages.append(ck.merge_tp(shards, gated))
    back = ck.merge_pp(stages)
    mine = {k: v for k, v in whole.items() if k.startswith("text_decoder.")}
    assert back.keys() == mine.keys()
    for k in mine:
        assert torch.equal(back[k], mine[k]), k


def test_gated_fc1_shards_hold_gate_and_up_halves() -> None:
    full = torch.arange(8.0).reshape(8, 1)  # gate rows 0-3, up rows 4-7
    s0 = ck.split_tp({"x.mlp.linear_fc1.weight": full}, 2, 0, ("x.",))["x.mlp.linear_fc1.weight"]
    assert s0.flatten().tolist() == [0, 1, 4, 5]


def test_part_checkpoint_names() -> None:
    name = "/ck/iter_0000010/mp_rank_01_002/model_optim_rng.pt"
    assert ck.part_checkpoint_name(name, "backbone") == "/ck/iter_0000010/mp_text_decoder_rank_01_002/model_optim_rng.pt"
    assert ck.part_checkpoint_name(name, "encoder").endswith("mp_image_encoder_rank_01_002/model_optim_rng.pt")


RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes" / "mindspeed_mm").glob("*.yaml"))
TINY_MODEL = Path(__file__).resolve().parents[1] / "mindspeed_flow" / "emulation" / "assets" / "model.json"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_mindspeed_mm_flow_recipe_builds_its_parts(recipe, tmp_path) -> None:
    from mindspeed_flow.hosts.mindspeed_mm.recipe import load_flow_job

    job = load_flow_job(recipe)
    encoders = [job.parallel.encoder] if not job.parallel.encoders else \
        [PartParallelConfig(**sizes) for sizes in job.parallel.encoders.values()]
    world = sum(p.dp * p.tp * p.pp * p.cp for p in (*encoders, job.parallel.backbone))
    model = TINY_MODEL
    if "audio" in job.parallel.encoders:  # a recipe with an audio part: the tiny model with Qwen2.5-Omni's encoder
        cfg = json.loads(TINY_MODEL.read_text())
        cfg["audio_encoder"] = {"audio_encoder": {"model_id": "qwen_omni", "num_attention_heads": 2}}
        model = tmp_path / "model_omni.json"
        model.write_text(json.dumps(cfg))
    parts = parts_for_job(recipe, _argv(model) + ["--use-distributed-optimizer"], world)
    assert parts.layout.world_size == world and parts.layout.part_ranks("backbone")[-1] == world - 1


def _omni_json(tmp_path: Path, **audio) -> Path:
    return _model_json(tmp_path, "omni.json", top={"audio_encoder": {"audio_encoder": {
        "model_id": "qwen_omni", "num_attention_heads": 4, **audio}}})


OMNI_THREE = "parallel:\n  encoders:\n    vision: {dp: 1}\n    audio: {dp: 2}\n  backbone: {dp: 1, tp: 2}\n"


def test_omni_audio_encoder_as_its_own_part_takes_the_ranks_after_the_vision_encoder(tmp_path) -> None:
    parts = parts_for_job(_recipe(tmp_path, OMNI_THREE), _argv(_omni_json(tmp_path, freeze=False)), 5)
    assert parts.layout.encoder_parts == ["encoder", "audio"] and parts.audio_part
    assert [parts.layout.part_ranks(p) for p in ("encoder", "audio", "backbone")] == [[0], [1, 2], [3, 4]]
    assert part_modules(parts.layout, "audio") == ("audio_encoder",)
    assert part_modules(parts.layout, "backbone") == ("text_decoder",)  # the decoder leaves it to the audio part
    assert parts.audio_trainable and parts.trainable("audio") and not parts.frozen_parts
    assert "audio (audio_encoder): ranks 1-2, dp=2" in parts.describe()
    two = parts_for_job(_recipe(tmp_path, "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 2}\n"),
                        _argv(_omni_json(tmp_path)), 3)
    assert not two.audio_part and part_modules(two.layout, "backbone") == ("audio_encoder", "text_decoder")
    frozen = parts_for_job(_recipe(tmp_path, OMNI_THREE), _argv(_omni_json(tmp_path)) + ["--use-distributed-optimizer"],
                           5)
    assert frozen.frozen_parts == ["audio"] and not frozen.audio_trainable


@pytest.mark.parametrize("text,model,world,want", [
    (OMNI_THREE, "vl", 5, "parallel.encoders.audio: omni.json has no audio_encoder"),
    ("parallel:\n  encoders:\n    vision: {dp: 1}\n    audio: {dp: 1, tp: 3}\n  backbone: {dp: 1}\n", "omni", 5,
     "parallel.encoders.audio.tp=3: the audio encoder runs on these ranks, and its num_attention_heads (4)"),
    ("parallel:\n  encoders:\n    vision: {dp: 1}\n    audio: {dp: 1, pp: 2}\n  backbone: {dp: 1}\n", "omni", 4,
     "parallel.encoders.audio.pp=2: an encoder part runs data/tensor parallel only"),
    ("parallel:\n  encoders:\n    vision: {dp: 1}\n    speech: {dp: 1}\n  backbone: {dp: 1}\n", "omni", 3,
     "parallel.encoders=['speech', 'vision']: a MindSpeed-MM flow job's encoder parts are `vision`"),
    ("parallel:\n  encoders:\n    audio: {dp: 1}\n  backbone: {dp: 1}\n", "omni", 2,
     "parallel.encoders=['audio']"),
    ("parallel:\n  encoders:\n    vision: {dp: 1}\n    audio: {dp: 1, depth: 2}\n  backbone: {dp: 1}\n", "omni", 3,
     "parallel.encoders.audio: unknown keys ['depth']"),
    (OMNI_THREE, "omni_frozen", 5, "parallel.encoders.audio: model.json freezes the audio encoder"),
    ("parallel:\n  encoders:\n    vision: {dp: 1}\n    audio: {dp: 3}\n  backbone: {dp: 1}\n", "omni", 5,
     "parallel.encoders.audio.dp=3: --global-batch-size 4 must be divisible"),
])
def test_bad_three_part_recipes_name_the_field_and_the_rule(tmp_path, text, model, world, want) -> None:
    path = {"omni": lambda: _omni_json(tmp_path, freeze=False),
            "omni_frozen": lambda: _omni_json(tmp_path),  # MindSpeed-MM's default: the audio encoder frozen
            "vl": lambda: _model_json(tmp_path, "omni.json")}[model]()
    with pytest.raises(FlowRecipeError) as err:
        parts_for_job(_recipe(tmp_path, text), _argv(path, 4), world)
    assert want in str(err.value), str(err.value)


OMNI_TWO_TP2 = "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, tp: 2}\n"
OMNI_AUDIO_TP = "parallel:\n  encoders:\n    vision: {dp: 1}\n    audio: {dp: 1, tp: %d}\n  backbone: {dp: 1, tp: 2}\n"


@pytest.mark.parametrize("text,world,audio_sp,flags,want", [
    # the audio encoder at TP 2 inherits --sequence-parallel: refused, naming the field and the way out
    (OMNI_TWO_TP2, 3, None, [], "--sequence-parallel with Qwen2.5-Omni's audio encoder at parallel.backbone.tp (the "
                                "audio encoder runs on the decoder's first stage)=2"),
    (OMNI_AUDIO_TP % 2, 5, None, [], "--sequence-parallel with Qwen2.5-Omni's audio encoder at "
                                     "parallel.encoders.audio.tp=2"),
    (OMNI_AUDIO_TP % 2, 5, True, [], 'add "sequence_parallel": false to omni.json\'s audio_encoder.audio_encoder'),
    # MC2 cannot run in a module without sequence parallelism: only an audio part at tp 1 avoids it
    (OMNI_TWO_TP2, 3, False, ["--use-ascend-mc2"], "--use-ascend-mc2 with Qwen2.5-Omni's audio encoder at "
                                                   "parallel.backbone.tp"),
    (OMNI_AUDIO_TP % 2, 5, False, ["--use-ascend-mc2"], "give the audio encoder its own part at tp 1"),
    # accepted: model.json turns sequence parallelism off in the audio encoder, or its part has no TP
    (OMNI_TWO_TP2, 3, False, [], ""),
    (OMNI_AUDIO_TP % 2, 5, False, [], ""),
    (OMNI_AUDIO_TP % 1, 4, None, ["--use-ascend-mc2"], ""),
], ids=["two_parts", "audio_tp2", "audio_tp2_sp_on", "two_parts_mc2", "audio_tp2_mc2", "two_parts_sp_off",
        "audio_tp2_sp_off", "audio_tp1_mc2"])
def test_sequence_parallel_where_the_audio_encoder_runs_tensor_parallel(tmp_path, text, world, audio_sp, flags,
                                                                        want) -> None:
    """MindSpeed-MM's audio encoder never splits its frames over TP, so under --sequence-parallel it runs only
    with `"sequence_parallel": false` in its own model.json section, and never under MC2 (MindSpeed refuses MC2 in
    a TP module without sequence parallelism); an audio part at tp 1 needs neither."""
    model = _omni_json(tmp_path, freeze=False, **({} if audio_sp is None else {"sequence_parallel": audio_sp}))
    argv = _argv(model, 4) + ["--sequence-parallel", *flags]
    if not want:
        assert parts_for_job(_recipe(tmp_path, text), argv, world).layout.world_size == world
        return
    with pytest.raises(FlowRecipeError) as err:
        parts_for_job(_recipe(tmp_path, text), argv, world)
    assert want in str(err.value), str(err.value)


def test_fix_sp_embedding_grad_reaches_the_parts_and_is_off_by_default(tmp_path) -> None:
    """The recipe's flow.fix_sp_embedding_grad is what the decoder's patch reads (FlowParts); off, the job computes
    MindSpeed-MM's own gradients."""
    base = "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, tp: 2}\n"
    model = _model_json(tmp_path)
    assert not parts_for_job(_recipe(tmp_path, base), _argv(model), 3).fix_sp_embedding_grad
    fixed = _recipe(tmp_path, base + "flow:\n  fix_sp_embedding_grad: true\n")
    assert parts_for_job(fixed, _argv(model) + ["--sequence-parallel"], 3).fix_sp_embedding_grad


# ------------------------------------------------------------------------------ refusals before any group exists


@pytest.mark.parametrize("case,want", [
    ("script", "pretrain_omni.py: MindSpeed-MM's OmniModel entry is not a flow entry"),
    ("qwen3vit", "image_encoder.vision_encoder.model_id='qwen3vit': Qwen3-VL's ViT returns deepstack"),
    ("internvl", "image_encoder.vision_encoder.model_id='clip': InternVL's ViT takes no image_grid_thw"),
    ("audio", "audio_encoder.audio_encoder.model_id=None: not an audio encoder the flow host runs"),
    ("audio_packed", "packing.layout=packed: model.json has an audio_encoder"),
    ("audio_split", "audio_encoder.audio_encoder.pipeline_num_layers=[16, 16]: the flow job runs the audio encoder "
                    "whole on the LLM's first stage"),
    ("moe", "text_decoder.num_moe_experts=8: MoE decoders"),
    ("ep", "--expert-model-parallel-size 2: expert parallelism"),
    ("cp", "--context-parallel-size 2: flow parts run without context parallelism"),
    ("fsdp2", "--use-torch-fsdp2: Megatron's FSDP wrapper is not supported per flow part yet"),
    ("video", "dataset_param.attr images='images' and videos='videos': MindSpeed-MM's pretrain_vlm.py cannot "
              "train images and videos in one data set"),
    ("sampler", "dataloader_param.sampler_type='LengthGroupedSampler'"),
    ("ckpt", "--ckpt-format torch_dist (Megatron default): a flow job saves and loads Megatron's torch format"),
    ("packed", "packing.layout=packed needs the job's --use-flash-attn"),
])
def test_what_the_host_cannot_take_is_refused_by_name(tmp_path, case, want) -> None:
    recipe = _recipe(tmp_path, "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 2}\n"
                     + ("packing: {layout: packed}\n" if case in ("packed", "audio_packed") else ""))
    model = {"qwen3vit": lambda: _model_json(tmp_path, vit={"model_id": "qwen3vit"}),
             "internvl": lambda: _model_json(tmp_path, vit={"model_id": "clip"}),
             "audio": lambda: _model_json(tmp_path, top={"audio_encoder": {"audio_encoder": {}}}),
             "audio_packed": lambda: _model_json(tmp_path, top={"audio_encoder": {"audio_encoder": {
                 "model_id": "qwen_omni", "num_attention_heads": 2}}}),
             "audio_split": lambda: _model_json(tmp_path, top={"audio_encoder": {"audio_encoder": {
                 "model_id": "qwen_omni", "num_attention_heads": 2, "pipeline_num_layers": [16, 16]}}}),
             "moe": lambda: _model_json(tmp_path, num_moe_experts=8)}.get(case, lambda: _model_json(tmp_path))()
    argv = _argv(model)
    script = "pretrain_omni.py" if case == "script" else "pretrain_vlm.py"
    if case in ("video", "sampler"):
        data = {"dataset_param": {"attr": {"images": "images", "videos": "videos" if case == "video" else None}},
                "dataloader_param": {"sampler_type": "LengthGroupedSampler" if case == "sampler"
                                     else "BaseRandomBatchSampler"}}
        (tmp_path / "data.json").write_text(json.dumps(data))
        argv += ["--mm-data", str(tmp_path / "data.json")]
    argv += {"ep": ["--expert-model-parallel-size", "2"], "cp": ["--context-parallel-size", "2"],
             "ckpt": ["--save", str(tmp_path / "ck")], "fsdp2": ["--use-torch-fsdp2"]}.get(case, [])
    with pytest.raises(FlowRecipeError) as err:
        parts_for_job(recipe, argv, 3, script=script)
    assert want in str(err.value), str(err.value)


def test_recipe_layer_split_gives_the_decoder_stages(tmp_path) -> None:
    model = _model_json(tmp_path, num_layers=5)
    recipe = _recipe(tmp_path, "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, pp: 2, layer_split: [1, 4]}\n")
    assert parts_for_job(recipe, _argv(model), 3).decoder_layers == (1, 4)
    bad = _recipe(tmp_path, "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, pp: 2, layer_split: [2, 2]}\n")
    with pytest.raises(FlowRecipeError, match="layer_split=\\[2, 2\\]: needs one entry per"):
        parts_for_job(bad, _argv(model), 3)


def test_decoder_split_precedence_recipe_then_model_json_then_even(tmp_path) -> None:
    """recipe layer_split > model.json pipeline_num_layers with one entry per decoder stage > even split; each
    result and each error names where the split came from."""
    pp2 = "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, pp: 2%s}\n"
    recipe = _recipe(tmp_path, pp2 % ", layer_split: [3, 1]")
    plain = tmp_path / "plain.yaml"
    plain.write_text(pp2 % "")
    split13 = _model_json(tmp_path, "m13.json", num_layers=4, pipeline_num_layers=[1, 3])
    parts = parts_for_job(recipe, _argv(split13), 3)  # the recipe wins over model.json
    assert parts.decoder_layers == (3, 1) and parts.decoder_layers_from == "flow.yaml parallel.backbone.layer_split"
    parts = parts_for_job(plain, _argv(split13), 3)  # model.json's split, one entry per decoder stage
    assert parts.decoder_layers == (1, 3)
    assert parts.decoder_layers_from == "m13.json text_decoder.pipeline_num_layers"
    coupled4 = _model_json(tmp_path, "m4.json", num_layers=4, pipeline_num_layers=[1, 1, 1, 1])
    parts = parts_for_job(plain, _argv(coupled4), 3)  # a coupled PP 4 split does not fit PP 2: even
    assert parts.decoder_layers == (2, 2)
    assert parts.decoder_layers_from == ("an even split (no plain.yaml parallel.backbone.layer_split; m4.json "
                                         "text_decoder.pipeline_num_layers [1, 1, 1, 1] has 4 entries, not 2)")
    absent = _model_json(tmp_path, "m.json", num_layers=5)
    assert parts_for_job(plain, _argv(absent), 3).decoder_layers == (2, 3)
    assert "m.json text_decoder.pipeline_num_layers absent" in parts_for_job(plain, _argv(absent), 3).decoder_layers_from
    for split, want in (([0, 4], "m.json: text_decoder.pipeline_num_layers=[0, 4]: has one entry per pipeline stage "
                                 "(pp=2), so it gives the split, but each entry must be >= 1 and they must sum to the "
                                 "LLM's 4 layers; fix it or give plain.yaml parallel.backbone.layer_split"),
                        ([2, 3], "m.json: text_decoder.pipeline_num_layers=[2, 3]: has one entry")):
        with pytest.raises(FlowRecipeError) as err:
            parts_for_job(plain, _argv(_model_json(tmp_path, "m.json", num_layers=4, pipeline_num_layers=split)), 3)
        assert want in str(err.value), str(err.value)
    with pytest.raises(FlowRecipeError, match=r"layer_split=\[3, 1\]: .* summing to the LLM's 5 layers \(the "
                                              r"recipe's split wins over m.json text_decoder.pipeline_num_layers\)"):
        parts_for_job(recipe, _argv(_model_json(tmp_path, "m.json", num_layers=5)), 3)


def test_plan_out_writes_the_split_a_flow_job_takes(tmp_path, capsys) -> None:
    """`mindspeed-flow plan --out` writes the uneven split it assumes as parallel.backbone.layer_split, the field the
    MindSpeed-MM host reads first."""
    from mindspeed_flow.hosts.mindspeed_mm.recipe import ModelShape, decoder_split_for, load_flow_job
    from mindspeed_flow.planner.cli import main as plan

    out = tmp_path / "planned.yaml"
    # no baselines: the decoupled plan is what --out writes (a faster baseline would be written instead)
    assert plan(["samples=256", "--no-baselines", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    job = load_flow_job(out)
    split = job.parallel.backbone.layer_split
    assert split and len(set(split)) > 1 and f"layers/stage={split}" in printed
    model = ModelShape.from_model_json(_model_json(tmp_path, num_layers=sum(split), pipeline_num_layers=[sum(split)]))
    assert decoder_split_for(job, model, out.name).layers == tuple(split)


def _vlm_whole() -> dict[str, torch.Tensor]:
    """A coupled model's whole tensors: 4 LLM layers (gated MLP), 2 ViT layers (gated), patch embed, projector."""
    t = _whole(gated=True)
    g = torch.Generator().manual_seed(1)
    h, f = 8, 12
    del t["image_encoder.encoder.blocks.layers.0.mlp.linear_fc1.weight"]
    for i in range(2):
        p = f"image_encoder.encoder.blocks.layers.{i}."
        t[p + "self_attention.linear_qkv.weight"] = torch.randn(3 * h, h, generator=g)
        t[p + "self_attention.linear_proj.weight"] = torch.randn(h, h, generator=g)
        t[p + "mlp.linear_fc1.weight"] = torch.randn(2 * f, h, generator=g)
        t[p + "mlp.linear_fc2.weight"] = torch.randn(h, f, generator=g)
        t[p + "input_layernorm.weight"] = torch.randn(h, generator=g)
    t["image_encoder.encoder.patch_embed.proj.weight"] = torch.randn(h, 6, generator=g)
    t["image_encoder.projector.layernorm.weight"] = torch.randn(h, generator=g)
    t["image_encoder.projector.encoder.linear_fc1.weight"] = torch.randn(f, h, generator=g)
    t["image_encoder.projector.encoder.linear_fc2.weight"] = torch.randn(h, f, generator=g)
    return t


GATED = ("image_encoder.encoder.", "text_decoder.")


def _write_coupled(root: Path, whole: dict, tp: int, vit: list[int], text: list[int], with_split: bool) -> Path:
    """A coupled checkpoint in Megatron's layout (iter_0000003/mp_rank_TT_PPP/model_optim_rng.pt, tracker), the ViT on
    the stages `vit` gives layers to (MindSpeed-MM's pipeline_num_layers), with optimizer state beside the model."""
    from types import SimpleNamespace as NS

    pp = len(text)
    model_cfg = NS(text_decoder=NS(pipeline_num_layers=text), image_encoder=NS(vision_encoder=NS(pipeline_num_layers=vit)))
    args = NS(mm=NS(model=model_cfg) if with_split else None, pipeline_model_parallel_size=pp)
    it = root / "iter_0000003"
    for s in range(pp):
        for r in range(tp):
            model = ck.part_state(whole, "backbone", tp=tp, tp_rank=r, layers=text, pp_rank=s, gated_prefixes=GATED)
            if vit[s]:
                model.update(ck.part_state(whole, "encoder", tp=tp, tp_rank=r, layers=[n for n in vit if n],
                                           pp_rank=[n for n in vit if n].index(vit[s]), gated_prefixes=GATED))
            state = {"model": model, "args": args, "iteration": 3, "checkpoint_version": 3.0,
                     "optimizer": {"state": {k: torch.randn_like(v) for k, v in model.items()}}}
            d = it / f"mp_rank_{r:02d}_{s:03d}"
            d.mkdir(parents=True)
            torch.save(state, d / "model_optim_rng.pt")
    (root / ck.TRACKER).write_text("3")
    return it


@pytest.mark.parametrize("with_split", [True, False], ids=["split_from_args", "split_from_keys"])
def test_coupled_checkpoint_rank_reads_only_its_share(tmp_path, with_split) -> None:
    """A TP2 x PP2 coupled checkpoint (ViT on stage 0, LLM layers [1, 3]): each flow rank gets exactly the tensors of
    the whole-merge path and reads strictly less than the checkpoint holds."""
    whole = _vlm_whole()
    it = _write_coupled(tmp_path, whole, tp=2, vit=[2, 0], text=[1, 3], with_split=with_split)
    merged, _ = ck.read_whole(it, None, GATED)
    model_bytes = sum(v.numel() * v.element_size() for v in whole.values())
    cases = [  # part, tp, tp_rank, layers, pp_rank, tied
        ("encoder", 1, 0, [2], 0, False), ("encoder", 2, 1, [2], 0, False),
        ("backbone", 2, 1, [2, 2], 1, False), ("backbone", 2, 0, [2, 2], 1, True),
        ("backbone", 2, 1, [2, 2], 0, False), ("backbone", 1, 0, [3, 1], 1, True), ("backbone", 1, 0, [4], 0, False),
    ]
    for part, tp, tp_rank, layers, pp_rank, tied in cases:
        old = ck.part_state(merged, part, tp=tp, tp_rank=tp_rank, layers=layers, pp_rank=pp_rank,
                            gated_prefixes=GATED, tied=tied)
        new, args, stats = ck.read_for_rank(it, part, tp=tp, tp_rank=tp_rank, layers=layers, pp_rank=pp_rank,
                                            gated_prefixes=GATED, tied=tied)
        case = (part, tp, tp_rank, layers, pp_rank, tied)
        assert new.keys() == old.keys(), case
        assert all(torch.equal(new[k], old[k]) for k in old), case
        assert args.pipeline_model_parallel_size == 2
        assert stats.read_bytes < stats.total_bytes and stats.read_bytes < model_bytes, (case, stats)
        assert stats.split_from == ("the saved args' pipeline_num_layers" if with_split else "the folders' layer keys")
        print(case, stats.line())
    # The encoder and a last-stage decoder rank with the coupled TP: one stage's folders, their own shard's bytes.
    _, _, enc = ck.read_for_rank(it, "encoder", tp=2, tp_rank=1, layers=[2], pp_rank=0, gated_prefixes=GATED)
    enc_bytes = sum(v.numel() * v.element_size() for k, v in whole.items() if k.startswith("image_encoder."))
    assert enc.read_bytes <= enc_bytes and (not with_split or enc.files_opened == 2), enc
    _, _, last = ck.read_for_rank(it, "backbone", tp=2, tp_rank=1, layers=[2, 2], pp_rank=1, gated_prefixes=GATED)
    last_layers = sum(v.numel() * v.element_size() for k, v in whole.items()
                      if k.startswith(("text_decoder.decoder.layers.2.", "text_decoder.decoder.layers.3.")))
    assert last.read_bytes < last_layers, last  # its TP half of layers 2-3 plus the final norm and output layer half


@pytest.mark.parametrize("layers", [[4], [1, 3], [2, 1, 1]])
def test_tied_embeddings_give_the_last_stage_its_output_layer(layers) -> None:
    whole = _whole(gated=True)
    whole.pop("text_decoder.output_layer.weight")  # a tied single-stage checkpoint has no output layer
    emb = whole["text_decoder.embedding.word_embeddings.weight"]
    for tp in (1, 2):
        for pp_rank in range(len(layers)):
            stage = [ck.part_state(whole, "backbone", tp=tp, tp_rank=r, layers=layers, pp_rank=pp_rank,
                                   gated_prefixes=("text_decoder.",), tied=True) for r in range(tp)]
            last = pp_rank == len(layers) - 1 and len(layers) > 1
            assert all((ck.OUTPUT_LAYER in s) == last for s in stage), (layers, pp_rank)
            if last:
                assert torch.equal(torch.cat([s[ck.OUTPUT_LAYER] for s in stage]), emb)
    # Back to one stage: the copy on the last stage is dropped again.
    two = [ck.part_state(whole, "backbone", tp=1, tp_rank=0, layers=[2, 2], pp_rank=r,
                         gated_prefixes=("text_decoder.",), tied=True) for r in range(2)]
    single = ck.part_state(ck.merge_pp(two), "backbone", tp=1, tp_rank=0, layers=[4], pp_rank=0,
                           gated_prefixes=("text_decoder.",), tied=True)
    assert ck.OUTPUT_LAYER not in single and torch.equal(single[ck.WORD_EMBEDDINGS], emb)


# ------------------------------------------------------------------------------ plan orders and loss weights


def _step(dp_rows: list[list[list[int]]], producers: dict[int, list[int]], tokens: dict[int, int]):
    from mindspeed_flow.hosts.mindspeed_mm.data import FlowSample, FlowStep
    from mindspeed_flow.packing.types import Microbatch, StepPlan
    from mindspeed_flow.step.plan import StepWork

    plan = StepPlan([[Microbatch(ids, 0, 0.0) for ids in row] for row in dp_rows], [], 64)
    work = StepWork(0, sorted(tokens), plan)
    consumers = [10 + d for d in range(len(dp_rows))]
    for d, row in enumerate(dp_rows):
        for ids in row:
            for sid in ids:
                work.consumer_of[sid] = consumers[d]
    for p, ids in producers.items():
        work.encode_order[p] = ids
        for sid in ids:
            work.producers.setdefault("encoder", {})[sid] = p
    samples = {sid: FlowSample(sid, torch.zeros(5), torch.zeros(5), None, None, n) for sid, n in tokens.items()}
    return FlowStep(0, samples, work), consumers


def test_transfer_orders_are_one_global_order_per_direction() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.schedule import embedding_order, gradient_order

    # Two decoder replicas (slots 0, 1), two producers; sample 5 has no image.
    step, consumers = _step([[[0, 1], [2]], [[3], [4, 5]]], {0: [3, 0, 4], 1: [1, 2]},
                            {0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 5: 0})
    order = embedding_order(step, [0, 1])
    assert order == [3, 0, 1, 4, 2]  # slot 0: producer 0's (3, 0), producer 1's (1); slot 1: 4, then 2
    for p, ids in step.work.encode_order.items():
        assert [s for s in order if s in ids] == ids  # each producer sends in this order
    assert gradient_order(step, consumers) == [0, 1, 3, 2, 4]  # slot, consumer, row


def test_loss_weights_give_the_unpatched_objective() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.data import FlowSample
    from mindspeed_flow.hosts.mindspeed_mm.schedule import LOSS_MICROBATCH, LOSS_SAMPLE, loss_weights

    # Two loader micro-batches of two samples: tokens (3, 1) and (2, 2).
    samples = [FlowSample(i, torch.zeros(1), torch.zeros(1), None, None, 0, t, b, bt, 2)
               for i, (t, b, bt) in enumerate([(3, 0, 4), (1, 0, 4), (2, 1, 4), (2, 1, 4)])]
    token_loss = {0: 1.0, 1: 5.0, 2: 2.0, 3: 4.0}  # the same loss on every token of a sample
    for mode, want in ((LOSS_MICROBATCH, ((3 * 1 + 1 * 5) / 4 + (2 * 2 + 2 * 4) / 4) / 2),
                       (LOSS_SAMPLE, ((1 + 5) / 2 + (2 + 4) / 2) / 2)):
        w = loss_weights(samples, mode, loader_batches=2)
        got = sum(w[i] * s.loss_tokens * token_loss[i] for i, s in enumerate(samples))
        assert got == pytest.approx(want), mode


# ------------------------------------------------------------------------------ packed (THD) decoder microbatches


def test_packed_row_keeps_samples_apart_and_pads_only_for_sequence_parallel() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.packed import pack_samples

    ids = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11, 12, 13])]
    labels = [torch.tensor([-100, 6, 7]), torch.tensor([8, 9]), torch.tensor([-100, -100, 12, 13])]
    positions = [torch.arange(n).expand(3, -1) + 100 * i for i, n in enumerate((3, 2, 4))]
    row = pack_samples(ids, labels, positions, pad_multiple=4)
    assert row.segments == [3, 2, 4, 3] and row.samples == 3 and row.cu_seqlens == [3, 5, 9, 12]
    assert row.batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0, 0]]
    # No label crosses a boundary: each sample's first label is dropped (the previous sample's last token would
    # predict it); the padding tail carries no loss.
    assert row.batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, 12, 13, -100, -100, -100]]
    pos = row.batch["position_ids"]
    assert pos.shape == (3, 1, 12)
    assert pos[0, 0].tolist() == [0, 1, 2, 100, 101, 200, 201, 202, 203, 0, 1, 2]  # restarts per sample
    weights = row.token_weights([1.0, 2.0, 3.0])
    assert weights.shape == (1, 11)
    assert weights[0].tolist() == [1.0] * 3 + [2.0] * 2 + [3.0] * 4 + [0.0] * 2
    assert pack_samples(ids, labels, positions).segments == [3, 2, 4]  # no SP: no padding at all
    empty = pack_samples([], [], [], pad_multiple=2)
    assert empty.segments == [2] and empty.samples == 0 and empty.batch["labels"].eq(-100).all()


def test_microbatch_tokens_count_padding_per_layout() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.data import LAYOUT_PACKED, LAYOUT_ROWS, microbatch_tokens

    assert microbatch_tokens([3, 2, 4], LAYOUT_ROWS, 1) == 12
    assert microbatch_tokens([3, 2, 4], LAYOUT_PACKED, 1) == 9
    assert microbatch_tokens([3, 2, 4], LAYOUT_PACKED, 4) == 12
    assert microbatch_tokens([3, 2, 4], LAYOUT_ROWS, 4) == 12
    assert microbatch_tokens([], LAYOUT_PACKED, 2) == 2


# ------------------------------------------------------------------------------ encoder groups and in-flight bound


@pytest.mark.parametrize("value,pp,frozen,want", [
    (0, 1, False, 2), (0, 2, False, 3), (1, 1, False, 1), (2, 2, False, 2), (5, 2, False, 5),
    (1, 2, True, 1),  # a frozen encoder waits only for receipts (posted at the decoder's step start): no deadlock
])
def test_encoder_inflight_resolves_from_the_decoder_pipeline(tmp_path, value, pp, frozen, want) -> None:
    recipe = _recipe(tmp_path, f"parallel:\n  encoder: {{dp: 1}}\n  backbone: {{dp: 1, pp: {pp}}}\n"
                               f"flow:\n  encoder_inflight: {value}\n")
    model = _frozen_model(tmp_path) if frozen else _model_json(tmp_path)
    argv = _argv(model) + (["--use-distributed-optimizer"] if frozen else [])
    assert parts_for_job(recipe, argv, 1 + pp).encoder_inflight == want


def _frozen_model(tmp_path: Path) -> Path:
    path = _model_json(tmp_path, vit={"freeze": True})
    cfg = json.loads(path.read_text())
    cfg["image_encoder"]["vision_projector"]["freeze"] = True
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("value,want", [
    (1, "flow.encoder_inflight=1: must be >= parallel.backbone.pp=2"),
    (-1, "flow.encoder_inflight=-1: must be an integer >= 0"),
])
def test_encoder_inflight_that_would_deadlock_is_refused(tmp_path, value, want) -> None:
    recipe = _recipe(tmp_path, f"parallel:\n  encoder: {{dp: 1}}\n  backbone: {{dp: 1, pp: 2}}\n"
                               f"flow:\n  encoder_inflight: {value}\n")
    with pytest.raises(FlowRecipeError) as err:
        parts_for_job(recipe, _argv(_model_json(tmp_path)), 3)
    assert want in str(err.value) and len(str(err.value).splitlines()) == 1


def test_slot_groups_cut_the_encode_order_by_decoder_slot() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.schedule import embedding_order, slot_groups

    step, _ = _step([[[0, 1], [2]], [[3], [4, 5]]], {0: [3, 0, 4], 1: [1, 2]},
                    {0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 5: 0})
    assert slot_groups(step, [3, 0, 4]) == [[3, 0], [4]]  # slot 0 of both decoder replicas, then slot 1
    assert slot_groups(step, [1, 2]) == [[1], [2]]
    # Sending group by group, sample by sample, keeps each producer's part of the global embedding order.
    order = embedding_order(step, [0, 1])
    for p, ids in step.work.encode_order.items():
        assert [sid for g in slot_groups(step, ids) for sid in g] == [s for s in order if s in ids]


def test_saved_bytes_counts_activations_once_and_not_parameters() -> None:
    from mindspeed_flow.step.held import HeldPeak, SavedBytes

    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8)
    saved = SavedBytes()
    with saved.counting():
        h = lin(x)  # saves x (and the weight: a parameter, not counted)
        y = (h * h).sum()  # saves h (twice: one storage)
    assert saved.total == x.numel() * 4 + h.numel() * 4
    y.backward()
    peak = HeldPeak()
    peak.add(10), peak.add(5), peak.drop(10), peak.add(7)
    assert (peak.peak_groups, peak.peak_bytes, peak.groups, peak.bytes) == (2, 15, 2, 12)


def _saved(root: Path, iteration: int, folders: list[str]) -> None:
    for name in folders:
        (root / f"iter_{iteration:07d}" / name).mkdir(parents=True)
        (root / f"iter_{iteration:07d}" / name / "model_optim_rng.pt").write_bytes(b"")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_resume_in_another_layout_is_refused_unless_weights_only(tmp_path) -> None:
    """A flow checkpoint whose decoder was saved at PP 2, loaded by a recipe with the decoder at PP 1: refused before
    any rank starts, naming the part and both layouts; accepted when the job loads weights only (each rank then
    re-splits its share); `--ckpt-step` picks the iteration whose layout counts."""
    ckpt = tmp_path / "ckpt"
    _saved(ckpt, 4, ["mp_image_encoder_rank_00", "mp_text_decoder_rank_00_000", "mp_text_decoder_rank_00_001"])
    _saved(ckpt, 8, ["mp_image_encoder_rank_00", "mp_text_decoder_rank_00"])
    model = _model_json(tmp_path)
    argv = _argv(model) + ["--ckpt-format", "torch", "--load", str(ckpt), "--use-distributed-optimizer"]
    recipe = _recipe(tmp_path, "parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 2}\n")
    parts_for_job(recipe, argv, 3)  # iteration 8 was saved in this layout
    with pytest.raises(FlowRecipeError) as err:
        parts_for_job(recipe, argv + ["--ckpt-step", "4"], 3)
    assert "saved with text_decoder at TP 1 PP 2 (the recipe: TP 1 PP 1)" in str(err.value), str(err.value)
    assert "--no-load-optim --no-load-rng" in str(err.value)
    parts_for_job(recipe, argv + ["--ckpt-step", "4", "--no-load-optim", "--no-load-rng"], 3)
    parts_for_job(recipe, argv + ["--ckpt-step", "4", "--finetune"], 3)


def _example_model_json(size: str) -> dict:
    """MindSpeed-MM's examples/qwen2.5vl/model_<size>.json: from $MINDSPEED_MM_HOME, else from the pinned sources
    archive beside the repository (../shared/third_party); skipped when neither is there."""
    home = os.environ.get("MINDSPEED_MM_HOME")
    if home and (Path(home) / f"examples/qwen2.5vl/model_{size}.json").is_file():
        return json.loads((Path(home) / f"examples/qwen2.5vl/model_{size}.json").read_text())
    archive = Path(__file__).resolve().parents[1].parent / "shared/third_party/mindspeed_mm_sources.tar.gz"
    if not archive.is_file():
        pytest.skip("MindSpeed-MM's example configs absent (MINDSPEED_MM_HOME or the pinned archive)")
    with tarfile.open(archive) as tar:
        return json.loads(tar.extractfile(f"MindSpeed-MM/examples/qwen2.5vl/model_{size}.json").read())


@pytest.mark.parametrize("size", ["3b", "7b", "32b", "72b"])
def test_cost_model_reads_the_same_architecture_as_the_planner(size: str) -> None:
    """The flow job's packing costs come from model.json through the same spec (and `CostModel.from_spec`) the
    planner prices from the published checkpoint's config.json: for MindSpeed-MM's own example configs the two
    specs are equal, field for field."""
    def attrs(node: dict) -> SimpleNamespace:  # MindSpeed-MM's ConfigReader: nested attribute access
        return SimpleNamespace(**{k: attrs(v) if isinstance(v, dict) else v for k, v in node.items()})

    cfg = attrs(_example_model_json(size))
    spec, published = model_spec(cfg), VLMSpec.from_hf_config(REAL_PRESETS[("qwen2_5_vl", size)])
    assert spec.llm == published.llm and spec.vision == published.vision
    assert vit_frozen(cfg)  # the examples freeze the ViT: forward-only costs
    frozen, trained = CostModel.from_spec(spec, True), CostModel.from_spec(spec, False)
    assert frozen.enc_linear * 3 == pytest.approx(trained.enc_linear)
    # profiled coefficients in the recipe's packing section win over the FLOP model, as on the torch host
    profiled = CostModel.from_config(PackingConfig(linear_coeff=2.0, quadratic_coeff=0.5), spec, True)
    assert (profiled.linear, profiled.quadratic) == (2.0, 0.5) and profiled.enc_linear == frozen.enc_linear


def test_one_list_of_what_is_supported_is_what_the_launcher_checks() -> None:
    """The README and docs/mindspeed_mm.md show `support_table()` verbatim, and every entry script and model id it
    names as refused is refused by the launcher's checks with its reason (every supported one passes them)."""
    root = Path(__file__).resolve().parents[1]
    table = support_table()
    for doc in ("README.md", "docs/mindspeed_mm.md"):
        assert table in (root / doc).read_text(), f"{doc}: regenerate the table from support_table()"
    for script in SUPPORTED_SCRIPTS:
        check_job_flags([], f"/x/{script}")
    for tail, why in REFUSED_SCRIPTS.items():
        with pytest.raises(FlowRecipeError) as err:
            check_job_flags([], f"/opt/MindSpeed-MM/{tail}")
        assert str(err.value).startswith(Path(tail).name) and why in str(err.value)
    good = {"model_id": "qwen2_5vl", "image_encoder": {"vision_encoder": {"model_id": "qwen2vit"},
                                                       "vision_projector": {"model_id": "lnmlp"}},
            "text_decoder": {"model_id": "qwen2_5_lm"}}
    assert unsupported_model(good) == []
    for field, (ok, refused) in MODEL_IDS.items():
        for model_id in (*ok, *refused):
            cfg = json.loads(json.dumps(good))
            node = cfg
            *path, last = field.split(".")
            for key in path:
                node = node[key]
            node[last] = model_id
            problems = unsupported_model(cfg)
            assert (problems == []) == (model_id in ok), (field, model_id, problems)
            if model_id in refused:
                assert problems == [f"{field}={model_id!r}: {refused[model_id]} (supported: {', '.join(ok)})"]
