"""Tensor parallelism of the torch host's parts against the dense parts, on 2 gloo ranks, fp32, every family.

Each rank builds the same tiny model twice from one seed, splits one copy over the TP group (encoder and backbone)
and runs both on the same packed microbatch: the image embeddings, the loss, the embedding gradient and every
parameter gradient (a sharded one against the matching shard of the dense gradient) must agree to fp32 rounding,
for each overlap implementation. Replicated activations mean both TP ranks hold the same full results.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.hosts.torch.exactness import encode, tiny_model
from mindspeed_flow.hosts.torch.split import split_vlm
from mindspeed_flow.hosts.torch.tensor_parallel import TensorParallelError, apply_tensor_parallel
from mindspeed_flow.hosts.torch.testing import make_samples
from mindspeed_flow.overlap import TP_DIM_ATTR, shard_of
from mindspeed_flow.utils.multiproc import run_ranks

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")


def _step(encoder, backbone, samples):
    embeds = encode(encoder, samples)
    leaves = [e.detach().requires_grad_() if e is not None else None for e in embeds]
    packed = backbone.pack(samples, leaves, sum(s.llm_tokens for s in samples) + 5)
    loss, _ = backbone(packed, leaves)
    loss.backward()
    for e, leaf in zip(embeds, leaves):  # the encoder's backward from the returned embedding gradients
        if e is not None:
            e.backward(leaf.grad)
    return (loss.detach(), torch.cat([e.detach() for e in embeds if e is not None]),
            torch.cat([leaf.grad for leaf in leaves if leaf is not None]))


def _tp_rank(rank: int, world: int, family: str, impl: str) -> dict[str, float]:
    torch.manual_seed(0)
    samples = make_samples(family, 3, seed=2)
    dense_model, tp_model = tiny_model(family), tiny_model(family)
    dense_enc, dense_bb = split_vlm(dense_model)
    enc, bb = split_vlm(tp_model)
    enc_ctx = apply_tensor_parallel(enc, dist.group.WORLD, impl=impl)
    bb_ctx = apply_tensor_parallel(bb, dist.group.WORLD, impl=impl)
    assert enc_ctx is not None and bb_ctx is not None and enc_ctx is not bb_ctx
    ref = _step(dense_enc, dense_bb, samples)
    got = _step(enc, bb, samples)
    out = {name: float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
           for name, g, r in zip(("loss", "embeds", "embed_grad"), got, ref)}
    dense = dict(dense_model.named_parameters())
    # Relative to the largest gradient entry of the model: some gradients are exactly zero in theory (a key
    # bias: softmax ignores a constant shift), so their own scale is rounding noise.
    scale = max(float(p.grad.abs().max()) for p in dense.values() if p.grad is not None)
    worst, sharded = 0.0, 0
    for name, p in tp_model.named_parameters():
        if p.grad is None:
            assert dense[name].grad is None, name
            continue
        want = shard_of(dense[name].grad, p, rank, world)
        assert p.grad.shape == want.shape, (name, p.grad.shape, want.shape)
        worst = max(worst, float((p.grad - want).abs().max()) / scale)
        sharded += hasattr(p, TP_DIM_ATTR)
    out["param_grads"], out["sharded"] = worst, float(sharded)
    return out


@pytest.mark.parametrize("family,impl", [("qwen2_vl", "chunked"), ("qwen2_5_vl", "plain"), ("llava", "chunked")])
def test_tensor_parallel_parts_match_dense(family: str, impl: str) -> None:
    results = run_ranks(_tp_rank, 2, family, impl, timeout_s=180)
    for rank, r in enumerate(results):
        assert r["sharded"] > 0, r
        for key in ("loss", "embeds", "embed_grad", "param_grads"):
            assert r[key] < 1e-5, (family, impl, rank, key, r)


def _bad_rank(rank: int, world: int) -> str:
    model = tiny_model("qwen2_vl")
    _, bb = split_vlm(model)
    group = dist.new_group(list(range(world)))
    cfg = bb.layers[0].self_attn.config
    cfg.num_key_value_heads = 1  # 1 KV head cannot be split over 3 ranks
    try:
        apply_tensor_parallel(bb, group)
    except TensorParallelError as err:
        return str(err)
    return "no error"


def test_indivisible_heads_are_a_clear_error() -> None:
    msg = run_ranks(_bad_rank, 3, timeout_s=120)[0]
    assert "not divisible by tp=3" in msg, msg


def _mc2_mode_rank(rank: int, world: int) -> dict[str, float]:
    """Under the NPU emulation (HCCL group, fake torch_npu), bf16: impl=mc2 runs the row linears through
    npu_mm_all_reduce_base and must give what impl=chunked gives."""
    import sys

    import torch

    from mindspeed_flow import emulation

    emulation.activate()
    torch_npu = sys.modules["torch_npu"]
    calls = []
    fused = torch_npu.npu_mm_all_reduce_base

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    torch_npu.npu_mm_all_reduce_base = counted
    group = dist.new_group(list(range(world)), backend="hccl")
    samples = make_samples("qwen2_vl", 2, seed=4)
    for s in samples:
        s.pixel_values = s.pixel_values.to(torch.bfloat16) if s.pixel_values is not None else None
    out = {}
    for impl in ("chunked", "mc2"):
        model = tiny_model("qwen2_vl").to(torch.bfloat16).to("npu")  # the parts run on the (emulated) device
        enc, bb = split_vlm(model)
        apply_tensor_parallel(enc, group, impl=impl)
        apply_tensor_parallel(bb, group, impl=impl)
        out[impl] = _step(enc, bb, samples)
    diffs = {name: float((m.float() - c.float()).abs().max() / c.float().abs().max())
             for name, m, c in zip(("loss", "embeds", "embed_grad"), out["mc2"], out["chunked"])}
    return {**diffs, "mc2_calls": float(len(calls))}


def test_mc2_mode_under_emulation_matches_chunked() -> None:
    for r in run_ranks(_mc2_mode_rank, 2, timeout_s=240):
        assert r["mc2_calls"] > 0, r
        # bf16: the fused op sums in another order than matmul + all-reduce; a few ulps of bf16.
        for key in ("loss", "embeds", "embed_grad"):
            assert r[key] < 2e-2, (key, r)
