"""Every recipe in recipes/ is composed through Hydra, validated against its schema, and instantiated into the
real object it describes (models built or counted, datasets built, layouts validated, clusters loaded, packers
run). A recipe that no test builds is a recipe nobody knows still works."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed_flow.config.load import check_rules, compose, model_hf_config, recipes_dir, to_job_config
from mindspeed_flow.data import build_dataset, token_spec_from_hf_config
from mindspeed_flow.packing import CostModel, plan_step
from mindspeed_flow.specs import VLMSpec, encoder_parts
from mindspeed_flow.step.layout import Layout, ModelLimits

ROOT = recipes_dir()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / group).glob("*.yaml"))


def test_every_recipe_starts_with_its_command() -> None:
    for path in ROOT.rglob("*.yaml"):
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        head = [x for x in lines[:3] if x.startswith("#")]
        assert any("mindspeed-flow" in x for x in head), f"{path} does not start with the command that runs it"


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_composes_and_validates(experiment: str) -> None:
    job = to_job_config(compose([f"experiment={experiment}"]))
    check_rules(job)
    spec = VLMSpec.from_hf_config(model_hf_config(job))
    for mode in ("decoupled", "coupled"):
        Layout.from_config(job.parallel, mode).validate(limits=ModelLimits.of(spec),
                                                        global_batch_size=job.trainer.global_batch_size)


@pytest.mark.parametrize("name", options("model"))
def test_model_recipe_instantiates(name: str) -> None:
    job = to_job_config(compose([f"model={name}"]))
    cfg = model_hf_config(job)
    spec = VLMSpec.from_hf_config(cfg)
    assert spec.total_params > 0
    if job.model.preset == "tiny":  # real sizes are counted (tests/test_specs_real.py builds them on meta)
        from mindspeed_flow.hosts.torch import build_vlm, split_vlm

        # a CPU-sized model is materialised; a bigger one built from the tiny preset (small_qwen2_vl, for one
        # accelerator) only as its encoder part(s), the backbone staying on meta: the counts are the same
        parts = None if spec.total_params < 50e6 else encoder_parts(job.model.family)
        model = build_vlm(job.model.family, cfg, seed=0, parts=parts)
        assert sum(p.numel() for p in model.parameters()) == spec.total_params
        if len(encoder_parts(job.model.family)) > 1:  # audio + vision encoder parts
            from mindspeed_flow.hosts.torch.omni import split_omni

            parts = split_omni(model)
            assert sum(p.numel() for p in parts["audio"].parameters()) == spec.audio.params
            encoder = parts["vision"]
        else:
            encoder, backbone = split_vlm(model)
        assert sum(p.numel() for p in encoder.parameters()) == spec.vision.params


def _data_overrides(name: str, tmp_path: Path) -> list[str]:
    if name == "length_table":
        table = tmp_path / "lengths.csv"
        table.write_text("sample_id,text_tokens,image_grid_thw\n0,40,1x8x8\n1,55,1x4x12;1x8x4\n2,30,\n")
        return [f"data.path={table}", "data.num_samples=3", "trainer.global_batch_size=2"]
    if name == "sharegpt":
        from PIL import Image

        Image.new("RGB", (80, 60), (200, 30, 30)).save(tmp_path / "a.png")
        rows = [{"id": i, "image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat color?"},
                                                               {"from": "gpt", "value": "red"}]} for i in range(2)]
        (tmp_path / "d.json").write_text(json.dumps(rows))
        return [f"data.path={tmp_path / 'd.json'}", f"data.image_root={tmp_path}", "data.num_samples=2",
                "trainer.global_batch_size=2"]
    if name.startswith("omni"):  # audio + image data needs the Omni thinker's config (audio ids, mel bins)
        return ["model=tiny_qwen2_5_omni"]
    return []


@pytest.mark.parametrize("name", options("data"))
def test_data_recipe_instantiates(name: str, tmp_path: Path) -> None:
    job = to_job_config(compose([f"data={name}", *_data_overrides(name, tmp_path)]))
    hf_config = model_hf_config(job)
    ds = build_dataset(job.data, token_spec_from_hf_config(hf_config), hf_config=hf_config)
    sample = ds.sample(0, with_pixels=True)
    assert sample.shape(ds.merge_size) == ds.shape(0)


@pytest.mark.parametrize("name", options("parallel"))
def test_parallel_recipe_validates(name: str) -> None:
    job = to_job_config(compose([f"parallel={name}"]))
    spec = VLMSpec.from_hf_config(model_hf_config(job))
    layout = Layout.from_config(job.parallel, "decoupled")
    layout.validate(limits=ModelLimits.of(spec), global_batch_size=job.trainer.global_batch_size)
    assert layout.world_size >= 2


@pytest.mark.parametrize("name", options("packing"))
def test_packing_recipe_plans_a_step(name: str) -> None:
    job = to_job_config(compose([f"packing={name}"]))
    spec = VLMSpec.from_hf_config(model_hf_config(job))
    ds = build_dataset(job.data, token_spec_from_hf_config(model_hf_config(job)))
    shapes = [ds.shape(i) for i in range(24)]
    plan = plan_step(shapes, dp=2, num_encoders=1, token_budget=job.packing.token_budget,
                     cost_model=CostModel.from_config(job.packing, spec), scheduler=job.packing.scheduler,
                     oversize_policy=job.packing.oversize_policy)
    assert sorted(plan.sample_ids()) == list(range(24))


@pytest.mark.parametrize("name", options("cluster"))
def test_cluster_recipe_loads(name: str) -> None:
    from mindspeed_flow.planner.hardware import load_cluster

    cluster = load_cluster(name)
    assert cluster.devices >= 1


@pytest.mark.parametrize("name", options("flow"))
def test_flow_recipe(name: str) -> None:
    job = to_job_config(compose([f"flow={name}"]))
    check_rules(job)
    Layout.from_config(job.parallel, job.flow.mode)


@pytest.mark.parametrize("data", ["video", "infovqa_tiles"])
def test_planning_workload_instantiates(data: str) -> None:
    """The encoder-heavy planning workloads (shapes only; planner/workload.py) in the InternViT-6B-like preset's
    geometry: 448 px tiles of 32 x 32 patches, 256 LLM tokens each after the 2 x 2 merge."""
    from mindspeed_flow.model_presets import hf_config_dict
    from mindspeed_flow.planner.workload import MAX_TILES, PLAN_ONLY_DATA, VIDEO_FRAMES, load_workload

    assert data in PLAN_ONLY_DATA
    shapes = load_workload(data, hf_config_dict("qwen2_5_vl", "internvit6b_7b"), 64).shapes
    assert len(shapes) == 64
    for s in shapes:
        assert set(s.image_grid_thw) <= {(1, 32, 32)} and set(s.image_tokens_per_image) <= {256}
        lo, hi = VIDEO_FRAMES if data == "video" else (0, MAX_TILES + 1)
        assert lo <= s.num_images <= hi and s.text_tokens > 0
    if data == "infovqa_tiles":
        assert max(s.num_images for s in shapes) > 1  # infographics take several tiles and a thumbnail
