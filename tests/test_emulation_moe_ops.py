"""The emulated torch_npu MoE ops (`mindspeed_flow.emulation.moe_ops`) against plain-torch loops over experts.

Sizes are odd on purpose: 7 tokens over 4 experts, one expert that receives no token, top-k 1 and 2. Each op is
checked forward and backward, then refused calls (what the real kernel refuses) are checked for a clear message,
and one MoE layer called the way MindSpeed-MM's Qwen3-VL MoE experts call it (permute -> grouped matmul per
expert -> swiglu -> grouped matmul -> unpermute) must equal the dense per-token reference, gradients included.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mindspeed_flow.emulation import moe_ops, ops
from mindspeed_flow.utils.multiproc import run_ranks

TOKENS, HIDDEN, FFN, EXPERTS = 7, 5, 6, 4
EMPTY_EXPERT = 2  # routed to by no token


def _routing(topk: int, seed: int = 0) -> torch.Tensor:
    """[TOKENS, topk] int32 expert ids, distinct per token, never EMPTY_EXPERT."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(EXPERTS) if e != EMPTY_EXPERT])
    rows = [used[torch.randperm(len(used), generator=g)[:topk]] for _ in range(TOKENS)]
    return torch.stack(rows).to(torch.int32)


def _pairs_by_expert(indices: torch.Tensor) -> list[int]:
    """Token-major (token, k) pair numbers in the order the permuted rows hold them: expert by expert."""
    flat = indices.reshape(-1).tolist()
    return [p for e in range(EXPERTS) for p in range(len(flat)) if flat[p] == e]


def _counts(indices: torch.Tensor) -> torch.Tensor:
    """Tokens per expert (int64, as group_list), EMPTY_EXPERT's being 0."""
    return torch.bincount(indices.reshape(-1).long(), minlength=EXPERTS)


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, grad)


def test_moe_ops_are_registered_for_the_fake_torch_npu() -> None:
    for name in ("npu_moe_token_permute", "npu_moe_token_unpermute", "npu_grouped_matmul"):
        assert ops.OPS[name] is moe_ops.OPS[name]


@pytest.mark.parametrize("topk", [1, 2])
def test_permute_groups_rows_by_expert_and_maps_each_pair(topk: int) -> None:
    torch.manual_seed(0)
    tokens = _leaf(TOKENS, HIDDEN)
    indices = _routing(topk)
    permuted, sorted_indices = moe_ops.npu_moe_token_permute(tokens, indices if topk > 1 else indices[:, 0])
    order = _pairs_by_expert(indices)
    ref = torch.stack([tokens[p // topk] for p in order])
    torch.testing.assert_close(permuted, ref, rtol=0, atol=0)
    assert sorted_indices.dtype == torch.int32 and sorted_indices.shape == (TOKENS * topk,)
    for pair, row in enumerate(sorted_indices.tolist()):  # the map unpermute reads back
        assert order[row] == pair
    grad = torch.randn_like(ref)
    torch.testing.assert_close(_grads(permuted, (tokens,), grad), _grads(ref, (tokens,), grad))


@pytest.mark.parametrize("num_out_tokens, kept", [(5, 5), (-3, 2 * TOKENS - 3), (100, 2 * TOKENS), (0, 2 * TOKENS)])
def test_permute_num_out_tokens_keeps_the_leading_rows(num_out_tokens: int, kept: int) -> None:
    tokens, indices = torch.randn(TOKENS, HIDDEN), _routing(2)
    full, map_full = moe_ops.npu_moe_token_permute(tokens, indices)
    cut, map_cut = moe_ops.npu_moe_token_permute(tokens, indices, num_out_tokens=num_out_tokens)
    assert torch.equal(cut, full[:kept]) and torch.equal(map_cut, map_full)


@pytest.mark.parametrize("topk, weighted", [(1, False), (1, True), (2, True)])
def test_unpermute_sums_each_tokens_expert_rows_weighted(topk: int, weighted: bool) -> None:
    torch.manual_seed(1)
    indices = _routing(topk)
    _, sorted_indices = moe_ops.npu_moe_token_permute(torch.randn(TOKENS, HIDDEN), indices)
    permuted = _leaf(TOKENS * topk, HIDDEN)
    probs = torch.rand(TOKENS, topk, requires_grad=True) if weighted else None
    out = moe_ops.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    order = _pairs_by_expert(indices)
    ref = torch.stack([sum((probs[i, k] if weighted else 1.0) * permuted[order.index(i * topk + k)]
                           for k in range(topk)) for i in range(TOKENS)])
    torch.testing.assert_close(out, ref)
    leaves = (permuted, probs) if weighted else (permuted,)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(_grads(out, leaves, grad), _grads(ref, leaves, grad))


def test_unpermute_reads_rows_dropped_by_num_out_tokens_as_zero() -> None:
    tokens, indices, probs = torch.randn(TOKENS, HIDDEN), _routing(2), torch.rand(TOKENS, 2)
    full, sorted_indices = moe_ops.npu_moe_token_permute(tokens, indices)
    cut, _ = moe_ops.npu_moe_token_permute(tokens, indices, num_out_tokens=9)
    padded = torch.cat((full[:9], torch.zeros(2 * TOKENS - 9, HIDDEN)))
    torch.testing.assert_close(moe_ops.npu_moe_token_unpermute(cut, sorted_indices, probs),
                               moe_ops.npu_moe_token_unpermute(padded, sorted_indices, probs))


def _gmm_ref(x: torch.Tensor, weights: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """Loop over experts on x's contiguous row groups; rows past the groups are zero."""
    rows, start = [], 0
    for w, c in zip(weights, counts):
        rows.append(x[start:start + c] @ w)
        start += c
    rows.append(torch.zeros(x.shape[0] - start, weights[0].shape[1]))
    return torch.cat(rows)


@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("stacked", [True, False])
def test_grouped_matmul_split_m_matches_expert_loop(group_list_type: int, stacked: bool) -> None:
    torch.manual_seed(2)
    counts = [3, 0, 4, 2]  # an expert with no rows; 9 rows grouped out of 10: the last row is ungrouped
    x, w = _leaf(10, HIDDEN), _leaf(EXPERTS, HIDDEN, FFN)
    group_list = torch.tensor(counts).cumsum(0) if group_list_type == 0 else torch.tensor(counts)
    weight = [w] if stacked else list(w.unbind(0))
    out = moe_ops.npu_grouped_matmul([x], weight, group_list=group_list, split_item=2, group_type=0,
                                     group_list_type=group_list_type)
    assert len(out) == 1
    ref = _gmm_ref(x, list(w.unbind(0)), counts)
    torch.testing.assert_close(out[0], ref)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(_grads(out[0], (x, w), grad), _grads(ref, (x, w), grad))
    per_group = moe_ops.npu_grouped_matmul([x], weight, group_list=counts, split_item=0, group_type=0,
                                           group_list_type=1)
    assert [t.shape[0] for t in per_group] == counts
    torch.testing.assert_close(torch.cat(per_group), ref[:9])


def test_grouped_matmul_split_k_is_the_per_expert_weight_gradient() -> None:
    torch.manual_seed(3)
    counts = [2, 0, 4, 1]
    x, g = _leaf(7, HIDDEN), _leaf(7, FFN)
    out = moe_ops.npu_grouped_matmul([x.T], [g], group_list=torch.tensor(counts), split_item=3, group_type=2,
                                     group_list_type=1)[0]
    bounds = torch.tensor([0, *counts]).cumsum(0).tolist()
    ref = torch.stack([x[s:e].T @ g[s:e] for s, e in zip(bounds, bounds[1:])])
    assert out.shape == (EXPERTS, HIDDEN, FFN) and torch.count_nonzero(out[1]) == 0
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(_grads(out, (x, g), grad), _grads(ref, (x, g), grad))


def test_grouped_matmul_unsplit_pairs_lists_with_bias() -> None:
    xs, ws, bs = [torch.randn(3, 4), torch.randn(1, 2)], [torch.randn(4, 5), torch.randn(2, 3)], [torch.randn(5),
                                                                                                  torch.randn(3)]
    out = moe_ops.npu_grouped_matmul(xs, ws, bias=bs)
    for got, x, w, b in zip(out, xs, ws, bs):
        torch.testing.assert_close(got, x @ w + b)


class _CallerGmm(torch.autograd.Function):
    """The grouped GEMM as MindSpeed-MM's GmmFunction calls the op (models/common/gmm.py): forward split M on
    counts, backward dx by split M on the transposed weight and dw by split K."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, counts)
        return moe_ops.npu_grouped_matmul([x], [weight], bias=None, group_list=counts, split_item=2, group_type=0,
                                          group_list_type=1)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, counts = ctx.saved_tensors
        dx = moe_ops.npu_grouped_matmul([grad], [weight.transpose(1, 2)], bias=None, group_list=counts,
                                        split_item=2, group_type=0, group_list_type=1)[0]
        dw = moe_ops.npu_grouped_matmul([x.T], [grad], bias=None, group_list=counts, split_item=3, group_type=2,
                                        group_list_type=1)[0]
        return dx, dw, None


def _moe_layer(hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, gmm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Qwen3-VL MoE experts as MindSpeed-MM runs them on NPU (Qwen3VLNpuFusedMoETextExperts.forward)."""
    permuted, row_map = moe_ops.npu_moe_token_permute(hidden, indices.to(torch.int32))
    counts = _counts(indices)
    act = ops.npu_swiglu(gmm(permuted, gate_up, counts), dim=-1)
    return moe_ops.npu_moe_token_unpermute(gmm(act, down, counts), row_map, probs=probs)


def _dense_moe(hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """Every token through its own top-k experts, one at a time."""
    out = []
    for i in range(hidden.shape[0]):
        acc = torch.zeros(hidden.shape[1])
        for k, e in enumerate(indices[i].tolist()):
            a, b = (hidden[i] @ gate_up[e]).chunk(2)
            acc = acc + probs[i, k] * ((F.silu(a) * b) @ down[e])
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("caller_backward", [False, True])
def test_moe_layer_round_trip_equals_dense_reference(topk: int, caller_backward: bool) -> None:
    torch.manual_seed(4)
    hidden, gate_up, down = _leaf(TOKENS, HIDDEN), _leaf(EXPERTS, HIDDEN, 2 * FFN), _leaf(EXPERTS, FFN, HIDDEN)
    probs = torch.softmax(torch.randn(TOKENS, topk), -1).requires_grad_()
    indices = _routing(topk, seed=topk)

    def plain(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return moe_ops.npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0,
                                          group_list_type=1)[0]

    out = _moe_layer(hidden, probs, indices, gate_up, down, _CallerGmm.apply if caller_backward else plain)
    ref = _dense_moe(hidden, probs, indices, gate_up, down)
    torch.testing.assert_close(out, ref)
    leaves = (hidden, probs, gate_up, down)
    grads = _grads(out.square().sum(), leaves, torch.tensor(1.0))
    want = _grads(ref.square().sum(), leaves, torch.tensor(1.0))
    torch.testing.assert_close(grads, want)
    assert torch.count_nonzero(grads[2][EMPTY_EXPERT]) == 0  # the idle expert gets no gradient


def test_moe_layer_in_bfloat16_stays_close_to_float32() -> None:
    torch.manual_seed(5)
    hidden, gate_up, down = torch.randn(TOKENS, HIDDEN), torch.randn(EXPERTS, HIDDEN, 2 * FFN), torch.randn(
        EXPERTS, FFN, HIDDEN)
    probs, indices = torch.softmax(torch.randn(TOKENS, 2), -1), _routing(2)
    bf = [t.to(torch.bfloat16) for t in (hidden, probs)]
    out = _moe_layer(bf[0], bf[1], indices, gate_up.bfloat16(), down.bfloat16(), _CallerGmm.apply)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _dense_moe(hidden, probs, indices, gate_up, down), rtol=0.05, atol=0.1)


_X, _IDX = torch.randn(TOKENS, HIDDEN), _routing(2)
_PERM, _MAP = moe_ops.npu_moe_token_permute(_X, _IDX)
_W = torch.randn(EXPERTS, HIDDEN, FFN)
_COUNTS = _counts(_IDX)


def _gmm(**overrides: Any) -> Callable[[], Any]:
    """A forward grouped-matmul call as MindSpeed-MM makes it, with some arguments replaced."""
    call = dict(x=[_PERM], weight=[_W], group_list=_COUNTS, split_item=2, group_type=0, group_list_type=1)
    call.update(overrides)
    x, weight = call.pop("x"), call.pop("weight")
    return lambda: moe_ops.npu_grouped_matmul(x, weight, **call)


REFUSED = {
    "permute float64 tokens": (lambda: moe_ops.npu_moe_token_permute(_X.double(), _IDX),
                               r"tokens dtype \[float64\] is invalid, should be float16 or bfloat16 or float32"),
    "permute float indices": (lambda: moe_ops.npu_moe_token_permute(_X, _IDX.float()),
                              r"indices dtype \[float32\] is invalid, should be int32 or int64"),
    "permute 3-D tokens": (lambda: moe_ops.npu_moe_token_permute(_X[None], _IDX),
                           r"tokens should be 2 dimensional, but got 3-dimensional"),
    "permute row mismatch": (lambda: moe_ops.npu_moe_token_permute(_X[:3], _IDX), r"indices has 7 rows but tokens"),
    "permute padded mode": (lambda: moe_ops.npu_moe_token_permute(_X, _IDX, padded_mode=True),
                            r"only support padded_mode is false"),
    "unpermute int64 map": (lambda: moe_ops.npu_moe_token_unpermute(_PERM, _MAP.long()),
                            r"sorted_indices dtype \[int64\] is invalid, should be int32"),
    "unpermute probs dtype": (lambda: moe_ops.npu_moe_token_unpermute(_PERM, _MAP, torch.rand(TOKENS, 2).bfloat16()),
                              r"probs dtype \[bfloat16\] must equal permuted_tokens dtype \[float32\]"),
    "unpermute probs shape": (lambda: moe_ops.npu_moe_token_unpermute(_PERM, _MAP, torch.rand(TOKENS, 3)),
                              r"probs \(7, 3\) has 21 entries but sorted_indices has 14"),
    "gmm dtype mix": (_gmm(weight=[_W.bfloat16()]), r"x and weight must share one dtype"),
    "gmm float64": (_gmm(x=[_PERM.double()], weight=[_W.double()]), r"x\[0\] dtype \[float64\] is invalid"),
    "gmm tensor not list": (_gmm(x=_PERM), r"x and weight must be lists of tensors"),
    "gmm group count": (_gmm(group_list=_COUNTS[:3]), r"group_list has 3 entries but there are 4 groups"),
    "gmm int32 group_list": (_gmm(group_list=_COUNTS.int()), r"group_list dtype \[int32\] is invalid, should be int64"),
    "gmm group_list past rows": (_gmm(group_list=_COUNTS + 1), r"group_list covers 18 rows but the split axis has 14"),
    "gmm cumsum decreasing": (_gmm(group_list=torch.tensor([5, 3, 9, 14]), group_list_type=0),
                              r"non-decreasing with group_list_type 0"),
    "gmm K mismatch": (_gmm(weight=[_W.transpose(1, 2)]), r"do not multiply \(K differs\)"),
    "gmm group_type 1": (_gmm(group_type=1), r"group_type must be -1 \(no split\), 0 \(split M\) or 2"),
    "gmm split K one output": (_gmm(x=[_PERM.T], weight=[torch.randn(14, FFN)], split_item=0, group_type=2),
                               r"split_item must be 2 or 3"),
}


def test_unemulated_grouped_matmul_scenarios_say_so() -> None:
    with pytest.raises(NotImplementedError, match="quantized scenarios \\(scale\\)"):
        _gmm(scale=[torch.ones(FFN, dtype=torch.int64)])()
    with pytest.raises(NotImplementedError, match="act_type=1"):
        _gmm(act_type=1)()
    with pytest.raises(TypeError, match="unexpected keyword"):
        _gmm(groups=4)()


def _moe_layer_on_the_npu_rank(rank: int, world_size: int, mode: str) -> str:
    """The Qwen3-VL MoE layer through the fake torch_npu on npu tensors, against the same layer on the host,
    with the tokens per expert counted by torch.histc as Qwen3VLNpuFusedMoETextExperts.forward counts them."""
    from mindspeed_flow import emulation
    from mindspeed_flow.emulation import npu_ext

    emulation.activate(mode=mode)
    import torch_npu

    torch.manual_seed(7)
    host = [torch.randn(TOKENS, HIDDEN), torch.softmax(torch.randn(TOKENS, 2), -1),
            torch.randn(EXPERTS, HIDDEN, 2 * FFN), torch.randn(EXPERTS, FFN, HIDDEN)]
    indices = _routing(2)
    leaves = [t.clone().requires_grad_() for t in host]
    ref = _moe_layer(leaves[0], leaves[1], indices, leaves[2], leaves[3], _CallerGmm.apply)
    want = _grads(ref.sum(), tuple(leaves), torch.tensor(1.0))

    dev = [t.to("npu").requires_grad_() for t in host]
    router_indices = indices.long().to("npu")  # int64, as the HF router's topk returns them
    counts = torch.histc(router_indices, bins=EXPERTS, min=0, max=EXPERTS)  # the caller's count (an npu histc)
    assert counts.dtype == torch.int64 and torch.equal(counts.cpu(), _counts(indices))
    if mode == "strict":  # a host histc of integers stays refused, as by CPU torch
        with pytest.raises(RuntimeError, match="not implemented for 'Long'"):
            torch.histc(indices.long(), bins=EXPERTS, min=0, max=EXPERTS)
    mask = _routing_map(2).to("npu")
    probs_rm = (torch.rand(TOKENS, EXPERTS) * mask.cpu()).to("npu").requires_grad_()
    one = torch.tensor(1.0, device="npu")

    def gmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_npu.npu_grouped_matmul([x], [w], bias=None, group_list=counts, split_item=2, group_type=0,
                                            group_list_type=1)[0]

    syncs_before = npu_ext.host_syncs() if mode == "strict" else {}
    permuted, row_map = torch_npu.npu_moe_token_permute(dev[0], router_indices.to(torch.int32))
    act = torch_npu.npu_swiglu(gmm(permuted, dev[2]), dim=-1)
    out = torch_npu.npu_moe_token_unpermute(gmm(act, dev[3]), row_map, probs=dev[1])
    got = _grads(out.sum(), tuple(dev), one)
    rows, row_probs, sorted_indices = _CallerPermute.apply(dev[0], mask, probs_rm, 2 * TOKENS)
    back = _CallerUnpermute.apply(rows * row_probs.unsqueeze(-1), sorted_indices, dev[0].shape, probs_rm, mask)
    _grads(back.sum(), (dev[0], probs_rm), one)
    # The kernels read their index inputs on the device: the emulated ops add no host synchronisation.
    assert (npu_ext.host_syncs() if mode == "strict" else {}) == syncs_before
    torch.testing.assert_close(out.cpu(), ref.detach())
    torch.testing.assert_close(tuple(g.cpu() for g in got), want)
    return f"{out.device.type} {row_map.device.type} {got[2].device.type}"


@pytest.mark.parametrize("mode, device", [("strict", "npu"), ("lenient", "cpu")])
def test_moe_layer_through_the_fake_torch_npu_on_the_npu(mode: str, device: str) -> None:
    """Registered in torch_npu, and on npu tensors (strict: the device; lenient: host) outputs stay there,
    with no host synchronisation counted for the ops (strict)."""
    assert run_ranks(_moe_layer_on_the_npu_rank, 1, mode, timeout_s=300) == [f"{device} {device} {device}"]


# ----------------------------------------------------------------------------------------------------------
# The routing-map family, as MindSpeed's MoePermuteMaskMap / MoeUnpermuteMaskMap call it (--moe-permute-fusion)
# ----------------------------------------------------------------------------------------------------------
def _routing_map(topk: int) -> torch.Tensor:
    """[TOKENS, EXPERTS] bool mask with topk experts per token, none on EMPTY_EXPERT."""
    mask = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool)
    mask.scatter_(1, _routing(topk).long(), True)
    return mask


class _CallerPermute(torch.autograd.Function):
    """Forward and backward through the ops the way mindspeed/te/pytorch/permutation.py MoePermuteMaskMap does."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None,
                num_out_tokens: int) -> tuple:
        permuted, permuted_probs, sorted_indices = moe_ops.npu_moe_token_permute_with_routing_map(
            tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=False)
        ctx.shape, ctx.sorted_indices, ctx.routing_map = routing_map.shape, sorted_indices, routing_map
        return permuted, permuted_probs, sorted_indices

    @staticmethod
    def backward(ctx: Any, permuted_grad: torch.Tensor, probs_grad: torch.Tensor | None, _: Any) -> tuple:
        tokens_num, num_experts = ctx.shape
        tokens_grad, probs_grad = moe_ops.npu_moe_token_permute_with_routing_map_grad(
            permuted_grad, probs_grad, ctx.sorted_indices, ctx.routing_map, num_experts, tokens_num, False)
        return tokens_grad, None, probs_grad, None


class _CallerUnpermute(torch.autograd.Function):
    """Forward and backward the way MoeUnpermuteMaskMap does (without drop_and_pad)."""

    @staticmethod
    def forward(ctx: Any, permuted: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
                probs: torch.Tensor | None, routing_map: torch.Tensor) -> torch.Tensor:
        out, _, _, _ = moe_ops._npu_moe_token_unpermute_with_routing_map(
            permuted, sorted_indices, restore_shape, probs=probs, routing_map=routing_map, drop_and_pad=False)
        ctx.save_for_backward(permuted, probs)
        ctx.sorted_indices, ctx.routing_map, ctx.restore_shape = sorted_indices, routing_map, restore_shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        permuted, probs = ctx.saved_tensors
        act_grad, probs_grad = moe_ops.npu_moe_token_unpermute_with_routing_map_grad(
            grad, ctx.sorted_indices, ctx.sorted_indices, routing_map=ctx.routing_map,
            permuted_tokens=permuted if probs is not None else None, probs=probs, drop_and_pad=False,
            restore_shape=ctx.restore_shape)
        return act_grad, None, None, probs_grad, None


@pytest.mark.parametrize("topk", [1, 2])
def test_permute_with_routing_map_equals_index_permute(topk: int) -> None:
    mask = _routing_map(topk)
    tokens, probs = torch.randn(TOKENS, HIDDEN), torch.rand(TOKENS, EXPERTS) * mask
    permuted, permuted_probs, sorted_indices = moe_ops.npu_moe_token_permute_with_routing_map(
        tokens, mask, probs=probs, num_out_tokens=TOKENS * topk)
    experts_per_token = mask.nonzero()[:, 1].view(TOKENS, topk).to(torch.int32)  # ascending per token
    want, want_map = moe_ops.npu_moe_token_permute(tokens, experts_per_token)
    assert torch.equal(permuted, want) and torch.equal(sorted_indices, want_map)
    rows_expert = torch.repeat_interleave(torch.arange(EXPERTS), mask.sum(0))
    rows_token = experts_per_token.new_tensor(_pairs_by_expert(experts_per_token)) // topk
    torch.testing.assert_close(permuted_probs, probs[rows_token.long(), rows_expert])


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("probs_on_permute", [False, True])
def test_routing_map_layer_round_trip_equals_dense_reference(topk: int, probs_on_permute: bool) -> None:
    """permute -> grouped matmul per expert -> unpermute; probs applied at unpermute (Megatron's default) or to
    the permuted rows (the permuted probs)."""
    torch.manual_seed(6)
    mask = _routing_map(topk)
    tokens, w = _leaf(TOKENS, HIDDEN), _leaf(EXPERTS, HIDDEN, HIDDEN)
    probs = (torch.rand(TOKENS, EXPERTS) * mask).requires_grad_()
    permuted, permuted_probs, sorted_indices = _CallerPermute.apply(tokens, mask, probs, TOKENS * topk)
    rows = moe_ops.npu_grouped_matmul([permuted], [w], group_list=mask.sum(0), split_item=2, group_type=0,
                                      group_list_type=1)[0]
    if probs_on_permute:
        rows = rows * permuted_probs.unsqueeze(-1)
    out = _CallerUnpermute.apply(rows, sorted_indices, tokens.shape, None if probs_on_permute else probs, mask)
    ref = torch.einsum("te,th,ehk->tk", probs * mask, tokens, w)
    torch.testing.assert_close(out, ref)
    leaves = (tokens, probs, w)
    grad = torch.randn_like(ref)
    got, want = _grads(out, leaves, grad), _grads(ref, leaves, grad)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1] * mask, want[1] * mask)  # the kernels leave unrouted probs' grads at zero
    assert torch.count_nonzero(got[1][~mask]) == 0
    torch.testing.assert_close(got[2], want[2])


_MASK = _routing_map(2)
ROUTING_MAP_REFUSED = {
    "float routing_map": (lambda: moe_ops.npu_moe_token_permute_with_routing_map(_X, _MASK.float()),
                          r"routing_map dtype \[float32\] is invalid, should be int8 or bool"),
    "uneven rows": (lambda: moe_ops.npu_moe_token_permute_with_routing_map(_X, _MASK, num_out_tokens=TOKENS),
                    r"every routing_map row must select topK = num_out_tokens // tokens_num = 1 experts"),
    "probs shape": (lambda: moe_ops.npu_moe_token_permute_with_routing_map(
        _X, _MASK, probs=torch.rand(TOKENS, 3), num_out_tokens=2 * TOKENS), r"probs \(7, 3\) must have routing_map"),
    "int64 sorted_indices": (lambda: moe_ops.npu_moe_token_unpermute_with_routing_map(
        torch.randn(2 * TOKENS, HIDDEN), torch.arange(2 * TOKENS), (TOKENS, HIDDEN)),
        r"sorted_indices dtype \[int64\] is invalid, should be int32"),
    "restore_shape mismatch": (lambda: moe_ops.npu_moe_token_unpermute_with_routing_map(
        torch.randn(2 * TOKENS, HIDDEN), torch.arange(2 * TOKENS, dtype=torch.int32), (TOKENS, HIDDEN + 1)),
        r"must be \[14, 6\]"),
}


@pytest.mark.parametrize("case", sorted({**REFUSED, **ROUTING_MAP_REFUSED}))
def test_wrong_calls_are_refused_with_the_kernels_reason(case: str) -> None:
    call, message = {**REFUSED, **ROUTING_MAP_REFUSED}[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_drop_and_pad_is_not_emulated() -> None:
    with pytest.raises(NotImplementedError, match="drop_and_pad=True"):
        moe_ops.npu_moe_token_permute_with_routing_map(_X, _MASK, num_out_tokens=8, drop_and_pad=True)


# ----------------------------------------------------------------------------------------------------------
# mindspeed.ops.gmm: MindSpeed's JIT-built grouped matmul, answered through its op builder
# ----------------------------------------------------------------------------------------------------------
# A stand-in for MindSpeed's op_builder package with the shape the interception relies on (pinned MindSpeed
# 028de58c): builder.py imports torch_npu before defining MindSpeedOpBuilder, whose load() needs CANN.
_STANDIN = {
    "mindspeed/__init__.py": "",
    "mindspeed/op_builder/__init__.py": "from .gmm_builder import GMMOpBuilder, GMMV2OpBuilder\n"
                                        "from .other_builder import OtherOpBuilder\n",
    "mindspeed/op_builder/builder.py": (
        "import torch_npu\n\n\nclass MindSpeedOpBuilder:\n    def __init__(self, name):\n        self.name = name\n\n"
        "    def load(self, verbose=True):\n        raise RuntimeError('JIT build of ' + self.name + ' needs CANN')\n"),
    "mindspeed/op_builder/gmm_builder.py": (
        "from mindspeed.op_builder.builder import MindSpeedOpBuilder\n\n\n"
        "class GMMOpBuilder(MindSpeedOpBuilder):\n    def __init__(self):\n"
        "        super().__init__('grouped_matmul')\n\n\n"
        "class GMMV2OpBuilder(MindSpeedOpBuilder):\n    def __init__(self):\n"
        "        super().__init__('grouped_matmul_v2')\n"),
    "mindspeed/op_builder/other_builder.py": (
        "from mindspeed.op_builder.builder import MindSpeedOpBuilder\n\n\n"
        "class OtherOpBuilder(MindSpeedOpBuilder):\n    def __init__(self):\n        super().__init__('other')\n"),
}


def _gmm_builder_rank(rank: int, world_size: int, root: str, activate_first: bool) -> str:
    """Load the grouped-matmul builders as mindspeed.ops.gmm.GMMFunction does and run forward and backward."""
    import os
    import sys

    from mindspeed_flow import emulation

    if activate_first:
        emulation.activate(mode="strict")
    else:  # builder.py is the first importer of torch_npu, as in a job whose first MindSpeed import is an op
        os.environ["MSF_EMULATION_MODE"] = "strict"
        sys.path.insert(0, emulation.site_dir())
    sys.path.insert(0, root)
    from mindspeed.op_builder import GMMOpBuilder, GMMV2OpBuilder, OtherOpBuilder

    with pytest.raises(RuntimeError, match="JIT build of other needs CANN"):
        OtherOpBuilder().load()
    gmm, gmm_v2 = GMMOpBuilder().load(), GMMV2OpBuilder().load()
    counts = [3, 0, 4, 2]
    x, w = torch.randn(9, HIDDEN, device="npu"), torch.randn(EXPERTS, HIDDEN, FFN, device="npu")
    grad = torch.randn(9, FFN, device="npu")
    ref = _gmm_ref(x.cpu(), list(w.cpu().unbind(0)), counts)
    cumsum = torch.tensor(counts).cumsum(0).to("npu")
    torch.testing.assert_close(gmm.npu_gmm([x], [w], [], cumsum, 0, 0)[0].cpu(), ref)
    torch.testing.assert_close(gmm_v2.npu_gmm([x], [w], [], torch.tensor(counts, device="npu"), 0, 1)[0].cpu(), ref)
    dx, dw, dbias = gmm.npu_gmm_backward([grad], [x], [w], cumsum, 0)
    leaves = (x.cpu().requires_grad_(), w.cpu().requires_grad_())
    want = _grads(_gmm_ref(leaves[0], list(leaves[1].unbind(0)), counts), leaves, grad.cpu())
    torch.testing.assert_close((dx[0].cpu(), dw[0].cpu()), want)
    assert dbias == [] and dw[0].shape == w.shape
    with pytest.raises(NotImplementedError, match="gemm_fusion"):
        gmm.npu_gmm_backward_fusion([grad], [w], cumsum, 0)
    return dx[0].device.type


@pytest.mark.parametrize("activate_first", [True, False])
def test_mindspeed_gmm_builders_load_the_emulated_grouped_matmul(tmp_path: Any, activate_first: bool) -> None:
    for rel, text in _STANDIN.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert run_ranks(_gmm_builder_rank, 1, str(tmp_path), activate_first, timeout_s=300) == ["npu"]


# ----------------------------------------------------------------------------------------------------------
# MC2 MoE: npu_alltoallv_gmm / npu_gmm_alltoallv on 8 ranks (the smallest documented ep_world_size)
# ----------------------------------------------------------------------------------------------------------
EP, LOCAL = 8, 2  # 16 global experts


def _ep_data(dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's view of the whole job (same seed everywhere): counts [src rank, global expert] with zeros,
    each rank's expert-sorted tokens, and the two expert weights [EP * LOCAL, ...]."""
    g = torch.Generator().manual_seed(11)
    counts = torch.randint(0, 3, (EP, EP * LOCAL), generator=g)
    counts[:, 5] = 0  # global expert 5 receives no token
    tokens = [torch.randn(int(counts[s].sum()), HIDDEN, generator=g).to(dtype) for s in range(EP)]
    w1 = torch.randn(EP * LOCAL, HIDDEN, FFN, generator=g).to(dtype)
    w2 = torch.randn(EP * LOCAL, FFN, HIDDEN, generator=g).to(dtype)
    return counts, tokens, w1, w2


def _dense_ep_reference(counts: torch.Tensor, tokens: list[torch.Tensor], w1: torch.Tensor,
                        w2: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's tokens through their global expert, block by block: x @ w1[g] @ w2[g]."""
    return [torch.cat([x @ w1[g] @ w2[g] for g, x in enumerate(t.split(counts[s].tolist()))])
            for s, t in enumerate(tokens)]


class _CallerMc2Gmm(torch.autograd.Function):
    """MindSpeed-MM's AllToAllGroupedMatmul (dispatch) and GroupedMatmulAllToAll (combine) of
    fsdp/ops/moe_ops/gemm_mc2.py: each op's backward is the other op on the transposed weights, and the weight
    gradient a split-K grouped matmul."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, hcom: str, send: list[int], recv: list[int],
                dispatch: bool) -> Any:
        npu = torch_npu_ops()
        if dispatch:
            out, _, rows = npu.npu_alltoallv_gmm(x, w, hcom, EP, send, recv, permute_out_flag=True)
        else:
            (out, _), rows = npu.npu_gmm_alltoallv(x, w, hcom, EP, send, recv), x
        ctx.save_for_backward(w, rows)
        ctx.hcom, ctx.send, ctx.recv, ctx.dispatch = hcom, send, recv, dispatch
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        w, rows = ctx.saved_tensors
        npu = torch_npu_ops()
        if ctx.dispatch:
            (dx, _), grad_rows = npu.npu_gmm_alltoallv(grad, w, ctx.hcom, EP, ctx.recv, ctx.send,
                                                       trans_gmm_weight=True), grad
        else:
            dx, _, grad_rows = npu.npu_alltoallv_gmm(grad, w, ctx.hcom, EP, ctx.recv, ctx.send,
                                                     permute_out_flag=True, trans_gmm_weight=True)
        per_expert = torch.tensor(ctx.recv if ctx.dispatch else ctx.send).reshape(EP, -1).sum(0).to(grad.device)
        dw = npu.npu_grouped_matmul([rows.T], [grad_rows], group_list=per_expert, split_item=3, group_type=2,
                                    group_list_type=1)[0]
        return dx, dw, None, None, None, None


def torch_npu_ops() -> Any:
    """The fake torch_npu of an activated rank (the ops as MindSpeed-MM reaches them)."""
    import torch_npu

    return torch_npu


def _mc2_moe_rank(rank: int, world_size: int, mode: str) -> str:
    """An expert-parallel MoE layer (dispatch gmm, second gmm + combine) on EP ranks against the dense reference."""
    from mindspeed_flow import emulation

    emulation.activate(mode=mode)
    counts, tokens, w1, w2 = _ep_data(torch.bfloat16)
    # float32 leaves for the reference; the ops take bfloat16 (float16 / bfloat16 only).
    ref_leaves = ([t.float().requires_grad_() for t in tokens], w1.float().requires_grad_(),
                  w2.float().requires_grad_())
    refs = _dense_ep_reference(counts, *ref_leaves)
    grads_out = [torch.randn(r.shape, generator=torch.Generator().manual_seed(s)) for s, r in enumerate(refs)]
    sum(torch.sum(r * g) for r, g in zip(refs, grads_out)).backward()

    group = dist.new_group(list(range(world_size)), backend="hccl")
    hcom = group._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_global_rank(group, rank))
    send = counts[rank].tolist()
    recv = counts[:, rank * LOCAL:(rank + 1) * LOCAL].reshape(-1).tolist()
    local = slice(rank * LOCAL, (rank + 1) * LOCAL)
    x = tokens[rank].to("npu").requires_grad_()
    lw1, lw2 = w1[local].to("npu").requires_grad_(), w2[local].to("npu").requires_grad_()
    hidden = _CallerMc2Gmm.apply(x, lw1, hcom, send, recv, True)
    out = _CallerMc2Gmm.apply(hidden, lw2, hcom, recv, send, False)
    out.backward(grads_out[rank].to(torch.bfloat16).to("npu"))
    loose = {"rtol": 0.05, "atol": 0.1}  # bfloat16 operands
    torch.testing.assert_close(out.float().cpu(), refs[rank].detach(), **loose)
    torch.testing.assert_close(x.grad.float().cpu(), ref_leaves[0][rank].grad, **loose)
    torch.testing.assert_close(lw1.grad.float().cpu(), ref_leaves[1].grad[local], **loose)
    torch.testing.assert_close(lw2.grad.float().cpu(), ref_leaves[2].grad[local], **loose)
    mm_x, mm_w = torch.randn(3, HIDDEN).bfloat16().to("npu"), torch.randn(4, HIDDEN).bfloat16().to("npu")
    _, shared, permuted = torch_npu_ops().npu_alltoallv_gmm(x.detach(), lw1.detach(), hcom, EP, send, recv,
                                                             mm_x=mm_x, mm_weight=mm_w, trans_mm_weight=True)
    assert permuted is None
    torch.testing.assert_close(shared, mm_x @ mm_w.T)
    return out.device.type


@pytest.mark.parametrize("mode, device", [("strict", "npu"), ("lenient", "cpu")])
def test_mc2_moe_layer_on_eight_ranks_equals_dense_reference(mode: str, device: str) -> None:
    assert run_ranks(_mc2_moe_rank, EP, mode, timeout_s=300) == [device] * EP


MC2_REFUSED = {
    "ep_world_size 2": (dict(ep_world_size=2), r"ep_world_size must be one of \(8, 16, 32, 64\), got 2"),
    "float32": (dict(dtype=torch.float32), r"gmm_x dtype \[float32\] is invalid, should be float16 or bfloat16"),
    "short counts": (dict(send_counts=[1] * 3), r"send_counts has 3 entries, not e \* ep_world_size = 16"),
    "counts tensor": (dict(send_counts_tensor=torch.ones(16, dtype=torch.int64)), r"are not supported in this"),
    "shared half": (dict(mm_x=torch.randn(3, HIDDEN).bfloat16()), r"mm_x and mm_weight go together"),
}


@pytest.mark.parametrize("case", sorted(MC2_REFUSED))
@pytest.mark.parametrize("op", ["npu_alltoallv_gmm", "npu_gmm_alltoallv"])
def test_wrong_mc2_moe_calls_are_refused(op: str, case: str) -> None:
    """Refused before any communication, so no group is needed."""
    overrides, message = MC2_REFUSED[case]
    call: dict[str, Any] = dict(ep_world_size=EP, send_counts=[1] * (EP * LOCAL), recv_counts=[1] * (EP * LOCAL))
    call.update(overrides)
    dtype = call.pop("dtype", torch.bfloat16)
    x, w = torch.randn(EP * LOCAL, HIDDEN).to(dtype), torch.randn(LOCAL, HIDDEN, FFN).to(dtype)
    with pytest.raises(RuntimeError, match=message):
        getattr(moe_ops, op)(x, w, "no_such_comm", **call)
