"""The emulated torch_npu ops against plain torch references, forward and backward.

Local ops are called from `mindspeed_flow.emulation.ops` directly (no global patching in the pytest process);
the MC2 ops run on forked ranks that activate the emulation (strict: npu tensors on an hccl group; lenient: host
tensors on gloo) and get their communicator names the way MindSpeed does
(`group._get_backend(torch.device("npu")).get_hccl_comm_name(global_rank)`).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_flow.emulation import ops
from mindspeed_flow.utils.multiproc import run_ranks

B, N, NKV, D = 2, 4, 2, 8


def _sdpa_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Reference on BNSD with GQA by repeat, `allowed` True = attend."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


def _to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = x.shape
    return {"BNSD": x, "BSND": x.transpose(1, 2), "SBH": x.permute(2, 0, 1, 3).reshape(s, b, n * d),
            "BSH": x.transpose(1, 2).reshape(b, s, n * d)}[layout]


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "SBH", "BSH"])
@pytest.mark.parametrize("sparse_mode", [0, 1, 2, 3])
def test_fusion_attention_layouts_modes_gqa(layout: str, sparse_mode: int) -> None:
    torch.manual_seed(0)
    sq, skv = 5, 7  # Sq != Skv tells top-left (mode 2) from bottom-right (mode 3) causal alignment
    q, k, v = _leaf(B, N, sq, D), _leaf(B, NKV, skv, D), _leaf(B, NKV, skv, D)
    scale = 1 / math.sqrt(D)
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    user_mask = torch.rand(B, 1, sq, skv) < 0.3  # True = masked, as on NPU
    user_mask[..., 0] = False  # keep every row attendable
    allowed = {0: ~user_mask, 1: ~user_mask, 2: (j <= i).expand(B, 1, sq, skv),
               3: (j <= i + skv - sq).expand(B, 1, sq, skv)}[sparse_mode]
    npu_mask = user_mask if sparse_mode in (0, 1) else torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    out = ops.npu_fusion_attention(_to_layout(q, layout), _to_layout(k, layout), _to_layout(v, layout), N, layout,
                                   atten_mask=npu_mask, scale=scale, sparse_mode=sparse_mode)
    assert len(out) == 7
    ref = _to_layout(_sdpa_ref(q, k, v, allowed, scale), layout)
    torch.testing.assert_close(out[0], ref)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out[0], (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("sparse_mode", [0, 3])
def test_fusion_attention_tnd_varlen(sparse_mode: int) -> None:
    torch.manual_seed(1)
    lens = [3, 6, 2]
    t = sum(lens)
    q, k, v = _leaf(t, N, D), _leaf(t, NKV, D), _leaf(t, NKV, D)
    cum = torch.tensor(lens).cumsum(0).tolist()
    out = ops.npu_fusion_attention(q, k, v, N, "TND", scale=0.5, sparse_mode=sparse_mode,
                                   actual_seq_qlen=cum, actual_seq_kvlen=cum,
                                   atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1) if sparse_mode
                                   else None)[0]
    refs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        causal = torch.ones(n, n, dtype=torch.bool).tril() if sparse_mode == 3 else None
        bnsd = [x[sl].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        refs.append(_sdpa_ref(*bnsd, causal, 0.5)[0].transpose(0, 1))
        start += n
    ref = torch.cat(refs)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, w)


def test_fusion_attention_dropout_matches_seeded_reference() -> None:
    torch.manual_seed(2)
    q, k, v = _leaf(B, N, 6, D), _leaf(B, N, 6, D), _leaf(B, N, 6, D)
    torch.manual_seed(123)
    out = ops.npu_fusion_attention(q, k, v, N, "BNSD", scale=0.3, keep_prob=0.75)[0]
    torch.manual_seed(123)
    probs = torch.softmax(q @ k.transpose(-1, -2) * 0.3, dim=-1)
    keep = torch.rand(probs.shape) < 0.75
    ref = (probs * keep / 0.75) @ v
    torch.testing.assert_close(out, ref)
    assert not torch.allclose(out, torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v)
    grad = torch.randn_like(ref)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, w)


def test_fusion_attention_fully_masked_row_is_zero_not_nan() -> None:
    q, k, v = _leaf(1, 1, 3, D), _leaf(1, 1, 3, D), _leaf(1, 1, 3, D)
    mask = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = True
    out = ops.npu_fusion_attention(q, k, v, 1, "BNSD", atten_mask=mask, scale=1.0)[0]
    assert torch.equal(out[0, 0, 1], torch.zeros(D, dtype=out.dtype))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_fusion_attention_rejects_unemulated_features() -> None:
    q = torch.randn(1, 1, 2, D)
    with pytest.raises(NotImplementedError, match="sparse_mode=4"):
        ops.npu_fusion_attention(q, q, q, 1, "BNSD", sparse_mode=4)
    with pytest.raises(NotImplementedError, match="pse"):
        ops.npu_fusion_attention(q, q, q, 1, "BNSD", pse=q)
    with pytest.raises(ValueError, match="input_layout"):
        ops.npu_fusion_attention(q, q, q, 1, "XYZ")
    with pytest.raises(ValueError, match="actual_seq_qlen"):
        ops.npu_fusion_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), 1, "TND")


def test_fusion_attention_bf16_close_to_fp32() -> None:
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, N, 16, D) for _ in range(3))
    out = ops.npu_fusion_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), N, "BNSD", scale=0.35)[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _sdpa_ref(q, k, v, None, 0.35), atol=3e-2, rtol=3e-2)


def test_rms_norm_matches_torch() -> None:
    torch.manual_seed(4)
    x, g = _leaf(3, 5, 16), _leaf(16)
    y, rstd = ops.npu_rms_norm(x, g, epsilon=1e-5)
    ref = F.rms_norm(x, (16,), g, eps=1e-5)
    torch.testing.assert_close(y, ref)
    assert rstd.shape == (3, 5, 1)
    torch.testing.assert_close(rstd, torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-5))
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(y, (x, g), grad), torch.autograd.grad(ref, (x, g), grad)):
        torch.testing.assert_close(a, b)


def _complex_rotary(x: torch.Tensor, theta: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Independent reference: rotate (re, im) pairs by exp(i*theta) with complex arithmetic."""
    h = x.shape[-1] // 2
    pairs = x.unflatten(-1, (h, 2)) if interleave else torch.stack((x[..., :h], x[..., h:]), dim=-1)
    rot = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(theta), theta))
    return rot.flatten(-2) if interleave else torch.cat((rot[..., 0], rot[..., 1]), dim=-1)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_matches_complex_rotation(mode: str) -> None:
    torch.manual_seed(5)
    x = _leaf(2, 6, 3, D)  # BSND
    theta = torch.rand(1, 6, 1, D // 2, dtype=torch.float64) * 6
    full = theta.repeat_interleave(2, -1) if mode == "interleave" else torch.cat((theta, theta), -1)
    out = ops.npu_rotary_mul(x, full.cos(), full.sin(), rotary_mode=mode)
    ref = _complex_rotary(x, theta, interleave=(mode == "interleave"))
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0])


def test_swiglu_matches_torch() -> None:
    torch.manual_seed(6)
    x = _leaf(4, 2, 10)
    out = ops.npu_swiglu(x, dim=1)
    a, b = x[:, 0:1], x[:, 1:2]
    ref = a * torch.sigmoid(a) * b
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0])


# ------------------------------------------------------------------------------------------------ MC2 ops
M, K, NOUT = 4, 6, 5


def _mc2_rank(rank: int, world_size: int, mode: str) -> str:
    import torch.distributed as dist

    from mindspeed_flow import emulation

    emulation.activate(mode=mode)
    import torch_npu

    # A subgroup spanning all ranks, created after activation as MindSpeed does (hccl: the npu backend, or gloo).
    group = dist.new_group(list(range(world_size)), backend="hccl")
    hcom = group._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_global_rank(group, rank))
    g = torch.Generator().manual_seed(7)
    # On the npu (strict: a device tensor; lenient: "npu" maps to the host), as MindSpeed's MC2 inputs are.
    x_full = torch.randn(M * world_size, K, generator=g, dtype=torch.float64).to("npu")
    w_full = torch.randn(K, NOUT * world_size, generator=g, dtype=torch.float64).to("npu")
    grad_full = torch.randn(M * world_size, NOUT * world_size, generator=g, dtype=torch.float64).to("npu")
    rows, cols = slice(rank * M, (rank + 1) * M), slice(rank * NOUT, (rank + 1) * NOUT)

    # all-gather + matmul: rows sharded in, column shard of W local -> column shard of the full product.
    x = x_full[rows].clone().requires_grad_()
    w = w_full[:, cols].clone().requires_grad_()
    out, gathered = torch_npu.npu_all_gather_base_mm(x, w, hcom, world_size, bias=None, gather_index=0)
    torch.testing.assert_close(gathered, x_full)
    torch.testing.assert_close(out, x_full @ w_full[:, cols])
    out.backward(grad_full[:, cols])
    torch.testing.assert_close(x.grad, (grad_full @ w_full.t())[rows])
    torch.testing.assert_close(w.grad, x_full.t() @ grad_full[:, cols])
    _, empty = torch_npu.npu_all_gather_base_mm(x.detach(), w.detach(), hcom, world_size, gather_output=False)
    assert empty.numel() == 0 and empty.device == out.device == x_full.device  # outputs stay on the npu

    # matmul + reduce-scatter: K sharded (row-parallel), output rows scattered.
    kc = slice(rank * (K // world_size), (rank + 1) * (K // world_size))
    xr = x_full[:, kc].clone().requires_grad_()
    wr = w_full[kc, :].clone().requires_grad_()
    out = torch_npu.npu_mm_reduce_scatter_base(xr, wr, hcom, world_size, reduce_op="sum", bias=None)
    full = x_full @ w_full
    m_rows = slice(rank * M, (rank + 1) * M)
    torch.testing.assert_close(out, full[m_rows])
    out.backward(grad_full[m_rows])
    torch.testing.assert_close(xr.grad, (grad_full @ w_full.t())[:, kc])
    torch.testing.assert_close(wr.grad, x_full[:, kc].t() @ grad_full)

    # matmul + all-reduce (3-D x1), bias and x3 added once.
    x3d = x_full[:, kc].reshape(2, -1, K // world_size).clone().requires_grad_()
    wa = w_full[kc, :].clone().requires_grad_()
    bias = torch.ones(NOUT * world_size, dtype=torch.float64, device="npu")
    out = torch_npu.npu_mm_all_reduce_base(x3d, wa, hcom, reduce_op="sum", bias=bias, x3=torch.ones_like(full)
                                           .reshape(2, -1, NOUT * world_size))
    torch.testing.assert_close(out, (full + 2).reshape(2, -1, NOUT * world_size))
    out.backward(grad_full.reshape(2, -1, NOUT * world_size))
    torch.testing.assert_close(x3d.grad.reshape(-1, K // world_size), (grad_full @ w_full.t())[:, kc])
    torch.testing.assert_close(wa.grad, x_full[:, kc].t() @ grad_full)

    with pytest.raises(KeyError, match="unknown HCCL communicator name"):
        torch_npu.npu_mm_all_reduce_base(x3d, wa, "no_such_comm")
    with pytest.raises(ValueError, match="world_size=3"):
        torch_npu.npu_all_gather_base_mm(x.detach(), w.detach(), hcom, 3)
    return hcom


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_mc2_ops_match_dense_reference_forward_and_backward(mode: str) -> None:
    names = run_ranks(_mc2_rank, 2, mode, timeout_s=120)
    assert names[0] == names[1] and names[0].startswith("fakehccl_")
