"""The emulated MoE ops called by the real MindSpeed-MM / MindSpeed / Megatron code, against those projects' own
eager (non-NPU) references, forward and backward.

- MindSpeed-MM's FSDP2 MoE ops (`mindspeed_mm/fsdp/ops/moe_ops/{permute,unpermute,gemm}.py`, fused=True: torch_npu
  permute, grouped matmul through its GmmFunction, unpermute; tokens per expert from torch.histc as in
  `fsdp/ops/npu_patch/npu_fused_operator.py`) against the same functions with fused=False;
- MindSpeed's `te/pytorch/permutation.py` MoePermuteMaskMap / MoeUnpermuteMaskMap (--moe-permute-fusion) against
  Megatron's `moe_utils.permute` / `unpermute`;
- MindSpeed's `core/transformer/moe/grouped_gemm_util.py` Ops.gmm (--moe-grouped-gemm) against a loop over experts;
- MindSpeed-MM's MC2 expert-parallel grouped matmuls (`fsdp/ops/moe_ops/gemm_mc2.py` all2all_grouped_matmul and
  grouped_matmul_all2all, on 8 ranks) against every token through its expert on one rank.

Each runs on a forked rank that activates the emulation; skipped unless the three source trees are found.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mindspeed_flow.emulation.sources import Sources
from mindspeed_flow.utils.multiproc import run_ranks

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.timeout(600)]

T, H, I, E, K = 7, 5, 6, 4, 2
EMPTY_EXPERT = 2


def _setup(mode: str, paths: list[str]) -> None:
    """Activate the emulation and put the source trees first on sys.path."""
    from mindspeed_flow import emulation

    emulation.activate(mode=mode)
    sys.path[:0] = paths


def _routing() -> torch.Tensor:
    """[T, K] distinct expert ids per token, never EMPTY_EXPERT."""
    g = torch.Generator().manual_seed(0)
    used = torch.tensor([e for e in range(E) if e != EMPTY_EXPERT])
    return torch.stack([used[torch.randperm(len(used), generator=g)[:K]] for _ in range(T)])


def _skip_package_inits(mm_root: str) -> None:
    """Import MindSpeed-MM's op modules without running the packages' __init__, which apply process-wide FSDP and
    attention patches tied to one torch build."""
    for name in ("mindspeed_mm", "mindspeed_mm.fsdp", "mindspeed_mm.fsdp.ops"):
        package = types.ModuleType(name)
        package.__path__ = [str(Path(mm_root, *name.split(".")))]
        sys.modules[name] = package


def _fsdp_moe_ops_rank(rank: int, world_size: int, mode: str, paths: list[str], mm_root: str) -> str:
    _setup(mode, paths)
    _skip_package_inits(mm_root)
    import torch_npu
    from mindspeed_mm.fsdp.ops.moe_ops.gemm import grouped_matmul
    from mindspeed_mm.fsdp.ops.moe_ops.permute import permute
    from mindspeed_mm.fsdp.ops.moe_ops.unpermute import unpermute

    torch.manual_seed(1)
    leaves = (torch.randn(T, H), torch.randn(E, H, 2 * I), torch.randn(E, I, H), torch.softmax(torch.randn(T, K), -1))
    hidden, gate_up, down, probs = (t.to("npu").requires_grad_() for t in leaves)
    indices = _routing().to("npu")
    tokens_per_expert = torch.histc(indices, bins=E, min=0, max=E)

    def layer(fused: bool) -> torch.Tensor:
        permuted, row_map = permute(hidden, indices.to(torch.int32), fused=fused)
        inter = grouped_matmul(permuted, gate_up, tokens_per_expert, fused=fused)
        if fused:
            act = torch_npu.npu_swiglu(inter, dim=-1)
        else:
            a, b = inter.chunk(2, dim=-1)
            act = F.silu(a) * b
        return unpermute(grouped_matmul(act, down, tokens_per_expert, fused=fused), row_map, probs=probs, fused=fused)

    got, want = layer(True), layer(False)
    torch.testing.assert_close(got, want)
    params = (hidden, gate_up, down, probs)
    torch.testing.assert_close(torch.autograd.grad(got.square().sum(), params),
                               torch.autograd.grad(want.square().sum(), params))
    return got.device.type


def _routing_map_rank(rank: int, world_size: int, paths: list[str]) -> str:
    _setup("strict", paths)
    from megatron.core.transformer.moe.moe_utils import permute, unpermute
    from mindspeed.te.pytorch.permutation import MoePermuteMaskMap, MoeUnpermuteMaskMap

    torch.manual_seed(2)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, _routing(), True).to("npu")
    x = torch.randn(T, H, device="npu", requires_grad=True)
    probs = (torch.rand(T, E, device="npu") * mask).requires_grad_()
    w = torch.randn(H, H, device="npu")
    rows, row_probs, sorted_indices = MoePermuteMaskMap.apply(x, mask, probs, T * K, False)
    ref_rows, ref_probs, ref_indices = permute(x, mask, probs=probs, num_out_tokens=T * K)
    torch.testing.assert_close((rows, row_probs), (ref_rows, ref_probs))
    pairs = [  # probs on the permuted rows, and probs at unpermute
        (MoeUnpermuteMaskMap.apply((rows @ w) * row_probs.unsqueeze(-1), sorted_indices, x.shape, None, mask, False),
         unpermute((ref_rows @ w) * ref_probs.unsqueeze(-1), ref_indices, x.shape, routing_map=mask)),
        (MoeUnpermuteMaskMap.apply(rows @ w, sorted_indices, x.shape, probs, mask, False),
         unpermute(ref_rows @ w, ref_indices, x.shape, probs=probs, routing_map=mask)),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want)
        g_got = torch.autograd.grad(got.square().sum(), (x, probs), retain_graph=True)
        g_want = torch.autograd.grad(want.square().sum(), (x, probs), retain_graph=True)
        torch.testing.assert_close(g_got[0], g_want[0])
        torch.testing.assert_close(g_got[1] * mask, g_want[1] * mask)  # unrouted probs: zero here, any in Megatron
    return got.device.type


def _grouped_gemm_rank(rank: int, world_size: int, paths: list[str]) -> str:
    _setup("strict", paths)
    from mindspeed.core.transformer.moe.grouped_gemm_util import Ops

    torch.manual_seed(3)
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(int(counts.sum()), H, device="npu", requires_grad=True)
    w = torch.randn(E, H, I, device="npu", requires_grad=True)
    got = Ops.gmm(x, w, counts, trans_b=False)
    bounds = [0, *counts.cumsum(0).tolist()]
    want = torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(want, (x, w), grad))
    return got.device.type


EP, LOCAL = 8, 2  # the smallest documented MC2 ep_world_size


def _mc2_ep_rank(rank: int, world_size: int, paths: list[str], mm_root: str) -> str:
    _setup("strict", paths)
    _skip_package_inits(mm_root)
    from mindspeed_mm.fsdp.ops.moe_ops.gemm_mc2 import all2all_grouped_matmul, grouped_matmul_all2all

    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 3, (EP, EP * LOCAL), generator=g)  # [source rank, global expert], zeros included
    tokens = [torch.randn(int(counts[s].sum()), H, generator=g).bfloat16() for s in range(EP)]
    w1 = torch.randn(EP * LOCAL, H, I, generator=g).bfloat16()
    w2 = torch.randn(EP * LOCAL, I, H, generator=g).bfloat16()
    ref_x, ref_w1, ref_w2 = tokens[rank].float().requires_grad_(), w1.float().requires_grad_(), w2.float()
    ref = torch.cat([x @ ref_w1[e] @ ref_w2[e] for e, x in enumerate(ref_x.split(counts[rank].tolist()))])
    ref.sum().backward()
    group = dist.new_group(list(range(world_size)), backend="hccl")
    local = slice(rank * LOCAL, (rank + 1) * LOCAL)
    x = tokens[rank].to("npu").requires_grad_()
    lw1, lw2 = w1[local].to("npu").requires_grad_(), w2[local].to("npu")
    send = counts[rank].to("npu")  # as ep_dispatcher.py hands them: tensors on the device
    recv = counts[:, local].reshape(-1).to("npu")
    hidden = all2all_grouped_matmul(x, lw1, group, send, recv)
    out = grouped_matmul_all2all(hidden, lw2, group, recv, send)
    out.sum().backward()
    full_dw1 = ref_w1.grad.to("npu")  # a rank's expert weights get every rank's tokens' gradient: sum them
    dist.all_reduce(full_dw1, group=group)
    loose = {"rtol": 0.05, "atol": 0.1}  # bfloat16 operands
    torch.testing.assert_close(out.float().cpu(), ref.detach(), **loose)
    torch.testing.assert_close(x.grad.float().cpu(), ref_x.grad, **loose)
    torch.testing.assert_close(lw1.grad.float().cpu(), full_dw1[local].cpu(), **loose)
    return out.device.type


@pytest.mark.parametrize("mode, device", [("strict", "npu"), ("lenient", "cpu")])
def test_mindspeed_mm_fsdp_moe_ops_fused_equal_eager(mm_sources: Sources, mode: str, device: str) -> None:
    assert run_ranks(_fsdp_moe_ops_rank, 1, mode, mm_sources.pythonpath(), str(mm_sources.mindspeed_mm.root),
                     timeout_s=300) == [device]


def test_mindspeed_routing_map_permute_equals_megatron(mm_sources: Sources) -> None:
    assert run_ranks(_routing_map_rank, 1, mm_sources.pythonpath(), timeout_s=300) == ["npu"]


def test_mindspeed_grouped_gemm_equals_expert_loop(mm_sources: Sources) -> None:
    assert run_ranks(_grouped_gemm_rank, 1, mm_sources.pythonpath(), timeout_s=300) == ["npu"]


def test_mindspeed_mm_mc2_expert_parallel_equals_one_rank(mm_sources: Sources) -> None:
    assert run_ranks(_mc2_ep_rank, EP, mm_sources.pythonpath(), str(mm_sources.mindspeed_mm.root),
                     timeout_s=300) == ["npu"] * EP
