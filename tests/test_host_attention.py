"""Varlen attention for packed microbatches: kernels against an explicit-mask reference, the packed model without
any T x T tensor, the NPU kernel through the emulated torch_npu, and the memory bench."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mindspeed_flow.accelerator import Accelerator, varlen_attention_kernel
from mindspeed_flow.bench import attention as bench
from mindspeed_flow.hosts.torch import split_vlm
from mindspeed_flow.hosts.torch.attention import KERNELS, Segments, varlen_attention
from mindspeed_flow.hosts.torch.exactness import encode, tiny_model
from mindspeed_flow.hosts.torch.testing import make_samples
from mindspeed_flow.utils.multiproc import run_ranks

LENGTHS = [5, 1, 12, 7, 3]  # a one-token sequence included


def _qkv(n_heads: int = 4, n_kv: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    q = torch.randn(1, n_heads, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, n_kv, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, n_kv, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1, t, n_heads, d, generator=g, dtype=torch.float64)
    return q, k, v, grad


def _reference(q, k, v, scale):
    """Explicit block-diagonal causal mask over the same sequences (what packed attention used to build)."""
    mask = bench.block_causal_mask(LENGTHS, q.device)
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _check_kernel(kernel: str) -> None:
    q, k, v, grad = _qkv()
    scale = 0.3
    ref = _reference(q, k, v, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = varlen_attention(q, k, v, Segments.from_lengths(LENGTHS, kernel=kernel), scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_sdpa_segments_equals_explicit_mask_forward_and_backward():
    _check_kernel("sdpa_segments")


def _npu_kernel_rank(rank: int, world: int) -> None:
    from mindspeed_flow import emulation

    emulation.activate(transfer=False)  # the fake torch_npu (this forked process only)
    _check_kernel("npu_fusion_attention")


def test_npu_fusion_attention_tnd_equals_explicit_mask_under_emulation():
    run_ranks(_npu_kernel_rank, 1, timeout_s=120)


def test_kernel_choice_and_errors():
    assert varlen_attention_kernel("npu") == "npu_fusion_attention"
    assert varlen_attention_kernel("cuda") == varlen_attention_kernel("cpu") == "sdpa_segments"
    assert Accelerator.for_type("cpu").varlen_attention_kernel in KERNELS
    assert Segments.from_segment_ids(torch.tensor([[0, 0, 1, 2, 2, 2]])).bounds == (0, 2, 3, 6)
    with pytest.raises(ValueError, match="strictly increase"):
        Segments((0, 3, 3))
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="does not match one packed microbatch"):
        varlen_attention(q, k, v, Segments((0, 4)))
    with pytest.raises(ValueError, match="kernel 'flex'"):
        varlen_attention(q, k, v, Segments.from_lengths(LENGTHS, kernel="flex"))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_packed_backbone_saves_no_token_by_token_tensor(family):
    """Forward + backward of a packed microbatch: autograd saves no [.., T, T] tensor (the old mask was one)."""
    model = tiny_model(family)
    encoder, backbone = split_vlm(model)
    samples = make_samples(family, 4, seed=3)
    embeds = encode(encoder, samples)
    budget = sum(s.llm_tokens for s in samples) + 7
    packed = backbone.pack(samples, embeds, budget)
    shapes: list[tuple[int, ...]] = []

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        loss, _ = backbone(packed, embeds)
    loss.backward()
    assert shapes and backbone.attn_implementation == "sdpa"
    assert not [s for s in shapes if len(s) >= 2 and s[-1] == s[-2] == budget], shapes


def test_bench_reports_mask_and_varlen_peaks():
    args = bench.parse_args(["--tokens", "1024", "--segments", "4", "--heads", "2", "--kv-heads", "1",
                             "--head-dim", "16"])
    report = bench.measure(args)
    assert report["kernel"] == "sdpa_segments" and report["mask_bytes"] == 1024 ** 2
    assert set(report["peak_bytes"]) == {"mask", "varlen"}
    assert all(v > 0 for v in report["peak_bytes"].values())
    with pytest.raises(SystemExit):
        bench.parse_args(["--heads", "3", "--kv-heads", "2"])
