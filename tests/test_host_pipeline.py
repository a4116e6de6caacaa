"""Backbone pipeline parallelism: 2 stages over gloo equal the single-process BackbonePart."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.hosts.torch import build_vlm, hf_compat, split_vlm
from mindspeed_flow.hosts.torch.data_parallel import DTensor, apply_ddp, apply_fsdp, dp_loss_scale
from mindspeed_flow.hosts.torch.pipeline import build_backbone_stage, make_schedule, pipeline_step, split_layers
from mindspeed_flow.hosts.torch.split import token_loss_sum
from mindspeed_flow.hosts.torch.testing import make_samples
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.utils.multiproc import run_ranks

N_MICRO = 4
# Import the model classes once in the parent: forked ranks inherit them instead of each importing transformers.
for _family in ("qwen2_vl", "llava"):
    hf_compat.family_classes(_family)


def _packs(backbone, encoder, family: str):
    """4 packed microbatches of 2 samples each (one of them text-only), all padded to one budget."""
    samples = make_samples(family, 2 * N_MICRO, seed=4)
    groups = [samples[2 * i:2 * i + 2] for i in range(N_MICRO)]
    budget = max(sum(s.llm_tokens for s in g) for g in groups) + 4
    embeds = [[encoder(s.pixel_values, s.image_grid_thw) if s.pixel_values is not None else None for s in g]
              for g in groups]
    return [backbone.pack(g, e, budget) for g, e in zip(groups, embeds)], embeds, budget


def _reference(family: str):
    """Single-process losses and gradients (names of the whole model) on the same microbatches."""
    model = build_vlm(family, hf_config_dict(family, "tiny"), seed=0)
    encoder, backbone = split_vlm(model)
    packs, embeds, _ = _packs(backbone, encoder, family)
    losses = []
    for p, e in zip(packs, embeds):
        loss, _ = backbone(p, e)
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}


def _pp_rank(rank: int, world: int, family: str, kinds: tuple[str, ...]) -> dict:
    ref_losses, ref_grads = _reference(family)
    results = {}
    for kind in kinds:
        model = build_vlm(family, hf_config_dict(family, "tiny"), seed=0)
        names = {id(q): n for n, q in model.named_parameters()}
        encoder, backbone = split_vlm(model)
        packs, embeds, _ = _packs(backbone, encoder, family)
        module, stage = build_backbone_stage(backbone, rank, world, dist.group.WORLD, torch.device("cpu"))
        schedule = make_schedule(stage, N_MICRO, kind=kind)
        if rank == 0:  # stage 0 asks for microbatch k's image input when the schedule runs its forward
            module.feed = lambda k: backbone.image_dense(packs[k], embeds[k])
        losses = pipeline_step(schedule, module, packs)
        checked = list(module.parameters())
        if rank == 0:
            checked += list(encoder.parameters())  # encoder gradients: through the stage-0 input's graph
        worst = 0.0
        for q in checked:
            name = names[id(q)]
            if name not in ref_grads:  # unused by the model itself (e.g. CLIP's post_layernorm)
                assert q.grad is None, f"{kind} rank {rank}: {name} got a gradient the whole model does not give"
                continue
            assert q.grad is not None, f"{kind} rank {rank}: {name} has no gradient"
            scale = ref_grads[name].abs().max().item() or 1.0
            worst = max(worst, (q.grad - ref_grads[name]).abs().max().item() / scale)
        results[kind] = {"worst_rel_grad": worst, "n_checked": len(checked),
                         "losses": None if losses is None else [float(x) for x in losses],
                         "ref_losses": [float(x) for x in ref_losses]}
        untouched = [names[id(q)] for q in model.parameters()
                     if id(q) not in {id(c) for c in checked} and q.grad is not None and "visual" not in names[id(q)]]
        results[kind]["foreign_grads"] = untouched
    return results


@pytest.mark.parametrize("family,kinds", [("qwen2_vl", ("1f1b", "gpipe")),
                                          ("llava", ("1f1b", "gpipe"))])
def test_two_stage_pipeline_equals_single_process(family, kinds):
    out = run_ranks(_pp_rank, 2, family, kinds, timeout_s=90)
    for kind in kinds:
        first, last = out[0][kind], out[1][kind]
        assert first["losses"] is None and len(last["losses"]) == N_MICRO
        for got, ref in zip(last["losses"], last["ref_losses"]):
            assert abs(got - ref) <= 1e-6 * abs(ref), (kind, got, ref)
        for r in (0, 1):
            assert out[r][kind]["worst_rel_grad"] <= 1e-6, (kind, r, out[r][kind]["worst_rel_grad"])
            assert out[r][kind]["foreign_grads"] == [], (kind, r)
        assert first["n_checked"] > last["n_checked"]  # stage 0 also checked the encoder's gradients


def _pp_dp_rank(rank: int, world: int, mode: str) -> float:
    """2 pipeline stages x 2 DP replicas; each replica runs 2 of the 4 microbatches."""
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_rank, pp_rank = rank // 2, rank % 2
    _, ref_grads = _reference("qwen2_vl")
    n_labels = _label_count()
    model = build_vlm("qwen2_vl", hf_config_dict("qwen2_vl", "tiny"), seed=0)
    encoder, backbone = split_vlm(model)
    packs, embeds, _ = _packs(backbone, encoder, "qwen2_vl")
    mine = slice(2 * dp_rank, 2 * dp_rank + 2)
    dp_group = dp_groups[pp_rank]
    wrap = (lambda m: apply_ddp(m, dp_group)) if mode == "ddp" else (lambda m: apply_fsdp(m, dp_group))
    module, stage = build_backbone_stage(backbone, pp_rank, 2, pp_groups[dp_rank], torch.device("cpu"), wrap=wrap)
    scale = dp_loss_scale(dp_group, module) / n_labels  # undo the DP wrapper's average (if any), normalize globally
    schedule = make_schedule(stage, 2, loss_fn=lambda out, tgt: token_loss_sum(out, tgt) * scale, kind="1f1b")
    if pp_rank == 0:
        module.feed = lambda k: backbone.image_dense(packs[mine][k], embeds[mine][k])
    pipeline_step(schedule, module, packs[mine])
    worst = 0.0
    for name, q in module.named_parameters():  # FSDP2 replaced the parameters: match by name
        g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        ref = ref_grads[_model_name(name, module.layer_range[0])] / n_labels
        worst = max(worst, (g - ref).abs().max().item() / ref.abs().max().item())
    return worst


def _model_name(stage_name: str, first_layer: int) -> str:
    """The whole model's name of a stage parameter (stage layers are numbered from 0)."""
    if stage_name.startswith("lm_head."):
        return stage_name
    if stage_name.startswith("layers."):
        _, idx, rest = stage_name.split(".", 2)
        stage_name = f"layers.{int(idx) + first_layer}.{rest}"
    return "model.language_model." + stage_name


def _label_count() -> int:
    model = build_vlm("qwen2_vl", hf_config_dict("qwen2_vl", "tiny"), seed=0)
    encoder, backbone = split_vlm(model)
    return sum(p.n_label_tokens for p in _packs(backbone, encoder, "qwen2_vl")[0])


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_pipeline_with_data_parallel_stages(mode):
    worst = run_ranks(_pp_dp_rank, 4, mode, timeout_s=120)
    assert max(worst) <= 5e-6, worst  # fp32: loss scaling and the DP sum change the rounding order


def test_layer_split():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(5, 3) == [(0, 2), (2, 4), (4, 5)] or split_layers(5, 3) == [(0, 1), (1, 3), (3, 5)]
    assert split_layers(7, 3)[1] == (2, 5)  # the middle stage takes the first extra layer
    assert split_layers(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="pp=5"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="layer_split"):
        split_layers(4, 2, [2, 1])


def test_schedule_kind_is_validated():
    with pytest.raises(ValueError, match="pp_schedule='zb'"):
        make_schedule(None, 4, kind="zb")
    with pytest.raises(ValueError, match="pp_schedule='interleaved1f1b'"):
        make_schedule(None, 4, kind="interleaved1f1b")
