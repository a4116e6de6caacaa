"""CPU references of the torch_npu MoE ops MindSpeed-MM's MoE models call, with the real ops' argument rules.

The callers (pinned MindSpeed-MM 57069cd5): the Qwen3-VL MoE and GLM-4.5V experts
(`mindspeed_mm/models/transformers/qwen3vl/modeling_qwen3_vl_moe.py`, `.../glm4v_moe/modeling_glm4v_moe.py`),
the FSDP2 MoE ops (`mindspeed_mm/fsdp/ops/moe_ops/{permute,unpermute,gemm}.py`) and the shared grouped GEMM
(`mindspeed_mm/models/common/gmm.py`). They route each token to its top-k experts with `npu_moe_token_permute`,
run every expert on its contiguous rows with `npu_grouped_matmul`, and gather the weighted expert outputs back
with `npu_moe_token_unpermute`.

Each op checks its call against the documented signature before computing (dtype, rank, argument values the
kernel refuses) and raises RuntimeError with the kernel's wording, as the real op does on any device: a call
the device would refuse is refused here. The sources of each rule are named next to the op.

The ops are compositions of differentiable torch ops (index_select, matmul, cat, stack), so autograd supplies
a backward that matches the kernels' own gradients; MindSpeed-MM's `GmmFunction`, which calls
`npu_grouped_matmul` again in its backward (group_type 0 for dx, group_type 2 for dw), works as well.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.emulation import hccl, npu_ext

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_TOPK = 512


def _dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16', the spelling the kernels' messages use."""
    return str(dtype).replace("torch.", "")


def _require(ok: bool, op: str, message: str) -> None:
    """Raise the kernel's RuntimeError (TORCH_CHECK) for a refused call."""
    if not ok:
        raise RuntimeError(f"{op}: {message}")


def _require_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    """Refuse a tensor whose dtype the kernel does not take (message shaped like the kernel's TORCH_CHECK)."""
    _require(t.dtype in allowed, op, f"Input tensor {name} dtype [{_dtype_name(t.dtype)}] is invalid, should be "
                                     f"{' or '.join(_dtype_name(d) for d in allowed)}")


def _require_dims(op: str, name: str, t: torch.Tensor, dims: Sequence[int]) -> None:
    """Refuse a tensor of the wrong rank."""
    _require(t.dim() in dims, op, f"The dims of input {name} should be {' or '.join(map(str, dims))} dimensional, "
                                  f"but got {t.dim()}-dimensional.")


def _host(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values on the host without a counted host sync.

    The kernels read their index inputs (group_list, routing maps, sorted indices) on the device; the emulator
    reads them on the host to slice and check, which must not show up in the process's host-sync counts
    (README, "Host synchronisations, counted"). Lenient npu tensors already are host tensors.
    """
    return npu_ext.host_alias(t) if t.device.type == "npu" else t


# ----------------------------------------------------------------------------------------------------------
# npu_moe_token_permute / npu_moe_token_unpermute
# ----------------------------------------------------------------------------------------------------------
# Sources: torch_npu / CANN `aclnnMoeTokenPermute` (https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/
# 82RC1alpha001/API/aolapi/context/aclnnMoeTokenPermute.md): tokens 2-D float16/bfloat16/float32, indices 1-D or 2-D
# int32/int64, sortedIndicesOut = argsort(argsort(flatten(indices))), permuted[sortedIndicesOut[i]] = tokens[i // topK];
# numOutTokens 0 keeps every row, > 0 keeps the first min(n, numel), < 0 keeps numel + n; paddedMode true is not
# supported. topK <= 512: mindspore.ops.moe_token_permute's doc (same kernel). The tie order among tokens routed to
# one expert is token order, as MindSpeed-MM's own eager reference (`fsdp/ops/moe_ops/permute.py` eager_permute,
# a stable argsort) and MindSpeed's kernel wrapper (`mindspeed/ops/csrc/cann/npu_moe_token_permute.cpp`) agree.
def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None,
                          padded_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert, rows grouped by expert; returns (permuted_tokens, sorted_indices).

    `sorted_indices` (int32, one entry per (token, k) pair in token-major order) is the row of `permuted_tokens`
    that pair went to: the map `npu_moe_token_unpermute` reads back.
    """
    op = "npu_moe_token_permute"
    _require(not padded_mode, op, "current version only support padded_mode is false")
    _require_dtype(op, "tokens", tokens, _FLOATS)
    _require_dtype(op, "indices", indices, _INDEX_DTYPES)
    _require_dims(op, "tokens", tokens, (2,))
    _require_dims(op, "indices", indices, (1, 2))
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    _require(topk <= _MAX_TOPK, op, f"topK (indices.size(1)) is {topk}, at most {_MAX_TOPK} is supported")
    _require(indices.shape[0] == tokens.shape[0], op, f"indices has {indices.shape[0]} rows but tokens has "
                                                      f"{tokens.shape[0]}")
    flat = indices.reshape(-1)
    total = flat.numel()
    wanted = int(num_out_tokens or 0)
    kept = min(wanted, total) if wanted > 0 else max(total + wanted, 0)
    order = torch.argsort(flat, stable=True)  # position j of the permuted rows holds pair order[j]
    row_of_pair = torch.empty_like(order)
    row_of_pair[order] = torch.arange(total, device=order.device)
    permuted = tokens.index_select(0, order[:kept] // topk)
    return permuted, row_of_pair.to(torch.int32)


# Sources: torch_npu / CANN `aclnnMoeTokenUnpermute` (https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/
# 82RC1alpha002/API/aolapi/context/aclnnMoeTokenUnpermute.md): out[i] = sum_k permuted[S[i*topK + k]] * probs[i][k]
# (topK = 1 and no weights when probs is None); sorted_indices int32 only and duplicate-free, probs [num_tokens, topK]
# (mindspore.ops.moe_token_unpermute's doc, same kernel); padded_mode true is refused and restore_shape is only read
# in padded mode. probs must have permuted_tokens' dtype: the pinned callers cast one to the other before calling
# (MindSpeed-MM `fsdp/ops/moe_ops/unpermute.py` fused_unpermute, `models/transformers/glm4v_moe/modeling_glm4v_moe.py`).
def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: torch.Tensor | None = None, padded_mode: bool = False,
                            restore_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Gather each (token, k) pair's expert row back and sum over k, weighted by `probs`: [num_tokens, hidden].

    Rows that `npu_moe_token_permute(num_out_tokens=...)` dropped (a pair whose row index lies past the end of
    `permuted_tokens`) contribute zero. The sum accumulates in float32 and is cast back to the tokens' dtype.
    """
    op = "npu_moe_token_unpermute"
    _require(not padded_mode, op, "current version only support padded_mode is false")
    _require_dtype(op, "permuted_tokens", permuted_tokens, _FLOATS)
    _require_dtype(op, "sorted_indices", sorted_indices, (torch.int32,))
    _require_dims(op, "permuted_tokens", permuted_tokens, (2,))
    _require_dims(op, "sorted_indices", sorted_indices, (1,))
    total = sorted_indices.numel()
    topk = 1
    if probs is not None:
        _require_dims(op, "probs", probs, (2,))
        _require(probs.dtype == permuted_tokens.dtype, op, f"Input tensor probs dtype [{_dtype_name(probs.dtype)}] "
                 f"must equal permuted_tokens dtype [{_dtype_name(permuted_tokens.dtype)}]")
        _require(probs.numel() == total, op, f"probs {tuple(probs.shape)} has {probs.numel()} entries but "
                                             f"sorted_indices has {total} (num_tokens * topK)")
        topk = probs.shape[1]
    rows = permuted_tokens.shape[0]
    _require(rows <= total, op, f"permuted_tokens has {rows} rows, more than sorted_indices' {total}")
    largest = int(_host(sorted_indices).max()) if total else -1
    _require(largest < total, op, f"sorted_indices holds {largest}, past num_tokens * topK = {total}")
    if rows < total:  # rows dropped by num_out_tokens read as zeros
        pad = permuted_tokens.new_zeros(total - rows, permuted_tokens.shape[1])
        permuted_tokens = torch.cat((permuted_tokens, pad))
    acc = torch.promote_types(permuted_tokens.dtype, torch.float32)
    gathered = permuted_tokens.index_select(0, sorted_indices.long()).to(acc)
    gathered = gathered.view(total // topk, topk, -1)
    if probs is not None:
        gathered = gathered * probs.to(acc).unsqueeze(-1)
    return gathered.sum(dim=1).to(permuted_tokens.dtype)


# ----------------------------------------------------------------------------------------------------------
# The routing-map family: MindSpeed's fused permute for Megatron's MoE dispatchers (--moe-permute-fusion)
# ----------------------------------------------------------------------------------------------------------
# Caller (pinned MindSpeed 028de58c): `mindspeed/te/pytorch/permutation.py` MoePermuteMaskMap / MoeUnpermuteMaskMap,
# patched over Megatron's moe_utils.permute / unpermute by `mindspeed/core/fusions/fused_moe_permute.py`; their
# backward calls the two *_grad ops explicitly, so the emulator supplies those too. The feature is switched off
# unless torch_npu has both npu_moe_token_permute_with_routing_map and npu_moe_token_unpermute_with_routing_map
# (`mindspeed/features_manager/fusions/fused_moe_permute.py`).
# Sources: CANN ops-transformer `moe/moe_token_permute_with_routing_map/README.md` and
# `moe/moe_token_unpermute_with_routing_map/README.md` (https://gitcode.com/cann/ops-transformer): tokens / probs
# float16, bfloat16, float32; routingMap int8 or bool; sortedIndices int32; without dropAndPad every routingMap row
# selects the same number of experts topK = numOutTokens // tokens_num, at most 512; sortedIndicesOut =
# argsort(the expert-major token ids), permuted probs = probs.T.masked_select(routingMap.T). Output shapes and
# argument order: torch_npu op-plugin `op_plugin/ops/opapi/MoeTokenPermuteWithRoutingMapOpApi.cpp`,
# `MoeTokenUnpermuteWithRoutingMapKernelOpApi.cpp` and the grad op's (https://gitcode.com/Ascend/op-plugin):
# num_out_tokens defaults to tokens.size(0); the unpermute grad returns [out_index.size(0), H] and probs' shape.
# dropAndPad (capacity-padded experts, Megatron --moe-pad-expert-input-to-capacity) is not emulated.
def _check_routing_map(op: str, routing_map: torch.Tensor, tokens_num: int | None) -> torch.Tensor:
    """routingMap.T as bool [E, T], after the dtype/shape checks."""
    _require_dtype(op, "routing_map", routing_map, (torch.int8, torch.bool))
    _require_dims(op, "routing_map", routing_map, (2,))
    if tokens_num is not None:
        _require(routing_map.shape[0] == tokens_num, op, f"routing_map has {routing_map.shape[0]} rows but there "
                                                         f"are {tokens_num} tokens")
    return routing_map.T.bool()


def _routed_positions(routing_map: torch.Tensor) -> torch.Tensor:
    """For each permuted row (expert-major: expert by expert, tokens in order), its position e * T + t in the
    flattened routingMap.T, on routing_map's device; found on the host, where the sizes are known."""
    positions = _host(routing_map).T.reshape(-1).nonzero().squeeze(1)
    return positions.to(routing_map.device)


def _row_probs(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """probs.T.masked_select(routingMap.T): the prob of each permuted row (differentiable in probs)."""
    return probs.T.reshape(-1).index_select(0, _routed_positions(routing_map))


def _check_probs(op: str, probs: torch.Tensor | None, routing_map: torch.Tensor | None) -> None:
    """probs is float and shaped like routing_map ([tokens, experts])."""
    if probs is None:
        return
    _require_dtype(op, "probs", probs, _FLOATS)
    _require(routing_map is not None, op, "probs needs routing_map (the permuted probs are selected by it)")
    _require(probs.shape == routing_map.shape, op, f"probs {tuple(probs.shape)} must have routing_map's shape "
                                                   f"{tuple(routing_map.shape)}")


def _no_drop_and_pad(op: str, drop_and_pad: bool) -> None:
    """dropAndPad mode is outside what the emulator reproduces."""
    if drop_and_pad:
        raise NotImplementedError(f"{op}: drop_and_pad=True (capacity-padded experts) is not emulated")


def npu_moe_token_permute_with_routing_map(tokens: torch.Tensor, routing_map: torch.Tensor, *,
                                           probs: torch.Tensor | None = None, num_out_tokens: int | None = None,
                                           drop_and_pad: bool = False
                                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows grouped by expert from a [tokens, experts] routing mask; returns (permuted, permuted_probs, sorted_indices).

    sorted_indices (int32) maps token-major (token, expert) pair i to its permuted row, as npu_moe_token_permute's.
    """
    op = "npu_moe_token_permute_with_routing_map"
    _no_drop_and_pad(op, drop_and_pad)
    _require_dtype(op, "tokens", tokens, _FLOATS)
    _require_dims(op, "tokens", tokens, (2,))
    _check_routing_map(op, routing_map, tokens.shape[0])
    _check_probs(op, probs, routing_map)
    tokens_num = tokens.shape[0]
    topk = (tokens.shape[0] if num_out_tokens is None else int(num_out_tokens)) // max(tokens_num, 1)
    per_token = sorted(set(_host(routing_map).bool().sum(dim=1).tolist()))
    _require(topk <= _MAX_TOPK, op, f"topK = num_out_tokens // tokens_num is {topk}, at most {_MAX_TOPK}")
    _require(per_token in ([topk], []), op, f"without drop_and_pad every routing_map row must select topK = "
                                           f"num_out_tokens // tokens_num = {topk} experts; rows select {per_token}")
    token_of_row = _routed_positions(routing_map) % max(tokens_num, 1)
    row_of_pair = torch.argsort(token_of_row, stable=True)
    permuted_probs = _row_probs(probs, routing_map) if probs is not None else None
    return tokens.index_select(0, token_of_row), permuted_probs, row_of_pair.to(torch.int32)


def npu_moe_token_permute_with_routing_map_grad(permuted_tokens_grad: torch.Tensor,
                                                permuted_probs_grad: torch.Tensor | None,
                                                sorted_indices: torch.Tensor, routing_map: torch.Tensor,
                                                num_experts: int, tokens_num: int,
                                                drop_and_pad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of the routing-map permute: (tokens_grad [T, H], probs_grad [T, E] or None)."""
    op = "npu_moe_token_permute_with_routing_map_grad"
    _no_drop_and_pad(op, drop_and_pad)
    _require_dtype(op, "permuted_tokens_grad", permuted_tokens_grad, _FLOATS)
    _require_dims(op, "permuted_tokens_grad", permuted_tokens_grad, (2,))
    _require_dtype(op, "sorted_indices", sorted_indices, (torch.int32,))
    mask_t = _check_routing_map(op, routing_map, tokens_num)
    _require(mask_t.shape[0] == num_experts, op, f"routing_map has {mask_t.shape[0]} experts, num_experts is "
                                                 f"{num_experts}")
    topk = sorted_indices.numel() // max(tokens_num, 1)
    acc = torch.promote_types(permuted_tokens_grad.dtype, torch.float32)
    per_pair = permuted_tokens_grad.index_select(0, sorted_indices.long()).to(acc)
    tokens_grad = per_pair.view(tokens_num, topk, -1).sum(dim=1).to(permuted_tokens_grad.dtype)
    if permuted_probs_grad is None:
        return tokens_grad, None
    probs_grad_t = permuted_probs_grad.new_zeros(mask_t.shape).masked_scatter(mask_t, permuted_probs_grad)
    return tokens_grad, probs_grad_t.T.contiguous()


def _pair_probs(probs: torch.Tensor | None, routing_map: torch.Tensor | None,
                sorted_indices: torch.Tensor) -> torch.Tensor | None:
    """The prob of each token-major pair: the permuted probs (expert-major rows) read at each pair's row."""
    if probs is None:
        return None
    return _row_probs(probs, routing_map).index_select(0, sorted_indices.long())


def _npu_moe_token_unpermute_with_routing_map(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                                              restore_shape: Sequence[int], *, probs: torch.Tensor | None = None,
                                              routing_map: torch.Tensor | None = None, drop_and_pad: bool = False
                                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor | None]:
    """out[t] = sum of token t's expert rows (weighted by probs[t, e]); returns (out, out_index, permuted_token_id,
    permuted_probs). Without drop_and_pad the real kernel's out_index / permuted_token_id are not read by MindSpeed
    (its backward passes sorted_indices for both), so the emulator returns sorted_indices in both places.
    """
    op = "_npu_moe_token_unpermute_with_routing_map"
    _no_drop_and_pad(op, drop_and_pad)
    _require_dtype(op, "permuted_tokens", permuted_tokens, _FLOATS)
    _require_dims(op, "permuted_tokens", permuted_tokens, (2,))
    _require_dtype(op, "sorted_indices", sorted_indices, (torch.int32,))
    _require_dims(op, "sorted_indices", sorted_indices, (1,))
    _require(len(restore_shape) == 2, op, f"restore_shape must be [tokens, hidden], got {tuple(restore_shape)}")
    tokens_num, hidden = int(restore_shape[0]), int(restore_shape[1])
    if routing_map is not None:
        _check_routing_map(op, routing_map, tokens_num)
    _check_probs(op, probs, routing_map)
    total = sorted_indices.numel()
    _require(total % max(tokens_num, 1) == 0, op, f"sorted_indices has {total} entries, not a multiple of "
                                                  f"{tokens_num} tokens")
    _require(permuted_tokens.shape == (total, hidden), op, f"permuted_tokens {tuple(permuted_tokens.shape)} must be "
                                                           f"[{total}, {hidden}] (sorted_indices x restore_shape[1])")
    acc = torch.promote_types(permuted_tokens.dtype, torch.float32)
    per_pair = permuted_tokens.index_select(0, sorted_indices.long()).to(acc)
    pair_probs = _pair_probs(probs, routing_map, sorted_indices)
    if pair_probs is not None:
        per_pair = per_pair * pair_probs.to(acc).unsqueeze(-1)
    out = per_pair.view(tokens_num, total // max(tokens_num, 1), hidden).sum(dim=1).to(permuted_tokens.dtype)
    permuted_probs = _row_probs(probs, routing_map) if probs is not None else None
    return out, sorted_indices.clone(), sorted_indices.clone(), permuted_probs


def npu_moe_token_unpermute_with_routing_map(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                                             restore_shape: Sequence[int], *, probs: torch.Tensor | None = None,
                                             routing_map: torch.Tensor | None = None,
                                             drop_and_pad: bool = False) -> torch.Tensor:
    """The unpermuted tokens alone (torch_npu's public wrapper of the op above)."""
    return _npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs=probs,
                                                     routing_map=routing_map, drop_and_pad=drop_and_pad)[0]


def npu_moe_token_unpermute_with_routing_map_grad(unpermuted_tokens_grad: torch.Tensor, out_index: torch.Tensor,
                                                  permuted_token_id: torch.Tensor,
                                                  routing_map: torch.Tensor | None = None,
                                                  permuted_tokens: torch.Tensor | None = None,
                                                  probs: torch.Tensor | None = None, drop_and_pad: bool = False,
                                                  restore_shape: Sequence[int] | None = None
                                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of the routing-map unpermute: (permuted_tokens_grad [rows, H], probs_grad [T, E] or None)."""
    op = "npu_moe_token_unpermute_with_routing_map_grad"
    _no_drop_and_pad(op, drop_and_pad)
    _require_dtype(op, "unpermuted_tokens_grad", unpermuted_tokens_grad, _FLOATS)
    _require_dims(op, "unpermuted_tokens_grad", unpermuted_tokens_grad, (2,))
    _require_dtype(op, "out_index", out_index, (torch.int32,))
    tokens_num, hidden = unpermuted_tokens_grad.shape
    if routing_map is not None:
        _check_routing_map(op, routing_map, tokens_num)
    _check_probs(op, probs, routing_map)
    _require(probs is None or permuted_tokens is not None, op, "probs' gradient needs permuted_tokens")
    rows = out_index.long()
    topk = rows.numel() // max(tokens_num, 1)
    acc = torch.promote_types(unpermuted_tokens_grad.dtype, torch.float32)
    per_pair = unpermuted_tokens_grad.to(acc).repeat_interleave(topk, dim=0)
    pair_probs = _pair_probs(probs, routing_map, out_index)
    scaled = per_pair if pair_probs is None else per_pair * pair_probs.to(acc).unsqueeze(-1)
    permuted_grad = scaled.new_zeros(rows.numel(), hidden).index_copy(0, rows, scaled)
    permuted_grad = permuted_grad.to(unpermuted_tokens_grad.dtype)
    if probs is None:
        return permuted_grad, None
    pair_dots = (per_pair * permuted_tokens.index_select(0, rows).to(acc)).sum(dim=-1)
    row_dots = pair_dots.new_zeros(rows.numel()).index_copy(0, rows, pair_dots)
    mask_t = routing_map.T.bool()
    probs_grad_t = row_dots.new_zeros(mask_t.shape).masked_scatter(mask_t, row_dots)
    return permuted_grad, probs_grad_t.T.to(unpermuted_tokens_grad.dtype).contiguous()


# ----------------------------------------------------------------------------------------------------------
# npu_grouped_matmul
# ----------------------------------------------------------------------------------------------------------
# Source: torch_npu `npu_grouped_matmul` (https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/
# ptaoplist_000524.html, PTA 7.0.0): npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None,
# antiquant_scale=None, antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
# activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=-1, group_list_type=0,
# act_type=0, output_dtype=None) -> List[Tensor]. x and weight are lists; weight tensors 2-D or 3-D; float16,
# bfloat16, float32 (int8/int4 are the quantized scenarios); group_list an int64 tensor or a list of ints, cumulative
# (group_list_type 0) or per-group counts (1); group_type -1 no split, 0 splits x's rows (M), 2 splits the contracted
# axis (K) and returns one [E, m, n] tensor; split_item 0/1 give one output per group, 2/3 one output. The group_type
# 2 meta test in Ascend/pytorch PR 34653 fixes its output rank (3-D). MindSpeed-MM's calls (`models/common/gmm.py`
# GmmFunction, `fsdp/ops/moe_ops/gemm.py`): forward ([x], [w3d], group_list=counts, split_item=2, group_type=0,
# group_list_type=1); backward dx the same with w transposed, dw ([x.T], [grad], split_item=3, group_type=2).
_QUANT_ARGS = ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale", "activation_input",
               "activation_quant_scale", "activation_quant_offset")


def _group_bounds(op: str, group_list: Sequence[int] | torch.Tensor, group_list_type: int, groups: int,
                  axis_size: int) -> list[tuple[int, int]]:
    """[start, end) of each group along the split axis, after the checks the kernel makes on group_list."""
    if isinstance(group_list, torch.Tensor):
        _require_dtype(op, "group_list", group_list, (torch.int64,))
        _require_dims(op, "group_list", group_list, (1,))
        values = [int(v) for v in _host(group_list).tolist()]
    else:
        values = [int(v) for v in group_list]
    _require(len(values) == groups, op, f"group_list has {len(values)} entries but there are {groups} groups")
    _require(group_list_type in (0, 1), op, f"group_list_type must be 0 (cumsum) or 1 (count), got {group_list_type}")
    _require(all(v >= 0 for v in values), op, f"group_list entries must be non-negative, got {values}")
    if group_list_type == 1:
        ends = [sum(values[: i + 1]) for i in range(groups)]
    else:
        _require(all(a <= b for a, b in zip(values, values[1:])), op,
                 f"group_list must be non-decreasing with group_list_type 0 (cumsum), got {values}")
        ends = values
    _require(not ends or ends[-1] <= axis_size, op, f"group_list covers {ends[-1] if ends else 0} rows but the split "
                                                    f"axis has {axis_size}")
    return list(zip([0] + ends[:-1], ends))


def _expert_weights(op: str, weight: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One [K, N] matrix per group, from a single [E, K, N] tensor or a list of E 2-D tensors."""
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))
    for i, w in enumerate(weight):
        _require_dims(op, f"weight[{i}]", w, (2,))
    return list(weight)


def _check_tensor_lists(op: str, x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor]) -> None:
    """x and weight are non-empty lists of same-dtype float tensors (the non-quantized scenario)."""
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op,
             f"x and weight must be lists of tensors (TensorList), got {type(x).__name__} and {type(weight).__name__}")
    _require(len(x) > 0 and len(weight) > 0, op, "x and weight must not be empty")
    for name, seq in (("x", x), ("weight", weight)):
        for i, t in enumerate(seq):
            _require_dtype(op, f"{name}[{i}]", t, _FLOATS)
    _require(len({t.dtype for t in (*x, *weight)}) == 1, op,
             f"x and weight must share one dtype in the non-quantized scenario, got "
             f"{sorted({_dtype_name(t.dtype) for t in (*x, *weight)})}")


def npu_grouped_matmul(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *,
                       bias: Sequence[torch.Tensor] | None = None,
                       group_list: Sequence[int] | torch.Tensor | None = None,
                       split_item: int = 0, group_type: int | None = -1, group_list_type: int = 0, act_type: int = 0,
                       output_dtype: torch.dtype | None = None, **quant: Any) -> list[torch.Tensor]:
    """Grouped matmul, non-quantized: y_g = x_g @ w_g (+ bias_g) for each group g.

    group_type -1: x[i] @ weight[i]; 0: rows [start, end) of the single x go to expert g (rows past the last group
    come out zero); 2: x[:, start:end] @ weight[start:end] per group, stacked to [E, m, n]. Quantization arguments,
    act_type and a different output_dtype are not emulated.
    """
    op = "npu_grouped_matmul"
    unknown = sorted(set(quant) - set(_QUANT_ARGS))
    if unknown:
        raise TypeError(f"{op}() got unexpected keyword arguments {unknown}")
    used = [name for name, value in quant.items()
            if value is not None and not (isinstance(value, (list, tuple)) and not value)]
    if used:
        raise NotImplementedError(f"{op}: the quantized scenarios ({', '.join(used)}) are not emulated")
    if act_type != 0:
        raise NotImplementedError(f"{op}: act_type={act_type} (a fused activation) is not emulated")
    _check_tensor_lists(op, x, weight)
    if output_dtype is not None and output_dtype != x[0].dtype:
        raise NotImplementedError(f"{op}: output_dtype={output_dtype} differs from the inputs' dtype; only the "
                                  "non-quantized scenario (output in the inputs' dtype) is emulated")
    _require(split_item in (0, 1, 2, 3), op, f"split_item must be 0, 1, 2 or 3, got {split_item}")
    group_type = -1 if group_type is None else group_type
    if group_type == -1:
        return _grouped_matmul_unsplit(op, x, weight, bias, group_list, split_item)
    if group_type == 0:
        return _grouped_matmul_split_m(op, x, weight, bias, group_list, split_item, group_list_type)
    if group_type == 2:
        return _grouped_matmul_split_k(op, x, weight, bias, group_list, split_item, group_list_type)
    raise RuntimeError(f"{op}: group_type must be -1 (no split), 0 (split M) or 2 (split K), got {group_type}")


def _add_bias(op: str, out: torch.Tensor, bias: Sequence[torch.Tensor] | None, g: int) -> torch.Tensor:
    """out + bias[g] when a per-group 1-D bias list is given."""
    if not bias:
        return out
    _require_dims(op, f"bias[{g}]", bias[g], (1,))
    return out + bias[g].to(out.dtype)


def _grouped_matmul_unsplit(op: str, x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor],
                            bias: Sequence[torch.Tensor] | None, group_list: Any,
                            split_item: int) -> list[torch.Tensor]:
    """group_type -1: every group is its own (x[i], weight[i]) pair."""
    _require(group_list is None, op, "group_list must be None when group_type is -1 (no split)")
    _require(len(x) == len(weight), op, f"x has {len(x)} tensors but weight has {len(weight)}")
    for g, w in enumerate(weight):
        _require_dims(op, f"weight[{g}]", w, (2,))
    outs = [_add_bias(op, xi @ wi, bias, g) for g, (xi, wi) in enumerate(zip(x, weight))]
    return [torch.cat(outs)] if split_item in (2, 3) else outs


def _grouped_matmul_split_m(op: str, x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor],
                            bias: Sequence[torch.Tensor] | None, group_list: Any, split_item: int,
                            group_list_type: int) -> list[torch.Tensor]:
    """group_type 0: the rows of one x are split among the experts by group_list (MoE expert FFNs)."""
    _require(group_list is not None, op, "group_type 0 (split M) needs group_list")
    _require(len(x) == 1, op, f"group_type 0 with group_list takes one x tensor, got {len(x)}")
    xs = x[0]
    _require_dims(op, "x[0]", xs, (2,))
    weights = _expert_weights(op, weight)
    k = xs.shape[1]
    for g, w in enumerate(weights):
        _require(w.shape[0] == k, op, f"x[0] {tuple(xs.shape)} and expert {g}'s weight {tuple(w.shape)} do not "
                                      "multiply (K differs)")
    bounds = _group_bounds(op, group_list, group_list_type, len(weights), xs.shape[0])
    outs = [_add_bias(op, xs[s:e] @ weights[g], bias, g) for g, (s, e) in enumerate(bounds)]
    if split_item in (0, 1):
        return outs
    covered = bounds[-1][1] if bounds else 0
    n = weights[0].shape[1]
    if covered < xs.shape[0]:  # the kernel writes only the grouped rows of y; the emulator makes the rest zero
        outs.append(xs.new_zeros(xs.shape[0] - covered, n))
    return [torch.cat(outs)]


def _grouped_matmul_split_k(op: str, x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor],
                            bias: Sequence[torch.Tensor] | None, group_list: Any, split_item: int,
                            group_list_type: int) -> list[torch.Tensor]:
    """group_type 2: the contracted axis of one x [m, K] and one weight [K, n] is split (expert weight grads)."""
    _require(group_list is not None, op, "group_type 2 (split K) needs group_list")
    _require(len(x) == 1 and len(weight) == 1, op, f"group_type 2 takes one x and one weight tensor, got "
                                                   f"{len(x)} and {len(weight)}")
    _require(split_item in (2, 3), op, f"group_type 2 returns one [E, m, n] tensor: split_item must be 2 or 3, "
                                       f"got {split_item}")
    _require(not bias, op, "bias is not supported with group_type 2")
    xs, w = x[0], weight[0]
    _require_dims(op, "x[0]", xs, (2,))
    _require_dims(op, "weight[0]", w, (2,))
    _require(xs.shape[1] == w.shape[0], op, f"x[0] {tuple(xs.shape)} and weight[0] {tuple(w.shape)} do not multiply")
    groups = group_list.numel() if isinstance(group_list, torch.Tensor) else len(group_list)
    bounds = _group_bounds(op, group_list, group_list_type, groups, xs.shape[1])
    return [torch.stack([xs[:, s:e] @ w[s:e] for s, e in bounds])]


# ----------------------------------------------------------------------------------------------------------
# MC2 MoE: all-to-all-v fused with the grouped matmul (expert parallelism)
# ----------------------------------------------------------------------------------------------------------
# Sources: torch_npu `npu_alltoallv_gmm` and `npu_gmm_alltoallv` API pages (op-plugin `docs/context/
# torch_npu-npu_alltoallv_gmm.md`, `torch_npu-npu_gmm_alltoallv.md`, https://gitcode.com/Ascend/op-plugin, 7.3.0):
# gmm_x 2-D and gmm_weight 3-D [e, H1, N1] in float16 / bfloat16 (one dtype), ep_world_size 8, 16, 32 or 64,
# send_counts / recv_counts lists of e * ep_world_size ints (at most 256, e <= 32), send/recv_counts_tensor "not
# supported in this version", mm_x / mm_weight 2-D, given together, the shared expert's matmul. Layout (from the
# callers, MindSpeed-MM `fsdp/ops/moe_ops/gemm_mc2.py` and MindSpeed `ops/grouped_matmul_mc2.py`): counts are
# indexed [rank * e + local expert]; the all-to-all-v exchanges each rank's block of e counts; Permute turns the
# received (source rank, local expert) blocks into local-expert-major order, the grouped matmul's row groups
# (recv_counts.reshape(ep, e).sum(0)), and npu_gmm_alltoallv undoes it. The doc's 2 MB - 100 MB per-card traffic
# range is a performance envelope and not checked. The kernels have no autograd: their callers pair each with the
# other in their own backward.
_MC2_EP_SIZES = (8, 16, 32, 64)


def _check_mc2_gmm(op: str, gmm_x: torch.Tensor, gmm_weight: torch.Tensor, hcom: str, ep_world_size: int,
                   send_counts: Sequence[int], recv_counts: Sequence[int], counts_tensors: tuple,
                   mm_x: torch.Tensor | None, mm_weight: torch.Tensor | None) -> tuple[int, dist.ProcessGroup]:
    """The documented rules of the two MC2 grouped matmuls; returns (e, the experts per rank; the EP group)."""
    for name, t in (("gmm_x", gmm_x), ("gmm_weight", gmm_weight)):
        _require_dtype(op, name, t, (torch.float16, torch.bfloat16))
    _require(gmm_weight.dtype == gmm_x.dtype, op, "gmm_weight must have gmm_x's dtype")
    _require_dims(op, "gmm_x", gmm_x, (2,))
    _require_dims(op, "gmm_weight", gmm_weight, (3,))
    _require(ep_world_size in _MC2_EP_SIZES, op, f"ep_world_size must be one of {_MC2_EP_SIZES}, got {ep_world_size}")
    experts = gmm_weight.shape[0]
    _require(experts <= 32 and experts * ep_world_size <= 256, op, f"e = {experts} experts per rank times "
             f"ep_world_size {ep_world_size}: e must be <= 32 and e * ep_world_size <= 256")
    for name, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        _require(len(counts) == experts * ep_world_size, op, f"{name} has {len(counts)} entries, not e * "
                                                             f"ep_world_size = {experts * ep_world_size}")
    _require(all(t is None for t in counts_tensors), op, "send_counts_tensor / recv_counts_tensor are not supported "
                                                         "in this version (pass None)")
    _require((mm_x is None) == (mm_weight is None), op, "mm_x and mm_weight go together (the shared expert)")
    if mm_x is not None:
        for name, t in (("mm_x", mm_x), ("mm_weight", mm_weight)):
            _require_dtype(op, name, t, (torch.float16, torch.bfloat16))
            _require_dims(op, name, t, (2,))
    _require(sum(send_counts) == gmm_x.shape[0], op, f"send_counts sum to {sum(send_counts)} but gmm_x has "
                                                     f"{gmm_x.shape[0]} rows")
    group = hccl.group_from_comm_name(hcom)
    _require(dist.get_world_size(group) == ep_world_size, op, f"ep_world_size={ep_world_size} but the "
                                                              f"communicator's group has {dist.get_world_size(group)}")
    return experts, group


def _all_to_all_v(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], experts: int,
                  ep_world_size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Rows to each rank in blocks of `experts` counts; rows from each rank back in rank order."""
    per_rank = [sum(counts[r * experts:(r + 1) * experts]) for counts in (send_counts, recv_counts)
                for r in range(ep_world_size)]
    send_splits, recv_splits = per_rank[:ep_world_size], per_rank[ep_world_size:]
    out = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def _regroup(x: torch.Tensor, counts: Sequence[int], outer: int, inner: int) -> torch.Tensor:
    """Blocks of rows indexed [o * inner + i] (sizes `counts`) reordered to [i * outer + o]."""
    blocks = x.split(list(counts))
    return torch.cat([blocks[o * inner + i] for i in range(inner) for o in range(outer)])


def _local_expert_gmm(x: torch.Tensor, weight: torch.Tensor, transpose: bool, counts: Sequence[int],
                      experts: int, ep_world_size: int) -> torch.Tensor:
    """The grouped matmul of local-expert-major rows; `counts` are indexed [rank * e + local expert]."""
    rows = [sum(counts[r * experts + j] for r in range(ep_world_size)) for j in range(experts)]
    return npu_grouped_matmul([x], [weight.transpose(1, 2) if transpose else weight], group_list=rows,
                              split_item=3, group_type=0, group_list_type=1)[0]


def _mm(x: torch.Tensor | None, weight: torch.Tensor | None, transpose: bool) -> torch.Tensor | None:
    """The shared expert's matmul, when given."""
    if x is None:
        return None
    return x @ (weight.T if transpose else weight)


def npu_alltoallv_gmm(gmm_x: torch.Tensor, gmm_weight: torch.Tensor, hcom: str, ep_world_size: int,
                      send_counts: Sequence[int], recv_counts: Sequence[int], *,
                      send_counts_tensor: torch.Tensor | None = None, recv_counts_tensor: torch.Tensor | None = None,
                      mm_x: torch.Tensor | None = None, mm_weight: torch.Tensor | None = None,
                      trans_gmm_weight: bool = False, trans_mm_weight: bool = False,
                      permute_out_flag: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """All-to-all-v of the expert-sorted rows, Permute to local-expert-major order, grouped matmul per local expert;
    returns (gmm_y, mm_y, permute_out), the last two None unless asked for."""
    experts, group = _check_mc2_gmm("npu_alltoallv_gmm", gmm_x, gmm_weight, hcom, ep_world_size, send_counts,
                                    recv_counts, (send_counts_tensor, recv_counts_tensor), mm_x, mm_weight)
    with torch.no_grad():
        received = _all_to_all_v(gmm_x, send_counts, recv_counts, experts, ep_world_size, group)
        permute_out = _regroup(received, recv_counts, ep_world_size, experts)
        gmm_y = _local_expert_gmm(permute_out, gmm_weight, trans_gmm_weight, recv_counts, experts, ep_world_size)
        mm_y = _mm(mm_x, mm_weight, trans_mm_weight)
    return gmm_y, mm_y, permute_out if permute_out_flag else None


def npu_gmm_alltoallv(gmm_x: torch.Tensor, gmm_weight: torch.Tensor, hcom: str, ep_world_size: int,
                      send_counts: Sequence[int], recv_counts: Sequence[int], *,
                      send_counts_tensor: torch.Tensor | None = None, recv_counts_tensor: torch.Tensor | None = None,
                      mm_x: torch.Tensor | None = None, mm_weight: torch.Tensor | None = None,
                      trans_gmm_weight: bool = False,
                      trans_mm_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Grouped matmul per local expert on local-expert-major rows, Unpermute to (rank, expert) blocks, all-to-all-v
    back to the ranks the rows came from; returns (y, mm_y)."""
    experts, group = _check_mc2_gmm("npu_gmm_alltoallv", gmm_x, gmm_weight, hcom, ep_world_size, send_counts,
                                    recv_counts, (send_counts_tensor, recv_counts_tensor), mm_x, mm_weight)
    with torch.no_grad():
        gmm_y = _local_expert_gmm(gmm_x, gmm_weight, trans_gmm_weight, send_counts, experts, ep_world_size)
        expert_major = [send_counts[r * experts + j] for j in range(experts) for r in range(ep_world_size)]
        unpermute_out = _regroup(gmm_y, expert_major, experts, ep_world_size)
        y = _all_to_all_v(unpermute_out, send_counts, recv_counts, experts, ep_world_size, group)
        mm_y = _mm(mm_x, mm_weight, trans_mm_weight)
    return y, mm_y


# ----------------------------------------------------------------------------------------------------------
# torch.histc of integer expert ids
# ----------------------------------------------------------------------------------------------------------
def install_integer_histc(npu_only: bool) -> None:
    """Let torch.histc / Tensor.histc count integer tensors, as the npu's histc does (idempotent).

    MindSpeed-MM's NPU MoE experts count tokens per expert with `torch.histc(router_indices, bins=E, min=0, max=E)`
    on int64 expert ids (`models/transformers/qwen3vl/modeling_qwen3_vl_moe.py`, `.../glm4v_moe/...`,
    `fsdp/ops/npu_patch/npu_fused_operator.py`) and hand the result to npu_grouped_matmul as group_list: the npu
    kernel takes integer input, torch's CPU kernel refuses it ("histogram_cpu" not implemented for 'Long'). The
    count runs on a float copy on the same device and comes back in the input's dtype (histc's output dtype).
    `npu_only` (strict mode) keeps host tensors under torch's own refusal, as on a real machine.
    """
    if getattr(torch.histc, "_msf_integer_histc", False):
        return
    for owner in (torch, torch.Tensor):
        original = owner.histc

        def histc(input: torch.Tensor, *args: Any,  # noqa: A002 (torch's own argument name, for keyword callers)
                  _original: Any = original, **kwargs: Any) -> torch.Tensor:
            """histc that also counts integer tensors (on the npu when npu_only)."""
            if input.is_floating_point() or (npu_only and input.device.type != "npu"):
                return _original(input, *args, **kwargs)
            return _original(input.float(), *args, **kwargs).to(input.dtype)

        histc._msf_integer_histc = True  # type: ignore[attr-defined]
        owner.histc = histc


OPS: dict[str, Any] = {
    "npu_moe_token_permute": npu_moe_token_permute,
    "npu_moe_token_unpermute": npu_moe_token_unpermute,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_moe_token_permute_with_routing_map": npu_moe_token_permute_with_routing_map,
    "npu_moe_token_permute_with_routing_map_grad": npu_moe_token_permute_with_routing_map_grad,
    "_npu_moe_token_unpermute_with_routing_map": _npu_moe_token_unpermute_with_routing_map,
    "npu_moe_token_unpermute_with_routing_map": npu_moe_token_unpermute_with_routing_map,
    "npu_moe_token_unpermute_with_routing_map_grad": npu_moe_token_unpermute_with_routing_map_grad,
    "npu_alltoallv_gmm": npu_alltoallv_gmm,
    "npu_gmm_alltoallv": npu_gmm_alltoallv,
}
