"""One optimizer per part, and the step that uses the GLOBAL gradient norm over every part.

MindSpeed's dist-train clips each part by its own norm, which changes the update whenever one part's gradients
are large. Here every rank contributes the squared norm of the gradients it holds, divided by how many ranks
hold the same copy (`hosts.torch.grad_sq_sum`), one all_reduce over all trained ranks sums the shares, and
every part clips with the same coefficient: what single-process training of the whole model does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from mindspeed_flow.hosts.torch.data_parallel import clip_grads_, global_grad_norm, grad_sq_sum


@dataclass
class ParamShare:
    """Parameters of one rank with the number of ranks holding identical copies of their gradients
    (DTensor/FSDP2 gradients are counted from their placements instead)."""

    params: list[torch.nn.Parameter]
    replicas: int = 1


@dataclass
class PartOptimizer:
    shares: list[ParamShare] = field(default_factory=list)
    optimizer: Optional[torch.optim.Optimizer] = None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for s in self.shares for p in s.params]

    def global_norm(self, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """The global norm as a device scalar (no host sync)."""
        return global_grad_norm([grad_sq_sum(s.params, replicated_over=s.replicas) for s in self.shares], group)

    def clip(self, total_norm: torch.Tensor, max_norm: float) -> None:
        if max_norm > 0:
            clip_grads_(self.params, total_norm, max_norm)


def build_optimizer(params: list[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
                    weight_decay: float, eps: float = 1e-8) -> Optional[torch.optim.Optimizer]:
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return None
    # foreach=False: the per-parameter update is then the same arithmetic however parameters are grouped, so the
    # decoupled parts and the coupled baseline take comparable steps.
    return torch.optim.AdamW(trainable, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, foreach=False)


def lr_at(step: int, base_lr: float, warmup_steps: int) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    return base_lr
