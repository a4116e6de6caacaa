"""The multi-rank harness itself: results come back by rank, and a failing rank is named."""
import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.utils.multiproc import RankFailure, run_ranks


def _allreduce(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _boom(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded")


def test_results_by_rank():
    assert run_ranks(_allreduce, 3, timeout_s=30) == [6.0, 6.0, 6.0]


def test_failure_names_rank():
    with pytest.raises(RankFailure, match="rank 1"):
        run_ranks(_boom, 2, timeout_s=20)
