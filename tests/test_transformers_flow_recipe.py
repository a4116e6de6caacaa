"""The `pretrain_transformers.py` flow job's checks before any process group exists, and the launcher's routing.

No MindSpeed-MM is needed: CONFIG.yaml here has the keys of MindSpeed-MM's `examples/qwen3vl/qwen3vl_full_sft_8B.yaml`
that the checks read, and the command-line form's files those of `examples/glm4.5v/model_106B.json` / `data_106B.json` (the example itself, scaled down, trains in tests/mindspeed_mm/test_transformers_entry.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_flow.hosts.mindspeed_mm import transformers_entry
from mindspeed_flow.hosts.mindspeed_mm.entries import check_flow_entry
from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowRecipeError
from mindspeed_flow.step.layout import BACKBONE, ENCODER

CONFIG = """\
gpt_args:
  ## parallel
  context_parallel_size: {cp}
  use_torch_fsdp2: {fsdp2}
  ## training
  micro_batch_size: 1
  global_batch_size: {gbs}
{gpt_extra}
data:
  dataset_param:
    basic_parameters:
      val_rate: {val_rate}
  dataloader_param:
    sampler_type: BaseRandomBatchSampler
model:
  model_id: {model_id}
  image_encoder:
    vision_encoder:
      freeze: {freeze}
    vision_projector:
      freeze: {freeze}
  text_decoder:
    freeze: false
  loss_cfg:
    loss_type: {loss_type}
"""
RECIPE = """\
parallel:
  encoder: {{dp: {enc}, tp: 1, pp: 1, cp: 1}}
  backbone: {{dp: {bb}, tp: {bb_tp}, pp: 1, cp: 1}}
"""


def _files(tmp_path: Path, *, enc: int = 1, bb: int = 2, bb_tp: int = 1, gbs: int = 2, cp: int = 1,
           fsdp2: str = "true", model_id: str = "qwen3_vl", freeze: str = "true", val_rate: float = 0.0,
           loss_type: str = "default", gpt_extra: str = "", extra: str = "") -> tuple[Path, Path]:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(cp=cp, fsdp2=fsdp2, gbs=gbs, gpt_extra=gpt_extra, val_rate=val_rate,
                                    model_id=model_id, freeze=freeze, loss_type=loss_type) + extra)
    recipe = tmp_path / "flow.yaml"
    recipe.write_text(RECIPE.format(enc=enc, bb=bb, bb_tp=bb_tp))
    return recipe, config


def test_parts_from_recipe_and_config(tmp_path: Path) -> None:
    recipe, config = _files(tmp_path)
    parts = transformers_entry.transformers_parts_for_job(recipe, [str(config)], 3)
    assert parts.layout.part_ranks(ENCODER) == [0] and parts.layout.part_ranks(BACKBONE) == [1, 2]
    assert parts.micro_steps == 1 and parts.exchange.vision_module == "model.model.visual"
    # The example freezes the tower and the projector: MindSpeed-MM runs the tower under no_grad, forward only.
    assert not parts.flow.encoder_trainable
    # Two encoder ranks, one LLM rank: the LLM rank carries the global batch of 2 in two micro-batches, and the
    # encoder ranks follow its count (not their own DP's).
    recipe, config = _files(tmp_path, enc=2, bb=1, freeze="false", model_id="qwen3_vl_moe")
    parts = transformers_entry.transformers_parts_for_job(recipe, [str(config)], 3)
    assert parts.micro_steps == 2 and parts.flow.encoder_trainable
    # The launcher's one check routes on the entry script.
    routed = check_flow_entry(recipe, "/x/MindSpeed-MM/pretrain_transformers.py", [str(config)], 3)
    assert isinstance(routed, transformers_entry.TransformersParts)


@pytest.mark.parametrize("kw, world, words", [
    (dict(model_id="internvl"), 3, "model.model_id='internvl'"),
    (dict(fsdp2="false"), 3, "gpt_args.use_torch_fsdp2=False"),
    (dict(cp=2), 3, "gpt_args.context_parallel_size=2"),
    (dict(gpt_extra="  tensor_model_parallel_size: 2"), 3, "gpt_args.tensor_model_parallel_size=2"),
    (dict(bb_tp=2), 5, "parallel.backbone.tp=2"),
    (dict(), 4, "launched with 4"),
    (dict(gbs=3), 3, "global batch size 3 must be divisible"),
    (dict(val_rate=0.1), 3, "val_rate=0.1"),
    (dict(loss_type="per_sample_loss"), 3, "loss_type='per_sample_loss'"),
    (dict(extra="lora_args:\n  lora_r: 8\n"), 3, "lora_args"),
], ids=["family", "no_fsdp2", "cp", "tp", "part_tp", "world", "batch", "validation", "loss", "lora"])
def test_bad_job_is_one_error_naming_the_field(tmp_path: Path, kw: dict, world: int, words: str) -> None:
    recipe, config = _files(tmp_path, **kw)
    with pytest.raises(FlowRecipeError, match=None) as err:
        transformers_entry.transformers_parts_for_job(recipe, [str(config)], world)
    assert words in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_command_line_form_needs_its_model_and_data_files(tmp_path: Path) -> None:
    recipe, config = _files(tmp_path)
    with pytest.raises(FlowRecipeError, match="--mm-model FILE.json is missing"):
        transformers_entry.transformers_parts_for_job(recipe, ["--seed", "1", str(config)], 3)
    with pytest.raises(FlowRecipeError, match="--mm-data .*nowhere.json: no such file"):
        transformers_entry.transformers_parts_for_job(
            recipe, ["--mm-model", str(config), "--mm-data", str(tmp_path / "nowhere.json")], 3)


# GLM-4.5V's example (`examples/glm4.5v/finetune_glm4_5v_106B.sh`): the arguments on the command line, the model and
# the data in JSON files; the keys the checks read.
GLM_MODEL = """{{"model_id": "glm4v_moe", "image_encoder": {{"vision_encoder": {{"freeze": true}},
  "vision_projector": {{"freeze": true}}}}, "text_decoder": {{"freeze": false}},
  "loss_cfg": {{"loss_type": "{loss_type}"}}}}"""
GLM_DATA = """{{"dataset_param": {{"attr": {{"images": "images", "videos": {videos}}}}},
  "dataloader_param": {{"sampler_type": "BaseRandomBatchSampler"}}}}"""


def _glm_argv(tmp_path: Path, *, loss_type: str = "per_token_loss", videos: str = "null",
              extra: tuple[str, ...] = ()) -> list[str]:
    model, data = tmp_path / "model.json", tmp_path / "data.json"
    model.write_text(GLM_MODEL.format(loss_type=loss_type))
    data.write_text(GLM_DATA.format(videos=videos))
    return ["--use-mcore-models", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--context-parallel-size", "1", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--use-torch-fsdp2", "--init-model-with-meta-device", "--mm-data", str(data), "--mm-model", str(model),
            "--distributed-backend", "nccl", *extra]


def test_command_line_form_of_the_glm45v_example(tmp_path: Path) -> None:
    recipe, _ = _files(tmp_path)
    parts = transformers_entry.transformers_parts_for_job(recipe, _glm_argv(tmp_path), 3)
    assert parts.layout.part_ranks(BACKBONE) == [1, 2] and parts.micro_steps == 1
    # GLM-4.5V's `freeze` leaves the tower's position embedding, downsampling and norms trainable, and its forward
    # runs the tower with gradients: the encoder part's values decide whether it trains, not the freeze flags.
    assert parts.flow.encoder_trainable
    assert parts.exchange.vision_module == "model.model.visual"
    # GLM-4.5V's tower takes a video's frames as images (its `get_video_features` flattens the grid so).
    assert parts.exchange.frames_as_images


def test_glm45v_videos_need_a_transformers_that_takes_the_plugins_metadata(tmp_path: Path, monkeypatch) -> None:
    """MindSpeed-MM's GLM plugin gives transformers' video processor `total_frames`; released transformers rejects
    it (the unpatched job fails in preprocessing): refused before launch, one line naming the field and why."""
    recipe, _ = _files(tmp_path)
    argv = _glm_argv(tmp_path, videos='"videos"')
    monkeypatch.setattr(transformers_entry, "video_metadata_takes_total_frames", lambda: False)
    with pytest.raises(FlowRecipeError) as err:
        transformers_entry.transformers_parts_for_job(recipe, argv, 3)
    assert "dataset_param.attr.videos='videos'" in str(err.value) and "total_frames" in str(err.value)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(transformers_entry, "video_metadata_takes_total_frames", lambda: True)
    assert transformers_entry.transformers_parts_for_job(recipe, argv, 3).exchange.frames_as_images
    monkeypatch.undo()
    # The released transformers of both test venvs (4.57.x and 5.x) reject the plugin's key.
    assert transformers_entry.video_metadata_takes_total_frames() is False


def test_glm_video_grid_becomes_one_image_grid_per_frame() -> None:
    import torch

    from mindspeed_flow.hosts.mindspeed_mm.fsdp2 import frames_as_images

    grid = torch.tensor([[1, 4, 6], [3, 2, 4], [2, 8, 2]])
    frames = frames_as_images(grid)
    assert frames.tolist() == [[1, 4, 6], [1, 2, 4], [1, 2, 4], [1, 2, 4], [1, 8, 2], [1, 8, 2]]
    assert int(frames.prod(-1).sum()) == int(grid.prod(-1).sum())  # the same patches, so the same rows
    assert grid.tolist()[1] == [3, 2, 4]  # the caller's grid is left as it was


@pytest.mark.parametrize("kw, words", [
    (dict(extra=("--tensor-model-parallel-size", "2")), "--tensor-model-parallel-size=2"),
    (dict(loss_type="square_loss"), "loss_cfg.loss_type='square_loss'"),
    (dict(extra=("--lora-target-modules", "q_proj")), "--lora-* arguments"),
], ids=["tp", "loss", "lora"])
def test_bad_command_line_job_is_one_error_naming_the_field(tmp_path: Path, kw: dict, words: str) -> None:
    recipe, _ = _files(tmp_path)
    with pytest.raises(FlowRecipeError) as err:
        transformers_entry.transformers_parts_for_job(recipe, _glm_argv(tmp_path, **kw), 3)
    assert words in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
