"""MoE and deepstack pricing, and a plan for every real-size preset of issue 27 (Qwen3-VL, InternVL3.5, GLM-4.5V,
Qwen2.5-Omni): FLOPs from the active parameters, weights and optimizer states from the total ones split over
expert parallelism, the EP all-to-all in the step, Qwen3-VL's deepstack features in the pool bytes."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from mindspeed_flow.cli import main
from mindspeed_flow.planner.cost import Layouts, backbone_costs, embedding_bytes, ep_alltoall_time
from mindspeed_flow.planner.inputs import build_problem, parse_kv
from mindspeed_flow.planner.parts import backbone_part, encoder_part
from mindspeed_flow.planner.space import PlanError, enumerate_layouts
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.specs import VLMSpec


def _problem(model: str, cluster: str = "atlas_900_a3_384", devices: int = 64, **planner: str):
    args = parse_kv([f"model={model}", f"cluster={cluster}", f"devices={devices}", "samples=128",
                     *(f"planner.{k}={v}" for k, v in planner.items())])
    return build_problem(args)[0]


def _row(**kw: int) -> dict:
    return {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "b": 16384, "rc": 1, **kw}


def test_moe_backbone_flops_are_active_and_weights_total() -> None:
    problem = _problem("qwen3_vl_30b_a3b")
    bb = problem.parts[-1]
    llm = problem.spec.llm
    # FLOPs per token: 6 x the active parameters a token's matmuls use (the embedding lookup has none)
    assert bb.linear_flops_per_token == pytest.approx(6 * (llm.active_params - llm.embedding_params), rel=1e-9)
    assert bb.linear_flops_per_token < 0.15 * 6 * llm.total_params
    # weights: all experts on one device at ep 1 (the total), an eighth of them at ep 8
    costs = backbone_costs(bb, problem.ctx, Layouts.from_rows([_row(), _row(ep=8)]))
    weights = costs.memory_parts["weights"] / 2  # bf16
    assert weights[0] == pytest.approx(llm.total_params, rel=1e-3)
    assert weights[1] == pytest.approx(llm.total_params - llm.routed_expert_params * 7 / 8, rel=1e-3)
    # the experts' optimizer states shard over the expert-data-parallel group (dp x tp / ep = 1 at ep 8)
    optim = costs.memory_parts["optim"] / 12
    dense = llm.total_params - llm.routed_expert_params
    assert optim[1] == pytest.approx(dense / 8 + llm.routed_expert_params / 8, rel=1e-3)
    assert optim[0] == pytest.approx(llm.total_params / 8, rel=1e-3)


def test_ep_traffic_only_with_ep_and_grows_across_nodes() -> None:
    problem = _problem("qwen3_vl_30b_a3b", cluster="atlas_800t_a2", devices=64)  # 8 devices a node, RoCE beyond
    bb = problem.parts[-1]
    L = Layouts.from_rows([_row(dp=16, ep=1), _row(dp=16, ep=8), _row(dp=16, ep=16)])
    ep = backbone_costs(bb, problem.ctx, L).time_parts["ep"]
    assert ep[0] == 0 and ep[1] > 0 and ep[2] > ep[1]
    # per byte sent off-rank, the 16-way group (two nodes) is slower than the 8-way one (one node's HCCS)
    one = ep_alltoall_time(problem.ctx, L.ep, np.full(3, 1e4), bb.hidden, bb.top_k)
    assert one[2] / (15 / 16) > 2 * one[1] / (7 / 8)
    # the formula: tokens x hidden x top-k x bytes x (ep - 1) / ep over the link, plus (ep - 1) hops
    bw, lat = problem.cluster.link(np.array([8]))
    assert one[1] == pytest.approx(1e4 * bb.hidden * bb.top_k * 2 * 7 / 8 / bw[0] + 7 * lat[0])
    # a dense backbone has no EP axis
    dense = _problem("qwen3_vl_8b")
    assert enumerate_layouts(dense.parts[-1], dense.ctx, 64).ep.max() == 1


def test_ep_divides_experts_and_dp_tp() -> None:
    problem = _problem("qwen3_vl_30b_a3b")
    bb = problem.parts[-1]
    L = enumerate_layouts(bb, problem.ctx, 64)
    assert L.ep.max() > 1
    assert np.all(bb.experts % L.ep == 0) and np.all((L.dp * L.tp) % L.ep == 0)
    with pytest.raises(PlanError, match="routed experts"):
        enumerate_layouts(bb, problem.ctx, 64, {"ep": 3})


def test_deepstack_features_travel_with_the_embeddings() -> None:
    # Qwen3-VL hands the LLM the merger's output plus one feature tensor per deepstack layer (3): 4x the bytes
    problem = _problem("qwen3_vl_8b")
    enc = problem.parts[0]
    assert enc.embedding_tensors == 4
    no_deepstack = {"vision_config": {"deepstack_visual_indexes": []}}
    plain = VLMSpec.from_hf_config(hf_config_dict("qwen3_vl", "8b", no_deepstack))
    flat = encoder_part(plain, problem.shapes)
    assert embedding_bytes(enc, problem.ctx, 100) == 4 * embedding_bytes(flat, problem.ctx, 100) == 4 * 100 * 4096 * 2
    assert backbone_part(plain, problem.shapes).total_params == problem.parts[-1].total_params


@pytest.mark.parametrize("model,devices", [("qwen3_vl_8b", 64), ("qwen3_vl_30b_a3b", 64),
                                           ("internvl3_5_30b_a3b", 64), ("glm4_5v", 128), ("qwen2_5_omni_7b", 32)])
def test_new_presets_plan_on_a3(model: str, devices: int, capsys) -> None:
    start = time.monotonic()
    rc = main(["plan", "cluster=atlas_900_a3_384", f"model={model}", f"devices={devices}", "samples=256",
               "--job", "any", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert time.monotonic() - start < 60
    obj = json.loads(cap.out)
    parts = {p["name"]: p for p in obj["parts"]}
    bb = parts["backbone"]
    spec = VLMSpec.from_hf_config(hf_config_dict(*{
        "qwen3_vl_8b": ("qwen3_vl", "8b"), "qwen3_vl_30b_a3b": ("qwen3_vl_moe", "30b_a3b"),
        "internvl3_5_30b_a3b": ("internvl", "internvl3_5_30b_a3b"), "glm4_5v": ("glm4v_moe", "glm4_5v"),
        "qwen2_5_omni_7b": ("qwen2_5_omni_thinker", "7b")}[model]))
    if spec.llm.is_moe:  # a runnable EP: it divides the experts and the backbone's dp x tp
        assert spec.llm.num_experts % bb["ep"] == 0 and (bb["dp"] * bb["tp"]) % bb["ep"] == 0
    else:
        assert bb["ep"] == 1
    assert sum(p["devices"] for p in obj["parts"]) <= devices
    assert all(p["memory_gb"]["total"] <= 64 for p in obj["parts"])
    assert obj["predicted"]["samples_per_s"] > 0


def test_other_jobs_refuse_the_new_families(capsys) -> None:
    for job in ("mm", "torch"):
        rc = main(["plan", "cluster=atlas_900_a3_384", "model=glm4_5v", "devices=128", "samples=64", "--job", job])
        assert rc == 2 and "--job" in capsys.readouterr().err
