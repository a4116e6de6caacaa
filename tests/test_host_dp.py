"""Backbone data parallelism: DDP and FSDP2 over 2 gloo ranks equal one process after AdamW steps, and the
global gradient norm / clipping helpers count every gradient exactly once."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.hosts.torch import build_vlm, hf_compat, split_vlm
from mindspeed_flow.hosts.torch.data_parallel import (DTensor, allreduce_grads_, apply_ddp, apply_fsdp,
                                                      check_finite_norm, clip_grads_,
                                                      dp_loss_scale, global_grad_norm, grad_sq_sum, grad_sync)
from mindspeed_flow.hosts.torch.testing import make_samples
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.utils.multiproc import run_ranks

FAMILY = "qwen2_vl"
STEPS = 3
MAX_NORM = 0.5  # small enough that clipping is active in every step
hf_compat.family_classes(FAMILY)  # import once in the parent; forked ranks inherit it


def _setup():
    model = build_vlm(FAMILY, hf_config_dict(FAMILY, "tiny"), seed=0)
    encoder, backbone = split_vlm(model)
    samples = make_samples(FAMILY, 8, seed=5)
    with torch.no_grad():  # the backbone test feeds fixed image embeddings
        embeds = [encoder(s.pixel_values, s.image_grid_thw) if s.pixel_values is not None else None for s in samples]
    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    budget = max(sum(samples[i].llm_tokens for i in g) for g in groups) + 3
    packs = [backbone.pack([samples[i] for i in g], [embeds[i] for i in g], budget) for g in groups]
    mb_embeds = [[embeds[i] for i in g] for g in groups]
    return backbone, packs, mb_embeds


def _train(backbone, forward, packs, embeds, mine, replicated_over, dp_group):
    """STEPS AdamW steps over the microbatches `mine`; returns the global grad norms seen before clipping."""
    opt = torch.optim.AdamW(backbone.parameters(), lr=1e-3, weight_decay=0.01)
    n_labels = sum(p.n_label_tokens for p in packs)
    scale = dp_loss_scale(dp_group, forward) if dp_group is not None else 1.0  # FSDP2: its measured reduction
    norms = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for k, i in enumerate(mine):
            with grad_sync(forward, enabled=k == len(mine) - 1):
                loss, _ = forward(packs[i], embeds[i])
                (loss * scale / n_labels).backward()
        norm = global_grad_norm([grad_sq_sum(backbone, replicated_over=replicated_over)])
        assert norm.dim() == 0 and norm.device == next(backbone.parameters()).device  # stays where the grads are
        clip_grads_(backbone.parameters(), norm, MAX_NORM)
        opt.step()
        norms.append(float(norm))
    return norms


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _dp_rank(rank: int, world: int, mode: str) -> dict:
    # single-process reference on the same 4 microbatches, clipped with torch's own clip_grad_norm_
    ref_bb, packs, embeds = _setup()
    opt = torch.optim.AdamW(ref_bb.parameters(), lr=1e-3, weight_decay=0.01)
    n_labels = sum(p.n_label_tokens for p in packs)
    ref_norms = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for p, e in zip(packs, embeds):
            loss, _ = ref_bb(p, e)
            (loss / n_labels).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref_bb.parameters(), MAX_NORM)))
        opt.step()

    backbone, packs, embeds = _setup()
    if mode == "ddp":
        forward, replicated = apply_ddp(backbone, dist.group.WORLD), world
    else:
        forward, replicated = apply_fsdp(backbone, dist.group.WORLD), 1
    mine = [i for i in range(len(packs)) if i % world == rank]
    norms = _train(backbone, forward, packs, embeds, mine, replicated, dist.group.WORLD)
    ref = dict(ref_bb.named_parameters())
    worst = max((_full(p) - ref[n]).abs().max().item() for n, p in backbone.named_parameters())
    # the parity criterion: allclose(rtol=1e-4, atol=1e-6) on every parameter
    close = all(torch.allclose(_full(p), ref[n], rtol=1e-4, atol=1e-6) for n, p in backbone.named_parameters())
    moved = min((_full(p) - q).abs().max().item() for (n, p), q in zip(backbone.named_parameters(), _initial()))
    sharded = any(isinstance(p, DTensor) for p in backbone.parameters())
    return {"worst": worst, "close": close, "moved": moved, "norms": norms, "ref_norms": ref_norms,
            "sharded": sharded}


def _initial() -> list[torch.Tensor]:
    return [p.detach().clone() for p in _setup()[0].parameters()]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_backbone_dp_equals_single_process(mode):
    out = run_ranks(_dp_rank, 2, mode, timeout_s=120)
    for r, res in enumerate(out):
        assert res["sharded"] == (mode == "fsdp")
        # the global norm (before clipping) equals the single-process norm: no double counting, none missing
        for got, ref in zip(res["norms"], res["ref_norms"]):
            assert abs(got - ref) <= 1e-5 * ref, (mode, r, got, ref)
        assert res["norms"][0] > MAX_NORM  # clipping really happened
        assert res["close"] and res["worst"] <= 1e-5, (mode, r, res["worst"])
        assert res["moved"] > 1e-4  # every parameter trained: the comparison is not between untouched weights


def _allreduce_rank(rank: int, world: int) -> list:
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(2))
    never = torch.nn.Parameter(torch.zeros(2))  # no gradient on any rank: must stay None (as under DDP)
    p.grad = torch.full((3,), float(rank + 1))  # q has a gradient on rank 1 only
    if rank == 1:
        q.grad = torch.ones(2)
    allreduce_grads_([p, q, never], dist.group.WORLD)
    return p.grad.tolist() + q.grad.tolist() + [never.grad]


def test_allreduce_grads_averages_and_keeps_globally_missing_grads_none():
    out = run_ranks(_allreduce_rank, 2, timeout_s=30)
    assert out[0] == out[1] == [1.5, 1.5, 1.5, 0.5, 0.5, None]


def test_grad_sq_sum_and_clip_rules():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)  # squared norm 16
    assert grad_sq_sum([p], replicated_over=4).item() == 4.0
    assert clip_grads_([p], total_norm=4.0, max_norm=8.0).item() == 1.0 and p.grad[0].item() == 2.0
    coef = clip_grads_([p], total_norm=torch.tensor(4.0), max_norm=1.0).item()
    assert abs(coef - 1.0 / (4.0 + 1e-6)) < 1e-7 and abs(p.grad[0].item() - 2.0 * coef) < 1e-7
    with pytest.raises(ValueError, match="replicated_over=0"):
        grad_sq_sum([p], replicated_over=0)
    with pytest.raises(FloatingPointError, match="non-finite"):
        clip_grads_([p], float("nan"), 1.0)
    # A device norm is never read inside clip (no host sync): a NaN spoils the factor, the caller's check names it.
    nan_coef = clip_grads_([p], torch.tensor(float("nan")), 1.0)
    assert torch.isnan(nan_coef) and torch.isnan(p.grad).all()
    with pytest.raises(FloatingPointError, match="global gradient norm is inf"):
        check_finite_norm(global_grad_norm([torch.tensor(float("inf")), torch.tensor(1.0)]))
