"""Data parallelism for a part (DDP or FSDP2), gradient-sync control, and the global gradient norm.

Reduction convention: DDP and FSDP2 both AVERAGE gradients over the DP group. The runtime's loss is a sum of
token losses divided by the GLOBAL label-token count, whose exact gradient is the SUM over DP ranks, so the
runtime scales each rank's loss by the DP size (`dp_loss_scale`) before backward. (Switching the collectives
to SUM instead would need PREMUL_SUM / comm hooks that gloo and torch 2.7 do not all support.) One exception,
measured rather than assumed: FSDP2 reduce-scatters with ReduceOp.AVG, which gloo in torch 2.7.1 silently
sums; `apply_fsdp` measures what FSDP2 yields on its group (torch_compat.fsdp_grad_reduction) and
`dp_loss_scale(group, module)` is 1 where the gradients arrive summed, so they are the same on every release.

Global norm without double counting: every rank computes `grad_sq_sum(module, replicated_over=...)`, its share
of the squared norm; the shares are summed over the whole world (all parts, all stages) once. A parameter that
is replicated on k ranks (DDP, or the encoder's DP group) contributes 1/k of its squared norm on each;
FSDP2 shards (DTensor Shard placements) contribute their local squares as they are, DTensor Replicate
placements are divided by their mesh size.

No host sync: the shares are summed, all-reduced, square-rooted and turned into the clipping coefficient on the
gradients' device (the reduction runs on the group's own backend, NCCL/HCCL on an accelerator), and the
gradients are scaled by a device scalar. The caller reads the norm once, after the optimizer step is queued
(`check_finite_norm`), where the step's metrics need it anyway.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mindspeed_flow import torch_compat
from mindspeed_flow.torch_compat import DTensor, FSDPModule, Replicate, device_mesh_for, fully_shard

# Set on a module by apply_fsdp: FSDP2's measured reduction over its group, "mean" or "sum".
_REDUCTION_ATTR = "_msf_fsdp_reduction"


def _device_type(module: nn.Module) -> str:
    p = next(module.parameters(), None)
    return "cpu" if p is None else p.device.type


def apply_ddp(module: nn.Module, dp_group: Optional[dist.ProcessGroup], *,
              find_unused_parameters: bool = False) -> nn.Module:
    """Wrap in DistributedDataParallel over `dp_group` (device_ids from the module's device, none on CPU).

    Set `find_unused_parameters` for modules with parameters the forward may skip (e.g. CLIP's post_layernorm).
    """
    dev = next(module.parameters()).device
    device_ids = None if dev.type == "cpu" else [dev.index if dev.index is not None else 0]
    return DDP(module, device_ids=device_ids, process_group=dp_group, broadcast_buffers=False,
               find_unused_parameters=find_unused_parameters)


def apply_fsdp(module: nn.Module, dp_group: Optional[dist.ProcessGroup], *,
               layer_containers: Sequence[str] = ("layers", "blocks", "encoder.layers"),
               reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 over `dp_group`: each decoder layer / vision block is its own unit, then the root (embeddings, head).

    Returns the same module object (fully_shard works in place); its parameters become DTensors, so call the
    part only through its forward (e.g. `BackbonePart.forward(packed, image_embeds)`, not `.embed` alone).
    Scale the loss by `dp_loss_scale(dp_group, module)`: FSDP2's reduction is measured here, per group.
    """
    mesh = device_mesh_for(dp_group, _device_type(module))
    p = next(module.parameters(), None)
    # Measured now, while every rank of the group is here (the probe is a collective): see dp_loss_scale.
    reduction = torch_compat.fsdp_grad_reduction(dp_group, p.dtype if p is not None else torch.float32,
                                                 _device_type(module))
    units = list(_blocks(module, layer_containers)) + [module]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
        # on every unit: the caller may hold an inner module (a pipeline stage inside its streaming wrapper)
        setattr(unit, _REDUCTION_ATTR, reduction)
    return module


def _blocks(module: nn.Module, containers: Sequence[str]) -> Iterator[nn.Module]:
    seen: set[int] = set()
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and any(name == c or name.endswith("." + c) for c in containers):
            for block in sub:
                if id(block) not in seen:
                    seen.add(id(block))
                    yield block


@contextlib.contextmanager
def grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Accumulate locally (no DP communication) unless `enabled`: use enabled=False for all but the last
    microbatch of a step. Works for DDP (no_sync) and FSDP2 (set_requires_gradient_sync)."""
    if enabled:
        yield
        return
    if hasattr(module, "no_sync") and not isinstance(module, FSDPModule):
        with module.no_sync():
            yield
        return
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield  # a plain module: nothing to hold back


def dp_loss_scale(dp_group: Optional[dist.ProcessGroup], module: Optional[nn.Module] = None) -> float:
    """Multiply the loss by this before backward so that the DP wrapper's reduction yields the SUM of gradients.

    The DP size for DDP and for FSDP2 that averages; 1 for an `apply_fsdp` module whose gradients arrive summed
    (gloo in torch 2.7.1, see torch_compat). Pass the DP-wrapped module (or the stage module it wraps).
    """
    if not dist.is_initialized():
        return 1.0
    if module is not None:
        reductions = {getattr(m, _REDUCTION_ATTR) for m in module.modules() if hasattr(m, _REDUCTION_ATTR)}
        if len(reductions) > 1:  # pragma: no cover - one apply_fsdp per module tree
            raise RuntimeError(f"FSDP2 units of one module reduce differently: {sorted(reductions)}")
        if reductions == {"sum"}:
            return 1.0
    return float(dist.get_world_size(dp_group))


def allreduce_grads_(params: Iterable[nn.Parameter], dp_group: Optional[dist.ProcessGroup],
                     average: bool = True) -> None:
    """Average (or sum) plain-tensor gradients over `dp_group`, one flattened collective per dtype.

    For parts whose forward/backward pattern does not suit DDP (an encoder that runs several forwards before
    the backbone returns the gradients), call this once after the last backward of the step. A rank without
    a gradient for a parameter (e.g. it encoded no image this step) contributes zeros; a parameter without a
    gradient on EVERY rank keeps `.grad = None`, as under DDP, so AdamW skips it the same way in both modes.
    """
    params = [p for p in params if p.requires_grad]
    if not params or dist.get_world_size(dp_group) == 1:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group_params in by_dtype.values():
        _allreduce_same_dtype(group_params, dp_group, average)


def _allreduce_same_dtype(params: list[nn.Parameter], dp_group: Optional[dist.ProcessGroup], average: bool) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    has_grad = torch.tensor([float(p.grad is not None) for p in params], dtype=params[0].dtype,
                            device=params[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [has_grad])  # the flags ride along in the same collective
    dist.all_reduce(flat, group=dp_group)
    if average:
        flat[:-len(params)].div_(dist.get_world_size(dp_group))
    flags = flat[-len(params):]
    offset = 0
    for p, g, flag in zip(params, grads, flags.tolist()):
        n = g.numel()
        if flag > 0:
            if p.grad is None:
                p.grad = g
            p.grad.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def _replicas_of(grad: torch.Tensor) -> int:
    """How many ranks of the DTensor's mesh hold this same shard (Replicate placements)."""
    k = 1
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Replicate):
            k *= grad.device_mesh.size(dim)
    return k


def grad_sq_sum(module_or_params: nn.Module | Iterable[torch.Tensor], *, replicated_over: int) -> torch.Tensor:
    """This rank's share of the global squared gradient norm (fp32 scalar on the gradients' device).

    `replicated_over`: on how many ranks each plain (non-DTensor) gradient lives identically, e.g. the DP size
    under DDP, 1 for an unreplicated pipeline stage. DTensor (FSDP2) gradients are counted from their
    placements. Sum the shares over the whole world once (e.g. all_reduce SUM) and take the square root.
    """
    if replicated_over < 1:
        raise ValueError(f"replicated_over={replicated_over} must be >= 1")
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    total: Optional[torch.Tensor] = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            share = g.to_local().float().pow(2).sum() / _replicas_of(g)
        else:
            share = g.float().pow(2).sum() / replicated_over
        total = share if total is None else total + share
    if total is None:
        p0 = next(iter(module_or_params.parameters()), None) if isinstance(module_or_params, nn.Module) else None
        total = torch.zeros((), dtype=torch.float32, device=p0.device if p0 is not None else "cpu")
    return total


def global_grad_norm(shares: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup] = None, *,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """sqrt of the shares summed locally and then over `group` (the whole world by default), as a 0-dim fp32
    tensor on the shares' device (`device` when there are none); never synchronises with the host."""
    if shares:
        local = torch.stack([s.detach().float() for s in shares]).sum()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device or "cpu")
    if dist.is_initialized():
        dist.all_reduce(local, group=group)
    return local.sqrt()


def clip_grads_(params: Iterable[nn.Parameter], total_norm: torch.Tensor | float, max_norm: float,
                eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients by min(1, max_norm / (total_norm + eps)) given the GLOBAL norm; returns the factor.

    The same rule as torch.nn.utils.clip_grad_norm_, so decoupled and coupled runs clip identically. With a
    tensor norm everything stays on its device (no branch on the value, so no host sync); a non-finite norm
    yields a non-finite factor, which `check_finite_norm` reports. A float norm is checked here.
    """
    if max_norm <= 0:
        raise ValueError(f"trainer.max_grad_norm={max_norm} must be positive (set it to a large value to disable)")
    if not isinstance(total_norm, torch.Tensor):
        check_finite_norm(total_norm)
    # A DTensor (FSDP2) gradient is scaled through its local shard, which it shares storage with.
    grads = [g.to_local() if isinstance(g, DTensor) else g
             for g in (p.grad.detach() for p in params if p.grad is not None)]
    device = grads[0].device if grads else "cpu"
    norm = torch.as_tensor(total_norm, dtype=torch.float32, device=device)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, coef.to(dtype))
    return coef


def check_finite_norm(total_norm: torch.Tensor | float, *, what: str = "global gradient norm") -> float:
    """The norm as a float (a host sync for a device tensor); raise FloatingPointError if it is not finite."""
    value = float(total_norm)
    if not math.isfinite(value):
        raise FloatingPointError(f"{what} is {value}; refusing to train on a non-finite gradient")
    return value
