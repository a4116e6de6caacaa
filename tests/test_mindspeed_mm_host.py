"""The MindSpeed-MM host's pure parts, without MindSpeed sources: recipe checks, rank layout, checkpoint re-sharding."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed_flow.hosts.mindspeed_mm import checkpoint as ck
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError, even_split, parts_for_job


def _model_json(tmp_path: Path, **llm) -> Path:
    cfg = {"image_encoder": {"vision_encoder": {"num_attention_heads": 2, "num_layers": 2, "freeze": False},
                             "vision_projector": {"freeze": False}},
           "text_decoder": {"num_attention_heads": 4, "num_query_groups": 2, "num_layers": 2, **llm}}
    path = tmp_path / "model.json"
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
    assert parts.ranks("encoder") == [0, 1] and parts.ranks("backbone") == [2, 3, 4, 5]
    # Megatron's tp-cp-dp-pp order inside the decoder: TP neighbours adjacent, stage 1 after stage 0.
    assert parts.global_rank("backbone", tp=1, pp=0) == 3 and parts.global_rank("backbone", tp=0, pp=1) == 4
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
def test_every_mindspeed_mm_flow_recipe_builds_its_parts(recipe) -> None:
    from mindspeed_flow.hosts.mindspeed_mm.recipe import load_flow_job

    job = load_flow_job(recipe)
    world = sum(p.dp * p.tp * p.pp * p.cp for p in (job.parallel.encoder, job.parallel.backbone))
    parts = parts_for_job(recipe, _argv(TINY_MODEL), world)
    assert parts.world_size == world and parts.ranks("backbone")[-1] == world - 1


def _transfer(rank: int, world: int, expected_sample: int) -> object:
    import torch.distributed as dist

    from mindspeed_flow.hosts.mindspeed_mm.transport import (KIND_EMBEDDING, KIND_GRAD, FlowTransportError,
                                                             PlannedTransport)

    t = PlannedTransport(rank=rank, payload_group=dist.new_group([0, 1]), header_group=dist.new_group(
        [0, 1], backend="gloo"), device=torch.device("cpu"), timeout_s=20)
    if rank == 0:  # producer: two embeddings in its order, then the gradient of the first
        t.post_receives(KIND_GRAD, 1, 0, [(7, 3)], hidden=4)
        t.send(KIND_EMBEDDING, 1, 0, 7, torch.full((3, 1, 4), 1.5))
        t.send(KIND_EMBEDDING, 1, 0, 8, torch.full((2, 1, 4), 2.5))
        grad = t.receive(KIND_GRAD, 1, 0, 7)
        t.flush()
        return grad.float().sum().item()
    t.post_receives(KIND_EMBEDDING, 0, 0, [(7, 3), (expected_sample, 2)], hidden=4)
    first = t.receive(KIND_EMBEDDING, 0, 0, 7)
    t.send(KIND_GRAD, 0, 0, 7, torch.ones(3, 1, 4))
    try:
        second = t.receive(KIND_EMBEDDING, 0, 0, expected_sample)
    except FlowTransportError as err:
        t.flush()
        return str(err)
    t.flush()
    return (first.float().mean().item(), second.float().mean().item())


def test_planned_transport_moves_items_in_plan_order() -> None:
    from mindspeed_flow.utils.multiproc import run_ranks

    producer, consumer = run_ranks(_transfer, 2, 8, timeout_s=60)
    assert producer == 12.0 and consumer == (1.5, 2.5)


def test_planned_transport_stops_when_plans_differ() -> None:
    from mindspeed_flow.utils.multiproc import run_ranks

    _, message = run_ranks(_transfer, 2, 9, timeout_s=60)
    assert "expected the embedding of sample 9 (step 0) from rank 0" in message
    assert "sent embedding of sample 8" in message and "plans differ" in message
