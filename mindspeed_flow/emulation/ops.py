"""CPU reference implementations of the torch_npu ops MindSpeed / MindSpeed-MM call, with the real argument
conventions and return values.

They are plain differentiable torch (autograd supplies the backward of the local ops; the MC2 ops carry their
own autograd Functions because collectives are not differentiable). They aim at numerical agreement with the
NPU kernels, not at speed or bit-exactness: softmax and normalisation accumulate in float32 and cast back.

This module imports nothing from torch_npu and has no side effects, so tests can call it directly; the fake
`torch_npu` package re-exports these functions (logging each call) once the emulation is activated.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mindspeed_flow.emulation import hccl, moe_ops

_LAYOUTS = ("BNSD", "BSND", "SBH", "BSH", "TND")
_NO_LIMIT = 2147483647


# ----------------------------------------------------------------------------------------------------------
# npu_fusion_attention
# ----------------------------------------------------------------------------------------------------------
def _to_bnsd(x: torch.Tensor, layout: str, head_num: int | None) -> torch.Tensor:
    """Bring q/k/v of one dense layout to [B, N, S, D]; for SBH/BSH the head count is H / D of *this* tensor."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "SBH":
        s, b, h = x.shape
        return x.view(s, b, head_num, h // head_num).permute(1, 2, 0, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, head_num, h // head_num).transpose(1, 2)
    raise ValueError(f"npu_fusion_attention: input_layout {layout!r} is not one of {_LAYOUTS}")


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    b, n, s, d = x.shape
    if layout == "SBH":
        return x.permute(2, 0, 1, 3).reshape(s, b, n * d)
    return x.transpose(1, 2).reshape(b, s, n * d)  # BSH


def _sparse_keep(sq: int, skv: int, sparse_mode: int, pre_tokens: int, next_tokens: int,
                 device: torch.device) -> torch.Tensor | None:
    """Boolean [Sq, Skv] mask of *allowed* positions implied by sparse_mode (None = no restriction).

    Mode 2 is causal aligned at the top-left corner (query i sees keys <= i), mode 3 at the bottom-right corner
    (query i sees keys <= i + Skv - Sq); mode 0/1 honour the pre/next token band when one is given.
    """
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(skv, device=device).unsqueeze(0)
    if sparse_mode == 2:
        return j <= i
    if sparse_mode == 3:
        return j <= i + (skv - sq)
    if sparse_mode in (0, 1):
        if pre_tokens >= _NO_LIMIT and next_tokens >= _NO_LIMIT:
            return None
        return (j >= i - pre_tokens) & (j <= i + next_tokens)
    raise NotImplementedError(f"npu_fusion_attention: sparse_mode={sparse_mode} is not emulated (0-3 are)")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masked: torch.Tensor | None,
            keep: torch.Tensor | None, keep_prob: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention on [B, N, S, D] tensors (k/v already expanded for GQA); returns (out, row max, row sum)."""
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 accumulation, as the kernel (float64 stays)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    disallowed = None
    if masked is not None:
        disallowed = masked.bool()
    if keep is not None:
        disallowed = ~keep if disallowed is None else (disallowed | ~keep)
    if disallowed is not None:
        scores = scores.masked_fill(disallowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # A fully masked row yields zeros (as the NPU kernel does) instead of NaN.
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    expd = torch.exp(scores - safe_max)
    row_sum = expd.sum(dim=-1, keepdim=True)
    probs = expd / row_sum.clamp_min(torch.finfo(acc).tiny)
    if keep_prob < 1.0:
        drop_keep = torch.rand(probs.shape, device=probs.device) < keep_prob
        probs = probs * drop_keep / keep_prob
    out = torch.matmul(probs, v.to(acc)).to(q.dtype)
    return out, safe_max.detach(), row_sum.detach()


def _expand_kv(x: torch.Tensor, n_q: int) -> torch.Tensor:
    n_kv = x.shape[1]
    if n_q % n_kv:
        raise ValueError(f"npu_fusion_attention: query heads {n_q} not a multiple of key/value heads {n_kv}")
    return x.repeat_interleave(n_q // n_kv, dim=1) if n_kv != n_q else x


def _seq_bounds(cum: Sequence[int] | torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(e) for e in (cum.tolist() if isinstance(cum, torch.Tensor) else cum)]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def _softmax_stats(row_max: torch.Tensor, row_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The NPU kernel returns max/sum broadcast over a trailing dim of 8, in float32."""
    return row_max.expand(*row_max.shape[:-1], 8).contiguous(), row_sum.expand(*row_sum.shape[:-1], 8).contiguous()


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: torch.Tensor | None = None,
                         padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
                         scale: float = 1.0, keep_prob: float = 1.0, pre_tockens: int = _NO_LIMIT,
                         next_tockens: int = _NO_LIMIT, inner_precise: int = 0, prefix: Any = None,
                         actual_seq_qlen: Sequence[int] | None = None,
                         actual_seq_kvlen: Sequence[int] | None = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False, **_: Any) -> tuple:
    """FlashAttention with torch_npu's conventions.

    `atten_mask` is boolean with True = masked (broadcastable to [B, N, Sq, Skv]); under sparse_mode 2/3 the
    passed mask (the compressed 2048x2048 triangle) is ignored and the causal shape is generated. TND is the
    varlen layout: `actual_seq_qlen`/`actual_seq_kvlen` are cumulative end offsets. Returns the 7-tuple
    (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels).
    """
    if pse is not None:
        raise NotImplementedError("npu_fusion_attention: pse (positional bias / ALiBi) is not emulated")
    layout = input_layout.upper()
    if layout == "TND":
        return _fusion_attention_tnd(query, key, value, head_num, atten_mask, scale, keep_prob, pre_tockens,
                                     next_tockens, actual_seq_qlen, actual_seq_kvlen, sparse_mode)
    d = query.shape[-1] if layout in ("BNSD", "BSND") else query.shape[-1] // head_num
    q = _to_bnsd(query, layout, head_num)
    n_kv = None if layout in ("BNSD", "BSND") else key.shape[-1] // d
    k = _expand_kv(_to_bnsd(key, layout, n_kv), q.shape[1])
    v = _expand_kv(_to_bnsd(value, layout, n_kv), q.shape[1])
    sq, skv = q.shape[2], k.shape[2]
    keep = _sparse_keep(sq, skv, sparse_mode, pre_tockens, next_tockens, q.device)
    masked = atten_mask if sparse_mode in (0, 1) else None
    out, row_max, row_sum = _attend(q, k, v, scale, masked, keep, keep_prob)
    smax, ssum = _softmax_stats(row_max, row_sum)
    numels = q.shape[0] * q.shape[1] * sq * skv
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return _from_bnsd(out, layout), smax, ssum, empty, 0, 0, numels


def _fusion_attention_tnd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                          atten_mask: torch.Tensor | None, scale: float, keep_prob: float, pre_tokens: int,
                          next_tokens: int, actual_seq_qlen: Sequence[int] | None,
                          actual_seq_kvlen: Sequence[int] | None, sparse_mode: int) -> tuple:
    """Varlen attention: each packed sequence attends only within itself (mask sliced top-left per sequence)."""
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise ValueError("npu_fusion_attention: input_layout TND needs actual_seq_qlen and actual_seq_kvlen")
    q_bounds, kv_bounds = _seq_bounds(actual_seq_qlen), _seq_bounds(actual_seq_kvlen)
    if len(q_bounds) != len(kv_bounds):
        raise ValueError(f"npu_fusion_attention: {len(q_bounds)} query sequences vs {len(kv_bounds)} key sequences")
    outs, maxes, sums = [], [], []
    for (qs, qe), (ks, ke) in zip(q_bounds, kv_bounds):
        if qe == qs:
            # A zero-length sequence attends to nothing and yields no rows. MindSpeed-MM's FSDP2 flash attention
            # passes cu_seqlens with their leading 0 (ops/flash_attn/flash_attn.py), i.e. a first sequence of
            # length 0, whenever a ViT forward holds several images.
            continue
        q = query[qs:qe].transpose(0, 1).unsqueeze(0)  # [1, N, s, D]
        k = _expand_kv(key[ks:ke].transpose(0, 1).unsqueeze(0), q.shape[1])
        v = _expand_kv(value[ks:ke].transpose(0, 1).unsqueeze(0), q.shape[1])
        keep = _sparse_keep(qe - qs, ke - ks, sparse_mode, pre_tokens, next_tokens, q.device)
        masked = atten_mask[..., : qe - qs, : ke - ks] if (atten_mask is not None and sparse_mode in (0, 1)) else None
        out, row_max, row_sum = _attend(q, k, v, scale, masked, keep, keep_prob)
        outs.append(out[0].transpose(0, 1))
        maxes.append(row_max[0].transpose(0, 1))
        sums.append(row_sum[0].transpose(0, 1))
    smax, ssum = _softmax_stats(torch.cat(maxes), torch.cat(sums))
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return torch.cat(outs), smax, ssum, empty, 0, 0, int(query.shape[0])


# ----------------------------------------------------------------------------------------------------------
# Element-wise / normalisation ops
# ----------------------------------------------------------------------------------------------------------
def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over gamma's trailing dims; returns (y, rstd) with rstd (float32 or wider) of shape x[:-g] + [1]*g."""
    dims = tuple(range(-gamma.dim(), 0))
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.to(acc)).to(x.dtype)
    return y, rstd


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """x * cos + rotate(x) * sin; `half` rotates the two halves, `interleave` rotates adjacent pairs."""
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not 'half' or 'interleave'")
    return x * r1 + rotated * r2


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: silu(first half) * second half along `dim`."""
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


# ----------------------------------------------------------------------------------------------------------
# MC2: matmul fused with a collective, over the gloo group behind the HCCL communicator name
# ----------------------------------------------------------------------------------------------------------
def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> torch.Tensor:
    out = torch.empty((x.shape[0] * world_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> torch.Tensor:
    if x.shape[0] % world_size:
        raise ValueError(f"MC2 reduce-scatter: {x.shape[0]} rows not divisible by world_size {world_size}")
    out = torch.empty((x.shape[0] // world_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _check_2d(name: str, x1: torch.Tensor, x2: torch.Tensor) -> None:
    if x1.dim() != 2 or x2.dim() != 2:
        raise ValueError(f"{name}: inputs must be 2-D (m, k) @ (k, n); got {tuple(x1.shape)} and {tuple(x2.shape)}")


def _check_world(name: str, group: dist.ProcessGroup, world_size: int) -> None:
    actual = dist.get_world_size(group)
    if actual != world_size:
        raise ValueError(f"{name}: world_size={world_size} but the communicator's group has {actual} ranks")


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x1: torch.Tensor, x2: torch.Tensor, group: dist.ProcessGroup,
                world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = _all_gather_rows(x1, group, world_size)
        ctx.save_for_backward(gathered, x2)
        ctx.group, ctx.world_size = group, world_size
        ctx.mark_non_differentiable(gathered)
        return gathered @ x2, gathered

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_gathered: torch.Tensor | None) -> tuple:
        gathered, x2 = ctx.saved_tensors
        grad_x1 = _reduce_scatter_rows(grad_out @ x2.t(), ctx.group, ctx.world_size)
        return grad_x1, gathered.t() @ grad_out, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x1: torch.Tensor, x2: torch.Tensor, group: dist.ProcessGroup,
                world_size: int) -> torch.Tensor:
        ctx.save_for_backward(x1, x2)
        ctx.group, ctx.world_size = group, world_size
        return _reduce_scatter_rows(x1 @ x2, group, world_size)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x1, x2 = ctx.saved_tensors
        grad_full = _all_gather_rows(grad_out, ctx.group, ctx.world_size)
        return grad_full @ x2.t(), x1.t() @ grad_full, None, None


class _MatmulAllReduce(torch.autograd.Function):
    """Backward is the identity on the reduced gradient (Megatron's row-parallel convention: every rank of
    the group holds the same downstream loss)."""

    @staticmethod
    def forward(ctx: Any, x1: torch.Tensor, x2: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(x1, x2)
        out = torch.matmul(x1, x2)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x1, x2 = ctx.saved_tensors
        grad_x2 = x1.reshape(-1, x1.shape[-1]).t() @ grad_out.reshape(-1, grad_out.shape[-1])
        return torch.matmul(grad_out, x2.t()), grad_x2, None


def npu_all_gather_base_mm(input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, *,  # noqa: A002
                           bias: torch.Tensor | None = None, gather_index: int = 0, gather_output: bool = True,
                           comm_turn: int = 0, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(input) @ x2 + bias, all_gather(input)); the gathered tensor is empty if not gather_output."""
    _check_2d("npu_all_gather_base_mm", input, x2)
    if gather_index != 0:
        raise NotImplementedError("npu_all_gather_base_mm: only gather_index=0 is emulated (as on NPU)")
    group = hccl.group_from_comm_name(hcom)
    _check_world("npu_all_gather_base_mm", group, world_size)
    out, gathered = _AllGatherMatmul.apply(input, x2, group, world_size)
    if bias is not None:
        out = out + bias
    return out, (gathered if gather_output else torch.empty(0, dtype=input.dtype, device=input.device))


def npu_mm_reduce_scatter_base(input: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, *,  # noqa: A002
                               reduce_op: str = "sum", bias: torch.Tensor | None = None, comm_turn: int = 0,
                               **_: Any) -> torch.Tensor:
    """reduce_scatter(input @ x2 + bias) along dim 0 (sum only, as on NPU)."""
    _check_2d("npu_mm_reduce_scatter_base", input, x2)
    if reduce_op != "sum":
        raise NotImplementedError(f"npu_mm_reduce_scatter_base: reduce_op={reduce_op!r}; only 'sum' is supported")
    group = hccl.group_from_comm_name(hcom)
    _check_world("npu_mm_reduce_scatter_base", group, world_size)
    out = _MatmulReduceScatter.apply(input, x2, group, world_size)
    if bias is not None:
        out = out + bias
    return out


def npu_mm_all_reduce_base(x1: torch.Tensor, x2: torch.Tensor, hcom: str, *, reduce_op: str = "sum",
                           bias: torch.Tensor | None = None, x3: torch.Tensor | None = None, comm_turn: int = 0,
                           **_: Any) -> torch.Tensor:
    """all_reduce(x1 @ x2) + bias + x3 (bias and x3 added once, after the reduction); x1 2-D or 3-D."""
    if x2.dim() != 2 or x1.dim() not in (2, 3):
        raise ValueError(f"npu_mm_all_reduce_base: x1 must be 2-D/3-D and x2 2-D; got {tuple(x1.shape)}, "
                         f"{tuple(x2.shape)}")
    if reduce_op != "sum":
        raise NotImplementedError(f"npu_mm_all_reduce_base: reduce_op={reduce_op!r}; only 'sum' is supported")
    out = _MatmulAllReduce.apply(x1, x2, hccl.group_from_comm_name(hcom))
    if bias is not None:
        out = out + bias
    if x3 is not None:
        out = out + x3
    return out


OPS: dict[str, Any] = {
    "npu_fusion_attention": npu_fusion_attention,
    "npu_rms_norm": npu_rms_norm,
    "npu_rotary_mul": npu_rotary_mul,
    "npu_swiglu": npu_swiglu,
    "npu_all_gather_base_mm": npu_all_gather_base_mm,
    "npu_mm_reduce_scatter_base": npu_mm_reduce_scatter_base,
    "npu_mm_all_reduce_base": npu_mm_all_reduce_base,
    **moe_ops.OPS,
}
