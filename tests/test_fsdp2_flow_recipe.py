"""The FSDP2 flow job's checks before any process group exists, its image plan, and the launcher's routing.

No MindSpeed-MM is needed: CONFIG.yaml here has the keys of MindSpeed-MM's `examples/qwen3vl` v1 config that the
checks read (the full example runs in tests/mindspeed_mm/test_fsdp2_flow.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindspeed_flow.hosts.mindspeed_mm import fsdp2
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError
from mindspeed_flow.step.layout import BACKBONE, ENCODER

CONFIG = """\
parallel:
  tensor_parallel_size: 1
  fully_shard_parallel_size: auto
  ring_attention_size: 1
  ulysses_parallel_size: 1
  expert_parallel_size: {ep}
data:
  dataloader_param:
    sampler_type: BaseRandomBatchSampler
model:
  model_id: {model_id}
  freeze: []
training:
  micro_batch_size: 1
  gradient_accumulation_steps: 1
  train_iters: 10
{extra}"""
RECIPE = """\
parallel:
  encoder: {{dp: {enc}, tp: 1, pp: 1, cp: 1}}
  backbone: {{dp: {bb}, tp: {bb_tp}, pp: 1, cp: 1}}
{trainer}"""


def _files(tmp_path: Path, *, enc: int = 1, bb: int = 2, bb_tp: int = 1, ep: int = 2, model_id: str = "qwen3_vl_moe",
           extra: str = "", trainer: str = "trainer:\n  global_batch_size: 2\n") -> tuple[Path, Path]:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(ep=ep, model_id=model_id, extra=extra))
    recipe = tmp_path / "flow.yaml"
    recipe.write_text(RECIPE.format(enc=enc, bb=bb, bb_tp=bb_tp, trainer=trainer))
    return recipe, config


def test_parts_from_recipe_and_config(tmp_path: Path) -> None:
    recipe, config = _files(tmp_path)
    parts = fsdp2.fsdp2_parts_for_job(recipe, [str(config)], 3)
    assert parts.layout.part_ranks(ENCODER) == [0] and parts.layout.part_ranks(BACKBONE) == [1, 2]
    assert parts.grad_accumulation == 1 and parts.expert_parallel_size == 2
    assert parts.overrides(BACKBONE)["parallel"] == {"fully_shard_parallel_size": 2, "expert_parallel_size": 2,
                                                     "expert_fully_shard_parallel_size": 1}
    assert parts.overrides(ENCODER)["parallel"]["expert_parallel_size"] == 1
    # One LLM rank carries the global batch of 2 in two micro-steps; both parts step alike.
    recipe, config = _files(tmp_path, enc=2, bb=1, ep=1)
    parts = fsdp2.fsdp2_parts_for_job(recipe, [str(config)], 3)
    assert parts.grad_accumulation == 2
    assert parts.overrides(ENCODER)["training"] == parts.overrides(BACKBONE)["training"] == {
        "gradient_accumulation_steps": 2}
    assert "FSDP over 2" in parts.describe()


@pytest.mark.parametrize("case, needle", [
    (dict(model_id="qwen2_5_vl"), "model.model_id='qwen2_5_vl'"),
    (dict(bb_tp=2), "parallel.backbone.tp=2"),
    (dict(enc=2), "launched with 3"),
    (dict(ep=4, bb=2), "expert_parallel_size=4 must divide"),
    (dict(extra="  train_epochs: 2\n"), "training.train_epochs"),
    (dict(trainer="trainer:\n  global_batch_size: 3\n"), "global_batch_size=3"),
])
def test_bad_pairings_are_refused_naming_the_field(tmp_path: Path, case: dict, needle: str) -> None:
    recipe, config = _files(tmp_path, **case)
    with pytest.raises(FlowRecipeError, match=None) as err:
        fsdp2.fsdp2_parts_for_job(recipe, [str(config)], 3)
    assert needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_is_one_line(tmp_path: Path) -> None:
    recipe, _ = _files(tmp_path)
    with pytest.raises(FlowRecipeError, match="needs its CONFIG.yaml"):
        fsdp2.fsdp2_parts_for_job(recipe, [], 3)


def test_images_go_heaviest_first_to_the_least_loaded_encoder() -> None:
    assert fsdp2.assign_images([16, 32, 16, 4], 2) == [1, 0, 1, 0]
    assert fsdp2.assign_images([8, 8, 8], 1) == [0, 0, 0]
    assert fsdp2.assign_images([], 3) == []
    owners = fsdp2.assign_images([5, 3, 3, 2, 2, 1], 3)
    loads = [sum(p for p, o in zip([5, 3, 3, 2, 2, 1], owners) if o == e) for e in range(3)]
    assert max(loads) - min(loads) <= 1, loads


def test_micro_step_plan_counts_rows_per_pair() -> None:
    plan = fsdp2.MicroStepPlan([torch.tensor([[1, 4, 4], [1, 8, 4]]), torch.tensor([[1, 4, 8]])],
                               [[0, 1], [1]], merge=2)
    assert plan.any_images
    assert plan.pair_images(1, 0) == [1] and plan.pair_images(1, 1) == [0] and plan.pair_images(0, 1) == []
    assert plan.patches(0, [0, 1]) == 48 and plan.rows(0, [0, 1]) == 12


def test_launcher_routes_the_fsdp2_trainer() -> None:
    from mindspeed_flow_patches.launch import is_fsdp2_trainer

    assert is_fsdp2_trainer("mindspeed_mm/fsdp/train/trainer.py")
    assert not is_fsdp2_trainer("pretrain_vlm.py")
    assert not is_fsdp2_trainer("pretrain_transformers.py")


def test_every_fsdp2_patch_target_has_its_wrapper() -> None:
    from mindspeed_flow_patches import fsdp2_flow

    assert sorted(t.target for t in fsdp2_flow.REGISTRY) == sorted(fsdp2_flow._WRAPPERS)
    for target in fsdp2_flow.REGISTRY:
        assert target.why and any(target.target.startswith(m + ".") for m in fsdp2_flow.TARGET_MODULES), target


def test_load_must_be_hf_weights_or_a_flow_checkpoint(tmp_path: Path) -> None:
    unpatched = tmp_path / "unpatched_ckpt"
    (unpatched / "iter_0000005").mkdir(parents=True)
    recipe, config = _files(tmp_path, extra=f"  load: {unpatched}\n")
    with pytest.raises(FlowRecipeError, match="neither HF weights nor a flow job's checkpoint"):
        fsdp2.fsdp2_parts_for_job(recipe, [str(config)], 3)
    for part in (ENCODER, BACKBONE):
        (unpatched / part).mkdir()
    fsdp2.fsdp2_parts_for_job(recipe, [str(config)], 3)  # a flow job's own checkpoint: resumes
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    recipe, config = _files(tmp_path, extra=f"  load: {hf}\n")
    fsdp2.fsdp2_parts_for_job(recipe, [str(config)], 3)


@pytest.mark.parametrize("part", [ENCODER, BACKBONE])
def test_each_part_builds_only_its_own_weights(part: str) -> None:
    """The tiny Qwen3-VL-MoE as transformers builds it (meta device, as MindSpeed-MM's meta init): an encoder rank
    keeps exactly the vision tower's values, an LLM rank everything else; the module tree (the names FSDP plans and
    the embedding re-tie look up) stays."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3-VL-MoE")
    from mindspeed_flow.model_presets import hf_config_dict

    config = transformers.Qwen3VLMoeConfig.from_dict(hf_config_dict("qwen3_vl_moe", "tiny"))
    with torch.device("meta"):
        model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())
    kept, dropped = fsdp2.drop_other_part(model, "model.visual", is_encoder=part == ENCODER)
    own = vision if part == ENCODER else total - vision
    assert (kept, dropped) == (own, total - own)
    names = {name for name, _ in model.named_parameters()}
    assert names and all(name.startswith("model.visual.") == (part == ENCODER) for name in names), sorted(names)[:5]
    # What MindSpeed-MM's plans and its re-tie name is still there, holding nothing on the side that dropped it.
    for path in ("model.visual", "model.visual.merger", "model.language_model", "model.language_model.embed_tokens",
                 "lm_head"):
        model.get_submodule(path)
    if part == ENCODER:
        assert model.get_input_embeddings()._parameters["weight"] is None
        assert len(model.model.language_model.layers) == 0
    else:
        assert len(model.model.visual.blocks) == 0 and len(model.model.visual.deepstack_merger_list) == 0
