"""Tensor-parallel linears whose collectives overlap the matmuls, with and without sequence parallelism.

With sequence parallelism (kinds "column" / "row"; activations outside the TP region are sequence shards):
Column-parallel (W is the local [out/tp, in] shard, x the local [m, in] sequence shard):
    out = all_gather(x) @ W^T            grad_x = reduce_scatter(grad_out @ W), grad_W = grad_out^T @ all_gather(x)
Row-parallel (W is the local [out, in/tp] shard, x the full-sequence [tp * m, in/tp] activation):
    out = reduce_scatter(x @ W^T)        grad_x = all_gather(grad_out) @ W,     grad_W = all_gather(grad_out)^T @ x
Without it (kinds "column_allreduce" / "row_allreduce"; activations outside the TP region are replicated):
    column: out = x @ W^T                grad_x = all_reduce(grad_out @ W)  (overlapped with grad_W's matmul)
    row:    out = all_reduce(x @ W^T)    grad_x = grad_out @ W

Three implementations compute the same thing, chosen per call by `OverlapContext.select`:
- "mc2": torch_npu's fused all-gather+matmul / matmul+reduce-scatter (HCCL, Ascend only, dtype/shape limits);
- "chunked": the rows are split into chunks whose async collectives run while earlier chunks multiply
  (MindSpeed's script-level CoC; any backend, gloo included);
- "plain": blocking collective, then one matmul (the reference, and the choice for tiny inputs).
Bias is always added outside the fused op (MC2 requires bias=None).

torch_npu is never imported here: the mc2 path is considered only when something else (the accelerator probe,
or the CPU emulation) already imported it. Nothing is cached at module level: every cache (communicator names, the
MC2 domain, reasons already logged, a group's missing reduce-scatter) lives on the `OverlapContext` the model part
owns.
"""
from __future__ import annotations

import logging
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mindspeed_flow.overlap import mc2_api
from mindspeed_flow.overlap.collectives import Waitable, all_gather_rows, default_group, reduce_scatter_rows

log = logging.getLogger(__name__)

IMPLS = ("mc2", "chunked", "plain")
KINDS = ("column", "row", "column_allreduce", "row_allreduce")
MC2_DTYPES = mc2_api.DTYPES
MC2_K_RANGE = mc2_api.K_RANGE  # k in [256, 65535): op-plugin docs for AllGatherMatmul / MatmulReduceScatter
MC2_WORLDS_A2 = (2, 4, 8)  # A2: HCCS full mesh inside one server
MC2_WORLDS_A3 = mc2_api.WORLD_SIZES  # A3 "double ring"
MC2_OPS = ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base")
MC2_ALLREDUCE_OP = "npu_mm_all_reduce_base"


# ------------------------------------------------------------------------------------------------ context
class OverlapContext:
    """What one model part's TP linears share: the TP group, the default implementation and chunk count, the HCCL
    communicator names, the one MC2 communication domain, and the selection reasons already logged.

    The part owns it (one per TP group), so two parts in one process, or two tests, never share caches. All MC2 ops
    of one model must share a communicator (op docs): the first group that runs MC2 claims the domain and other
    groups fall back to "chunked" instead of failing inside HCCL.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, impl: str = "auto", chunks: int = 2,
                 announce: Optional[Callable[[str], None]] = None) -> None:
        """`announce`: also called with each selection line (e.g. a launcher's print on one rank of the part)."""
        _check_impl(impl)
        if chunks < 1:
            raise ValueError(f"overlap chunks={chunks}: must be >= 1")
        self.group, self.impl, self.chunks, self.announce = group, impl, chunks, announce
        self.domain: Optional[str] = None
        self._names: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
        self._logged: set[tuple] = set()
        # Set once the backend's reduce-scatter raised on this group (old gloo): later calls use the fallback.
        self.reduce_scatter_unsupported: Optional[str] = None

    def mesh(self, device_type: str) -> Any:
        """A one-dimensional DeviceMesh over the TP group (for DTensor views of the shards, e.g. checkpoints)."""
        if getattr(self, "_mesh", None) is None:
            self._mesh = DeviceMesh.from_group(default_group(self.group), device_type)
        return self._mesh

    def mark_reduce_scatter_unsupported(self, reason: str) -> None:
        self.reduce_scatter_unsupported = reason

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def hccl_name(self, group: Optional[dist.ProcessGroup] = None) -> str:
        """The group's HCCL communicator name, as MindSpeed gets it: from the group's NPU backend, for this
        process's *global* rank (the documented `get_hccl_comm_name(rankid)` takes the global rank)."""
        group = default_group(group if group is not None else self.group)
        if group not in self._names:
            global_rank = dist.get_global_rank(group, dist.get_rank(group))
            get_backend = getattr(group, "_get_backend", None)
            # torch > 2.0.1 keeps the HCCL backend behind _get_backend; older torch_npu put the method on the group.
            holder = get_backend(torch.device("npu")) if get_backend is not None else group
            self._names[group] = holder.get_hccl_comm_name(global_rank)
        return self._names[group]

    def claim(self, name: str) -> None:
        if self.domain is None:
            self.domain = name

    def mc2_rejections(self, x: torch.Tensor, weight: torch.Tensor, kind: str = "column") -> list[str]:
        """Why the MC2 fused ops cannot run this call (empty list: they can)."""
        reasons = _static_mc2_rejections(x, weight, self.group, kind)
        if reasons:
            return reasons
        try:
            name = self.hccl_name()
        except Exception as err:  # noqa: BLE001 - a group without an HCCL backend is a reason, not a crash
            return [f"no HCCL communicator for the group ({err})"]
        if self.domain is not None and name != self.domain:
            return [f"communicator {name} differs from the MC2 domain {self.domain} already in use"]
        return []

    def explain(self, x: torch.Tensor, weight: torch.Tensor, kind: str = "column", impl: Optional[str] = None,
                chunks: Optional[int] = None) -> tuple[str, list[str]]:
        """(implementation, why the better ones were not taken). `impl="mc2"` raises when MC2 cannot run."""
        requested = self.impl if impl is None else impl
        chunks = self.chunks if chunks is None else chunks
        _check_impl(requested)
        if kind not in KINDS:
            raise ValueError(f"overlap kind {kind!r}: expected one of {', '.join(KINDS)}")
        if requested in ("chunked", "plain"):
            return requested, [f"{requested} requested"]
        rejected = self.mc2_rejections(x, weight, kind)
        if requested == "mc2" and kind == "column_allreduce":
            # No fused op exists for this kind at all: "mc2" for a model means MC2 wherever an op exists.
            return "chunked", rejected
        if requested == "mc2":
            if rejected:
                raise ValueError("overlap impl 'mc2' requested but unusable: " + "; ".join(rejected))
            return "mc2", []
        if not rejected:
            return "mc2", []
        world = self.world
        rows = _local_rows(x, kind, world)
        if world == 1 or chunks < 2 or rows < chunks:
            # Nothing to overlap with a single chunk or without communication; chunking would only add launches.
            return "plain", rejected + [f"plain: world={world}, chunks={chunks}, rows per rank={rows}"]
        return "chunked", rejected

    def select(self, x: torch.Tensor, weight: torch.Tensor, kind: str = "column", impl: Optional[str] = None,
               chunks: Optional[int] = None) -> str:
        """The implementation to run; logs (once per distinct set of reasons) why mc2 or chunking was rejected."""
        chosen, reasons = self.explain(x, weight, kind, impl, chunks)
        # Keyed on the reasons, not the shape: packed batches change m every step and would log every step.
        key = (kind, self.impl if impl is None else impl, chosen, tuple(reasons))
        if key not in self._logged:
            self._logged.add(key)
            line = (f"overlap {kind} linear x{tuple(x.shape)} w{tuple(weight.shape)} "
                    f"{str(x.dtype).replace('torch.', '')}: {chosen}" + (f" ({'; '.join(reasons)})" if reasons else ""))
            log.info(line)
            if self.announce is not None:
                self.announce(line)
        return chosen


def _check_impl(impl: str) -> None:
    if impl not in IMPLS + ("auto",):
        raise ValueError(f"overlap impl {impl!r}: expected one of auto, {', '.join(IMPLS)}")


def _torch_npu() -> Any:
    """The torch_npu module if something already imported it, else None (importing it without CANN breaks)."""
    return sys.modules.get("torch_npu")


def _is_a3() -> bool:
    try:
        name = str(torch.npu.get_device_name())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - no device name means we cannot claim A3's larger worlds
        return False
    return "910_93" in name or "910C" in name


def _mc2_op_ks(x: torch.Tensor, weight: torch.Tensor, kind: str) -> list[int]:
    """The contraction sizes the MC2 ops would see: column forward x@W^T (in); row forward x@W^T (in/tp) and
    row backward all_gather(grad_out)@W (out). The column backward is a plain matmul + async reduce-scatter."""
    return [x.shape[-1]] if kind == "column" else [x.shape[-1], weight.shape[0]]


def _static_mc2_rejections(x: torch.Tensor, weight: torch.Tensor, group: Optional[dist.ProcessGroup],
                           kind: str) -> list[str]:
    """The MC2 limits that depend only on the call (module, device, dtype, shapes, world size)."""
    torch_npu = _torch_npu()
    if torch_npu is None:
        return ["torch_npu is not imported (MC2 needs Ascend + CANN)"]
    if kind == "column_allreduce":
        # Its only communication is the backward all-reduce of grad x, which no fused op covers; MindSpeed, too,
        # runs MC2 only on the sequence-parallel path.
        return ["no MC2 op fuses the replicated-input column backward (all-reduce of grad x)"]
    if kind == "row_allreduce":
        return _allreduce_mc2_rejections(torch_npu, x, weight)
    reasons = [f"torch_npu has no {op}" for op in MC2_OPS if not hasattr(torch_npu, op)]
    # The CPU emulation's "npu" tensors live on the host; a real torch_npu needs them on the device.
    if x.device.type != "npu" and not getattr(torch_npu, "EMULATED", False):
        reasons.append(f"input is on {x.device.type}, not npu")
    if x.dtype not in MC2_DTYPES or weight.dtype != x.dtype:
        reasons.append(f"dtypes {x.dtype}/{weight.dtype}: MC2 takes float16 or bfloat16 for both")
    for k in _mc2_op_ks(x, weight, kind):
        if not MC2_K_RANGE[0] <= k < MC2_K_RANGE[1]:
            reasons.append(f"k={k} outside [{MC2_K_RANGE[0]}, {MC2_K_RANGE[1]})")
    world = dist.get_world_size(group)
    rows = x.numel() // max(1, x.shape[-1])
    if kind == "row" and rows % world:
        reasons.append(f"m={rows} not divisible by world size {world}")
    worlds = MC2_WORLDS_A3 if _is_a3() else MC2_WORLDS_A2
    if world not in worlds:
        reasons.append(f"world size {world} not in {worlds}")
    return reasons


def _allreduce_mc2_rejections(torch_npu: Any, x: torch.Tensor, weight: torch.Tensor) -> list[str]:
    """npu_mm_all_reduce_base (matmul + all-reduce): fp16/bf16, and documented for Atlas A2 only."""
    reasons = [] if hasattr(torch_npu, MC2_ALLREDUCE_OP) else [f"torch_npu has no {MC2_ALLREDUCE_OP}"]
    if x.device.type != "npu" and not getattr(torch_npu, "EMULATED", False):
        reasons.append(f"input is on {x.device.type}, not npu")
    if x.dtype not in MC2_DTYPES or weight.dtype != x.dtype:
        reasons.append(f"dtypes {x.dtype}/{weight.dtype}: MC2 takes float16 or bfloat16 for both")
    if _is_a3():
        reasons.append(f"{MC2_ALLREDUCE_OP} is documented for Atlas A2 only")
    return reasons


def _local_rows(x: torch.Tensor, kind: str, world: int) -> int:
    """Rows each chunked step splits: the local rows, or one rank's output share for the SP row kind."""
    rows = x.numel() // max(1, x.shape[-1])
    return rows // world if kind == "row" else rows


# ------------------------------------------------------------------------------------------------ kernels
@dataclass(frozen=True)
class _Plan:
    """What one call runs: implementation, chunk count, group, world size (and the HCCL name for mc2)."""

    impl: str
    chunks: int
    group: Optional[dist.ProcessGroup]
    world: int
    hcom: Optional[str] = None
    ctx: Optional["OverlapContext"] = None

    def mc2_op(self, name: str) -> Any:
        """torch_npu's fused op, checked against its documented prototype and rules on every call."""
        return mc2_api.checked(name, getattr(_torch_npu(), name), self.hcom, self.world)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> Waitable:
        """reduce_scatter_rows on this plan's group, with the fallback the part's context already knows it needs."""
        known = self.ctx is not None and self.ctx.reduce_scatter_unsupported is not None
        return reduce_scatter_rows(out, inp, self.group, async_op=async_op, via_all_reduce=known,
                                   on_unsupported=None if self.ctx is None else
                                   self.ctx.mark_reduce_scatter_unsupported)


def _chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """Near-equal [start, end) row ranges; uneven splits are fine since every rank has the same row count."""
    n = max(1, min(chunks, rows))
    step = math.ceil(rows / n)
    return [(s, min(s + step, rows)) for s in range(0, rows, step)] or [(0, 0)]


def _gather_matmul(a: torch.Tensor, b: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(a) @ b, all_gather(a)) for local a [m, k] and b [k, n]; rank-major rows in both."""
    m, k = a.shape
    if plan.impl == "mc2":
        op = plan.mc2_op("npu_all_gather_base_mm")
        out, gathered = op(a.contiguous(), b, plan.hcom, plan.world, bias=None, gather_index=0, gather_output=True)
        return out, gathered
    if plan.impl == "plain":
        gathered = a.new_empty(plan.world * m, k)
        all_gather_rows(gathered, a, plan.group)
        return gathered @ b, gathered
    # Communicate first: every chunk's gather is in flight before the first matmul, so chunk i multiplies while
    # chunks i+1.. are still on the wire. Each buffer is chunk-major; writing it into [world, m, :] views puts
    # the rows back in rank-major order without a separate permute. On NCCL/HCCL an async collective runs on the
    # backend's communication stream and wait() only orders the compute stream after it, so no side stream is
    # needed here; on gloo it runs on gloo's host threads.
    bounds = _chunk_bounds(m, plan.chunks)
    bufs = [a.new_empty(plan.world * (e - s), k) for s, e in bounds]
    works = [all_gather_rows(buf, a[s:e], plan.group, async_op=True) for buf, (s, e) in zip(bufs, bounds)]
    gathered = a.new_empty(plan.world, m, k)
    out = a.new_empty(plan.world, m, b.shape[1])
    for buf, work, (s, e) in zip(bufs, works, bounds):
        work.wait()
        out[:, s:e] = (buf @ b).view(plan.world, e - s, -1)
        gathered[:, s:e] = buf.view(plan.world, e - s, k)
    return out.view(plan.world * m, -1), gathered.view(plan.world * m, k)


def _matmul_scatter_start(a: torch.Tensor, b: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, list[Waitable]]:
    """Start reduce_scatter(a @ b) for a [world * m, k]; returns the [m, n] output and the handles to wait on
    before reading it (the caller can compute something else meanwhile)."""
    rows, k = a.shape
    if rows % plan.world:
        raise ValueError(f"reduce-scatter over {plan.world} ranks: {rows} rows is not a multiple of the world size")
    m = rows // plan.world
    if plan.impl == "mc2":
        op = plan.mc2_op("npu_mm_reduce_scatter_base")
        out = op(a.contiguous(), b, plan.hcom, plan.world, reduce_op="sum", bias=None)
        return out, []
    out = a.new_empty(m, b.shape[1])
    if plan.impl == "plain":
        plan.reduce_scatter(out, a @ b)
        return out, []
    # Compute first: chunk i's reduce-scatter runs while chunk i+1 multiplies. Chunk i takes rows [s, e) of
    # every rank's block, so its scatter lands in rows [s, e) of this rank's output.
    blocks = a.view(plan.world, m, k)
    works = []
    for s, e in _chunk_bounds(m, plan.chunks):
        partial = blocks[:, s:e].reshape(-1, k) @ b
        works.append(plan.reduce_scatter(out[s:e], partial, async_op=True))
    return out, works


def _matmul_scatter(a: torch.Tensor, b: torch.Tensor, plan: _Plan) -> torch.Tensor:
    out, works = _matmul_scatter_start(a, b, plan)
    for work in works:
        work.wait()
    return out


def _backward_scatter_plan(plan: _Plan) -> _Plan:
    """The column backward's reduce-scatter: MC2 would serialise it with the weight-gradient matmul, so (as
    MindSpeed does) it runs as one async collective that the weight gradient overlaps instead."""
    if plan.impl != "mc2":
        return plan
    return _Plan("chunked", 1, plan.group, plan.world, ctx=plan.ctx)


def _matmul_allreduce(a: torch.Tensor, b: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """all_reduce(a @ b) over the TP group, for a [m, k] and b [k, n]."""
    if plan.impl == "mc2":
        return plan.mc2_op(MC2_ALLREDUCE_OP)(a.contiguous(), b, plan.hcom, reduce_op="sum", bias=None)
    if plan.impl == "plain":
        out = a @ b
        dist.all_reduce(out, group=plan.group)
        return out
    # Chunk i's all-reduce runs while chunk i+1 multiplies; each chunk is a contiguous row block of `out`.
    out = a.new_empty(a.shape[0], b.shape[1])
    works = []
    for s, e in _chunk_bounds(a.shape[0], plan.chunks):
        torch.matmul(a[s:e], b, out=out[s:e])
        works.append(dist.all_reduce(out[s:e], group=plan.group, async_op=True))
    for work in works:
        work.wait()
    return out


class _ColumnParallel(torch.autograd.Function):
    """Replicated input, column-sharded weight: no forward communication; grad x is all-reduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, plan: _Plan) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.plan = plan
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        plan, grad_out = ctx.plan, grad_out.contiguous()
        grad_x, work = None, None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ weight
            # chunked: the all-reduce of grad x is in flight while grad W multiplies (MindSpeed's order too)
            work = dist.all_reduce(grad_x, group=plan.group, async_op=plan.impl != "plain")
        grad_w = grad_out.t() @ x if ctx.needs_input_grad[1] else None
        if work is not None and plan.impl != "plain":
            work.wait()
        return grad_x, grad_w, None


class _RowParallel(torch.autograd.Function):
    """Input sharded on features, row-sharded weight: the partial products are all-reduced in forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, plan: _Plan) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _matmul_allreduce(x, weight.t(), plan)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # replicated on every TP rank: no communication
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_out.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class _ColumnParallelSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, plan: _Plan) -> torch.Tensor:
        out, gathered = _gather_matmul(x, weight.t(), plan)
        # The gathered input is kept for grad_W (world x the local activation) instead of gathering it again.
        ctx.save_for_backward(gathered, weight)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        gathered, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x, works = None, []
        if ctx.needs_input_grad[0]:
            grad_x, works = _matmul_scatter_start(grad_out, weight, _backward_scatter_plan(ctx.plan))
        grad_w = grad_out.t() @ gathered if ctx.needs_input_grad[1] else None  # overlaps the scatter
        for work in works:
            work.wait()
        return grad_x, grad_w, None


class _RowParallelSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, plan: _Plan) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.plan = plan
        return _matmul_scatter(x, weight.t(), plan)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        grad_x, grad_full = _gather_matmul(grad_out.contiguous(), weight, ctx.plan)
        grad_w = grad_full.t() @ x if ctx.needs_input_grad[1] else None
        return (grad_x if ctx.needs_input_grad[0] else None), grad_w, None


# ------------------------------------------------------------------------------------------------ functional
def _plan(x2d: torch.Tensor, weight: torch.Tensor, ctx: OverlapContext, impl: Optional[str], kind: str,
          chunks: Optional[int]) -> _Plan:
    chosen = ctx.select(x2d, weight, kind, impl, chunks)
    hcom = None
    if chosen == "mc2":
        hcom = ctx.hccl_name()
        ctx.claim(hcom)
    return _Plan(chosen, ctx.chunks if chunks is None else chunks, ctx.group, ctx.world, hcom, ctx)


def column_parallel_linear_sp(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                              ctx: OverlapContext, impl: Optional[str] = None,
                              chunks: Optional[int] = None) -> torch.Tensor:
    """all_gather(x, dim 0) @ weight^T + bias; x [s/tp, ..., in] -> [s, ..., out/tp] with weight [out/tp, in].

    The TP group, default implementation and chunk count come from `ctx`; `impl` / `chunks` override them."""
    _check_linear_shapes("column-parallel", x, weight, "[out/tp, in]")
    x2d = x.reshape(-1, x.shape[-1])
    plan = _plan(x2d, weight, ctx, impl, "column", chunks)
    out = _ColumnParallelSP.apply(x2d, weight, plan)
    if bias is not None:
        out = out + bias
    return out.view(x.shape[0] * plan.world, *x.shape[1:-1], weight.shape[0])


def row_parallel_linear_sp(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                           ctx: OverlapContext, impl: Optional[str] = None,
                           chunks: Optional[int] = None) -> torch.Tensor:
    """reduce_scatter(x @ weight^T, dim 0) + bias; x [s, ..., in/tp] -> [s/tp, ..., out], weight [out, in/tp]."""
    world = ctx.world
    _check_linear_shapes("row-parallel", x, weight, "[out, in/tp]")
    if x.shape[0] % world:
        raise ValueError(f"row-parallel linear: sequence dim {x.shape[0]} of x {tuple(x.shape)} is not a "
                         f"multiple of the tensor-parallel size {world} (reduce-scatter splits it)")
    x2d = x.reshape(-1, x.shape[-1])
    plan = _plan(x2d, weight, ctx, impl, "row", chunks)
    out = _RowParallelSP.apply(x2d, weight, plan)
    if bias is not None:
        out = out + bias
    return out.view(x.shape[0] // world, *x.shape[1:-1], weight.shape[0])


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                           ctx: OverlapContext, impl: Optional[str] = None) -> torch.Tensor:
    """x @ weight^T + bias on a replicated input; x [..., in] -> [..., out/tp] with weight [out/tp, in]."""
    _check_linear_shapes("column-parallel", x, weight, "[out/tp, in]")
    x2d = x.reshape(-1, x.shape[-1])
    plan = _plan(x2d, weight, ctx, impl, "column_allreduce", None)
    out = _ColumnParallel.apply(x2d, weight, plan)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                        ctx: OverlapContext, impl: Optional[str] = None, chunks: Optional[int] = None) -> torch.Tensor:
    """all_reduce(x @ weight^T) + bias; x [..., in/tp] -> [..., out] replicated, weight [out, in/tp]."""
    _check_linear_shapes("row-parallel", x, weight, "[out, in/tp]")
    x2d = x.reshape(-1, x.shape[-1])
    plan = _plan(x2d, weight, ctx, impl, "row_allreduce", chunks)
    out = _RowParallel.apply(x2d, weight, plan)
    if bias is not None:
        out = out + bias  # once, after the reduction
    return out.view(*x.shape[:-1], weight.shape[0])


def _check_linear_shapes(what: str, x: torch.Tensor, weight: torch.Tensor, layout: str) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{what} linear: x {tuple(x.shape)} last dim != weight {tuple(weight.shape)} dim 1 "
                         f"(weight is the local {layout} shard)")


# ------------------------------------------------------------------------------------------------ modules
TP_DIM_ATTR = "tensor_parallel_dim"  # on a parameter: the dim it is sharded along over the TP group (absent: replicated)
TP_FUSED_ATTR = "tensor_parallel_fused"  # how many projections a column shard stacks (a ViT's fused qkv: 3)
TP_CTX_ATTR = "tensor_parallel_context"  # the OverlapContext (TP group) a parallel linear's parameters belong to


def local_shard(full: torch.Tensor, dim: int, rank: int, world: int, fused: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of a dense tensor split along `dim` over `world` ranks; with `fused` > 1 (dim 0 only)
    each of the stacked projections is split on its own (rank r gets q_r|k_r|v_r)."""
    if fused > 1:
        if dim != 0:
            raise ValueError("fused projections are split along dim 0 only")
        parts = full.reshape(fused, full.shape[0] // fused, *full.shape[1:])
        return parts.chunk(world, dim=1)[rank].reshape(-1, *full.shape[1:])
    return full.chunk(world, dim=dim)[rank]


def shard_of(full: torch.Tensor, param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The shard of `full` (a dense tensor shaped like the unsplit parameter) that `param` holds on `rank`."""
    dim = getattr(param, TP_DIM_ATTR, None)
    if dim is None:
        return full
    return local_shard(full, dim, rank, world, getattr(param, TP_FUSED_ATTR, 1))


def checkpoint_tensor(param: nn.Parameter, tensor: torch.Tensor
                      ) -> tuple[torch.Tensor, Optional[Callable[[], None]]]:
    """What a checkpoint stores for `tensor` (a parameter's data, or an optimizer moment shaped like it), and
    what to run once a load has filled it in.

    A TP shard is stored as a DTensor view over the TP group, so DCP writes the whole tensor under the same key
    as a tp=1 run and loads it back resharded to any TP size, in place. A fused projection's shard (q_r|k_r|v_r)
    is not a slice DTensor can describe: it is gathered to the dense tensor (a ViT's qkv: small) and its shard
    copied back after a load.
    """
    dim = getattr(param, TP_DIM_ATTR, None)
    ctx = getattr(param, TP_CTX_ATTR, None)
    if dim is None or ctx is None or ctx.world == 1:
        return tensor, None
    fused = getattr(param, "tensor_parallel_fused", 1)
    if fused == 1:
        return DTensor.from_local(tensor, ctx.mesh(tensor.device.type), [Shard(dim)], run_check=False), None
    world, rank = ctx.world, dist.get_rank(ctx.group)
    pieces = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(pieces, tensor.contiguous(), group=ctx.group)
    rows = tensor.shape[0] // fused
    # piece r stacks q_r|k_r|v_r: regroup as q_0..q_{tp-1} | k_0.. | v_0.. (the dense layout)
    dense = torch.stack([p.reshape(fused, rows, *tensor.shape[1:]) for p in pieces], dim=1)
    dense = dense.reshape(fused * world * rows, *tensor.shape[1:]).contiguous()

    def copy_back() -> None:
        with torch.no_grad():
            tensor.copy_(local_shard(dense, 0, rank, world, fused))

    return dense, copy_back


class _ParallelLinear(nn.Module):
    """Shared parameter handling; subclasses decide the shard shapes and the function applied.

    Sharded parameters carry `tensor_parallel_dim` (the dim split over the TP group), so the gradient norm counts
    them once per shard and checkpoints can save them as shards of one tensor.
    """

    column: bool  # True: weight rows (output features) are split; False: weight columns (input features)

    def __init__(self, in_features: int, out_features: int, ctx: OverlapContext, bias: bool, impl: Optional[str],
                 chunks: Optional[int], dtype: Optional[torch.dtype], device: Optional[torch.device]) -> None:
        super().__init__()
        if impl is not None:
            _check_impl(impl)
        world = ctx.world
        split = out_features if self.column else in_features
        if split % world:
            raise ValueError(f"{type(self).__name__}: {'out' if self.column else 'in'}_features={split} not "
                             f"divisible by tp={world}")
        self.ctx, self.impl, self.chunks = ctx, impl, chunks
        self.in_features, self.out_features = in_features, out_features
        shape = (out_features // world, in_features) if self.column else (out_features, in_features // world)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        setattr(self.weight, TP_DIM_ATTR, 0 if self.column else 1)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(shape[0], dtype=dtype, device=device))
            if self.column:
                setattr(self.bias, TP_DIM_ATTR, 0)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    @classmethod
    def from_linear(cls, linear: nn.Linear, ctx: OverlapContext, *, fused: int = 1, impl: Optional[str] = None,
                    chunks: Optional[int] = None) -> "_ParallelLinear":
        """This rank's shard of a dense `nn.Linear` (same dtype and device).

        `fused` > 1 (column only): the weight stacks that many projections (a ViT's fused qkv); each is split on
        its own, so rank r holds q_r, k_r, v_r rather than a slice across the q|k|v boundary.
        """
        out_features, in_features = linear.weight.shape
        if fused > 1 and not cls.column:
            raise ValueError("fused projections can only be split column-wise")
        if out_features % fused:
            raise ValueError(f"{cls.__name__}.from_linear: out_features={out_features} is not {fused} fused parts")
        w = linear.weight
        mod = cls(in_features, out_features, ctx, bias=linear.bias is not None, impl=impl, chunks=chunks,
                  dtype=w.dtype, device=w.device)
        world, rank = ctx.world, dist.get_rank(ctx.group)
        for p in mod.parameters():  # checkpoints find the group (and its mesh) of a shard through it
            setattr(p, TP_CTX_ATTR, ctx)
        if fused > 1:
            setattr(mod.weight, TP_FUSED_ATTR, fused)
            if mod.bias is not None:
                setattr(mod.bias, TP_FUSED_ATTR, fused)
        with torch.no_grad():
            mod.weight.copy_(shard_of(w, mod.weight, rank, world))
            if linear.bias is not None:
                mod.bias.copy_(shard_of(linear.bias, mod.bias, rank, world))
        mod.weight.requires_grad_(w.requires_grad)  # a frozen layer stays frozen
        if linear.bias is not None:
            mod.bias.requires_grad_(linear.bias.requires_grad)
        return mod

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, shard={tuple(self.weight.shape)}, " \
               f"bias={self.bias is not None}, impl={self.impl or self.ctx.impl}, " \
               f"chunks={self.chunks or self.ctx.chunks}"


class ColumnParallelLinear(_ParallelLinear):
    """Column-parallel linear on a replicated input: [..., in] -> [..., out/tp]; weight shard [out/tp, in]."""

    column = True

    def __init__(self, in_features: int, out_features: int, ctx: OverlapContext, bias: bool = True,
                 impl: Optional[str] = None, chunks: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(in_features, out_features, ctx, bias, impl, chunks, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, ctx=self.ctx, impl=self.impl)


class RowParallelLinear(_ParallelLinear):
    """Row-parallel linear producing a replicated output: [..., in/tp] -> [..., out]; weight shard [out, in/tp],
    full bias (added once, after the all-reduce; its gradient is the same on every TP rank)."""

    column = False

    def __init__(self, in_features: int, out_features: int, ctx: OverlapContext, bias: bool = True,
                 impl: Optional[str] = None, chunks: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(in_features, out_features, ctx, bias, impl, chunks, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, ctx=self.ctx, impl=self.impl, chunks=self.chunks)


class ColumnParallelLinearSP(ColumnParallelLinear):
    """Column-parallel linear on a sequence-parallel input: [s/tp, ..., in] -> [s, ..., out/tp].

    Holds the local weight shard [out/tp, in] and bias shard [out/tp]; the TP group is `ctx.group`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear_sp(x, self.weight, self.bias, ctx=self.ctx, impl=self.impl,
                                         chunks=self.chunks)


class RowParallelLinearSP(RowParallelLinear):
    """Row-parallel linear producing a sequence-parallel output: [s, ..., in/tp] -> [s/tp, ..., out].

    Holds the local weight shard [out, in/tp] and the full bias [out]. The bias is replicated while each rank
    sees only its sequence shard, so (as in Megatron) its gradient must be all-reduced over the TP group; it is
    tagged `sequence_parallel = True` for the optimizer's grad sync.
    """

    def __init__(self, in_features: int, out_features: int, ctx: OverlapContext, bias: bool = True,
                 impl: Optional[str] = None, chunks: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(in_features, out_features, ctx, bias, impl, chunks, dtype, device)
        if self.bias is not None:
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear_sp(x, self.weight, self.bias, ctx=self.ctx, impl=self.impl, chunks=self.chunks)
