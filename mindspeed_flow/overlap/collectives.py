"""Row-wise all-gather and reduce-scatter over a tensor-parallel group, portable across torch versions and backends.

The overlap layer needs exactly two collectives on dim 0: all-gather (rank-major concatenation of equal shards)
and sum reduce-scatter (the inverse). torch renamed them between releases (`all_gather_into_tensor` /
`reduce_scatter_tensor` on torch 2.7, `all_gather_single` / `reduce_scatter_single` on newer releases, where the
old names warn; `torch_compat.dist_fn` picks the one present), and gloo on older torch could not reduce-scatter
at all, which is handled here.

Every helper can run asynchronously and returns a handle with `.wait()`; on a backend whose reduce-scatter
raises, the sum is done with `all_reduce` and the caller's rows are copied out when the handle is waited on. The
module keeps no state: the caller (the part's `OverlapContext`) remembers that a group lacks reduce-scatter and asks
for the fallback directly from then on.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from mindspeed_flow.torch_compat import dist_fn

log = logging.getLogger(__name__)

class Waitable(Protocol):
    def wait(self) -> Any: ...


class _Done:
    """Handle for work that already finished (a blocking call, or a group of one)."""

    def wait(self) -> bool:
        return True


class _InFlight:
    """An async collective plus the tensors it reads and writes: the caller may drop its own references (a chunk's
    temporary matmul result, say) before waiting, and the buffers must outlive the transfer."""

    def __init__(self, work: Waitable, *tensors: torch.Tensor) -> None:
        self._work, self._tensors = work, tensors

    def wait(self) -> bool:
        self._work.wait()
        self._tensors = ()
        return True


class _AllReduceThenCopy:
    """Reduce-scatter emulated by all_reduce: the copy of this rank's rows must wait for the sum to land."""

    def __init__(self, work: Optional[Waitable], summed: torch.Tensor, out: torch.Tensor, rank: int) -> None:
        self._work, self._summed, self._out, self._rank = work, summed, out, rank

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        rows = self._out.shape[0]
        self._out.copy_(self._summed[self._rank * rows:(self._rank + 1) * rows])
        return True


def default_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """`group`, or the default (world) group when None, so callers can key caches on a real object."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup],
                    async_op: bool = False) -> Waitable:
    """out[r * m:(r + 1) * m] = inp of rank r, for `inp` of m rows; `out` must be contiguous with world * m rows."""
    world = dist.get_world_size(group)
    if out.shape[0] != inp.shape[0] * world or out.shape[1:] != inp.shape[1:]:
        raise ValueError(f"all_gather_rows: output {tuple(out.shape)} is not {world} x input {tuple(inp.shape)}"
                         " stacked on dim 0")
    if world == 1:
        out.copy_(inp)
        return _Done()
    inp = inp.contiguous()
    work = dist_fn("all_gather_single", "all_gather_into_tensor")(out, inp, group=group, async_op=async_op)
    return _InFlight(work, out, inp) if async_op else _Done()


def reduce_scatter_rows(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup],
                        async_op: bool = False, via_all_reduce: bool = False,
                        on_unsupported: Optional[Callable[[str], None]] = None) -> Waitable:
    """out = (sum over ranks of inp)[r * m:(r + 1) * m] on rank r, for `out` of m rows and `inp` of world * m.

    `via_all_reduce=True` forces the fallback (all_reduce of a copy, then this rank's rows), which moves twice
    the bytes. When the backend's reduce-scatter raises, the fallback is taken and `on_unsupported(reason)` tells
    the caller, so it can pass `via_all_reduce=True` from then on instead of raising (and logging) every step.
    """
    world = dist.get_world_size(group)
    if inp.shape[0] != out.shape[0] * world or out.shape[1:] != inp.shape[1:]:
        raise ValueError(f"reduce_scatter_rows: input {tuple(inp.shape)} is not {world} x output "
                         f"{tuple(out.shape)} stacked on dim 0")
    if world == 1:
        out.copy_(inp)
        return _Done()
    if not via_all_reduce:
        try:
            inp = inp.contiguous()
            work = dist_fn("reduce_scatter_single", "reduce_scatter_tensor")(out, inp, group=group,
                                                                              async_op=async_op)
            return _InFlight(work, out, inp) if async_op else _Done()
        except (RuntimeError, NotImplementedError) as err:
            # Old gloo raised here (sync or async); every rank of the group raises alike, so all take the
            # fallback together and the collective sequence stays matched.
            if on_unsupported is not None:
                on_unsupported(str(err))
            log.warning("reduce-scatter unsupported on backend %s (%s); using all_reduce + chunk",
                        dist.get_backend(group), err)
    summed = inp.clone()  # all_reduce is in place; the caller's input must stay intact for autograd
    work = dist.all_reduce(summed, group=group, async_op=async_op)
    handle = _AllReduceThenCopy(work if async_op else None, summed, out, dist.get_rank(group))
    if not async_op:
        handle.wait()
        return _Done()
    return handle
